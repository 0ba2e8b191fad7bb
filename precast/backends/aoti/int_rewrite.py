"""The int8 / int8-asym / int4 rewrite of ``backends/aoti/int_weights.py`` applied, on ``precast.compile``'s private
copy: the kernel calls (int8-asym's with its rank-1 correction), the new constants the kernels read (int4's packed
weight and scales-and-zeros; int8-asym's shifted ``q`` and correction factor) and their recipes
(``backends/aoti/packed.py``'s format), and the stored parts ``CompiledModel.load_weights`` computes from an
original weight (``derive``: the weight formats' ``stored_value``).

Input: an ExportedProgram and its ``IntPlan``. Output: the rewritten program and the recipes of its new constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from precast.backends.aoti.int_weights import (
    CORR_SUFFIX,
    INT8S_SUFFIX,
    PACK_SUFFIX,
    SZ_SUFFIX,
    IntLinear,
    IntPlan,
    linear_args,
    value_of,
)
from precast.backends.aoti.package_cache import StoredConstant
from precast.backends.aoti.packed import recipe_sources, replay
from precast.errors import PrecastError
from precast.ir.fake import lacks_data
from precast.ir.program import Program
from precast.quant.forms import NIBBLES

aten = torch.ops.aten


# ---- recipes (packed.py's format) ------------------------------------------------------------------------------
def _op(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"op": f"aten::{name}", "args": list(args), "kwargs": kwargs}


def _dt(dtype: torch.dtype) -> dict[str, str]:
    return {"dtype": str(dtype).removeprefix("torch.")}


def int4pack_recipe(packed: str, n: int, k: int) -> dict[str, Any]:
    """``packed`` (uint8 [N, K/2], low nibble even k) in ``_convert_weight_to_int4pack_for_cpu``'s layout."""
    ref = {"ref": packed}  # unpacked as the weight formats' graph form does (``precast.quant.forms.NIBBLES``)
    nibbles = [_op(target.name().removeprefix("aten::"), ref, arg) for target, arg in NIBBLES]
    values = _op("reshape.default", _op("stack.default", nibbles, -1), [n, k])
    return _op(
        "_convert_weight_to_int4pack_for_cpu.default",
        _op("_to_copy.default", values, dtype=_dt(torch.int32)),
        1,
    )


def scales_zeros_recipe(scale: str, zero: str, n: int, groups: int, dtype: torch.dtype) -> dict[str, Any]:
    """[K/g, N, 2] in ``dtype``: the scale and torch's float zero ``(8 - zero) * scale`` (fp32, rounded once)."""
    s32 = _op("_to_copy.default", {"ref": scale}, dtype=_dt(torch.float32))
    z32 = _op("_to_copy.default", {"ref": zero}, dtype=_dt(torch.float32))
    zf = _op("_to_copy.default", _op("mul.Tensor", _op("rsub.Scalar", z32, 8), s32), dtype=_dt(dtype))
    both = _op(
        "stack.default",
        [_op("reshape.default", {"ref": scale}, [n, groups]), _op("reshape.default", zf, [n, groups])],
        -1,
    )
    return _op(
        "clone.default",
        _op("permute.default", both, [1, 0, 2]),
        memory_format={"memory_format": "contiguous_format"},
    )


def int8_shift_recipe(q: str) -> dict[str, Any]:
    """int8-asym's ``q`` (uint8 [N, K]) less 128, as int8 (the int8 kernel's weight): exact, through int16."""
    q16 = _op("_to_copy.default", {"ref": q}, dtype=_dt(torch.int16))
    return _op("_to_copy.default", _op("sub.Scalar", q16, 128), dtype=_dt(torch.int8))


def int8_correction_recipe(zero: str, scale: str, n: int) -> dict[str, Any]:
    """int8-asym's correction factor [N], fp32: ``(zero - 128) * scale`` (exact: an integer times a scale of at
    most 16 significant bits)."""
    z32 = _op("_to_copy.default", {"ref": zero}, dtype=_dt(torch.float32))
    s32 = _op("_to_copy.default", {"ref": scale}, dtype=_dt(torch.float32))
    return _op("reshape.default", _op("mul.Tensor", _op("sub.Scalar", z32, 128), s32), [n])


def inline_recipes(recipe: Any, derived: Mapping[str, Any]) -> Any:
    """``recipe`` with each reference to a constant of ``derived`` replaced by that constant's own recipe (the
    folded constants of a compile of the rewritten program, stated over the caller's program's constants)."""
    if isinstance(recipe, list):
        return [inline_recipes(r, derived) for r in recipe]
    if not isinstance(recipe, dict):
        return recipe
    if "ref" in recipe:
        return derived.get(recipe["ref"], recipe)
    if "op" in recipe:
        return {
            **recipe,
            "args": inline_recipes(recipe["args"], derived),
            "kwargs": {k: inline_recipes(v, derived) for k, v in recipe["kwargs"].items()},
        }
    return recipe


# ---- the rewrite (on a cache miss) --------------------------------------------------------------------------------
def apply_int_weights(ep: ExportedProgram, plan: IntPlan) -> tuple[ExportedProgram, dict[str, Any]]:
    """A rewritten copy of ``ep`` (the caller's program untouched) and the recipes of its new constants."""
    if not plan.rewrites:
        return ep, {}
    rw = _Rewrite.of(ep)
    rw.still_read = _read_elsewhere(rw, {r.linear for r in plan.rewrites})
    for r in plan.rewrites:
        _rewrite_linear(rw, r)
    rw.prog.graph.eliminate_dead_code()
    rw.prog.remove_unused_constants()
    return rw.prog.to_exported_program(), rw.recipes


@dataclass
class _Rewrite:
    """The rewrite under way: the private program, its nodes by name and constant placeholders by stored name,
    the fake mode new nodes' values are computed in, and the new constants made so far with their recipes."""

    prog: Program
    nodes: dict[str, Node]
    by_target: dict[str, Node]
    fake_mode: Any
    values: dict[str, torch.Tensor]  # the constants' values by stored name
    recipes: dict[str, Any] = field(default_factory=dict)  # new constant's stored name -> its recipe
    made: dict[str, Node] = field(default_factory=dict)  # like + suffix -> the new constant's placeholder
    still_read: set[str] = field(default_factory=set)  # constants read after the rewrite too (a tied table)

    @classmethod
    def of(cls, ep: ExportedProgram) -> _Rewrite:
        """A rewrite of a private copy of ``ep``."""
        from torch._guards import detect_fake_mode

        prog = Program(ep)
        return cls(
            prog,
            {n.name: n for n in prog.graph.nodes},
            {spec.target: node for node, spec in prog.input_spec.items()},
            detect_fake_mode([n.meta.get("val") for n in prog.graph.nodes if n.op == "placeholder"]),
            {**prog.state_dict, **{k: v for k, v in prog.constants.items() if isinstance(v, torch.Tensor)}},
        )

    def constant(self, like: str, suffix: str, recipe: dict[str, Any]) -> Node:
        """The new constant ``like + suffix`` computed by ``recipe`` (once), next to the constant ``like``."""
        if like + suffix in self.made:
            return self.made[like + suffix]
        sources = {n: _computable(self.values[n]) for n in recipe_sources(recipe)}
        value = replay(recipe, sources).contiguous()
        # ``like.int4pack`` names an attribute of a submodule ``like``: fine once ``like`` is gone, but a constant
        # still read (a tied table's int4 rows, which the embedding gathers) is a tensor at that path, which
        # unlifting the program refuses ("references nonexistent attribute"): ``like_int4pack`` then
        named = "_" + suffix.removeprefix(".") if like in self.still_read else suffix
        node = self.prog.add_constant_like(self.by_target[like], value, named)
        target = self.prog.input_spec[node].target
        with self.fake_mode:
            node.meta["val"] = replay(recipe, {n: self.by_target[n].meta["val"] for n in sources})
        self.recipes[target] = recipe
        self.made[like + suffix] = node
        return node

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Node:
        """A new call of ``op`` on ``args`` / ``kwargs``, its fake value computed."""
        node = self.prog.graph.call_function(op, args, kwargs)
        vals = torch.utils._pytree.tree_map(
            lambda a: a.meta["val"] if isinstance(a, Node) else a, (args, kwargs)
        )
        with self.fake_mode:
            node.meta["val"] = op(*vals[0], **vals[1])
        return node


def _read_elsewhere(rw: _Rewrite, linears: set[str]) -> set[str]:
    """The constants some node still reads once ``linears`` are rewritten: those with a use that does not lead
    only into those linears' weights (their dequantization, dead after the rewrite)."""
    weights = {linear_args(rw.nodes[name])[1] for name in linears}
    dying: set[Node] = set()
    for node in reversed(rw.prog.graph.nodes):
        if node in weights or (node.op == "call_function" and node.users and set(node.users) <= dying):
            dying.add(node)
    return {t for t, node in rw.by_target.items() if set(node.users) - dying}


def _rewrite_linear(rw: _Rewrite, r: IntLinear) -> None:
    """One linear replaced by its int8 / int8-asym / int4 kernel's call (on 2-d activations; bias added after), its
    meta kept."""
    linear = rw.nodes[r.linear]
    x, _, bias = linear_args(linear)
    xv = value_of(x)
    weight = value_of(rw.by_target[r.weight])
    n, k = (weight.shape[0], 2 * weight.shape[1]) if r.kind == "int4" else weight.shape
    made = _kernel_constants(rw, r, n, k)  # placeholders, next to the constants they are made from
    with rw.prog.graph.inserting_before(linear):
        x2d = x if xv.dim() == 2 else rw.call(aten.reshape.default, x, [-1, k])
        y = _kernel_call(rw, r, x2d, n, made)
        if bias is not None:
            y = rw.call(aten.add.Tensor, y, bias)
        if xv.dim() != 2:
            # sizes read from x, never the example's: a re-export makes the batch dynamic
            lead = [rw.call(aten.sym_size.int, x, i) for i in range(xv.dim() - 1)]
            y = rw.call(aten.reshape.default, y, [*lead, n])
    y.meta.update({k: v for k, v in linear.meta.items() if k not in ("val", "tensor_meta")})
    linear.replace_all_uses_with(y)
    rw.prog.graph.erase_node(linear)


def _kernel_constants(rw: _Rewrite, r: IntLinear, n: int, k: int) -> tuple[Node, ...]:
    """The new constants ``r``'s kernel call reads: int4's packed weight and scales-and-zeros, int8-asym's
    shifted ``q`` and correction factor; none for int8 (the kernel reads the stored ``q``)."""
    if r.kind == "int4":
        return (
            rw.constant(r.weight, PACK_SUFFIX, int4pack_recipe(r.weight, n, k)),
            rw.constant(r.scale, SZ_SUFFIX, scales_zeros_recipe(r.scale, r.zero, n, k // r.group, r.dtype)),
        )
    if r.kind == "int8-asym":
        return (
            rw.constant(r.weight, INT8S_SUFFIX, int8_shift_recipe(r.weight)),
            rw.constant(r.zero, CORR_SUFFIX, int8_correction_recipe(r.zero, r.scale, n)),
        )
    return ()


def _kernel_call(rw: _Rewrite, r: IntLinear, x2d: Node, n: int, made: tuple[Node, ...]) -> Node:
    """``x2d @ W.T`` [M, N] by ``r``'s kernel. int8-asym: ``W = (q8 - z8) * s``, so ``x2d @ W.T`` is the int8
    kernel on ``q8`` less ``sum(x2d, -1) * (z8 * s)`` (a rank-1 correction: one factor per row of W), computed in
    fp32 and rounded once to the activation's dtype (Inductor fuses it into one pointwise kernel)."""
    if r.kind == "int4":
        pack, sz = made
        return rw.call(aten._weight_int4pack_mm_for_cpu.default, x2d, pack, r.group, sz)
    scale = rw.call(aten.reshape.default, rw.by_target[r.scale], [n])
    q = made[0] if r.kind == "int8-asym" else rw.by_target[r.weight]
    y = rw.call(aten._weight_int8pack_mm.default, x2d, q, scale)
    if r.kind != "int8-asym":
        return y
    if r.dtype != torch.float32:
        y = rw.call(aten._to_copy.default, y, dtype=torch.float32)
        x2d = rw.call(aten._to_copy.default, x2d, dtype=torch.float32)
    total = rw.call(aten.sum.dim_IntList, x2d, [-1], True)
    y = rw.call(aten.sub.Tensor, y, rw.call(aten.mul.Tensor, total, made[1]))
    return y if r.dtype == torch.float32 else rw.call(aten._to_copy.default, y, dtype=r.dtype)


def _computable(value: torch.Tensor) -> torch.Tensor:
    """``value``, or an empty meta tensor of its shape and dtype where it holds no data (streamed weights)."""
    if lacks_data(value):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


# ---- load_weights: a stored part computed from its original ------------------------------------------------
def derived_copy(value: torch.Tensor, st: StoredConstant) -> torch.Tensor:
    """The stored constant ``st`` computed from its original ``value`` (quantized, the part it holds) by the
    conversion's own function, as a new contiguous tensor on the model's device."""
    from precast.weights.formats import stored_value  # the weight formats' one home (issue 41)

    out = stored_value(st.source, value.detach())
    if tuple(out.shape) != st.shape or out.dtype != st.source.dtype:
        raise PrecastError(
            f"load_weights: {st.source.stored} ({st.source.derive} of {st.source.original}) came out "
            f"{out.dtype} {list(out.shape)}, the compiled code reads {st.source.dtype} {list(st.shape)}"
        )
    on = out.to(device=st.device, memory_format=torch.contiguous_format)
    return on.clone() if on.data_ptr() == value.data_ptr() else on


def original_shape(stored: list[StoredConstant]) -> tuple[int, ...] | None:
    """The shape of the original the stored constants of one name came from: a cast's own; int8's and int8-asym's
    q [N, K] (tags ``int8-...`` and ``int8a-...``); int4's packed [N, K/2] -> [N, K]; None when no stored part
    states it."""
    derived = {getattr(st.source, "derive", None) or "": st for st in stored}
    if "" in derived:
        return derived[""].shape
    for derive, st in derived.items():
        if derive.endswith(".q"):
            return st.shape if derive.startswith("int8") else (*st.shape[:-1], 2 * st.shape[-1])
    return None
