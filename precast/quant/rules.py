"""Which format each weight gets (``weight_format=``): one format for every weight, glob patterns over weight
names (first match first), or one rule per weight name (a plan's, a budget's choice).

Names: a weight is matched by its name in the program (``model.model.layers.0.mlp.up_proj.weight`` in the LLM
recipe's program, whose wrapper adds ``model.``), by the reading module's path + ``.weight`` (a tied head is
``model.lm_head.weight`` to its linear), and by each of those with leading module names removed: the checkpoint's
own names (``lm_head.weight``, ``model.layers.*``) match, as a user writes them.

Nothing silent: after the pass, a pattern that matched no weight of the program, a pattern every weight of which an
earlier pattern took (first match wins: a pattern after ``"*"``), and a plan naming weights the program lacks (or
lacking weights it has: a plan written for another model) each stop the conversion with one line
(``WeightRules.check_used``).

Input: what the user gave. Output: ``WeightRules`` (``choose(names) -> (format, why)``), or a one-line error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from precast.errors import PrecastError
from precast.quant.formats import FLOAT, WeightFormat, parse_format


def name_forms(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "b.c", "c"]``: the name and the same name with leading module names removed (a
    checkpoint's names under a wrapper's prefix)."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


@dataclass(frozen=True)
class WeightRules:
    """Which format each weight gets: ``rules`` (glob pattern over weight names -> format), first match wins; a
    weight no pattern matches keeps the float the policy gives it. ``source``: how the user said it (the report's
    "why"). ``literal``: one rule per weight name (a plan's, a budget's): the full names matched exactly. Built by
    ``weight_rules`` from ``weight_format=``. ``fitted`` (``precast.quant.fit.Fitted``): int4 parts fitted on
    calibration data, stored in place of round-to-nearest's where they cover a weight and format."""

    rules: tuple[tuple[str, WeightFormat], ...]
    source: str
    literal: bool = False
    fitted: Any = field(default=None, compare=False, repr=False)

    @property
    def int4(self) -> list[WeightFormat]:
        """The int4 formats the rules name (those data-aware rounding fits)."""
        return list(dict.fromkeys(f for _, f in self.rules if f.kind == "int4"))

    @classmethod
    def exact(cls, formats: Mapping[str, str | WeightFormat], source: str) -> WeightRules:
        """One rule per weight name (a plan's ``weights``): the names matched literally."""
        escaped = {name: re.sub(r"([*?\[])", r"[\1]", name) for name in formats}
        return cls(
            tuple((escaped[n], parse_format(f, f"{source}: {n}")) for n, f in formats.items()),
            source,
            literal=True,
        )

    def for_reads(self, read_dtypes: Mapping[str, set]) -> WeightRules:
        """The rules the pass applies once it knows the dtypes each weight is read in (weight -> dtypes): these
        rules; a budget's choice re-costs its formats as they will be stored (``precast.quant.budget``)."""
        return self

    def read_names(self, names: list[str], own: list[str]) -> list[str]:
        """The names one read of a weight is chosen by: ``own`` (the weight's names less those its other reads'
        modules give it: a tied table's embedding read is not ``lm_head.weight``) under patterns, or where a plan
        names the read apart (a table stored ``int4-g64+int8``: the plan keys each read's format by its own name);
        else, in a plan, all the weight's names (a plan naming the table once covers both reads)."""
        if not self.literal or self.first(own) is not None:
            return own
        return names

    def matches(self, pattern: str, names: Iterable[str]) -> bool:
        forms = list(names) if self.literal else [f for n in names for f in name_forms(n)]
        return any(fnmatch.fnmatchcase(f, pattern) for f in forms)

    def first(self, names: list[str]) -> int | None:
        """The index of the first rule matching any of a weight's names, or None."""
        return next((i for i, (p, _) in enumerate(self.rules) if self.matches(p, names)), None)

    def choose(self, names: list[str]) -> tuple[WeightFormat, str]:
        i = self.first(names)
        if i is None:
            return FLOAT, f"{self.source}: no pattern matches"
        pattern, fmt = self.rules[i]
        return fmt, self.source if pattern == "*" or self.literal else f"{self.source}: {pattern!r}"

    def check_used(self, weights: Mapping[str, list[str]], others: Iterable[str] = ()) -> None:
        """One line for a rule that chose no weight: ``weights`` maps each weight the pass read (linear weights,
        embedding tables) to its names, ``others`` the program's other constants (a pattern naming only those
        matched something: the pass's own info says why they stay float)."""
        if self.literal:  # a plan may name a tied table's reads apart (``read_names``): each name is used
            used = {
                i for i, (p, _) in enumerate(self.rules) if any(self.matches(p, n) for n in weights.values())
            }
        else:
            used = {self.first(names) for names in weights.values()}
        unused = [i for i in range(len(self.rules)) if i not in used]
        if not unused:
            return
        if self.literal:
            self._check_plan(unused, weights)
            return
        other = [[n] for n in others]
        for i in unused:
            pattern = self.rules[i][0]
            taken = [names for names in weights.values() if self.matches(pattern, names)]
            if taken:
                j = self.first(taken[0])
                raise PrecastError(
                    f"{self.source}: pattern {pattern!r} never applies: the weights it matches (e.g. "
                    f"{taken[0][0]!r}) match the earlier pattern {self.rules[j][0]!r} first (first match wins); "
                    "put it before that one"
                )
            if not any(self.matches(pattern, names) for names in other):
                example = next(iter(weights), None)
                raise PrecastError(
                    f"{self.source}: pattern {pattern!r} matches no weight of this program (its weights are "
                    f"named like {example!r}; a checkpoint's own names, e.g. 'lm_head.weight', match too); "
                    "fix or remove the pattern"
                )

    def _check_plan(self, unused: list[int], weights: Mapping[str, list[str]]) -> None:
        names = [re.sub(r"\[(.)\]", r"\1", self.rules[i][0]) for i in unused]
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        raise PrecastError(
            f"{self.source} names {len(names)} weight(s) this program lacks ({shown}): it was written for "
            "another model; write a plan for this one (or give weight_format= patterns)"
        )

    def check_covers(self, weights: Mapping[str, list[str]]) -> None:
        """A plan (``literal``) names every weight the pass read; one line naming those it lacks (a plan written
        for another model would leave them float without a word)."""
        if not self.literal:
            return
        missing = [w for w, names in weights.items() if self.first(names) is None]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise PrecastError(
                f"{self.source} names no format for {len(missing)} weight(s) of this program ({shown}): it was "
                "written for another model; write a plan for this one"
            )


def weight_rules(value: object) -> WeightRules | None:
    """``weight_format=`` as rules: None; a format for every weight (``"int8"``, ``"int4"``, ``"int4-g128"``,
    ``precast.Int8()``, ``precast.Int4(group=128)``); or a mapping of glob patterns over weight names (the
    program's, or the checkpoint's: see the module docstring) to formats (strings or format objects), first match
    first (``"*"``: every other weight). One line for anything else."""
    if value is None or isinstance(value, WeightRules):
        return value
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
