"""The graph form of each weight format: the ops that dequantize a stored weight, written once
(``write_weight``, ``write_rows``: the conversion's pass, ``precast.quant.graph``) and recognised once
(``recognise``: every engine that reads the stored integers in its kernels imports it; none re-matches the shape).

For a linear weight W [N, K] read in ``dt`` (``precast.quant.formats`` holds the arithmetic, op for op the same):

- int8:      ``mul(_to_copy(q, dtype=dt), scale)``, ``q`` int8 [N, K], ``scale`` [N, 1];
- int8-asym: ``mul(sub(_to_copy(q, dtype=dt), _to_copy(zero, dtype=dt)), scale)``, ``q`` and ``zero`` uint8;
- int4 (group g): ``view(mul(sub(_to_copy(view(stack([packed & 15, packed >> 4], -1), [N, K/g, g]), dtype=dt),
  _to_copy(zero, dtype=dt)), scale), [N, K])``, ``packed`` uint8 [N, K/2] (low nibble the even index), ``zero``
  uint8 and ``scale`` [N, K/g, 1].

A convolution's weight [O, I, kh, kw] (int8 / int8-asym, per output channel) is stored as the matrix
[O, I*kh*kw] and written as that matrix's form viewed back to the weight's shape (``write_conv_weight``):
``view(mul(_to_copy(q, dtype=dt), scale), [O, I, kh, kw])``. ``recognise`` reads linear weights only, so every
engine runs a convolution's weight as the float dequantization the graph states (the same values).

An embedding gathers the rows of each part first and dequantizes only those (``write_rows``). The casts that
decompress a weight carry a custom-meta mark (``is_dequant``): the report does not count them as activation casts.

Input: graph nodes. Output: the dequantizing nodes (writer), or a ``Dequantized`` naming the parts (recogniser).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from precast.quant.formats import INT8, INT8_ASYM, Int4, WeightFormat

aten = torch.ops.aten
EMBEDDING = aten.embedding.default
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
# int4's unpacking, low nibble first: ``stack([op(packed, arg) for op, arg in NIBBLES], -1)`` (the writer, the
# recogniser, and every engine that spells the recipe elsewhere, e.g. AOTInductor's int4 packing, read it here)
NIBBLES = ((aten.bitwise_and.Scalar, 15), (aten.bitwise_right_shift.Tensor_Scalar, 4))
# the dtype of each format's stored ``q`` (int4's: the packed bytes)
Q_DTYPE = {"int8": torch.int8, "int8-asym": torch.uint8, "int4": torch.uint8}
# every op the writer puts between a stored part and the value a linear / embedding reads
FORM_OPS = frozenset(
    {
        aten._to_copy.default,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.view.default,
        aten.stack.default,
        aten.unsqueeze.default,
        aten.flatten.using_ints,
        aten.unflatten.int,
        EMBEDDING,
        *(op for op, _ in NIBBLES),
    }
)
META_KEY = "precast"
DEQUANT = "dequant"  # custom-meta mark of the casts that decompress a stored weight

# op(target, *args, **kwargs) -> the new node (the caller places it and copies its reader's meta)
Op = Callable[..., Node]


def is_dequant(node: Node) -> bool:
    return bool(((node.meta.get("custom") or {}).get(META_KEY) or {}).get(DEQUANT))


def mark_dequant(node: Node) -> None:
    node.meta.setdefault("custom", {}).setdefault(META_KEY, {})[DEQUANT] = True


# ---- the writer --------------------------------------------------------------------------------------------------
def _dequantized(
    op: Op, q: Node, zero: Node | None, scale: Node, dt: torch.dtype, held: torch.dtype | None = None
) -> Node:
    """``q.to(dt) * scale``, or ``(q.to(dt) - zero.to(dt)) * scale``; scales ``held`` on a narrower grid than ``dt``
    (a tied table's, bf16, read in fp32 by the embedding: ``scale_grid``) are cast to ``dt`` first, exactly, after
    an embedding's gather (a row's scales only)."""
    value = op(aten._to_copy.default, q, dtype=dt)
    if zero is not None:
        value = op(aten.sub.Tensor, value, op(aten._to_copy.default, zero, dtype=dt))
    if held not in (None, dt):
        scale = op(aten._to_copy.default, scale, dtype=dt)
    return op(aten.mul.Tensor, value, scale)


def _held(parts: dict[str, Node]) -> torch.dtype | None:
    """The dtype the scale constant is stored in (None where its node has no value)."""
    val = parts["scale"].meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _nibbles(op: Op, packed: Node) -> Node:
    """``stack([packed & 15, packed >> 4], -1)``: the int4 values, low nibble first."""
    return op(aten.stack.default, [op(target, packed, arg) for target, arg in NIBBLES], -1)


def write_weight(
    op: Op, fmt: WeightFormat, parts: dict[str, Node], dt: torch.dtype, shape: tuple[int, int]
) -> Node:
    """The dequantized [out, in] weight a linear reads."""
    n, k = shape
    if fmt.kind in ("int8", "int8-asym"):
        return _dequantized(op, parts["q"], parts.get("zero"), parts["scale"], dt, _held(parts))
    g = fmt.group
    q = op(aten.view.default, _nibbles(op, parts["q"]), [n, k // g, g])
    dequantized = _dequantized(op, q, parts["zero"], parts["scale"], dt, _held(parts))
    return op(aten.view.default, dequantized, [n, k])


def write_conv_weight(
    op: Op, fmt: WeightFormat, parts: dict[str, Node], dt: torch.dtype, shape: tuple[int, ...]
) -> Node:
    """A convolution's dequantized weight of ``shape`` ([O, I, kh, ...]): the [O, I*kh*...] matrix's form
    (``write_weight``), viewed to ``shape``."""
    matrix = (shape[0], math.prod(shape[1:]))
    return op(aten.view.default, write_weight(op, fmt, parts, dt, matrix), list(shape))


def write_rows(
    op: Op, fmt: WeightFormat, parts: dict[str, Node], dt: torch.dtype, ids: Node, n: int, k: int
) -> Node:
    """An embedding's rows, gathered from the parts then dequantized (the whole table never is)."""
    if fmt.kind in ("int8", "int8-asym"):
        gathered = {role: op(EMBEDDING, part, ids) for role, part in parts.items()}
        return _dequantized(op, gathered["q"], gathered.get("zero"), gathered["scale"], dt, _held(parts))
    g = fmt.group

    def rows_of(part: Node) -> Node:  # [n, k/g, 1] read as [..., k/g, 1]
        return op(aten.unsqueeze.default, op(EMBEDDING, op(aten.view.default, part, [n, k // g]), ids), -1)

    scale = rows_of(parts["scale"])
    q = _nibbles(op, op(EMBEDDING, parts["q"], ids))
    q = op(aten.unflatten.int, op(aten.flatten.using_ints, q, -2, -1), -1, [k // g, g])
    dequantized = _dequantized(op, q, rows_of(parts["zero"]), scale, dt, _held(parts))
    return op(aten.flatten.using_ints, dequantized, -2, -1)


# ---- the recogniser ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dequantized:
    """A linear's weight recognised as a stored format: its parts (``q``: int4's packed bytes), the dtype it is
    dequantized to, and ``chain``: the dequantizing nodes, first to last (the weight node itself last)."""

    format: WeightFormat
    q: Node
    scale: Node
    zero: Node | None
    dtype: torch.dtype
    chain: tuple[Node, ...]


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def value_of(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a plain ``_to_copy(t, dtype=...)`` (no other change), else None."""
    if not is_call(node, aten._to_copy.default) or len(node.args) != 1:
        return None
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    if extra.get("layout", torch.strided) != torch.strided or extra.get("memory_format") not in (
        None,
        torch.preserve_format,
        torch.contiguous_format,
    ):
        return None
    return node.kwargs.get("dtype")


def packed_of(lo: Any, hi: Any) -> Node | None:
    """``p`` where ``lo`` is ``p & 15`` and ``hi`` is ``p >> 4`` of one uint8 tensor ``p`` (int4's nibbles)."""
    (lo_op, lo_arg), (hi_op, hi_arg) = NIBBLES
    if not (is_call(lo, lo_op) and is_call(hi, hi_op)):
        return None
    p, pv = lo.args[0], value_of(lo.args[0])
    ok = (
        p is hi.args[0]
        and pv is not None
        and pv.dtype == Q_DTYPE["int4"]
        and lo.args[1] == lo_arg
        and hi.args[1] == hi_arg
    )
    return p if ok else None


def _sub_of_casts(sub: Any) -> tuple[Node, Node, torch.dtype] | None:
    """``(a_cast, b_cast, dt)`` of ``sub(_to_copy(a, dtype=dt), _to_copy(b, dtype=dt))`` (alpha 1)."""
    if not is_call(sub, aten.sub.Tensor) or len(sub.args) != 2 or sub.kwargs.get("alpha", 1) != 1:
        return None
    a, b = sub.args
    dt = cast_dtype(a)
    return (a, b, dt) if dt is not None and cast_dtype(b) == dt else None


def _int8(w: Node) -> Dequantized | None:
    for deq, s in (w.args, w.args[::-1]):
        dt = cast_dtype(deq)
        qv = value_of(deq.args[0]) if dt is not None else None
        if qv is not None and qv.dtype == Q_DTYPE["int8"] and qv.dim() == 2 and isinstance(s, Node):
            return Dequantized(INT8, deq.args[0], s, None, dt, (deq, w))
    return None


def _int8_asym(w: Node) -> Dequantized | None:
    for sub, s in (w.args, w.args[::-1]):
        casts = _sub_of_casts(sub)
        if casts is None or not isinstance(s, Node):
            continue
        qf, zf, dt = casts
        qv = value_of(qf.args[0])
        if qv is not None and qv.dtype == Q_DTYPE["int8-asym"] and qv.dim() == 2:
            return Dequantized(INT8_ASYM, qf.args[0], s, zf.args[0], dt, (qf, zf, sub, w))
    return None


def _int4(w: Node) -> Dequantized | None:
    mul = w.args[0]
    if not is_call(mul, aten.mul.Tensor):
        return None
    for sub, s in (mul.args, mul.args[::-1]):
        casts = _sub_of_casts(sub)
        if casts is None or not isinstance(s, Node) or not is_call(casts[0].args[0], *VIEWS):
            continue
        qf, zf, dt = casts
        grouped = qf.args[0]
        stack = grouped.args[0]
        if not is_call(stack, aten.stack.default) or len(stack.args[0]) != 2:
            continue
        dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
        lo, hi = stack.args[0]
        p = packed_of(lo, hi)
        gv = value_of(grouped)
        if (
            p is None
            or dim not in (-1, 2)
            or gv is None
            or gv.dim() != 3
            or not isinstance(gv.shape[-1], int)
        ):
            continue
        g = gv.shape[-1]
        fmt = Int4(g) if g in (32, 64, 128) else _Group(g)
        return Dequantized(fmt, p, s, zf.args[0], dt, (lo, hi, stack, grouped, qf, zf, sub, mul, w))
    return None


class _Group(WeightFormat):
    """An int4 form of a group size precast does not write (a hand-built program): recognised, so an engine can
    say why its kernel does not take it."""

    def __init__(self, group: int) -> None:
        super().__init__("int4", group)

    def __repr__(self) -> str:
        return f"int4 group {self.group}"


def recognise(w: Any) -> Dequantized | None:
    """The stored format behind a linear's weight operand ``w`` (the forms in the module docstring, either operand
    order of the ``mul``), or None for a float weight or any other computation."""
    if is_call(w, aten.mul.Tensor) and len(w.args) == 2:
        return _int8(w) or _int8_asym(w)
    if is_call(w, *VIEWS):
        return _int4(w)
    return None
