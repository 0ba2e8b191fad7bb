"""Policy "rules" (Torch-TensorRT / ModelOpt AutoCast style): every compute op runs in the low dtype, except
where a rule says fp32. Each rule is a small function with a name; the name, the value it measured and its
limit go on the Decision, so the report reads ``layer_norm_3: fp32 (data_max: absmax of its output 7.1e+04 >
512) at model.py:57``.

Order of authority (first answer wins): the program's autocast regions (classify), ``include_nodes`` /
``include_ops`` (force low), ``exclude_nodes``, ``exclude_ops``, ``custom_rules``, the precision-sensitive
``patterns`` (``precast.policy.patterns``), ``init_max``, ``data_max``, ``flush_to_zero`` (``data_min``),
``max_reduction_depth``, the accuracy fallback (``tolerance``), then the default: low precision.

Ops are of three kinds. *Compute* ops (matmuls, convolutions, elementwise math, reductions, norms...) get
the dtype the rules give and their floating inputs are cast to it. *Follow* ops (views, shape and index ops,
concatenation, comparisons, exact selections such as max/relu, explicit casts) are never cast: they run in the
dtype of their inputs. *In-place* ops are never cast either: their mutated argument must stay the tensor it is.
Integer, bool and float64 tensors are never cast.

Input: ``RulesPolicy`` options, the Program, calibration, fallback overrides. Output: ``RulesDecider``,
whose ``decide(node, args, kwargs)`` returns a Decision naming its rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from precast.dtypes import dtype_name
from precast.errors import module_path
from precast.ir.program import Program
from precast.policy.base import Decision
from precast.policy.rules import patterns as sensitive
from precast.policy.rules.measures import Calibration, _scalar_beyond, reduction_depth
from precast.policy.rules.options import RuleOptions, match_node, matches_op
from precast.policy.rules.taxonomy import FP32_KERNEL_OPS, casts_for, op_kind, op_name

# a custom rule: (node, context) -> reason to keep the node in fp32, or None
CustomRule = Callable[[torch.fx.Node, "RuleContext"], "str | None"]


# ---- option parsing -------------------------------------------------------------------------------------


# ---- measurements ---------------------------------------------------------------------------------------


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

    def options(self, low: torch.dtype) -> RuleOptions:
        """The checked options for one conversion to ``low`` (one clear error per bad option)."""
        as_tuple = lambda v: (v,) if isinstance(v, str) else tuple(v)  # noqa: E731
        return RuleOptions.build(
            low,
            exclude_nodes=as_tuple(self.exclude_nodes),
            exclude_ops=as_tuple(self.exclude_ops),
            include_nodes=as_tuple(self.include_nodes),
            include_ops=as_tuple(self.include_ops),
            data_max=self.data_max,
            init_max=self.init_max,
            max_reduction_depth=self.max_reduction_depth,
            custom_rules=tuple(self.custom_rules),
            patterns=self.patterns
            if self.patterns is None or isinstance(self.patterns, str)
            else tuple(self.patterns),
        )

    def bind(
        self,
        program: Program,
        opts: RuleOptions,
        calibration: Calibration | None = None,
        fallback: dict[str, float] | None = None,
        device_fp32: dict[str, str] | None = None,
    ) -> RulesDecider:
        """The decider classify asks for one program: options, calibration statistics, the ops the
        tolerance search keeps in fp32 (``fallback``: node -> error score), and the ops that have no
        low-precision kernel on the device (``device_fp32``: node -> what failed)."""
        return RulesDecider(program, opts, calibration, fallback=fallback, device_fp32=device_fp32)


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

    def _const_absmax(self, name: str, t: torch.Tensor) -> float:
        if name not in self._absmax:
            t = t.detach()
            self._absmax[name] = t.abs().max().item() if t.is_floating_point() and t.numel() else 0.0
        return self._absmax[name]

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        d = self._decide(node, args, kwargs)
        if d is not None:
            self.decided[node.name] = d
        return d

    def _decide(self, node, args, kwargs) -> Decision | None:
        kind = op_kind(node, args, kwargs)
        if kind == "inplace":
            return None
        o, low, fp32 = self.opts, self.opts.low, torch.float32

        def make(dtype, source, rule, reason, measured=None, limit=None):
            return Decision(
                dtype,
                source,
                rule,
                reason,
                casts=casts_for(node, args, kwargs, dtype),
                measured=measured,
                limit=limit,
            )

        hit = match_node(node, o.include_nodes)
        if hit:
            return make(low, "user", "include_nodes", f"include_nodes: {hit}")
        op = matches_op(node.target, o.include_ops)
        if op is not None:
            return make(low, "user", "include_ops", f"include_ops: {op}")
        hit = match_node(node, o.exclude_nodes)
        if hit:
            return make(fp32, "user", "exclude_nodes", f"exclude_nodes: {hit}")
        op = matches_op(node.target, o.exclude_ops)
        if op is not None:
            return make(fp32, "user", "exclude_ops", f"exclude_ops: {op}")
        scalar = _scalar_beyond(node, args, kwargs, low)
        if scalar is not None:
            name, value = scalar
            return make(
                fp32,
                "rules",
                "scalar_range",
                f"scalar_range: its {name} {value:.3g} is beyond {dtype_name(low)}'s range (the op would fail "
                "there)",
                abs(float(value)),
                float(torch.finfo(low).max),
            )
        if kind != "compute":
            return None
        if node.name in self.device_fp32:
            return make(
                fp32,
                "rules",
                "no_low_kernel",
                f"no low-precision kernel on this device: {self.device_fp32[node.name]}",
            )
        if op_name(node.target) in FP32_KERNEL_OPS:
            return make(
                fp32,
                "rules",
                "fp32_kernel",
                "fp32_kernel: its kernel computes in float32 for low-precision inputs, so lowering them would "
                "only add a run-time upcast of the weights it reads",
            )
        consts = None
        if o.custom_rules:
            consts = self.constants_of(node)
            ctx = self._context(node, args, kwargs, consts)
            for rule in o.custom_rules:
                reason = rule(node, ctx)
                if reason:
                    rname = getattr(rule, "__name__", type(rule).__name__)
                    return make(fp32, "user", f"custom:{rname}", f"custom rule {rname}: {reason}")
        hit = self.sensitive.get(node.name)
        if hit is not None:
            return make(fp32, "rules", f"pattern:{hit.pattern}", hit.reason)
        if o.init_max is not None:
            consts = consts if consts is not None else self.constants_of(node)
            for cname, t in consts.items():
                m = self._const_absmax(cname, t)
                if m > o.init_max:
                    return make(
                        fp32,
                        "rules",
                        "init_max",
                        f"init_max: constant {cname} absmax {m:.3g} > {o.init_max:g}",
                        m,
                        o.init_max,
                    )
        if o.data_max is not None and self.calibration is not None:
            found = self._data_range(node)
            if found is not None and found[0] > o.data_max:
                m, what = found
                return make(
                    fp32,
                    "rules",
                    "data_max",
                    f"data_max: absmax {m:.3g} of {what} > {o.data_max:g}",
                    m,
                    o.data_max,
                )
        if o.data_min is not None and self.calibration is not None:
            found = self._data_floor(node)
            if found is not None:
                m, what = found
                return make(
                    fp32,
                    "rules",
                    "flush_to_zero",
                    f"flush_to_zero: absmax {m:.3g} of {what} < {o.data_min:.3g}, the smallest normal "
                    f"{dtype_name(low)}: in {dtype_name(low)} its values would be subnormal or flush to zero",
                    m,
                    o.data_min,
                )
        if o.max_reduction_depth is not None:
            depth = reduction_depth(node, args, kwargs)
            if depth is not None and depth[0] > o.max_reduction_depth:
                return make(
                    fp32,
                    "rules",
                    "max_reduction_depth",
                    f"max_reduction_depth: accumulates over {depth[0]} ({depth[1]}) > {o.max_reduction_depth}",
                    float(depth[0]),
                    float(o.max_reduction_depth),
                )
        if node.name in self.fallback:
            score = self.fallback[node.name]
            return make(
                fp32,
                "rules",
                "tolerance",
                f"tolerance: among the ops whose low precision costs most accuracy (estimated share of the "
                f"all-low error: {score:.3g} of the allowed error)",
                score,
            )
        return make(low, "rules", "default", f"{dtype_name(low)}: no rule keeps it in fp32")

    def _data_range(self, node: torch.fx.Node) -> tuple[float, str] | None:
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

    def _data_floor(self, node: torch.fx.Node) -> tuple[float, str] | None:
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

    def _context(self, node, args, kwargs, consts) -> RuleContext:
        stats = self.calibration.stats if self.calibration else {}
        return RuleContext(
            node=node,
            args=args,
            kwargs=kwargs,
            low=self.opts.low,
            module=module_path(node),
            stats=stats.get(node.name),
            input_stats={a.name: stats[a.name] for a in node.all_input_nodes if a.name in stats},
            constants=consts,
        )


# ---- the conversion ---------------------------------------------------------------------------------------
