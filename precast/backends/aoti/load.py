"""Loading a published AOTInductor cache entry for ``precast.compile`` (``backends/aoti/compiler.py``; ``build.py``
builds and publishes it).

- ``loader_constants``: the tensors the loader reads (the program's own, or those of ``weights=`` shards), plus
  the packed copies and folded constants recomputed from them.
- ``load_package``: load a package, its failure one line.
- ``load_model``: the entry's package loaded with those constants, as a ``CompiledModel``.

Input: the program's facts, the compile's job and the entry's manifest. Output: a loaded ``CompiledModel``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from precast.backends.aoti.facts import CompileJob, ProgramFacts
from precast.backends.aoti.model import CompiledModel, initial_state
from precast.backends.aoti.package_cache import PACKAGE
from precast.backends.aoti.packed import gemm_pack, recipe_sources, replay
from precast.errors import PrecastError, first_line
from precast.ir.fake import lacks_data
from precast.runtime.signature import ProgramSignature
from precast.threads import TORCH_LOCK
from precast.weights.sources import SafetensorsSource, check_stored


def load_model(
    facts: ProgramFacts,
    job: CompileJob,
    manifest: dict[str, Any],
    weights: str | os.PathLike | None,
    compile_seconds: float,
    started: float,
) -> CompiledModel:
    """The entry's package loaded with the constants its code reads (the program's own, or those of ``weights=``
    for streamed weights), as a model starting from the program's state. ``compile_seconds``: 0.0 when the entry
    was published before (by an earlier run or a process we waited for); ``started``: when the compile began."""
    layout = manifest["weights"]
    constants = None
    if layout["external"]:
        source = SafetensorsSource(weights, "precast.compile(weights=...)") if facts.fake else None
        packed = manifest["packed"]
        constants = loader_constants(facts, source, layout, packed["plans"], packed.get("folded", {}))
    with TORCH_LOCK:
        runner = load_package(job.entry / PACKAGE)
    return CompiledModel(
        runner,
        job.entry / PACKAGE,
        job.key,
        facts.stored,
        ProgramSignature.from_dict(manifest["signature"]),
        from_cache=compile_seconds == 0.0,
        compile_seconds=compile_seconds,
        load_seconds=time.perf_counter() - started - compile_seconds,
        packed=manifest.get("packed"),
        constants=constants,
        unread=tuple(layout["unread"]),
        state=initial_state(_written_values(facts)),
        form=job.form.to_dict(),  # the choice as measured now (a provisional one may have been timed again)
        threads=job.threads,
    )


def _written_values(facts: ProgramFacts) -> dict[str, torch.Tensor]:
    """The program's values of the constants its code writes (a KV cache): the state each model starts from."""
    program = facts.constants
    return {n: program[n] for n in sorted(facts.written) if n in program and not lacks_data(program[n])}


def loader_constants(
    facts: ProgramFacts,
    source: SafetensorsSource | None,
    layout: dict[str, Any],
    plans: dict[str, Any],
    folded: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """The tensors the loader will read: the program's own (a buffer the code writes is copied: the caller's
    program stays as it was), or those of ``source``; plus the packed copies, packed from them, and the
    constants freezing folded, recomputed from them."""
    program = facts.constants
    unread = set(layout["unread"])
    every = set(layout["every"])
    folded = {n: r for n, r in folded.items() if n in every and n not in unread}
    needed = {n for n in layout["every"] if n not in unread and n not in plans and n not in folded}
    wanted = needed | {p["source"] for n, p in plans.items() if n not in unread}
    wanted |= set().union(*(recipe_sources(r) for r in folded.values())) if folded else set()
    # the files hold what the program has no values for (streamed weights); a buffer made at construction
    # (a rotary table) or a KV cache stays the program's own
    from_files = {n for n in wanted if lacks_data(program[n])} if source is not None else set()
    written = facts.written
    values = {n: program[n].clone() if n in written else program[n] for n in wanted - from_files}
    if source is not None:
        check_stored(source, program, from_files, "precast.compile(weights=...)")
        values.update(source.read_many(from_files))
    out = {n: values[n] for n in needed}
    for name, plan in plans.items():
        if name not in unread:
            kw = {k: plan[k] for k in ("transposed", "block_n", "vnni")}
            out[name] = gemm_pack(values[plan["source"]], **kw)
    for name, recipe in folded.items():
        out[name] = replay(recipe, values)
    return out


def load_package(package: Path) -> Any:
    import torch._inductor

    try:
        return torch._inductor.aoti_load_package(str(package))
    except Exception as exc:
        raise PrecastError(
            f"precast.compile: cannot load {package}: {first_line(exc)[:300]}; delete the cache entry"
        ) from exc
