"""Each weight stored once in an LLM folder: the program's weights read from the OpenVINO IR's ``.bin``.

A folder with OpenVINO IR holds every linear and embedding weight in ``model.bin`` already, in the dtype precast
stored it (bf16, int8 and its scales, packed int4): OpenVINO's constants are the program's tensors, byte for byte.
So the program is saved without its weights (``program.pt2`` of kilobytes: the graph, meta tensors), and
``index_weights`` records, for each of the program's tensors, where its bytes lie in the ``.bin`` (each match
checked by its SHA-256, never assumed), the all-zero ones (a KV cache's initial value) as zeros, and the few the IR
holds in another form (an RMSNorm's fp32 weight OpenVINO folded) in a small ``weights.bin`` beside it (raw
bytes at recorded offsets, as the ``.bin`` is: no other format, no other package).
``filled_program`` gives the program its tensors back from those (copied out of the mapped ``.bin``; each
tensor's length, dtype and shape checked against the program), for the eager and AOTInductor routes.

Input: the program and the IR's files; the folder's index. Output: the index and the leftover tensors; a program
with its weights.
"""

from __future__ import annotations

import copy
import hashlib
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.dtypes import dtype_of_name, long_name
from precast.errors import PrecastError
from precast.weights.files import as_meta

REST = "weights.bin"  # the program's tensors the IR does not hold byte for byte: raw, at recorded offsets
ALIGN = 64


def _tensors(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    out = {**ep.state_dict, **ep.constants}
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _ir_constants(xml: Path, data: memoryview) -> dict[str, tuple[int, int]]:
    """sha256 of each ``Const`` of the IR's ``.bin`` -> (offset, size) (the first, for equal constants)."""
    found: dict[str, tuple[int, int]] = {}
    for layer in ET.parse(xml).getroot().iter("layer"):
        info = layer.find("data")
        if layer.get("type") != "Const" or info is None or info.get("offset") is None:
            continue
        offset, size = int(info.get("offset", 0)), int(info.get("size", 0))
        found.setdefault(hashlib.sha256(data[offset : offset + size]).hexdigest(), (offset, size))
    return found


def index_weights(ep: ExportedProgram, xml: Path | None) -> tuple[dict[str, Any], bytes]:
    """Where each of ``ep``'s tensors lies: ``{"bin": {name: [offset, dtype, shape]}, "zeros": {name: [dtype,
    shape]}, "rest": {name: [offset, dtype, shape]}}`` over the IR at ``xml`` (its ``.bin`` beside it), and the
    bytes of ``REST`` (empty when the IR holds everything). Without an IR (``xml`` None), every tensor but the
    zeros is in ``REST``."""
    constants: dict[str, tuple[int, int]] = {}
    if xml is not None:
        constants = _ir_constants(xml, memoryview(xml.with_suffix(".bin").read_bytes()))
    index: dict[str, Any] = {"bin": {}, "zeros": {}, "rest": {}}
    rest = bytearray()
    for name, t in sorted(_tensors(ep).items()):
        about = [long_name(t.dtype), list(t.shape)]
        if t.numel() and not t.is_complex() and not torch.any(t != 0):
            index["zeros"][name] = about
            continue
        where = constants.get(hashlib.sha256(_bytes(t)).hexdigest())
        if where is not None and t.numel():
            index["bin"][name] = [where[0], *about]
        else:
            rest.extend(b"\0" * (-len(rest) % ALIGN))
            index["rest"][name] = [len(rest), *about]
            rest.extend(_bytes(t))
    return index, bytes(rest)


def weightless(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with every tensor constant a meta tensor: what ``torch.export.save`` writes in kilobytes."""
    out = copy.copy(ep)
    out._state_dict = {k: as_meta(v) for k, v in ep.state_dict.items()}
    out._constants = {k: as_meta(v) if isinstance(v, torch.Tensor) else v for k, v in ep.constants.items()}
    return out


def indexed_tensors(folder: Path, index: dict[str, Any], bin_name: str) -> dict[str, torch.Tensor]:
    """The program's tensors by stored name, from the folder: the IR's ``.bin``, zeros, ``REST``."""
    values: dict[str, torch.Tensor] = {}
    if index.get("bin"):
        values.update(_from_bin(folder / bin_name, index["bin"]))
    for name, (dtype, shape) in (index.get("zeros") or {}).items():
        values[name] = torch.zeros(shape, dtype=dtype_of_name(dtype, "the folder's weight index"))
    if index.get("rest"):
        values.update(_from_bin(folder / REST, index["rest"]))
    return values


def filled_program(ep: ExportedProgram, values: dict[str, torch.Tensor], folder: Path) -> ExportedProgram:
    """``ep`` (saved weightless) with its tensors ``values`` (``indexed_tensors`` of ``folder``), each checked."""
    wanted = _tensors(ep)
    missing = sorted(set(wanted) - set(values))
    bad = [
        n
        for n, w in wanted.items()
        if n in values and (values[n].shape != w.shape or values[n].dtype != w.dtype)
    ]
    if missing or bad:
        what = f"missing {missing[:3]}" if missing else f"{bad[:3]} differ in shape or dtype"
        raise PrecastError(
            f"{folder}: its weights do not match its program.pt2 ({what}); export the folder again"
        )
    out = copy.copy(ep)
    out._state_dict = {k: _like(v, values[k]) for k, v in ep.state_dict.items()}
    out._constants = {k: _like(v, values[k]) if k in values else v for k, v in ep.constants.items()}
    return out


def _from_bin(path: Path, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each entry's tensor, copied out of ``path`` mapped: into memory torch allocated, aligned as kernels expect
    (a constant at an odd offset of the file crashed AOTInductor's code); the mapping is dropped after."""
    size = os.path.getsize(path)
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    out = {}
    for name, (offset, dtype, shape) in entries.items():
        dt = dtype_of_name(dtype, "the folder's weight index")
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        if offset < 0 or offset + n > size:
            raise PrecastError(f"{path}: {name} lies past the file's end; export the folder again")
        out[name] = data[offset : offset + n].clone().view(dt).reshape(shape)
    return out


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new
