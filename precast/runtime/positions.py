"""Cache positions: which input of a program indexes a cache it writes, the cache's length, and the check that a
call's positions fall inside it (``ProgramSignature`` runs it on every call of a compiled engine).

transformers' recipe writes its static KV cache with ``index_copy_(2, cache_position[0] + arange(seq), ...)``;
a position past the cache's end makes the compiled kernel abort ("index out of bounds: 0 <= tmp10 < 512") or
write outside the buffer. The length is read from the graph (the written buffer's size along the indexed
dimension), never from names.

Input: an ExportedProgram (``cache_positions``); a call's position tensor (``check_positions``). Output: input name
-> cache length; nothing, or a one-line PrecastError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError
from precast.ir.mutation import aliased_input

_INDEX_WRITES = {
    # op -> (argument holding the destination, how to find the indexed dimension and its index tensor)
    "aten::index_copy_": "dim",
    "aten::index_copy": "dim",
    "aten::index_put_": "list",
    "aten::index_put": "list",
}
_METADATA_READS = ("aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::size")


def cache_positions(ep: ExportedProgram) -> dict[str, int]:
    """User input name -> the length of the cache it indexes: for each write of the program into a buffer it
    writes (``index_copy_`` / ``index_put_``, as transformers' ``StaticLayer.update`` writes its KV cache) whose
    index is computed from exactly one integer user input (``cache_position``), the destination's size along the
    indexed dimension; the smallest over every such write. Read from the graph, never from names. Empty when the
    program writes no cache this way."""
    from precast.ir.program import written_targets

    written = written_targets(ep)
    buffers = {
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) and s.target in written
    }
    users = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    found: dict[str, int] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        how = _INDEX_WRITES.get(getattr(schema, "name", ""))
        if how is None or len(node.args) < 3:
            continue
        dest = _storage_root(node.args[0])
        val = dest.meta.get("val") if isinstance(dest, torch.fx.Node) else None
        if dest is None or dest.name not in buffers or not isinstance(val, torch.Tensor):
            continue
        if how == "dim":
            pairs = [(node.args[1], node.args[2])]
        else:
            pairs = [(d, i) for d, i in enumerate(node.args[1]) if isinstance(i, torch.fx.Node)]
        for dim, index in pairs:
            if not isinstance(dim, int) or not isinstance(index, torch.fx.Node):
                continue
            sources = value_sources(index) & users
            if len(sources) != 1:
                continue
            size = val.shape[dim]
            if not isinstance(size, int):
                continue  # a cache of symbolic length: nothing fixed to check against
            name = sources.pop()
            found[name] = min(found.get(name, size), size)
    return found


def _storage_root(node: Any) -> Any:
    """Follow views and in-place ops back to the value that owns the storage (``ir.mutation``'s storage root:
    each step its ``aliased_input``)."""
    while isinstance(node, torch.fx.Node):
        source = aliased_input(node)
        if source is None:
            break
        node = source
    return node


def value_sources(node: torch.fx.Node) -> set[str]:
    """Placeholders whose values flow into ``node`` (a size read, ``sym_size``, is metadata, not a value)."""
    seen: set[torch.fx.Node] = set()
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            out.add(n.name)
            continue
        if (
            n.op == "call_function"
            and getattr(getattr(n.target, "_schema", None), "name", "") in _METADATA_READS
        ):
            continue
        stack.extend(n.all_input_nodes)
    return out


def check_positions(t: Any, length: int, name: str, where: str) -> None:
    """Cache positions inside the cache: every value in [0, L), and the run the cache's writer fills from the
    first position (transformers writes ``cache_position[0] + arange(seq)``) ending before L. Past it, the
    compiled kernel would abort ("index out of bounds") or write outside the buffer."""
    if t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex:
        return
    if t.numel() <= 256:  # a decode step or a prompt: one conversion to Python, no tensor ops
        values = t.reshape(-1).tolist()
        low, high, first = min(values), max(values), values[0]
    else:
        low, high = (int(v) for v in torch.aminmax(t.detach().reshape(-1)))
        first = int(t.reshape(-1)[0])
    end = first + t.numel() - 1
    if low < 0 or max(high, end) >= length:
        shown = f"positions {low}..{max(high, end)}" if t.numel() > 1 else f"position {low}"
        raise PrecastError(
            f"compiled program: input {name!r} ({where}): cache {shown} outside the "
            f"cache, which holds {length} positions (0..{length - 1}); start a new sequence (reset()) or "
            "export the program with a longer cache (max_cache_len)"
        )
