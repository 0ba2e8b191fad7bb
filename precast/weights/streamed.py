"""Streamed weights, the write side: after a conversion decided on the graph alone (``precast.weights.files``), read
each original weight from its file, cast it as ``fold_constant_casts`` would have (``cast_constant``: the same
rounding, fp16's range clamped), and write it straight into the output shard, one tensor in memory at a time.

Output: one shard per input shard, named as the input's, plus transformers' ``model.safetensors.index.json``,
keyed by the converted program's stored names (a cast weight keeps its original name when its fp32 copy is no
longer read). safetensors has no incremental writer, so the file is written here to its published layout: an
8-byte little-endian header length, the JSON header (offsets known up front from the program's metadata), then
each tensor's bytes in header order; the result is read back by ``safetensors`` in the tests. The folder is
written beside the target under a temporary name and renamed into place: never a partial output, never the
input folder.

``stand_in`` and ``with_weights`` (the program made runnable without or with its streamed values) are
``precast.weights.filled``.

Input: the converted ExportedProgram, the ``WeightFiles`` it was converted from, the output folder. Output: the
report's ``weights`` record (files, bytes read and written, values clamped).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError
from precast.io import safetensors_header
from precast.ir.program import constant_sources
from precast.passes.fold import cast_constant
from precast.progress import ProgressBar
from precast.quant.formats import quantized_part
from precast.weights.files import INDEX, WeightFiles, streamed_targets, tensor_bytes


class _Streamed(NamedTuple):
    """One value-less constant to write: its stored name, the original weight it comes from, its stored dtype and
    shape, and ``derive`` (the part of a weight stored in 8/4 bits, ``ConstantSource.derive``; else None)."""

    stored: str
    original: str
    dtype: torch.dtype
    shape: tuple
    derive: str | None


def _tensors_by_shard(ep: ExportedProgram, files: WeightFiles) -> dict[Path, list[_Streamed]]:
    """input shard -> the value-less constants of ``ep`` whose original weights it holds."""
    sources = constant_sources(ep)
    values = {**ep.state_dict, **ep.constants}
    by_shard: dict[Path, list[_Streamed]] = {}
    for stored in streamed_targets(ep):
        src = sources.get(stored)
        original = src.original if src is not None else stored
        if original not in files:
            raise PrecastError(
                f"internal: {stored} holds no value and its source {original} is not in the weight files"
            )
        v = values[stored]
        derive = src.derive if src is not None else None  # a quantized weight's part (weight_format=)
        by_shard.setdefault(files.file_of(original), []).append(
            _Streamed(stored, original, v.dtype, tuple(v.shape), derive)
        )
    return by_shard


def resolved(path: str | os.PathLike) -> Path:
    """``path`` as the kernel will reach it: absolute, every symlink followed, each ``..`` applied after the
    component before it (``new/../in`` is ``in`` even while ``new`` does not exist yet; ``link/..`` is the link
    target's parent)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def protected(files: WeightFiles | str | os.PathLike) -> list[Path]:
    """The paths a conversion must never write: the input folder (or file) and, resolved, every file it reads
    (a shard may be a symlink into another folder, as in Hugging Face's cache)."""
    if isinstance(files, WeightFiles):
        return sorted({resolved(files.path), *(resolved(f) for f in files.where.values())})
    return [resolved(files)]


def overlaps(out: Path, inputs: list[Path]) -> Path | None:
    """The first of ``inputs`` that writing or replacing the folder ``out`` would touch: ``out`` is it, lies
    inside it, or holds it (all three resolved)."""
    if out in inputs:
        return out
    for p in inputs:
        if p in out.parents or out in p.parents:
            return p
    return None


def check_weights_out(source: WeightFiles | str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """The output folder, resolved (``resolved``), refused (one line) where writing it would touch the input
    weights (``protected``) or a folder that is not precast's own."""
    out = resolved(out_dir)
    hit = overlaps(out, protected(source))
    if hit is not None:
        src = source.path if isinstance(source, WeightFiles) else Path(source)
        how = "is" if out == hit else "lies inside" if hit in out.parents else "holds"
        plain = (
            out == resolved(src) == Path(os.path.abspath(out_dir))
        )  # spelled as what it is: nothing to add
        detail = "" if plain else f" (it resolves to {out}, which {how} {hit})"
        raise PrecastError(
            f"weights output {out_dir}: it would overwrite the input weights {src}{detail}; choose another folder"
        )
    if out.exists() and not _ours(out):
        raise PrecastError(
            f"weights output {out}: exists and is not a folder of weights precast wrote; choose a new folder"
        )
    return out


def check_file_outside(output: str | os.PathLike, files: WeightFiles, flag: str = "-o") -> None:
    """An output file (the CLI's ``-o``) refused (one line) where it would write a file of the input weights or
    anything inside their folder, whatever the spelling (``resolved``)."""
    out = resolved(output)
    hit = overlaps(out, protected(files))
    if hit is not None:
        raise PrecastError(
            f"{flag} {output}: resolves to {out}, {'a file of' if out == hit else 'inside'} the input weights "
            f"{files.path}; write the output elsewhere (the input weights are never written)"
        )


def write_weights(
    ep: ExportedProgram, files: WeightFiles, out_dir: str | os.PathLike, progress: bool | None = None
) -> dict:
    """Write the weights ``ep`` holds no values for into ``out_dir`` (see the module docstring)."""
    out = check_weights_out(files, out_dir)
    by_shard = _tensors_by_shard(ep, files)
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale(out.parent)  # what a conversion killed outright (SIGKILL, power loss) left here
    with _work_folder(out.parent, out.name) as tmp:
        record = _write(files, by_shard, tmp, out, out_dir, progress)
    record["stale_removed"] = stale
    return record


@dataclass
class _Written:
    """What the shards written so far hold: the report's record (counts and bytes), the values clamped per
    tensor, and the index's map (stored name -> shard)."""

    record: dict[str, Any]
    clamped: dict[str, int] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)


def _write(
    files: WeightFiles,
    by_shard: dict[Path, list[_Streamed]],
    tmp: Path,
    out: Path,
    out_dir: str | os.PathLike,
    progress: bool | None,
) -> dict:
    """The shards and the index written into ``tmp``, then renamed to ``out``."""
    written = _Written(
        {
            "source": str(files.path.absolute()),
            "output": str(out),
            "files": 0,
            "tensors": 0,
            "bytes_read": 0,
            "bytes_written": 0,
        }
    )
    record = written.record
    start = time.perf_counter()
    total = sum(len(v) for v in by_shard.values())
    with ProgressBar(f"writing weights to {out.name}", total, progress) as bar:
        for shard, entries in sorted(by_shard.items()):
            entries.sort()
            name = shard.name if shard.suffix == ".safetensors" else "model.safetensors"
            _write_shard(files, entries, tmp / name, str(out / name), written, bar)
            record["files"] += 1
        index = {
            "metadata": {"total_size": record["bytes_written"], "written_by": "precast"},
            "weight_map": dict(sorted(written.weight_map.items())),
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    _publish(files, tmp, out, out_dir)
    record["tensors"] = len(written.weight_map)
    record["clamped"] = written.clamped
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _write_shard(
    files: WeightFiles, entries: list[_Streamed], path: Path, where: str, written: _Written, bar: ProgressBar
) -> None:
    """One output shard: the safetensors header, then each tensor read, cast and written in header order."""
    with open(path, "wb") as f:
        f.write(
            safetensors_header(
                [(e.stored, e.dtype, e.shape) for e in entries],
                {"format": "pt", "written_by": "precast"},
                where,
            )
        )
        for e in entries:
            low = _converted(files, e, written)
            f.write(tensor_bytes(low))
            written.record["bytes_written"] += low.numel() * low.element_size()
            written.weight_map[e.stored] = path.name
            bar.advance()
        f.flush()
        os.fsync(f.fileno())


def _converted(files: WeightFiles, e: _Streamed, written: _Written) -> torch.Tensor:
    """The stored value of ``e``: its original read and cast (fp16's range clamped, counted) or quantized."""
    value = files.read(e.original)
    written.record["bytes_read"] += value.numel() * value.element_size()
    if e.derive is not None:  # one part of a weight stored in 8/4 bits, from the original
        low, n = quantized_part(value, e.derive).to(e.dtype), 0
    else:
        low, n = cast_constant(value, e.dtype) if value.dtype != e.dtype else (value, 0)
    del value
    if n:
        written.clamped[e.stored] = n
    low = low.contiguous()
    if tuple(low.shape) != e.shape:
        raise PrecastError(f"internal: {e.stored} is {list(low.shape)}, the program says {list(e.shape)}")
    return low


def _publish(files: WeightFiles, tmp: Path, out: Path, out_dir: str | os.PathLike) -> None:
    """The written folder renamed into place, once the output is checked again (a link swapped meanwhile)."""
    # checked again just before the rename: a symlink swapped in meanwhile is refused, not followed
    if check_weights_out(files, out_dir) != out:
        raise PrecastError(
            f"weights output {out_dir}: now resolves to {resolved(out_dir)}, not {out} (a link changed while "
            "writing); nothing was written"
        )
    _replace_dir(tmp, out)


# the marker of a folder precast is writing (JSON: written_by, pid) and the lock its writer holds until done; a
# killed writer's lock is free (the kernel drops it with the process), which is how the next run knows
MARK = ".precast-writing"
LOCK = ".precast-writing.lock"
_WORK = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


@contextlib.contextmanager
def _work_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new folder ``.NAME.<hex>.tmp`` in ``parent`` holding ``MARK`` with ``LOCK`` held while the block runs;
    removed when the block fails. An ordinary folder (mode 0777 minus the umask), not mkdtemp's private one."""
    from filelock import FileLock

    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            os.mkdir(tmp, 0o777)
            break
        except FileExistsError:
            continue
    else:
        raise PrecastError(f"weights output {parent / name}: cannot create a temporary folder beside it")
    lock = FileLock(str(tmp / LOCK))
    try:
        lock.acquire(timeout=0)
        (tmp / MARK).write_text(json.dumps({"written_by": "precast", "pid": os.getpid()}))
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()


def remove_stale(parent: Path) -> list[str]:
    """Remove the work folders in ``parent`` that a killed conversion left: named ``.NAME.<hex>.tmp``, owned by
    this user, holding precast's ``MARK`` (or nothing yet but the marker and its lock), and whose ``LOCK`` is
    free (no process writes there any more). A folder another conversion is writing keeps its lock and stays.
    Returns the names removed."""
    from filelock import FileLock, Timeout

    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed  # not listable: nothing of ours can be found there
    for entry in entries:
        if not _WORK.fullmatch(entry.name) or not _is_our_work(entry):
            continue
        lock = FileLock(str(entry / LOCK))
        try:
            lock.acquire(timeout=0)
        except (Timeout, OSError):
            continue  # held (a live writer) or gone (another run removed it first): not ours to touch
        try:
            shutil.rmtree(entry)
        finally:
            lock.release()
        removed.append(entry.name)
    return removed


def _is_our_work(folder: Path) -> bool:
    """A real folder of this user's with precast's marker (or only the marker and lock being made)."""
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        names = {e.name for e in folder.iterdir()}
        if MARK not in names:
            return names <= {LOCK}
        return json.loads((folder / MARK).read_text()).get("written_by") == "precast"
    except (OSError, ValueError, AttributeError):
        return False


def _replace_dir(new: Path, out: Path) -> None:
    """``new`` renamed to ``out``; an existing ``out`` moved aside first (into a work folder of its own, which
    the next run removes should this one be killed) and removed after: never a mix. The marker and lock move
    with ``new`` and are removed from ``out`` once it is in place."""
    if out.exists():
        with _work_folder(out.parent, out.name) as old:
            os.replace(out, old / out.name)
            os.replace(new, out)
            shutil.rmtree(old)
    else:
        os.replace(new, out)
    for name in (MARK, LOCK):
        (out / name).unlink(missing_ok=True)


def _ours(folder: Path) -> bool:
    """An empty folder, or one precast wrote (its index says so, and it holds nothing but shards and the index)."""
    if not folder.is_dir():
        return False
    entries = list(folder.iterdir())
    if not entries:
        return True
    try:
        ours = json.loads((folder / INDEX).read_text())["metadata"]["written_by"] == "precast"
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return ours and all(
        e.is_file() and (e.suffix == ".safetensors" or e.name in (INDEX, MARK, LOCK)) for e in entries
    )
