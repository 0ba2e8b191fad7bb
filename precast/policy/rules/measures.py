"""What the rules measure on an op: reduction depth (how many values an output sums), scalars beyond the low
dtype's range; the per-op value statistics calibration collects (``NodeStats``, ``Calibration``) are in
``precast.policy.measurements`` (measured by ``precast.numerics.calibration.stage``).

Input: an op node with its (fake) arguments, or observed tensors. Output: numbers a rule compares with a limit.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from precast.ir.graph import tensor_args
from precast.ir.op_families import CONV_OPS
from precast.policy.rules.taxonomy import MATMUL_INNER, NORM_OPS, REDUCE_DIM_OPS, op_name


def _dims(dim: Any, ndim: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [d % ndim if ndim else 0 for d in dims]


def _arg(node: torch.fx.Node, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return kwargs.get(name, default)


def reduction_depth(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[int, str] | None:
    """(accumulation depth, what it is) from shapes alone, for ops that accumulate; None for others."""
    name = op_name(node.target)
    tensors = [t for _, t in tensor_args(args, kwargs)]
    if not tensors:
        return None

    def size(x) -> int:
        return int(x) if not isinstance(x, torch.SymInt) else int(x.node.hint or 0)

    if name in MATMUL_INNER:
        which, pos = MATMUL_INNER[name]
        if pos >= len(tensors):
            return None
        t = tensors[pos]
        inner = t.shape[-1] if t.dim() else 1
        return size(inner), "inner dimension"
    if name in CONV_OPS:
        if len(tensors) < 2:
            return None
        w = tensors[1]
        transposed = "transpose" in name or (name in ("convolution", "_convolution") and bool(args[6]))
        groups = _arg(node, args, kwargs, "groups", 1) or 1
        k = math.prod(size(s) for s in w.shape[2:])
        chans = size(w.shape[0]) // groups if transposed else size(w.shape[1])
        return chans * k, f"{'in_channels/groups' if transposed else 'in_channels/groups'} x kernel"
    if name in ("scaled_dot_product_attention",) or name.startswith("_scaled_dot_product"):
        q, k = tensors[0], tensors[1]
        head, keys = size(q.shape[-1]), size(k.shape[-2])
        return (head, "head dim") if head >= keys else (keys, "key length")
    if name in REDUCE_DIM_OPS:
        t = tensors[0]
        dim = _arg(node, args, kwargs, "dim")
        if name in (
            "softmax",
            "log_softmax",
            "_softmax",
            "_log_softmax",
            "cumsum",
            "cumprod",
            "logcumsumexp",
        ):
            dim = [dim]
        if t.dim() == 0:
            return 1, "elements"
        return math.prod(size(t.shape[d]) for d in _dims(dim, t.dim())), "reduced elements"
    if name in NORM_OPS:
        shape = _arg(node, args, kwargs, "normalized_shape") or []
        return math.prod(size(s) for s in shape), "normalized elements"
    if name in ("group_norm", "native_group_norm"):
        t = tensors[0]
        groups = _arg(node, args, kwargs, "num_groups", None) or _arg(node, args, kwargs, "group", 1)
        return size(t.numel()) // max(1, size(t.shape[0]) * groups), "elements per group"
    return None


def scalar_beyond(
    node: torch.fx.Node, args: tuple, kwargs: dict, low: torch.dtype
) -> tuple[str, float] | None:
    """A finite Scalar argument the low dtype cannot hold (``masked_fill(mask, finfo(float32).min)``, baked in
    by an fp32 export): in low precision the op raises "cannot be converted ... without overflow"."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    limit = torch.finfo(low).max
    for i, arg in enumerate(schema.arguments):
        if str(arg.type) not in ("number", "Scalar"):
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and abs(value) > limit
        ):
            return arg.name, value
    return None


__all__ = [
    "reduction_depth",
    "scalar_beyond",
]
