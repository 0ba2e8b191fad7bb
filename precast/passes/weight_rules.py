"""Which format each weight gets (``weight_format=``): one format for every weight, glob patterns over weight
names (first match first), or one rule per weight name (a plan's, a budget's choice).

Input: what the user gave. Output: ``WeightRules`` (``choose(names) -> (format, why)``), or a one-line error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

from precast.errors import PrecastError
from precast.ir.weight_formats import FLOAT, WeightFormat, parse_format


@dataclass(frozen=True)
class WeightRules:
    """Which format each weight gets: ``rules`` (glob pattern over weight names -> format), first match wins; a
    weight no pattern matches keeps the float the policy gives it. ``source``: how the user said it (the report's
    "why"). Built by ``weight_rules`` from ``weight_format=``."""

    rules: tuple[tuple[str, WeightFormat], ...]
    source: str
    literal: bool = False  # one rule per weight name (a plan's): the why is the source alone

    @classmethod
    def exact(cls, formats: Mapping[str, str], source: str) -> WeightRules:
        """One rule per weight name (a plan's ``weights``): the names matched literally."""
        escaped = {name: re.sub(r"([*?\[])", r"[\1]", name) for name in formats}
        return cls(
            tuple((escaped[n], parse_format(f, f"{source}: {n}")) for n, f in formats.items()),
            source,
            literal=True,
        )

    def choose(self, names: list[str]) -> tuple[WeightFormat, str]:
        for pattern, fmt in self.rules:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                why = self.source if pattern == "*" or self.literal else f"{self.source}: {pattern!r}"
                return fmt, why
        return FLOAT, f"{self.source}: no pattern matches"


def weight_rules(value: object) -> WeightRules | None:
    """``weight_format=`` as rules: None; a format for every weight (``"int8"``, ``"int4"``, ``"int4-g128"``); or a
    mapping of glob patterns over weight names (the program's FQN, or the reading module's path + ``.weight``, e.g.
    ``lm_head.weight`` for a tied head) to formats, first match first (``"*"``: every other weight). One line for
    anything else."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        rules = []
        for pattern, fmt in value.items():
            if not isinstance(pattern, str) or not pattern:
                raise PrecastError(
                    f"weight_format: the keys are glob patterns over weight names; got {pattern!r}"
                )
            rules.append((pattern, parse_format(fmt, f"weight_format[{pattern!r}]")))
        return WeightRules(tuple(rules), "weight_format rules")
    fmt = parse_format(value)
    return WeightRules((("*", fmt),), f"weight_format={fmt.name!r}")
