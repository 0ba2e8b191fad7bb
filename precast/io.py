"""File output that never leaves a partial file behind: write to a temporary file, then rename.

Input: a destination path. Output: a temporary path to write, renamed into place on success.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from precast.errors import PrecastError


def check_writable(path: str | Path) -> Path:
    """Fail early, before any long work, if ``path`` cannot be written."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise PrecastError(f"{p}: is a directory; give a file name such as {p / 'model.pt2'}")
    if not parent.exists():
        raise PrecastError(f"{p}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise PrecastError(f"{p}: directory {parent} is not writable; choose another output path")
    return p


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; renamed onto ``path`` only if the block succeeds."""
    p = check_writable(path)
    # keep the real suffix last: torch.export.save warns about a file not ending in .pt2
    fd, tmp = tempfile.mkstemp(
        prefix=f".{p.stem}.tmp-", suffix=p.suffix, dir=p.parent if str(p.parent) else "."
    )
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes the file 0600; an output file gets the permissions the user's umask gives new files
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


CACHE_ENV = "PRECAST_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """precast's cache folder (AOTInductor packages, op latencies): the argument, else ``$PRECAST_CACHE_DIR``,
    else the platform's user cache dir for precast. Not created here."""
    root = cache_dir or os.environ.get(CACHE_ENV) or None
    if root is None:
        from platformdirs import user_cache_dir

        root = user_cache_dir("precast")
    return Path(root).expanduser()
