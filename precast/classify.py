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

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from precast.errors import PrecastError, where
from precast.policy.autocast import autocast_decision, op_device_type, tensor_args
from precast.policy.base import Decision, Policy, dtype_name
from precast.policy.torch_tables import Category, category
from precast.program import Program
from precast.regions import innermost_region

ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# Ops whose eager kernels require every floating tensor argument to have one dtype (no type promotion).
# FakeTensor does not check this, so a low-precision activation meeting an fp32 weight would only fail at run
# time; precast checks it at conversion.
SAME_DTYPE_OPS = frozenset(
    name
    for base in (
        "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "einsum",
        "bilinear", "tensordot", "linalg_vecdot", "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "scaled_dot_product_attention",
        "_addmm_activation", "prelu", "mkldnn_rnn_layer", "lstm", "gru", "rnn_tanh", "rnn_relu",
    )
    for name in (f"aten::{base}",)
)
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
        raise PrecastError("the program's placeholders carry no fake values; re-export it with torch.export.export")
    return mode


def classify(
    program: Program, policy: Policy | None, user_rules: tuple[UserRule, ...] = (), on_error: Callable | None = None
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
                first = _splice_decomposition(program, node, args, kwargs, mode)
                if first is not None:
                    result.decomposed.append(f"{node.name} ({node.target})")
                    node = first
                    continue
            decision = _decide(node, args, kwargs, policy, user_rules)
            if node.target is ASSERT_METADATA and isinstance(args[0], torch.Tensor):
                # export's runtime check of a `.to()` input: keep it true for the dtype that now flows
                if node.kwargs.get("dtype") not in (None, args[0].dtype):
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
        return autocast_decision(node, args, kwargs, device, dtype, source=source, context=context, region=region)
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
    kwargs.update(decision.kwarg_updates)
    if decision.new_target is not None:
        target = decision.new_target
    return target, tuple(args), kwargs


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


# ---- decomposition of composites that eager autocast would decompose ------------------------------------


def _is_composite(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )


def _should_decompose(node, args, kwargs, policy, mode) -> bool:
    op = node.target
    if not _is_composite(op):
        return False
    device = op_device_type(args, kwargs)
    if device is None or category(device, op) is not None:
        return False
    state = _autocast_state(node, device, policy)
    if state is None or not state[0]:
        return False
    if not any(t.is_floating_point() for _, t in tensor_args(args, kwargs)):
        return False
    return _reaches_autocast_op(op, args, kwargs, device, mode, depth=0)


def _trace_decomposition(op, args, kwargs, mode) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def decomposed(*tensors):
        vals = list(flat)
        for i, t in zip(idx, tensors, strict=True):
            vals[i] = t
        a, k = pytree.tree_unflatten(vals, spec)
        return op.decompose(*a, **k)

    with mode:
        return make_fx(decomposed, pre_dispatch=True)(*[flat[i] for i in idx])


def _reaches_autocast_op(op, args, kwargs, device, mode, depth) -> bool:
    if depth > 4:
        return False
    try:
        sub = _trace_decomposition(op, args, kwargs, mode)
    except Exception:
        return False  # a decomposition we cannot trace: keep the op (eager would run it as is when not composite)
    for n in sub.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        cat = category(device, n.target)
        if cat is not None and cat != Category.FALLTHROUGH:
            return True
        if _is_composite(n.target):
            a = torch.fx.node.map_aggregate(n.args, lambda x: x.meta.get("val") if isinstance(x, torch.fx.Node) else x)
            k = torch.fx.node.map_aggregate(n.kwargs, lambda x: x.meta.get("val") if isinstance(x, torch.fx.Node) else x)
            if _reaches_autocast_op(n.target, a, k, device, mode, depth + 1):
                return True
    return False


def _splice_decomposition(program: Program, node, args, kwargs, mode) -> torch.fx.Node | None:
    """Replace ``node`` by its one-level decomposition; returns the first new node (None if not possible)."""
    sub = _trace_decomposition(node.target, args, kwargs, mode)
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return None
    flat_nodes, _ = pytree.tree_flatten((node.args, node.kwargs))
    flat_vals, _ = pytree.tree_flatten((args, kwargs))
    tensor_nodes = [n for n, v in zip(flat_nodes, flat_vals, strict=True) if isinstance(v, torch.Tensor)]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, tensor_nodes, strict=True))
    graph = program.graph
    first = None
    out = None
    keep = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "precast_regions", "custom") if k in node.meta}
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = torch.fx.node.map_aggregate(n.args[0], lambda a: env[a] if isinstance(a, torch.fx.Node) else a)
                continue
            new = graph.node_copy(n, lambda a: env[a])
            new.meta.update(keep)
            new.meta["precast_decomposed_from"] = f"{node.name} ({node.target})"
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
                raise PrecastError(f"{where(user)}: unexpected use of a multi-output op while decomposing {node.name}")
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)
    return first
