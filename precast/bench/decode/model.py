"""The decode harness's model (``precast.bench.decode``): the seeded Llama-shaped decoder of transformers (random
weights), its ExecuTorch export recipe (static KV cache in buffers), the prompt and tokens, and the bytes a decode
step reads.

- ``Shape``, ``QUICK``: the decoder's shape (``--quick``: a small one).
- ``llama``, ``wrapped``, ``export_decoder``, ``decode_inputs``: the model, its export wrapper, the program, the
  prompt and tokens.
- ``read_bytes``: the bytes a decode step reads (every weight but the embedding table, plus the whole static cache).
- The mixed int4/int8 plan the harness runs (llama.cpp's Q4_K_M choice): the weight formats' preset,
  ``precast.quant.presets.q4_k_m_rules``.

Input: a shape. Output: a module, a program, inputs, byte counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 32000
    cache_len: int = 512
    context: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[str, int, int, int]]:
        """(name, N, K, calls per token) of each distinct linear weight shape of a decode step (M = 1)."""
        kv = self.kv_heads * self.head_dim
        per_layer = [
            ("q/o proj", self.hidden, self.hidden, 2),
            ("k/v proj", kv, self.hidden, 2),
            ("gate/up proj", self.intermediate, self.hidden, 2),
            ("down proj", self.hidden, self.intermediate, 1),
        ]
        return [(n, N, K, c * self.layers) for n, N, K, c in per_layer] + [
            ("lm_head", self.vocab, self.hidden, 1)
        ]

    def tag(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self)).encode()).hexdigest()[:10]


QUICK = Shape(
    layers=2, hidden=128, heads=4, kv_heads=2, intermediate=352, vocab=512, cache_len=64, context=32
)


# ---- the model ----------------------------------------------------------------------------------------------
def llama(shape: Shape, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The seeded random Llama-shaped ``LlamaForCausalLM`` (eval), in ``dtype``, set up for a static cache."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max(1024, shape.cache_len),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=shape.cache_len,
        cache_config={"batch_size": 1, "max_cache_len": shape.cache_len},
    )
    return model.to(dtype)


def wrapped(model: torch.nn.Module, shape: Shape) -> torch.nn.Module:
    """transformers' export wrapper (``TorchExportableModuleForDecoderOnlyLM``): the static cache in buffers."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=shape.cache_len)


def export_decoder(model: torch.nn.Module, shape: Shape) -> torch.export.ExportedProgram:
    """The recipe's strict export, with the sequence dimension dynamic (1 .. cache_len - 1)."""
    from torch.export import Dim

    w = wrapped(model, shape)
    seq = Dim("seq", min=1, max=shape.cache_len - 1)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w.export(
            input_ids=ids,
            cache_position=torch.arange(4),
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
        )


def decode_inputs(shape: Shape) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prompt (``context`` tokens) and the decode tokens' ids, seeded."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape.vocab, (1, shape.context), generator=g)
    tokens = [
        torch.randint(0, shape.vocab, (1, 1), generator=g) for _ in range(shape.cache_len - shape.context)
    ]
    return prompt, tokens


def read_bytes(state: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """(bytes held as weights / as cache, bytes one decode step reads) from a state dict of tensors: every weight
    but the embedding table (one row read per token), plus the whole static cache."""
    weights = cache = read = 0
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        n = t.numel() * t.element_size()
        if "cache" in name and ("key" in name or "value" in name or "keys" in name or "values" in name):
            cache += n
            read += n
        elif "cumulative_length" in name or "inv_freq" in name:
            continue
        else:
            weights += n
            read += n // t.shape[0] if "embed_tokens" in name else n
    return {"weights": weights, "cache": cache}, read
