"""Which paths a command may read and write: an output is never an input, an input is a regular file.

- ``same_file(a, b)``: one file, through symlinks and hard links (the inode where both exist).
- ``check_outputs({what: path}, inputs)``: before anything is written, no output is an input and no two outputs
  are one file (an IR's ``.bin`` beside its ``.xml`` and the files written into an output folder count).
- ``ir_files(xml)``: the two files an OpenVINO IR written to ``xml`` consists of.
- ``check_input_file(path, hint)``: a path a command reads is a regular file (not a FIFO that would hang the reader,
  not a device such as ``/dev/zero`` read without end), checked with stat before anything opens it.

Input: paths. Output: Paths; a one-line PrecastError naming the path and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from precast.errors import PrecastError


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True if ``a`` and ``b`` name one file (``os.path.samefile`` when both exist, else the resolved paths)."""
    pa, pb = Path(a), Path(b)
    with contextlib.suppress(OSError):
        return os.path.samefile(pa, pb)
    return pa.expanduser().resolve() == pb.expanduser().resolve()


PathArg = str | os.PathLike | None


def check_outputs(outputs: dict[str, PathArg], inputs: tuple[PathArg, ...] | list[PathArg]) -> None:
    """Before anything is written: no file a command writes is a file it reads, and no two outputs are one file.

    ``outputs`` maps what names each file (``"-o"``, ``"--write-plan"``, ``"the IR's weights (beside -o)"``) to
    the path; sibling files (an IR's ``.bin``) and the files written into an output folder (``--repro``) are
    listed too. "One file" is ``same_file``: the same inode where both exist (so a symlink or a hard link to an
    input counts), else the same resolved path. One ``PrecastError`` line naming both."""
    named = [(what, Path(p)) for what, p in outputs.items() if p is not None]
    for what, p in named:
        for source in inputs:
            if source is not None and same_file(p, source):
                said = "" if what == "the output" else f"{what} "
                raise PrecastError(f"{p}: {said}is also the input {source}; write the output to another file")
    for i, (what, p) in enumerate(named):
        for other, q in named[i + 1 :]:
            if same_file(p, q):
                raise PrecastError(f"{p}: {what} and {other} name the same file; give them different paths")


def ir_files(xml: str | os.PathLike) -> tuple[Path, Path]:
    """The two files of an OpenVINO IR written to ``xml``: the ``.xml`` itself and its weights beside it."""
    p = Path(xml)
    return p, p.with_suffix(".bin")


def check_input_file(path: str | os.PathLike, hint: str, option: str = "") -> Path:
    """``path`` as a Path when it names a regular file (through links), else one line: the ``option`` naming it,
    the path, what is there (nothing, a folder, a FIFO, a device) and ``hint``. Checked with stat, never opened:
    a FIFO would block the reader until a writer comes, ``/dev/zero`` be read until memory runs out."""
    p, what = Path(path), f"{option} " if option else ""
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        why = (
            "no such file"
            if exc.errno in (errno.ENOENT, errno.ENOTDIR)
            else f"cannot be read ({exc.strerror})"
        )
        raise PrecastError(f"{what}{p}: {why}; {hint}") from None
    if not stat.S_ISREG(mode):
        kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device"}
        kind = kinds.get(stat.S_IFMT(mode), "a block device or socket")
        raise PrecastError(f"{what}{p}: is {kind}, not a regular file (only regular files are read); {hint}")
    return p
