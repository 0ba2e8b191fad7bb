"""Sensitivity energies as a mergeable value: per tapped read (value, reader), the expected output error its
rounding to the low dtype causes (``precast.numerics.probes.probe_energies``), summed over batches, and per
ranked op its value range; merged by summing (ranges: max / min / sums), saved as JSON.

Energies over several batches are the **mean** of the per-batch energies (``Energies.mean``: the sum over every
batch of every shard, divided by the number of batches once, after the sums are merged): the expected error on a
typical batch, in the units one batch gives, so the metric (``Estimator.to_metric``) reads the same with one batch
or many. One process over batches B and shards over a partition of B sum the same per-batch energies in another
order: equal to float64 rounding (a relative 1e-12 bounds it for the batch counts calibration uses), not bitwise.

Input: per-batch energies and ranges (``add``), other ``Energies``, a JSON file. Output: ``Energies``; one-line
PrecastError for a foreign or corrupt file, or energies of another program, policy, dtype or metric.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precast.errors import PrecastError
from precast.io import write_bytes
from precast.numerics.calibration import read_json_file

FORMAT, VERSION = "precast-energies", 1
# "underflow" when more than this share of an op's nonzero values are below the low dtype's normals
UNDERFLOW_SHARE = 0.01
Range = (
    tuple  # (absmax, smallest nonzero |value| or None, nonzero values below the low dtype's normals, nonzero)
)


def merge_range(a: Range, b: Range) -> Range:
    mins = [x for x in (a[1], b[1]) if x is not None]
    return (max(a[0], b[0]), min(mins) if mins else None, a[2] + b[2], a[3] + b[3])


@dataclass
class Energies:
    """``energy``: (value, reader) -> the sum over ``batches`` batches of that read's energy; ``ranges``: ranked op
    -> its value range over them. ``key``: the program, policy, low dtype, metric and ranked ops they are for."""

    key: str
    dtype: str
    metric: str
    batches: int = 0
    energy: dict[tuple[str, str], float] = field(default_factory=dict)
    ranges: dict[str, Range] = field(default_factory=dict)
    ranked_by: str = "first-order sensitivity"

    def add(self, energy: dict[tuple[str, str], float], ranges: dict[str, Range]) -> None:
        """One more batch's energies and ranges."""
        for k, v in energy.items():
            self.energy[k] = self.energy.get(k, 0.0) + v
        for k, r in ranges.items():
            self.ranges[k] = merge_range(self.ranges[k], r) if k in self.ranges else r
        self.batches += 1

    def mean(self) -> dict[tuple[str, str], float]:
        """Per read, the energy on a typical batch: the summed energy over the number of batches."""
        n = max(self.batches, 1)
        return {k: v / n for k, v in self.energy.items()}

    def merge(self, *others: Energies) -> Energies:
        """These energies and ``others``': sums added, ranges merged (refused for another key)."""
        out = Energies(
            self.key,
            self.dtype,
            self.metric,
            self.batches,
            dict(self.energy),
            dict(self.ranges),
            self.ranked_by,
        )
        for o in others:
            if (o.key, o.dtype, o.metric) != (out.key, out.dtype, out.metric):
                raise PrecastError(
                    f"cannot merge energies of another program, policy or metric ({o.dtype} {o.metric} {o.key} "
                    f"and {out.dtype} {out.metric} {out.key}): measure every shard with the same model and options"
                )
            out.batches += o.batches
            for k, v in o.energy.items():
                out.energy[k] = out.energy.get(k, 0.0) + v
            for k, r in o.ranges.items():
                out.ranges[k] = merge_range(out.ranges[k], r) if k in out.ranges else r
            if o.ranked_by != out.ranked_by:
                out.ranked_by = o.ranked_by if out.ranked_by.startswith("first-order") else out.ranked_by
        return out

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "key": self.key,
            "dtype": self.dtype,
            "metric": self.metric,
            "batches": self.batches,
            "ranked_by": self.ranked_by,
            "energy": [[v, r, e] for (v, r), e in self.energy.items()],
            "ranges": {k: list(r) for k, r in self.ranges.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Energies:
        energy = {}
        for v, r, e in d["energy"]:
            e = float(e)
            if not math.isfinite(e) or e < 0:
                raise ValueError(f"energy {e!r} of {v}->{r}")
            energy[(str(v), str(r))] = e
        ranges = {
            str(k): (float(a), None if m is None else float(m), int(s), int(z))
            for k, (a, m, s, z) in d["ranges"].items()
        }
        return cls(
            str(d["key"]),
            str(d["dtype"]),
            str(d["metric"]),
            int(d["batches"]),
            energy,
            ranges,
            str(d["ranked_by"]),
        )

    def save(self, path: str | Path) -> None:
        """As JSON (format ``precast-energies``), written whole; read back with ``precast.load_energies``."""
        write_bytes(path, json.dumps(self.to_dict(), indent=1).encode())


def load_energies(source: Any) -> Energies:
    """``Energies``, or the path of a file ``Energies.save`` wrote."""
    if isinstance(source, Energies):
        return source
    if not isinstance(source, (str, Path)):
        raise PrecastError(f"energies: {source!r} is neither precast Energies nor the path of a saved one")
    path = Path(source)
    hint = "write it with precast.sensitivity(...).energies.save(path)"
    doc = read_json_file(path, "energies", FORMAT, hint, VERSION)
    try:
        return Energies.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PrecastError(f"energies {path}: malformed ({type(exc).__name__}: {exc}); {hint}") from exc


def range_status(rng: tuple | None, finfo: Any, low: str) -> tuple[str, str]:
    """("overflow" | "underflow" | "fine", why) of an op's value range in the low dtype (``finfo``)."""
    if rng is None:
        return "fine", ""
    absmax, absmin, small, nonzero = rng
    if absmax > finfo.max:
        return "overflow", f"|values| reach {absmax:.3g}, beyond {low}'s ±{finfo.max:.6g}"
    if nonzero and small / nonzero > UNDERFLOW_SHARE:
        return "underflow", (
            f"{small / nonzero:.1%} of its nonzero values (as small as {absmin:.3g}) are below {low}'s smallest "
            f"normal {finfo.tiny:.3g}: subnormal or flushed to zero"
        )
    return "fine", ""
