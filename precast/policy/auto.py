"""Policy "auto": the rules policy, with each matmul / convolution / attention op's precision chosen by what it
costs on the target device (as TensorRT picks per layer the fastest allowed precision).

Input: per candidate op node, its measured latencies (``OpLatency``: fp32, low precision, and the casts the
low choice forces on its activation inputs and its output; ``precast.numerics.latency`` measures them with
the op's real shapes, cached per device). Output: decisions. An op runs low only when that pays even with
the casts its choice forces (a cast between two low ops is not paid); every other candidate stays fp32.
The accuracy rules (patterns, ``data_max``, ``exclude_ops``, ``tolerance``...) apply as under ``"rules"``: auto
never puts in low precision an op the rules keep fp32. Ops outside the measured families follow their
inputs: low when one of their floating inputs is low, fp32 otherwise; so when no op pays, the program stays
fp32 throughout (bitwise the unconverted program).

Pure decisions: nothing here runs an op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.fx

from precast.dtypes import dtype_name
from precast.ir.op_families import ATTENTION_OPS, CONV_OPS, MATMUL_OPS
from precast.ir.program import Program
from precast.policy.base import Decision
from precast.policy.rules.options import RuleOptions
from precast.policy.rules.policy import RulesDecider, RulesPolicy
from precast.policy.rules.table import Rule, RuleCall, keep_rules, rule
from precast.policy.rules.taxonomy import op_kind, op_name

if TYPE_CHECKING:
    from precast.policy.measurements import Calibration

# the families auto measures (precast.ir.op_families); other ops follow their inputs
MEASURED_OPS = MATMUL_OPS | CONV_OPS | ATTENTION_OPS
# low precision must beat fp32 by this fraction (timing noise on a shared machine is a few percent)
MARGIN = 0.05


@dataclass(frozen=True)
class OpLatency:
    """One op's latencies on the device, in microseconds: fp32, in the low dtype (inputs already low), and
    the casts the low choice forces when its neighbours are fp32 (activation inputs to low, output to fp32;
    constants are cast once at conversion, so they cost nothing)."""

    fp32: float
    low: float
    cast_in: float = 0.0
    cast_out: float = 0.0
    cached: bool = False  # read from the cache, not timed in this conversion
    origin: str = ""  # where the numbers come from, for the report ("" : measured here / from the cache)

    @classmethod
    def of(cls, value: Any) -> OpLatency:
        if isinstance(value, OpLatency):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        return cls(*value)


@dataclass
class Choice:
    """What auto chose for one measured op, and the cost it weighed (µs)."""

    low: bool
    latency: OpLatency
    cost_low: float  # low latency plus the casts its neighbours force
    casts: float  # the casts counted in cost_low


def is_measured(node: torch.fx.Node) -> bool:
    """A node of the families auto measures, computing on floating (not float64) tensors."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if op_name(node.target) not in MEASURED_OPS:
        return False
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.float32,) for v in vals)


def neighbours(graph: torch.fx.Graph, measured: set[str], constants: set[str]) -> tuple[dict, dict]:
    """For each measured node: the measured nodes its activations come from / go to through unmeasured ops,
    with None standing for the program's boundary (a user input / an output)."""
    nodes = {n.name: n for n in graph.nodes}

    def walk(start: torch.fx.Node, step) -> set:
        found, seen, stack = set(), set(), list(step(start))
        while stack:
            n = stack.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            if n.name in measured:
                found.add(n.name)
            elif n.op == "placeholder":
                if n.name not in constants:  # weights are cast once at conversion: no cast at run time
                    found.add(None)
            elif n.op == "output":
                found.add(None)
            elif n.op == "get_attr":
                continue
            else:
                stack.extend(step(n))
            if len(seen) > 200:  # a long unmeasured stretch: count it as the boundary
                found.add(None)
                break
        return found

    up = {m: walk(nodes[m], lambda n: _float_inputs(n)) for m in measured}
    down = {m: walk(nodes[m], lambda n: list(n.users)) for m in measured}
    return up, down


def _float_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    out = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            continue
        out.append(a)
    return out


def choose(
    latencies: Mapping[str, OpLatency],
    up: Mapping[str, set],
    down: Mapping[str, set],
    allowed: set[str] | None = None,
    margin: float = MARGIN,
) -> dict[str, Choice]:
    """Per measured node, low or fp32. Starts from every op whose low kernel alone beats fp32 (and that the
    rules allow low), then drops, until nothing changes, each op that no longer pays with the casts its
    neighbours force; what is left low pays for its own casts, so the measured ops together are never slower
    than in fp32. ``up``/``down``: measured neighbours of each node (None: the program boundary)."""
    allowed = set(latencies) if allowed is None else allowed & set(latencies)
    low = {n for n in allowed if latencies[n].low < latencies[n].fp32 * (1 - margin)}

    def cost(n: str) -> tuple[float, float]:
        lat = latencies[n]
        cin = 0.0 if up.get(n) and all(m in low for m in up[n]) else lat.cast_in
        cout = 0.0 if down.get(n) and all(m in low for m in down[n]) else lat.cast_out
        return lat.low + cin + cout, cin + cout

    changed = True
    while changed:
        changed = False
        for n in sorted(low):
            if cost(n)[0] >= latencies[n].fp32 * (1 - margin):
                low.discard(n)
                changed = True
    out = {}
    for n, lat in latencies.items():
        c, casts = cost(n) if n in low else (lat.low + lat.cast_in + lat.cast_out, lat.cast_in + lat.cast_out)
        out[n] = Choice(n in low, lat, c, casts)
    return out


@dataclass(frozen=True)
class AutoPolicy(RulesPolicy):
    """``policy="auto"`` as an object: the rules policy (same keywords), but a matmul / convolution /
    attention op runs low only where that is faster on the device, casts included. ``latencies``: node name
    -> ``OpLatency`` (or ``(fp32, low, cast_in, cast_out)`` in µs) to use instead of measuring (tests,
    replaying a table); ``cache_dir``: where measurements are cached (default ``$PRECAST_CACHE_DIR`` or the
    user cache dir); ``confirm``: time the converted program against the fp32 program at the end and keep
    fp32 throughout when the converted one is slower."""

    latencies: Mapping[str, Any] | None = None
    cache_dir: str | None = None
    confirm: bool = True
    name: str = field(default="auto", init=False)
    # hooks: the latency step before the tolerance search, the end-to-end confirmation after the device fallback
    prepare_steps: ClassVar[tuple[str, ...]] = ("calibrate", "latency", "tolerance")
    after_lowering: ClassVar[tuple[str, ...]] = ("device_fallback", "auto_confirm")

    def bind(
        self,
        program: Program,
        opts: RuleOptions,
        calibration: Calibration | None = None,
        latencies: Mapping[str, Any] | None = None,
        **found: Any,
    ) -> AutoDecider:
        """``RulesPolicy.bind``, with ``latencies``: the measured table (node -> OpLatency; None: the table given
        to the policy). The other keywords are ``AutoDecider``'s."""
        if latencies is None:  # the table given to the policy
            table = {k: replace(OpLatency.of(v), origin="given") for k, v in (self.latencies or {}).items()}
        else:
            table = {k: OpLatency.of(v) for k, v in latencies.items()}
        return super().bind(program, opts, calibration, latencies=table, **found)


class AutoDecider(RulesDecider):
    """The auto policy bound to one program: the rules decider whose default for a measured op is the measured
    choice, and for every other compute op the dtype of its inputs."""

    name = "auto"

    def __init__(
        self,
        program: Program,
        opts: RuleOptions,
        calibration: Calibration | None = None,
        *,
        latencies: Mapping[str, OpLatency] | None = None,
        all_fp32: str | None = None,
        **found: Any,
    ):
        """``RulesDecider``'s keywords (``found``), and ``latencies`` (node -> OpLatency), ``all_fp32`` (a reason to
        keep every measured op fp32: the end-to-end confirmation found the converted program slower)."""
        super().__init__(program, opts, calibration, **found)
        # the rules of policy "rules" but its default, then auto's own: the measured choice, else follow
        self.keep: tuple[Rule, ...] = keep_rules(opts)
        self.rules = (*self.keep, *AUTO_RULES)
        self.latencies = dict(latencies or {})
        self.all_fp32 = all_fp32
        constants = {n.name for n in program.input_spec if program.constant_target(n) is not None}
        graph = program.graph
        self.measured = {n.name for n in graph.nodes if is_measured(n)}
        up, down = neighbours(graph, self.measured, constants)
        known = {k: v for k, v in self.latencies.items() if k in self.measured}
        # the rules' own answer for each measured op, asked once on the graph as it stands (its export-time
        # values): auto chooses only among the ops no rule keeps fp32
        allowed = set()
        if all_fp32 is None:
            for n in graph.nodes:
                if n.name in known and self._rules_default(n):
                    allowed.add(n.name)
        self.choices = choose(known, up, down, allowed=allowed)

    def _rules_default(self, node: torch.fx.Node) -> bool:
        """Whether no rule of policy "rules" keeps this compute op fp32 (or forces it low): auto may choose."""
        val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
        args = torch.fx.node.map_aggregate(node.args, val)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
        return op_kind(node, args, kwargs) == "compute" and self.ask(self.keep, node, args, kwargs) is None

    # ---- the report's summary ---------------------------------------------------------------------------
    def summary(
        self, note: str = "", timed: int | None = None, cached: int | None = None
    ) -> tuple[str, float | None]:
        """One paragraph for the report: how many measured ops run low, the estimated speedup over the
        measured ops, and, when none pays, why. ``timed``/``cached``: distinct shapes timed now / read from
        the cache (None: the latencies were given). Returns (text, estimated speedup)."""
        lname = dtype_name(self.opts.low)
        chosen = [(n, self.choices[n]) for n in sorted(self.choices)]
        if not chosen:
            return (
                "auto: no matmul/convolution/attention op to measure outside the program's own regions",
                None,
            )
        fp32 = sum(c.latency.fp32 for _, c in chosen)
        after = sum(c.cost_low if c.low else c.latency.fp32 for _, c in chosen)
        n_low = sum(c.low for _, c in chosen)
        est = fp32 / after if after > 0 else None
        origin = (
            "latencies given" if timed is None else f"shapes: {timed} timed now, {cached} read from the cache"
        )
        text = (
            f"auto: {n_low} of {len(chosen)} measured ops run {lname} ({origin}); measured ops {fp32:.1f} µs "
            f"in fp32 -> {after:.1f} µs, estimated speedup {est:.2f}x"
        )
        if self.all_fp32:
            return text + f"; everything kept fp32: {self.all_fp32}", 1.0
        if n_low == 0:
            ops = {n.name: op_name(n.target) for n in self.program.graph.nodes if n.name in self.choices}
            ratios = sorted((c.latency.low / c.latency.fp32, n) for n, c in chosen if c.latency.fp32 > 0)
            (best, bname), worst = ratios[0], ratios[-1][0]
            if best >= 1:
                text += f"; no op pays, every measured op stays fp32: {lname} {ops[bname]} {best:.1f}x slower than fp32 here"
                if worst > best * 1.05:
                    text += f" (up to {worst:.1f}x)"
            else:
                text += (
                    f"; no op pays, every measured op stays fp32: {lname} {ops[bname]} is {1 / best:.1f}x faster than fp32 "
                    "here, but not with the casts it needs"
                )
            if note:
                text += f": {note}"
        return text, est


@rule("auto:measured")
def auto_measured(call: RuleCall) -> Decision | None:
    """A matmul / convolution / attention op runs low only where that is faster on the device, casts included
    (``choose``); one auto could not time stays fp32."""
    auto = call.decider
    if call.node.name not in auto.measured:
        return None
    low, fp32 = call.low, torch.float32
    lname = dtype_name(low)
    c = auto.choices.get(call.node.name)
    if c is None:
        return _auto(call, fp32, "auto:unmeasured", "auto: not measured: kept fp32")
    lat = c.latency
    casts = f" + {c.casts:.1f} µs casts" if c.casts else ""
    where = lat.origin or ("from the cache" if lat.cached else "measured here")
    if c.low:
        reason = (
            f"auto: {lname} {lat.low:.1f} µs{casts} vs fp32 {lat.fp32:.1f} µs ({where}): "
            f"{lat.fp32 / c.cost_low:.2f}x faster"
        )
        return _auto(call, low, "auto:faster", reason, c.cost_low, lat.fp32)
    why = auto.all_fp32 or "low precision does not pay here"
    reason = f"auto: {lname} {lat.low:.1f} µs{casts} vs fp32 {lat.fp32:.1f} µs ({where}): {why}"
    return _auto(call, fp32, "auto:slower", reason, c.cost_low, lat.fp32)


@rule("auto:follow")
def auto_follow(call: RuleCall) -> Decision | None:
    """Every other compute op follows its inputs: low when one of its floating inputs is low, else fp32."""
    low = call.low
    if any(
        isinstance(t, torch.Tensor) and t.dtype == low
        for t in torch.utils._pytree.tree_leaves((call.args, call.kwargs))
    ):
        return _auto(call, low, "auto:follow", f"auto: {dtype_name(low)}, as its inputs")
    return _auto(call, torch.float32, "auto:follow", "auto: fp32, as its inputs")


def _auto(call: RuleCall, dtype, rule_name, reason, measured=None, limit=None) -> Decision:
    return call.decision(dtype, "auto", rule_name, reason, measured, limit)


AUTO_RULES = (auto_measured, auto_follow)


AutoPolicy.decider = AutoDecider
