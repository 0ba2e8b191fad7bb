"""The program a backend is handed, made ready for an engine (engine-independent): the ExportedProgram behind a
ConvertResult (``exported_program``), dim 0 made dynamic (``dynamic_batch``; ``batch_symbols`` reads it), zeros
for the example inputs a program saved without them lacks (``with_example_inputs``), and the refusal for an engine
that carries no state between calls (``refuse_written_state``).

Input: an ExportedProgram (or what a caller passed for one). Output: an ExportedProgram (itself or a re-export /
copy; the caller's is never changed), or a one-line PrecastError.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError, first_line


def exported_program(program: Any, caller: str) -> ExportedProgram:
    """The ExportedProgram a backend is handed: ``program`` itself or a ConvertResult's ``.program``; anything else
    is one PrecastError line naming ``caller`` (e.g. "precast.compile")."""
    ep = getattr(program, "program", program)  # a ConvertResult
    if not isinstance(ep, ExportedProgram):
        raise PrecastError(
            f"{caller}: got {type(program).__name__}; pass an ExportedProgram "
            "(torch.export.export(...) or precast.convert(...).program)"
        )
    return ep


def dynamic_batch(ep: ExportedProgram) -> ExportedProgram:
    """Re-export ``ep`` with dim 0 of every tensor input dynamic (min 1), as the dynamo harness does.

    A batch of 1 in the example would be specialized (0/1 specialization), so it is traced at batch 2. Falls
    back to ``Dim.AUTO`` (dynamic where the program allows) and then to the program as it is.
    """
    from torch.export import Dim

    args, kwargs = ep.example_inputs or ((), {})
    if kwargs or not args:
        return ep
    batched = [isinstance(a, torch.Tensor) and a.dim() > 0 for a in args]
    if not any(batched):
        return ep
    sizes = {a.shape[0] for a, b in zip(args, batched, strict=True) if b}
    trace_args = tuple(
        torch.cat([a, a]) if b and a.shape[0] == 1 else a for a, b in zip(args, batched, strict=True)
    )
    module = ep.module(check_guards=False)  # the static program's guards pin the batch size
    attempts: list[tuple] = []
    if len(sizes) == 1:
        batch = Dim("batch", min=1)
        attempts.append(tuple({0: batch} if b else None for b in batched))
    attempts.append(tuple({0: Dim.AUTO} if b else None for b in batched))
    reasons = []
    for shapes in attempts:
        try:
            out = torch.export.export(module, trace_args, dynamic_shapes=shapes, strict=False)
        except Exception as exc:  # noqa: BLE001 - a model with a fixed batch: try the next, then keep it static
            reasons.append(first_line(exc))
            continue
        if batch_symbols(out):
            return out
        # Dim.AUTO "succeeds" on a graph that fixes the batch, with dim 0 pinned to the traced size (2 for an
        # example batch of 1): that program would run only at the traced size, so keep the original instead
        reasons.append("Dim.AUTO left dim 0 static (the program fixes the batch size)")
    warnings.warn(
        f"precast.compile: the batch dimension stays static ({'; '.join(reasons)}); the package runs only at "
        "the example batch size (pass dynamic=False to silence this)",
        stacklevel=3,
    )
    return ep


def batch_symbols(ep: ExportedProgram) -> set[str]:
    """Names of the symbols dim 0 of the program's tensor user inputs has (empty: a static batch)."""
    user = set(ep.graph_signature.user_inputs)
    out = set()
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in user and isinstance(val, torch.Tensor) and val.dim():
            dim = val.shape[0]
            # a SymInt export specialized (Dim.AUTO on a graph that fixes the size) prints as a number
            if isinstance(dim, torch.SymInt) and dim.node.expr.free_symbols:
                out.add(str(dim))
    return out


def refuse_written_state(ep: ExportedProgram, engine: str, what: str) -> None:
    """One line where ``ep`` writes state (a KV cache, a running statistic) that ``engine`` would not carry from
    one call to the next: each call there would start again from the values the program was exported with
    (measured with OpenVINO on a Llama decoder: prefill right, the next decode step's logits at cosine 0.07)."""
    from precast.ir.program import written_targets

    written = sorted(written_targets(ep))
    if written:
        shown = ", ".join(written[:4]) + (" ..." if len(written) > 4 else "")
        raise PrecastError(
            f"{what}: the program writes {len(written)} buffer(s) from call to call ({shown}: a KV cache or a "
            f"running statistic), which {engine} does not carry between calls, so every call after the first "
            "would be wrong; serve it with precast.compile (AOTInductor) or ExecuTorch, which keep them"
        )


def with_example_inputs(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` itself when it has example inputs; else a copy whose example inputs are zeros of each input's
    shape (a dynamic size at the hint export recorded), dtype and device. AOTInductor needs example inputs to
    compile; a program exported without weights (fake inputs, dropped) or saved without them has none."""
    from torch.utils import _pytree as pytree

    if ep.example_inputs is not None:
        return ep
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    flat = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = placeholders[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise PrecastError(
                f"precast.compile: the program has no example inputs and its input {spec.arg.name!r} is not a "
                "tensor; export it with example inputs (torch.export keeps them)"
            )
        sizes = [s if isinstance(s, int) else s.node.hint for s in val.shape]
        if any(s is None for s in sizes):
            raise PrecastError(
                f"precast.compile: the program has no example inputs and input {spec.arg.name!r} has a size "
                "with no recorded value; export it with example inputs"
            )
        flat.append(torch.zeros(sizes, dtype=val.dtype, device=val.device))
    out = copy.copy(ep)
    out._example_inputs = pytree.tree_unflatten(flat, ep.call_spec.in_spec)
    return out
