"""Writes across dtypes: a value written into a tensor arrives in that tensor's dtype.

A KV cache is a buffer written in place (``index_copy_`` in transformers' ``StaticLayer.update``); the
scatter family of ops requires the value and the destination to have one dtype. When a policy changes the
dtype of a value that such an op writes (the value projection comes out bf16, the cache is fp32), or when the
destination itself is stored in another dtype (``cache_dtype=``), the value is cast to the destination's dtype at
the write: what ``copy_`` does by itself, and what transformers 4.x's static cache did. The destination is never
cast: an in-place write to a cast copy would be lost.

Only mismatches precast made are mended: where the program as exported already wrote one dtype into another
(and so fails at run time), the existing dtype checks report it. Ops of the autocast region policy torch opened
around a module's forward while capturing it (``POLICY_OP_META``) are the policy's: a mismatch recorded there is
precast's making, mended like the others.

Input: an op node, its (fake) arguments as classify sees them, the decision taken for it. Output: the decision
with the written values' casts, and ``WriteCast`` records for the report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from precast.dtypes import dtype_name
from precast.ir.graph import ArgPath, tensor_args
from precast.ir.regions import POLICY_OP_META
from precast.policy.base import Decision

# ops that write a value argument into (a copy of) their first argument and require the two to share a dtype
# (measured on torch 2.13: each raises "... expected to have the same dtype" otherwise); slice_scatter,
# select_scatter and copy_ cast by themselves
SAME_DTYPE_WRITES = frozenset(
    f"aten::{name}"
    for base in (
        "index_copy",
        "index_put",
        "masked_scatter",
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_add",
        "put",
    )
    for name in (base, base + "_")
) | {"aten::_index_put_impl_", "aten::_index_put_impl"}
# the schema names of the written value, by op family
VALUE_ARGS = ("source", "src", "values", "value")

# node.meta key where classify records a write cast for the report
WRITE_CAST_META = "precast_write_cast"


@dataclass(frozen=True)
class WriteCast:
    """The value ``value`` written by ``node`` into ``destination`` was cast from ``was`` to ``dtype``."""

    destination: str
    value: str
    was: torch.dtype
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"the value {self.value} written into {self.destination} arrives {dtype_name(self.was)}: cast to "
            f"{dtype_name(self.dtype)}, the destination's dtype, at the write"
        )


def cast_written_values(
    node: torch.fx.Node,
    args: tuple,
    kwargs: dict,
    decision: Decision | None,
    stored: dict[torch.fx.Node, torch.dtype],
) -> tuple[Decision | None, WriteCast | None]:
    """``decision`` with the value an op of ``SAME_DTYPE_WRITES`` writes cast to its destination's dtype, when
    precast made them differ. ``stored``: placeholders whose dtype the conversion changed (a cache stored in a
    low dtype) -> the dtype the program gave them; their writes compare against that."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name not in SAME_DTYPE_WRITES:
        return decision, None
    found = tensor_args(args, kwargs)
    if not found or found[0][0] != ("args", 0):
        return decision, None
    names = [a.name for a in op._schema.arguments]
    casts = dict(decision.casts) if decision is not None else {}
    casts.pop(("args", 0), None)  # never a copy of the destination: the write must reach its storage
    dest_path, dest = found[0]
    dest_dtype = dest.dtype
    recorded_dest = _recorded(node, dest_path, stored)
    made = None
    for path, value in found[1:]:
        if not (value.is_floating_point() and dest.is_floating_point()):
            continue
        if _schema_name(path, names) not in VALUE_ARGS:
            continue
        now = casts.get(path, value.dtype)
        # policy torch's capture traced the module under autocast: a mismatch recorded there is the policy's
        by_policy = bool(node.meta.get(POLICY_OP_META))
        if now == dest_dtype or (not by_policy and _recorded(node, path, stored) != recorded_dest):
            continue  # already one dtype, or the program itself wrote across dtypes (its own error)
        casts[path] = dest_dtype
        made = WriteCast(_name(node, dest_path), _name(node, path), now, dest_dtype)
    if made is None and (decision is None or ("args", 0) not in decision.casts):
        return decision, None
    if decision is None:
        decision = Decision(None, "none", "write", "")
    reason = made.describe() if made is not None else "the destination of an in-place write is never cast"
    decision = replace(
        decision, casts=casts, reason=f"{decision.reason}; {reason}" if decision.reason else reason
    )
    return decision, made


def _schema_name(path: ArgPath, names: list[str]) -> str | None:
    if path[0] == "kwargs":
        return path[1]
    return names[path[1]] if path[1] < len(names) else None


def arg_at(node: torch.fx.Node, path: ArgPath) -> object:
    """The FX argument of ``node`` at ``path`` (an ``ArgPath`` of ``tensor_args``)."""
    holder = node.args if path[0] == "args" else node.kwargs
    value = holder[path[1]] if path[0] == "kwargs" or path[1] < len(holder) else None
    return value[path[2]] if len(path) == 3 and isinstance(value, (list, tuple)) else value


def _recorded(node: torch.fx.Node, path: ArgPath, stored: dict) -> torch.dtype | None:
    """The dtype the program as exported gave this argument."""
    arg = arg_at(node, path)
    if not isinstance(arg, torch.fx.Node):
        return None
    if arg in stored:
        return stored[arg]
    val = arg.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _name(node: torch.fx.Node, path: ArgPath) -> str:
    arg = arg_at(node, path)
    return arg.name if isinstance(arg, torch.fx.Node) else str(arg)


class CastWrites(TorchDispatchMode):
    """Eager semantics of the same rule, for the references precast runs: under this mode an op of
    ``SAME_DTYPE_WRITES`` whose floating value and destination differ gets the value cast to the destination's
    dtype first (``value.to(dest.dtype)``, as a patched ``StaticLayer.update`` would), everything else runs
    as it is. Below autocast in the dispatcher, so autocast's own casts happen first, as in eager."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in SAME_DTYPE_WRITES and args and isinstance(args[0], torch.Tensor):
            dest = args[0]
            names = [a.name for a in func._schema.arguments]

            def match(name: str | None, value: object) -> object:
                if (
                    name in VALUE_ARGS
                    and isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and dest.is_floating_point()
                    and value.dtype != dest.dtype
                ):
                    return value.to(dest.dtype)
                return value

            args = (
                dest,
                *(match(names[i] if i < len(names) else None, a) for i, a in enumerate(args[1:], 1)),
            )
            kwargs = {k: match(k, v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
