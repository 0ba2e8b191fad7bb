"""The program in the forms OpenVINO's CPU plugin fuses, where the rewrite computes the same values.

OpenVINO's CPU plugin fuses a rotary embedding ``x * cos + rotate_half(x) * sin`` into one ``RoPE`` layer
(``RoPEFusionGPTNEOX``) when its pattern matches: one ``x`` read by both products, ``rotate_half`` as
``Concat(Multiply(Slice(x, h:), -1.0), Slice(x, :h))`` on the last axis. A precast program misses that pattern in
two ways, each fixed here without changing a value:

- ``rotation_reads_promoted`` (on the decomposed GraphModule, before conversion). Under eager autocast the query
  and key projections are bf16 (or fp16) and the cos/sin tables fp32, so each product promotes ``x`` to fp32:
  torch inside the multiply, OpenVINO's frontend as two Converts, one of ``x`` and one of the rotated ``x``, and
  the pattern's single ``x`` is not there. The rewrite casts ``x`` once and rotates the cast value. Exact: the
  widening cast commutes with slicing, negation and concatenation, and each multiply then reads the very fp32
  values it promoted before (bitwise the same results, tested).
- ``fold_scalar_casts`` (on the OpenVINO model). The frontend writes ``neg`` as a multiply by ``ConvertLike`` of
  an integer ``-1`` and marks that Convert as a decompression (``DisableConstantFolding``): the CPU plugin keeps it
  a Convert, and the pattern's ``-1.0`` constant is not there either. (A saved IR loses the mark and folds it:
  OpenVINO's own exports, read from disk, fuse.) Each Convert of a one-element constant that only computations on
  data read becomes the constant it computes, where the conversion is exact; a weight's decompression (the weight,
  its scale and zero point: read by constant-only ops) keeps its Converts.

Measured on the 0.246 B Llama-shaped decoder (bf16 hint, one thread): a decode step ran 552 OpenVINO layers and
now runs 372 (OpenVINO's own export: 371), one RoPE layer per query and key projection (``docs/backends.md``).

Input: the decomposed GraphModule OpenVINO is about to convert / the converted ``openvino.Model``. Output: how
many rotations / casts were rewritten.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from precast.ir.program import META_KEY

aten = torch.ops.aten


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """``node``'s arguments by name, defaults filled in (PyTorch's schema normalisation)."""
    pair = node.normalized_arguments(node.graph.owning_module, normalize_to_only_use_kwargs=True)
    return dict(pair.kwargs) if pair is not None else {}


def _last_dim(dim: Any, rank: int) -> bool:
    return isinstance(dim, int) and dim % rank == rank - 1


def _half_slice(node: Any, x: torch.fx.Node, first: bool) -> bool:
    """``node`` is ``x[..., :h]`` (first) or ``x[..., h:]`` with ``h`` half the last dimension."""
    xv = _val(x)
    if not _call(node, aten.slice.Tensor) or xv is None or xv.dim() < 1:
        return False
    a = _arguments(node)
    size = xv.shape[-1]
    if a.get("input") is not x or not isinstance(size, int) or size % 2 or a.get("step") != 1:
        return False
    if not _last_dim(a.get("dim"), xv.dim()):
        return False
    start, end, half = a.get("start"), a.get("end"), size // 2
    if first:
        return start in (0, None) and end == half
    return start == half and (end is None or (isinstance(end, int) and end >= size))


def _rotation(node: Any) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """Where ``node`` is ``cat((-x[..., h:], x[..., :h]), -1)`` (transformers' ``rotate_half``): ``x`` and the
    nodes between it and ``node`` (the negation, the two slices); else None."""
    if not _call(node, aten.cat.default):
        return None
    a = _arguments(node)
    if len(a.get("tensors", ())) != 2:
        return None
    neg, first = a["tensors"]
    if not _call(neg, aten.neg.default) or not _call(first, aten.slice.Tensor):
        return None
    x = first.args[0]
    xv = _val(x)
    if xv is None or not _last_dim(a.get("dim"), xv.dim()):
        return None
    if not (_half_slice(first, x, first=True) and _half_slice(neg.args[0], x, first=False)):
        return None
    return x, [neg, first, neg.args[0]]


def _retyped(node: torch.fx.Node, dtype: torch.dtype) -> None:
    """``node`` now makes ``dtype``: its value's metadata, and (on this private copy of the decision record) the
    dtype precast's plan check holds its OpenVINO layer to (the same values, computed wider)."""
    node.meta["val"] = node.meta["val"].to(dtype)
    custom = node.meta.get("custom") or {}
    record = custom.get(META_KEY) or {}
    decision = record.get("decision") or {}
    if decision.get("dtype") in ("bf16", "fp16"):
        name = {torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, decision["dtype"])
        node.meta["custom"] = {
            **custom,
            META_KEY: {**record, "decision": {**decision, "dtype": name}},
        }


def _factor_in(mul: torch.fx.Node, read: torch.fx.Node, dtype: torch.dtype) -> bool:
    """``mul`` is ``read * other`` (either order) with ``other`` and the product in ``dtype``."""
    others = [_val(a) for a in mul.args if a is not read]
    return len(others) == 1 and all(v is not None and v.dtype == dtype for v in (_val(mul), others[0]))


def rotation_reads_promoted(gm: torch.fx.GraphModule) -> int:
    """Each rotary embedding ``x * cos + rotate_half(x) * sin`` whose products promote a narrower ``x`` rotates
    ``x`` cast once to the products' dtype (see the module docstring); returns how many."""
    graph = gm.graph
    rewritten = 0
    for add in list(graph.nodes):
        if not _call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
            continue
        out = _val(add)
        if out is None or not all(_call(m, aten.mul.Tensor) for m in add.args):
            continue
        for by_cos, by_sin in (add.args, add.args[::-1]):
            found = [(a, r) for a in by_sin.args if (r := _rotation(a)) is not None]
            if len(found) != 1:
                continue
            cat, (x, between) = found[0]
            xv = _val(x)
            if x not in by_cos.args or xv is None or not (xv.is_floating_point() and out.is_floating_point()):
                continue
            # a widening cast (exact: every value of the narrower dtype is one of the wider)
            if torch.finfo(xv.dtype).bits >= torch.finfo(out.dtype).bits:
                continue
            # each product promotes: its other factor and its result in the wider dtype (torch then computes
            # it on x converted exactly, which is what the rewrite hands it)
            if not (_factor_in(by_cos, x, out.dtype) and _factor_in(by_sin, cat, out.dtype)):
                continue
            # everything the rotation reads from x is read through the cast; x's other readers keep x
            if any(len(n.users) != 1 for n in (cat, *between)):
                continue
            # after x (after the last input where x is one: the inputs stay first)
            at = x if x.op != "placeholder" else list(graph.find_nodes(op="placeholder"))[-1]
            with graph.inserting_after(at):
                wide = graph.call_function(aten._to_copy.default, (x,), {"dtype": out.dtype})
            wide.meta["val"] = xv.to(out.dtype)
            for reader in (*between[1:], by_cos):  # the slices and the cos product read x
                reader.replace_input_with(x, wide)
            for n in (*between, cat):
                _retyped(n, out.dtype)
            rewritten += 1
            break
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


def fold_scalar_casts(model: Any) -> int:
    """Each Convert of a one-element Constant that only computations on data read, replaced by the constant it
    computes where the conversion is exact (see the module docstring); returns how many. A Convert read by a
    constant-only subgraph (a weight's decompression: scale, zero point) is left as OpenVINO marked it."""
    import openvino as ov

    floats = {ov.Type.f32: torch.float32, ov.Type.bf16: torch.bfloat16, ov.Type.f16: torch.float16}
    ops = list(model.get_ordered_ops())  # topological: an op's inputs come before it
    constant: set[str] = set()  # ops whose value depends on no input or state
    for op in ops:
        if op.get_type_name() == "Constant" or (
            op.get_input_size()
            and op.get_type_name() not in ("Parameter", "ReadValue")
            and all(i.get_source_output().get_node().get_name() in constant for i in op.inputs())
        ):
            constant.add(op.get_name())
    folded = 0
    for op in ops:
        if op.get_type_name() != "Convert" or op.input_value(0).get_node().get_type_name() != "Constant":
            continue
        target = floats.get(op.get_output_element_type(0))
        shape = op.get_output_partial_shape(0)
        if target is None or not shape.is_static or math.prod(shape.to_shape()) != 1:
            continue
        readers = [r.get_node() for r in op.output(0).get_target_inputs()]
        if not readers or any(r.get_name() in constant for r in readers):
            continue
        value = float(op.input_value(0).get_node().get_data().ravel()[0])
        if torch.tensor(value, dtype=torch.float64).to(target).item() != value:
            continue  # a rounding cast: OpenVINO's Convert does it as the program asked
        const = ov.op.Constant(op.get_output_element_type(0), shape.to_shape(), [value])
        const.set_friendly_name(op.get_friendly_name())
        for reader in list(op.output(0).get_target_inputs()):
            reader.replace_source_output(const.output(0))
        for reader in readers:  # marked as reading a decompression, which it no longer does
            if not any(_is_decompression(i.get_source_output().get_node()) for i in reader.inputs()):
                info = reader.get_rt_info()
                for key in [k for k in info if str(k).startswith("dequantization_node")]:
                    del info[key]
        folded += 1
    if folded:
        model.validate_nodes_and_infer_types()
    return folded


def _is_decompression(op: Any) -> bool:
    return op.get_type_name() == "Convert" and op.input_value(0).get_node().get_type_name() == "Constant"
