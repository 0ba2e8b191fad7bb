"""``weight_format=precast.WeightBudget(...)``: each weight's format chosen by measurement, under a budget.

The conversion estimates, on the budget's calibration batches, every linear/embedding weight's output error in every
format (``precast.numerics.weight_sensitivity``: the exact rounding against the fp32 program's Fisher information),
then keeps the cheapest formats whose summed estimate meets the budget (``allocate``). The choice becomes one
rule per weight, applied as any ``weight_format=`` is; the report says what was estimated and chosen
(``report.weight_budget``), and ``precast.Plan.from_result`` writes it for the next conversion (no measuring).

Input: the conversion's state after capture, the budget. Output: the state's weight rules set, and the record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.errors import PrecastError
from precast.ir.weight_formats import parse_format
from precast.numerics.weight_sensitivity import Allocation, WeightCosts, allocate, estimate_costs
from precast.passes.runner import timed
from precast.passes.weight_rules import WeightRules


@dataclass(frozen=True)
class WeightBudget:
    """Choose each weight's format by measurement (``convert(..., weight_format=WeightBudget(...))``).

    One budget: ``kld`` (the estimated mean KL divergence per position of the next-token distribution that the
    weights' storage adds, nats; for programs whose first output is logits), ``mse`` (estimated mean squared output
    error, for any other program), ``bytes`` (stored bytes of the linear/embedding weights, scales included) or
    ``bits`` (their mean bits per weight, e.g. 4.5). ``data``: calibration batches (a list of input tuples, as
    ``calibration=``); ``formats``: the formats to choose among besides "float" (the dtype the policy computes in);
    ``probes``: backward passes per batch (more: a steadier ranking); ``progress``: called as ``progress(done, total)``
    before the first backward pass and after each (``total``: batches x probes; ``precast.progress.ProgressBar.counter``
    shows it with the time left)."""

    kld: float | None = None
    mse: float | None = None
    bytes: float | None = None
    bits: float | None = None
    data: Any = field(default=None, compare=False)
    formats: Sequence[str] = ("int4", "int8")
    probes: int = 8
    progress: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def check(self) -> None:
        given = {
            k: v
            for k, v in (("kld", self.kld), ("mse", self.mse), ("bytes", self.bytes), ("bits", self.bits))
            if v is not None
        }
        if len(given) != 1:
            raise PrecastError(
                "WeightBudget: give exactly one budget: kld= (nats per position), mse=, bytes= or bits= (per weight); "
                f"got {', '.join(given) or 'none'}"
            )
        ((name, value),) = given.items()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise PrecastError(f"WeightBudget: {name}={value!r}: give a number > 0")
        for f in self.formats:
            if not parse_format(f, "WeightBudget formats").quantized:
                raise PrecastError(
                    "WeightBudget formats: name the 8/4-bit formats to choose among; float is always one"
                )
        if (
            self.data is None
            or isinstance(self.data, (torch.Tensor, str, bytes, dict))
            or not isinstance(self.data, Iterable)
        ):
            raise PrecastError(
                "WeightBudget: data= is the calibration batches the choice is measured on (a list of input tuples)"
            )
        if not isinstance(self.probes, int) or isinstance(self.probes, bool) or self.probes < 1:
            raise PrecastError(f"WeightBudget: probes={self.probes!r}: give a number of backward passes >= 1")
        if self.progress is not None and not callable(self.progress):
            raise PrecastError(
                f"WeightBudget: progress={self.progress!r}: give a function progress(done, total), or None"
            )

    @property
    def metric(self) -> str:
        return "mse" if self.mse is not None else "kld"


@dataclass
class BudgetChoice:
    """What a budget chose: the allocation, and the costs it was made from."""

    allocation: Allocation
    costs: WeightCosts

    def to_json(self, budget: WeightBudget) -> dict:
        counts: dict[str, int] = {}
        for f in self.allocation.formats.values():
            counts[f] = counts.get(f, 0) + 1
        elements = sum(torch.Size(w.shape).numel() for w in self.costs.weights.values())
        return {
            "budget": {
                k: getattr(budget, k)
                for k in ("kld", "mse", "bytes", "bits")
                if getattr(budget, k) is not None
            },
            "metric": self.costs.metric,
            "estimate": self.allocation.estimate,
            "bytes": self.allocation.bytes,
            "bits_per_weight": 8 * self.allocation.bytes / max(elements, 1),
            "formats": counts,
            "probes": self.costs.probes,
            "positions": self.costs.positions,
            "seconds": self.costs.seconds,
        }


def choose(
    ep: Any, budget: WeightBudget, float_dtype: torch.dtype, formats_only: bool = False
) -> BudgetChoice:
    """Estimate the costs on ``ep`` (its fp32 weights) and allocate under the budget; one line when nothing fits."""
    budget.check()
    costs = estimate_costs(
        ep,
        budget.data,
        budget.formats,
        float_dtype=float_dtype,
        metric=budget.metric,
        probes=budget.probes,
        progress=budget.progress,
    )
    if budget.metric != costs.metric:
        raise PrecastError(f"WeightBudget: {budget.metric} budget on a {costs.metric} estimate")
    elements = sum(torch.Size(w.shape).numel() for w in costs.weights.values())
    cap = (
        budget.bytes
        if budget.bytes is not None
        else budget.bits * elements / 8
        if budget.bits is not None
        else None
    )
    if cap is not None:
        cheapest = allocate(costs, error=float("inf"))
        if cheapest.bytes > cap:
            raise PrecastError(
                f"WeightBudget: the cheapest formats take {cheapest.bytes} bytes "
                f"({8 * cheapest.bytes / elements:.2f} bits per weight), over the budget; raise it or add a smaller "
                "format"
            )
        allocation = allocate(costs, max_bytes=cap)
    else:
        allocation = allocate(costs, error=budget.kld if budget.kld is not None else budget.mse)
    return BudgetChoice(allocation, costs)


def choose_weights(state: Any, budget: WeightBudget) -> BudgetChoice:
    """The conversion's weight rules from the budget (measured on the captured program's fp32 weights)."""
    low = state.low if state.policy is not None and state.low is not None else torch.float32
    with timed("weight_budget"):
        choice = choose(state.captured, budget, low)
    rules = WeightRules.exact(choice.allocation.formats, "the weight budget")
    state.weight_rules = state.program.weight_rules = rules
    return choice
