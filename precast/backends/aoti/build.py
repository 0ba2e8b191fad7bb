"""Building and publishing an AOTInductor cache entry for ``precast.compile`` (``backends/aoti/compiler.py``;
``load.py`` loads it).

- ``entry_manifest``: the entry's manifest, read if it is published and intact, else built.
- ``build_locked``: compile the program (the int weights' rewrite applied, placeholders for streamed weights) into
  a temporary folder under the key's file lock, write its manifest (sha256 of the package, the compiled program's
  signature, the packed and folded plans, the constants' layout) and rename it into place: an entry appears
  whole or not at all.

Input: the program's facts and the compile's job (``facts.py``). Output: the entry's manifest and the seconds
spent compiling.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.aoti.attention import apply_attention
from precast.backends.aoti.facts import CompileJob, ProgramFacts
from precast.backends.aoti.int_rewrite import apply_int_weights, inline_recipes
from precast.backends.aoti.package_cache import (
    FORMAT,
    MANIFEST,
    PACKAGE,
    StoredConstant,
    fsync_dir,
    notify_compiled,
    read_entry,
    remove_entry,
    sha256_file,
    warn_rebuilding,
    write_durable,
)
from precast.backends.aoti.packed import (
    match_folded,
    match_packed,
    record_folded_constants,
    record_new_constants,
    record_scalar_constants,
)
from precast.errors import PrecastError, first_line
from precast.io import check_space, file_lock
from precast.runtime.exported import dynamic_batch
from precast.runtime.signature import ProgramSignature
from precast.threads import TORCH_LOCK
from precast.weights.sources import package_constants, tensor_constants, with_placeholders

IN_SO = "aot_inductor.package_constants_in_so"


def entry_manifest(
    facts: ProgramFacts, job: CompileJob, progress: bool | None, lock_timeout: float | None
) -> tuple[float, dict[str, Any]]:
    """The seconds spent compiling (0.0: published by an earlier run or by a process we waited for) and the
    manifest of ``job``'s entry: read when published and intact, else built from a private copy of the program
    (the int weights' and the attention's rewrites applied; uninitialized placeholders for streamed weights) and
    published."""
    manifest, _ = read_entry(job.entry, job.key)
    if manifest is not None:
        return 0.0, manifest
    # a private copy: the caller's program stays as it is
    rewritten, derived = apply_int_weights(facts.ep, job.ints)
    rewritten = apply_attention(rewritten, job.attention)
    program = with_placeholders(rewritten, facts.device) if facts.fake else rewritten
    return build_locked(program, facts, job, progress, lock_timeout, derived=derived)


def build_locked(
    ep: ExportedProgram,
    facts: ProgramFacts,
    job: CompileJob,
    progress: bool | None,
    lock_timeout: float | None,
    derived: dict[str, Any] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Compile ``ep`` and publish ``job``'s entry unless another process did it while we waited for the lock.

    ``ep``: the program to compile (``facts``' program rewritten, ``entry_manifest``). ``derived``: the recipes
    of constants ``ep`` holds that the caller's program does not (``int_weights``: the int4 kernel's packed
    weights), over the caller's stored names; written with freezing's folded constants (those folded from a
    derived one are stated over the caller's names too), so every load recomputes them.

    Returns the seconds spent compiling (0.0 if another process published the entry first) and the manifest."""
    key, root = job.key, job.root
    with file_lock(root / "locks" / f"{key}.lock", f"compiling cache entry {key[:12]}", lock_timeout):
        manifest = _published_or_cleared(job)
        if manifest is not None:
            return 0.0, manifest
        build = _build_dir(ep, job)
        try:
            started = time.perf_counter()
            built = _compile_into(build / PACKAGE, ep, job, derived, bool(facts.fake), progress)
            seconds = time.perf_counter() - started
            manifest = _manifest(build / PACKAGE, job, facts.stored, built, seconds)
            _publish(build, job.entry, manifest)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        notify_compiled(key, seconds, root)
        return seconds, manifest


def _published_or_cleared(job: CompileJob) -> dict[str, Any] | None:
    """Under the lock: the manifest another process published meanwhile; else None, with a damaged entry and the
    temporary folders of killed compiles of this key removed."""
    manifest, why = read_entry(job.entry, job.key)
    if manifest is not None:
        return manifest
    if why != "absent":
        warn_rebuilding(job.entry, why)
        remove_entry(job.entry, job.root)
    for stale in (job.root / "tmp").glob(f"{job.key}.*"):  # left by a killed compile: we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    return None


def _build_dir(ep: ExportedProgram, job: CompileJob) -> Path:
    """A new temporary folder to build the entry in, once the cache dir has room for it."""
    weights = sum(v.numel() * v.element_size() for v in tensor_constants(ep).values())
    # the package holds the weights and the compiler writes intermediates: refuse early, not mid-write
    check_space(job.root / "tmp", 2 * weights + (64 << 20), f"precast.compile: cache dir {job.root}")
    return Path(tempfile.mkdtemp(prefix=f"{job.key}.", dir=job.root / "tmp"))


def _compile_into(
    package: Path,
    ep: ExportedProgram,
    job: CompileJob,
    derived: dict[str, Any] | None,
    fake: bool,
    progress: bool | None,
) -> tuple[ExportedProgram, dict[str, Any], dict[str, Any]]:
    """Compile ``ep`` into ``package``: the program compiled, its packed/folded plan and its constants' layout;
    compiled again with the constants in the .so when its code reads constants precast cannot hand it."""
    message = f"precast: compiling with AOTInductor ({job.key[:12]}, ~30 s on a small CPU)"
    with _progress(progress, message), TORCH_LOCK:
        compiled, packed = _with_derived(_aoti_compile(ep, package, job.configs, job.dynamic), derived)
        layout = _layout(package, ep, packed, job.configs)
        if layout is None:  # the code reads constants precast cannot hand it: they go in the .so
            if fake:
                raise PrecastError(
                    "precast.compile: AOTInductor computed constants from the weights' values, which a "
                    "program with fake or meta weights does not have; load the weights into the program"
                )
            compiled, packed = _with_derived(
                _aoti_compile(ep, package, {**job.configs, IN_SO: True}, job.dynamic), derived
            )
            layout = {"external": False, "every": [], "unread": []}
    return compiled, packed, layout


def _manifest(
    package: Path,
    job: CompileJob,
    stored: dict[str, StoredConstant],
    built: tuple[ExportedProgram, dict[str, Any], dict[str, Any]],
    seconds: float,
) -> dict[str, Any]:
    """The entry's manifest (``package_cache.read_entry`` checks it) for ``package`` and what built it (the
    program compiled, its packed/folded plan, its constants' layout): the package's hash, the compiled program's
    signature, how it was compiled, where each stored constant came from and the int weights a kernel reads."""
    compiled, packed, layout = built
    int_weights = job.ints.to_dict() if job.ints.key() else None
    return {
        "format": FORMAT,
        "key": job.key,
        "files": {PACKAGE: sha256_file(package)},
        "signature": ProgramSignature.from_program(compiled).to_dict(),
        "torch": torch.__version__,
        "inductor_configs": job.configs,
        "form": job.form.to_dict(),
        "threads": job.threads,
        "dynamic": job.dynamic,
        "compile_seconds": round(seconds, 3),
        "created": time.time(),
        "constants": {
            name: [st.source.original, str(st.source.original_dtype), str(st.source.dtype)]
            + ([st.source.derive] if getattr(st.source, "derive", None) else [])
            for name, st in stored.items()
        },
        "packed": packed,
        "weights": layout,
        **({"int_weights": int_weights} if int_weights else {}),
    }


def _publish(build: Path, entry: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest durably and rename the build folder into place: the entry appears whole or not at all."""
    write_durable(build / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
    fsync_dir(build)
    os.rename(build, entry)  # atomic publish
    fsync_dir(entry.parent)


def _with_derived(
    compiled: tuple[ExportedProgram, dict[str, Any]], derived: dict[str, Any] | None
) -> tuple[ExportedProgram, dict[str, Any]]:
    """The compile's packed/folded plan with ``derived``'s recipes added and inlined into the folded ones."""
    program, packed = compiled
    if not derived:
        return program, packed
    folded = {n: inline_recipes(r, derived) for n, r in packed.get("folded", {}).items()}
    return program, {**packed, "folded": {**derived, **folded}}


def _layout(
    package: Path, ep: ExportedProgram, packed: dict[str, Any], configs: dict[str, Any]
) -> dict[str, Any] | None:
    """Where the package's constants come from at load: ``{"external": False, ...}`` when they are in the .so;
    else every constant its code declares and those it never reads; None when it reads one that is neither a
    program constant nor a packed copy precast reproduces (or its wrapper source cannot be read)."""
    if configs.get(IN_SO, True):
        return {"external": False, "every": [], "unread": []}
    found = package_constants(package)
    if found is None or packed["unmatched"]:
        return None
    every, unread = found
    known = set(tensor_constants(ep)) | set(packed["plans"]) | set(packed.get("folded", {}))
    if any(n not in known for n in every if n not in unread):
        return None
    return {"external": True, "every": every, "unread": unread}


@contextlib.contextmanager
def _progress(enabled: bool | None, message: str) -> Iterator[None]:
    if enabled is None:
        enabled = sys.stderr.isatty() and not os.environ.get("CI")
    if not enabled:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


# ---- AOTInductor --------------------------------------------------------------------------------------------
def _aoti_compile(
    ep: ExportedProgram, package: Path, configs: dict[str, Any], dynamic: bool
) -> tuple[ExportedProgram, dict[str, Any]]:
    """Compile ``ep`` (made batch-dynamic if asked) into ``package``; returns the program actually compiled and
    the plan of the weights the compiled code reads through packed copies (``{"plans": ..., "unmatched": ...}``,
    see ``match_packed``)."""
    import torch._inductor

    with torch.no_grad():
        program = dynamic_batch(ep) if dynamic else ep
        try:
            with (
                record_new_constants() as added,
                record_folded_constants() as folded,
                record_scalar_constants() as scalars,
            ):
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(package), inductor_configs=dict(configs)
                )
        except Exception as exc:
            raise PrecastError(
                f"precast.compile: AOTInductor failed: {type(exc).__name__}: {first_line(exc)[:300]}; "
                "run with TORCH_LOGS=output_code for details, or try dynamic=False"
            ) from exc
    sources = {
        name: value
        for name, value in {**program.state_dict, **program.constants}.items()
        if isinstance(value, torch.Tensor)
    }
    # a program constant Inductor registers under its own name (a 3-d buffer the code writes: a KV cache) is not a
    # packed copy; counted as one it was "unmatched", which put the constants in the .so and refused load_weights
    plans, unmatched = match_packed({n: t for n, t in added.items() if n not in sources}, sources)
    # one the code reads without a recipe: _layout refuses it; a lowering's own 0-d constants (the int4 kernel's
    # group size) are literals the loader is handed like the folded ones
    recipes, _ = match_folded({**scalars, **folded}, sources)
    return program, {"plans": plans, "unmatched": unmatched, "folded": recipes}
