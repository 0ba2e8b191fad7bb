"""Ops pinned to fp32 over any policy: a plan's ops under policy "torch" or the program's own regions (policy
None), and the trials of a sensitivity estimate over those policies.

Rules and auto keep ops fp32 through their own decider (``bind(..., fallback=...)``, custom rules); policy torch
and the program's regions have no decider to bind, so ``Pinned`` wraps the policy (or None: the regions only):
a pinned op computes in fp32 (its floating inputs cast to fp32, never a tensor it writes), with the authority
of the user's own choice, before the regions and the policy; every other op is decided exactly as the wrapped
policy decides it (eager autocast semantics under torch, the regions as written under None). A pinned op's
output then flows on in fp32, as it would in eager code that ran that op in fp32.

Input: a policy (or None) and a ``pin(node) -> reason | None``. Output: a policy object for ``convert``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from precast.policy.base import Decision, Policy
from precast.policy.rules.taxonomy import casts_for


@dataclass(frozen=True)
class Pinned:
    """``inner`` (a policy without ``bind``, or None for the program's regions only) with the ops ``pin``
    names (a reason) kept in fp32. ``rule``: the rule name the report shows for them."""

    inner: Policy | None
    pin: Callable[[torch.fx.Node], str | None]
    rule: str = "pinned"
    # verification: the wrapped policy's reference, with the difference stated as measured error (the pins
    # change what the policy alone would compute)
    promises_reference = False

    @property
    def name(self) -> str:
        return self.inner.name if self.inner is not None else "regions"

    @property
    def regions_only(self) -> bool:
        return self.inner is None

    def __getattr__(self, attr: str) -> Any:
        # the wrapped policy's hooks (capture_under_autocast, reference, keep_io_types, device_type...)
        if attr.startswith("__") or self.inner is None:
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def reference(self) -> str:
        return getattr(self.inner, "reference", "measured") if self.inner is not None else "program"

    def for_device(self, device_type: str, dtype: torch.dtype | None) -> Pinned:
        inner = self.inner
        if inner is not None and hasattr(inner, "for_device"):
            inner = inner.for_device(device_type, dtype)
        return replace(self, inner=inner)

    def autocast_state(self, device_type: str) -> tuple[bool, torch.dtype] | None:
        return self.inner.autocast_state(device_type) if self.inner is not None else None

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        return self.inner.decide(node, args, kwargs) if self.inner is not None else None

    def pinned(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        """The fp32 decision for a pinned op (None: not pinned). Only ops with a floating tensor input."""
        reason = self.pin(node)
        if reason is None or not isinstance(node.target, torch._ops.OpOverload):
            return None
        casts = casts_for(node, args, kwargs, torch.float32)
        return Decision(torch.float32, "user", self.rule, f"{reason} (over policy {self.name})", casts=casts)


def pin_names(policy: Policy | None, names: dict[str, Any], why: str = "kept in fp32") -> Pinned:
    """``policy`` with the ops named in ``names`` (node names of the program being lowered) pinned to fp32."""
    chosen = set(names)
    return Pinned(policy, lambda node: why if node.name in chosen else None, rule="kept")
