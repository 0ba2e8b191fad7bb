"""The AOTInductor package cache: keys, crash-safe entries, integrity checks, compile observers.

Input: a program and compile options. Output: the cache key, and entries ``<cache>/aoti/<key>/{model.pt2,
manifest.json}`` built in ``<cache>/tmp/`` and renamed into place; a package is loaded only if its manifest's
sha256 matches. The cache folder is private (0700, ``precast.io.private_dir``): the sha256 catches a torn or
corrupted file, not an attacker -- whoever can write the folder can replace a package and its hash together, so
a folder another user owns or group/others may write is refused. See docs/compile.md ("Trust model").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast import cpu
from precast.errors import PrecastError
from precast.io import cache_root, private_dir
from precast.ir.fake import has_data
from precast.ir.program import CONSTANT_KINDS, ConstantSource, constant_sources, program_devices
from precast.runtime.signature import ProgramSignature
from precast.weights.files import tensor_bytes

MANIFEST = "manifest.json"
PACKAGE = "model.pt2"
FORMAT = 5  # 2: the manifest carries the compiled program's input signature; the key covers the toolchain;
# 3: and the plan of the weights the compiled code reads through packed copies (backends/aoti/build.py, "packed");
# 4: packages leave their constants out; "weights" says which the code declares and which it never reads
# 5: a 3-d program constant (a KV cache) is no longer listed as an unmatched packed copy (entries before it kept
#    their constants in the .so and refused load_weights)

# environment variables that change what inductor or the C++ compiler emits (read at compile time)
TOOLCHAIN_ENV_PREFIXES = ("TORCHINDUCTOR_", "AOT_INDUCTOR", "TORCH_COMPILE", "INDUCTOR_")
TOOLCHAIN_ENV = (
    "CXX",
    "CC",
    "CFLAGS",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "CPATH",
    "LIBRARY_PATH",
)  # not OMP_NUM_THREADS: the thread count is keyed as the ``cpp.threads`` config the code is generated for
# (compiler.compile_configs), whatever set it


@dataclass(frozen=True)
class StoredConstant:
    """What load_weights needs to know about one stored constant (no tensor kept)."""

    source: ConstantSource
    shape: tuple[int, ...]
    device: str
    read: bool = True  # False: the graph never reads it (AOTInductor drops it; nothing to swap)
    persistent: bool = True  # in the model's state_dict(); False: a non-persistent buffer or lifted constant


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The argument, else ``$PRECAST_CACHE_DIR``, else the platform's user cache dir; created private (0700)."""
    root = private_dir(cache_root(cache_dir))
    for sub in ("aoti", "tmp", "locks"):
        private_dir(root / sub)
    return root


# ---- compile observers (tests count compiles with them) --------------------------------------------------------
_OBSERVERS: list[Callable[[dict[str, Any]], None]] = []
_OBSERVERS_LOCK = threading.Lock()


@contextlib.contextmanager
def observe_compiles(callback: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Call ``callback({"key", "seconds", "pid", "cache_dir"})`` after every AOTInductor compile this process
    runs (tests count compiles with it; precast itself writes no log)."""
    with _OBSERVERS_LOCK:
        _OBSERVERS.append(callback)
    try:
        yield
    finally:
        with _OBSERVERS_LOCK:
            _OBSERVERS.remove(callback)


def notify_compiled(key: str, seconds: float, root: Path) -> None:
    with _OBSERVERS_LOCK:
        observers = list(_OBSERVERS)
    event = {"key": key, "seconds": round(seconds, 3), "pid": os.getpid(), "cache_dir": str(root)}
    for callback in observers:
        callback(event)


# ---- cache key --------------------------------------------------------------------------------------------
def cache_key(
    ep: ExportedProgram, inductor_configs: Mapping[str, Any], dynamic: bool, device: str | None = None
) -> str:
    """sha256 of everything the compiled code depends on: the program (graph, signature, weights), the compile
    options, inductor's whole in-process config and environment, the C++ compiler and its version, the CPU's ISA,
    torch (version and git commit), precast's version and the device."""
    h = hashlib.sha256()

    def put(label: str, text: str) -> None:
        h.update(f"{label}\0{text}\0".encode())

    put("format", str(FORMAT))
    put("graph", ep.graph_module.code)
    put("signature", str(ep.graph_signature))
    put("range_constraints", str(sorted((str(k), str(v)) for k, v in ep.range_constraints.items())))
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                put("input", f"{node.name}:{tuple(val.shape)}:{val.dtype}:{val.device.type}:{val.stride()}")
            else:
                put("input", f"{node.name}:{val!r}")
    for name, value in sorted({**ep.constants, **ep.state_dict}.items()):
        if isinstance(value, torch.Tensor) and not has_data(value):
            # no data (streamed weights): the package is built without constants, so it depends on their
            # metadata only; the values are checked against it when loaded (weights/sources.py)
            put("fake-tensor", f"{name}:{value.dtype}:{tuple(value.shape)}:{value.stride()}")
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            put("tensor", f"{name}:{t.dtype}:{tuple(t.shape)}")
            h.update(tensor_bytes(t))  # the bytes numpy gave before: the key of a given program is unchanged
        else:
            put("object", f"{name}:{type(value).__qualname__}")
    put("configs", json.dumps(dict(inductor_configs), sort_keys=True, default=str))
    put("dynamic", str(dynamic))
    for label, text in toolchain().items():
        put(label, text)
    device = device or program_device(
        ep
    )  # the device the code is built for (a meta-weight program: its inputs')
    put("device", device)
    if device == "cuda" and torch.cuda.is_available():
        put(
            "cuda",
            f"{torch.version.cuda}:{torch.cuda.get_device_capability()}:{torch.cuda.get_device_name()}",
        )
    return h.hexdigest()[:32]


def toolchain() -> dict[str, str]:
    """What besides the program changes the package: read now (inductor's config may change in process)."""
    import torch._inductor.config as inductor_config

    from precast.version import __version__

    env = {k: v for k, v in os.environ.items() if k.startswith(TOOLCHAIN_ENV_PREFIXES) or k in TOOLCHAIN_ENV}
    return {
        "torch": f"{torch.__version__} git={torch.version.git_version}",
        "precast": __version__,
        "inductor_config": _inductor_config_digest(inductor_config),
        "env": json.dumps(env, sort_keys=True),
        "compiler": _compiler_identity(),
        # inductor compiles with -march=native: a package runs only on a CPU with the ISA it was built for
        "isa": f"{cpu.capability()} {cpu.identity()}",
    }


def _inductor_config_digest(config: Any) -> str:
    """What ``config.get_hash()`` hashes (every option not marked compile-ignored), computed now: ``get_hash``
    caches its digest, and an AOTInductor compile mutates a config value in place without invalidating it, so the
    cached digest can be that of an earlier state, and a stale key would serve another package."""
    ignored = getattr(config, "_compile_ignored_keys", set())
    values = {k: v for k, v in config.get_config_copy().items() if k not in ignored}
    # an AOTInductor compile fills aot_inductor.metadata in place with the machine it ran on (AOTI_DEVICE_KEY,
    # AOTI_CPU_ISA, ...), which the key already covers: kept, the same program would key differently before and
    # after the process's first compile. The user's own metadata stays in the key.
    metadata = values.get("aot_inductor.metadata")
    if isinstance(metadata, dict):
        values["aot_inductor.metadata"] = {
            k: v for k, v in metadata.items() if not str(k).startswith("AOTI_")
        }
    return hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()


def _compiler_identity() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        cxx = get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - no compiler: the compile itself reports it; the key says so
        return f"none ({type(exc).__name__})"
    path = shutil.which(cxx) or cxx
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return f"{path} {_compiler_version(path, st.st_mtime_ns, st.st_size)}"
    return path


@functools.lru_cache(maxsize=8)
def _compiler_version(path: str, mtime_ns: int, size: int) -> str:
    """``cxx --version``'s first line, once per compiler binary (keyed by its mtime and size)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    return (
        (out.stdout or out.stderr).strip().splitlines()[0]
        if (out.stdout or out.stderr).strip()
        else "unknown"
    )


def program_device(ep: ExportedProgram) -> str:
    """The device the key names: the first tensor constant's (``meta`` for streamed weights), else the first
    input's, else cpu."""
    constants, inputs = program_devices(ep)
    return next(iter(constants + inputs), "cpu")


def stored_constants(ep: ExportedProgram, device: str | None = None) -> dict[str, StoredConstant]:
    """The program's constants by stored name: where each came from, its shape and device (``device`` where
    given: a program with meta weights runs elsewhere), whether it is read."""
    sources = constant_sources(ep)
    read = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in CONSTANT_KINDS or spec.target not in sources:
            continue
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        if isinstance(value, torch.Tensor):
            persistent = spec.kind == InputKind.PARAMETER or (
                spec.kind == InputKind.BUFFER and spec.persistent is not False
            )
            out[spec.target] = StoredConstant(
                sources[spec.target],
                tuple(value.shape),
                device or str(value.device),
                read=spec.arg.name in read,
                persistent=persistent,
            )
    return out


# ---- cache entries ------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_entry(entry: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` for a complete, intact entry for ``key``; ``(None, why not)`` otherwise.

    A manifest that is not JSON, or JSON of the wrong shape, is a reason (the entry is rebuilt), never a crash.
    """
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "absent"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"unreadable manifest ({type(exc).__name__})"
    if not isinstance(manifest, dict):
        return None, f"malformed manifest (a JSON {type(manifest).__name__}, not an object)"
    if manifest.get("format") != FORMAT or manifest.get("key") != key:
        return None, "manifest for another key or format"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return None, "malformed manifest (no files table)"
    if PACKAGE not in files:
        return None, f"manifest lists no {PACKAGE}"
    try:
        ProgramSignature.from_dict(manifest.get("signature"))
    except PrecastError:
        return None, "malformed manifest (no valid input signature)"
    if not packed_plan_ok(manifest.get("packed")):
        return None, "malformed manifest (no valid packed-weights plan)"
    if not weights_layout_ok(manifest.get("weights")):
        return None, "malformed manifest (no valid weights layout)"
    for name, digest in files.items():
        if "/" in name or name.startswith("."):
            return None, f"manifest names {name!r} outside the entry"
        try:
            if sha256_file(entry / name) != digest:
                return None, f"{name} does not match its manifest hash"
        except OSError:
            return None, f"{name} is missing"
    return manifest, None


def packed_plan_ok(packed: Any) -> bool:
    """The manifest's ``"packed"``: ``{"plans": {name: {"source", "transposed", "block_n", "vnni"}}, "unmatched":
    [names], "folded": {name: recipe}}`` (backends/aoti/build.py; ``folded`` absent in entries before it)."""
    if not isinstance(packed, dict) or not isinstance(packed.get("unmatched"), list):
        return False
    folded = packed.get("folded", {})
    if not isinstance(folded, dict) or not all(isinstance(r, dict) for r in folded.values()):
        return False
    plans = packed.get("plans")
    return isinstance(plans, dict) and all(
        isinstance(p, dict)
        and isinstance(p.get("source"), str)
        and isinstance(p.get("transposed"), bool)
        and all(type(p.get(k)) is int and p[k] > 0 for k in ("block_n", "vnni"))
        for p in plans.values()
    )


def weights_layout_ok(layout: Any) -> bool:
    """The manifest's ``"weights"``: ``{"external": bool, "every": [names], "unread": [names]}``
    (backends/aoti/build.py ``_layout``)."""
    return (
        isinstance(layout, dict)
        and isinstance(layout.get("external"), bool)
        and all(
            isinstance(layout.get(k), list) and all(isinstance(n, str) for n in layout[k])
            for k in ("every", "unread")
        )
    )


def entry_problem(entry: Path, key: str) -> str | None:
    """None if ``entry`` is a complete, intact entry for ``key``; else why not."""
    return read_entry(entry, key)[1]


def warn_rebuilding(entry: Path, why: str) -> None:
    """A damaged entry (not merely absent) is worth a line: it is rebuilt, never loaded."""
    if why != "absent":
        warnings.warn(f"precast cache entry {entry}: {why}; rebuilding it", stacklevel=3)


def remove_entry(entry: Path, root: Path) -> None:
    """Move ``entry`` out of ``aoti/`` in one rename (no reader sees it half-deleted), then delete it."""
    trash = Path(tempfile.mkdtemp(prefix="trash.", dir=root / "tmp"))
    os.rename(entry, trash / "entry")
    shutil.rmtree(trash, ignore_errors=True)


def write_durable(path: Path, text: str) -> None:
    """Write ``text`` and fsync it (a manifest must be on disk before the entry is published)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
