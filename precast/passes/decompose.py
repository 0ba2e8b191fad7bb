"""Decomposing composites as eager autocast would (part of the classify stage): a CompositeImplicitAutograd op
with no autocast kernel (``einsum``, ``lstm``) runs its decomposition *under* autocast in eager, so the ``bmm``
inside it is cast. Classify asks ``should_decompose`` per op and splices the traced decomposition in place, one
level at a time, only when it reaches an op that autocast casts.

Input: an op node, its fake arguments, the policy. Output: the node replaced by its decomposition in the graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from precast.errors import PrecastError, first_line, where
from precast.ir.fake import FakeState
from precast.ir.fake_run import check_dynamic
from precast.ir.graph import op_device_type, tensor_args
from precast.ir.program import Program
from precast.policy.base import Decision
from precast.policy.compose import autocast_state_of
from precast.policy.torch_tables import category
from precast.threads import TORCH_LOCK, quiet_logger

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


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensor logs a traceback at ERROR before raising when a meta kernel fails; the plain trace of a
    composite is expected to fail that way on inputs only autocast can reconcile."""
    with quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL):  # a filter: no global level change
        yield


def _is_composite(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )


def should_decompose(node, args, kwargs, policy) -> bool:
    op = node.target
    if node.meta.get(TRACED_META) or not _is_composite(op) or op._schema.name in NEVER_CASTS:
        return False
    device = op_device_type(args, kwargs)
    if device is None or category(device, op) is not None:
        return False
    state = autocast_state_of(node, device, policy)
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
    with TORCH_LOCK, mode:  # make_fx's tracing state is process-global: one thread at a time
        return make_fx(call, tracing_mode="symbolic" if symbolic else "real")(*inputs)


def trace_decomposition(op, args, kwargs, mode) -> torch.fx.GraphModule:
    """``op``'s decomposition as eager runs it without autocast, traced on fake values (node vals in meta)."""
    with _quiet_fake_tensor_log():
        return _trace(op, args, kwargs, mode, None)


def free_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in t.shape)


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default)


# Views whose validity depends on strides. The trace runs on fake values, whose strides can differ from the real
# ones (fake batch_norm keeps a transposed input's strides, the CPU kernel returns a contiguous tensor), so a
# ``view`` the trace recorded can be invalid at run time. Eager's decomposition calls ``reshape`` on the real
# tensor: a view where the real strides allow it, else a copy, the same values either way. So does the splice.
_STRIDE_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _stride_independent(gm: torch.fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _STRIDE_VIEWS:
            n.target = torch.ops.aten.reshape.default


def _not_traced(node: torch.fx.Node, why: str, on_error, exc: Exception | None = None) -> None:
    """A composite eager autocast decomposes that precast cannot splice: an error (``composite-not-traced``);
    when the user allows it, the op stays as written and no longer matches eager autocast exactly."""
    err = PrecastError(
        f"{where(node)}: {node.target} runs decomposed under autocast in eager, but {why}; kept as written it "
        "would not compute what eager autocast computes: cast its inputs explicitly, or allow "
        "'composite-not-traced' to keep the op as written",
        code="composite-not-traced",
        node=node.name,
    )
    if on_error is None:
        raise err from exc
    on_error(err, node)


def splice_decomposition(
    program: Program, node, args, kwargs, state: FakeState, policy, on_error=None
) -> torch.fx.Node | None:
    """Replace ``node`` by its decomposition traced under the autocast state eager runs it in, when autocast
    casts anything inside it.

    Returns the first new node, or None when the op stays as it is. The decomposition is compared with the
    one traced without autocast; when only the autocast trace succeeds (inputs of mixed dtypes that autocast
    unifies, ``einsum(fp16, fp32)`` in a region), autocast clearly changes it and it is spliced."""
    device = op_device_type(args, kwargs)
    enabled, dtype, source, context, region = autocast_state_of(node, device, policy)
    try:
        traced = _trace(node.target, args, kwargs, state.mode, (device, dtype))
    except Exception as exc:
        _not_traced(node, f"tracing it under {context} failed: {first_line(exc)}", on_error, exc)
        return None
    check_dynamic(state, node)
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        _not_traced(
            node, "its decomposition creates tensor constants, which precast does not splice", on_error
        )
        return None
    if _casts(traced) <= _plain_casts(node, args, kwargs, state):
        return None
    _stride_independent(traced)
    why = f"{context}: inside {node.target} (a composite eager autocast decomposes), as eager runs it"
    mark = functools.partial(Decision, None, source, "decomposed", why, region=region)  # one per new node
    first, out = _copy_in(program.graph, node, args, kwargs, traced, mark)
    if first is None:
        return None
    check_dynamic(state, node)
    _replace_uses(program.graph, node, out)
    return first


def _plain_casts(node: torch.fx.Node, args: tuple, kwargs: dict, state: FakeState) -> int:
    """How many casts the decomposition traced without autocast holds; -1 when that trace fails."""
    try:
        with _quiet_fake_tensor_log():
            plain = _casts(_trace(node.target, args, kwargs, state.mode, None))
    except Exception:  # noqa: BLE001 - eager would fail without autocast: autocast is what makes it run
        plain = -1
    check_dynamic(state, node)
    return plain


def _copy_in(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    args: tuple,
    kwargs: dict,
    traced: torch.fx.GraphModule,
    mark: Callable[[], Decision],
) -> tuple[torch.fx.Node | None, object]:
    """The traced decomposition's nodes copied into ``graph`` before ``node`` (its placeholders bound to the
    node's tensor arguments, each new node marked with a decision of its own, ``mark()``): the first new node (None when there is
    none) and the decomposition's outputs."""
    flat_nodes, _ = pytree.tree_flatten((node.args, node.kwargs))
    flat_vals, _ = pytree.tree_flatten((args, kwargs))
    tensor_nodes = [n for n, v in zip(flat_nodes, flat_vals, strict=True) if isinstance(v, torch.Tensor)]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env: dict = dict(zip(placeholders, tensor_nodes, strict=True))
    first = out = None
    keep = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "precast_regions") if k in node.meta}
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
            new.meta[TRACED_META] = mark()
            env[n] = new
            first = first or new
    return first, out


def _replace_uses(graph: torch.fx.Graph, node: torch.fx.Node, out: object) -> None:
    """The uses of ``node`` rewired to the decomposition's outputs (a multi-output op's through its getitems),
    and ``node`` erased."""
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
