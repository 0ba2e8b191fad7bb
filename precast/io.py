"""Files precast writes and folders it keeps: nothing partial, never the input, private caches, bounded locks.

- ``check_writable(out, inputs=...)``: fail early (before long work) if ``out`` cannot be written or IS an input
  (``precast.paths``: which paths name one file, what a command may read).
- ``atomic_path(out)``: a temporary file beside ``out`` (created ``O_EXCL`` with mode 0666 minus the umask: the
  process umask is never changed), renamed into place only if the block succeeds, removed otherwise -- on an
  exception, Ctrl-C, or SIGTERM once the CLI turned it into an exception.
- ``write_bytes(out, data)``: the free space checked first, then written through Python (a full disk is an
  OSError here, not an abort inside a C++ stream writer's destructor).
- ``private_dir(path)``: a cache folder created 0700; one owned by another user or writable by group/others is
  refused (anyone who can write it can make precast load their native code).
- ``write_tensors(out, tensors, metadata)`` / ``read_tensors(path)``: named tensors in the safetensors format
  (written and read here with torch alone: no pickle, no extra dependency; the ``safetensors`` package reads it).
- ``program_bytes(program, output)``: an ExportedProgram serialized in memory (``torch.export.save``), to be written
  with ``write_bytes``; a failure of the save is one line naming ``output``.
- ``file_lock(path)``: an inter-process lock that says which lock it waits for after a few seconds and gives up
  after ``$PRECAST_LOCK_TIMEOUT`` seconds (default 600) with one line.

Input: destination paths, bytes. Output: files written whole or not at all; PrecastError on user error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import os
import re
import secrets
import shutil
import stat
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from precast.errors import PrecastError, first_line
from precast.paths import check_outputs
from precast.threads import TORCH_LOCK

CACHE_ENV = "PRECAST_CACHE_DIR"
LOCK_TIMEOUT_ENV = "PRECAST_LOCK_TIMEOUT"
LOCK_TIMEOUT_S = 600.0  # a compile takes ~30 s on a small CPU; ten minutes is a holder that is stuck
LOCK_NOTICE_S = 5.0  # say what we wait for after this long
SPACE_MARGIN = 16 << 20  # keep this much free beyond what a write needs


def check_writable(path: str | Path, inputs: tuple[str | os.PathLike | None, ...] = ()) -> Path:
    """Fail early, before any long work, if ``path`` cannot be written or is one of ``inputs``."""
    p = Path(path)
    check_outputs({"the output": p}, inputs)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise PrecastError(f"{p}: is a directory; give a file name such as {p / 'model.pt2'}")
    if not parent.exists():
        raise PrecastError(f"{p}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise PrecastError(f"{p}: directory {parent} is not writable; choose another output path")
    try:  # a real probe: a read-only file system or a pseudo-fs (/proc) passes os.access for root
        _create_temp(p).unlink()
    except OSError as exc:
        raise PrecastError(
            f"{p}: cannot write in {parent} ({exc.strerror}); choose another output path"
        ) from exc
    return p


def _create_temp(p: Path) -> Path:
    """A new empty file beside ``p``; mode 0666 minus the umask (the kernel applies it: no umask read)."""
    folder = p.parent if str(p.parent) else Path(".")
    for _ in range(100):
        # keep the real suffix last: torch.export.save warns about a file not ending in .pt2
        tmp = folder / f".{p.stem}.tmp-{secrets.token_hex(6)}{p.suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise PrecastError(f"{p}: cannot create a temporary file beside it")


@contextlib.contextmanager
def atomic_path(path: str | Path, inputs: tuple[str | os.PathLike | None, ...] = ()) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; renamed onto ``path`` only if the block succeeds."""
    p = check_writable(path, inputs)
    try:
        tmp_path = _create_temp(p)
    except OSError as exc:
        raise PrecastError(f"{p}: cannot write there ({exc.strerror})") from exc
    try:
        yield tmp_path
        os.replace(tmp_path, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def check_space(folder: str | Path, need: int, what: str) -> None:
    """PrecastError if ``folder``'s file system has less than ``need`` bytes (plus a margin) free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # a file system that cannot say: the write itself reports a full disk
    if free < need + SPACE_MARGIN:
        raise PrecastError(
            f"{what}: {free / 2**20:.0f} MiB free in {folder}, {(need + SPACE_MARGIN) / 2**20:.0f} MiB needed; "
            "free some space or write elsewhere"
        )


def write_bytes(
    path: str | Path, data: bytes | memoryview, inputs: tuple[str | os.PathLike | None, ...] = ()
) -> None:
    """Write ``data`` to ``path`` whole or not at all, after checking the free space; one-line errors."""
    p = check_writable(path, inputs)
    folder = p.parent if str(p.parent) else Path(".")
    check_space(folder, len(data), str(p))
    try:
        if not _write_unnamed(folder, p, data):
            with atomic_path(p, inputs) as tmp, open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:
        full = " (disk full)" if exc.errno == errno.ENOSPC else ""
        raise PrecastError(f"{p}: could not write it: {exc.strerror}{full}; nothing was written") from exc


def _write_unnamed(folder: Path, p: Path, data: bytes | memoryview) -> bool:
    """Linux: write into an unnamed file (``O_TMPFILE``), give it a name only once complete, rename it into
    place. Even ``kill -9`` mid-write leaves nothing behind. False where the file system cannot (the caller
    falls back to ``atomic_path``)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not Path("/proc/self/fd").is_dir():
        return False
    try:
        fd = os.open(folder, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return False
        raise
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        for _ in range(100):
            tmp = folder / f".{p.stem}.tmp-{secrets.token_hex(6)}{p.suffix}"
            # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N: Python calls plain link() (which would link the
            # /proc symlink itself) unless a dir fd is given
            proc = os.open("/proc", os.O_RDONLY)
            try:
                os.link(f"self/fd/{fd}", tmp, src_dir_fd=proc, follow_symlinks=True)
            except FileExistsError:
                continue
            finally:
                os.close(proc)
            try:
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise
            return True
        raise PrecastError(f"{p}: cannot name a temporary file beside it")
    finally:
        os.close(fd)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """precast's cache folder (AOTInductor packages, op latencies): the argument, else ``$PRECAST_CACHE_DIR``,
    else the platform's user cache dir for precast. Not created here (``private_dir`` does)."""
    root = cache_dir or os.environ.get(CACHE_ENV) or None
    if root is None:
        from platformdirs import user_cache_dir

        root = user_cache_dir("precast")
    return Path(root).expanduser()


def private_dir(path: str | Path) -> Path:
    """``path`` created 0700 if absent; refused (one line) if another user owns it or group/others may write it.

    Entries in precast's cache are native code and measurements it trusts: whoever can write the folder could
    replace a package and its manifest hash together. An existing folder is never chmod-ed behind the user's back.
    """
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = p.stat()
    except OSError as exc:
        raise PrecastError(
            f"cache dir {p}: cannot create it ({exc.strerror}); pass cache_dir= or set {CACHE_ENV}"
        ) from exc
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PrecastError(
            f"cache dir {p}: owned by uid {st.st_uid}, not you; precast loads native code from its cache, "
            f"so use a folder you own (set {CACHE_ENV})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PrecastError(
            f"cache dir {p}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); precast loads native "
            f"code from its cache: run 'chmod go-w {p}' or set {CACHE_ENV} to a private folder"
        )
    return p


def lock_timeout() -> float:
    """``$PRECAST_LOCK_TIMEOUT`` seconds (default 600); a bad value is a one-line error."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None:
        return LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise PrecastError(f"{LOCK_TIMEOUT_ENV}={raw}: expected a positive number of seconds")
    return value


@contextlib.contextmanager
def file_lock(path: str | Path, what: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the inter-process lock ``path`` (for ``what``). After ``LOCK_NOTICE_S`` a line on stderr names the
    lock; after ``timeout`` (default ``lock_timeout()``) a one-line PrecastError says how to clear a stuck one."""
    from filelock import FileLock, Timeout

    limit = lock_timeout() if timeout is None else timeout
    lock = FileLock(str(path))
    started = time.monotonic()
    try:
        lock.acquire(timeout=min(LOCK_NOTICE_S, limit))
    except Timeout:
        print(
            f"precast: waiting for {path} ({what}; another process holds it), up to {limit:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        try:
            lock.acquire(timeout=max(0.0, limit - (time.monotonic() - started)))
        except Timeout:
            raise PrecastError(
                f"{path}: still locked after {limit:.0f} s ({what}); if no precast process is running, delete "
                f"the lock file, or raise {LOCK_TIMEOUT_ENV}"
            ) from None
    try:
        yield
    finally:
        lock.release()


MAX_DEPTH = 32  # nesting of a JSON text precast reads (a file, a header, a pytree spec): its own nest <= 6


def too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether ``text``'s JSON brackets nest deeper than ``limit`` (strings skipped): checked before
    ``json.loads``, whose recursion a deeply nested file would exhaust (RecursionError)."""
    depth = 0
    for m in _BRACKETS.finditer(_JSON_STRINGS.sub('""', text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return True
    return False


_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def loads_bounded(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """``json.loads`` of untrusted text, its nesting first checked against ``limit`` (ValueError beyond)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8")
    if too_deep(text, limit):
        raise ValueError(f"JSON nested more than {limit} deep (precast's own files nest a few levels)")
    return json.loads(text)


# the safetensors format: an 8-byte little-endian header size, a JSON header (name -> dtype, shape, byte offsets
# into the data; "__metadata__": str -> str), then the tensors' bytes, little-endian, back to back
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HEADER_LIMIT = 100 << 20  # the format's own bound on the header


DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def safetensors_header(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str], what: str
) -> bytes:
    """The size and JSON header of a safetensors file whose tensors (name, dtype, shape) follow in this order:
    written before the data, so a file can be streamed tensor by tensor."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPE_CODES:
            raise PrecastError(f"{what}: tensor {name} is {dtype}, which the safetensors format cannot hold")
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[name] = {
            "dtype": DTYPE_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(head)) + head


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` (CPU copies are taken) and string ``metadata`` as one safetensors file, whole or not at all."""
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    head = safetensors_header([(n, t.dtype, tuple(t.shape)) for n, t in flat.items()], metadata, str(path))
    chunks = [
        ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        for t in flat.values()
    ]
    write_bytes(path, head + b"".join(chunks))


def read_tensors(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a file that is not one whole is one PrecastError (``what``)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PrecastError(f"{what} {path}: cannot read it ({exc.strerror})") from exc
    bad = f"{what} {path}: not a complete safetensors file"
    try:
        (size,) = struct.unpack("<Q", data[:8])
        if size > min(HEADER_LIMIT, len(data) - 8):
            raise ValueError("header size")
        header = loads_bounded(data[8 : 8 + size])  # nesting bounded before json recurses
        metadata = header.pop("__metadata__", {}) or {}
        body, out, end = memoryview(data)[8 + size :], {}, 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype, shape, (b, e) = SAFETENSORS_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape):
                raise ValueError(f"shape of {name} is not a list of non-negative integers")
            if not all(type(x) is int and x >= 0 for x in (b, e)):
                raise ValueError(f"offsets of {name}")
            count = 1
            for d in shape:
                count *= int(d)
            if b != end or e - b != count * torch.empty((), dtype=dtype).element_size() or e > len(body):
                raise ValueError(f"offsets of {name}")
            end = e
            flat = (
                torch.frombuffer(bytearray(body[b:e]), dtype=dtype) if e > b else torch.empty(0, dtype=dtype)
            )
            out[name] = flat.reshape(shape)
        if end != len(body) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("trailing bytes")
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise PrecastError(f"{bad} ({exc}); write it again") from exc
    return out, metadata


def program_bytes(program: torch.export.ExportedProgram, output: str) -> memoryview:
    """The converted program serialized in memory, to be written through Python (a full disk is one line, not an
    abort); a failure of ``torch.export.save`` is one line naming ``output``. A view of the buffer, not a copy of
    it (``getvalue`` would hold the program twice at the export's peak)."""
    buffer = io.BytesIO()
    try:
        with TORCH_LOCK:
            torch.export.save(program, buffer)
    except Exception as exc:
        raise PrecastError(f"{output}: could not save the converted program: {first_line(exc)}") from exc
    return buffer.getbuffer()
