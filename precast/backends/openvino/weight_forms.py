"""The int8 / int4 weight forms of a program (issue 41) rewritten, before OpenVINO converts it, into the forms its
frontend and CPU plugin keep compressed; the same values.

- **int4 linear** (``stack([packed & 15, packed >> 4], -1)`` of a uint8 constant, viewed to groups, ``(q - zero) *
  scale``): OpenVINO's frontend turns that stack into one ``u4`` constant (``u4_compression_stack``, in its
  ``aten.stack`` translator), but ``run_decompositions`` (with OpenVINO's own table, as
  ``TorchFXPythonDecoder.from_exported_program`` runs it) has already decomposed the stack into
  ``cat([unsqueeze(lo, 2), unsqueeze(hi, 2)], -1)``: the pattern does not fire, and the conversion fails on
  ``aten.bitwise_right_shift.Tensor_Scalar``, which the FX frontend converts only inside that pattern (measured:
  ``openvino.convert_model(ep)`` fails so, openvino 2026.4.1 with torch 2.13). ``restack_nibbles`` puts the stack
  back.
- **int4 embedding** (the packed rows gathered, then unpacked and dequantized with the gathered zero points and
  scales, so an eager run never unpacks the table): a nibble shift of gathered rows has no conversion at all.
  ``int4_rows_from_table`` gathers from the table dequantized in the linear's form instead, which OpenVINO holds as
  one u4 constant and its CPU plugin gathers compressed (one ``Gather`` reading u4, its scale and zero point as
  inputs).
- **int8** (``_to_copy(q) * scale``; an embedding's rows gathered from ``q`` then converted and scaled) converts as it
  is: ``Constant(i8) -> Convert -> Multiply``, the Convert marked a decompression by the frontend.

Input: the decomposed GraphModule OpenVINO is about to convert. Output: how many reads were rewritten.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from precast.quant.formats import INT4_GROUPS, Int4
from precast.quant.forms import FORM_OPS, NIBBLES, packed_of, write_weight

aten = torch.ops.aten


def call(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def nibbles(lo: Any, hi: Any) -> bool:
    """``lo`` is ``c & 15`` and ``hi`` is ``c >> 4`` of one uint8 tensor ``c`` (int4's unpacking, as the weight
    formats' home recognises it: ``precast.quant.forms.packed_of``)."""
    return packed_of(lo, hi) is not None


# ---- the rewrites -------------------------------------------------------------------------------------------------
def compressible_weights(gm: torch.fx.GraphModule) -> int:
    """The decomposed program in the forms OpenVINO compresses (``int4_rows_from_table``, then
    ``restack_nibbles``); the same values. Returns how many reads were rewritten."""
    return int4_rows_from_table(gm) + restack_nibbles(gm)


def restack_nibbles(gm: torch.fx.GraphModule) -> int:
    """Each ``cat([unsqueeze(c & 15, r), unsqueeze(c >> 4, r)], -1)`` (``stack([lo, hi], -1)`` as
    ``run_decompositions`` leaves it, ``r`` the nibbles' rank) back to ``aten.stack.default([lo, hi], -1)``, the form
    OpenVINO's frontend turns into one u4 constant (see the module docstring). The same values; returns how many."""
    graph = gm.graph
    found = 0
    for cat in list(graph.nodes):
        if not call(cat, aten.cat.default) or len(cat.args[0]) != 2:
            continue
        parts = cat.args[0]
        if not all(call(p, aten.unsqueeze.default) and len(p.users) == 1 for p in parts):
            continue
        lo, hi = (p.args[0] for p in parts)
        low = val(lo)
        if low is None or not nibbles(lo, hi):
            continue
        rank = low.dim()
        dims = [p.args[1] % (rank + 1) for p in parts]
        cat_dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % (rank + 1)
        if dims != [rank, rank] or cat_dim != rank:
            continue
        with graph.inserting_before(cat):
            stack = graph.call_function(aten.stack.default, ([lo, hi], -1))
        stack.meta = dict(cat.meta)
        cat.replace_all_uses_with(stack)
        graph.erase_node(cat)
        for part in parts:
            graph.erase_node(part)
        found += 1
    if found:
        graph.lint()
        gm.recompile()
    return found


def int4_rows_from_table(gm: torch.fx.GraphModule) -> int:
    """Each int4 embedding read as rows gathered then unpacked (``embedding(packed, ids) & 15``, ``>> 4``, minus the
    gathered zero points, times the gathered scales: how the conversion keeps an eager run from unpacking the whole
    table) becomes ``embedding(table, ids)`` of the table dequantized in the linear's form, which OpenVINO's frontend
    holds as one u4 constant and its CPU plugin gathers compressed. OpenVINO converts a nibble shift only inside that
    pattern (of a constant): on gathered rows the conversion fails. Bitwise the same values (a gather moves data;
    each element is ``(q - z) * s`` in the same dtype either way). Returns how many."""
    graph = gm.graph
    found = 0
    for rows in list(graph.nodes):
        table = rows.args[0] if call(rows, aten.embedding.default) else None
        packed = val(table)
        if packed is None or packed.dtype != torch.uint8 or packed.dim() != 2 or table.op != "get_attr":
            continue
        readers = {u.target: u for u in rows.users}
        lo, hi = (readers.get(target) for target, _ in NIBBLES)
        if lo is None or hi is None or len(rows.users) != 2 or not nibbles(lo, hi):
            continue
        end = _dequantized_rows(rows, 2 * packed.shape[1])
        if end is None:
            continue
        out, zero, scale = end
        n, k = packed.shape[0], 2 * packed.shape[1]
        groups = val(scale).numel() // n
        dt = val(out).dtype
        if k // groups not in INT4_GROUPS:
            continue  # not a group precast writes
        with graph.inserting_before(out):  # the table dequantized in the linear's form (precast.quant.forms)
            make = _Maker(graph)
            parts = {
                "q": table,
                "zero": make(aten.view.default, zero, [n, groups, 1]),
                "scale": make(aten.view.default, scale, [n, groups, 1]),
            }
            w = write_weight(make, Int4(k // groups), parts, dt, (n, k))
            new = make(aten.embedding.default, w, rows.args[1])
        new.meta = {**out.meta, "val": new.meta["val"]}
        out.replace_all_uses_with(new)
        found += 1
    if found:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return found


# the ops between an int4 embedding's gathered rows and their dequantized value: the form's own
# (``precast.quant.forms``), and those OpenVINO's decompositions may turn its reshapes, casts and stack into
_ROWS = FORM_OPS | {
    aten.to.dtype,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.cat.default,
}


def _dequantized_rows(
    rows: torch.fx.Node, k: int
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """From the gathered packed rows, the node that holds them dequantized (``[..., k]``, floating), with the zero
    point and scale constants it gathers by the same ids: (that node, zero, scale), or None where what lies
    between is anything else."""
    ids = rows.args[1]
    seen: set[torch.fx.Node] = set()
    todo = list(rows.users)
    while todo:
        node = todo.pop(0)
        if node in seen or not call(node, *_ROWS):
            continue
        seen.add(node)
        value = val(node)
        if (
            value is not None
            and value.is_floating_point()
            and value.dim() == val(rows).dim()
            and value.shape[-1] == k
        ):
            tables = _gathered_tables(node, ids)
            if tables is None or len(tables) != 3 or tables[0] is not rows.args[0]:
                return None
            zero, scale = sorted(tables[1:], key=lambda t: val(t).is_floating_point())
            if val(zero).dtype != torch.uint8 or not val(scale).is_floating_point():
                return None
            return node, zero, scale
        todo += list(node.users)
    return None


def _gathered_tables(out: torch.fx.Node, ids: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The constants ``out`` gathers by ``ids`` (the packed table first), where every node it depends on is one of
    the unpacking ops over such gathers; else None."""
    tables: list[torch.fx.Node] = []
    todo, seen = [out], set()
    while todo:
        node = todo.pop()
        if node in seen or node is ids:
            continue
        seen.add(node)
        if not call(node, *_ROWS):
            return None
        if node.target is aten.embedding.default:
            if node.args[1] is not ids:
                return None
            base = node.args[0]
            while call(base, aten.view.default, aten.reshape.default):
                base = base.args[0]
            if not isinstance(base, torch.fx.Node) or base.op != "get_attr":
                return None
            tables.append(base)
            continue
        # tensors only: a view's sizes (sym_size of the ids, with a dynamic batch) are not what it reads
        todo += [a for a in node.all_input_nodes if a.op != "get_attr" and val(a) is not None]
    tables.sort(key=lambda t: val(t).dtype != torch.uint8 or val(t).dim() != 2)
    return tables


class _Maker:
    """New call_function nodes with their fake values (computed on the fake inputs)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fakes = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], (args, kwargs))
        mode = next(v.fake_mode for v in pytree.tree_leaves(fakes) if hasattr(v, "fake_mode"))
        with mode:
            node.meta["val"] = target(*fakes[0], **fakes[1])
        return node
