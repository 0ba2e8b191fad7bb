"""AOTInductor compilation of (converted) programs, with a disk cache and weight swapping.

    cm = precast.compile(res.program)           # compile once, cached on disk and in process
    y = cm(x)                                   # any batch size (dim 0 is dynamic by default)
    cm.load_weights(model.state_dict())         # new fp32 weights by original name, cast on load

Cache entries live in ``<cache_dir>/aoti/<key>/`` (``model.pt2`` + ``manifest.json``). The key hashes the
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
``load_weights`` refuse, as for weights folded by freezing.

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
from torch.utils import _pytree as pytree

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
from precast.backends.packed import gemm_pack, match_packed, record_new_constants
from precast.backends.signature import ProgramSignature, dynamic_batch, exported_program
from precast.errors import PrecastError, first_line
from precast.io import check_space, file_lock
from precast.threads import TORCH_LOCK

MODES = ("default", "max-autotune")

# program -> {options key: CompiledModel}; weak so a cached model never keeps a program's weights alive. A hit
# counts only if the model's key is the program's key now: weights changed in place give a new key
_MEMO: weakref.WeakKeyDictionary[ExportedProgram, dict[str, CompiledModel]] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


class CompiledModel:
    """A loaded AOTInductor package. Call it like the program's module; swap weights with ``load_weights``."""

    def __init__(
        self,
        runner: Any,
        package_path: Path,
        key: str,
        stored: dict[str, StoredConstant],
        signature: ProgramSignature,
        *,
        from_cache: bool,
        compile_seconds: float,
        load_seconds: float,
        packed: Mapping[str, Any] | None = None,
    ):
        self._runner = runner
        # packed constant -> {"source": stored name, "transposed", "block_n", "vnni"}; "unmatched": [names]
        self._packed = dict((packed or {}).get("plans", {}))
        self._packed_unmatched = list((packed or {}).get("unmatched", []))
        self.package_path = Path(package_path)
        self.key = key
        self._stored = stored
        self.signature = signature
        # call the loader directly: AOTICompiledModel.__call__ re-parses its call spec on every call
        loader = getattr(runner, "loader", None)
        self._boxed_run = getattr(loader, "boxed_run", None)
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1]) if self._boxed_run else None
        self._all_tensors = all(s.kind == "tensor" for s in signature.inputs)
        self.from_cache = from_cache
        self.compile_seconds = compile_seconds
        self.load_seconds = load_seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.signature.check(
            args, kwargs
        )  # a one-line PrecastError before native code sees a bad input
        if self._boxed_run is None:
            return self._runner(*args, **kwargs)
        tensors = list(flat) if self._all_tensors else [t for t in flat if isinstance(t, torch.Tensor)]
        return pytree.tree_unflatten(self._boxed_run(tensors), self._out_spec)

    def __repr__(self) -> str:
        how = "from cache" if self.from_cache else f"compiled in {self.compile_seconds:.1f}s"
        return f"CompiledModel({self.package_path}, {how})"

    def constant_fqns(self) -> list[str]:
        """Names of the constants the compiled code reads (stored names, possibly low precision)."""
        return sorted(self._runner.get_constant_fqns())

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
        """Replace the weights by the model's ORIGINAL state_dict (fp32, original names), without recompiling.

        Each tensor is cast to the dtype(s) the converted program stores it in. Names, shapes and dtypes are
        checked first; on any mismatch a PrecastError lists them all and the model keeps its old weights.
        Non-persistent buffers and lifted constants (``position_ids``, ``inv_freq``: not in ``state_dict()``)
        are swapped when given by name and otherwise keep the value the program baked. Returns
        ``{"loaded": [...], "kept": [...]}``: the original names swapped, and those left as they were.
        """
        by_original: dict[str, list[StoredConstant]] = {}
        for st in self._stored.values():
            by_original.setdefault(st.source.original, []).append(st)
        swappable = set(self._runner.get_constant_fqns())
        kept = sorted(
            n
            for n, sts in by_original.items()
            if n not in state_dict and not any(st.persistent for st in sts)
        )
        missing = sorted(n for n in by_original if n not in state_dict and n not in kept)
        unexpected = sorted(n for n in state_dict if n not in by_original)
        problems: list[str] = []
        for name in sorted(set(by_original) & set(state_dict)):
            value = state_dict[name]
            want = by_original[name][0]
            if not isinstance(value, torch.Tensor):
                problems.append(f"{name} is a {type(value).__name__}, not a tensor")
                continue
            if tuple(value.shape) != want.shape:
                problems.append(f"{name} has shape {tuple(value.shape)}, expected {want.shape}")
            if value.dtype != want.source.original_dtype:
                problems.append(f"{name} has dtype {value.dtype}, expected {want.source.original_dtype}")
        folded = sorted(
            st.source.stored for st in self._stored.values() if st.read and st.source.stored not in swappable
        )
        if missing:
            problems.insert(0, f"missing {missing}")
        if unexpected:
            problems.insert(1 if missing else 0, f"unexpected {unexpected}")
        if folded:
            problems.append(
                f"compiled code folded {folded} into itself (freezing, or always_keep_tensor_constants=False); "
                "recompile without them to swap those"
            )
        if self._packed_unmatched:
            problems.append(
                f"compiled code packed weights into {sorted(self._packed_unmatched)} in a layout precast cannot "
                "reproduce; recompile with mode='default' to swap them"
            )
        if problems:
            raise PrecastError(
                f"load_weights({self.package_path.name}): {len(problems)} problem(s): {'; '.join(problems)}; "
                "pass the original fp32 state_dict of the model the program was converted from "
                "(the compiled model still serves its previous weights)"
            )
        update: dict[str, torch.Tensor] = {}
        for name, entries in by_original.items():
            if name in kept:
                continue
            value = state_dict[name].detach()
            for st in entries:
                if not st.read:
                    continue  # never read by the graph (e.g. num_batches_tracked): checked above, nothing to swap
                # a fresh contiguous copy in the stored dtype: the same rounding fold_constant_casts applied
                update[st.source.stored] = value.to(
                    device=st.device, dtype=st.source.dtype, copy=True, memory_format=torch.contiguous_format
                )
        for (
            name,
            plan,
        ) in self._packed.items():  # the GEMM template's copies, packed as the compile packed them
            if plan["source"] in update:
                update[name] = gemm_pack(
                    update[plan["source"]],
                    transposed=plan["transposed"],
                    block_n=plan["block_n"],
                    vnni=plan["vnni"],
                )
        self._runner.load_constants(update, check_full_update=set(update) >= swappable)
        return {"loaded": sorted(n for n in by_original if n not in kept), "kept": kept}


# ---- public entry point -------------------------------------------------------------------------------------
def compile_configs(
    mode: str = "default", inductor_configs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The inductor configs ``compile`` compiles with (and keys its cache entry by).

    Without freezing, every constant stays a swappable constant: AOTInductor otherwise inlines 0-d constants and
    1-d ones of <= 8 elements into its code (``GraphLowering.can_inline_constant``), and ``load_weights`` could
    never swap an 8-element bias (``always_keep_tensor_constants``; the caller's own value wins)."""
    configs = dict(inductor_configs or {})
    if mode == "max-autotune":
        configs["max_autotune"] = True
    if not configs.get("freezing"):
        configs.setdefault("always_keep_tensor_constants", True)
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
) -> CompiledModel:
    """Compile ``program`` (an ExportedProgram or a ConvertResult) with AOTInductor, cached; returns a loaded model.

    ``dynamic``: re-export with a dynamic dim 0 (batch) on every tensor input, as PyTorch's benchmark harness does.
    ``cache_dir``: default ``$PRECAST_CACHE_DIR`` or the user cache dir. ``progress``: a spinner on stderr
    (default: only when stderr is a terminal and ``CI`` is unset). ``lock_timeout``: seconds to wait for another
    process compiling the same key (default ``$PRECAST_LOCK_TIMEOUT`` or 600); a line on stderr after 5 s.
    Safe to call from several threads (torch's compile and load are serialized; see precast/threads.py).
    """
    ep = exported_program(program, "precast.compile")
    if mode not in MODES:
        raise PrecastError(f"precast.compile: mode={mode!r}; choose one of {', '.join(MODES)}")
    configs = compile_configs(mode, inductor_configs)
    root = resolve_cache_dir(cache_dir)
    options = json.dumps(
        {"configs": configs, "dynamic": dynamic, "root": str(root)}, sort_keys=True, default=str
    )
    key = cache_key(ep, configs, dynamic)  # by content: weights changed in place give another key
    with _MEMO_LOCK:
        model = _MEMO.get(ep, {}).get(options)
    if model is not None and model.key == key:
        return model

    stored = stored_constants(ep)
    entry = root / "aoti" / key
    started = time.perf_counter()
    compile_seconds = 0.0
    manifest, _ = read_entry(entry, key)
    if manifest is None:
        compile_seconds, manifest = _build_locked(
            ep, root, key, configs, dynamic, stored, progress, lock_timeout
        )
    from_cache = compile_seconds == 0.0  # published by an earlier run or by a process we waited for
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
    )
    with _MEMO_LOCK:
        _MEMO.setdefault(ep, {})[options] = model
    return model


def _build_locked(
    ep: ExportedProgram,
    root: Path,
    key: str,
    configs: dict[str, Any],
    dynamic: bool,
    stored: dict[str, StoredConstant],
    progress: bool | None,
    lock_timeout: float | None,
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
        weights = sum(
            v.numel() * v.element_size()
            for v in {**ep.state_dict, **ep.constants}.values()
            if isinstance(v, torch.Tensor)
        )
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
