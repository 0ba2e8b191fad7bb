"""AOTInductor compilation of (converted) programs, with a disk cache and weight swapping.

    cm = precast.compile(res.program)           # compile once, cached on disk and in process
    y = cm(x)                                   # any batch size (dim 0 is dynamic by default)
    cm.load_weights(model.state_dict())         # new fp32 weights by original name, cast on load

Cache entries live in ``<cache_dir>/aoti/<key>/`` (``model.pt2`` + ``manifest.json``). The package holds no
weights: the model hands the loader the program's own tensors (or, for a program with meta weights, those read
from ``weights=`` shards), held once (``weights/sources.py``, ``backends/compiled.py``). The key hashes the
graph, the weights, the compile options, inductor's config and environment, the C++ compiler and its version, the
CPU's ISA, torch's version and git commit, precast's version and the device. An entry is built in a temporary
folder and renamed into place after its manifest (sha256 of every file, the compiled program's input signature)
is written, under a file lock, so concurrent processes compile a key once and a killed compile never leaves a
loadable entry. An entry whose files do not match its manifest is rebuilt, never loaded: it is native code.
Every call's inputs are checked against the compiled program's signature (``backends/signature.py``) before
the native code runs: AOTInductor itself reads past its buffers on a wrong shape.

Packed weights: under ``mode="max-autotune"`` on a CPU, Inductor's C++ GEMM template (AMX / AVX512 micro-kernels)
copies each weight it uses into a blocked (and for bf16 VNNI-interleaved) constant at compile time and reads only
that copy. The compile records those copies (``record_new_constants``), finds the stored weight and the packing
that reproduces each bit for bit (``match_packed``), and writes the plan in the manifest; ``load_weights`` packs
the new weights the same way (``gemm_pack``), so they stay swappable. A copy precast cannot reproduce makes
``load_weights`` refuse, as for weights folded by freezing. The originals the code never reads are not loaded.

Input: an ExportedProgram (converted or not) and compile options. Output: a ``CompiledModel`` (callable,
``load_weights`` by original names) backed by a cached AOTInductor package (``backends/cache.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.cache import (
    FORMAT,
    MANIFEST,
    PACKAGE,
    StoredConstant,
    cache_key,
    fsync_dir,
    notify_compiled,
    read_entry,
    remove_entry,
    resolve_cache_dir,
    sha256_file,
    stored_constants,
    warn_rebuilding,
    write_durable,
)
from precast.backends.compiled import CompiledModel, initial_state
from precast.backends.packed import gemm_pack, match_packed, record_new_constants
from precast.backends.signature import ProgramSignature, dynamic_batch, exported_program, with_example_inputs
from precast.errors import PrecastError, first_line
from precast.io import check_space, file_lock
from precast.ir.program import written_targets
from precast.threads import TORCH_LOCK
from precast.weights.sources import (
    SafetensorsSource,
    check_stored,
    is_fake,
    package_constants,
    tensor_constants,
    with_placeholders,
)

MODES = ("default", "max-autotune")
IN_SO = "aot_inductor.package_constants_in_so"

# program -> {options key: CompiledModel}; weak so a cached model never keeps a program's weights alive. A hit
# counts only if the model's key is the program's key now: weights changed in place give a new key
_MEMO: weakref.WeakKeyDictionary[ExportedProgram, dict[str, CompiledModel]] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


# ---- public entry point -------------------------------------------------------------------------------------
def compile_configs(
    mode: str = "default", inductor_configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The inductor configs ``compile`` compiles with (and keys its cache entry by).

    Without freezing, every constant stays a swappable constant: AOTInductor otherwise inlines 0-d constants and
    1-d ones of <= 8 elements into its code (``GraphLowering.can_inline_constant``), and ``load_weights`` could
    never swap an 8-element bias (``always_keep_tensor_constants``; the caller's own value wins). And the
    package leaves its constants out (``aot_inductor.package_constants_in_so=False``, the same name on torch 2.13
    and 2.15): the model hands the loader tensors it owns, held once (``weights/sources.py``); freezing folds
    weights into constants only the compile computes, so they stay in the .so there."""
    configs = dict(inductor_configs or {})
    if mode == "max-autotune":
        configs["max_autotune"] = True
    if not configs.get("freezing"):
        configs.setdefault("always_keep_tensor_constants", True)
        configs.setdefault(IN_SO, False)
    return configs


def compile(
    program: ExportedProgram | Any,
    *,
    mode: str = "default",
    cache_dir: str | os.PathLike | None = None,
    dynamic: bool = True,
    inductor_configs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    lock_timeout: float | None = None,
    weights: str | os.PathLike | None = None,
) -> CompiledModel:
    """Compile ``program`` (an ExportedProgram or a ConvertResult) with AOTInductor, cached; returns a loaded model.

    ``dynamic``: re-export with a dynamic dim 0 (batch) on every tensor input, as PyTorch's benchmark harness does.
    ``cache_dir``: default ``$PRECAST_CACHE_DIR`` or the user cache dir. ``progress``: a spinner on stderr
    (default: only when stderr is a terminal and ``CI`` is unset). ``lock_timeout``: seconds to wait for another
    process compiling the same key (default ``$PRECAST_LOCK_TIMEOUT`` or 600); a line on stderr after 5 s.
    Safe to call from several threads (torch's compile and load are serialized; see precast/threads.py).
    ``weights``: for a program whose constants are fake or meta (converted with streamed weights), a
    ``.safetensors`` file or a directory of shards (+ ``model.safetensors.index.json``) holding them by the
    program's stored names, in their stored dtypes; checked against the program, then read once.
    The compiled model reads the program's own weight tensors (no copy): change weights with ``load_weights``.
    """
    ep = with_example_inputs(exported_program(program, "precast.compile"))
    if mode not in MODES:
        raise PrecastError(f"precast.compile: mode={mode!r}; choose one of {', '.join(MODES)}")
    configs = compile_configs(mode, inductor_configs)
    fake = sorted(n for n, v in tensor_constants(ep).items() if is_fake(v))
    device = _check_fake(ep, fake, weights, configs, mode)
    root = resolve_cache_dir(cache_dir)
    options = json.dumps(
        {"configs": configs, "dynamic": dynamic, "root": str(root)}, sort_keys=True, default=str
    )
    key = cache_key(ep, configs, dynamic)  # by content: weights changed in place give another key
    with _MEMO_LOCK:
        model = None if weights is not None else _MEMO.get(ep, {}).get(options)
    if model is not None and model.key == key:
        if not model.stateful:
            return model
        # a program that writes state (a KV cache): a model of its own each call, never another's state; the
        # package is loaded again (AOTInductor keeps the state a loaded package writes per loaded package), the
        # read-only weights shared
        started = time.perf_counter()
        with TORCH_LOCK:
            runner = _load(model.package_path)
        return model._sibling(runner, time.perf_counter() - started)

    stored = stored_constants(ep, device if fake else None)
    entry = root / "aoti" / key
    started = time.perf_counter()
    compile_seconds = 0.0
    manifest, _ = read_entry(entry, key)
    if manifest is None:
        compile_seconds, manifest = _build_locked(
            with_placeholders(ep, device) if fake else ep,
            root,
            key,
            configs,
            dynamic,
            stored,
            progress,
            lock_timeout,
            fake=bool(fake),
        )
    from_cache = compile_seconds == 0.0  # published by an earlier run or by a process we waited for
    layout = manifest["weights"]
    constants = None
    if layout["external"]:
        source = SafetensorsSource(weights, "precast.compile(weights=...)") if fake else None
        constants = _constants(ep, source, layout, manifest["packed"]["plans"])
    with TORCH_LOCK:
        runner = _load(entry / PACKAGE)
    model = CompiledModel(
        runner,
        entry / PACKAGE,
        key,
        stored,
        ProgramSignature.from_dict(manifest["signature"]),
        from_cache=from_cache,
        compile_seconds=compile_seconds,
        load_seconds=time.perf_counter() - started - compile_seconds,
        packed=manifest.get("packed"),
        constants=constants,
        unread=tuple(layout["unread"]),
        state=initial_state(_written_values(ep)),
    )
    with _MEMO_LOCK:
        _MEMO.setdefault(ep, {})[options] = model
    return model


def _written_values(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """The program's values of the constants its code writes (a KV cache): the state each model starts from."""
    program = tensor_constants(ep)
    return {n: program[n] for n in sorted(written_targets(ep)) if n in program and not is_fake(program[n])}


def _check_fake(
    ep: ExportedProgram, fake: list[str], weights: Any, configs: dict[str, Any], mode: str
) -> str:
    """The device the constants live on at run time; refuses a fake-weight program this compile cannot serve."""
    inputs = [
        n.meta["val"].device.type
        for n in ep.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    real = [v.device.type for v in tensor_constants(ep).values() if not is_fake(v)]
    device = next((d for d in real + inputs if d != "meta"), "cpu")
    if weights is not None and not fake:
        raise PrecastError(
            "precast.compile: weights= is for a program whose constants are fake or meta (converted with streamed "
            "weights); this one holds its weights: drop weights=, or swap them after with load_weights"
        )
    if not fake:
        return device
    if weights is None:
        raise PrecastError(
            f"precast.compile: {len(fake)} constant(s) of the program have no data (fake or meta), e.g. "
            f"{fake[0]!r}; pass weights=DIR (the shards the conversion wrote) or a .safetensors file"
        )
    if configs.get(IN_SO, True) or mode == "max-autotune":
        raise PrecastError(
            "precast.compile: a program with fake or meta weights compiles only with mode='default' and its "
            f"weights outside the package (no freezing, {IN_SO} not True): max-autotune and freezing compute new "
            "constants from the weights' values at compile time; load the weights into the program for those"
        )
    return device


def _constants(
    ep: ExportedProgram, source: SafetensorsSource | None, layout: dict[str, Any], plans: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The tensors the loader will read: the program's own (a buffer the code writes is copied: the caller's
    program stays as it was), or those of ``source``; plus the packed copies, packed from them."""
    program = tensor_constants(ep)
    unread = set(layout["unread"])
    needed = {n for n in layout["every"] if n not in unread and n not in plans}
    wanted = needed | {p["source"] for n, p in plans.items() if n not in unread}
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
    return out


def _build_locked(
    ep: ExportedProgram,
    root: Path,
    key: str,
    configs: dict[str, Any],
    dynamic: bool,
    stored: dict[str, StoredConstant],
    progress: bool | None,
    lock_timeout: float | None,
    fake: bool = False,
) -> tuple[float, dict[str, Any]]:
    """Compile and publish the entry for ``key`` unless another process did it while we waited for the lock.

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
                compiled, packed = _aoti_compile(ep, build / PACKAGE, configs, dynamic)
                layout = _layout(build / PACKAGE, ep, packed, configs)
                if layout is None:  # the code reads constants precast cannot hand it: they go in the .so
                    if fake:
                        raise PrecastError(
                            "precast.compile: AOTInductor computed constants from the weights' values, which a "
                            "program with fake or meta weights does not have; load the weights into the program"
                        )
                    compiled, packed = _aoti_compile(ep, build / PACKAGE, {**configs, IN_SO: True}, dynamic)
                    layout = {"external": False, "every": [], "unread": []}
            seconds = time.perf_counter() - started
            manifest = {
                "format": FORMAT,
                "key": key,
                "files": {PACKAGE: sha256_file(build / PACKAGE)},
                "signature": ProgramSignature.from_program(compiled).to_dict(),
                "torch": torch.__version__,
                "inductor_configs": configs,
                "dynamic": dynamic,
                "compile_seconds": round(seconds, 3),
                "created": time.time(),
                "constants": {
                    name: [st.source.original, str(st.source.original_dtype), str(st.source.dtype)]
                    for name, st in stored.items()
                },
                "packed": packed,
                "weights": layout,
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
    known = set(tensor_constants(ep)) | set(packed["plans"])
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
            with record_new_constants() as added:
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
    plans, unmatched = match_packed(added, sources)
    return program, {"plans": plans, "unmatched": unmatched}


def _load(package: Path) -> Any:
    import torch._inductor

    try:
        return torch._inductor.aoti_load_package(str(package))
    except Exception as exc:
        raise PrecastError(
            f"precast.compile: cannot load {package}: {first_line(exc)[:300]}; delete the cache entry"
        ) from exc
