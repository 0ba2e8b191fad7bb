"""Assertions shared by the tests."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def assert_bitwise(got, want) -> None:
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}"
            assert a.shape == b.shape
            assert torch.equal(a, b), (
                f"values differ: max abs {(a.double() - b.double()).abs().max().item():.3g}"
            )
        else:
            assert a == b


def constant_casts(ep: ExportedProgram) -> list[str]:
    """Casts whose input is a constant placeholder, directly or through view ops: work a backend would do on
    every forward."""
    from precast.ir.graph import VIEW_OPS

    consts = {s.arg.name for s in ep.graph_signature.input_specs if s.kind in CONSTANT_KINDS}
    casts = (
        torch.ops.aten._to_copy.default,
        torch.ops.aten.to.dtype,
        torch.ops.prims.convert_element_type.default,
    )

    def from_constant(node) -> bool:
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
            node = node.args[0]
        return isinstance(node, torch.fx.Node) and node.name in consts

    return [
        n.name
        for n in ep.graph.nodes
        if n.op == "call_function" and n.target in casts and from_constant(n.args[0])
    ]


def casts_per_producer(ep: ExportedProgram) -> dict:
    """(producer name, dtype) -> number of cast nodes."""
    counts: dict = {}
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default and "dtype" in n.kwargs:
            key = (n.args[0].name, n.kwargs["dtype"])
            counts[key] = counts.get(key, 0) + 1
    return counts


def openvino_native_bf16() -> bool:
    """What OpenVINO reports about this CPU: its default inference precision is bf16 (native bf16 arithmetic)."""
    import openvino as ov

    from precast.backends.openvino.precision import native_bf16

    return native_bf16(ov.Core())


def openvino_emulated_only(plan) -> bool:
    """Every layer OpenVINO ran off precast's plan is one the CPU's capabilities imply: under the f32 hint, on a
    CPU without native bf16 (plain AVX2), a bf16 layer computed in fp32 (OpenVINO has no bf16 kernels there).
    On a CPU with native bf16 nothing may be overridden."""
    if openvino_native_bf16():
        return plan.overridden == []
    return plan.hint == "f32" and all(
        set(x.planned) - {"fp32"} == {"bf16"} and x.runtime == ("fp32",) for x in plan.overridden
    )
