"""Named weight-format presets: a recipe of formats per weight, written once, as llama.cpp names its own.

- ``q4_k_m_rules(layers)``: llama.cpp's Q4_K_M choice of the tensors stored in more bits (``use_more_bits`` in
  llama-quant.cpp), in precast's formats: int8 for the output head and for ``v_proj`` / ``down_proj`` of the
  layers ``q4_k_m_more_bits`` names, int4 (group 64) for every other weight. Patterns over a Llama-shaped
  decoder's names (the checkpoint's or the LLM recipe's program's: ``precast.quant.rules`` matches both).

Input: a decoder's layer count. Output: ``weight_format=`` rules (pattern -> format name), first match first.
"""

from __future__ import annotations


def q4_k_m_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M choice (``use_more_bits`` in llama-quant.cpp) of the layers whose ``attn_v`` and
    ``ffn_down`` get more bits: ``i < n/8``, ``i >= 7n/8``, or ``(i - n/8) % 3 == 2``."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_rules(layers: int) -> dict[str, str]:
    """Q4_K_M's layer rule in precast's formats, as ``weight_format=`` rules for a Llama-shaped decoder of
    ``layers`` layers (the module docstring)."""
    rules = {"*lm_head.weight": "int8"}
    for i in range(layers):
        if q4_k_m_more_bits(i, layers):
            rules[f"*layers.{i}.self_attn.v_proj.weight"] = "int8"
            rules[f"*layers.{i}.mlp.down_proj.weight"] = "int8"
    return {**rules, "*": "int4"}
