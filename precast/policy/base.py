"""What a policy answers: the dtype an op computes in, the casts on its inputs that get it there, and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx

# An argument position: ("args", 0), ("args", 1, 2) for the 3rd tensor of a list argument, ("kwargs", "weight")
ArgPath = tuple


def dtype_name(dtype: torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


@dataclass
class Decision:
    """A node's precision decision; lives in ``node.meta["precast"]``.

    ``source`` says who decided (``region``, ``torch``, ``rules``, ``user``, ``none``), ``rule`` names the rule or
    autocast category, ``reason`` is the sentence a report shows, ``measured`` the value a rule measured.
    """

    dtype: torch.dtype | None
    source: str
    rule: str
    reason: str
    casts: dict[ArgPath, torch.dtype] = field(default_factory=dict)
    kwarg_updates: dict[str, Any] = field(default_factory=dict)
    new_target: Any = None  # fp32_append_dtype: the overload eager redispatches to
    region: int | None = None
    measured: float | None = None
    limit: float | None = None

    def to_json(self) -> dict:
        return {
            "dtype": dtype_name(self.dtype),
            "source": self.source,
            "rule": self.rule,
            "reason": self.reason,
            "region": self.region,
            "measured": self.measured,
            "limit": self.limit,
            "casts": len(self.casts),
        }


class Policy(Protocol):
    """A pluggable precision policy: asked once per op node outside any autocast region."""

    name: str

    def autocast_state(self, device_type: str) -> tuple[bool, torch.dtype] | None:
        """Eager-autocast state this policy applies on a device type (None: the policy is not autocast)."""
        ...

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        """Decision for an op outside any region, given its arguments' (fake) values; None leaves it alone."""
        ...
