"""The engines of an LLM folder (``precast.llm.folder``): written once by export-llm, opened by ``precast.load``.

- ``write_openvino``: the program compiled for OpenVINO, its compiled form saved as IR with the compile's record
  (``backends/openvino/saved``).
- ``write_aoti``: the program compiled by ``precast.compile`` (its form measured in the user's cache as usual),
  the published cache entry (a package without weights, and its manifest of hashes) copied into ``aoti/``, with
  what opening it without the program needs (``backends/aoti/opened``).
- ``write_weights``: the program's tensors indexed inside the IR's ``.bin``, the rest in ``weights.bin``
  (``folder_weights``): the program itself is then saved without weights.
- ``load_engine``: the folder's artifact for an engine, opened as it is where it is valid, rebuilt from the
  program where it is not (never into the folder), with one note each.

An AOTInductor package is native code: it is loaded from a folder only when you own it and no one else can write
it (as precast's own cache, ``io.private_dir``'s rule); otherwise the program is compiled into your cache.

Input: a stage folder and a converted program; a ``Folder``. Output: files and records; a model and notes.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precast.backends.aoti.package_cache import PACKAGE
from precast.llm.folder import AOTI, AOTI_V1, OPENVINO, Folder, folder_program, folder_tensors


def write_openvino(stage: Path, program: Any, threads: int | None) -> dict[str, Any]:
    """``model.xml`` + ``model.bin``: the program's compiled form; returns the compile's record."""
    import precast
    from precast.backends.openvino.saved import save_form

    model = precast.compile(program, backend="openvino", threads=threads)
    record = save_form(model, stage / OPENVINO)
    record["threads"] = model.threads
    return record


def write_aoti(stage: Path, program: Any, threads: int | None) -> dict[str, Any]:
    """``aoti/`` (a cache root holding the compile's entry, no weights in it); returns what opening it needs
    (``backends/aoti/opened.entry_record``)."""
    import precast
    from precast.backends.aoti.opened import entry_record
    from precast.backends.aoti.package_cache import toolchain

    tools = toolchain()  # as the compile's key reads it, before the compile
    model = precast.compile(program, threads=threads)
    entry = Path(model.package_path).parent
    root = stage / AOTI
    for sub in ("aoti", "tmp", "locks"):
        (root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copytree(entry, root / "aoti" / entry.name)
    return entry_record(model, program, tools)


def write_weights(stage: Path, program: Any, with_ir: bool) -> tuple[dict[str, Any], str | None]:
    """The program's tensors indexed in ``model.bin`` (``with_ir``) and the rest written raw into ``REST``
    (``folder_weights``); returns the index and the file written (None when the IR holds everything)."""
    from precast.io import write_bytes
    from precast.llm.folder_weights import REST, index_weights

    index, rest = index_weights(program, stage / OPENVINO if with_ir else None)
    if not rest:
        return index, None
    write_bytes(stage / REST, rest)
    return index, REST


def default_backend(folder: Folder) -> str:
    """OpenVINO where the folder holds IR and OpenVINO is installed, else AOTInductor."""
    import importlib.util

    if folder.file("openvino") is not None and importlib.util.find_spec("openvino") is not None:
        return "openvino"
    return "aoti"


def load_engine(
    folder: Folder,
    backend: str,
    threads: int | None,
    cache_dir: Any,
    trust_pickle: bool,
    notify: Callable[[str], None] | None = None,
) -> tuple[Any, list[str], int | None]:
    """(the model, the notes, the thread count it runs at) for ``backend``. ``notify(line)``: told before a rebuild
    of seconds to minutes starts, and why (``precast generate`` prints it at once; the notes come after)."""
    from precast.runtime.threads import resolve_threads

    threads = resolve_threads(threads)
    tell = notify or (lambda line: None)
    if backend == "openvino":
        return (*_openvino(folder, threads, trust_pickle, tell), threads)
    if backend == "eager":
        program = folder_program(folder, trust_pickle=trust_pickle)
        return program, [f"{folder.program.name}: run in torch (eager)"], None
    return (*_aoti(folder, threads, cache_dir, trust_pickle, tell), threads)


def _openvino(
    folder: Folder, threads: int, trust_pickle: bool, tell: Callable[[str], None]
) -> tuple[Any, list[str]]:
    import precast
    from precast.backends.openvino.convert import require_openvino
    from precast.backends.openvino.saved import open_form, stale_reason

    ov = require_openvino()
    xml, record = folder.file("openvino"), folder.manifest.get("openvino")
    why = "the folder holds no OpenVINO IR" if xml is None else ""
    if not why and not isinstance(record, dict):
        why = f"{xml.name} is format {folder.version}'s IR as converted, not a compiled form"
    why = why or stale_reason(record, ov.Core())
    if not why:
        model = open_form(xml, record, threads=threads)
        return model, [f"{xml.name}: OpenVINO's compiled form opened ({model.compile_seconds:.1f} s)"]
    tell(f"OpenVINO: {why}; converting {folder.program.name} again for this machine (tens of seconds)")
    started = time.perf_counter()
    model = precast.compile(
        folder_program(folder, trust_pickle=trust_pickle), backend="openvino", threads=threads
    )
    took = time.perf_counter() - started
    return model, [f"OpenVINO: {why}; converted {folder.program.name} again for this machine ({took:.0f} s)"]


def _aoti(
    folder: Folder, threads: int, cache_dir: Any, trust_pickle: bool, tell: Callable[[str], None]
) -> tuple[Any, list[str]]:
    """The folder's package opened with the folder's weights, no program read (``backends/aoti/opened``); else
    the program compiled into the user's cache in the folder's form."""
    import precast
    from precast.backends.aoti.forms import FORM_CONFIGS

    record = folder.manifest.get("aoti")
    why = _aoti_unusable(folder, record, folder.path / AOTI)
    if not why:
        opened = _open_package(folder, record, threads)
        if not isinstance(opened, str):
            return opened, [f"{AOTI}/: AOTInductor package opened ({opened.load_seconds:.1f} s)"]
        why = opened
    form = record.get("form") if isinstance(record, dict) else None
    options: dict[str, Any] = {}
    if form in FORM_CONFIGS:  # the folder's form, not a new measurement at this thread count
        options = {"mode": "default", "inductor_configs": dict(FORM_CONFIGS[form])}
    tell(
        f"AOTInductor: {why}; {folder.program.name} at {threads} thread(s) from your cache, compiled into it first "
        "if this machine and thread count have none (minutes; seconds once cached)"
    )
    started = time.perf_counter()
    program = folder_program(folder, trust_pickle=trust_pickle)
    model = precast.compile(program, cache_dir=cache_dir, threads=threads, **options)
    took = time.perf_counter() - started
    cached = "loaded from your cache" if model.from_cache else "compiled into your cache"
    return model, [f"AOTInductor: {why}; {folder.program.name} {cached} ({took:.0f} s)"]


def _open_package(folder: Folder, record: dict[str, Any], threads: int) -> Any:
    """The ``CompiledModel`` of the folder's entry, or why not (a string), checked before any weight is read."""
    from precast.backends.aoti.opened import mismatch, open_entry

    why = mismatch(record, threads)
    tensors = None if why else folder_tensors(folder)
    if tensors is None:
        return why or "the folder's weights are in its program only"
    return open_entry(folder.path / AOTI, record, tensors, threads)


def _aoti_unusable(folder: Folder, record: Any, root: Path) -> str:
    """Why the folder's AOTInductor entry cannot be loaded here ("" when it can be tried)."""
    if (folder.path / AOTI_V1).is_file() and not isinstance(record, dict):
        return (
            f"{AOTI_V1} is format 1's self-contained package (not read: its weights would be a second copy)"
        )
    if not isinstance(record, dict) or not root.is_dir():
        return "the folder holds no AOTInductor package"
    entry = root / "aoti" / str(record.get("key", ""))
    for path in (folder.path, root, root / "aoti", entry, entry / PACKAGE):
        if not path.exists():
            continue
        st = path.stat()
        if hasattr(os, "getuid") and st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{root} holds native code in a folder you do not own or others can write ({path.name})"
    return ""
