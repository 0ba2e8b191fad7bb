"""Error metrics: the one place that measures how far outputs are from a reference.

Input: two pytrees of outputs (converted, reference). Output: per-tensor rows (``compare_outputs``), a running
worst case over batches (``WorstError``, what the tolerance search and ``tolerance=`` targets read), or a
single (max abs, cosine) pair (``flat_error``, the benchmark's column). Verification, ``precast check``, the
tolerance search and ``precast bench`` all measure here.

Cosine has no epsilon floor: outputs around 1e-9 (``F.cosine_similarity`` clamps norms to 1e-8) must still
measure their direction; two all-zero vectors are similar (1.0), zero against non-zero is not (0.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from precast.dtypes import long_name
from precast.errors import PrecastError


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors seen as flat float64 vectors (see the module docstring)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return (a @ b).item() / (na * nb)


def row_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Lowest cosine similarity over the rows (last dimension) of two tensors of one shape; 1.0 for rows
    that are zero in both."""
    a, b = a.detach().double(), b.detach().double()
    rows_a = a.reshape(-1, a.shape[-1]) if a.dim() >= 1 else a.reshape(1, 1)
    rows_b = b.reshape(-1, b.shape[-1]) if b.dim() >= 1 else b.reshape(1, 1)
    if rows_a.numel() == 0:
        return 1.0
    cos = torch.nn.functional.cosine_similarity(rows_a, rows_b, dim=-1, eps=1e-30)
    both_zero = (rows_a.norm(dim=-1) == 0) & (rows_b.norm(dim=-1) == 0)
    return torch.where(both_zero, torch.ones_like(cos), cos).min().item()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN where the other has NaN counts as equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    return (
        a.is_floating_point()
        and bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))
        and bool(torch.equal(torch.isnan(a), torch.isnan(b)))
    )


def tensor_metrics(a: torch.Tensor, e: torch.Tensor) -> dict:
    """One output against its reference: dtypes, bitwise, max abs / max relative error, cosine, finiteness."""
    af, ef = a.detach().double().flatten(), e.detach().double().flatten()
    bitwise = bitwise_equal(a, e)
    finite = bool(torch.isfinite(af).all().item() and torch.isfinite(ef).all().item())
    same_shape = a.shape == e.shape
    if af.numel() and finite and same_shape:
        diff = (af - ef).abs()
        max_abs = diff.max().item()
        max_rel = (diff / ef.abs().clamp_min(1e-12)).max().item()
        cos = cosine(af, ef)
    else:
        max_abs = max_rel = 0.0 if bitwise or not af.numel() else math.inf
        cos = 1.0 if bitwise or not af.numel() else math.nan
    return {
        "dtype": long_name(a.dtype),
        "reference_dtype": long_name(e.dtype),
        "dtype_match": a.dtype == e.dtype,
        "shape": list(a.shape),
        "bitwise": bitwise,
        "max_abs": max_abs,
        "max_rel": max_rel,
        "cosine": cos,
        "finite": finite,
    }


def compare_outputs(actual: Any, expected: Any) -> list[dict]:
    """``tensor_metrics`` per output leaf (non-tensor leaves: equal or not)."""
    rows = []
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            rows.append(tensor_metrics(a, e))
        else:
            same = bool(a == e)
            rows.append(
                {
                    "dtype": type(a).__name__,
                    "dtype_match": True,
                    "bitwise": same,
                    "max_abs": 0.0,
                    "max_rel": 0.0,
                    "cosine": 1.0,
                    "finite": True,
                }
            )
    return rows


class WorstError:
    """Running worst case over batches and floating outputs: ``max_abs``, ``rel`` (norm of the difference over
    the norm of the reference) and ``cosine`` (lowest row cosine). A non-finite or misshapen output is the
    worst possible (inf, inf, -1)."""

    def __init__(self) -> None:
        self.m = {"max_abs": 0.0, "rel": 0.0, "cosine": 1.0}

    def update(self, got: Sequence[Any], want: Sequence[Any]) -> None:
        for a, e in zip(got, want, strict=True):
            if not isinstance(e, torch.Tensor) or not e.is_floating_point():
                continue
            a, e = a.detach().double(), e.detach().double()
            if not torch.isfinite(a).all() or a.shape != e.shape:
                self.m = {"max_abs": math.inf, "rel": math.inf, "cosine": -1.0}
                return
            if e.numel() == 0:
                continue
            diff = a - e
            self.m["max_abs"] = max(self.m["max_abs"], diff.abs().max().item())
            ref = e.norm().item()
            self.m["rel"] = max(
                self.m["rel"], diff.norm().item() / ref if ref else (0.0 if not diff.any() else math.inf)
            )
            self.m["cosine"] = min(self.m["cosine"], row_cosine(a, e))


def flat_error(out: Any, ref: Any) -> tuple[float, float]:
    """(max abs error, cosine) of all floating outputs concatenated: one number pair per model."""
    a, b = _flat(out), _flat(ref)
    if a.shape != b.shape:
        raise PrecastError(f"output has {a.numel()} values, the reference {b.numel()}")
    return ((a - b).abs().max().item() if a.numel() else 0.0), (cosine(a, b) if a.numel() else 1.0)


def _flat(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().double().flatten().cpu() for t in leaves])


def next_token_metrics(
    logits: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor | None = None
) -> dict:
    """How far a language model's next-token distributions are from the reference's, the metrics users judge an
    LLM by: ``kld`` (mean KL(reference || logits) per position, nats), ``top1`` (share of positions whose argmax
    agrees), and with ``labels`` (the next token at each position; -100: none) ``ppl`` and ``reference_ppl``
    (perplexity of the labels under each). ``logits``/``reference``: [..., vocab], any float dtype (computed in
    float64)."""
    vocab = reference.shape[-1]
    got = torch.log_softmax(logits.detach().reshape(-1, vocab).double(), -1)
    ref = torch.log_softmax(reference.detach().reshape(-1, vocab).double(), -1)
    out = {
        "positions": int(ref.shape[0]),
        "kld": float((ref.exp() * (ref - got)).sum(-1).mean()),
        "top1": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
    }
    if labels is not None:
        flat = labels.reshape(-1)
        keep = flat != -100
        if keep.any():
            idx = flat[keep].unsqueeze(1)
            out["ppl"] = math.exp(float(-got[keep].gather(1, idx).mean()))
            out["reference_ppl"] = math.exp(float(-ref[keep].gather(1, idx).mean()))
    return out
