"""AWQ's activation-aware scaling, folded into the float model, to measure whether it pays under precast's fitted int4
(``benchmarks/llm_weights.py --awq``; issue 50 item 1: "measure which pay on real text and keep those").

For a Llama-architecture ``transformers`` model (SmolLM2): each group of linears that reads one activation gets a
per-input-channel scale ``s``, the linears' input columns multiplied by ``s`` and the op before divided by it, so the
float function is unchanged (up to fp32 rounding, printed). The groups where that fold is exact:

- ``input_layernorm`` -> ``q_proj``, ``k_proj``, ``v_proj`` (the RMSNorm weight divided by ``s``);
- ``post_attention_layernorm`` -> ``gate_proj``, ``up_proj``;
- ``v_proj`` -> ``o_proj`` (the value rows divided by ``s``; each kv head's scale shared by the query heads reading
  it: the mean of their statistics);
- ``up_proj`` -> ``down_proj`` (``silu(gate) * up`` is linear in ``up``).

The final norm -> the tied head is left alone (scaling the head's columns would scale the embedding's).

The scale is AWQ's search: ``s = mean|x| ** alpha`` (normalised to a geometric mean of 1), ``alpha`` on a grid in
[0, 1], the one whose round-to-nearest int4 (``group`` columns, asymmetric, as precast's ``int4-g64`` stores it)
gives the least output error ``|x (Q(W s) / s - W)^T|^2`` on the calibration rows; ``alpha = 0`` is no scaling, so a
group is never made worse by the search's own measure.

``pow2``: each scale rounded to a power of two, so the fold is exact (bitwise the same float function: a product
by a power of two rounds as the unscaled one does, barring under/overflow) at the search's other alphas' cost.

Input: the model (changed in place: pass a copy), calibration batches (``input_ids``). Output: per-group alphas.
"""

from __future__ import annotations

import torch

GRID = 20


def _rtn_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """``w`` [N, K] rounded to nearest on int4 asymmetric groups of ``group`` columns, dequantized."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale).round() + zero).clamp(0, 15)
    return ((q - zero) * scale).reshape(n, k)


def _pow2(s: torch.Tensor, pow2: bool) -> torch.Tensor:
    """``s`` rounded to the nearest power of two (``pow2``): a fold by it is exact in every float format."""
    return torch.exp2(torch.log2(s).round()) if pow2 else s


def search_scale(
    x: torch.Tensor, weights: list[torch.Tensor], group: int, pow2: bool = False
) -> tuple[torch.Tensor, float, float]:
    """``(s, alpha, error ratio)``: AWQ's per-input-channel scale for linears of ``weights`` reading rows ``x``."""
    w = torch.cat(weights, 0).float()
    x = x.float()
    ref = x @ w.T
    mean = x.abs().mean(0).clamp(min=1e-6)
    best = (None, 0.0, float("inf"))
    base = None
    for i in range(GRID + 1):
        alpha = i / GRID
        s = mean.pow(alpha)
        s = _pow2(s / (s.max() * s.min()).sqrt(), pow2)
        q = _rtn_int4(w * s, group) / s
        err = float(((x @ q.T) - ref).pow(2).sum())
        if i == 0:
            base = err
        if err < best[2]:
            best = (s, alpha, err)
    return best[0].float(), best[1], best[2] / base


@torch.no_grad()
def fold_awq(
    model: torch.nn.Module, batches: list[torch.Tensor], group: int = 64, rows: int = 1024, pow2: bool = False
) -> dict:
    """Scale ``model`` (a transformers Llama, in place) by AWQ's search on ``batches`` (token id tensors)."""
    layers = model.model.layers
    cfg = model.config
    taps = _tap_inputs(model, batches)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    head = cfg.hidden_size // cfg.num_attention_heads
    out: dict[str, dict[str, float]] = {}
    for i, layer in enumerate(layers):
        x = {k.split(".", 1)[1]: v[:rows] for k, v in taps.items() if k.startswith(f"{i}.")}
        att, mlp = layer.self_attn, layer.mlp
        # norm -> q, k, v
        s, a, r = search_scale(
            x["qkv"], [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], group, pow2
        )
        layer.input_layernorm.weight.div_(s)
        for lin in (att.q_proj, att.k_proj, att.v_proj):
            lin.weight.mul_(s)
        out[f"{i}.qkv"] = {"alpha": a, "error": r}
        # norm -> gate, up
        s, a, r = search_scale(x["gate_up"], [mlp.gate_proj.weight, mlp.up_proj.weight], group, pow2)
        layer.post_attention_layernorm.weight.div_(s)
        for lin in (mlp.gate_proj, mlp.up_proj):
            lin.weight.mul_(s)
        out[f"{i}.gate_up"] = {"alpha": a, "error": r}
        # v -> o: one scale per kv channel, the query heads sharing it averaged
        s_kv, a, r = _searched_kv(x["o"], att.o_proj.weight, cfg, group, pow2)
        s_full = s_kv.reshape(cfg.num_key_value_heads, 1, head).expand(-1, groups, -1).reshape(-1)
        att.v_proj.weight.div_(s_kv[:, None])
        if att.v_proj.bias is not None:
            att.v_proj.bias.div_(s_kv)
        att.o_proj.weight.mul_(s_full)
        out[f"{i}.o"] = {"alpha": a, "error": r}
        # up -> down
        s, a, r = search_scale(x["down"], [mlp.down_proj.weight], group, pow2)
        mlp.up_proj.weight.div_(s[:, None])
        mlp.down_proj.weight.mul_(s)
        out[f"{i}.down"] = {"alpha": a, "error": r}
    return out


def _tap_inputs(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's inputs to its four linear groups on ``batches`` (rows, fp32), keyed ``"<layer>.<group>"``."""
    taps: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name, mod in (
            ("qkv", layer.self_attn.q_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_proj),
            ("down", layer.mlp.down_proj),
        ):

            def hook(_m, args, key=f"{i}.{name}"):
                taps.setdefault(key, []).append(args[0].reshape(-1, args[0].shape[-1]).float())

            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in taps.items()}


def _searched_kv(
    x: torch.Tensor, w: torch.Tensor, cfg, group: int, pow2: bool = False
) -> tuple[torch.Tensor, float, float]:
    """The v -> o scale ``(s, alpha, error ratio)``: AWQ's search with ``s`` per kv channel (the mean |x| of the
    query heads sharing it), applied to ``o_proj``'s columns of every head of the group."""
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    head = cfg.hidden_size // cfg.num_attention_heads
    kvh = cfg.num_key_value_heads
    xd, wd = x.float(), w.float()
    ref = xd @ wd.T
    mean = x.abs().reshape(x.shape[0], kvh, groups, head).mean((0, 2)).reshape(-1).clamp(min=1e-6)
    best, base = (torch.ones_like(mean), 0.0, float("inf")), None
    for i in range(GRID + 1):
        s = mean.pow(i / GRID)
        s = _pow2(s / (s.max() * s.min()).sqrt(), pow2)
        full = s.reshape(kvh, 1, head).expand(-1, groups, -1).reshape(-1)
        q = _rtn_int4(wd * full, group) / full
        err = float(((xd @ q.T) - ref).pow(2).sum())
        base = err if i == 0 else base
        if err < best[2]:
            best = (s, i / GRID, err)
    return best[0].float(), best[1], best[2] / base
