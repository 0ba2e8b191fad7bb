"""``weight_format=precast.Budget(...)``: each weight's format chosen by measurement, under a budget.

The conversion estimates, on the budget's calibration batches, every linear/embedding weight's output error in every
format (``precast.quant.estimate``: the exact rounding against the fp32 program's Fisher information),
then keeps the cheapest formats whose summed estimate meets the budget (``allocate``). The choice becomes one
rule per weight, applied as any ``weight_format=`` is; the report says what was estimated and chosen
(``report.weight_budget``), and ``precast.Plan.from_result`` writes it for the next conversion (no measuring).

The cost is what the program stores: the knapsack runs again in the quantizing pass (``BudgetRules.for_reads``),
once the dtypes each weight is read in are known, with every scale and zero point counted as stored
(``WeightFormat.stored_bits``: a float weight read in two dtypes keeps a copy in each; a tied table read in fp32
by the embedding and in bf16 by the head keeps one bf16 scale vector); before, the estimate alone was counted and
planned 4.956 bits where 5.006 were stored (issue 50).
``WeightBudget`` is its old name, kept one release.

Input: the conversion's state after capture, the budget. Output: the state's weight rules set, and the record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from precast.errors import PrecastError
from precast.memory import give_back
from precast.passes.runner import timed
from precast.quant.estimate import Allocation, WeightCosts, allocate, estimate_costs
from precast.quant.fit import Fitted, fit_int4
from precast.quant.formats import parse_format
from precast.quant.rules import WeightRules

ROUNDINGS = ("data", "rtn")  # Budget.rounding: int4 fitted on the data, or round-to-nearest
METRICS = ("kld", "mse")  # Budget.metric (None: kld for logits over a vocabulary, else asked for)


@dataclass(frozen=True)
class Budget:
    """Choose each weight's format by measurement (``convert(..., weight_format=WeightBudget(...))``).

    One budget: ``kld`` (the estimated mean KL divergence per position of the next-token distribution that the
    weights' storage adds, nats; for programs whose first output is logits), ``mse`` (estimated mean squared output
    error, for any other program), ``bytes`` (stored bytes of the linear/embedding weights, scales included) or
    ``bits`` (their mean bits per weight, e.g. 4.5). ``data``: calibration batches (a list of input tuples, as
    ``calibration=``); ``formats``: the formats to choose among besides "float" (the dtype the policy computes in);
    ``probes``: backward passes per batch (more: a steadier ranking); ``progress``: called as ``progress(done, total)``
    before the first backward pass and after each (``total``: batches x probes; ``precast.progress.ProgressBar.counter``
    shows it with the time left). ``program``: the program measured on, when not the one converted: a cheaper
    program over the same weights (the same tensors, or equal values, under the same names), such as a decoder
    exported with a static cache of one calibration window instead of the deployed cache (``precast export-llm``
    does this: the backward passes then hold no gradients of the unused cache positions); None: the converted
    program itself. ``rounding``: how an int4 weight's values are chosen: ``"data"`` (the default: fitted on
    ``data``, GPTQ with each group's step and zero point searched against its inputs' importance,
    ``precast.quant.fit``; the estimate measures and the program stores those values) or ``"rtn"``
    (round-to-nearest, data-free); ``rounding_progress(done, total)``: called as the int4 weights are fitted.
    ``metric``: what a ``bits``/``bytes`` budget minimizes: ``"kld"`` (the first output is logits), ``"mse"`` (any
    output; on unit-norm embeddings it is 2 (1 - cosine) / dim) or None: ``"kld"`` when the first output's last
    dimension is the row count of an embedding table the program reads (logits over its vocabulary), else one line
    asking for it (``metric_for``); a ``kld``/``mse`` budget is its own metric."""

    kld: float | None = None
    mse: float | None = None
    bytes: float | None = None
    bits: float | None = None
    data: Any = field(default=None, compare=False)
    formats: Sequence[str] = ("int4", "int8")
    probes: int = 8
    progress: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)
    program: Any = field(default=None, compare=False, repr=False)
    rounding: str = "data"
    rounding_progress: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)
    metric: str | None = None

    def check_choice(self, said: Callable[[str, Any], str] | None = None) -> None:
        """The fields that say what is chosen (one finite budget > 0, the 8/4-bit formats, probes >= 1), checked
        before anything is measured (``precast.llm.export`` runs it before the calibration text is read); ``said``
        as for ``check``."""
        said = said or (lambda name, value: f"WeightBudget: {name}={value!r}")
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PrecastError(f"{said(name, value)}: give a number > 0")
        for f in self.formats:
            try:
                fmt = parse_format(f, "formats")
            except PrecastError as exc:  # formats='int2': ... -> (said) formats int2: ...
                raise PrecastError(f"{said('formats', f)}:" + str(exc).split(":", 1)[1]) from None
            if not fmt.quantized:
                raise PrecastError(
                    f"{said('formats', f)}: name the 8/4-bit formats to choose among; float is always one"
                )
        if self.metric not in (None, *METRICS) or (self.metric or name) != name and name in METRICS:
            raise PrecastError(
                f"{said('metric', self.metric)}: choose 'kld' (logits) or 'mse' (any output), or None"
                + (f"; a {name}= budget is measured in {name}" if name in METRICS else "")
            )
        if not isinstance(self.probes, int) or isinstance(self.probes, bool) or self.probes < 1:
            raise PrecastError(f"{said('probes', self.probes)}: give a number of backward passes >= 1")
        if self.rounding not in ROUNDINGS:
            raise PrecastError(
                f"{said('rounding', self.rounding)}: choose 'data' (int4 fitted on the calibration data) or 'rtn' "
                "(round-to-nearest)"
            )

    def check(self, said: Callable[[str, Any], str] | None = None) -> None:
        """Every field checked, one line each; ``said(field, value)`` names a field as the caller's user wrote it
        (``precast export-llm``: ``--bits 4.5``; default ``WeightBudget: bits=4.5``)."""
        self.check_choice(said)
        if (
            self.data is None
            or isinstance(self.data, (torch.Tensor, str, bytes, dict))
            or not isinstance(self.data, Iterable)
        ):
            raise PrecastError(
                "WeightBudget: data= is the calibration batches the choice is measured on (a list of input tuples)"
            )
        if self.program is not None and not isinstance(self.program, ExportedProgram):
            raise PrecastError(
                f"WeightBudget: program={type(self.program).__name__}: give the torch.export program the weights "
                "are measured on (the same weights as the converted one), or None"
            )
        for name in ("progress", "rounding_progress"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise PrecastError(
                    f"WeightBudget: {name}={getattr(self, name)!r}: give a function {name}(done, total), or None"
                )

    def metric_for(self, ep: ExportedProgram) -> str:
        """The metric the budget is measured in on ``ep``: its ``kld=``/``mse=``, else ``metric=``, else ``"kld"``
        when ``ep``'s first output is logits over a vocabulary (``first_output``); one line when it is not."""
        if self.kld is not None or self.mse is not None:
            return "kld" if self.kld is not None else "mse"
        if self.metric is not None:
            return self.metric
        shape, vocabularies = first_output(ep)
        if shape and shape[-1] in vocabularies:
            return "kld"
        name, value = ("bits", self.bits) if self.bits is not None else ("bytes", self.bytes)
        raise PrecastError(
            f"WeightBudget: {name}={value!r}: the program's first output (shape {shape}) is not logits over a "
            f"vocabulary (no embedding table it reads has {shape[-1] if shape else '?'} rows), so a KL estimate "
            "would misread it: give metric='mse' (squared output error: embeddings, features, regression) or "
            "metric='kld' (the output is a classifier's logits)"
        )


def first_output(ep: ExportedProgram) -> tuple[tuple[int, ...] | None, set[int]]:
    """The shape of ``ep``'s first user output (None: not a tensor) and the row counts of the embedding tables it
    reads (in its regions too)."""
    (out,) = [n for n in ep.graph.nodes if n.op == "output"]
    kinds = [s.kind for s in ep.graph_signature.output_specs]
    first = out.args[0][kinds.index(OutputKind.USER_OUTPUT)] if OutputKind.USER_OUTPUT in kinds else None
    val = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    shape = tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) and val.dim() else None
    rows = set()
    for gm in ep.graph_module.modules():
        for node in gm.graph.nodes if isinstance(gm, torch.fx.GraphModule) else ():
            if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
                table = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
                if isinstance(table, torch.Tensor) and table.dim() == 2:
                    rows.add(int(table.shape[0]))
    return shape, rows


WeightBudget = Budget  # its name before precast.quant: kept one release
NOT_MEASURED = (
    "not measured by the budget (it estimates linear and embedding weights only): kept float; name them in "
    "weight_format= rules to store them in 8 bits"
)


@dataclass
class BudgetChoice:
    """What a budget chose: the allocation, the costs it was made from, the int4 parts fitted on data (None:
    round-to-nearest)."""

    allocation: Allocation
    costs: WeightCosts
    record: dict = field(default_factory=dict)  # the last to_json, updated in place when restated as stored
    fitted: Fitted | None = None

    def to_json(self, budget: Budget) -> dict:
        counts: dict[str, int] = {}
        for f in self.allocation.formats.values():
            counts[f] = counts.get(f, 0) + 1
        elements = sum(torch.Size(w.shape).numel() for w in self.costs.weights.values())
        self.record.update(
            {
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
                "rounding": budget.rounding,
                "rounding_seconds": self.fitted.seconds if self.fitted is not None else 0.0,
            }
        )
        return self.record


def choose(ep: Any, budget: Budget, float_dtype: torch.dtype, formats_only: bool = False) -> BudgetChoice:
    """Estimate the costs on ``ep`` (its fp32 weights) and allocate under the budget; one line when nothing fits."""
    budget.check()
    metric = budget.metric_for(ep)  # before minutes of fitting and measuring
    fitted = None
    if budget.rounding == "data":
        fitted = fit_int4(ep, budget.data, budget.formats, float_dtype, progress=budget.rounding_progress)
        give_back()  # the statistics' sums (400 MB for SmolLM2-135M) before the backward passes
    costs = estimate_costs(
        ep,
        budget.data,
        budget.formats,
        float_dtype=float_dtype,
        metric=metric,
        probes=budget.probes,
        progress=budget.progress,
        fitted=fitted,
    )
    if metric != costs.metric:
        raise PrecastError(f"WeightBudget: {metric} budget on a {costs.metric} estimate")
    return BudgetChoice(allocated(costs, budget), costs, fitted=fitted)


def allocated(costs: WeightCosts, budget: Budget) -> Allocation:
    """The cheapest formats under the budget; one line when even the cheapest do not fit."""
    elements = sum(torch.Size(w.shape).numel() for w in costs.weights.values())
    cap = (
        budget.bytes
        if budget.bytes is not None
        else budget.bits * elements / 8
        if budget.bits is not None
        else None
    )
    if cap is None:
        return allocate(costs, error=budget.kld if budget.kld is not None else budget.mse)
    cheapest = allocate(costs, error=float("inf"))
    if cheapest.bytes > cap:
        raise PrecastError(
            f"WeightBudget: the cheapest formats take {cheapest.bytes} bytes "
            f"({8 * cheapest.bytes / elements:.3f} bits per weight, every scale and zero point as stored), over "
            "the budget; raise it or add a smaller format"
        )
    return allocate(costs, max_bytes=cap)


def as_stored(costs: WeightCosts, read_dtypes: Mapping[str, set[torch.dtype]]) -> WeightCosts:
    """``costs`` with each (weight, format)'s bytes as the conversion stores them (``WeightFormat.stored_bits``:
    one scale copy per grid (``scale_grid``), every zero point, a float copy per read dtype); the estimate
    measured one bf16 scale vector per weight."""
    weights = {}
    for name, w in costs.weights.items():
        dtypes = read_dtypes.get(name) or {costs.float_dtype}
        numel = torch.Size(w.shape).numel()
        stored = {f: round(numel * parse_format(f).stored_bits(w.shape, dtypes) / 8) for f in w.bytes}
        weights[name] = dataclasses.replace(w, bytes=stored)
    return dataclasses.replace(costs, weights=weights)


@dataclass(frozen=True)
class BudgetRules(WeightRules):
    """The budget's choice as one rule per weight, chosen again by the quantizing pass once it knows the dtypes
    each weight is read in (``for_reads``): the knapsack then counts every scale and zero point as stored, and the
    report's record (``choice.record``) says what was stored."""

    choice: BudgetChoice | None = field(default=None, compare=False)
    budget: Budget | None = field(default=None, compare=False)

    def for_reads(self, read_dtypes: Mapping[str, set]) -> WeightRules:
        costs = as_stored(self.choice.costs, read_dtypes)
        self.choice.allocation, self.choice.costs = allocated(costs, self.budget), costs
        self.choice.to_json(self.budget)  # the report's record (the dict to_json returned before), updated
        formats = dict(self.choice.allocation.formats)
        unmeasured = sorted(set(read_dtypes) - set(costs.weights))  # convolution weights: estimate reads none
        if unmeasured:
            formats.update(dict.fromkeys(unmeasured, "float"))
            self.choice.record["not_measured"] = {"weights": unmeasured, "why": NOT_MEASURED}
        exact = WeightRules.exact(formats, self.source)
        return dataclasses.replace(exact, fitted=self.fitted)


def choose_weights(state: Any, budget: Budget) -> BudgetChoice:
    """The conversion's weight rules from the budget (measured on the captured program's fp32 weights, or on
    ``budget.program``'s when given: checked to be the same weights)."""
    low = state.low if state.policy is not None and state.low is not None else torch.float32
    with timed("weight_budget"):
        if budget.program is not None:  # before minutes of measuring
            same_weights(budget.program, state.captured)
        choice = choose(budget.program if budget.program is not None else state.captured, budget, low)
        give_back()  # the measuring freed ~1 GB the heap would keep (precast.memory)
    plain = WeightRules.exact(choice.allocation.formats, "the weight budget")
    rules = BudgetRules(
        plain.rules, plain.source, literal=True, fitted=choice.fitted, choice=choice, budget=budget
    )
    state.weight_rules = state.program.weight_rules = rules
    return choice


def fit_weights(state: Any, data: Any, names: Iterable[str] | None = None) -> Any:
    """``WeightOptions(data=)``: the int4 formats the conversion's rules name, fitted on ``data`` (measured on the
    captured program's fp32 weights, scales in the policy's dtype) and stored in place of round-to-nearest's;
    ``names``: those weights only (a plan's fitted ones: the others it rounded to nearest)."""
    low = state.low if state.policy is not None and state.low is not None else torch.float32
    rules = state.weight_rules
    with timed("weight_fit"):
        fitted = fit_int4(state.captured, data, rules.int4, low, names=names)
        give_back()
    state.weight_rules = state.program.weight_rules = dataclasses.replace(rules, fitted=fitted)
    return fitted


def same_weights(measured: ExportedProgram, converted: ExportedProgram) -> None:
    """Every weight ``measured`` could measure (each 2-d floating parameter or constant: those ``weight_reads``
    draws from) is the converted program's, by name, shape and value (the same tensor, or equal values); one line
    naming the first that is not."""
    for name, mine in [*measured.state_dict.items(), *measured.constants.items()]:
        if not isinstance(mine, torch.Tensor) or not mine.is_floating_point() or mine.dim() != 2:
            continue
        theirs = converted.state_dict.get(name, converted.constants.get(name))
        if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
            where = "is missing" if theirs is None else f"is {tuple(theirs.shape)}, not {tuple(mine.shape)}"
            raise PrecastError(
                f"WeightBudget: program= is not over the converted program's weights: {name} {where} there; "
                "give the same model exported otherwise (e.g. another cache length), or no program="
            )
        shared = mine.data_ptr() == theirs.data_ptr() and mine.stride() == theirs.stride()  # the same storage
        if not (shared and mine.dtype == theirs.dtype) and not torch.equal(mine, theirs):
            raise PrecastError(
                f"WeightBudget: program= holds other values for {name} than the converted program; give the same "
                "model's weights, or no program="
            )
