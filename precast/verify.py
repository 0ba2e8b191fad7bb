"""Verify: re-check the rewritten graph with fake tensors, and compare outputs against the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from precast.classify import fake_mode_of
from precast.errors import PrecastError, where
from precast.program import Program


def refresh_vals(program: Program) -> None:
    """Recompute every node's fake value (dtype metadata) after rewriting; a failure names the node."""
    mode = fake_mode_of(program)
    vals = [n.meta["val"] for n in program.graph.nodes if n.op == "placeholder"]
    prop = _TrackingProp(program.gm, mode)
    try:
        prop.propagate_dont_convert_inputs(*vals)
    except Exception as exc:
        loc = where(prop.current) if prop.current is not None else "the converted graph"
        raise PrecastError(
            f"{loc}: the converted program fails shape/dtype checks: {str(exc).splitlines()[0]}"
        ) from exc


class _TrackingProp(FakeTensorProp):
    """FakeTensorProp that remembers the node it is running, so a failure can name it."""

    current: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node):
        self.current = n
        return super().run_node(n)


def error_metrics(actual: Any, expected: Any) -> list[dict]:
    """Per output tensor: dtype match, bitwise equality, max abs error, cosine similarity."""
    out = []
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        if not isinstance(a, torch.Tensor):
            out.append({"bitwise": a == e, "dtype_match": True, "max_abs": 0.0, "cosine": 1.0})
            continue
        same_dtype = a.dtype == e.dtype
        bitwise = same_dtype and a.shape == e.shape and bool(torch.equal(a, e) or _nan_equal(a, e))
        af, ef = a.detach().double().flatten(), e.detach().double().flatten()
        finite = torch.isfinite(af).all().item() and torch.isfinite(ef).all().item()
        max_abs = (
            (af - ef).abs().max().item() if af.numel() and finite else (0.0 if bitwise else float("inf"))
        )
        cos = (
            torch.nn.functional.cosine_similarity(af, ef, dim=0).item()
            if af.numel() and finite
            else float("nan")
        )
        out.append(
            {
                "dtype": str(a.dtype).removeprefix("torch."),
                "reference_dtype": str(e.dtype).removeprefix("torch."),
                "dtype_match": same_dtype,
                "bitwise": bitwise,
                "max_abs": max_abs,
                "cosine": cos,
                "finite": bool(finite),
            }
        )
    return out


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_floating_point()
        and bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))
        and bool(torch.equal(torch.isnan(a), torch.isnan(b)))
    )


def compare(
    converted: Callable, reference: Callable, args: tuple, kwargs: dict, *, reference_name: str
) -> dict:
    with torch.no_grad():
        got = converted(*args, **kwargs)
        want = reference(*args, **kwargs)
    metrics = error_metrics(got, want)
    bitwise = all(m["bitwise"] for m in metrics)
    worst = max((m["max_abs"] for m in metrics), default=0.0)
    verdict = "bitwise equal" if bitwise else f"max abs error {worst:.3g}"
    return {
        "reference": reference_name,
        "bitwise": bitwise,
        "max_abs": worst,
        "outputs": metrics,
        "verdict": verdict,
    }
