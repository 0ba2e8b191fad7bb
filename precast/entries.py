"""A versioned JSON table of measured entries in the cache folder (the latency cache, the form cache): never
unpickled; a malformed file or entry is a miss with a warning (measured again, the file rewritten), never a crash;
written atomically under a file lock, merged with what another process wrote meanwhile.

Input: a path, what it is called, its version, an entry check. Output: the good entries; the file written.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from precast.errors import PrecastError, first_line
from precast.io import CACHE_ENV, atomic_path, file_lock, private_dir


def read_entries(
    path: Path, what: str, version: int, ok: Callable[[Any], bool], stacklevel: int = 3
) -> dict[str, Any]:
    """The entries of the versioned JSON table at ``path`` that pass ``ok``; a file that is not JSON, or JSON of
    another shape, is a miss with a warning naming ``what`` (measured again, the file rewritten), never a crash;
    another version is a silent miss."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        warnings.warn(
            f"{what} {path}: unreadable ({first_line(exc)}); measuring again", stacklevel=stacklevel
        )
        return {}
    if not isinstance(data, dict) or data.get("version") != version:
        return {}
    entries = data.get("entries")
    if not isinstance(entries, dict):
        warnings.warn(f"{what} {path}: malformed (no entries table); measuring again", stacklevel=stacklevel)
        return {}
    good = {k: e for k, e in entries.items() if ok(e)}
    if len(good) != len(entries):
        warnings.warn(
            f"{what} {path}: {len(entries) - len(good)} malformed entries ignored (measured again)",
            stacklevel=stacklevel,
        )
    return good


def write_entries(
    path: Path, what: str, version: int, ok: Callable[[Any], bool], new: dict[str, Any]
) -> None:
    """``new`` merged into the table at ``path`` (read again under its lock, so concurrent writers keep each
    other's entries), written atomically; a folder that cannot be written is one line."""
    try:
        private_dir(path.parent)
        with file_lock(str(path) + ".lock", f"the {what}"):
            entries = {**read_entries(path, what, version, ok), **new}
            with atomic_path(path) as tmp:
                Path(tmp).write_text(json.dumps({"version": version, "entries": entries}, indent=1))
    except OSError as exc:
        raise PrecastError(
            f"{what} {path}: cannot write it ({exc.strerror}); set {CACHE_ENV} to a writable directory"
        ) from exc
