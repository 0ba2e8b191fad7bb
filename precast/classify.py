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
import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

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


# ---- fake values on the conversion's own shape environment -------------------------------------------------
# The program's fake values (node.meta["val"]) share one ShapeEnv with the input program. Running ops on them
# can add guards or replace a dynamic symbol by its example value (a C++ composite reading ``sizes()``), and
# that would narrow the caller's program as well as ours. So the conversion works on a private copy of the
# ShapeEnv: every fake value of the program is re-created on it, and every fake run checks that no symbol of
# the program's inputs was specialized or narrowed.
# Keyed by the Program (nothing in the state refers back to it, so the entry dies with the conversion).
# ShapeEnv fields that hold tensors or FX nodes (not deep-copyable, and caches anyway): start them empty
_SHAPE_ENV_FRESH = {"tracked_fakes": None, "fake_tensor_cache": {}, "fx_node_cache": {}}
_SHAPE_ENV_SHARED = ("log",)


@dataclass
class FakeState:
    """The conversion's private fake mode and what it must preserve."""

    mode: FakeTensorMode
    # input symbol -> (where it comes from, e.g. "x.size()[0]", its value range at the start)
    symbols: dict[sympy.Symbol, tuple[str, object]] = field(default_factory=dict)
    replacements: int = 0
    # node -> signature (target, args, kwargs) when its fake value was last computed (precast.verify)
    signatures: dict[torch.fx.Node, tuple] = field(default_factory=dict)
    # (id(value), dtype) -> (value, value.to(dtype)): one fake cast per value and dtype per conversion (the
    # value is kept so its id is never reused while the entry lives)
    casts: dict[tuple[int, torch.dtype], tuple[object, object]] = field(default_factory=dict)
    # node -> (target, (args, kwargs), output) of its last fake run (``run_fake``). Off for the full re-check
    # (``refresh_vals``).
    runs: dict[torch.fx.Node, tuple[object, tuple, object]] = field(default_factory=dict)
    reuse_runs: bool = True


def fake_cast(state: FakeState, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value.to(dtype)`` on fake values, computed once per (value, dtype): classify casts an argument, then
    insert_casts gives the cast node the same value (fake values are immutable metadata)."""
    hit = state.casts.get((id(value), dtype))
    if hit is not None and hit[0] is value:
        return hit[1]
    out = value.to(dtype)
    state.casts[(id(value), dtype)] = (value, out)
    return out


def fake_state(program: Program) -> FakeState:
    """The program's private fake mode, created on first use: a copy of the input program's ShapeEnv, with
    every node's fake value re-created on it (no op runs: only metadata is rebuilt)."""
    if program.fake_state is None:
        program.fake_state = _privatize(program)  # state travels with the program, never in a global
    return program.fake_state


def fake_mode_of(program: Program) -> FakeTensorMode:
    return fake_state(program).mode


def _privatize(program: Program) -> FakeState:
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    source = detect_fake_mode(vals)
    if source is None:
        raise PrecastError(
            "the program's placeholders carry no fake values; re-export it with torch.export.export"
        )
    env = _copy_shape_env(source.shape_env) if source.shape_env is not None else None
    mode = FakeTensorMode(
        allow_fallback_kernels=source.allow_fallback_kernels,
        allow_non_fake_inputs=source.allow_non_fake_inputs,
        shape_env=env,
        static_shapes=source.static_shapes,
        export=getattr(source, "export", False),
    )
    state = FakeState(mode)
    adopt_vals(state, program.graph.nodes)
    _unmark_buffers(program)
    state.signatures = {n: node_signature(n) for n in program.graph.nodes}
    if env is not None:
        state.symbols = _input_symbols(program, env)
        state.replacements = len(env.replacements)
    return state


def _unmark_buffers(program: Program) -> None:
    """Buffers and lifted constants start a call not requiring grad. Export records each placeholder's fake
    value as it was at the end of tracing: a buffer updated in place from an activation (an EMA) comes back
    marked requires_grad, and re-running that in-place op on a leaf requiring grad would fail."""
    for node, spec in program.input_spec.items():
        val = node.meta.get("val")
        if spec.kind != InputKind.PARAMETER and isinstance(val, FakeTensor) and val.requires_grad:
            val.requires_grad_(False)


def adopt_vals(state: FakeState, nodes: Iterable[torch.fx.Node]) -> None:
    """Re-create on the private mode any fake value that still lives on another one (nodes copied in from
    elsewhere, e.g. a region inlined after the state was made). Only metadata is rebuilt."""
    memo: dict[int, tuple[object, object]] = {}
    for node in nodes:
        val = node.meta.get("val")
        if val is not None and _foreign(val, state.mode):
            node.meta["val"] = _rebind(val, state.mode, memo)


def _foreign(value: object, mode: FakeTensorMode) -> bool:
    if isinstance(value, FakeTensor):
        return value.fake_mode is not mode
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return mode.shape_env is not None and value.node.shape_env is not mode.shape_env
    if isinstance(value, (list, tuple, dict)):
        return any(_foreign(v, mode) for v in (value.values() if isinstance(value, dict) else value))
    return False


def _copy_shape_env(env: ShapeEnv) -> ShapeEnv:
    """A deep copy of ``env``'s symbolic state (ranges, replacements, guards), sharing nothing mutable."""
    new = ShapeEnv.__new__(ShapeEnv)
    for key, value in env.__dict__.items():
        if key in _SHAPE_ENV_FRESH:
            value = copy.copy(_SHAPE_ENV_FRESH[key])
        elif key not in _SHAPE_ENV_SHARED:
            value = copy.deepcopy(value)
        new.__dict__[key] = value
    return new


def _rebind(value: object, mode: FakeTensorMode, memo: dict[int, tuple[object, object]]) -> object:
    """``value`` (a fake tensor, SymInt, or a container of them) re-created on ``mode`` and its ShapeEnv.

    ``memo`` keeps one copy per object (values shared between nodes, such as a tuple and its getitems, stay
    shared); it holds the original too, so an id is never reused while the memo lives."""
    hit = memo.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if isinstance(value, FakeTensor):
        if value.fake_mode is mode:
            return value
        sizes = [_rebind(s, mode, memo) for s in value.shape]
        strides = [_rebind(s, mode, memo) for s in value.stride()]
        out = _empty_like_meta(mode, sizes, strides, value)
    elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if mode.shape_env is None or value.node.shape_env is mode.shape_env:
            return value
        out = type(value)(value.node.with_shape_env(mode.shape_env))
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        out = type(value)(_rebind(v, mode, memo) for v in value)
    elif isinstance(value, dict):
        out = {k: _rebind(v, mode, memo) for k, v in value.items()}
    else:
        return value
    memo[id(value)] = (value, out)
    return out


def _empty_like_meta(mode: FakeTensorMode, sizes: list, strides: list, like: FakeTensor) -> FakeTensor:
    """A fake tensor of ``like``'s dtype and device with the given sizes and strides, built on a meta tensor
    directly (the fake dispatch cache would rebuild every output from its cache entry, twice the cost)."""
    meta = torch.empty_strided(sizes, strides, dtype=like.dtype, device="meta")
    out = FakeTensor(mode, meta, like.device)
    if like.requires_grad:
        out.requires_grad_(True)
    return out


def _input_symbols(program: Program, env: ShapeEnv) -> dict:
    """Each free symbol of the program's input shapes -> (``name.size()[i]``, its value range now)."""
    found: dict = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for i, size in enumerate(node.meta["val"].shape):
            if not isinstance(size, torch.SymInt):
                continue
            for sym in size.node.expr.free_symbols:
                if sym not in found:
                    found[sym] = (f"{node.name}.size()[{i}]", env.var_to_range.get(sym))
    return found


def node_signature(node: torch.fx.Node) -> tuple:
    """What a node's fake value is computed from: op, target and arguments."""
    return (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))


def _freeze(value: object) -> object:
    """A comparable snapshot of FX arguments: nodes by identity, containers as tuples, others by value when
    hashable (dtypes, numbers, strings), else by identity."""
    if isinstance(value, torch.fx.Node):
        return value
    if isinstance(value, torch.Tensor):  # `==` on tensors is elementwise
        return ("id", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, slice):
        return ("slice", _freeze(value.start), _freeze(value.stop), _freeze(value.step))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def check_dynamic(state: FakeState, node: torch.fx.Node) -> None:
    """Raise if running ``node`` on fake values specialized or narrowed a dynamic dimension of the program's
    inputs (eager would then reject other sizes: "Guard failed: x.size()[0] == 2")."""
    env = state.mode.shape_env
    if env is None or not state.symbols:
        return
    if len(env.replacements) == state.replacements and all(
        env.var_to_range.get(sym) == rng for sym, (_, rng) in state.symbols.items()
    ):
        return
    for sym, (name, rng) in state.symbols.items():
        now = env.replacements.get(sym, sym)
        if now != sym or env.var_to_range.get(sym) != rng:
            fixed = now if now != sym else env.var_to_range.get(sym)
            op = str(node.target)
            raise PrecastError(
                f"{where(node)}: computing {op} on the program's fake values fixed the dynamic dimension "
                f"{name} ({sym}, range {rng}) to {fixed}; precast must not narrow a dynamic shape: please "
                "report it with this program (convert with static shapes meanwhile)",
                code="dynamic-dim-specialized",
                node=node.name,
            )
    state.replacements = len(env.replacements)  # only new, unrelated (unbacked) symbols were replaced


def _oblivious_backend_choice(target: object) -> contextlib.AbstractContextManager:
    """Fake convolution picks a backend to guess the output's memory format, comparing the batch with
    thresholds (``_select_conv_backend``); on a dynamic batch that adds a guard export never added, narrowing
    the batch range (VR[2, 64] -> VR[2, 15]). The choice only shapes strides, never values: decide it without
    guards (size-oblivious)."""
    name = target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else ""
    if name in op_families.CONV_OPS:
        return torch.fx.experimental._config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


def run_fake(state: FakeState, node: torch.fx.Node, target, args: tuple, kwargs: dict) -> object:
    """Run ``target`` on fake values as export does (Python dispatcher on: symbolic-aware decompositions, no
    C++ composite reading concrete sizes), then check that no dynamic dimension was specialized. A node run
    again on inputs no op can tell from its last run's (same objects, or ``_same_fake``) returns that run's
    result (``FakeState.runs``): the checks after insert_casts and fold recompute on the cast values classify
    used, or on folded constants of the same metadata."""
    if target is operator.getitem:
        return target(*args)
    memo = _memoizable(target)
    if memo and state.reuse_runs:
        last = state.runs.get(node)
        if last is not None and last[0] is target and _same_args(last[1], (args, kwargs)):
            return last[2]
    with state.mode, enable_python_dispatcher(), _oblivious_backend_choice(target):
        out = target(*args, **kwargs)
    check_dynamic(state, node)
    if memo:
        state.runs[node] = (target, (args, kwargs), out)
    return out


def remember_run(
    state: FakeState, node: torch.fx.Node, target, args: tuple, kwargs: dict, out: object
) -> None:
    """Record ``out`` as what ``node`` computes from these inputs (a cast node given the value classify
    already computed for that cast)."""
    if _memoizable(target):
        state.runs[node] = (target, (args, kwargs), out)


def _memoizable(target: object) -> bool:
    """Aten ops that write nothing (an in-place or out= op may change its inputs' metadata: always run)."""
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def _same_args(a: object, b: object) -> bool:
    """Arguments an op cannot tell apart: same structure (lists and tuples alike: FX hands them over as
    immutable lists), fake values by ``_same_fake``, real tensors (constants) by identity, anything else by
    type and value."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_args(a[k], b[k]) for k in a)
    sym = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, sym) or isinstance(b, sym):  # `==` on symbolic values would add a guard
        return _same_fake(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


def classify(
    program: Program,
    policy: Policy | None,
    user_rules: tuple[UserRule, ...] = (),
    on_error: Callable | None = None,
) -> ClassifyResult:
    """``on_error(err, node)``, when given, receives the ``dtype-mismatch`` and ``composite-not-traced`` errors
    instead of raising them here (precast.diagnostics records them, and re-raises unless the user allowed the
    code; an allowed ``composite-not-traced`` keeps the composite op as written)."""
    graph = program.graph
    state = fake_state(program)
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
            decompose = _should_decompose(node, args, kwargs, policy)
            if decompose:
                first = _splice_decomposition(program, node, args, kwargs, state, policy, on_error)
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
            # a composite kept as written (the trace changed nothing, or failed and the user allowed it): export
            # recorded its value as autocast computed it, which need not be what it computes as written
            recorded = _recorded(node, decision, env, state) if traced is None and not decompose else _MISSING
            if recorded is _MISSING:
                env[node] = _run(node, args, kwargs, decision, state, on_error)
            else:
                _check_dtypes(node, node.target, args, kwargs, on_error)
                env[node] = recorded
                remember_run(state, node, node.target, args, kwargs, recorded)
            if decision is None and isinstance(node.target, torch._ops.OpOverload):
                decision = _unchanged(node, env[node])
            if decision is not None:
                if decision.dtype is None:
                    decision.dtype = _float_dtype(env[node])
                node.meta["precast"] = decision
                result.decided += 1
        node = node.next
    _store_vals(graph, env)
    return result


def _store_vals(graph: torch.fx.Graph, env: dict) -> None:
    """Give every op the value it will have once its decision is applied: the check after insert_casts then
    recomputes only the nodes insert_casts rewrote and finds the same values, instead of re-propagating
    everything downstream of a cast. Done after the walk: ``_recorded`` compares inputs with the values export
    recorded."""
    for node in graph.nodes:
        if node.op == "call_function" and node in env and node.meta.get("val", _MISSING) is not env[node]:
            node.meta["val"] = env[node]


_MISSING = object()


def _recorded(node: torch.fx.Node, decision: Decision | None, env: dict, state: FakeState) -> object:
    """The node's own fake value when running it again would only recompute it, else ``_MISSING``.

    That holds when the decision changes nothing (no casts, dtype kwargs or redispatch), every input's value is
    the value recorded for that input or has its exact metadata (``_same_fake``: an op's fake output depends
    on nothing else), and the node's value was computed from its current arguments (unchanged signature).
    Most of a program outside autocast regions is so, and so is most of a region export traced under
    autocast; a fake run (symbolic sizes rebuilt through sympy) is the main cost of classify. In-place ops
    still run: they may change their input's metadata."""
    if decision is not None and (decision.casts or decision.kwarg_updates or decision.new_target is not None):
        return _MISSING
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return _MISSING
    val = node.meta.get("val", _MISSING)
    if val is _MISSING or _foreign(val, state.mode):
        return _MISSING
    for a in node.all_input_nodes:
        if a.op != "get_attr" and not _same_fake(env.get(a, _MISSING), a.meta.get("val", _MISSING)):
            return _MISSING
    if state.signatures.get(node) != node_signature(node):
        return _MISSING
    return val


def _same_fake(a: object, b: object) -> bool:
    """The same object, or fake values an op that writes nothing computes the same metadata from: same
    structure, and tensors of the same dtype, device, sizes, strides, storage offset and layout (symbolic sizes
    by expression: ``==`` on SymInts would add a guard). ``requires_grad`` is not compared: it does not change
    an output's metadata, and export records values without it."""
    if a is b:
        return a is not _MISSING
    if isinstance(a, FakeTensor) and isinstance(b, FakeTensor):
        return (
            a.dtype == b.dtype
            and a.device == b.device
            and a.layout == b.layout
            and a.dim() == b.dim()
            and all(_same_int(p, q) for p, q in zip(a.shape, b.shape, strict=True))
            and all(_same_int(p, q) for p, q in zip(a.stride(), b.stride(), strict=True))
            and _same_int(a.storage_offset(), b.storage_offset())
            and a.is_conj() == b.is_conj()
            and a.is_neg() == b.is_neg()
        )
    if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        return all(_same_fake(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not isinstance(a, bool) and not isinstance(b, bool) and _same_int(a, b)
    return False


def _same_int(p: object, q: object) -> bool:
    pe = p.node.expr if isinstance(p, torch.SymInt) else p
    qe = q.node.expr if isinstance(q, torch.SymInt) else q
    return bool(pe == qe)


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


def _run(node, args, kwargs, decision, state: FakeState, on_error=None):
    target, args, kwargs = apply_decision(
        node.target, args, kwargs, decision, lambda v, d: fake_cast(state, v, d)
    )
    _check_dtypes(node, target, args, kwargs, on_error)
    try:
        return run_fake(state, node, target, args, kwargs)
    except PrecastError:
        raise
    except Exception as exc:
        raise fake_run_error(node, target, args, kwargs, exc) from exc


def _check_dtypes(node, target, args: tuple, kwargs: dict, on_error=None) -> None:
    """The dtype check FakeTensor does not make (also for an op whose recorded value is reused)."""
    if isinstance(target, torch._ops.OpOverload) and target._schema.name in SAME_DTYPE_OPS:
        try:
            check_same_dtype(node, args, kwargs)
        except PrecastError as err:
            if on_error is None:
                raise
            on_error(err, node)


def fake_run_error(node: torch.fx.Node, target, args: tuple, kwargs: dict, exc: Exception) -> PrecastError:
    """The error for an op that fails on fake values: ``dtype-mismatch`` only when its floating inputs have
    different dtypes (what the program would hit at run time); anything else is ``fake-run-failed``."""
    floats = {t.dtype for _, t in tensor_args(args, kwargs) if t.is_floating_point()}
    if len(floats) > 1:
        return PrecastError(
            f"{where(node)}: {_first_line(exc)}; inputs {_dtypes(args, kwargs)}. "
            "This op would fail at run time with these dtypes: cast its inputs to one dtype (e.g. `.float()`) "
            "or move it inside the autocast region",
            code="dtype-mismatch",
            node=node.name,
        )
    op = str(target)
    return PrecastError(
        f"{where(node)}: {op} fails on the program's fake values with inputs {_dtypes(args, kwargs)}: "
        f"{_first_line(exc)}; check that the program runs as exported (ep.module()), else report it",
        code="fake-run-failed",
        node=node.name,
    )


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


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensor logs a traceback at ERROR before raising when a meta kernel fails; the plain trace of a
    composite is expected to fail that way on inputs only autocast can reconcile."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_composite(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )


def _should_decompose(node, args, kwargs, policy) -> bool:
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


def _splice_decomposition(
    program: Program, node, args, kwargs, state: FakeState, policy, on_error=None
) -> torch.fx.Node | None:
    """Replace ``node`` by its decomposition traced under the autocast state eager runs it in, when autocast
    casts anything inside it.

    Returns the first new node, or None when the op stays as it is. The decomposition is compared with the
    one traced without autocast; when only the autocast trace succeeds (inputs of mixed dtypes that autocast
    unifies, ``einsum(fp16, fp32)`` in a region), autocast clearly changes it and it is spliced."""
    device = op_device_type(args, kwargs)
    enabled, dtype, source, context, region = _autocast_state(node, device, policy)
    try:
        traced = _trace(node.target, args, kwargs, state.mode, (device, dtype))
    except Exception as exc:
        _not_traced(node, f"tracing it under {context} failed: {_first_line(exc)}", on_error, exc)
        return None
    check_dynamic(state, node)
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        _not_traced(
            node, "its decomposition creates tensor constants, which precast does not splice", on_error
        )
        return None
    try:
        with _quiet_fake_tensor_log():
            plain = _casts(_trace(node.target, args, kwargs, state.mode, None))
    except Exception:  # noqa: BLE001 - eager would fail without autocast: autocast is what makes it run
        plain = -1
    check_dynamic(state, node)
    if _casts(traced) <= plain:
        return None
    _stride_independent(traced)
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
    check_dynamic(state, node)
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
