"""Eager ``torch.autocast`` semantics for one op, as data about casts (no tensors are touched).

Mirrors ATen ``autocast_mode.h``: ``cached_cast`` casts an argument only when it is *eligible* (a floating
tensor of the autocast device type, not float64) and not already of the target type; ``promote`` picks float32
when any eligible argument is float32, else the low dtype; ``fp32_set_opt_dtype`` and ``fp32_append_dtype``
act only when the first argument is eligible. Tensor, optional Tensor and Tensor-list arguments are cast;
nothing else is.

Input: an op node, its fake arguments, the autocast device/dtype. Output: a ``Decision`` as eager would make it.
"""

from __future__ import annotations

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
        # eager autocast has a kernel for it on this torch, and precast does not know what it does: say so
        return Decision(
            None,
            source,
            UNKNOWN_CATEGORY,
            f"{context}: torch {torch.__version__} registers an autocast kernel for {registration(op)} that "
            "precast has no category for; left as written",
            region=region,
        )
    if cat is None or cat == Category.FALLTHROUGH:
        return None
    tensors = tensor_args(args, kwargs)
    elig = [(p, t) for p, t in tensors if eligible(t, device_type)]
    first = tensors[0][1] if tensors else None
    first_eligible = first is not None and eligible(first, device_type) and _is_first_arg(tensors[0][0])

    def cast_to(target: torch.dtype) -> dict[ArgPath, torch.dtype]:
        return {p: target for p, t in elig if t.dtype != target}

    why = f"{context}: {cat.value}"
    if cat == Category.LOWER_PRECISION_FP:
        return Decision(low, source, cat.value, why, casts=cast_to(low), region=region)
    if cat == Category.FP32:
        return Decision(torch.float32, source, cat.value, why, casts=cast_to(torch.float32), region=region)
    if cat == Category.PROMOTE:
        # at::autocast::prioritize, argument by argument: float32 wins; two low dtypes stay low; else an error
        target = low
        for _, t in elig:
            if target == torch.float32 or t.dtype == torch.float32:
                target = torch.float32
            elif t.dtype != low:
                raise PrecastError(
                    f"{where(node)}: eager autocast would fail here: '{registration(op)}' promotes a "
                    f"{dtype_name(t.dtype)} tensor under {dtype_name(low)} autocast (Unexpected floating ScalarType "
                    "in at::autocast::prioritize); cast it to float32 or to the autocast dtype first",
                    code="autocast-promote",
                    node=node.name,
                )
        return Decision(
            target, source, cat.value, f"{why} to {dtype_name(target)}", casts=cast_to(target), region=region
        )
    if cat == Category.FP32_SET_OPT_DTYPE:
        if not first_eligible:
            return None
        updates = (
            {} if kwargs.get("dtype") is not None or _positional_dtype(op, args) else {"dtype": torch.float32}
        )
        return Decision(torch.float32, source, cat.value, why, kwarg_updates=updates, region=region)
    if cat == Category.FP32_APPEND_DTYPE:
        if not first_eligible:
            return None
        target_name = APPEND_DTYPE_OVERLOAD[device_type][registration(op)]
        return Decision(
            torch.float32,
            source,
            cat.value,
            f"{why} (redispatched to {target_name})",
            kwarg_updates={"dtype": torch.float32},
            new_target=_resolve(target_name),
            region=region,
        )
    if cat == Category.BANNED:
        raise PrecastError(
            f"{where(node)}: {BANNED_MESSAGES.get(registration(op), f'{registration(op)} is banned under autocast')}",
            code="autocast-banned",
            node=node.name,
        )
    return None


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
