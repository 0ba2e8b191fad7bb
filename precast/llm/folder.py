"""The folder ``precast export-llm`` writes, as a format: its manifest, the files it names, its program (``precast.load``
opens it: ``precast.llm.loaded``).

Format (``export.json``: ``"format": "precast-llm-export"``, ``"version"``; docs/llm_export.md "Folder format"):
version 2 holds the converted program's graph (``program.pt2``), each weight once, the tokenizer, the plan and report,
and per engine the artifact that runs: OpenVINO IR in the form precast compiled it (``model.xml`` + ``model.bin``,
whose constants are the program's weights: ``folder_weights``; the compile's record under ``"openvino"``) and an
AOTInductor cache entry without weights (``aoti/``, its form under ``"aoti"``). Version 1 folders (program with its
weights, IR as converted) are read: their engines are built from the program, said in ``notes``. A newer version is
refused in one line.

What is valid where: an OpenVINO form holds for the OpenVINO version and the CPU capabilities it was made for
(``backends/openvino/saved.stale_reason``); an AOTInductor entry for the torch, compiler and CPU its key names. What
is not valid here is rebuilt from the program (OpenVINO: converted again, in memory; AOTInductor: compiled into the
user's cache, never into the folder), and ``notes`` says which and why. The folder itself is only read.

Input: a folder path. Output: a ``Folder`` (its manifest, files, stop tokens), its program.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from precast.errors import PrecastError
from precast.io import loads_bounded

MANIFEST = "export.json"
FORMAT = "precast-llm-export"
VERSION = 2  # this precast writes; it reads 1 and 2
PROGRAM = "program.pt2"
TOKENIZER = "tokenizer.json"
PLAN = "plan.json"
REPORT = "report.json"
OPENVINO = "model.xml"
AOTI = "aoti"  # an AOTInductor cache root: aoti/<key>/ (model.pt2 + manifest.json)
AOTI_V1 = "model.aoti.pt2"  # version 1: a self-contained package
MANIFEST_LIMIT = 1 << 22  # export.json is tens of KiB (the weight index); a larger one is not ours
# the engines of precast.backends.registry whose artifact a folder holds (written by folder_engines, preferred in
# this order), and what precast.load(DIR) can run: those, or the program eagerly
HELD = ("openvino", "aoti")
BACKENDS = (*HELD, "eager")


def read_manifest(folder: Path) -> dict[str, Any]:
    """A folder's ``export.json`` (``{}`` when there is none); one line when it is not ours or is newer."""
    path = folder / MANIFEST
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > MANIFEST_LIMIT:
            raise ValueError("too large")
        data = loads_bounded(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise PrecastError(f"{path}: not an export-llm manifest ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PrecastError(f'{path}: not an export-llm manifest (no "format": "{FORMAT}")')
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION or version < 1:
        raise PrecastError(
            f"{path}: folder format version {version!r}; this precast reads versions 1 to {VERSION}: "
            "upgrade precast (pip install -U precast), or export the folder again"
        )
    return data


@dataclasses.dataclass
class Folder:
    """An export-llm folder, read: its manifest and the files it names, checked to be names in the folder."""

    path: Path
    manifest: dict[str, Any]
    program: Path
    tokenizer: Path | None
    stop_tokens: list[int]

    @property
    def version(self) -> int:
        return int(self.manifest.get("version", 1))

    def file(self, key: str) -> Path | None:
        """The folder's file the manifest names under ``files[key]`` (None when it names none or it is absent)."""
        name = (self.manifest.get("files") or {}).get(key)
        if not isinstance(name, str):
            return None
        _check_name(self.path, name)
        return self.path / name if (self.path / name).exists() else None


def _check_name(folder: Path, name: str) -> None:
    if Path(name).name != name or name in ("", ".", ".."):
        raise PrecastError(f"{folder / MANIFEST}: file {name!r} is not a name in the folder")


def open_folder(path: str | Path) -> Folder:
    """The folder at ``path`` read: its manifest, program, tokenizer and stop tokens; one line when it is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise PrecastError(f"{folder}: not a folder; give the folder precast export-llm wrote")
    manifest = read_manifest(folder)
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    names = {
        k: str(files.get(k) or default) for k, default in (("program", PROGRAM), ("tokenizer", TOKENIZER))
    }
    for name in names.values():
        _check_name(folder, name)
    program = folder / names["program"]
    if not program.is_file():
        raise PrecastError(
            f"{folder}: no {program.name} in it; give a folder precast export-llm wrote, or a program .pt2"
        )
    tokenizer = folder / names["tokenizer"]
    stops = manifest.get("stop_tokens") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise PrecastError(f"{folder / MANIFEST}: stop_tokens must be a list of token ids")
    return Folder(folder, manifest, program, tokenizer if tokenizer.is_file() else None, stops)


def folder_tensors(folder: Folder) -> dict[str, Any] | None:
    """The program's tensors by stored name, from where the folder holds them (``folder_weights``: the IR's
    ``.bin``, zeros, ``weights.bin``); None for a folder whose program holds its own weights."""
    index = folder.manifest.get("weight_index")
    if not isinstance(index, dict):
        return None
    from precast.llm.folder_weights import indexed_tensors

    ir = Path(str((folder.manifest.get("files") or {}).get("openvino") or OPENVINO))
    _check_name(folder.path, ir.name)
    return indexed_tensors(folder.path, index, ir.with_suffix(".bin").name)


def folder_program(folder: Folder, *, weights: bool = True, trust_pickle: bool = False) -> Any:
    """The folder's converted program; ``weights``: with its tensors (read from where the folder holds them)."""
    from precast.pipeline.load import load_program

    program = load_program(folder.program, trust_pickle=trust_pickle)
    if not weights or not isinstance(folder.manifest.get("weight_index"), dict):
        return program
    from precast.llm.folder_weights import filled_program

    return filled_program(program, folder_tensors(folder) or {}, folder.path)


def read_tokenizer(path: str | Path, who: str, *, required: bool = True) -> Any:
    """A ``tokenizer.json`` (the ``tokenizers`` library), one line when it is not one; ``who`` names it in the
    line (``--tokenizer``). Without the package: one line, or None when not ``required``."""
    from precast.errors import first_line
    from precast.paths import check_input_file

    check_input_file(path, "give a tokenizer.json", who)  # a FIFO or device: refused unopened
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if not required:
            return None
        raise PrecastError(f"{who} needs the tokenizers package: pip install 'precast[llm]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises its own exception type for a malformed file
        raise PrecastError(f"{who} {path}: not a tokenizer.json ({first_line(exc)[:200]})") from exc
