"""Data-aware int4 rounding: the same stored parts as ``Int4.quantize`` (packed nibbles, one uint8 zero point and
one scale in the compute dtype per group), with the values chosen against the layer's output error on data.

``Int4.quantize`` (round-to-nearest, RTN) takes each group's step from its range, ``s = (max - min) / 15``. A
linear's output error is ``(W - Q) x``; on inputs ``x`` with second moment ``H = E[x x^T]`` its mean square is
``tr((W - Q) H (W - Q)^T)``. Two roundings here reduce it, each returning parts that ``dequantize`` reads unchanged
(the engines' compressed paths read them as they read RTN's):

- ``search_int4(weight, importance, fmt, scale_dtype)``: per group, a search over the step and zero point that
  minimises ``sum_j imp_j (w_j - deq_j)^2`` with ``imp = diag(H)`` (llama.cpp's importance matrix, NNCF's scale
  estimation). Candidates: the range shrunk by each factor in ``SHRINKS`` (1.0 first: RTN's own parts are a
  candidate, so the search is never worse than RTN on its objective), each followed by one importance-weighted
  least-squares refit of (step, offset) given its integers; the step is rounded to the stored dtype and the integers
  recomputed against it before any candidate is scored, so the score is the stored value's.
- ``gptq_int4(weight, hessian, fmt, scale_dtype)``: GPTQ (Frantar et al. 2022): columns quantized in order, each
  column's rounding error spread over the columns not yet quantized through the inverse Hessian's Cholesky factor
  (damping ``damp`` x mean diagonal), each group's step and zero point fitted (by ``search_int4``) when its first
  column is reached, on the columns as updated so far. Static order (no act-order: the group's parameters would
  then depend on a permutation the stored layout cannot express).

- ``awq_scales(importance, alpha)`` / ``fold_scales(norm_weight, weights, scales)``: AWQ's per-input-channel
  scales, rounded to powers of two so that dividing the preceding norm's weight and multiplying the next linears'
  input columns by them is exact (the folded float program computes the unscaled one's values bitwise); the scaled
  weight is then rounded against the scaled statistics (``H / (s s^T)``).

Measured on SmolLM2-135M and all-MiniLM-L6-v2: docs/weight_formats.md "Data-aware int4" (the source
checkout's int4 rounding benchmark). A part fitted to data is not recomputable from the fp32 weight alone: its
``derive`` tag says so (``derive_tag(..., data_aware=True)``, ``precast.quant.formats``).

Input: an fp32 weight [out, in], its input statistics (``importance`` [in] or ``hessian`` [in, in]). Output: the
stored parts, by role, in ``Int4``'s layout. Deterministic: the same inputs give the same bytes.
"""

from __future__ import annotations

import torch

from precast.errors import PrecastError
from precast.quant.formats import Int4, fits, scale_of

GPTQ = "gptq+search"  # how a weight fitted here was rounded (the report's ``rounding``)
SEARCH = "search"  # each group's step and zero point searched against the importance alone (no GPTQ update)
RTN = "rtn"  # round-to-nearest: ``Int4.quantize``'s, the data-free default
# range shrink factors tried per group (1.0 first: RTN's candidate)
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
_LEVELS = 15


def _check(weight: torch.Tensor, stats: torch.Tensor, fmt: Int4, what: str) -> None:
    if not isinstance(fmt, Int4):
        raise PrecastError(f"data-aware rounding is for int4 formats; got {fmt!r}")
    why = fits(fmt, tuple(weight.shape))
    if why:
        raise PrecastError(f"data-aware int4 of a weight {tuple(weight.shape)}: {why}")
    k = weight.shape[1]
    want = (k,) if what == "importance" else (k, k)
    if tuple(stats.shape) != want:
        raise PrecastError(
            f"data-aware int4: {what} of shape {tuple(stats.shape)} for a weight {tuple(weight.shape)}; "
            f"give {what} of shape {want} (the statistics of the weight's input channels)"
        )


def _score(
    groups: torch.Tensor, imp: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers, weighted squared error per group) of groups [n, G, g] at the stored ``scale`` and ``zero``."""
    step = scale.to(torch.float32)
    q = torch.clamp(torch.round(groups / step) + zero, 0, _LEVELS)
    err = (imp * (groups - (q - zero) * step) ** 2).sum(-1, keepdim=True)
    return q, err


def _from_range(low: torch.Tensor, high: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """RTN's (scale, zero) for a range containing zero (``Int4.quantize``'s arithmetic)."""
    scale = scale_of(high - low, _LEVELS, scale_dtype)
    zero = torch.clamp(torch.round(-low / scale.to(torch.float32)), 0, _LEVELS)
    return scale, zero


def _refit(
    groups: torch.Tensor, imp: torch.Tensor, q: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (step, offset) minimising ``sum imp (w - (q * s + m))^2`` for fixed integers ``q``, as a stored
    (scale, integer zero ``round(-m / s)``); a degenerate group (one level) keeps a unit step."""
    sw, sq, sqq = (
        imp.sum(-1, keepdim=True),
        (imp * q).sum(-1, keepdim=True),
        (imp * q * q).sum(-1, keepdim=True),
    )
    sx, sqx = (imp * groups).sum(-1, keepdim=True), (imp * q * groups).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * sw * sqq
    step = torch.where(ok, (sw * sqx - sq * sx) / torch.where(ok, det, 1.0), 0.0)
    offset = torch.where(ok, (sqq * sx - sq * sqx) / torch.where(ok, det, 1.0), 0.0)
    scale = step.abs().to(scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.clamp(torch.round(-offset / scale.to(torch.float32)), 0, _LEVELS)
    return scale, zero


def _search_groups(
    groups: torch.Tensor, imp: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best stored (scale, zero) per group of groups [n, G, g] under importance imp [1|n, G, g]."""
    low0 = groups.amin(-1, keepdim=True).clamp(max=0)
    high0 = groups.amax(-1, keepdim=True).clamp(min=0)
    best_scale, best_zero = _from_range(low0, high0, scale_dtype)
    q, best = _score(groups, imp, best_scale, best_zero)
    for i, shrink in enumerate(SHRINKS):
        cands = [] if i == 0 else [_from_range(low0 * shrink, high0 * shrink, scale_dtype)]
        if i == 0:
            cands.append(_refit(groups, imp, q, scale_dtype))
        else:
            q_c, _ = _score(groups, imp, *cands[0])
            cands.append(_refit(groups, imp, q_c, scale_dtype))
        for scale, zero in cands:
            _, err = _score(groups, imp, scale, zero)
            better = err < best
            best = torch.where(better, err, best)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """Integers q [out, in] (0..15) with scale/zero [out, in/g, 1] -> ``Int4``'s stored parts, by role."""
    n, k = q.shape
    pairs = q.to(torch.uint8).reshape(n, k // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return {"q": packed.contiguous(), "scale": scale.contiguous(), "zero": zero.to(torch.uint8).contiguous()}


def search_int4(
    weight: torch.Tensor, importance: torch.Tensor, fmt: Int4, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] in ``fmt`` with each group's step and zero point searched against the input channels'
    ``importance`` [in] (``E[x_j^2]``): the stored parts, by role (``Int4.quantize``'s layout and dtypes)."""
    _check(weight, importance, fmt, "importance")
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    g = fmt.group
    groups = w.reshape(n, k // g, g)
    imp = _importance(importance).reshape(1, k // g, g)
    scale, zero = _search_groups(groups, imp, scale_dtype)
    q, _ = _score(groups, imp, scale, zero)
    return pack_int4(q.reshape(n, k), scale, zero)


def _importance(importance: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 importance with a floor (1e-6 of the mean) so an unseen channel still counts a little."""
    imp = importance.detach().to(torch.float32).clamp(min=0)
    mean = imp.mean()
    return imp + (1e-6 * mean if mean > 0 else 1.0)


def _inverse_factor(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the damped H^-1, the channels never seen); fp64 for the factorisations."""
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean = torch.diagonal(h).mean()
    h += torch.eye(h.shape[0], dtype=h.dtype) * (damp * mean)
    factor = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32), dead


def gptq_int4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: Int4,
    scale_dtype: torch.dtype,
    *,
    damp: float = 0.01,
    block: int = 128,
    search: bool = True,
) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] in ``fmt`` by GPTQ on ``hessian`` [in, in] (``sum x x^T`` over the calibration
    inputs; any positive multiple gives the same result): the stored parts, by role (``Int4.quantize``'s layout).
    ``search``: each group's step and zero point by ``search_int4``'s search (else RTN's, from the group's range
    as updated so far)."""
    _check(weight, hessian, fmt, "hessian")
    g = fmt.group
    block = max(g, block - block % g)
    w = weight.detach().to(torch.float32).clone()
    factor, dead = _inverse_factor(hessian, damp)
    w[:, dead] = 0
    imp = _importance(torch.diagonal(hessian)) if search else None
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.uint8)  # 0..15: a byte each (a 49152 x 576 table: 28 MB, not 113)
    scales = torch.zeros(n, k // g, 1, dtype=scale_dtype)
    zeros = torch.zeros(n, k // g, 1)
    for start in range(0, k, block):
        end = min(start + block, k)
        errors = _gptq_block(w, factor, imp, (start, end, g), scale_dtype, (q, scales, zeros))
        w[:, end:] -= errors @ factor[start:end, end:]
    return pack_int4(q, scales, zeros)


def _gptq_block(
    w: torch.Tensor,
    factor: torch.Tensor,
    imp: torch.Tensor | None,
    span: tuple[int, int, int],
    scale_dtype: torch.dtype,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Quantize columns [start, end) of ``w`` in place (GPTQ's inner loop), writing integers, scales and zeros
    into ``out``; the scaled errors [n, end - start] the columns after ``end`` are updated with."""
    start, end, g = span
    q_out, scales, zeros = out
    sub = w[:, start:end].clone()
    inv = factor[start:end, start:end]
    errors = torch.zeros_like(sub)
    for i in range(end - start):
        col = start + i
        if col % g == 0:
            group = sub[:, i : i + g].reshape(-1, 1, g)
            if imp is None:
                low, high = (
                    group.amin(-1, keepdim=True).clamp(max=0),
                    group.amax(-1, keepdim=True).clamp(min=0),
                )
                scale, zero = _from_range(low, high, scale_dtype)
            else:
                scale, zero = _search_groups(group, imp[col : col + g].reshape(1, 1, g), scale_dtype)
            scales[:, col // g] = scale[:, 0]
            zeros[:, col // g] = zero[:, 0]
        step = scales[:, col // g, 0].to(torch.float32)
        zero = zeros[:, col // g, 0]
        x = sub[:, i]
        qi = torch.clamp(torch.round(x / step) + zero, 0, _LEVELS)
        q_out[:, col] = qi
        err = (x - (qi - zero) * step) / inv[i, i]
        sub[:, i:] -= err[:, None] * inv[i, i:][None, :]
        errors[:, i] = err
    w[:, start:end] = sub
    return errors


def awq_scales(importance: torch.Tensor, alpha: float) -> torch.Tensor:
    """AWQ's per-input-channel scales ``s_j = (sqrt(imp_j) / geometric mean)^alpha`` rounded to powers of two
    (fp32, [in]): the fold into the preceding op (``fold_scales``) then multiplies and divides by exact powers of
    two, so the folded float program computes the unscaled one's values bitwise (no subnormal / overflow: the
    exponents are clamped to +-16)."""
    rms = _importance(importance).sqrt()
    rel = rms / torch.exp(torch.log(rms).mean())
    return torch.exp2(torch.round(torch.log2(rel) * alpha).clamp(-16, 16))


def fold_scales(
    norm_weight: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The preceding norm's weight divided by ``scales`` and each following linear's weight [out, in] multiplied
    by them along its input: ``norm(x) * (w / s) @ (W * s)^T`` is ``norm(x) * w @ W^T`` exactly (powers of two)."""
    if not bool(((torch.log2(scales) % 1) == 0).all()):
        raise PrecastError("fold_scales: the scales must be powers of two (awq_scales) for an exact fold")
    return norm_weight / scales, [w * scales for w in weights]
