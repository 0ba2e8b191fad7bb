"""From what the user passed to ``convert`` (a policy name or object, ``dtype``, ``device_type``, the rules
keywords) to one policy object and the low dtype, or one clear line for a bad mix.

The rules keywords are defined once, as the fields of ``RulesPolicy`` (``RULE_OPTIONS``): ``convert``'s
keywords, this check and the CLI's flags are read from there.

Input: the user's arguments. Output: (policy object or None, low dtype or None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from precast.dtypes import parse_low_dtype
from precast.errors import PrecastError
from precast.policy.auto import AutoPolicy
from precast.policy.base import Policy
from precast.policy.hooks import binds, hook
from precast.policy.rules.policy import RulesPolicy
from precast.policy.torch_policy import TorchPolicy

POLICY_NAMES = (None, "torch", "rules", "auto")
# the rules keywords, in RulesPolicy's order (dtype is convert's own keyword)
RULE_OPTIONS = tuple(f.name for f in dataclasses.fields(RulesPolicy) if f.init and f.name != "dtype")
# the ones given as sequences (stored as tuples in the frozen policy)
SEQUENCE_OPTIONS = tuple(f.name for f in dataclasses.fields(RulesPolicy) if f.default == ())


def rule_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The rules keywords out of ``given`` (e.g. ``convert``'s arguments), sequences as tuples, ``patterns`` a
    name or a tuple of names; the calibration data is passed on as given (it may be a one-pass iterator)."""
    out = {k: given.get(k) for k in RULE_OPTIONS}
    for k in SEQUENCE_OPTIONS:
        out[k] = tuple(out[k] or ())
    if out["patterns"] is not None and not isinstance(out["patterns"], str):
        out["patterns"] = tuple(out["patterns"])
    return out


def resolve_policy(
    policy: Any, dtype: Any, device_type: str | None, options: Mapping[str, Any]
) -> tuple[Policy | None, torch.dtype | None]:
    """(policy object or None, low dtype or None) from what the user passed; one line for a bad mix."""
    low = parse_low_dtype(dtype)
    given = [k for k, v in options.items() if v not in (None, ())]
    if isinstance(policy, str) or policy is None:
        if policy not in POLICY_NAMES:
            raise PrecastError(
                f"policy={policy!r}: choose None (the program's own autocast regions), 'torch', 'rules', 'auto', "
                "or a policy object (precast.TorchPolicy, precast.RulesPolicy, precast.AutoPolicy, or your own)"
            )
        if policy not in ("rules", "auto") and given:
            raise PrecastError(
                f"{', '.join(given)}: these options belong to policy='rules' (or 'auto'), so they need "
                "policy='rules' to apply"
            )
        if policy == "rules":
            return RulesPolicy(dtype=low, **options), low
        if policy == "auto":
            return AutoPolicy(dtype=low, **options), low
        if policy == "torch":
            return TorchPolicy(device_type, low), low
        return None, low
    if given:
        raise PrecastError(
            f"{', '.join(given)}: give these options inside the policy object ({type(policy).__name__}(...)), "
            "or use policy='rules' with keywords, not both"
        )
    # a policy that binds a decider per program (``bind``) decides through that decider
    needs = ("name", "bind") if binds(policy) else ("name", "autocast_state", "decide")
    missing = [a for a in needs if not hasattr(policy, a)]
    if missing:
        raise PrecastError(
            f"policy={policy!r}: not a policy (missing {', '.join(missing)}); give None, 'torch', 'rules' or an "
            "object with name, autocast_state(device_type) and decide(node, args, kwargs)"
        )
    mine = parse_low_dtype(hook(policy, "dtype"))
    if low is not None and mine is not None and low != mine:
        raise PrecastError(
            f"dtype={dtype!r} but the {type(policy).__name__} says dtype={hook(policy, 'dtype')!r}: give one"
        )
    theirs = hook(policy, "device_type")
    if device_type is not None and theirs not in (None, device_type):
        raise PrecastError(
            f"device_type={device_type!r} but the {type(policy).__name__} says {theirs!r}: give one"
        )
    return policy, low or mine
