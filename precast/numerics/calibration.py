"""Calibration statistics as mergeable values: per-node ``NodeStats`` and a program's ``Calibration``, merged
exactly (ranges by min/max, counts summed), saved and loaded.

A ``Calibration`` records the program its node names mean (``key``: ``precast.ir.graph.graph_key`` of the
program calibration ran on) and the low dtype its subnormal counts are for; merging or converting with one of
another program or dtype is refused with one line. Its kept sample (the batches the tolerance search runs) is
the globally first ``keep`` batches, each tagged with its global index, so merged shards keep the batches one
process over the same data would keep, in the same order.

Files: JSON (format ``precast-calibration``) for the statistics; the sample's tensors in a safetensors file
beside it (``<stem>.sample.safetensors``, named and hashed in the JSON). Nothing is unpickled: a batch's
structure is a pytree spec in JSON, its tensors safetensors, its other leaves JSON values.

Input: batches' outputs (``NodeStats.update``), calibrations, files. Output: merged values, files, one-line
PrecastErrors for a foreign or corrupt file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from precast.dtypes import dtype_name
from precast.errors import PrecastError
from precast.io import read_tensors, write_bytes, write_tensors

FORMAT, VERSION = "precast-calibration", 1


# batches kept from the single pass over the calibration data for the tolerance search (several forwards each)
TOLERANCE_BATCHES = 8


@dataclass
class NodeStats:
    """Range of a node's floating outputs over every batch (non-finite values counted, not in the range).

    With a low dtype given, also how many finite values are nonzero, how many of those are subnormal in the low
    dtype (below its smallest normal, ``torch.finfo(low).tiny``: few significant bits left) and how many flush
    to zero there (at most half its smallest subnormal, which rounds to 0).
    """

    absmax: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    batches: int = 0
    count: int = 0  # finite floating values seen
    nonzero: int = 0
    subnormal: int = 0  # nonzero values below the low dtype's smallest normal (flushed ones included)
    flushed: int = 0  # nonzero values that become 0 in the low dtype

    def update(self, value: object, low: torch.dtype | None = None) -> None:
        seen = False
        for t in pytree.tree_leaves(value):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.numel() == 0:
                continue
            seen = True
            self._update_tensor(t.detach(), low)
        self.batches += seen

    def _update_tensor(self, t: torch.Tensor, low: torch.dtype | None) -> None:
        finite = torch.isfinite(t)
        bad = int(t.numel() - finite.sum().item())
        self.nonfinite += bad
        vals = t[finite] if bad else t
        self.count += vals.numel()
        if not vals.numel():
            return
        # + 0.0 makes -0.0 the one zero: max(0.0, -0.0) keeps whichever came first, and merged statistics
        # must not depend on the order their batches came in
        lo, hi = vals.min().item() + 0.0, vals.max().item() + 0.0
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.absmax = max(self.absmax, abs(lo), abs(hi))
        if low is None:
            return
        mag = vals.abs()
        nonzero = mag > 0
        self.nonzero += int(nonzero.sum().item())
        small = nonzero & (mag < torch.finfo(low).tiny)
        if small.any():
            self.subnormal += int(small.sum().item())
            self.flushed += int((small & (mag <= smallest_subnormal(low) / 2)).sum().item())

    def merge(self, other: NodeStats) -> NodeStats:
        """The statistics of both sets of batches: ranges by min/max (exact), counts summed. Associative and
        commutative, ``NodeStats()`` its identity: merging per-shard statistics in any grouping is bitwise the
        statistics of one pass over all the batches."""
        return NodeStats(
            absmax=max(self.absmax, other.absmax),
            min=min(self.min, other.min),
            max=max(self.max, other.max),
            **{k: getattr(self, k) + getattr(other, k) for k in COUNTS},
        )


COUNTS = ("nonfinite", "batches", "count", "nonzero", "subnormal", "flushed")  # NodeStats' summed fields


def smallest_subnormal(dtype: torch.dtype) -> float:
    """2**-24 for float16, 2**-133 for bfloat16: the smallest positive value the dtype holds."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


@dataclass
class Calibration:
    """Per-node statistics over ``batches`` batches, the program they were measured on (``key``, see
    ``precast.ir.graph.graph_key``) and for which low dtype (``dtype``: the subnormal counts depend on
    it), and the kept sample: the first ``keep`` batches in the global order of the data, as (args, kwargs), with
    their global indices (``sample_index``; a shard's i-th batch of ``world`` shards is global batch
    ``i * world + rank``, the order of ``data[rank::world]``)."""

    stats: dict[str, NodeStats] = field(default_factory=dict)
    batches: int = 0
    source: str = "calibration data"  # or "the example inputs"
    sample: list[tuple[tuple, dict]] = field(default_factory=list)  # the first batches, as (args, kwargs)
    sample_index: list[int] = field(default_factory=list)  # their global batch indices, ascending
    keep: int = 0  # how many batches the sample keeps at most
    key: str = ""  # the program's graph the statistics are keyed by ("" : not recorded)
    dtype: str | None = None  # the low dtype of the subnormal counts (None: not counted)

    def merge(self, *others: Calibration) -> Calibration:
        """One calibration of this one's batches and ``others``': statistics merged node by node, the sample the
        globally first ``keep`` batches of all. Refused (PrecastError) for statistics of
        another program or low dtype, or a batch index in two of them (overlapping shards)."""
        out = Calibration(
            {k: NodeStats().merge(v) for k, v in self.stats.items()},
            self.batches,
            self.source,
            list(self.sample),
            list(self.sample_index),
            self.keep,
            self.key,
            self.dtype,
        )
        for o in others:
            for what, mine, theirs in (("program", out.key, o.key), ("low dtype", out.dtype, o.dtype)):
                if mine != theirs:
                    raise PrecastError(
                        f"cannot merge calibrations of another {what} ({mine or 'none'} and {theirs or 'none'}): "
                        "calibrate every shard on the same program with the same dtype"
                    )
            for k, v in o.stats.items():
                out.stats[k] = out.stats[k].merge(v) if k in out.stats else NodeStats().merge(v)
            out.batches += o.batches
            out.source = out.source if out.source == o.source else "calibration data"
            out.keep = max(out.keep, o.keep)
            both = set(out.sample_index) & set(o.sample_index)
            if both:
                raise PrecastError(
                    f"cannot merge calibrations that both hold batch {min(both)}: shards must not overlap (give "
                    "each its shard=(rank, world) or pass data[rank::world] on each rank)"
                )
            pairs = sorted(
                zip(out.sample_index + o.sample_index, out.sample + o.sample, strict=True), key=lambda p: p[0]
            )[: out.keep]
            out.sample_index, out.sample = [i for i, _ in pairs], [b for _, b in pairs]
        return out

    def save(self, path: str | Path) -> None:
        """The statistics as JSON at ``path``; the kept sample's tensors, if any, in
        ``<stem>.sample.safetensors`` beside it. Read back with ``precast.load_calibration``."""
        save_calibration(self, path)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _float(x: Any) -> float:
    if isinstance(x, str) and x in ("inf", "-inf"):
        return float(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{x!r} is not a number")
    return float(x)


def sample_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.sample.safetensors")


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """``path``: the statistics (JSON); the sample's tensors, if any, in ``sample_path(path)``."""
    path = Path(path)
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "program": cal.key,
        "dtype": cal.dtype,
        "batches": cal.batches,
        "source": cal.source,
        "keep": cal.keep,
        "stats": {
            k: {
                "absmax": s.absmax,
                "min": _num(s.min),
                "max": _num(s.max),
                **{c: getattr(s, c) for c in COUNTS},
            }
            for k, s in cal.stats.items()
        },
        "sample": None,
    }
    if cal.sample:
        tensors, batches = {}, []
        for index, batch in zip(cal.sample_index, cal.sample, strict=True):
            leaves, spec = pytree.tree_flatten(batch)
            out = []
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    tensors[f"b{index}.{j}"] = leaf
                    out.append({"tensor": f"b{index}.{j}"})
                elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                    out.append({"value": leaf})
                else:
                    raise PrecastError(
                        f"{path}: calibration batch {index} holds a {type(leaf).__name__}; only tensors and "
                        "numbers can be saved"
                    )
            batches.append({"index": index, "spec": pytree.treespec_dumps(spec), "leaves": out})
        side = sample_path(path)
        write_tensors(side, tensors, {"format": FORMAT, "program": cal.key})
        digest = hashlib.sha256(side.read_bytes()).hexdigest()
        doc["sample"] = {"file": side.name, "sha256": digest, "batches": batches}
    write_bytes(path, json.dumps(doc, indent=1).encode())


def read_json_file(path: Path, what: str, fmt: str, hint: str, version: int = VERSION) -> dict:
    """A JSON file of format ``fmt`` and ``version``, or one line saying what it is not (``hint``: what to do)."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise PrecastError(f"{what} {path}: cannot read it ({exc.strerror})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PrecastError(f"{what} {path}: not JSON ({exc}); {hint}") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise PrecastError(f'{what} {path}: not a {fmt} file (no "format": "{fmt}"); {hint}')
    if doc.get("version") != version:
        raise PrecastError(
            f"{what} {path}: version {doc.get('version')!r}; this precast reads version {version}"
        )
    return doc


def load_calibration(path: str | Path) -> Calibration:
    """A calibration saved by ``Calibration.save`` (its sample read from the safetensors file beside it)."""
    path = Path(path)
    what, hint = "calibration", "write it with precast.calibrate(...).save(path)"
    doc = read_json_file(path, what, FORMAT, hint)
    try:
        stats = {
            str(k): NodeStats(
                absmax=_float(v["absmax"]),
                min=_float(v["min"]),
                max=_float(v["max"]),
                **{c: int(v[c]) for c in COUNTS},
            )
            for k, v in doc["stats"].items()
        }
        cal = Calibration(
            stats,
            int(doc["batches"]),
            str(doc["source"]),
            keep=int(doc["keep"]),
            key=str(doc["program"]),
            dtype=None if doc["dtype"] is None else str(doc["dtype"]),
        )
        sample = doc["sample"]
        if sample is not None:
            name = str(sample["file"])
            if Path(name).name != name:
                raise ValueError(f"sample file {name!r} is not a file name beside it")
            side = path.with_name(name)
            if side.is_file() and hashlib.sha256(side.read_bytes()).hexdigest() != sample["sha256"]:
                raise ValueError(f"{name} does not match its sha256 (written by another save)")
            tensors, _ = read_tensors(side, what)
            for b in sample["batches"]:
                leaves = [tensors[x["tensor"]] if "tensor" in x else x["value"] for x in b["leaves"]]
                cal.sample.append(pytree.tree_unflatten(leaves, pytree.treespec_loads(b["spec"])))
                cal.sample_index.append(int(b["index"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PrecastError(f"{what} {path}: malformed ({type(exc).__name__}: {exc}); {hint}") from exc
    return cal


def check_calibration(cal: Calibration, key: str, low: torch.dtype | None, where: str) -> None:
    """One line if ``cal`` was measured on another program or for another low dtype."""
    if cal.key != key:
        raise PrecastError(
            f"{where}: measured on another program (graph key {cal.key or 'none'}, this program's is {key}); "
            "calibrate this export of the model (precast.calibrate on the same program or module and inputs)"
        )
    want = dtype_name(low)
    if cal.dtype is not None and want is not None and cal.dtype != want:
        raise PrecastError(
            f"{where}: measured for {cal.dtype}, this conversion lowers to {want}; calibrate with dtype={want!r}"
        )
