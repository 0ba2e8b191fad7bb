"""A native engine's run function behind the program's input signature and output structure: what ONNX Runtime
and ExecuTorch hand back from ``precast.compile(program, backend="onnx" | "executorch")`` and ``precast.load``.

Those runtimes take a flat list of tensors and return one; a bad input is a crash or a silent wrong answer in
native code. ``SignedModel`` checks every call against the program's ``ProgramSignature`` (dtype, rank, static and
dynamic sizes, token ids against the vocabulary) before the runtime sees it, and gives the outputs back in the
program's structure. It keeps the artifact's bytes (the ``.onnx`` or ``.pte`` file), so saving writes exactly
what was compiled and verified; the record saved beside it (``record()``) is what ``from_record`` needs to check
calls again without the program.

Input: a run function over flat tensors, a signature, an output spec, the artifact's bytes. Output: the outputs in
the program's structure; a JSON-ready record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from precast.errors import PrecastError
from precast.runtime.records import record_mismatch
from precast.runtime.signature import ProgramSignature

RECORD_VERSION = 1


class SignedModel:
    """Call it like the program's module: inputs checked against ``signature`` (one PrecastError line), the
    tensors handed to ``run`` flat, its outputs unflattened into the program's output structure."""

    def __init__(
        self,
        run: Callable[[list[torch.Tensor]], list[Any]],
        signature: ProgramSignature,
        out_spec: Any,
        data: bytes,
        *,
        engine: str,
        facts: dict[str, Any] | None = None,
    ):
        self._run = run
        self.signature = signature
        self._out_spec = out_spec
        self.data = data  # the artifact as compiled (and verified): what saving writes
        self.engine = engine
        self.facts = dict(facts or {})  # what the engine reported of the artifact (JSON-ready values)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.signature.check(args, kwargs)
        outs = self._run([t for t in flat if isinstance(t, torch.Tensor)])
        return pytree.tree_unflatten(list(outs), self._out_spec) if self._out_spec is not None else outs

    def __repr__(self) -> str:
        return f"SignedModel({self.engine}, {len(self.data) / 2**20:.2f} MB)"

    def record(self) -> dict[str, Any]:
        """What ``from_record`` needs besides the artifact: the signature and the output structure."""
        return {
            "version": RECORD_VERSION,
            "signature": self.signature.to_dict(),
            "out_spec": pytree.treespec_dumps(self._out_spec) if self._out_spec is not None else None,
        }


def program_record(ep: ExportedProgram) -> dict[str, Any]:
    """The record of a program's call contract (``SignedModel.record``'s form), read from the program."""
    return {
        "version": RECORD_VERSION,
        "signature": ProgramSignature.from_program(ep).to_dict(),
        "out_spec": pytree.treespec_dumps(ep.call_spec.out_spec),
    }


def from_record(
    run: Callable[[list[torch.Tensor]], list[Any]],
    record: dict[str, Any],
    data: bytes,
    *,
    engine: str,
    where: str,
    facts: dict[str, Any] | None = None,
) -> SignedModel:
    """A ``SignedModel`` from a record ``record()`` or ``program_record`` wrote; one line naming ``where`` for a
    record of another version or a malformed one."""
    if record_mismatch(record, RECORD_VERSION, ("signature",)):
        raise PrecastError(
            f"{where}: its record is from another precast version or malformed; compile and save it again"
        )
    out_spec = record.get("out_spec")
    try:
        spec = pytree.treespec_loads(out_spec) if out_spec is not None else None
    except (TypeError, ValueError, KeyError) as exc:
        raise PrecastError(
            f"{where}: its record's output structure is malformed ({exc}); save it again"
        ) from exc
    signature = ProgramSignature.from_dict(record["signature"])
    return SignedModel(run, signature, spec, data, engine=engine, facts=facts)


def save_signed(model: SignedModel, path: Any) -> dict[str, Any]:
    """Write ``model``'s artifact to ``path`` whole or not at all; returns its record (``record()`` and the
    engine's facts) for the caller to keep beside it."""
    from precast.io import write_bytes

    write_bytes(path, model.data)
    return {**model.record(), "facts": model.facts}
