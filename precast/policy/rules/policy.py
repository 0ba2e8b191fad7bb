"""Policy "rules" (Torch-TensorRT / ModelOpt AutoCast style): every compute op runs in the low dtype, except
where a rule says fp32. Each rule is a named object in an ordered table (``precast.policy.rules.table``); the
name, the value it measured and its limit go on the Decision, so the report reads ``layer_norm_3: fp32 (data_max: absmax of its output 7.1e+04 >
512) at model.py:57``.

Order of authority (first answer wins): the program's autocast regions (classify), ``include_nodes`` /
``include_ops`` (force low), ``exclude_nodes``, ``exclude_ops``, ``custom_rules``, the precision-sensitive
``patterns`` (``precast.policy.rules.patterns``), ``init_max``, ``data_max``, ``flush_to_zero`` (``data_min``),
``max_reduction_depth``, the tolerance search's choice (``tolerance``), then the default: low precision.
Before the custom rules: ``scalar_range`` and ``no_low_kernel`` (the device fallback's ops).

Ops are of three kinds. *Compute* ops (matmuls, convolutions, elementwise math, reductions, norms...) get
the dtype the rules give and their floating inputs are cast to it. *Follow* ops (views, shape and index ops,
concatenation, comparisons, exact selections such as max/relu, explicit casts) are never cast: they run in the
dtype of their inputs. *In-place* ops are never cast either: their mutated argument must stay the tensor it is.
Integer, bool and float64 tensors are never cast.

Input: ``RulesPolicy`` options, the Program, calibration, the tolerance search's and the device fallback's
fp32 overrides. Output: ``RulesDecider``,
whose ``decide(node, args, kwargs)`` returns a Decision naming its rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from precast.errors import module_path
from precast.ir.program import Program
from precast.policy.base import Decision
from precast.policy.rules import patterns as sensitive
from precast.policy.rules.options import RuleOptions
from precast.policy.rules.table import Rule, RuleCall, is_default, rules_table
from precast.policy.rules.taxonomy import op_kind

if TYPE_CHECKING:
    from precast.policy.measurements import Calibration

# a custom rule: (node, context) -> reason to keep the node in fp32, or None
CustomRule = Callable[[torch.fx.Node, "RuleContext"], "str | None"]


@dataclass
class RuleContext:
    """What a custom rule sees: fake values of the arguments, calibration ranges, constants."""

    node: torch.fx.Node
    args: tuple
    kwargs: dict
    low: torch.dtype
    module: str
    stats: Any  # NodeStats of this node's output, or None without calibration
    input_stats: dict  # input node name -> NodeStats
    constants: dict  # input node name -> real constant tensor (parameters, buffers)


@dataclass(frozen=True)
class RulesPolicy:
    """``policy="rules"`` as an object: every compute op in the low dtype except where a rule says fp32.

    Holds the rules options (the same keywords ``convert(policy="rules", ...)`` takes, which is a shorthand for
    ``convert(policy=RulesPolicy(...))``); nothing in it changes during a conversion, so one object serves any
    number of conversions. ``dtype``: the low dtype (default: the device's autocast dtype).
    """

    dtype: torch.dtype | str | None = None
    exclude_nodes: tuple = ()
    exclude_ops: tuple = ()
    include_nodes: tuple = ()
    include_ops: tuple = ()
    data_max: float | None = None
    init_max: float | None = None
    max_reduction_depth: int | None = None
    calibration: Any = None
    tolerance: Any = None
    custom_rules: tuple = ()
    patterns: Any = None
    name: str = field(default="rules", init=False)
    # hooks (precast.policy.hooks.PolicyHooks): outputs keep their dtypes, the difference from the unconverted
    # program is information, the device fallback retries ops without a low-precision kernel in fp32
    keep_io_types: ClassVar[bool] = True
    reference: ClassVar[str] = "measured"
    prepare_steps: ClassVar[tuple[str, ...]] = ("calibrate", "tolerance")
    after_lowering: ClassVar[tuple[str, ...]] = ("device_fallback",)
    decider: ClassVar[type[RulesDecider]]  # what bind returns (set below, once RulesDecider exists)

    def tolerance_candidate(self, decision: Decision) -> bool:
        """The tolerance search may keep fp32 the ops no rule but the default put low."""
        return is_default(decision)

    def options(self, low: torch.dtype) -> RuleOptions:
        """The checked options for one conversion to ``low`` (one clear error per bad option): this policy's
        fields, but the data (calibration, tolerance), as ``RuleOptions.build`` takes them."""
        given = {}
        for f in dataclasses.fields(RulesPolicy):  # the rules fields only (a subclass adds its own)
            if not f.init or f.name in ("dtype", "calibration", "tolerance"):
                continue
            value = getattr(self, f.name)
            if f.default == ():  # a sequence; one pattern or op name alone is one entry
                value = (value,) if isinstance(value, str) and f.name != "custom_rules" else tuple(value)
            elif f.name == "patterns" and value is not None and not isinstance(value, str):
                value = tuple(value)
            given[f.name] = value
        return RuleOptions.build(low, **given)

    def bind(
        self, program: Program, opts: RuleOptions, calibration: Calibration | None = None, **found: Any
    ) -> RulesDecider:
        """The decider classify asks for one program (``precast.policy.hooks.PolicyHooks.bind``): ``found`` is
        what the conversion found before this lowering, handed to the decider as it is: ``fallback`` (the
        tolerance search's fp32 ops), ``device_fp32`` (the device check's), a subclass's own (auto's
        ``latencies``, ``all_fp32``). The keywords are the decider's (``decider``), defined there only."""
        return self.decider(program, opts, calibration, **found)


class RulesDecider:
    """The rules policy bound to one program; its ``decide`` is asked for every op outside autocast regions."""

    name = "rules"

    def __init__(
        self,
        program: Program,
        opts: RuleOptions,
        calibration: Calibration | None = None,
        fallback: dict[str, float] | None = None,
        device_fp32: dict[str, str] | None = None,
    ):
        self.program, self.opts, self.calibration = program, opts, calibration
        self.rules: tuple[Rule, ...] = rules_table(opts)  # asked in order, the first answer decides
        # node -> what failed: ops the device check found without a low-precision kernel on this device
        self.device_fp32: dict[str, str] = dict(device_fp32 or {})
        # node -> estimated error share: kept fp32 by the tolerance search (given here only, never changed)
        self.fallback: dict[str, float] = dict(fallback or {})
        self.decided: dict[str, Decision] = {}  # what it decided, for reporting
        self._absmax: dict[str, float] = {}
        # precision-sensitive subgraphs, matched once on the graph as it stands before any decision
        self.sensitive: dict[str, sensitive.Match] = sensitive.mark(
            program.graph,
            opts.patterns,
            parameters={n.name for n, spec in program.input_spec.items() if spec.kind == InputKind.PARAMETER},
            constant=program.constant_value,
        )

    def autocast_state(self, device_type: str) -> None:
        return None

    # constant tensors of a node's inputs, by input node name
    def constants_of(self, node: torch.fx.Node) -> dict[str, torch.Tensor]:
        out = {}
        for a in node.all_input_nodes:
            value = None
            if a.op == "placeholder":
                value = self.program.constant_value(a)
            elif a.op == "get_attr":
                value = getattr(self.program.gm, a.target, None)
            if isinstance(value, torch.Tensor):
                out[a.name] = value
        return out

    def const_absmax(self, name: str, t: torch.Tensor) -> float:
        if name not in self._absmax:
            if t.device.type == "meta":  # streamed weights: its value is read from the file, once
                node = next(n for n in self.program.graph.nodes if n.name == name)
                target = self.program.constant_target(node)
                self._absmax[name] = self.program.weights.absmax(target)  # type: ignore[union-attr]
            else:
                self._absmax[name] = self.program.absmax(t)
        return self._absmax[name]

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        d = self.ask(self.rules, node, args, kwargs)
        if d is not None:
            self.decided[node.name] = d
        return d

    def ask(self, rules: tuple[Rule, ...], node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        """The first answer of ``rules``, in order (in-place ops are never cast; follow ops are asked only by
        the rules that are not ``compute_only``)."""
        kind = op_kind(node, args, kwargs)
        if kind == "inplace":
            return None
        call = RuleCall(node, args, kwargs, self)
        for r in rules:
            if r.compute_only and kind != "compute":
                continue
            d = r(call)
            if d is not None:
                return d
        return None

    def data_range(self, node: torch.fx.Node) -> tuple[float, str] | None:
        stats = self.calibration.stats
        best = None
        own = stats.get(node.name)
        if own is not None:
            best = (own.absmax, "its output")
        for a in node.all_input_nodes:
            if self.program.constant_target(a) is not None or a.op == "get_attr":
                continue  # constants: init_max's business
            s = stats.get(a.name)
            if s is not None and (best is None or s.absmax > best[0]):
                best = (s.absmax, f"its input {a.name}")
        return best

    def data_floor(self, node: torch.fx.Node) -> tuple[float, str] | None:
        """The smallest nonzero absmax below ``data_min`` among the node's output and floating activation
        inputs (a cast of such an input to the low dtype would flush it), with what it is; None if none."""
        stats, limit = self.calibration.stats, self.opts.data_min
        found = []
        own = stats.get(node.name)
        if own is not None:
            found.append((own.absmax, "its output"))
        for a in node.all_input_nodes:
            if self.program.constant_target(a) is not None or a.op == "get_attr":
                continue  # constants are cast once at conversion; init_max's business
            s = stats.get(a.name)
            if s is not None:
                found.append((s.absmax, f"its input {a.name}"))
        tiny = [f for f in found if 0 < f[0] < limit]
        return min(tiny, key=lambda f: f[0]) if tiny else None

    def context(self, call: RuleCall) -> RuleContext:
        """What a custom rule sees of one op."""
        node, stats = call.node, self.calibration.stats if self.calibration else {}
        return RuleContext(
            node=node,
            args=call.args,
            kwargs=call.kwargs,
            low=self.opts.low,
            module=module_path(node),
            stats=stats.get(node.name),
            input_stats={a.name: stats[a.name] for a in node.all_input_nodes if a.name in stats},
            constants=call.constants,
        )


RulesPolicy.decider = RulesDecider
