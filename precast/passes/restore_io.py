"""Restore output dtypes: outputs whose dtype the conversion changed get a cast back to the dtype the input
program returned (``keep_io_types=True``, any policy); outputs that update a buffer or parameter always do, so
the state a program writes keeps its dtype. Inputs never change dtype: casts are inserted after them.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind

from precast.ir.graph import CAST_META, TO_COPY, cast_dtype, is_cast
from precast.ir.mutation import analyze
from precast.ir.program import Program


def restore_output_dtypes(program: Program, original: list[torch.dtype | None], keep_io: bool) -> int:
    """Cast outputs back to ``original`` dtypes (user outputs only when ``keep_io``). An existing cast of the
    same producer to the same dtype is reused. Returns the number of outputs restored."""
    graph = program.graph
    out = graph.output_node()
    leaves, spec = pytree.tree_flatten(out.args[0])
    kinds = [s.kind for s in program.output_specs]
    restored = 0
    alias = analyze(graph, program.input_spec, program.output_specs)
    for i, (a, want) in enumerate(zip(leaves, original, strict=True)):
        if not isinstance(a, torch.fx.Node) or want is None:
            continue
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype == want:
            continue
        if not keep_io and i < len(kinds) and kinds[i] == OutputKind.USER_OUTPUT:
            continue
        existing = None
        if not alias.written(a):  # a cast made before a later write would hold a stale value
            existing = next((u for u in a.users if is_cast(u) and cast_dtype(u) == want), None)
        if existing is None:
            with graph.inserting_before(out):
                existing = graph.call_function(TO_COPY, (a,), {"dtype": want})
            for k in ("stack_trace", "nn_module_stack"):
                if k in a.meta:
                    existing.meta[k] = a.meta[k]
            existing.meta["val"] = val.to(want)
            existing.meta[CAST_META] = want
        leaves[i] = existing
        restored += 1
    if restored:
        out.args = (pytree.tree_unflatten(leaves, spec),)
    return restored
