"""Fake tensors of the conversion: a private shape environment and the program's fake values re-created on it.

The program's fake values share one ShapeEnv with the input program. Running ops on them can add guards or
replace a dynamic symbol by its example value (a C++ composite reading ``sizes()``), and that would narrow the
caller's program as well as ours. So the conversion works on a private copy of the ShapeEnv
(``fake_state(program)``, kept on the Program): every fake value of the program is re-created on it, and
every fake run (``precast.ir.fake_run.run_fake``) checks that no symbol of the program's inputs was specialized
or narrowed.

After a rewriting stage, values are updated incrementally (``precast.ir.fake_update.check_pass``).

Input: a ``Program``. Output: its ``FakeState`` (the private mode, the input symbols to preserve); fake values in
``node.meta["val"]`` on that mode.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from precast.errors import PrecastError
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


def has_data(value: object) -> bool:
    """Whether ``value`` is a tensor holding data: not on the meta device, not a FakeTensor (a program exported or
    converted with streamed weights holds such tensors in place of its weights). The one test of it."""
    return (
        isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.device.type != "meta"
    )


def lacks_data(value: object) -> bool:
    """A tensor without data (meta or a FakeTensor); a non-tensor is neither."""
    return isinstance(value, torch.Tensor) and not has_data(value)


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
