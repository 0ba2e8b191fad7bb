"""A compiled AOTInductor model saved as one self-contained package (its weights inside the ``.so``), and loaded
again without the program: ``precast.save(model, "m.pt2")`` / ``precast.load("m.pt2")`` (the engine registry,
``backends/registry.py``), and ``precast compile IN.pt2 -o m.pt2``.

``precast.compile`` keeps a program's weights outside its cached package (the model reads the program's own
tensors: ``weights/sources.py``), which cannot be saved alone; ``saving_options`` asks the compile for the
weights inside (Inductor's ``aot_inductor.package_constants_in_so``). ``save`` writes that package whole (a
``torch._inductor.aoti_load_package`` file, loadable without precast) and returns the record ``load`` needs: the
signature every call is checked against, the thread count it was compiled for, and the torch and CPU ISA it was
built with (Inductor compiles with ``-march=native``: a package runs only where both match).

Input: a ``CompiledModel`` and a path; a path and a record. Output: the package and its record; a
``CompiledModel``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from precast.backends.aoti.build import IN_SO
from precast.backends.aoti.load import load_package
from precast.backends.aoti.model import CompiledModel
from precast.backends.aoti.package_cache import toolchain
from precast.errors import PrecastError
from precast.runtime.signature import ProgramSignature
from precast.threads import TORCH_LOCK

RECORD_VERSION = 1
_BUILT_WITH = ("torch", "isa")  # what a self-contained package needs of the machine that loads it


def saving_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of ``precast.compile`` for a model ``save`` can write: the weights compiled into the package."""
    configs = dict(options.get("inductor_configs") or {})
    configs[IN_SO] = True
    return {**options, "inductor_configs": configs}


def save(model: CompiledModel, path: str | os.PathLike) -> dict[str, Any]:
    """Write ``model``'s package to ``path`` whole; its record. One line for a model whose weights live outside
    its package, or that writes state (a KV cache: an LLM folder, ``precast export-llm``, holds those)."""
    from precast.io import write_bytes

    if not model.self_contained:
        raise PrecastError(
            f"precast.save: this AOTInductor model reads its weights outside its package; compile it with "
            f"precast.compile(program, saving=True) to write {path}"
        )
    if model.stateful:
        raise PrecastError(
            f"precast.save: the model writes state (a KV cache) that a saved package cannot reset; write an LLM "
            f"folder with precast export-llm instead of {path}"
        )
    write_bytes(path, model.package_path.read_bytes())
    tools = toolchain()
    return {
        "version": RECORD_VERSION,
        "signature": model.signature.to_dict(),
        "threads": model.threads,
        "form": model.form.get("name", "default"),
        "built_with": {k: tools[k] for k in _BUILT_WITH},
        "facts": {"summary": describe(model)},
    }


def load(path: str | os.PathLike, record: dict[str, Any], *, threads: int | None = None) -> CompiledModel:
    """The package ``save`` wrote, loaded to run at the thread count it was compiled for; one line where the
    record is of another version, ``threads`` differs, or this machine's torch or CPU ISA is not the one it was
    built with."""
    started = time.perf_counter()
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION or "signature" not in record:
        raise PrecastError(f"{path}: its record is from another precast version or malformed; save it again")
    built, here = record.get("built_with") or {}, toolchain()
    differ = [k for k in _BUILT_WITH if built.get(k) != here[k]]
    if differ:
        raise PrecastError(
            f"{path}: built with another {' and '.join(differ)} ({', '.join(str(built.get(k)) for k in differ)}); "
            "compile the program again here"
        )
    if threads is not None and threads != record["threads"]:
        raise PrecastError(
            f"{path}: compiled for {record['threads']} thread(s), not {threads}; load it with "
            f"threads={record['threads']} or compile the program again for {threads}"
        )
    with TORCH_LOCK:
        runner = load_package(Path(path))
    return CompiledModel(
        runner,
        Path(path),
        "",
        {},
        ProgramSignature.from_dict(record["signature"]),
        from_cache=False,
        compile_seconds=0.0,
        load_seconds=time.perf_counter() - started,
        form={"name": str(record.get("form", "default")), "why": "as saved"},
        threads=int(record["threads"]),
    )


def describe(model: CompiledModel) -> str:
    """How ``model`` came to be, in words: from the cache or compiled (how long), its form and thread count."""
    how = "loaded from cache" if model.from_cache else f"compiled in {model.compile_seconds:.1f}s"
    return how + f", form {model.form.get('name', 'default')}, {model.threads} thread(s)"
