"""Authority by composition: who decides an op's precision. The program's own autocast regions first, then the
user's rules (include/exclude, custom rules), then the policy: the first decision wins.

Input: an op node with its (fake) argument values, the policy, the user rules. Output: a ``Decision`` or None.
"""

from __future__ import annotations

import torch

from precast.dtypes import dtype_name
from precast.ir.graph import op_device_type
from precast.ir.regions import innermost_region
from precast.policy.autocast import autocast_decision
from precast.policy.base import Decision, Policy


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


def decide(node, args, kwargs, policy, user_rules) -> Decision | None:
    device = op_device_type(args, kwargs)
    if device is None:
        return None
    state = autocast_state_of(node, device, policy)
    if state is not None and state[2] == "region":
        enabled, dtype, source, context, region = state
        if not enabled:
            return Decision(None, "region", "disabled", f"{context}: autocast off", region=region)
        return autocast_decision(
            node, args, kwargs, device, dtype, source=source, context=context, region=region
        )
    for rule in user_rules:
        decision = rule(node, args, kwargs)
        if decision is not None:
            return decision
    if state is not None:
        enabled, dtype, source, context, region = state
        if enabled:
            return autocast_decision(node, args, kwargs, device, dtype, source=source, context=context)
        return None
    return policy.decide(node, args, kwargs) if policy is not None else None
