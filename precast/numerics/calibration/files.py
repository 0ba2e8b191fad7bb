"""Calibration statistics files read as untrusted input (``load_calibration``): the JSON's nesting bounded before it
is parsed (``precast.io.loads_bounded``), every number checked (ranges finite and ordered, ``absmax`` the range's
larger magnitude, counts integers in ``[0, MAX_COUNT]`` consistent with each other), the kept batches' safetensors
header and pytree specs checked before torch reads them, and each file's measurement ids (``Calibration.parts``;
a file written before ids: its sha256). ``read_json_file`` and ``count`` serve the energies files too.

Input: a path. Output: a ``Calibration``, or one line (PrecastError) saying what the file is not.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from precast.errors import PrecastError
from precast.io import MAX_DEPTH, loads_bounded, read_tensors, too_deep
from precast.paths import check_input_file
from precast.policy.measurements import COUNTS, FORMAT, MAX_COUNT, VERSION, Calibration, NodeStats

MAX_KEEP = 1 << 20  # kept batches a file may declare
MAX_PARTS = 1 << 16  # measurement ids a file may list


def count(x: Any, what: str, limit: int = MAX_COUNT) -> int:
    """A count read from a file: an integer (not a float, not a bool) in [0, limit]."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{what} is {x!r}, not an integer")
    if not 0 <= x <= limit:
        raise ValueError(f"{what} is {x}, outside [0, {limit}]")
    return x


def check_node_stats(s: NodeStats, what: str, batches: int) -> None:
    """ValueError when ``s`` could not have been measured: a range that is not finite and ordered (or not the
    empty range of a node without finite values), an ``absmax`` other than the range's larger magnitude, counts
    that contradict each other or exceed the calibration's batches."""
    if s.count == 0:
        if not (s.min == math.inf and s.max == -math.inf and s.absmax == 0.0):
            raise ValueError(
                f"{what}: no finite value counted, but a range [{s.min}, {s.max}] (absmax {s.absmax})"
            )
    else:
        if not (math.isfinite(s.min) and math.isfinite(s.max) and s.min <= s.max):
            raise ValueError(f"{what}: range [{s.min}, {s.max}] is not finite and ordered (min <= max)")
        if s.absmax != max(abs(s.min), abs(s.max)):
            raise ValueError(f"{what}: absmax {s.absmax} is not the largest magnitude of [{s.min}, {s.max}]")
    if not s.flushed <= s.subnormal <= s.nonzero <= s.count:
        raise ValueError(
            f"{what}: counts contradict each other (flushed {s.flushed} <= subnormal {s.subnormal} <= nonzero "
            f"{s.nonzero} <= count {s.count} must hold)"
        )
    if s.batches > batches or ((s.count or s.nonfinite) and not s.batches):
        raise ValueError(f"{what}: {s.batches} batches of the calibration's {batches}")


def _float(x: Any) -> float:
    if isinstance(x, str) and x in ("inf", "-inf"):
        return float(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{x!r} is not a number")
    return float(x)


def read_json_file(path: Path, what: str, fmt: str, hint: str, version: int = VERSION) -> dict:
    """A JSON file of format ``fmt`` and ``version``, or one line saying what it is not (``hint``: what to do).
    Its nesting is bounded before it is parsed (``check_json_depth``). A FIFO or device is refused unopened."""
    check_input_file(path, hint, what)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PrecastError(f"{what} {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise PrecastError(f"{what} {path}: not JSON ({exc}); {hint}") from exc
    try:
        doc = loads_bounded(text)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise PrecastError(f"{what} {path}: not JSON ({exc}); {hint}") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise PrecastError(f'{what} {path}: not a {fmt} file (no "format": "{fmt}"); {hint}')
    if doc.get("version") != version:
        raise PrecastError(
            f"{what} {path}: version {doc.get('version')!r}; this precast reads version {version}"
        )
    return doc


def _stats_of(name: str, v: Any, batches: int) -> NodeStats:
    if not isinstance(v, dict):
        raise ValueError(f"statistics of {name} are a {type(v).__name__}, not an object")
    s = NodeStats(
        absmax=_float(v["absmax"]),
        min=_float(v["min"]),
        max=_float(v["max"]),
        **{c: count(v[c], f"{c} of {name}") for c in COUNTS},
    )
    check_node_stats(s, name, batches)
    return s


def _parts(doc: dict, path: Path) -> tuple[str, ...]:
    parts = doc.get("parts")
    if parts is None:  # written before measurement ids: the file's own bytes identify it
        return (hashlib.sha256(path.read_bytes()).hexdigest(),)
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"parts is not a list of 1 to {MAX_PARTS} measurement ids")
    for p in parts:
        if not (isinstance(p, str) and 0 < len(p) <= 64 and all(c in "0123456789abcdef" for c in p)):
            raise ValueError(f"measurement id {p!r} is not hexadecimal")
    if len(set(parts)) != len(parts):
        raise ValueError("a measurement id is listed twice (the same statistics merged twice)")
    return tuple(parts)


def _sample_batch(b: Any, tensors: dict[str, torch.Tensor], name: str) -> tuple[int, Any]:
    """(global index, batch) of one kept batch of the JSON, its spec's nesting bounded before it is parsed."""
    if not isinstance(b, dict) or not isinstance(b.get("spec"), str) or not isinstance(b.get("leaves"), list):
        raise ValueError("a kept batch is not an object with a spec and leaves")
    index = count(b["index"], "a kept batch's index")
    leaves = []
    for x in b["leaves"]:
        if not isinstance(x, dict):
            raise ValueError(f"a leaf of batch {index} is not an object")
        if "tensor" in x:
            if x["tensor"] not in tensors:
                raise ValueError(f"batch {index} names tensor {x['tensor']!r}, which {name} does not hold")
            leaves.append(tensors[x["tensor"]])
        elif x.get("value") is None or isinstance(x["value"], (bool, int, float, str)):
            leaves.append(x.get("value"))
        else:
            raise ValueError(f"a leaf of batch {index} is neither a tensor nor a number")
    if too_deep(b["spec"]):
        raise ValueError(f"the spec of batch {index} nests more than {MAX_DEPTH} deep")
    try:
        spec = pytree.treespec_loads(b["spec"])
    except NotImplementedError as exc:  # a type no pytree registration knows
        raise ValueError(f"the spec of batch {index} names a type this process cannot build ({exc})") from exc
    return index, pytree.tree_unflatten(leaves, spec)


def load_calibration(path: str | Path) -> Calibration:
    """A calibration saved by ``Calibration.save`` (its sample read from the safetensors file beside it), every
    value checked (see the module docstring): anything a measurement could not have written is one line."""
    path = Path(path)
    what, hint = "calibration", "write it with precast.calibrate(...).save(path)"
    doc = read_json_file(path, what, FORMAT, hint)
    try:
        batches = count(doc["batches"], "batches")
        stats = doc["stats"]
        if not isinstance(stats, dict):
            raise ValueError("stats is not an object of node names")
        if not isinstance(doc["program"], str) or not isinstance(doc["source"], str):
            raise ValueError("program and source must be strings")
        if doc["dtype"] is not None and not isinstance(doc["dtype"], str):
            raise ValueError("dtype must be a string or null")
        cal = Calibration(
            {str(k): _stats_of(str(k), v, batches) for k, v in stats.items()},
            batches,
            doc["source"],
            keep=count(doc["keep"], "keep", MAX_KEEP),
            key=doc["program"],
            dtype=doc["dtype"],
            parts=_parts(doc, path),
        )
        sample = doc["sample"]
        if sample is not None:
            if not isinstance(sample, dict) or not isinstance(sample.get("batches"), list):
                raise ValueError("sample is not an object with a list of batches")
            name = str(sample["file"])
            if Path(name).name != name:
                raise ValueError(f"sample file {name!r} is not a file name beside it")
            if len(sample["batches"]) > cal.keep:
                raise ValueError(f"{len(sample['batches'])} kept batches, more than keep={cal.keep}")
            side = path.with_name(name)
            if side.is_file() and hashlib.sha256(side.read_bytes()).hexdigest() != sample["sha256"]:
                raise ValueError(f"{name} does not match its sha256 (written by another save)")
            tensors, _ = read_tensors(side, what)
            for b in sample["batches"]:
                index, batch = _sample_batch(b, tensors, name)
                cal.sample.append(batch)
                cal.sample_index.append(index)
            if cal.sample_index != sorted(set(cal.sample_index)):
                raise ValueError(f"kept batch indices {cal.sample_index[:8]} are not ascending and distinct")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise PrecastError(f"{what} {path}: malformed ({type(exc).__name__}: {exc}); {hint}") from exc
    return cal
