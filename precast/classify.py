"""Classify: walk the graph in order with fake tensors and give every op a Decision (``node.meta["precast"]``).

Decisions depend on the dtypes that reach an op, which depend on the decisions upstream (autocast casts only
eligible arguments, ``promote`` looks at the actual dtypes), so classification propagates fake values as it
goes, as eager autocast would see them at run time. Order of authority: the program's own autocast regions,
then user rules (exclude/include), then the policy.

Composite ops that eager autocast would decompose (a CompositeImplicitAutograd op with no autocast kernel, such
as ``einsum`` or ``lstm``, runs its decomposition *under* autocast, so the ``bmm`` inside it is cast) are
decomposed here one level at a time, only when their decomposition reaches an op that autocast casts. Ops that
autocast leaves alone stay as the user wrote them.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from precast.errors import PrecastError, where
from precast.policy import op_families
from precast.policy.autocast import autocast_decision, op_device_type, tensor_args
from precast.policy.base import Decision, Policy, dtype_name
from precast.policy.torch_tables import category
from precast.program import Program
from precast.regions import innermost_region

ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# Ops whose eager kernels require every floating tensor argument to have one dtype (no type promotion).
# FakeTensor does not check this, so a low-precision activation meeting an fp32 weight would only fail at run
# time; precast checks it at conversion.
SAME_DTYPE_OPS = frozenset(f"aten::{name}" for name in op_families.SAME_DTYPE_OPS)
# a user rule: (node, args, kwargs) -> Decision | None; rules.py builds these from exclude/include options
UserRule = Callable[[torch.fx.Node, tuple, dict], "Decision | None"]


@dataclass
class ClassifyResult:
    decided: int = 0
    decomposed: list[str] | None = None


def fake_mode_of(program: Program):
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise PrecastError(
            "the program's placeholders carry no fake values; re-export it with torch.export.export"
        )
    return mode


def classify(
    program: Program,
    policy: Policy | None,
    user_rules: tuple[UserRule, ...] = (),
    on_error: Callable | None = None,
) -> ClassifyResult:
    """``on_error(err, node)``, when given, receives the dtype-mismatch errors instead of raising them here
    (precast.diagnostics records them, and re-raises unless the user allowed the code)."""
    graph = program.graph
    mode = fake_mode_of(program)
    env: dict[torch.fx.Node, object] = {}
    result = ClassifyResult(decomposed=[])

    def load(a):
        return env[a] if isinstance(a, torch.fx.Node) else a

    node = next(iter(graph.nodes))
    while node.op != "output":
        if node.op == "placeholder":
            env[node] = node.meta["val"]
        elif node.op == "get_attr":
            env[node] = getattr(program.gm, node.target)
        elif node.op == "call_function":
            args = torch.fx.node.map_aggregate(node.args, load)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
            if _should_decompose(node, args, kwargs, policy, mode):
                first = _splice_decomposition(program, node, args, kwargs, mode, policy)
                if first is not None:
                    result.decomposed.append(f"{node.name} ({node.target})")
                    node = first
                    continue
            traced = node.meta.get(TRACED_META)
            # nodes traced under autocast already hold eager's casts: deciding again would cast twice
            decision = (
                copy.copy(traced) if traced is not None else _decide(node, args, kwargs, policy, user_rules)
            )
            # export's runtime check of a `.to()` input: keep it true for the dtype that now flows
            if (
                node.target is ASSERT_METADATA
                and isinstance(args[0], torch.Tensor)
                and node.kwargs.get("dtype") not in (None, args[0].dtype)
            ):
                decision = Decision(None, "none", "assert", "export's dtype check, updated to the new dtype")
                decision.kwarg_updates = {"dtype": args[0].dtype}
            env[node] = _run(node, args, kwargs, decision, mode, on_error)
            if decision is None and isinstance(node.target, torch._ops.OpOverload):
                decision = _unchanged(node, env[node])
            if decision is not None:
                if decision.dtype is None:
                    decision.dtype = _float_dtype(env[node])
                node.meta["precast"] = decision
                result.decided += 1
        node = node.next
    return result


def _float_dtype(value: object) -> torch.dtype | None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return None


def _unchanged(node: torch.fx.Node, out: object) -> Decision:
    return Decision(_float_dtype(out), "none", "follow", "not cast: runs in the dtype of its inputs")


def _autocast_state(node: torch.fx.Node, device: str, policy: Policy | None):
    """(enabled, dtype, source, context text, region id) in force for this node on ``device``."""
    region = innermost_region(node, device)
    if region is not None:
        return region.enabled, region.dtype, "region", region.describe(), region.id
    if policy is not None:
        state = policy.autocast_state(device)
        if state is not None:
            enabled, dtype = state
            return enabled, dtype, policy.name, f"policy torch: autocast({device}, {dtype_name(dtype)})", None
    return None


def _decide(node, args, kwargs, policy, user_rules) -> Decision | None:
    device = op_device_type(args, kwargs)
    if device is None:
        return None
    state = _autocast_state(node, device, policy)
    if state is not None and state[2] == "region":
        enabled, dtype, source, context, region = state
        if not enabled:
            return Decision(None, "region", "disabled", f"{context}: autocast off", region=region)
        return autocast_decision(
            node, args, kwargs, device, dtype, source=source, context=context, region=region
        )
    for rule in user_rules:
        decision = rule(node, args, kwargs)
        if decision is not None:
            return decision
    if state is not None:
        enabled, dtype, source, context, region = state
        if enabled:
            return autocast_decision(node, args, kwargs, device, dtype, source=source, context=context)
        return None
    return policy.decide(node, args, kwargs) if policy is not None else None


def apply_decision(target, args: tuple, kwargs: dict, decision: Decision | None, cast: Callable) -> tuple:
    """(target, args, kwargs) with the decision's casts applied through ``cast(value, dtype)``."""
    if decision is None:
        return target, args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for path, dtype in decision.casts.items():
        holder = args if path[0] == "args" else kwargs
        if len(path) == 2:
            holder[path[1]] = cast(holder[path[1]], dtype)
        else:
            seq = list(holder[path[1]])
            seq[path[2]] = cast(seq[path[2]], dtype)
            holder[path[1]] = seq
    if decision.new_target is not None:
        args, kwargs = redispatch_args(target, decision.new_target, args, kwargs)
        target = decision.new_target
    kwargs.update(decision.kwarg_updates)
    return target, tuple(args), kwargs


def redispatch_args(old, new, args: list, kwargs: dict) -> tuple[list, dict]:
    """Arguments of ``old`` rebound by name to ``new``'s schema, with ``old``'s defaults filled in
    (``norm.Scalar(x)`` means p=2; ``norm.ScalarOpt_dtype`` requires p)."""
    named = {}
    for i, arg in enumerate(old._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    new_args, new_kwargs = [], {}
    for arg in new._schema.arguments:
        if arg.name not in named:
            continue
        if arg.kwarg_only:
            new_kwargs[arg.name] = named[arg.name]
        else:
            new_args.append(named[arg.name])
    return new_args, new_kwargs


def _run(node, args, kwargs, decision, mode, on_error=None):
    target, args, kwargs = apply_decision(node.target, args, kwargs, decision, lambda v, d: v.to(d))
    if isinstance(target, torch._ops.OpOverload) and target._schema.name in SAME_DTYPE_OPS:
        try:
            check_same_dtype(node, args, kwargs)
        except PrecastError as err:
            if on_error is None:
                raise
            on_error(err, node)
    try:
        if isinstance(target, torch._ops.OpOverload):
            with mode:
                return target(*args, **kwargs)
        if target is operator.getitem:
            return target(*args)
        with mode:
            return target(*args, **kwargs)
    except PrecastError:
        raise
    except Exception as exc:  # a dtype mismatch the program would hit at run time, usually
        raise PrecastError(
            f"{where(node)}: {_first_line(exc)}; inputs {_dtypes(args, kwargs)}. "
            "This op would fail at run time with these dtypes: cast its inputs to one dtype (e.g. `.float()`) "
            "or move it inside the autocast region",
            code="dtype-mismatch",
            node=node.name,
        ) from exc


def check_same_dtype(node: torch.fx.Node, args: tuple, kwargs: dict) -> None:
    floats = [(p, t) for p, t in tensor_args(args, kwargs) if t.is_floating_point()]
    dtypes = {t.dtype for _, t in floats}
    if len(dtypes) <= 1:
        return
    inputs = ", ".join(f"{_arg_name(node, p)} {dtype_name(t.dtype)}" for p, t in floats)
    low = sorted((d for d in dtypes if d != torch.float32), key=str)
    fix = (
        "cast the activation back with `.float()` where it leaves the autocast region, or move this op inside "
        "the region"
        if low and torch.float32 in dtypes
        else "cast its inputs to one dtype"
    )
    raise PrecastError(
        f"{where(node)}: {node.target._schema.name.removeprefix('aten::')} would fail at run time: its inputs have "
        f"different dtypes ({inputs}); {fix}",
        code="dtype-mismatch",
        node=node.name,
    )


def _arg_name(node: torch.fx.Node, path: tuple) -> str:
    if path[0] == "kwargs":
        return str(path[1])
    schema_args = getattr(node.target, "_schema", None)
    if schema_args is not None and path[1] < len(schema_args.arguments):
        name = schema_args.arguments[path[1]].name
        return name if len(path) == 2 else f"{name}[{path[2]}]"
    return f"arg{path[1]}"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _dtypes(args, kwargs) -> str:
    return "(" + ", ".join(dtype_name(t.dtype) or "?" for _, t in tensor_args(args, kwargs)) + ")"


# ---- composites that eager autocast would decompose --------------------------------------------------------
# A CompositeImplicitAutograd op with no autocast kernel (einsum, gru, bilinear...) runs its decomposition in
# eager *below* the autocast key, so the table ops inside it are cast. precast traces the op under real
# autocast (post-autograd make_fx: the dispatcher decomposes exactly as eager does and autocast inserts its
# casts at exactly the same levels) and splices that subgraph in when it contains a cast. Ops whose
# decomposition autocast leaves alone stay as the user wrote them.
TRACED_META = "precast_traced"
# composites that only reshape, move or convert: they never reach an autocast op
NEVER_CASTS = frozenset(
    f"aten::{n}"
    for n in (
        "reshape",
        "flatten",
        "unflatten",
        "contiguous",
        "to",
        "type_as",
        "view_as",
        "reshape_as",
        "expand_as",
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "squeeze",
        "movedim",
        "swapaxes",
        "transpose",
        "chunk",
        "split",
        "tensor_split",
        "unsafe_chunk",
        "flip",
        "t",
        "numpy_T",
        "mT",
        "size",
        "layer_norm",
        "group_norm",
        "batch_norm",
        "instance_norm",
        "softmax",
        "log_softmax",
        "relu6",
        "hardtanh",
    )
)


@contextlib.contextmanager
def _real_autocast(device: str, dtype: torch.dtype):
    """torch.autocast refuses 'cuda' without a GPU; the dispatcher's autocast works on fake CUDA tensors."""
    prev = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, prev[0])
        torch.set_autocast_dtype(device, prev[1])


def _is_composite(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )


def _should_decompose(node, args, kwargs, policy, mode) -> bool:
    op = node.target
    if node.meta.get(TRACED_META) or not _is_composite(op) or op._schema.name in NEVER_CASTS:
        return False
    device = op_device_type(args, kwargs)
    if device is None or category(device, op) is not None:
        return False
    state = _autocast_state(node, device, policy)
    if state is None or not state[0]:
        return False
    return any(t.is_floating_point() and t.dtype != torch.float64 for _, t in tensor_args(args, kwargs))


def _trace(op, args, kwargs, mode, autocast: tuple[str, torch.dtype] | None) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def call(*tensors):
        vals = list(flat)
        for i, t in zip(idx, tensors, strict=True):
            vals[i] = t
        a, k = pytree.tree_unflatten(vals, spec)
        if autocast is None:
            return op(*a, **k)
        with _real_autocast(*autocast):
            return op(*a, **k)

    inputs = [flat[i] for i in idx]
    symbolic = any(free_symbols(t) for t in inputs)
    with mode:
        return make_fx(call, tracing_mode="symbolic" if symbolic else "real")(*inputs)


def free_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in t.shape)


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default)


def _splice_decomposition(program: Program, node, args, kwargs, mode, policy) -> torch.fx.Node | None:
    """Replace ``node`` by its decomposition traced under autocast, when autocast casts anything inside it.

    Returns the first new node, or None when the op stays as it is."""
    device = op_device_type(args, kwargs)
    enabled, dtype, source, context, region = _autocast_state(node, device, policy)
    try:
        traced = _trace(node.target, args, kwargs, mode, (device, dtype))
        plain = _trace(node.target, args, kwargs, mode, None)
    except Exception:
        return None  # not traceable here: keep the op (its own kernel runs, as eager would below autocast)
    if _casts(traced) <= _casts(plain) or any(n.op == "get_attr" for n in traced.graph.nodes):
        return None
    flat_nodes, _ = pytree.tree_flatten((node.args, node.kwargs))
    flat_vals, _ = pytree.tree_flatten((args, kwargs))
    tensor_nodes = [n for n, v in zip(flat_nodes, flat_vals, strict=True) if isinstance(v, torch.Tensor)]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env: dict = dict(zip(placeholders, tensor_nodes, strict=True))
    graph = program.graph
    first = out = None
    keep = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "precast_regions") if k in node.meta}
    why = f"{context}: inside {node.target} (a composite eager autocast decomposes), as eager runs it"
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = torch.fx.node.map_aggregate(
                    n.args[0], lambda a: env[a] if isinstance(a, torch.fx.Node) else a
                )
                continue
            new = graph.node_copy(n, lambda a: env[a])
            new.meta.update(keep)
            new.meta[TRACED_META] = Decision(None, source, "decomposed", why, region=region)
            env[n] = new
            first = first or new
    if first is None:
        return None
    if isinstance(out, (list, tuple)):
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
            else:
                raise PrecastError(
                    f"{where(user)}: unexpected use of a multi-output op while decomposing {node.name}"
                )
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)
    return first
