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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError, module_path
from precast.policy import patterns as sensitive
from precast.policy.autocast import tensor_args
from precast.policy.base import Decision, dtype_name
from precast.policy.calibrate import TOLERANCE_BATCHES, Calibration, calibrate
from precast.policy.op_families import CONV_OPS
from precast.program import Program
from precast.report import Diagnostic, Report

# GEMM_OPS (precast.policy.op_families): what low precision is for; the fallback never moves these
# ops that follow their inputs' dtype: shape/index/data movement, comparisons, exact selections, casts
FOLLOW_OPS = frozenset(
    {
        "clone",
        "contiguous",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "hstack",
        "vstack",
        "index",
        "index_select",
        "gather",
        "take",
        "take_along_dim",
        "flip",
        "roll",
        "repeat",
        "tile",
        "constant_pad_nd",
        "pad",
        "_to_copy",
        "to",
        "type_as",
        "copy",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "where",
        "masked_fill",
        "masked_select",
        "masked_scatter",
        "scatter",
        "index_put",
        "index_copy",
        "index_fill",
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "reshape",
        "flatten",
        "unflatten",
        "repeat_interleave",
        "tril",
        "triu",
        "diag",
        "diagonal_copy",
        "max",
        "min",
        "amax",
        "amin",
        "maximum",
        "minimum",
        "sort",
        "topk",
        "kthvalue",
        "median",
        "argsort",
        "relu",
        "abs",
        "neg",
        "sign",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "isnan",
        "isinf",
        "isfinite",
        "isneginf",
        "isposinf",
        "logical_and",
        "logical_or",
        "logical_not",
        "logical_xor",
        "argmax",
        "argmin",
        "any",
        "all",
        "nonzero",
        "searchsorted",
        "bucketize",
        "bitwise_and",
        "bitwise_or",
        "bitwise_not",
        "lift_fresh_copy",
        "detach",
        "scalar_tensor",
        "sym_size",
        "sym_numel",
        "sym_stride",
        "_assert_tensor_metadata",
        "_assert_scalar",
        "_assert_async",
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "eye",
        "one_hot",
        "unfold",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "narrow",
        "select_scatter",
        "slice_scatter",
        "diagonal_scatter",
        "as_strided_scatter",
        "fill",
        "zero",
    }
)
REDUCE_DIM_OPS = frozenset(
    {
        "sum",
        "mean",
        "nansum",
        "nanmean",
        "cumsum",
        "cumprod",
        "logcumsumexp",
        "softmax",
        "log_softmax",
        "_softmax",
        "_log_softmax",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "norm",
        "linalg_vector_norm",
        "frobenius_norm",
        "logsumexp",
        "prod",
    }
)
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})
MATMUL_INNER = {
    "linear": ("w", 1),
    "mm": ("a", 0),
    "bmm": ("a", 0),
    "matmul": ("a", 0),
    "addmm": ("a", 1),
    "baddbmm": ("a", 1),
    "addbmm": ("a", 1),
    "addmv": ("a", 1),
    "mv": ("a", 0),
    "dot": ("a", 0),
}
FP16_DATA_MAX = 512.0

# a custom rule: (node, context) -> reason to keep the node in fp32, or None
CustomRule = Callable[[torch.fx.Node, "RuleContext"], "str | None"]


def op_name(target: object) -> str:
    """``softmax`` for ``aten.softmax.int``; '' for non-ATen targets."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    return ""


def mutates(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def op_kind(node: torch.fx.Node, args: tuple, kwargs: dict) -> str:
    """'compute', 'follow' or 'inplace' (see the module docstring)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "follow"
    if mutates(target):
        return "inplace"
    schema = target._schema
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return "follow"  # a view
    name = op_name(target)
    if name in FOLLOW_OPS or name.rstrip("_") in FOLLOW_OPS:
        return "follow"
    if not any(t.is_floating_point() and t.dtype != torch.float64 for _, t in tensor_args(args, kwargs)):
        return "follow"
    return "compute"


def casts_for(node: torch.fx.Node, args: tuple, kwargs: dict, target: torch.dtype) -> dict:
    """Casts that bring every floating (not float64) tensor argument to ``target``; mutated arguments never."""
    schema = getattr(node.target, "_schema", None)
    written = set()
    if schema is not None:
        written = {
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        }
        written |= {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return {
        path: target
        for path, t in tensor_args(args, kwargs)
        if t.is_floating_point() and t.dtype not in (torch.float64, target) and path[1] not in written
    }


# ---- option parsing -------------------------------------------------------------------------------------


def compile_patterns(patterns: Iterable[str], option: str) -> list[re.Pattern]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    out = []
    for p in patterns:
        if not isinstance(p, str):
            raise PrecastError(
                f"{option}: {p!r} is not a string; give regular expressions like 'encoder\\.layer\\.0'"
            )
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise PrecastError(f"{option}: {p!r} is not a valid regular expression ({exc})") from exc
    return out


def resolve_op(spec: Any, option: str) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket:
    """An OpOverload / OpOverloadPacket, or a name: 'softmax', 'aten.softmax', 'aten::softmax', 'aten.softmax.int',
    'torch.ops.aten.softmax'. A name without an overload matches every overload."""
    if isinstance(spec, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PrecastError(
            f"{option}: {spec!r} is not an op; give torch.ops.aten.softmax (or .int) or a name like 'aten.softmax'"
        )
    text = spec.strip().removeprefix("torch.ops.").replace("::", ".")
    parts = text.split(".")
    ns, rest = (
        (parts[0], parts[1:])
        if len(parts) > 1
        and hasattr(torch.ops, parts[0])
        and parts[0] in ("aten", "prims", "quantized", "higher_order")
        or len(parts) > 2
        else ("aten", parts)
    )
    if len(rest) not in (1, 2) or not rest[0]:
        raise PrecastError(
            f"{option}: cannot read {spec!r} as an op name; write 'aten.softmax' or 'aten.softmax.int'"
        )
    try:
        packet = getattr(getattr(torch.ops, ns), rest[0])
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise AttributeError(rest[0])
        return getattr(packet, rest[1]) if len(rest) == 2 else packet
    except (AttributeError, RuntimeError) as exc:
        hint = f" (did you mean '{rest[0].lower()}'?)" if rest[0] != rest[0].lower() else ""
        raise PrecastError(f"{option}: no op named {spec!r} in torch.ops.{ns}{hint}") from exc


def matches_op(target: object, ops: list) -> object | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for op in ops:
        if target is op or (isinstance(op, torch._ops.OpOverloadPacket) and target.overloadpacket is op):
            return op
    return None


def match_node(node: torch.fx.Node, patterns: list[re.Pattern]) -> str | None:
    """What matched: ``re.search`` of each pattern on the node name, then on its module path."""
    path = module_path(node)
    for p in patterns:
        if p.search(node.name):
            return f"{p.pattern!r} matches its name"
        if path and p.search(path):
            return f"{p.pattern!r} matches its module {path}"
    return None


@dataclass
class RuleOptions:
    low: torch.dtype
    exclude_nodes: list[re.Pattern] = field(default_factory=list)
    exclude_ops: list = field(default_factory=list)
    include_nodes: list[re.Pattern] = field(default_factory=list)
    include_ops: list = field(default_factory=list)
    data_max: float | None = None
    init_max: float | None = None
    data_min: float | None = None  # flush_to_zero: values whose absmax stays below this underflow in `low`
    max_reduction_depth: int | None = None
    custom_rules: tuple = ()
    # precision-sensitive patterns kept in fp32 (precast.policy.patterns.PATTERNS); all by default
    patterns: frozenset = frozenset(sensitive.PATTERNS)

    @classmethod
    def build(
        cls,
        low,
        exclude_nodes=(),
        exclude_ops=(),
        include_nodes=(),
        include_ops=(),
        data_max=None,
        init_max=None,
        max_reduction_depth=None,
        custom_rules=(),
        data_min=None,
        patterns=None,
    ) -> RuleOptions:
        """Checked options; ``patterns``: None (every precision-sensitive pattern), () (none), or names from
        ``precast.policy.patterns.PATTERNS``."""
        if data_max is None and low == torch.float16:
            data_max = FP16_DATA_MAX
        if init_max is None:
            init_max = torch.finfo(low).max
        if data_min is None and low == torch.float16:
            # bf16 shares fp32's exponent range: what it flushes is already subnormal in fp32
            data_min = torch.finfo(low).tiny
        for name, value in (("data_max", data_max), ("init_max", init_max)):
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            ):
                raise PrecastError(f"{name}={value!r}: give a positive number (math.inf turns the rule off)")
        if data_min is not None and (not isinstance(data_min, (int, float)) or not 0 <= data_min < math.inf):
            raise PrecastError(f"data_min={data_min!r}: give a finite number >= 0 (0 turns the rule off)")
        if max_reduction_depth is not None and (
            not isinstance(max_reduction_depth, int)
            or isinstance(max_reduction_depth, bool)
            or max_reduction_depth < 1
        ):
            raise PrecastError(f"max_reduction_depth={max_reduction_depth!r}: give a positive integer")
        for rule in custom_rules:
            if not callable(rule):
                raise PrecastError(
                    f"custom_rules: {rule!r} is not callable; give functions (node, context) -> reason"
                )
        try:
            chosen = sensitive.parse_patterns(patterns)
        except ValueError as exc:
            raise PrecastError(str(exc)) from None
        ops = lambda xs, opt: [resolve_op(x, opt) for x in ((xs,) if isinstance(xs, str) else xs)]  # noqa: E731
        return cls(
            low=low,
            exclude_nodes=compile_patterns(exclude_nodes, "exclude_nodes"),
            exclude_ops=ops(exclude_ops, "exclude_ops"),
            include_nodes=compile_patterns(include_nodes, "include_nodes"),
            include_ops=ops(include_ops, "include_ops"),
            data_max=None if data_max is None or math.isinf(data_max) else float(data_max),
            init_max=None if math.isinf(init_max) else float(init_max),
            data_min=float(data_min) if data_min else None,
            max_reduction_depth=max_reduction_depth,
            custom_rules=tuple(custom_rules),
            patterns=chosen,
        )


# ---- measurements ---------------------------------------------------------------------------------------


def _dims(dim: Any, ndim: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [d % ndim if ndim else 0 for d in dims]


def _arg(node: torch.fx.Node, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return kwargs.get(name, default)


def reduction_depth(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[int, str] | None:
    """(accumulation depth, what it is) from shapes alone, for ops that accumulate; None for others."""
    name = op_name(node.target)
    tensors = [t for _, t in tensor_args(args, kwargs)]
    if not tensors:
        return None

    def size(x) -> int:
        return int(x) if not isinstance(x, torch.SymInt) else int(x.node.hint or 0)

    if name in MATMUL_INNER:
        which, pos = MATMUL_INNER[name]
        if pos >= len(tensors):
            return None
        t = tensors[pos]
        inner = t.shape[-1] if t.dim() else 1
        return size(inner), "inner dimension"
    if name in CONV_OPS:
        if len(tensors) < 2:
            return None
        w = tensors[1]
        transposed = "transpose" in name or (name in ("convolution", "_convolution") and bool(args[6]))
        groups = _arg(node, args, kwargs, "groups", 1) or 1
        k = math.prod(size(s) for s in w.shape[2:])
        chans = size(w.shape[0]) // groups if transposed else size(w.shape[1])
        return chans * k, f"{'in_channels/groups' if transposed else 'in_channels/groups'} x kernel"
    if name in ("scaled_dot_product_attention",) or name.startswith("_scaled_dot_product"):
        q, k = tensors[0], tensors[1]
        head, keys = size(q.shape[-1]), size(k.shape[-2])
        return (head, "head dim") if head >= keys else (keys, "key length")
    if name in REDUCE_DIM_OPS:
        t = tensors[0]
        dim = _arg(node, args, kwargs, "dim")
        if name in (
            "softmax",
            "log_softmax",
            "_softmax",
            "_log_softmax",
            "cumsum",
            "cumprod",
            "logcumsumexp",
        ):
            dim = [dim]
        if t.dim() == 0:
            return 1, "elements"
        return math.prod(size(t.shape[d]) for d in _dims(dim, t.dim())), "reduced elements"
    if name in NORM_OPS:
        shape = _arg(node, args, kwargs, "normalized_shape") or []
        return math.prod(size(s) for s in shape), "normalized elements"
    if name in ("group_norm", "native_group_norm"):
        t = tensors[0]
        groups = _arg(node, args, kwargs, "num_groups", None) or _arg(node, args, kwargs, "group", 1)
        return size(t.numel()) // max(1, size(t.shape[0]) * groups), "elements per group"
    return None


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


def _scalar_beyond(
    node: torch.fx.Node, args: tuple, kwargs: dict, low: torch.dtype
) -> tuple[str, float] | None:
    """A finite Scalar argument the low dtype cannot hold (``masked_fill(mask, finfo(float32).min)``, baked in
    by an fp32 export): in low precision the op raises "cannot be converted ... without overflow"."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    limit = torch.finfo(low).max
    for i, arg in enumerate(schema.arguments):
        if str(arg.type) not in ("number", "Scalar"):
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and abs(value) > limit
        ):
            return arg.name, value
    return None


class RulesPolicy:
    """The "rules" policy; its ``decide`` is asked for every op outside autocast regions."""

    name = "rules"

    def __init__(self, program: Program, opts: RuleOptions, calibration: Calibration | None = None):
        self.program, self.opts, self.calibration = program, opts, calibration
        self.fallback: dict[str, float] = {}  # node -> error score: kept fp32 by the accuracy fallback
        self.force: dict[str, torch.dtype] = {}  # fallback search only: node -> dtype
        self.decided: dict[str, Decision] = {}
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
        if node.name in self.force:
            return make(self.force[node.name], "rules", "search", "accuracy search")
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
                f"tolerance: among the ops whose low precision costs most accuracy (alone: {score:.3g} of "
                "the allowed error)",
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


def convert_with_rules(
    program: Program,
    ep: ExportedProgram,
    rep: Report,
    *,
    low: torch.dtype,
    device: str,
    keep_io_types: bool | None,
    verify: bool,
    calibration=None,
    tolerance=None,
    inputs: tuple[tuple, dict] | None = None,
    **rule_options: Any,
):
    """policy="rules": ``rule_options`` are RuleOptions.build's keywords (exclude/include, limits, custom rules);
    ``inputs``: example inputs given beside a program, used to verify."""
    from precast.convert import ConvertResult, _verify, finish, run_pass, run_pipeline
    from precast.passes.restore_io import output_dtypes, restore_output_dtypes
    from precast.policy.fallback import meet_tolerance, parse_tolerance

    keep_io = True if keep_io_types is None else bool(keep_io_types)
    opts = RuleOptions.build(low, **rule_options)
    tol = parse_tolerance(tolerance)
    ranges = opts.data_max is not None or opts.data_min is not None
    cal = _calibrate(program, ep, rep, calibration, low, ranges=ranges, tol=tol is not None)
    if tol is not None and cal is None:
        raise PrecastError("tolerance= needs data to measure the error on: pass calibration=[inputs, ...]")

    original_out = output_dtypes(program.graph)
    policy = RulesPolicy(program, opts, cal)
    result = None
    if tol is not None:
        result = meet_tolerance(program, ep, policy, tol, cal.sample)
        rep.diagnostics.append(Diagnostic("info", "tolerance", result.summary()))
    run_pipeline(program, policy, rep)
    run_pass(program, "restore_output_dtypes", restore_output_dtypes, original_out, keep_io)
    out = finish(program, rep)
    _warn_flushed(rep, cal, opts)
    kept = [r for r in rep.nodes if r.source in ("rules", "user") and r.dtype == "fp32"]
    if kept:
        rep.diagnostics.append(
            Diagnostic(
                "info",
                "kept-fp32",
                f"{len(kept)} op(s) kept in fp32 by rules: "
                + "; ".join(
                    f"{r.name} ({r.reason})" + (f" at {r.location}" if r.location else "") for r in kept[:20]
                )
                + ("; ..." if len(kept) > 20 else ""),
            )
        )
    if result is not None:
        from precast.policy.fallback import check_program
        from precast.program import private_state

        # on private copies of the buffers `out` writes: the program handed back has seen no forward
        final = check_program(private_state(out).module(), cal.sample, result.refs)
        result.final = final
        rep.verification["tolerance"] = {
            "target": tol.spec,
            "achieved": final,
            "kept_fp32": list(policy.fallback),
        }
        if not tol.met(final):
            rep.diagnostics.append(
                Diagnostic(
                    "warning",
                    "tolerance-not-met",
                    f"the converted program measures {tol.describe(final)} on the {len(cal.sample)} calibration "
                    f"batch(es) the search used, outside {tol.spec}",
                )
            )
    if verify:
        _verify(out, ep, rep, "rules", device, low, inputs=inputs)
        if result is not None:
            rep.verification["tolerance"] = {
                "target": tol.spec,
                "achieved": result.final,
                "kept_fp32": list(policy.fallback),
            }
    return ConvertResult(out, rep)


def _calibrate(
    program: Program, ep: ExportedProgram, rep: Report, data, low: torch.dtype, *, ranges: bool, tol: bool
) -> Calibration | None:
    """One streaming pass over the calibration data (else the example inputs, when a range rule or the
    tolerance needs data): statistics from every batch, the first TOLERANCE_BATCHES kept for the tolerance
    search. The report says which data each used."""
    keep = TOLERANCE_BATCHES if tol else 0
    if data is not None:
        cal = calibrate(program, ep, data, low=low, keep=keep)
        searched = f"; the tolerance search used the first {len(cal.sample)}" if tol else ""
        rep.diagnostics.append(
            Diagnostic("info", "calibrated", f"value ranges measured on {cal.batches} batches{searched}")
        )
        return cal
    if not (ranges or tol):
        return None
    if ep.example_inputs is None:
        if ranges:
            rep.diagnostics.append(
                Diagnostic(
                    "warning",
                    "data-max-inactive",
                    "data_max and flush_to_zero are not applied: no calibration data and the program has no "
                    "example inputs; pass calibration=[inputs, ...]",
                )
            )
        return None
    rep.diagnostics.append(
        Diagnostic(
            "info",
            "ranges-from-example-inputs",
            "no calibration data: value ranges (data_max, flush_to_zero) and errors were measured on the example "
            "inputs only; pass calibration=[inputs, ...] for representative ranges",
        )
    )
    return calibrate(program, ep, [ep.example_inputs], low=low, keep=keep, source="the example inputs")


def _warn_flushed(rep: Report, cal: Calibration | None, opts: RuleOptions) -> None:
    """Ops left in the low dtype (by include_nodes/include_ops or an autocast region) whose outputs flush to
    zero or go subnormal there: the conversion may return zeros, so say so."""
    if cal is None or opts.data_min is None:
        return
    low = dtype_name(opts.low)
    hit = [
        (r, cal.stats[r.name])
        for r in rep.nodes
        if r.dtype == low and r.name in cal.stats and 0 < cal.stats[r.name].absmax < opts.data_min
    ]
    if hit:
        rep.diagnostics.append(
            Diagnostic(
                "warning",
                "flush-to-zero",
                f"{len(hit)} op(s) run in {low} although their outputs (absmax below {opts.data_min:.3g}) are "
                f"subnormal or flush to zero there: "
                + "; ".join(f"{r.name} (absmax {st.absmax:.3g}, {r.rule})" for r, st in hit[:10])
                + ("; ..." if len(hit) > 10 else ""),
                node=hit[0][0].name,
                location=hit[0][0].location,
            )
        )
