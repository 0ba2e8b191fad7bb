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
from precast.numerics.calibration.files import count, read_json_file

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
        """Energies from a saved dict, every value checked (ValueError / TypeError / KeyError): energies finite and
        non-negative, ranges a non-negative absmax (infinite where a value was) with the smallest nonzero magnitude in (0, absmax] (or
        None when nothing is nonzero), counts integers in [0, MAX_COUNT] with the small ones among the nonzero."""
        if not isinstance(d["energy"], list) or not isinstance(d["ranges"], dict):
            raise TypeError("energy must be a list of [value, reader, energy] and ranges an object")
        energy = {}
        for item in d["energy"]:
            if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item[:2])):
                raise ValueError(f"energy entry {str(item)[:80]} is not [value, reader, energy]")
            v, r, e = item
            e = _finite(e, f"energy of {v}->{r}")
            if (v, r) in energy:
                raise ValueError(f"energy of {v}->{r} given twice")
            energy[(v, r)] = e
        ranges = {}
        for k, rng in d["ranges"].items():
            if not (isinstance(rng, list) and len(rng) == 4):
                raise ValueError(f"range of {k} is not [absmax, smallest nonzero, small, nonzero]")
            a, m, small, nonzero = rng
            a = _finite(a, f"absmax of {k}", inf=True)
            small, nonzero = count(small, f"small values of {k}"), count(nonzero, f"nonzero values of {k}")
            if m is not None:
                m = _finite(m, f"smallest nonzero of {k}", inf=True)
                if not 0 < m <= a:
                    raise ValueError(f"range of {k}: smallest nonzero {m} is not in (0, absmax {a}]")
            elif nonzero:
                raise ValueError(f"range of {k}: {nonzero} nonzero values but no smallest nonzero")
            if small > nonzero:
                raise ValueError(f"range of {k}: {small} small values of {nonzero} nonzero")
            ranges[str(k)] = (a, m, small, nonzero)
        for f in ("key", "dtype", "metric", "ranked_by"):
            if not isinstance(d[f], str):
                raise TypeError(f"{f} is not a string")
        return cls(
            d["key"], d["dtype"], d["metric"], count(d["batches"], "batches"), energy, ranges, d["ranked_by"]
        )

    def check_covers(self, reads: set[tuple[str, str]], ops: set[str], where: str) -> None:
        """One line unless these energies are of exactly ``reads`` and their ranges of exactly ``ops`` (what a
        measurement on this program records): a read the program lacks has no meaning, a missing one would rank
        as free."""
        for what, have, want in (("read", set(self.energy), reads), ("op range", set(self.ranges), ops)):
            extra, missing = sorted(have - want), sorted(want - have)
            if extra or missing:
                bad = extra or missing
                names = ", ".join("->".join(x) if isinstance(x, tuple) else x for x in bad[:3])
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                raise PrecastError(
                    f"{where}: {'energies of' if extra else 'no energies for'} {len(bad)} {what}(s) "
                    f"{'the program does not have' if extra else 'of the program'} ({names}{more}); measure "
                    "them on this program (precast.sensitivity(..., data=...).energies)"
                )

    def save(self, path: str | Path) -> None:
        """As JSON (format ``precast-energies``), written whole; read back with ``precast.load_energies``."""
        write_bytes(path, json.dumps(self.to_dict(), indent=1).encode())


def _finite(x: Any, what: str, inf: bool = False) -> float:
    """A non-negative number of a file: finite (``inf``: or +infinity, a range reaching an infinite value)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{what} is {x!r}, not a number")
    x = float(x)
    if not ((math.isfinite(x) or (inf and x == math.inf)) and x >= 0):
        raise ValueError(f"{what} is {x!r}, not {'a number' if inf else 'finite and'} >= 0")
    return x


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
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
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
