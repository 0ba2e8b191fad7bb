"""The AOTInductor package cache: keys, crash-safe entries, integrity checks.

Input: a program and compile options. Output: the cache key, and entries ``<cache>/aoti/<key>/{model.pt2,
manifest.json}`` built in ``<cache>/tmp/`` and renamed into place; a package is loaded only if its manifest's
sha256 matches (it is native code). See docs/compile.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError
from precast.io import CACHE_ENV, cache_root
from precast.ir.program import CONSTANT_KINDS, ConstantSource, constant_sources

MANIFEST = "manifest.json"


PACKAGE = "model.pt2"


COMPILE_LOG = "compile.log"  # one JSON line per compile actually run (tests count them)


FORMAT = 1


@dataclass(frozen=True)
class _Stored:
    """What load_weights needs to know about one stored constant (no tensor kept)."""

    source: ConstantSource
    shape: tuple[int, ...]
    device: str
    read: bool = True  # False: the graph never reads it (AOTInductor drops it; nothing to swap)
    persistent: bool = True  # in the model's state_dict(); False: a non-persistent buffer or lifted constant


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The argument, else ``$PRECAST_CACHE_DIR``, else the platform's user cache dir for precast."""
    root = cache_root(cache_dir)
    try:
        (root / "aoti").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrecastError(
            f"cache dir {root}: cannot create it ({exc.strerror}); pass cache_dir= or set {CACHE_ENV}"
        ) from exc
    return root


# ---- cache key --------------------------------------------------------------------------------------------
def cache_key(ep: ExportedProgram, inductor_configs: Mapping[str, Any], dynamic: bool) -> str:
    """sha256 of everything the compiled code depends on."""
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
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            put("tensor", f"{name}:{t.dtype}:{tuple(t.shape)}")
            # reshape(-1): a 0-d tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes directly
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            put("object", f"{name}:{type(value).__qualname__}")
    put("configs", json.dumps(dict(inductor_configs), sort_keys=True, default=str))
    put("dynamic", str(dynamic))
    put("torch", torch.__version__)
    put("cpu", str(torch.backends.cpu.get_cpu_capability()))
    if _program_device(ep) == "cuda" and torch.cuda.is_available():
        put("cuda", f"{torch.version.cuda}:{torch.cuda.get_device_capability()}")
    return h.hexdigest()[:32]


def _program_device(ep: ExportedProgram) -> str:
    for value in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for node in ep.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            return node.meta["val"].device.type
    return "cpu"


def _stored_constants(ep: ExportedProgram) -> dict[str, _Stored]:
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
            out[spec.target] = _Stored(
                sources[spec.target],
                tuple(value.shape),
                str(value.device),
                read=spec.arg.name in read,
                persistent=persistent,
            )
    return out


# ---- cache entries ------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _valid_entry(entry: Path, key: str) -> str | None:
    """None if ``entry`` is a complete, untampered entry for ``key``; else why not."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        return "absent"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("format") != FORMAT or manifest.get("key") != key:
        return "manifest for another key or format"
    files = manifest.get("files") or {}
    if PACKAGE not in files:
        return f"manifest lists no {PACKAGE}"
    for name, digest in files.items():
        try:
            if _sha256(entry / name) != digest:
                return f"{name} does not match its manifest hash"
        except OSError:
            return f"{name} is missing"
    return None


def _remove(entry: Path, root: Path) -> None:
    trash = Path(tempfile.mkdtemp(prefix="trash.", dir=root / "tmp"))
    os.rename(entry, trash / "entry")
    shutil.rmtree(trash, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
