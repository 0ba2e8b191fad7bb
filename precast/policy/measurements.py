"""The values measurement hands a policy, as data: a program's calibration statistics (``NodeStats`` per node, a
mergeable ``Calibration``, written to files by ``save_calibration``) and the tolerance search's bounds and outcome
(``Tolerance``, ``ToleranceResult``). The code that measures them, reads their files back and runs the search is
``precast.numerics``; the values live here, below the policies that read them.

A ``Calibration`` records the program its node names mean (``key``: ``precast.ir.graph.graph_key`` of the
program calibration ran on) and the low dtype its subnormal counts are for; merging one with one of another
program or dtype is refused with one line. Its kept sample (the batches the tolerance search runs) is the
globally first ``keep`` batches, each tagged with its global index, so merged shards keep the batches one
process over the same data would keep, in the same order. Each measurement gets an identity (``parts``: a random
id, or a file's sha256 for files written before ids): merging two values that share a part (a file merged with
itself, whatever ``keep``) is refused, as is merging two that hold the same kept batch.

Files: JSON (format ``precast-calibration``) for the statistics; the sample's tensors in a safetensors file
beside it (``<stem>.sample.safetensors``, named and hashed in the JSON). Nothing is pickled: a batch's structure
is a pytree spec in JSON, its tensors safetensors, its other leaves JSON values (read back, as untrusted input,
by ``precast.numerics.calibration.files``).

Input: batches' outputs (``NodeStats.update``), calibrations, the search's measurements. Output: merged values,
files, summaries; one-line PrecastErrors for values that cannot merge.
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
import torch.utils._pytree as pytree

from precast.errors import PrecastError
from precast.io import write_bytes, write_tensors

FORMAT, VERSION = "precast-calibration", 1

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


@dataclass
class Tolerance:
    """The bounds of a tolerance (``precast.numerics.tolerance.search.parse_tolerance``): all must hold."""

    spec: dict

    def met(self, m: dict) -> bool:
        return all((m["cosine"] >= lim) if k == "cosine" else (m[k] <= lim) for k, lim in self.spec.items())

    def parts(self, m: dict) -> dict[str, float]:
        """Per bound, the error as a fraction of what it allows (> 1: violated)."""
        out = {}
        for k, lim in self.spec.items():
            if k == "cosine":
                out[k] = (1.0 - m["cosine"]) / max(1.0 - lim, 1e-300)
            else:
                out[k] = m[k] / lim if lim > 0 else (0.0 if m[k] == 0 else math.inf)
        return out

    def score(self, m: dict) -> float:
        """Error as a fraction of what the tolerance allows (> 1: violated), the worst bound."""
        return max(self.parts(m).values())

    def describe(self, m: dict) -> str:
        return ", ".join(f"{k} {m[k]:.6g}" for k in self.spec)


@dataclass
class ToleranceResult:
    """What the tolerance search kept in fp32, the errors it measured on the way and what it cost."""

    tolerance: Tolerance
    all_low: dict  # errors with no fallback
    floor: dict | None = None  # errors with every candidate in fp32 (when the search measured it)
    achieved: dict | None = None  # errors of the program the search chose, as it measured them
    kept: dict = field(default_factory=dict)  # node -> estimated share of the all-low error (of the allowed)
    candidates: int = 0
    tries: int = 0  # programs measured besides the all-low one
    forwards: int = 0  # forwards of a program over the search's batches: reference, all-low, tries, check
    backwards: int = 0  # backward passes of the instrumented reference forward (gradient probes)
    seconds: float = 0.0  # the search's wall time (the check's added by tolerance_check)
    refs: list = field(default_factory=list)
    final: dict | None = None  # errors of the converted program (tolerance_check)
    ranked_by: str = ""  # how the ranking was estimated
    measured: dict = field(default_factory=dict)  # prefix length -> errors

    def summary(self) -> str:
        t = self.tolerance
        cost = f"{self.forwards} forwards, {self.seconds:.1f} s"
        if not self.kept:
            return f"tolerance {t.spec} met with no fallback ({t.describe(self.all_low)}; {cost})"
        names = ", ".join(self.kept)
        return (
            f"tolerance {t.spec}: all-low {t.describe(self.all_low)}; kept {len(self.kept)} of {self.candidates} "
            f"candidate op(s) in fp32 ({names}) -> {t.describe(self.achieved)} ({self.tries} tries, {cost}; "
            f"ranked by {self.ranked_by})"
        )
