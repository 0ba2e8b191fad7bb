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

Also ``stand_in(ep)``: the program with each value-less constant a zero broadcast to its shape (no memory), for
the device check, which needs kernels to run, not values.

Input: the converted ExportedProgram, the ``WeightFiles`` it was converted from, the output folder. Output: the
report's ``weights`` record (files, bytes read and written, values clamped).
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError
from precast.io import safetensors_header
from precast.ir.program import constant_sources
from precast.passes.fold import cast_constant
from precast.progress import ProgressBar
from precast.weights.files import INDEX, WeightFiles, has_values, streamed_targets, tensor_bytes


def _plan(ep: ExportedProgram, files: WeightFiles) -> dict[Path, list[tuple[str, str, torch.dtype, tuple]]]:
    """input shard -> [(stored name, original name, stored dtype, shape)] for every value-less constant."""
    sources = constant_sources(ep)
    values = {**ep.state_dict, **ep.constants}
    plan: dict[Path, list[tuple[str, str, torch.dtype, tuple]]] = {}
    for stored in streamed_targets(ep):
        src = sources.get(stored)
        original = src.original if src is not None else stored
        if original not in files:
            raise PrecastError(
                f"internal: {stored} holds no value and its source {original} is not in the weight files"
            )
        v = values[stored]
        plan.setdefault(files.file_of(original), []).append((stored, original, v.dtype, tuple(v.shape)))
    return plan


def check_weights_out(source: Path, out_dir: str | os.PathLike) -> Path:
    """The output folder, refused (one line) where writing it would touch the input weights or a folder that is not
    precast's own."""
    out, src = Path(out_dir).absolute(), Path(source).absolute()
    if out == src or src in out.parents or (src.is_dir() and out in src.parents):
        raise PrecastError(
            f"weights output {out}: it would overwrite the input weights {src}; choose another folder"
        )
    if out.exists() and not _ours(out):
        raise PrecastError(
            f"weights output {out}: exists and is not a folder of weights precast wrote; choose a new folder"
        )
    return out


def write_weights(
    ep: ExportedProgram, files: WeightFiles, out_dir: str | os.PathLike, progress: bool | None = None
) -> dict:
    """Write the weights ``ep`` holds no values for into ``out_dir`` (see the module docstring)."""
    out = check_weights_out(files.path, out_dir)
    plan = _plan(ep, files)
    out.parent.mkdir(parents=True, exist_ok=True)
    # an ordinary folder (mode 0777 minus the umask, applied by the kernel), not mkdtemp's private one
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    os.mkdir(tmp, 0o777)
    record = {
        "source": str(files.path.absolute()),
        "output": str(out),
        "files": 0,
        "tensors": 0,
        "bytes_read": 0,
        "bytes_written": 0,
    }
    clamped: dict[str, int] = {}
    weight_map: dict[str, str] = {}
    start = time.perf_counter()
    try:
        total = sum(len(v) for v in plan.values())
        with ProgressBar(f"writing weights to {out.name}", total, progress) as bar:
            for shard, entries in sorted(plan.items()):
                entries.sort()
                name = shard.name if shard.suffix == ".safetensors" else "model.safetensors"
                with open(tmp / name, "wb") as f:
                    f.write(
                        safetensors_header(
                            [(stored, dtype, shape) for stored, _o, dtype, shape in entries],
                            {"format": "pt", "written_by": "precast"},
                            str(out / name),
                        )
                    )
                    for stored, original, dtype, shape in entries:
                        value = files.read(original)
                        record["bytes_read"] += value.numel() * value.element_size()
                        low, n = cast_constant(value, dtype) if value.dtype != dtype else (value, 0)
                        del value
                        if n:
                            clamped[stored] = n
                        low = low.contiguous()
                        if tuple(low.shape) != shape:
                            raise PrecastError(
                                f"internal: {stored} is {list(low.shape)}, the program says {list(shape)}"
                            )
                        f.write(tensor_bytes(low))
                        record["bytes_written"] += low.numel() * low.element_size()
                        weight_map[stored] = name
                        bar.advance()
                    f.flush()
                    os.fsync(f.fileno())
                record["files"] += 1
            index = {
                "metadata": {"total_size": record["bytes_written"], "written_by": "precast"},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record["tensors"] = len(weight_map)
    record["clamped"] = clamped
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _replace_dir(new: Path, out: Path) -> None:
    """``new`` renamed to ``out``; an existing ``out`` moved aside first and removed after (never a mix)."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    return ours and all(e.is_file() and (e.suffix == ".safetensors" or e.name == INDEX) for e in entries)


def stand_in(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with each value-less constant a zero of its dtype broadcast to its shape: runnable, no memory."""

    def zero(v: torch.Tensor) -> torch.Tensor:
        z = torch.zeros((), dtype=v.dtype).expand(v.shape)
        return torch.nn.Parameter(z, requires_grad=False) if isinstance(v, torch.nn.Parameter) else z

    out = copy.copy(ep)
    out._state_dict = {k: v if has_values(v) else zero(v) for k, v in ep.state_dict.items()}
    out._constants = {
        k: v if not isinstance(v, torch.Tensor) or has_values(v) else zero(v) for k, v in ep.constants.items()
    }
    return out


def with_weights(ep: ExportedProgram, weights: str | os.PathLike) -> ExportedProgram:
    """``ep`` (converted with streamed weights, or exported without them) with its value-less constants read
    from ``weights`` (a folder of shards or one file, names as the program stores them, dtypes and shapes
    checked): a program that runs eagerly (``.module()``), saves with its weights, or goes to another backend."""
    files = WeightFiles(weights)
    targets = streamed_targets(ep)
    files.match(targets)
    missing, problems = [], []
    values: dict[str, torch.Tensor] = {}
    for name in targets:
        v = {**ep.state_dict, **ep.constants}[name]
        if name not in files:
            missing.append(name)
            continue
        shape, dtype = files.shape_dtype(name)
        if shape != tuple(v.shape) or dtype != v.dtype:
            problems.append(
                f"{name} is {dtype} {list(shape)} in the files, {v.dtype} {list(v.shape)} in the program"
            )
            continue
        t = files.read(name)
        values[name] = torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t
    if missing:
        problems.insert(
            0, f"missing {len(missing)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    if problems:
        raise PrecastError(
            f"weights {files.path}: {'; '.join(problems)}; pass the folder precast.convert wrote"
        )
    out = copy.copy(ep)
    out._state_dict = {k: values.get(k, v) for k, v in ep.state_dict.items()}
    out._constants = {k: values.get(k, v) for k, v in ep.constants.items()}
    return out
