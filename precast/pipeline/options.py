"""The options of one conversion, as one frozen record checked in one place.

``ConvertOptions`` holds what ``precast.convert`` (its records, flattened by ``pipeline/records.py``) and
``precast convert`` take besides the source and its inputs: the policy (a name or an object), the rules keywords (``rules``: by the names ``RulesPolicy`` declares,
``precast.policy.resolve.RULE_OPTIONS``), and the conversion's own options. ``check()`` is where every refusal of
a bad option or a bad mix comes from, one line each, before anything is captured or run: the policy and its
keywords (``policy/resolve.py``), a plan over them (``policy/plan.py``), the low and cache dtypes, keep_io_types,
the diagnostic codes allowed, streamed weights and what they cannot serve. It returns the policy object and a
``CheckedOptions`` (the values the driver uses: dtypes parsed, weight files opened).

Input: the user's options. Output: (policy object or None, ``CheckedOptions``), or a one-line ``PrecastError``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.dtypes import parse_low_dtype
from precast.errors import PrecastError
from precast.ir.diagnostics import parse_allow
from precast.numerics.calibration.stage import is_given
from precast.numerics.tolerance.search import parse_tolerance
from precast.policy.base import Policy
from precast.policy.hooks import binds, hook
from precast.policy.pinned import Pinned
from precast.policy.plan import load_plan, with_plan
from precast.policy.resolve import RULE_OPTIONS, resolve_policy, rule_options
from precast.quant.budget import WeightBudget
from precast.quant.rules import WeightRules, weight_rules
from precast.weights.files import WeightFiles
from precast.weights.streamed import check_weights_out


@dataclass(frozen=True)
class ConvertOptions:
    """Every option of a conversion (``precast.convert``'s keywords, the CLI's flags), unchecked until
    ``check()``. ``rules``: the rules keywords given, by ``RulesPolicy``'s field names."""

    policy: Any = None
    dtype: torch.dtype | str | None = None
    device_type: str | None = None
    rules: Mapping[str, Any] = field(default_factory=dict)
    keep_io_types: bool | None = None
    dynamic_shapes: Any = None
    verify: bool = True
    allow: Iterable[str] = ()
    plan: Any = None
    cache_dtype: torch.dtype | str | None = None
    weights: str | os.PathLike | None = None
    weights_out: str | os.PathLike | None = None
    weight_format: Any = None
    weight_data: Any = None  # WeightOptions(data=): the batches int4 weights are fitted on

    @classmethod
    def from_keywords(cls, given: Mapping[str, Any]) -> ConvertOptions:
        """The record from flat keywords (name -> value: what ``pipeline/records.options_of`` makes of
        ``convert``'s records and shortcuts): the rules keywords picked by ``RulesPolicy``'s field names, the rest
        by this record's; a name that is neither is an error here, never silently dropped."""
        own = {f.name for f in dataclasses.fields(cls)} - {"rules"}
        unknown = set(given) - own - set(RULE_OPTIONS)
        if unknown:
            raise TypeError(f"ConvertOptions has no option {', '.join(sorted(unknown))}")
        rules = {k: v for k, v in given.items() if k in RULE_OPTIONS}
        return cls(rules=rules, **{k: v for k, v in given.items() if k in own})

    def check(self, source: Any = None) -> tuple[Policy | None, CheckedOptions]:
        """Every refusal, one line each; ``source``: what is converted, when known (weights= needs a program)."""
        parse_low_dtype(self.dtype)  # a bad dtype is said first, before any mix of options
        if self.device_type not in (None, "cpu", "cuda"):
            raise PrecastError(
                f"device_type={self.device_type!r}: precast has autocast tables for 'cpu' and 'cuda'"
            )
        cache = cache_dtype_of(self.cache_dtype)
        if self.keep_io_types is not None and not isinstance(self.keep_io_types, bool):
            raise PrecastError(
                f"keep_io_types={self.keep_io_types!r}: give True, False or None (the policy's default)"
            )
        allowed = parse_allow(self.allow)
        weight = self.weight_rules()
        files = self.streamed_files(source)
        rules = rule_options(self.rules)
        policy, custom_rules, dtype, pins = with_plan(
            self.plan, self.policy, rules["custom_rules"], self.dtype
        )
        chosen, low = resolve_policy(policy, dtype, self.device_type, {**rules, "custom_rules": custom_rules})
        if pins is not None:  # a plan over policy torch or the program's regions: its ops pinned to fp32
            chosen = Pinned(chosen, pins, rule="custom:plan")
        if binds(
            chosen
        ):  # the policy's own options (regexes, ops, limits, tolerance), refused before capture
            hook(chosen, "options")(low or torch.bfloat16)
            # a tolerance without calibration= measures on the example inputs (prepare says when there are none)
            parse_tolerance(hook(chosen, "tolerance"))
        return chosen, CheckedOptions(self, low, cache, allowed, files, weight)

    def weight_rules(self) -> WeightRules | None:
        """``weight_format=``, or the weight formats a plan carries (one line when both are given)."""
        planned = load_plan(self.plan).weights if self.plan is not None else {}
        if isinstance(self.weight_format, WeightBudget):
            self.weight_format.check()
            if planned:
                raise PrecastError("plan= carries weight formats and weight_format= is a budget: give one")
            if self.weight_data is not None:
                raise PrecastError(
                    "WeightOptions(data=) and a Budget: give the calibration batches once, as Budget(data=...)"
                )
            if self.weights is not None:
                raise PrecastError(
                    "weight_format=WeightBudget(...) measures the weights, which streamed weights cannot give (no "
                    "values in memory); convert in memory, or give the formats (a plan written by one that did)"
                )
            return None  # chosen after capture, on the program's weights (precast/quant/budget.py)
        rules = weight_rules(self.weight_format)
        if planned and rules is not None:
            raise PrecastError(
                "plan= carries weight formats and weight_format= is given: give one (the plan's are in its "
                '"weights")'
            )
        chosen = WeightRules.exact(planned, "the plan") if planned else rules
        self.check_weight_data(chosen)
        return chosen

    def check_weight_data(self, rules: WeightRules | None) -> None:
        """``WeightOptions(data=)``: calibration batches, for rules naming an int4 format, with weights in memory;
        and a plan whose int4 weights were fitted on data is given data to fit them again (one line each)."""
        data = self.weight_data
        planned = load_plan(self.plan).roundings if self.plan is not None else {}
        if data is None:
            if planned:
                raise PrecastError(
                    f"plan= fitted {len(planned)} int4 weight(s) on calibration data ({next(iter(planned))}: "
                    f"{next(iter(planned.values()))}): give the data to fit them again "
                    "(weights=precast.WeightOptions(data=...), export-llm's --calibration-text)"
                )
            return
        if isinstance(data, (torch.Tensor, str, bytes, dict)) or not isinstance(data, Iterable):
            raise PrecastError(
                "WeightOptions(data=): give the calibration batches int4 weights are fitted on (a list of input tuples)"
            )
        if rules is None or not rules.int4:
            raise PrecastError(
                "WeightOptions(data=) fits int4 weights on data, and no int4 format is given: name one "
                "(format='int4'), or drop data="
            )
        if self.weights is not None:
            raise PrecastError(
                "WeightOptions(data=) runs the program to fit int4 weights, which streamed weights cannot (no values "
                "in memory); convert in memory, or drop data="
            )

    def streamed_files(self, source: Any) -> WeightFiles | None:
        """``weights=``: the files, once the options they cannot serve are refused (one line each)."""
        if self.weights is None:
            if self.weights_out is not None:
                raise PrecastError(
                    "weights_out= is where streamed weights go: give weights= (their source) as well"
                )
            return None
        if source is not None and not isinstance(source, ExportedProgram):
            raise PrecastError(
                "weights= streams the weights of an ExportedProgram (exported with fake or meta weights, "
                "docs/streaming.md); a module holds its weights already: convert it without weights="
            )
        if self.weights_out is None:
            raise PrecastError("weights= needs weights_out=: the folder the converted weights are written to")
        calibration = self.rules.get("calibration")
        if calibration is not None and not is_given(calibration):
            raise PrecastError(
                "calibration= batches run the program, which streamed weights cannot (no values in memory); "
                "pass statistics measured beforehand (precast.calibrate, docs/distributed.md), or convert in "
                "memory"
            )
        if self.rules.get("tolerance") is not None:
            raise PrecastError(
                "tolerance= runs the converted program on data, which streamed weights cannot (no values in "
                "memory); convert in memory, or leave it out"
            )
        times = not isinstance(self.policy, str) and binds(self.policy)
        if self.policy == "auto" or (times and "latency" in hook(self.policy, "prepare_steps")):
            raise PrecastError(
                "policy='auto' (a policy that times ops) runs the converted program, which streamed weights cannot; use 'torch', "
                "'rules' or a plan"
            )
        files = WeightFiles(self.weights)
        check_weights_out(files, self.weights_out)  # before the conversion, not after it
        return files


@dataclass(frozen=True)
class CheckedOptions:
    """What ``ConvertOptions.check`` returns besides the policy: the record as given, and its values parsed."""

    given: ConvertOptions
    low: torch.dtype | None = None  # the low dtype (None: the device's autocast dtype)
    cache_dtype: torch.dtype | None = None  # cache_dtype=: the caches held in this dtype
    allowed: list[str] = field(default_factory=list)  # the diagnostic codes whose errors become warnings
    files: WeightFiles | None = None  # weights=: the files the value-less constants come from
    weight_rules: WeightRules | None = None  # weight_format=: the weights stored in 8/4 bits

    @classmethod
    def of(cls, low: torch.dtype | None = None, **given: Any) -> CheckedOptions:
        """For a driver that resolves its policy itself (``precast.calibrate``, ``precast.sensitivity``): the
        options it takes (``device_type``, ``dynamic_shapes``), with the low dtype it resolved."""
        return cls(ConvertOptions(**given), low)


def cache_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``cache_dtype=`` as a dtype: bf16/fp16 names or dtypes, float32 for "as the program gives it"."""
    if value is None:
        return None
    if value in (torch.float32, "fp32", "float32"):
        return torch.float32
    try:
        return parse_low_dtype(value)
    except PrecastError as exc:
        raise PrecastError(f"cache_dtype={value!r}: give 'bf16', 'fp16', 'fp32' or a torch dtype") from exc
