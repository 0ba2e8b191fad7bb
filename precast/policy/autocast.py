"""Eager ``torch.autocast`` semantics for one op, as data about casts (no tensors are touched).

Mirrors ATen ``autocast_mode.h``: ``cached_cast`` casts an argument only when it is *eligible* (a floating
tensor of the autocast device type, not float64) and not already of the target type; ``promote`` picks float32
when any eligible argument is float32, else the low dtype; ``fp32_set_opt_dtype`` and ``fp32_append_dtype``
act only when the first argument is eligible. Tensor, optional Tensor and Tensor-list arguments are cast;
nothing else is.

Input: an op node, its fake arguments, the autocast device/dtype. Output: a ``Decision`` as eager would make it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from precast.dtypes import dtype_name
from precast.errors import PrecastError, where
from precast.ir.graph import ArgPath, tensor_args
from precast.policy.base import Decision
from precast.policy.torch_tables import (
    APPEND_DTYPE_OVERLOAD,
    BANNED_MESSAGES,
    Category,
    category,
    is_unknown_registration,
)

# the rule of a Decision for an op the installed torch's autocast registers and precast has no category for
UNKNOWN_CATEGORY = "unknown-category"


def eligible(value: object, device_type: str) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and (value.device.type == device_type or (device_type == "cpu" and value.is_mkldnn))
    )


def registration(op: object) -> str:
    return op.name() if isinstance(op, torch._ops.OpOverload) else str(op)


@dataclass
class _Call:
    """One op as eager autocast sees it: its category, its eligible tensor arguments, whether the first
    argument is eligible, and the fields every Decision made for it carries."""

    node: torch.fx.Node
    cat: Category
    elig: list[tuple[ArgPath, torch.Tensor]]
    first_eligible: bool
    source: str
    why: str
    region: int | None

    def cast_to(self, target: torch.dtype) -> dict[ArgPath, torch.dtype]:
        """The casts of the eligible arguments not already of ``target``."""
        return {p: target for p, t in self.elig if t.dtype != target}

    def decision(self, dtype: torch.dtype, reason: str | None = None, **fields: Any) -> Decision:
        """A Decision of this category (``reason``: the category's, unless given)."""
        return Decision(dtype, self.source, self.cat.value, reason or self.why, region=self.region, **fields)


def autocast_decision(
    node: torch.fx.Node,
    args: tuple,
    kwargs: dict,
    device_type: str,
    low: torch.dtype,
    *,
    source: str,
    context: str,
    region: int | None = None,
) -> Decision | None:
    """Decision eager autocast (enabled, ``low`` dtype, on ``device_type``) makes for this op, or None."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    cat = category(device_type, op)
    if cat is None and is_unknown_registration(device_type, registration(op)):
        return _unknown_kernel(op, source, context, region)
    if cat is None or cat == Category.FALLTHROUGH:
        return None
    tensors = tensor_args(args, kwargs)
    elig = [(p, t) for p, t in tensors if eligible(t, device_type)]
    first = tensors[0][1] if tensors else None
    first_eligible = first is not None and eligible(first, device_type) and _is_first_arg(tensors[0][0])
    call = _Call(node, cat, elig, first_eligible, source, f"{context}: {cat.value}", region)
    if cat == Category.LOWER_PRECISION_FP:
        return call.decision(low, casts=call.cast_to(low))
    if cat == Category.FP32:
        return call.decision(torch.float32, casts=call.cast_to(torch.float32))
    if cat == Category.PROMOTE:
        target = _promoted(call, op, low)
        return call.decision(target, f"{call.why} to {dtype_name(target)}", casts=call.cast_to(target))
    if cat == Category.FP32_SET_OPT_DTYPE:
        return _set_opt_dtype(call, op, args, kwargs)
    if cat == Category.FP32_APPEND_DTYPE:
        return _append_dtype(call, op, device_type)
    if cat == Category.BANNED:
        raise PrecastError(
            f"{where(node)}: {BANNED_MESSAGES.get(registration(op), f'{registration(op)} is banned under autocast')}",
            code="autocast-banned",
            node=node.name,
        )
    return None


def _unknown_kernel(op: torch._ops.OpOverload, source: str, context: str, region: int | None) -> Decision:
    """An op eager autocast has a kernel for on this torch, and precast does not know what it does: say so."""
    return Decision(
        None,
        source,
        UNKNOWN_CATEGORY,
        f"{context}: torch {torch.__version__} registers an autocast kernel for {registration(op)} that "
        "precast has no category for; left as written",
        region=region,
    )


def _promoted(call: _Call, op: torch._ops.OpOverload, low: torch.dtype) -> torch.dtype:
    """The dtype ``promote`` computes in: at::autocast::prioritize, argument by argument: float32 wins; two low
    dtypes stay low; else an error (eager fails there too)."""
    target = low
    for _, t in call.elig:
        if target == torch.float32 or t.dtype == torch.float32:
            target = torch.float32
        elif t.dtype != low:
            raise PrecastError(
                f"{where(call.node)}: eager autocast would fail here: '{registration(op)}' promotes a "
                f"{dtype_name(t.dtype)} tensor under {dtype_name(low)} autocast (Unexpected floating ScalarType "
                "in at::autocast::prioritize); cast it to float32 or to the autocast dtype first",
                code="autocast-promote",
                node=call.node.name,
            )
    return target


def _set_opt_dtype(call: _Call, op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Decision | None:
    """``fp32_set_opt_dtype``: fp32 through the op's own ``dtype`` argument, when its first argument is
    eligible and no dtype is given."""
    if not call.first_eligible:
        return None
    updates = (
        {} if kwargs.get("dtype") is not None or _positional_dtype(op, args) else {"dtype": torch.float32}
    )
    return call.decision(torch.float32, kwarg_updates=updates)


def _append_dtype(call: _Call, op: torch._ops.OpOverload, device_type: str) -> Decision | None:
    """``fp32_append_dtype``: redispatched to the overload that takes a dtype, in fp32, when its first
    argument is eligible."""
    if not call.first_eligible:
        return None
    target_name = APPEND_DTYPE_OVERLOAD[device_type][registration(op)]
    return call.decision(
        torch.float32,
        f"{call.why} (redispatched to {target_name})",
        kwarg_updates={"dtype": torch.float32},
        new_target=_resolve(target_name),
    )


def _is_first_arg(path: ArgPath) -> bool:
    return path[:2] == ("args", 0)


def _positional_dtype(op: torch._ops.OpOverload, args: tuple) -> bool:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dtype":
            return i < len(args) and args[i] is not None
    return False


def _resolve(name: str) -> torch._ops.OpOverload:
    ns, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), opname)
    return getattr(packet, overload or "default")
