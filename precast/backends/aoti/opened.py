"""An AOTInductor cache entry opened without its program: what ``precast.load`` of an LLM folder runs
(``llm/folder_engines``), where reading the program back (``torch.export.load`` of a decoder's graph) would take
longer than the whole load should.

``entry_record`` (at export, beside ``precast.compile``): what opening needs besides the entry and the weights:
the key, the toolchain the key was computed under (``package_cache.toolchain``: torch, precast, the C++ compiler,
the CPU's ISA, inductor's config), the thread count, the constants the code writes (a KV cache) and the stored
constants' sources (for ``load_weights``). ``open_entry``: the entry checked (its manifest's hashes, as every
cache load is), the toolchain compared with this machine's, and the package loaded with the given weights, as
``load.load_model`` does for a compile. Anything that differs is a reason, in words; the caller compiles from the
program instead.

Input: a compiled model and its program; a cache root, a record, the weights by stored name. Output: a record; a
``CompiledModel`` or the reason it cannot be opened here.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from precast.backends.aoti.load import load_package, loader_constants
from precast.backends.aoti.model import CompiledModel, initial_state
from precast.backends.aoti.package_cache import (
    PACKAGE,
    StoredConstant,
    read_entry,
    stored_constants,
    toolchain,
)
from precast.dtypes import dtype_of_name, long_name
from precast.ir.program import ConstantSource, written_targets
from precast.runtime.records import record_mismatch
from precast.runtime.signature import ProgramSignature
from precast.threads import TORCH_LOCK

RECORD_VERSION = 1


def entry_record(model: CompiledModel, program: Any, tools: dict[str, str]) -> dict[str, Any]:
    """What ``open_entry`` needs of ``model`` (compiled from ``program`` under ``tools``: ``toolchain()`` read
    before the compile, as its key was)."""
    stored = {
        name: {
            "source": {
                **dataclasses.asdict(s.source),
                "original_dtype": long_name(s.source.original_dtype),
                "dtype": long_name(s.source.dtype),
            },
            "shape": list(s.shape),
            "device": s.device,
            "read": s.read,
            "persistent": s.persistent,
        }
        for name, s in stored_constants(program).items()
    }
    return {
        "version": RECORD_VERSION,
        "key": model.key,
        "toolchain": tools,
        "threads": model.threads,
        "form": model.form.get("name", "default"),
        "written": sorted(written_targets(program)),
        "stored": stored,
    }


def open_entry(
    root: Path, record: dict[str, Any], constants: dict[str, torch.Tensor], threads: int
) -> CompiledModel | str:
    """The entry ``record`` names under the cache root ``root``, loaded with ``constants`` (the program's tensors
    by stored name) to run at ``threads``; or why it cannot be here."""
    started = time.perf_counter()
    why = mismatch(record, threads)
    if why:
        return why
    entry = root / "aoti" / str(record["key"])
    manifest, broken = read_entry(entry, str(record["key"]))
    if manifest is None:
        return f"its package is not intact ({broken})"
    layout, packed = manifest["weights"], manifest.get("packed") or {}
    facts = SimpleNamespace(constants=constants, written=frozenset(record["written"]))
    loaded = None
    if layout["external"]:
        loaded = loader_constants(facts, None, layout, packed.get("plans", {}), packed.get("folded", {}))  # type: ignore[arg-type]
    with TORCH_LOCK:
        runner = load_package(entry / PACKAGE)
    return CompiledModel(
        runner,
        entry / PACKAGE,
        str(record["key"]),
        _stored(record["stored"]),
        ProgramSignature.from_dict(manifest["signature"]),
        from_cache=True,
        compile_seconds=0.0,
        load_seconds=time.perf_counter() - started,
        packed=packed,
        constants=loaded,
        unread=tuple(layout["unread"]),
        state=initial_state({n: constants[n] for n in sorted(facts.written) if n in constants}),
        form=manifest.get("form", {"name": record.get("form", "default"), "why": "as exported"}),
        threads=threads,
    )


def mismatch(record: dict[str, Any], threads: int) -> str:
    """Why an entry built under ``record`` cannot serve this machine at ``threads`` ("" when it can)."""
    stale = record_mismatch(record, RECORD_VERSION, ("key", "toolchain", "threads", "written", "stored"))
    if stale:
        return stale
    if record["threads"] != threads:
        return f"its package was compiled for {record['threads']} thread(s), not {threads}"
    made, here = record["toolchain"], toolchain()
    differ = [k for k in sorted(set(made) | set(here)) if made.get(k) != here.get(k)]
    if differ:
        names = {
            "isa": "CPU",
            "compiler": "C++ compiler",
            "inductor_config": "Inductor's config",
            "env": "environment",
        }
        return "its package was built for another " + ", ".join(names.get(k, k) for k in differ)
    return ""


def _stored(data: dict[str, Any]) -> dict[str, StoredConstant]:
    out = {}
    for name, d in data.items():
        src = dict(d["source"])
        for key in ("original_dtype", "dtype"):
            src[key] = dtype_of_name(src[key], "the folder's AOTInductor record")
        out[name] = StoredConstant(
            ConstantSource(**src), tuple(d["shape"]), d["device"], read=d["read"], persistent=d["persistent"]
        )
    return out
