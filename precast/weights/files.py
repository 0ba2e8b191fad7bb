"""Weights outside memory: a model's safetensors files read one tensor at a time, and the program that stands for
them with no values (its constants meta tensors).

``WeightFiles`` opens one ``.safetensors`` file, or a folder of shards as transformers saves them (with
``model.safetensors.index.json``, or every ``*.safetensors`` in it): names, shapes and dtypes come from the
headers; ``read(name)`` copies one tensor in and closes the file again, so nothing stays mapped. The files are
parsed by the safetensors library (no pickle, bounds checked); the index is JSON naming files inside the folder.

``without_weights(ep, files)`` is a copy of a program whose constants found in the files are meta tensors (shape and
dtype checked against the file), so a conversion decides on the graph alone. It keeps real values only where the
program needs them: the constants it writes (a KV cache saved with the weights) and one-element constants (an
epsilon the rules read), both read from the files; constants absent from the files must hold values of their own
(a rotary table made at construction), else a one-line error lists them. A program exported with fake weights
(under ``FakeTensorMode``) or with meta weights is accepted as it is: its constants never held values.

Input: a folder or file path; an ExportedProgram. Output: ``WeightFiles``; ``without_weights`` -> ExportedProgram.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.dtypes import absmax
from precast.errors import NAMES_SHOWN, PrecastError, first_line, name_list
from precast.io import SAFETENSORS_DTYPES
from precast.ir.fake import has_data
from precast.ir.program import CONSTANT_KINDS, written_targets

INDEX = "model.safetensors.index.json"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read in place (no copy, and no numpy: ``pip install precast`` does not
    bring it, torch does not either)."""
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class WeightFiles:
    """The tensors of one safetensors file or a folder of shards, read lazily (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, what: str = "weights"):
        try:  # an extra of the core install (precast[weights]): imported where weights are streamed
            from safetensors import safe_open
        except ImportError as exc:
            raise PrecastError(
                "weights=: streaming weights needs safetensors: pip install 'precast[weights]'"
            ) from exc

        self._open = safe_open
        self.path = Path(path)
        self.what = what
        self.where: dict[str, Path] = {}  # name -> file
        # name -> (shape, dtype); a dtype torch has no name for here stays the file's code (e.g. "F8_E4M3")
        self.headers: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {}
        self._absmax: dict[str, float] = {}
        self.prefix = ""  # what the program's names add in front of the files' (a wrapper module's attribute)
        files, index = self._files()
        for f in files:
            self._read_header(f)
        if not self.where:
            raise PrecastError(f"{what} {self.path}: no tensors in it; pass the folder a model was saved to")
        wrong = sorted(n for n, f in (index or {}).items() if self.where.get(n, Path()).name != f)
        if wrong:
            raise PrecastError(
                f"{what} {self.path}: {INDEX} maps {len(wrong)} name(s) to shards that do not hold them; rewrite the "
                f"index: {name_list(wrong)}"
            )

    def _files(self) -> tuple[list[Path], dict[str, str] | None]:
        """The files to read, and the index's name -> file map (None without an index)."""
        p, what = self.path, self.what
        kind = _kind(p)
        if kind == "file":
            if p.suffix != ".safetensors":
                raise PrecastError(
                    f"{what} {p}: not a .safetensors file; pass a .safetensors file or a folder of them"
                )
            return [p], None
        if kind is None:
            raise PrecastError(f"{what} {p}: no such file or folder")
        if kind != "folder":
            raise PrecastError(
                f"{what} {p}: {kind}, not a regular file or a folder; pass a folder of .safetensors files"
            )
        index = p / INDEX
        index_kind = _kind(index)
        if index_kind is None:
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise PrecastError(f"{what} {p}: no {INDEX} and no .safetensors files in it")
            for f in files:
                if _kind(f) != "file":
                    raise PrecastError(
                        f"{what} {f}: {_kind(f) or 'a broken link'}, not a regular file; only regular files are read "
                        "from a weights folder: remove it or move it out"
                    )
            return files, None
        if index_kind != "file":
            raise PrecastError(
                f"{what} {index}: {index_kind}, not a regular file; replace it with the index JSON"
            )
        try:
            weight_map = json.loads(_read_regular(index, what))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PrecastError(f"{what} {index}: not a safetensors index ({first_line(exc)})") from exc
        files = []
        for name in names:
            # a plain file name in this folder: an index cannot send the reader elsewhere
            if not isinstance(name, str) or Path(name).name != name or _kind(p / name) != "file":
                raise PrecastError(
                    f"{what} {index}: names a shard {name!r} that is not a regular file in {p}"
                )
            files.append(p / name)
        return files, weight_map

    def _read_header(self, f: Path) -> None:
        try:
            with self._opened(f) as h:
                for name in h.keys():  # noqa: SIM118 - safe_open is not a dict
                    view = h.get_slice(name)
                    code = view.get_dtype()
                    if name in self.where:
                        raise PrecastError(
                            f"{self.what} {self.path}: {name} is in both {self.where[name].name} and {f.name}"
                        )
                    self.where[name] = f
                    self.headers[name] = (tuple(view.get_shape()), SAFETENSORS_DTYPES.get(code, code))
        except PrecastError:
            raise
        except Exception as exc:  # the library's own parse error (a bad header, a short file), made one line
            raise PrecastError(
                f"{self.what} {f}: not a valid safetensors file ({first_line(exc)[:160]}); write it again "
                "(a truncated or damaged file is refused before any tensor is read)"
            ) from exc

    @contextlib.contextmanager
    def _opened(self, f: Path) -> Iterator[Any]:
        """``safe_open`` of ``f`` once it is known to be a regular file: opened here without blocking and checked
        on the open descriptor (a FIFO or device put in its place meanwhile cannot hang the reader), then handed
        to safetensors through ``/proc/self/fd`` (the same file, not the name again) where there is one."""
        fd = _open_regular(f, self.what)
        try:
            proc = f"/proc/self/fd/{fd}"
            with self._open(proc if os.path.exists(proc) else str(f), framework="pt") as h:
                yield h
        finally:
            os.close(fd)

    def match(self, names: list[str]) -> None:
        """Find the prefix the program's constant ``names`` carry over the files' (``model.`` when the program
        was exported from a wrapper holding the model as ``self.model``): the one that matches the most."""
        counts: dict[str, int] = {}
        for n in names:
            parts = n.split(".")
            for i in range(len(parts)):
                if ".".join(parts[i:]) in self.where:
                    prefix = ".".join(parts[:i]) + ("." if i else "")
                    counts[prefix] = counts.get(prefix, 0) + 1
        if counts:
            self.prefix = max(sorted(counts), key=lambda p: (counts[p], -len(p)))

    def file_name(self, name: str) -> str | None:
        """The files' name for the program's constant ``name`` (None: not in the files)."""
        if name.startswith(self.prefix) and name[len(self.prefix) :] in self.where:
            return name[len(self.prefix) :]
        return None

    def __contains__(self, name: object) -> bool:
        """Whether the program's constant ``name`` is in the files (the prefix ``match`` found applied)."""
        return isinstance(name, str) and self.file_name(name) is not None

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        """Shape and dtype of the program's constant ``name`` (the files' prefix applied), from the header."""
        return self.headers[self.file_name(name)]  # type: ignore[index]

    # ---- by the files' own names (a converted program's weights: names as stored) --------------------------
    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        return self.headers[name]

    def _key(self, name: str) -> str:
        """The files' own key of ``name`` (a reader under other names, as ``aoti.swap``'s, maps it)."""
        return name

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._opened(self.where[name]) as h:
            return h.get_tensor(self._key(name))

    def __iter__(self):  # noqa: ANN204
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def read_many(self, names: set[str]):  # noqa: ANN201 - an iterator of (name, tensor)
        """``(name, tensor)`` for ``names``, file by file, one file open at a time."""
        for file in sorted(set(self.where.values())):
            wanted = [n for n, f in self.where.items() if f == file and n in names]
            if wanted:
                with self._opened(file) as h:
                    for name in wanted:
                        yield name, h.get_tensor(self._key(name))

    def file_of(self, name: str) -> Path:
        return self.where[self.file_name(name)]  # type: ignore[index]

    def read(self, name: str) -> torch.Tensor:
        """The program's constant ``name``, copied in; the file is closed again (nothing of it stays mapped)."""
        key = self.file_name(name)
        with self._opened(self.where[key]) as h:  # type: ignore[index]
            return h.get_tensor(key)

    def absmax(self, name: str) -> float:
        """max |value| of the program's constant ``name`` (``precast.dtypes.absmax``: no second tensor of the
        weight's size), read once and remembered."""
        if name not in self._absmax:
            self._absmax[name] = absmax(self.read(name))
        return self._absmax[name]


def _kind(p: Path) -> str | None:
    """ "file" (a regular file, through links), "folder", None (nothing there, or a broken link), else what it is."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    return {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device"}.get(
        stat.S_IFMT(mode), "a block device" if stat.S_ISBLK(mode) else "not a regular file"
    )


def _open_regular(f: Path, what: str) -> int:
    """A read-only descriptor of ``f``, opened without blocking (a FIFO never waits for a writer) and refused
    (one line) unless it is a regular file."""
    try:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise PrecastError(f"{what} {f}: cannot be opened ({exc.strerror}); check the file") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise PrecastError(
            f"{what} {f}: not a regular file (a FIFO, device or socket); only regular files are read from a "
            "weights folder: remove it or move it out"
        )
    return fd


def _read_regular(f: Path, what: str) -> str:
    fd = _open_regular(f, what)
    with os.fdopen(fd, "rb") as h:
        return h.read().decode("utf-8")


def as_meta(value: torch.Tensor, requires_grad: bool | None = None) -> torch.Tensor:
    """A meta tensor of ``value``'s shape, strides and dtype; a Parameter stays one (``requires_grad``: its flag,
    else ``value``'s)."""
    meta = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    if isinstance(value, torch.nn.Parameter):
        flag = value.requires_grad if requires_grad is None else requires_grad
        return torch.nn.Parameter(meta, requires_grad=flag)
    return meta


def _like(value: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(real, requires_grad=value.requires_grad)
    return real


def without_weights(ep: ExportedProgram, files: WeightFiles) -> ExportedProgram:
    """``ep`` with the constants found in ``files`` as meta tensors (see the module docstring)."""
    read = {s.target for s in ep.graph_signature.input_specs if s.kind in CONSTANT_KINDS}
    files.match(sorted(read))
    written = written_targets(ep)
    stores: list[dict[str, object]] = [dict(ep.state_dict), dict(ep.constants)]
    problems, missing = _values_dropped(stores, files, read, written)
    found = sum(name in files for store in stores for name in store)
    _refuse_misfit(files, found, problems, missing)
    out = copy.copy(ep)
    out._state_dict, out._constants = stores
    if ep.example_inputs is not None and not all(
        has_data(t) for t in torch.utils._pytree.tree_leaves(ep.example_inputs) if isinstance(t, torch.Tensor)
    ):
        out._example_inputs = None  # fake example inputs of a weightless export: nothing to run on
    return out


def _values_dropped(
    stores: list[dict[str, object]], files: WeightFiles, read: set[str], written: set[str]
) -> tuple[list[str], list[str]]:
    """Each constant of ``stores`` the files hold made a meta tensor in place (real values read for the state the
    program writes and for one-element constants); returns the shape or dtype mismatches and the constants the
    program reads that hold no value and are not in the files."""
    problems, missing = [], []
    for store in stores:
        for name, value in store.items():
            if not isinstance(value, torch.Tensor):
                continue
            if name not in files:
                if not has_data(value):
                    if name in read:
                        missing.append(name)
                    else:
                        store[name] = as_meta(value)  # never read: only its metadata is kept
                continue
            shape, dtype = files.shape_dtype(name)
            if tuple(value.shape) != shape or value.dtype != dtype:
                problems.append(
                    f"{name} is {dtype} {list(shape)} in the files, {value.dtype} {list(value.shape)} in the program"
                )
                continue
            if name in written or value.numel() == 1:
                store[name] = _like(value, files.read(name))  # written state and scalars: real values
            else:
                store[name] = as_meta(value)
    return problems, missing


def _refuse_misfit(files: WeightFiles, found: int, problems: list[str], missing: list[str]) -> None:
    """One line when the files do not fit the program (``found`` of its constants in them): another model's,
    other shapes or dtypes, or constants the program reads with a value nowhere."""
    if not found:
        raise PrecastError(
            f"weights {files.path}: these files belong to another model: none of its {len(files.where)} tensors is "
            f"a constant of the program (it has e.g. {name_list(sorted(files.where), 3)}); pass the weights of the "
            "model the program was exported from"
        )
    if (
        len(problems) * 2 > found
    ):  # most names there, most shapes or dtypes not: the same family, another size
        problems.insert(
            0,
            f"these files belong to another model: {len(problems)} of the {found} constants found differ in shape "
            "or dtype; pass the weights of the model the program was exported from",
        )
    elif missing and len(missing) > found:  # most of what the program needs is not there: not a rotary table
        problems.insert(
            0,
            f"these files belong to another model: {len(missing)} constant(s) the program reads are not in them "
            f"(only {found} are): {name_list(sorted(missing))}; pass the weights of the model the program was "
            "exported from",
        )
    elif missing:
        problems.insert(
            0,
            f"{len(missing)} constant(s) the program reads hold no value and are not in the files; give them real "
            "values before export (e.g. non-persistent buffers such as a rotary table): "
            f"{name_list(sorted(missing))}",
        )
    if problems:
        more = f" ... ({len(problems)} problems in all)" if len(problems) > NAMES_SHOWN else ""
        raise PrecastError(f"weights {files.path}: {'; '.join(problems[:NAMES_SHOWN])}{more}")


def streamed_targets(ep: ExportedProgram) -> list[str]:
    """The constants of ``ep`` that hold no values (they come from weight files)."""
    return sorted(
        name
        for store in (ep.state_dict, ep.constants)
        for name, v in store.items()
        if isinstance(v, torch.Tensor) and not has_data(v)
    )
