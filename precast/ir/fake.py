"""Fake tensors of the conversion: a private shape environment, running ops on fake values, and keeping
``node.meta["val"]`` right after every rewrite.

The program's fake values share one ShapeEnv with the input program. Running ops on them can add guards or
replace a dynamic symbol by its example value (a C++ composite reading ``sizes()``), and that would narrow the
caller's program as well as ours. So the conversion works on a private copy of the ShapeEnv
(``fake_state(program)``, kept on the Program): every fake value of the program is re-created on it, and
every fake run checks that no symbol of the program's inputs was specialized or narrowed.

After a rewriting stage, values are updated incrementally (``precast.ir.fake_update.check_pass``).

Input: a ``Program``. Output: fake values in ``node.meta["val"]``; a ``PrecastError`` naming the node when an
op cannot run on them.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from precast.dtypes import dtype_name
from precast.errors import PrecastError, first_line, where
from precast.ir import op_families
from precast.ir.graph import tensor_args
from precast.ir.program import Program

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
        if val is not None and foreign(val, state.mode):
            node.meta["val"] = _rebind(val, state.mode, memo)


def foreign(value: object, mode: FakeTensorMode) -> bool:
    if isinstance(value, FakeTensor):
        return value.fake_mode is not mode
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return mode.shape_env is not None and value.node.shape_env is not mode.shape_env
    if isinstance(value, (list, tuple, dict)):
        return any(foreign(v, mode) for v in (value.values() if isinstance(value, dict) else value))
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
    for sym, (name, rng) in list(state.symbols.items()):
        now = env.replacements.get(sym, sym)
        new = env.var_to_range.get(sym)
        if now == sym and _zero_one_assumption(rng, new):
            # the lower bound raised to 2 is torch.export's own 0/1 specialization (export traces sizes >= 2 and
            # still accepts 1 at run time, per the program's range_constraints): what export itself assumed
            # while tracing this op, not a narrowing by precast (a program loaded from a file starts at 1)
            state.symbols[sym] = (name, new)
            continue
        if now != sym or new != rng:
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


def _zero_one_assumption(old: object, new: object) -> bool:
    """``new`` is ``old`` with its lower bound raised from 0 or 1 to 2, the upper bound unchanged."""
    if old is None or new is None:
        return False
    return int(old.lower) <= 1 and int(new.lower) == 2 and old.upper == new.upper


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
    again on inputs no op can tell from its last run's (same objects, or ``same_fake``) returns that run's
    result (``FakeState.runs``): the checks after insert_casts and fold recompute on the cast values classify
    used, or on folded constants of the same metadata."""
    if target is operator.getitem:
        return target(*args)
    memo = _memoizable(target)
    if memo and state.reuse_runs:
        last = state.runs.get(node)
        if last is not None and last[0] is target and _same_args(last[1], (args, kwargs)):
            return last[2]
    # no autograd: a conversion's fake runs compute dtypes and shapes for inference, and an op autograd refuses
    # (a Parameter passed as batch_norm's running_var) runs without it, as the program itself does
    with state.mode, enable_python_dispatcher(), _oblivious_backend_choice(target), torch.no_grad():
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
    immutable lists), fake values by ``same_fake``, real tensors (constants) by identity, anything else by
    type and value."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_args(a[k], b[k]) for k in a)
    sym = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, sym) or isinstance(b, sym):  # `==` on symbolic values would add a guard
        return same_fake(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


MISSING = object()  # "no value recorded" (None is a value)


def same_fake(a: object, b: object) -> bool:
    """The same object, or fake values an op that writes nothing computes the same metadata from: same
    structure, and tensors of the same dtype, device, sizes, strides, storage offset and layout (symbolic sizes
    by expression: ``==`` on SymInts would add a guard). ``requires_grad`` is not compared: it does not change
    an output's metadata, and export records values without it."""
    if a is b:
        return a is not MISSING
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
        return all(same_fake(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not isinstance(a, bool) and not isinstance(b, bool) and _same_int(a, b)
    return False


def _same_int(p: object, q: object) -> bool:
    pe = p.node.expr if isinstance(p, torch.SymInt) else p
    qe = q.node.expr if isinstance(q, torch.SymInt) else q
    return bool(pe == qe)


def fake_run_error(node: torch.fx.Node, target, args: tuple, kwargs: dict, exc: Exception) -> PrecastError:
    """The error for an op that fails on fake values: ``dtype-mismatch`` only when its floating inputs have
    different dtypes (what the program would hit at run time); anything else is ``fake-run-failed``."""
    floats = {t.dtype for _, t in tensor_args(args, kwargs) if t.is_floating_point()}
    if len(floats) > 1:
        return PrecastError(
            f"{where(node)}: {first_line(exc)}; inputs {_dtypes(args, kwargs)}. "
            "This op would fail at run time with these dtypes: cast its inputs to one dtype (e.g. `.float()`) "
            "or move it inside the autocast region",
            code="dtype-mismatch",
            node=node.name,
        )
    op = str(target)
    return PrecastError(
        f"{where(node)}: {op} fails on the program's fake values with inputs {_dtypes(args, kwargs)}: "
        f"{first_line(exc)}; check that the program runs as exported (ep.module()), else report it",
        code="fake-run-failed",
        node=node.name,
    )


def arg_name(node: torch.fx.Node, path: tuple) -> str:
    if path[0] == "kwargs":
        return str(path[1])
    schema_args = getattr(node.target, "_schema", None)
    if schema_args is not None and path[1] < len(schema_args.arguments):
        name = schema_args.arguments[path[1]].name
        return name if len(path) == 2 else f"{name}[{path[2]}]"
    return f"arg{path[1]}"


def _dtypes(args, kwargs) -> str:
    return "(" + ", ".join(dtype_name(t.dtype) or "?" for _, t in tensor_args(args, kwargs)) + ")"
