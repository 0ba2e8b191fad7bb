"""What a policy answers: the dtype an op computes in, the casts on its inputs that get it there, and why.

Input: a Decision and an op's (target, args, kwargs). Output: the call with the decision's casts applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx

from precast.dtypes import dtype_name
from precast.ir.graph import ArgPath


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


def apply_decision(target, args: tuple, kwargs: dict, decision: Decision | None, cast: Callable) -> tuple:
    """(target, args, kwargs) with the decision's casts applied through ``cast(value, dtype)``."""
    if decision is None:
        return target, args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for path, dtype in decision.casts.items():
        holder = args if path[0] == "args" else kwargs
        if len(path) == 2:
            holder[path[1]] = cast(holder[path[1]], dtype)
        else:
            seq = list(holder[path[1]])
            seq[path[2]] = cast(seq[path[2]], dtype)
            holder[path[1]] = seq
    if decision.new_target is not None:
        args, kwargs = redispatch_args(target, decision.new_target, args, kwargs)
        target = decision.new_target
    kwargs.update(decision.kwarg_updates)
    return target, tuple(args), kwargs


def redispatch_args(old, new, args: list, kwargs: dict) -> tuple[list, dict]:
    """Arguments of ``old`` rebound by name to ``new``'s schema, with ``old``'s defaults filled in
    (``norm.Scalar(x)`` means p=2; ``norm.ScalarOpt_dtype`` requires p)."""
    named = {}
    for i, arg in enumerate(old._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    new_args, new_kwargs = [], {}
    for arg in new._schema.arguments:
        if arg.name not in named:
            continue
        if arg.kwarg_only:
            new_kwargs[arg.name] = named[arg.name]
        else:
            new_args.append(named[arg.name])
    return new_args, new_kwargs
