"""Authority by composition: who decides an op's precision. The program's own autocast regions first, then the
policy (whose own table puts the user's include/exclude options and custom rules first, ``precast.policy.rules``):
the first decision wins.

Input: an op node with its (fake) argument values, the policy. Output: a ``Decision`` or None.
"""

from __future__ import annotations

import torch

from precast.dtypes import dtype_name
from precast.ir.graph import ArgPath, op_device_type, tensor_args
from precast.ir.regions import innermost_region
from precast.policy.autocast import autocast_decision, eligible
from precast.policy.base import Decision, Policy, apply_decision


def autocast_state_of(node: torch.fx.Node, device: str, policy: Policy | None):
    """(enabled, dtype, source, context text, region id) in force for this node on ``device``."""
    region = innermost_region(node, device)
    if region is not None:
        return region.enabled, region.dtype, "region", region.describe(), region.id
    if policy is not None:
        state = policy.autocast_state(device)
        if state is not None:
            enabled, dtype = state
            return enabled, dtype, policy.name, f"policy torch: autocast({device}, {dtype_name(dtype)})", None
    return None


def decide(node: torch.fx.Node, args: tuple, kwargs: dict, policy: Policy | None) -> Decision | None:
    device = op_device_type(args, kwargs)
    if device is None:
        return None
    pinned = getattr(policy, "pinned", None)  # ops the user pinned to fp32 over any policy (policy/pinned.py)
    if pinned is not None:
        decision = pinned(node, args, kwargs)
        if decision is not None:
            return decision
    state = autocast_state_of(node, device, policy)
    if state is not None and state[2] == "region":
        return region_decision(node, args, kwargs, device, state, policy)
    if state is not None:
        enabled, dtype, source, context, region = state
        if enabled:
            return autocast_decision(node, args, kwargs, device, dtype, source=source, context=context)
        return None
    return policy.decide(node, args, kwargs) if policy is not None else None


def region_decision(node, args: tuple, kwargs: dict, device: str, state: tuple, policy) -> Decision | None:
    """An op of the program's own region: eager autocast in the region's state, on the inputs the program gives
    it. Under a policy that lowers ops outside regions without autocast semantics (rules, auto, a user's), a
    value may reach the region in another dtype than the program gave it (an fp16 activation entering an
    ``enabled=False`` head): it is cast back at the boundary, so the region runs as written. Policy None changes
    nothing outside regions, and under policy torch eager itself hands the region the low value."""
    enabled, dtype, source, context, region = state
    restore = as_written(node, args, kwargs, device) if lowers_outside_regions(policy, device) else {}
    if restore:
        fix = Decision(None, "region", "as-written", "", casts=restore)
        _, args, kwargs = apply_decision(node.target, args, kwargs, fix, lambda v, d: v.to(d))
    if not enabled:
        decision = Decision(None, "region", "disabled", f"{context}: autocast off", region=region)
    else:
        decision = autocast_decision(
            node, args, kwargs, device, dtype, source=source, context=context, region=region
        )
    if restore:
        if decision is None:
            decision = Decision(
                None, "region", "as-written", f"{context}: not cast by autocast", region=region
            )
        decision.casts = {**restore, **decision.casts}
        decision.reason += "; inputs cast back at the region's boundary to the dtypes the program gives them"
    return decision


def lowers_outside_regions(policy: Policy | None, device: str) -> bool:
    """A policy whose decisions outside regions are not eager autocast's (rules, auto, a user's own)."""
    return (
        policy is not None
        and policy.autocast_state(device) is None
        and not getattr(policy, "regions_only", False)
    )


def as_written(node, args: tuple, kwargs: dict, device: str) -> dict[ArgPath, torch.dtype]:
    """Casts giving each eligible floating argument the dtype it has in the program as exported (its producer's
    recorded value), where the conversion so far changed it."""
    restore = {}
    for path, value in tensor_args(args, kwargs):
        if not eligible(value, device):
            continue
        source = _arg_at(node, path)
        recorded = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if (
            isinstance(recorded, torch.Tensor)
            and recorded.is_floating_point()
            and recorded.dtype != value.dtype
        ):
            restore[path] = recorded.dtype
    return restore


def _arg_at(node, path: ArgPath):
    holder = node.args if path[0] == "args" else node.kwargs
    value = holder[path[1]]
    return value[path[2]] if len(path) == 3 else value
