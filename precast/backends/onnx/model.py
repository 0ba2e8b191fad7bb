"""ONNX as a ``precast.compile`` target: the program exported to ONNX (``export.py``) and opened in an ONNX Runtime
CPU session (``runtime.py``), called like the program's module with its inputs checked first
(``runtime/signed.py``); saved as the ``.onnx`` file, loaded again without the program.

    model = precast.compile(res.program, backend="onnx")     # a SignedModel over an ONNX Runtime session
    precast.save(model, "m.onnx"); again = precast.load("m.onnx")

Input: an ExportedProgram (or ConvertResult), options; a saved ``.onnx`` and its record. Output: a ``SignedModel``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from precast.backends.onnx.export import dynamic_if_possible, export_onnx, require_modules
from precast.backends.onnx.runtime import ort_session, run_onnx
from precast.runtime.exported import exported_program, refuse_written_state
from precast.runtime.signed import SignedModel, from_record, program_record, save_signed

WHERE = "precast.compile(backend='onnx')"


def compile_onnx(
    program: Any,
    *,
    dynamic: bool = True,
    threads: int | None = None,
    opset: int | None = None,
    optimize: bool = True,
) -> SignedModel:
    """``program`` exported to ONNX (``export_onnx``: ``dynamic`` makes dim 0 dynamic where the graph allows,
    ``opset``, ``optimize``) and opened in ONNX Runtime's CPU provider at ``threads`` intra-op threads (default:
    ONNX Runtime's). A program writing state (a KV cache) is refused: a session does not carry it."""
    require_modules("onnx", "onnxscript", "onnxruntime")
    ep = exported_program(program, WHERE)
    refuse_written_state(ep, "an ONNX Runtime session", WHERE)
    if dynamic:
        ep = dynamic_if_possible(
            ep
        )  # the signature below is the exported file's: dynamic batch where it could be
    with tempfile.TemporaryDirectory(prefix="precast-onnx-") as folder:
        path = Path(folder) / "model.onnx"
        info = export_onnx(ep, path, dynamic_batch=dynamic, opset=opset, optimize=optimize)
        session = ort_session(path, threads=threads)
        data = path.read_bytes()
    low = {k: v for k, v in info.initializers.items() if k in ("float16", "bfloat16")}
    batch = "dynamic batch" if info.dynamic_batch else "static shapes"
    summary = (
        f"{info.size_bytes / 2**20:.2f} MB, opset {info.opset}, {batch}, low-precision initializers {low}"
    )
    record = program_record(ep)
    return from_record(
        lambda tensors: run_onnx(session, tensors),
        record,
        data,
        engine="onnx",
        where=WHERE,
        facts={"summary": summary, "opset": info.opset, "dynamic_batch": info.dynamic_batch},
    )


def save_onnx(model: SignedModel, path: str | os.PathLike) -> dict[str, Any]:
    """The ``.onnx`` file as compiled, written whole; its record (signature, output structure, facts)."""
    return save_signed(model, path)


def load_onnx(path: str | os.PathLike, record: dict[str, Any], *, threads: int | None = None) -> SignedModel:
    """A saved ``.onnx`` opened in ONNX Runtime's CPU provider, its calls checked against the record's signature."""
    require_modules("onnx", "onnxruntime")
    session = ort_session(path, threads=threads)
    data = Path(path).read_bytes()
    return from_record(
        lambda tensors: run_onnx(session, tensors),
        record,
        data,
        engine="onnx",
        where=str(path),
        facts=dict(record.get("facts") or {}),
    )
