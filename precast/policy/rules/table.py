"""The rules of the rules policy as named objects in an ordered table: each a small function with the name the
report prints and a docstring, asked in order; the first that answers decides the op.

A ``Rule`` is ``check(call) -> Decision | None``. ``RuleCall`` is one op as a rule sees it: the node, its (fake)
argument values, and the decider it is asked for (options, calibration, the matched patterns, the ops the
tolerance search and the device fallback keep fp32). A user's ``custom_rules`` become rules of the same kind
(``custom_rule``). ``rules_table(opts)`` is the table of policy "rules"; policy "auto" composes it with its
own last rules instead of the ``DEFAULT`` one (``precast.policy.auto``).

Input: a ``RuleCall``. Output: a Decision naming its rule, or None (the next rule is asked).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx

from precast.dtypes import dtype_name
from precast.policy.base import Decision
from precast.policy.rules.measures import reduction_depth, scalar_beyond
from precast.policy.rules.options import RuleOptions, match_node, matches_op
from precast.policy.rules.taxonomy import FP32_KERNEL_OPS, casts_for, op_name

if TYPE_CHECKING:
    from precast.policy.measurements import Calibration


class Asker(Protocol):
    """What a rule reads of the decider asking it (``precast.policy.rules.policy.RulesDecider``)."""

    opts: RuleOptions
    calibration: Calibration | None
    sensitive: dict  # node -> the precision-sensitive pattern it belongs to
    device_fp32: dict[str, str]  # node -> what failed: the device fallback's ops
    fallback: dict[str, float]  # node -> score: the tolerance search's ops

    def constants_of(self, node: torch.fx.Node) -> dict[str, torch.Tensor]: ...
    def const_absmax(self, name: str, t: torch.Tensor) -> float: ...
    def data_range(self, node: torch.fx.Node) -> tuple[float, str] | None: ...
    def data_floor(self, node: torch.fx.Node) -> tuple[float, str] | None: ...
    def context(self, call: RuleCall) -> Any: ...


@dataclass
class RuleCall:
    """One op as a rule sees it: the node, its arguments' (fake) values, the decider asking."""

    node: torch.fx.Node
    args: tuple
    kwargs: dict
    decider: Asker

    @property
    def opts(self) -> RuleOptions:
        return self.decider.opts

    @property
    def low(self) -> torch.dtype:
        return self.decider.opts.low

    @functools.cached_property
    def constants(self) -> dict[str, torch.Tensor]:
        """The node's constant inputs (parameters, buffers), by input node name (looked up once per op)."""
        return self.decider.constants_of(self.node)

    def decision(
        self,
        dtype: torch.dtype,
        source: str,
        rule: str,
        reason: str,
        measured: float | None = None,
        limit: float | None = None,
    ) -> Decision:
        """A Decision with the casts that bring the op's floating inputs to ``dtype``."""
        casts = casts_for(self.node, self.args, self.kwargs, dtype)
        return Decision(dtype, source, rule, reason, casts=casts, measured=measured, limit=limit)


@dataclass(frozen=True)
class Rule:
    """A named rule: ``check(call)`` returns a Decision or None. ``compute_only``: asked only for compute ops
    (``precast.policy.rules.taxonomy.op_kind``); the others are asked for follow ops too."""

    name: str
    check: Callable[[RuleCall], Decision | None]
    compute_only: bool = True

    def __call__(self, call: RuleCall) -> Decision | None:
        return self.check(call)

    @property
    def doc(self) -> str:
        return (self.check.__doc__ or "").strip()


def rule(name: str, *, compute_only: bool = True) -> Callable[[Callable], Rule]:
    """Decorator: the function becomes a ``Rule`` named ``name``."""
    return lambda fn: Rule(name, fn, compute_only)


def custom_rule(fn: Callable[[torch.fx.Node, Any], str | None] | Rule) -> Rule:
    """A user's ``custom_rules`` entry as a rule: ``fn(node, context) -> reason to keep it fp32 | None``
    (``precast.policy.rules.policy.RuleContext``); a ``Rule`` is kept as it is."""
    if isinstance(fn, Rule):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)

    def check(call: RuleCall) -> Decision | None:
        reason = fn(call.node, call.decider.context(call))
        if not reason:
            return None
        return call.decision(torch.float32, "user", f"custom:{name}", f"custom rule {name}: {reason}")

    return Rule(f"custom:{name}", check)


# ---- the user's include / exclude options (source "user") ------------------------------------------------


def _listed(call: RuleCall, option: str, dtype: torch.dtype) -> Decision | None:
    """The user's include / exclude ``option``: ``dtype`` for an op it lists (``*_nodes``: a pattern matching
    the node's name or module path; ``*_ops``: the op), saying what matched; None for any other op."""
    listed = getattr(call.opts, option)
    hit = match_node(call.node, listed) if option.endswith("_nodes") else matches_op(call.node.target, listed)
    return None if hit is None else call.decision(dtype, "user", option, f"{option}: {hit}")


@rule("include_nodes", compute_only=False)
def include_nodes(call: RuleCall) -> Decision | None:
    """A node whose name or module path matches ``include_nodes`` runs in the low dtype."""
    return _listed(call, "include_nodes", call.low)


@rule("include_ops", compute_only=False)
def include_ops(call: RuleCall) -> Decision | None:
    """An op listed in ``include_ops`` runs in the low dtype."""
    return _listed(call, "include_ops", call.low)


@rule("exclude_nodes", compute_only=False)
def exclude_nodes(call: RuleCall) -> Decision | None:
    """A node whose name or module path matches ``exclude_nodes`` stays fp32."""
    return _listed(call, "exclude_nodes", torch.float32)


@rule("exclude_ops", compute_only=False)
def exclude_ops(call: RuleCall) -> Decision | None:
    """An op listed in ``exclude_ops`` stays fp32."""
    return _listed(call, "exclude_ops", torch.float32)


# ---- the policy's own rules (source "rules") ----------------------------------------------------------------


@rule("scalar_range", compute_only=False)
def scalar_range(call: RuleCall) -> Decision | None:
    """A Scalar argument beyond the low dtype's range (an fp32 ``finfo.min`` baked in by export): the op would
    fail in the low dtype, so it stays fp32."""
    found = scalar_beyond(call.node, call.args, call.kwargs, call.low)
    if found is None:
        return None
    name, value = found
    return call.decision(
        torch.float32,
        "rules",
        "scalar_range",
        f"scalar_range: its {name} {value:.3g} is beyond {dtype_name(call.low)}'s range (the op would fail "
        "there)",
        abs(float(value)),
        float(torch.finfo(call.low).max),
    )


@rule("no_low_kernel")
def no_low_kernel(call: RuleCall) -> Decision | None:
    """An op the device fallback found without a low-precision kernel on this device stays fp32."""
    what = call.decider.device_fp32.get(call.node.name)
    if what is None:
        return None
    return call.decision(
        torch.float32, "rules", "no_low_kernel", f"no low-precision kernel on this device: {what}"
    )


@rule("fp32_kernel")
def fp32_kernel(call: RuleCall) -> Decision | None:
    """An op whose kernel computes in float32 for low-precision inputs (weight norm) stays fp32: lowering its
    inputs would only add a run-time upcast of the weights it reads (``taxonomy.FP32_KERNEL_OPS``)."""
    if op_name(call.node.target) not in FP32_KERNEL_OPS:
        return None
    return call.decision(
        torch.float32,
        "rules",
        "fp32_kernel",
        "fp32_kernel: its kernel computes in float32 for low-precision inputs, so lowering them would "
        "only add a run-time upcast of the weights it reads",
    )


@rule("pattern")
def pattern(call: RuleCall) -> Decision | None:
    """An op in a precision-sensitive subgraph (``precast.policy.rules.patterns``) stays fp32."""
    hit = call.decider.sensitive.get(call.node.name)
    return (
        None if hit is None else call.decision(torch.float32, "rules", f"pattern:{hit.pattern}", hit.reason)
    )


@rule("init_max")
def init_max(call: RuleCall) -> Decision | None:
    """An op reading a constant whose absmax exceeds ``init_max`` stays fp32."""
    limit = call.opts.init_max
    if limit is None:
        return None
    for cname, t in call.constants.items():
        m = call.decider.const_absmax(cname, t)
        if m > limit:
            reason = f"init_max: constant {cname} absmax {m:.3g} > {limit:g}"
            return call.decision(torch.float32, "rules", "init_max", reason, m, limit)
    return None


@rule("data_max")
def data_max(call: RuleCall) -> Decision | None:
    """An op whose output or activation input exceeds ``data_max`` on the calibration data stays fp32."""
    limit = call.opts.data_max
    if limit is None or call.decider.calibration is None:
        return None
    found = call.decider.data_range(call.node)
    if found is None or not found[0] > limit:
        return None
    m, what = found
    return call.decision(
        torch.float32, "rules", "data_max", f"data_max: absmax {m:.3g} of {what} > {limit:g}", m, limit
    )


@rule("flush_to_zero")
def flush_to_zero(call: RuleCall) -> Decision | None:
    """An op whose output or activation input stays below the low dtype's smallest normal (``data_min``) on the
    calibration data stays fp32: in the low dtype its values would be subnormal or flush to zero."""
    limit = call.opts.data_min
    if limit is None or call.decider.calibration is None:
        return None
    found = call.decider.data_floor(call.node)
    if found is None:
        return None
    m, what = found
    low = dtype_name(call.low)
    reason = (
        f"flush_to_zero: absmax {m:.3g} of {what} < {limit:.3g}, the smallest normal "
        f"{low}: in {low} its values would be subnormal or flush to zero"
    )
    return call.decision(torch.float32, "rules", "flush_to_zero", reason, m, limit)


@rule("max_reduction_depth")
def max_reduction_depth(call: RuleCall) -> Decision | None:
    """A reduction accumulating over more than ``max_reduction_depth`` elements stays fp32."""
    limit = call.opts.max_reduction_depth
    if limit is None:
        return None
    depth = reduction_depth(call.node, call.args, call.kwargs)
    if depth is None or not depth[0] > limit:
        return None
    reason = f"max_reduction_depth: accumulates over {depth[0]} ({depth[1]}) > {limit}"
    return call.decision(torch.float32, "rules", "max_reduction_depth", reason, float(depth[0]), float(limit))


@rule("tolerance")
def tolerance(call: RuleCall) -> Decision | None:
    """An op the tolerance search keeps fp32 (its low precision costs most of the allowed error)."""
    score = call.decider.fallback.get(call.node.name)
    if score is None:
        return None
    reason = (
        f"tolerance: among the ops whose low precision costs most accuracy (estimated share of the "
        f"all-low error: {score:.3g} of the allowed error)"
    )
    return call.decision(torch.float32, "rules", "tolerance", reason, score)


@rule("default")
def default(call: RuleCall) -> Decision | None:
    """Every other compute op runs in the low dtype."""
    return call.decision(call.low, "rules", "default", f"{dtype_name(call.low)}: no rule keeps it in fp32")


DEFAULT = default
BEFORE_CUSTOM = (
    include_nodes,
    include_ops,
    exclude_nodes,
    exclude_ops,
    scalar_range,
    no_low_kernel,
    fp32_kernel,
)
AFTER_CUSTOM = (pattern, init_max, data_max, flush_to_zero, max_reduction_depth, tolerance)


def keep_rules(opts: RuleOptions) -> tuple[Rule, ...]:
    """Every rule of policy "rules" before its default, in order; the user's custom rules in their place."""
    return BEFORE_CUSTOM + tuple(custom_rule(r) for r in opts.custom_rules) + AFTER_CUSTOM


def rules_table(opts: RuleOptions) -> tuple[Rule, ...]:
    """The ordered table of policy "rules": the rules that keep an op fp32 (or force it low), then ``DEFAULT``."""
    return (*keep_rules(opts), DEFAULT)


def is_default(decision: Decision | None) -> bool:
    """Whether no rule but the default decided (the op is the policy's own low choice)."""
    return decision is not None and decision.rule == DEFAULT.name and decision.source == "rules"
