"""Graph vocabulary shared by every stage: what a precast cast is, no-op conversions, views, constants bytes,
output dtypes, a key for a graph's node names (``graph_key``).

Input: FX nodes / graphs / Programs. Output: facts about them; nothing here rewrites a graph.
"""

from __future__ import annotations

import hashlib

import torch
import torch.utils._pytree as pytree

from precast.dtypes import dtype_name
from precast.ir.program import Program

TO_COPY = torch.ops.aten._to_copy.default


CAST_META = "precast_cast"  # marks cast nodes precast inserted (value: target dtype)


def is_cast(node: torch.fx.Node) -> bool:
    """A pure dtype cast: ``_to_copy(x, dtype=d)`` or ``to.dtype(x, d)`` with nothing else changed."""
    if node.op != "call_function":
        return False
    if node.target is TO_COPY:
        return set(node.kwargs) <= {"dtype"} and len(node.args) == 1 and "dtype" in node.kwargs
    if node.target is torch.ops.aten.to.dtype:
        extra = node.args[2:] + tuple(node.kwargs.values())
        return not any(extra)  # non_blocking=False, copy=False, memory_format=None
    return False


def cast_dtype(node: torch.fx.Node) -> torch.dtype:
    return node.kwargs["dtype"] if node.target is TO_COPY else node.args[1]


# Ops through which a cast commutes exactly: they only select, move or repeat elements (first arg is the input).
VIEW_OPS = {
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.squeeze.default,
    torch.ops.aten.flatten.using_ints,
    torch.ops.aten.unflatten.int,
    torch.ops.aten.select.int,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.unbind.int,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.chunk.default,
    torch.ops.aten.movedim.int,
    torch.ops.aten.swapaxes.default,
    torch.ops.aten.numpy_T.default,
    torch.ops.aten.mT.default,
    torch.ops.aten.matrix_H.default,
}


def constant_bytes(program: Program) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            value = program.constant_value(node)
            if isinstance(value, torch.Tensor):
                key = dtype_name(value.dtype) or "?"
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


# Conversions export records for `.to(device=..., dtype=...)` / `.float()`: identities when they change neither
# dtype nor device (Llama's `inv_freq.to(x.device, torch.float)`); the cast commutes with them and the replay
# drops them (replayed on the low-precision constant they would cast it back).
NOOP_CONVERSIONS = {
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.device,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._to_copy.default,
}


def is_noop_conversion(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in NOOP_CONVERSIONS or not node.args:
        return False
    src, out = node.args[0], node.meta.get("val")
    src = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    return (
        isinstance(src, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and src.dtype == out.dtype
        and src.device == out.device
    )


def output_dtypes(graph: torch.fx.Graph) -> list[torch.dtype | None]:
    """The dtype of each output leaf of ``graph``, as it is now (call before the conversion changes it)."""
    out = graph.output_node()
    vals = []
    for a in pytree.tree_leaves(out.args[0]):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        vals.append(v.dtype if isinstance(v, torch.Tensor) else None)
    return vals


ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def tensor_args(args: tuple, kwargs: dict) -> list[tuple[ArgPath, torch.Tensor]]:
    """Every tensor argument (top level, or inside a list/tuple argument) with its path."""
    found = []
    for key, container in (("args", enumerate(args)), ("kwargs", kwargs.items())):
        for name, value in container:
            if isinstance(value, torch.Tensor):
                found.append(((key, name), value))
            elif isinstance(value, (list, tuple)):
                found.extend(((key, name, j), v) for j, v in enumerate(value) if isinstance(v, torch.Tensor))
    return found


def op_device_type(args: tuple, kwargs: dict) -> str | None:
    """The device type autocast dispatches on: that of the op's tensor arguments."""
    for _, value in tensor_args(args, kwargs):
        return value.device.type
    return None


# An argument position: ("args", 0), ("args", 1, 2) for the 3rd tensor of a list argument, ("kwargs", "weight")
ArgPath = tuple


def graph_key(graph: torch.fx.Graph) -> str:
    """A hash of the graph's nodes (op, name, target, arguments) and its inputs' dtypes and ranks: what node
    names mean in statistics measured on it. The same export of the same model gives the same key in any
    process; another model, or another export of it, another key."""
    h = hashlib.sha256()
    for n in graph.nodes:
        val = n.meta.get("val")
        typ = f"{val.dtype}/{val.dim()}" if n.op == "placeholder" and isinstance(val, torch.Tensor) else ""
        h.update(f"{n.op}|{n.name}|{n.target}|{n.args}|{n.kwargs}|{typ}\n".encode())
    return h.hexdigest()[:32]
