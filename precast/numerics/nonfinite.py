"""The first non-finite op of a low-precision program, and the one-op subgraph that reproduces an op's result.

Input: a converted ``Program`` (the policy's decisions lowered: casts explicit), its placeholder values for one
batch. Output: ``NonFinite`` (the first op, in execution order, whose output is non-finite while its inputs are
finite: name, module, source line, input ranges, the reason) or None; ``op_inputs`` (the fp32 values an op
computes from) and ``op_subgraph`` (that op alone as an ExportedProgram), for ``--repro``.

One instrumented run: an ``fx.Interpreter`` over the converted graph that stops at the first such op. When the
first non-finite value is a cast precast wrote (an fp32 value beyond the low dtype's range, cast for an op that
reads it in low precision), the op named is that reader: it is the op whose low precision breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from precast.dtypes import dtype_name
from precast.errors import module_path, user_source_line
from precast.ir.graph import CAST_META
from precast.policy.rules.taxonomy import op_name

LOG_OPS = {"log", "log2", "log10", "log1p", "xlogy"}
ROOT_OPS = {"sqrt", "rsqrt", "pow"}
DIV_OPS = {"div", "true_divide", "reciprocal", "remainder", "fmod"}


@dataclass
class NonFinite:
    name: str
    module: str
    op: str
    location: str | None
    reason: str
    inputs: list[dict] = field(default_factory=list)  # per floating input: name, dtype, min, max, absmax
    via_cast: str | None = None  # the cast precast wrote whose output is the first non-finite value


class _Found(Exception):
    """Raised by the watching interpreter to stop at the first non-finite op (caught in ``first_nonfinite``)."""


class _Watching(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.first: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if (
            n.op == "call_function"
            and not _finite(out)
            and all(_finite(self.env[a]) for a in n.all_input_nodes)
        ):
            self.first = n
            self.env[n] = out  # run() stores it only on return
            raise _Found
        return out


def _finite(value: Any) -> bool:
    return all(
        bool(torch.isfinite(t).all())
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _describe(name: str, t: Any) -> dict | None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    d = t.detach().double()
    return {
        "name": name,
        "dtype": dtype_name(t.dtype),
        "min": d.min().item(),
        "max": d.max().item(),
        "absmax": d.abs().max().item(),
        "zeros": int((d == 0).sum().item()),
    }


def run_watching(gm: torch.fx.GraphModule, values: list) -> tuple[torch.fx.Node | None, dict]:
    """Run ``gm`` on placeholder ``values``: the first op whose output is non-finite from finite inputs (None
    if every value stays finite) and the values computed up to it (node -> value)."""
    interp = _Watching(gm)
    try:
        with torch.no_grad():
            interp.run(*values)
    except _Found:
        pass  # the op is interp.first
    return interp.first, interp.env


def first_nonfinite(
    gm: torch.fx.GraphModule, values: list, low: torch.dtype
) -> tuple[NonFinite | None, Any, dict]:
    """The first non-finite op (see the module docstring), the node to reproduce it with (None, None when every
    value stays finite), and the values computed up to it."""
    node, env = run_watching(gm, values)
    if node is None:
        return None, None, env
    finfo = torch.finfo(low)
    via = None
    target = node
    if node.meta.get(CAST_META) is not None:
        via = node.name
        readers = [u for u in node.users if u.op == "call_function" and u.meta.get(CAST_META) is None]
        target = readers[0] if readers else node
        src = env[node.args[0]]
        reason = (
            f"its input {node.args[0].name} reaches |{_absmax(src):.6g}| in float32, beyond {dtype_name(low)}'s "
            f"±{finfo.max:.6g}: the cast to {dtype_name(low)} for this op overflows to inf"
        )
    else:
        reason = _reason(node, env, low)
    inputs = [d for a in target.all_input_nodes if (d := _describe(*_origin_named(a, env))) is not None]
    found = NonFinite(
        target.name,
        module_path(target),
        op_name(target.target),
        user_source_line(target),
        reason,
        inputs,
        via,
    )
    return found, target, env


def _absmax(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def _reason(node: torch.fx.Node, env: dict, low: torch.dtype) -> str:
    """Why finite inputs gave a non-finite output: the op recomputed in float32 says overflow or domain."""
    finfo = torch.finfo(low)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _up(env[a]))
    name = op_name(node.target)
    try:
        ref = node.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - said in the reason: the fp32 recomputation is only an explanation
        ref, why = None, f"{type(exc).__name__}"
    outs = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    got = [t for t in pytree.tree_leaves(env[node]) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    nan = any(bool(torch.isnan(t).any()) for t in got)
    kind = "NaN" if nan else "inf"
    if ref is None:
        return f"{kind} in {dtype_name(low)} (recomputing it in float32 failed: {why})"
    if outs and all(bool(torch.isfinite(t).all()) for t in outs):
        big = max(_absmax(t) for t in outs)
        if big > finfo.max:
            return (
                f"overflow: in float32 its output reaches |{big:.6g}|, beyond {dtype_name(low)}'s ±{finfo.max:.6g}"
                + (" (then inf - inf or 0 * inf made NaN)" if nan else "")
            )
        return f"{kind} in {dtype_name(low)} although float32 stays finite (|output| <= {big:.6g})"
    floats = [
        a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]
    zero = any(bool((a == 0).any()) for a in floats)
    neg = any(bool((a < 0).any()) for a in floats)
    if name in LOG_OPS and zero:
        return f"log of 0 ({kind}), in float32 too"
    if name in LOG_OPS and neg:
        return f"log of a negative value ({kind}), in float32 too"
    if name in ROOT_OPS and neg:
        return f"root of a negative value ({kind}), in float32 too"
    if name in DIV_OPS and zero:
        return ("0/0 (NaN)" if nan else "division by 0 (inf)") + ", in float32 too"
    return f"{kind} in float32 too (a domain error of {name}, not a precision one)"


def _up(v: Any) -> Any:
    return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _origin_named(a: torch.fx.Node, env: dict) -> tuple[str, Any]:
    """(name, value) of an op's input before the casts precast wrote (an upcast of low values is exact)."""
    while a.meta.get(CAST_META) is not None:
        a = a.args[0]
    return a.name, env[a]


def _origin(a: torch.fx.Node, env: dict) -> Any:
    return _origin_named(a, env)[1]


def op_inputs(node: torch.fx.Node, env: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of ``node`` with every input at its value before precast's casts, floating ones in fp32."""
    return torch.fx.node.map_arg((node.args, node.kwargs), lambda a: _up(_origin(a, env)))


class OneOp(torch.nn.Module):
    """One op with its tensor arguments as inputs and everything else fixed (the repro subgraph)."""

    def __init__(self, target: Any, args: tuple, kwargs: dict):
        super().__init__()
        self.target = target
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.fixed = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.fixed)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.target(*args, **kwargs)


def op_subgraph(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[torch.export.ExportedProgram, tuple]:
    """``node``'s op alone, exported with its tensor inputs (fp32 values) as the program's inputs."""
    mod = OneOp(node.target, args, kwargs)
    tensors = tuple(v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor))
    return torch.export.export(mod, tensors, strict=False), tensors


def is_nonfinite(value: Any) -> bool:
    return not _finite(value)
