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

Files are untrusted input (``load_calibration``): the JSON's nesting is bounded before it is parsed, every
number checked (ranges finite and ordered, ``absmax`` the larger magnitude of the range; counts integers in
``[0, MAX_COUNT]`` and consistent with each other), the sample's safetensors header checked before torch reads
it, and the statistics must cover exactly the program's measured nodes (``check_calibration``,
``check_coverage``). Each measurement gets an identity (``parts``: a random id, or a file's sha256 for files
written before ids): merging two values that share a part (a file merged with itself, whatever ``keep``) is
refused, as is merging two that hold the same kept batch.

Input: batches' outputs (``NodeStats.update``), calibrations, files. Output: merged values, files, one-line
PrecastErrors for a foreign or corrupt file.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from precast.dtypes import dtype_name
from precast.errors import PrecastError
from precast.io import write_bytes, write_tensors

FORMAT, VERSION = "precast-calibration", 1


# batches kept from the single pass over the calibration data for the tolerance search (several forwards each)
TOLERANCE_BATCHES = 8
MAX_COUNT = (
    2**62
)  # counts in a file: integers in [0, MAX_COUNT] (int64 after a distributed sum of a few ranks)


def new_part() -> str:
    """A fresh measurement id (``Calibration.parts``)."""
    return uuid.uuid4().hex


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
    # the measurements merged into this value: a random id each (a file written before ids: its sha256); two
    # values sharing one would count the same batches twice
    parts: tuple[str, ...] = ()

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
            tuple(self.parts),
        )
        for o in others:
            for what, mine, theirs in (("program", out.key, o.key), ("low dtype", out.dtype, o.dtype)):
                if mine != theirs:
                    raise PrecastError(
                        f"cannot merge calibrations of another {what} ({mine or 'none'} and {theirs or 'none'}): "
                        "calibrate every shard on the same program with the same dtype"
                    )
            same = sorted(set(out.parts) & set(o.parts))
            if same:
                raise PrecastError(
                    f"cannot merge calibrations that both hold measurement {same[0][:12]} ({len(same)} shared): "
                    "the same statistics given twice (a file merged with itself, or with a merge that holds it) "
                    "would count their batches twice; merge each shard once"
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
            out.parts = (*out.parts, *o.parts)
        return out

    def save(self, path: str | Path) -> None:
        """The statistics as JSON at ``path``; the kept sample's tensors, if any, in
        ``<stem>.sample.safetensors`` beside it. Read back with ``precast.load_calibration``."""
        save_calibration(self, path)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


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
        "parts": list(cal.parts),
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


def measured_nodes(graph: torch.fx.Graph) -> list[str]:
    """The nodes calibration measures, in graph order: every placeholder and op but export's dtype asserts."""
    return [
        n.name
        for n in graph.nodes
        if n.op in ("placeholder", "call_function")
        and n.target is not torch.ops.aten._assert_tensor_metadata.default
    ]


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_coverage(cal: Calibration, names: list[str], where: str) -> None:
    """One line unless ``cal`` has statistics of exactly ``names`` (``measured_nodes``): a node the program lacks
    would be ignored, a missing one decided without data; a calibration of no batch (a shard with no data) may
    hold none."""
    want = set(names)
    extra = sorted(set(cal.stats) - want)
    if extra:
        raise PrecastError(
            f"{where}: statistics of {len(extra)} node(s) the program does not have ({_few(extra)}); "
            "calibrate this program (precast.calibrate on the same program or module and inputs)"
        )
    missing = [n for n in names if n not in cal.stats]
    if missing and cal.batches:
        raise PrecastError(
            f"{where}: no statistics for {len(missing)} of the program's {len(names)} measured node(s) "
            f"({_few(missing)}); calibrate this program again (a calibration measures every node)"
        )


def check_calibration(
    cal: Calibration, key: str, low: torch.dtype | None, where: str, names: list[str] | None = None
) -> None:
    """One line if ``cal`` was measured on another program or for another low dtype, or (``names``: the
    program's ``measured_nodes``) holds statistics of nodes the program does not have."""
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
    if names is not None:
        extra = sorted(set(cal.stats) - set(names))
        if extra:
            check_coverage(cal, names, where)
