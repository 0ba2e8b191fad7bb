"""Building, publishing and loading an AOTInductor cache entry for ``precast.compile`` (``backends/aoti/compiler.py``).

- ``build_locked``: compile ``program`` into a temporary folder under the key's file lock, write its manifest
  (sha256 of the package, the compiled program's signature, the packed and folded plans, the constants'
  layout) and rename it into place: an entry appears whole or not at all.
- ``loader_constants``: the tensors the loader reads (the program's own, or those of ``weights=`` shards), plus
  the packed copies and folded constants recomputed from them.
- ``load_package``: load a package, its failure one line.

Input: an ExportedProgram, its key and configs. Output: the entry's manifest; the loaded runner.
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

from precast.backends.aoti.forms import Form
from precast.backends.aoti.int_rewrite import inline_recipes
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
    gemm_pack,
    match_folded,
    match_packed,
    recipe_sources,
    record_folded_constants,
    record_new_constants,
    record_scalar_constants,
    replay,
)
from precast.errors import PrecastError, first_line
from precast.io import check_space, file_lock
from precast.ir.program import written_targets
from precast.runtime.exported import dynamic_batch
from precast.runtime.signature import ProgramSignature
from precast.threads import TORCH_LOCK
from precast.weights.sources import (
    SafetensorsSource,
    check_stored,
    is_fake,
    package_constants,
    tensor_constants,
)

IN_SO = "aot_inductor.package_constants_in_so"


def loader_constants(
    ep: ExportedProgram,
    source: SafetensorsSource | None,
    layout: dict[str, Any],
    plans: dict[str, Any],
    folded: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """The tensors the loader will read: the program's own (a buffer the code writes is copied: the caller's
    program stays as it was), or those of ``source``; plus the packed copies, packed from them, and the
    constants freezing folded, recomputed from them."""
    program = tensor_constants(ep)
    unread = set(layout["unread"])
    every = set(layout["every"])
    folded = {n: r for n, r in folded.items() if n in every and n not in unread}
    needed = {n for n in layout["every"] if n not in unread and n not in plans and n not in folded}
    wanted = needed | {p["source"] for n, p in plans.items() if n not in unread}
    wanted |= set().union(*(recipe_sources(r) for r in folded.values())) if folded else set()
    # the files hold what the program has no values for (streamed weights); a buffer made at construction
    # (a rotary table) or a KV cache stays the program's own
    from_files = {n for n in wanted if is_fake(program[n])} if source is not None else set()
    written = written_targets(ep)
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


def build_locked(
    ep: ExportedProgram,
    root: Path,
    key: str,
    configs: dict[str, Any],
    dynamic: bool,
    stored: dict[str, StoredConstant],
    progress: bool | None,
    lock_timeout: float | None,
    fake: bool = False,
    form: Form | None = None,
    derived: dict[str, Any] | None = None,
    int_weights: dict[str, Any] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Compile and publish the entry for ``key`` unless another process did it while we waited for the lock.

    ``derived``: the recipes of constants ``ep`` holds that the caller's program does not (``aoti_int``: the
    int4 kernel's packed weights), over the caller's stored names; written with freezing's folded constants
    (those folded from a derived one are stated over the caller's names too), so every load recomputes them.
    ``int_weights``: the manifest's record of which int weights a low-bit kernel reads.

    Returns the seconds spent compiling (0.0 if another process published the entry first) and the manifest."""
    entry = root / "aoti" / key
    with file_lock(root / "locks" / f"{key}.lock", f"compiling cache entry {key[:12]}", lock_timeout):
        manifest, why = read_entry(entry, key)
        if manifest is not None:
            return 0.0, manifest
        if why != "absent":
            warn_rebuilding(entry, why)
            remove_entry(entry, root)
        for stale in (root / "tmp").glob(f"{key}.*"):  # left by a killed compile: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        weights = sum(v.numel() * v.element_size() for v in tensor_constants(ep).values())
        # the package holds the weights and the compiler writes intermediates: refuse early, not mid-write
        check_space(root / "tmp", 2 * weights + (64 << 20), f"precast.compile: cache dir {root}")
        build = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=root / "tmp"))
        try:
            started = time.perf_counter()
            with (
                _progress(
                    progress, f"precast: compiling with AOTInductor ({key[:12]}, ~30 s on a small CPU)"
                ),
                TORCH_LOCK,
            ):
                compiled, packed = _with_derived(
                    _aoti_compile(ep, build / PACKAGE, configs, dynamic), derived
                )
                layout = _layout(build / PACKAGE, ep, packed, configs)
                if layout is None:  # the code reads constants precast cannot hand it: they go in the .so
                    if fake:
                        raise PrecastError(
                            "precast.compile: AOTInductor computed constants from the weights' values, which a "
                            "program with fake or meta weights does not have; load the weights into the program"
                        )
                    compiled, packed = _with_derived(
                        _aoti_compile(ep, build / PACKAGE, {**configs, IN_SO: True}, dynamic), derived
                    )
                    layout = {"external": False, "every": [], "unread": []}
            seconds = time.perf_counter() - started
            manifest = {
                "format": FORMAT,
                "key": key,
                "files": {PACKAGE: sha256_file(build / PACKAGE)},
                "signature": ProgramSignature.from_program(compiled).to_dict(),
                "torch": torch.__version__,
                "inductor_configs": configs,
                "form": (form or Form("default", {}, "")).to_dict(),
                "dynamic": dynamic,
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
            write_durable(build / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
            fsync_dir(build)
            os.rename(build, entry)  # atomic publish: the entry appears whole or not at all
            fsync_dir(entry.parent)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        notify_compiled(key, seconds, root)
        return seconds, manifest


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


def load_package(package: Path) -> Any:
    import torch._inductor

    try:
        return torch._inductor.aoti_load_package(str(package))
    except Exception as exc:
        raise PrecastError(
            f"precast.compile: cannot load {package}: {first_line(exc)[:300]}; delete the cache entry"
        ) from exc
