"""The tolerance search, its logic: which ops to keep in fp32 so the outputs meet a tolerance.

``tolerance`` is a dict of one or more bounds, all of which must hold on every batch the search uses (the first
``TOLERANCE_BATCHES`` calibration batches, kept from the single streaming pass) and every user output (compared
with the unconverted program, in float64):

- ``{"max_abs": 1e-2}``: largest absolute elementwise error;
- ``{"rel": 1e-3}``: largest relative L2 error ``||y - y_ref|| / ||y_ref||`` of an output;
- ``{"cosine": 0.9999}``: smallest cosine similarity between output vectors along the last dimension
  (e.g. one per sentence embedding; a 0-d or 1-d output is one vector).

Pure logic, no program is run here: ``precast.numerics.tolerance.stage`` measures (it converts each try exactly as
the conversion will and runs it) and estimates, from one instrumented reference forward, how much output error
each rounding to the low dtype carries (``Source``). Here:

1. ``rank``: the order in which to move candidates to fp32. A value one op reads from another is rounded to
   the low dtype unless the op that makes it (through views and other dtype-following ops) and the op that
   reads it both run in fp32, so a ``Source`` (one such read, its estimated error energy) goes only when all
   its ``members`` are kept; the order greedily adds the source (or the rest of its members) that removes the
   most energy per op added (a residual add and the layer_norm reading it come together).
2. ``meet_tolerance``: with the energies as a model of the error (``score ~ energy_left ** power``, calibrated
   by every measurement), the fewest top-ranked candidates that meet the tolerance are bracketed and bisected
   with predicted, not halved, steps: about 3-5 measured tries (``TRIES``, then only while the bracket is wider
   than a quarter of the prefix). The matmul/conv family is never moved (exclude
   such an op explicitly with ``exclude_nodes`` if that is what it takes); when every candidate in fp32 still
   misses the tolerance: PrecastError ``tolerance-unmet``.

The tolerance's bounds and the search's result (``Tolerance``, ``ToleranceResult``) are data the policy reads:
``precast.policy.measurements``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from precast.errors import PrecastError
from precast.policy.measurements import Tolerance, ToleranceResult

KEYS = ("max_abs", "rel", "cosine")
# error ~ energy ** POWER: 1 - cosine grows with the squared error, max_abs and rel with the error itself
POWER = {"cosine": 1.0, "rel": 0.5, "max_abs": 0.5}
# measured prefixes after the all-low program before the search settles for a bracket within a quarter of the
# prefix (it always stops at a bracket of one): with the reference and the all-low forwards, 2 + TRIES forwards
TRIES = 5


def parse_tolerance(tolerance: Any) -> Tolerance | None:
    if tolerance is None:
        return None
    if not isinstance(tolerance, dict) or not tolerance:
        raise PrecastError(
            f"tolerance={tolerance!r}: give a dict of bounds, e.g. {{'max_abs': 1e-2}}, {{'rel': 1e-3}} or "
            "{'cosine': 0.9999} (several keys: all must hold)"
        )
    spec = {}
    for k, v in tolerance.items():
        if k not in KEYS:
            raise PrecastError(f"tolerance: unknown bound {k!r}; use {', '.join(KEYS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise PrecastError(f"tolerance[{k!r}]={v!r}: give a finite number >= 0")
        if k == "cosine" and not (0 < v < 1):
            raise PrecastError(
                f"tolerance['cosine']={v!r}: give a similarity between 0 and 1 (exclusive), e.g. 0.9999"
            )
        spec[k] = float(v)
    return Tolerance(spec)


@dataclass(frozen=True)
class Source:
    """One read of a value rounded to the low dtype: ``energy``, its estimated share of the output error (any
    unit, the same for every source), and ``members``, the ops that must all run in fp32 for it to go (those
    that make the value and the one that reads it; an op the search may not move makes the source fixed)."""

    energy: float
    members: frozenset
    name: str = ""


@dataclass
class Ranking:
    """Candidates in the order the search moves them to fp32, with each one's energy gain when added and the
    energy left after each prefix (``left[k]``: with ``order[:k]`` in fp32; ``left[0]`` is the total)."""

    order: list[str]
    gain: dict[str, float]
    left: list[float]
    fixed: float  # energy no candidate can remove (matmuls, regions, ops other rules keep low)


def rank(candidates: Sequence[str], sources: Sequence[Source]) -> Ranking:
    """Greedy cover: repeatedly keep the members of the source whose completion removes the most energy per op
    added; candidates no source needs follow in their given (graph) order."""
    cand = set(candidates)
    movable = [s for s in sources if s.members and s.members <= cand]
    fixed = sum(s.energy for s in sources if not (s.members and s.members <= cand))
    touching: dict[str, list[int]] = {c: [] for c in candidates}  # candidate -> sources it is a member of
    for i, s in enumerate(movable):
        for c in s.members:
            touching[c].append(i)
    pos = {c: i for i, c in enumerate(candidates)}
    kept: set = set()
    pending = set(range(len(movable)))
    order: list[str] = []
    gain: dict[str, float] = {}
    left = [fixed + sum(s.energy for s in movable)]
    cached: dict[int, tuple[float, frozenset]] = {}  # source -> (energy removed per op added, ops to add)

    def completion(i: int) -> tuple[float, frozenset]:
        need = movable[i].members - kept
        near = {j for c in need for j in touching[c] if j in pending}
        got = sum(movable[j].energy for j in near if movable[j].members <= kept | need)
        return got / len(need), need

    while pending:
        for i in pending - cached.keys():
            cached[i] = completion(i)
        best = max(pending, key=lambda i: (cached[i][0], -i))
        ratio, need = cached[best]
        for c in sorted(need, key=pos.__getitem__):
            order.append(c)
            gain[c] = ratio
            kept.add(c)
            done = {j for j in touching[c] if j in pending and movable[j].members <= kept}
            pending -= done
            left.append(max(left[-1] - sum(movable[j].energy for j in done), 0.0))
            # completions that read c (or a source c completes) change: computed again when needed
            for j in {k for t in touching[c] for m in movable[t].members for k in touching[m]}:
                cached.pop(j, None)
    for c in candidates:
        if c not in kept:
            order.append(c)
            gain[c] = 0.0
            left.append(left[-1])
    return Ranking(order, gain, left, fixed)


def _target_left(tol: Tolerance, points: list[tuple[float, dict]], goal: float) -> float:
    """Energy left at which the model puts every bound at ``goal`` (a fraction of what it allows), from the
    measured (energy left, errors) points nearest the boundary: power-law interpolation between a miss and a
    meet, else extrapolation from the one point."""
    want = math.inf
    for key, p in ((k, POWER[k]) for k in tol.spec):
        miss = [(e, tol.parts(m)[key]) for e, m in points if tol.parts(m)[key] > goal]
        meet = [(e, tol.parts(m)[key]) for e, m in points if tol.parts(m)[key] <= goal]
        lo = min(miss, key=lambda x: x[0]) if miss else None  # the miss with the least energy left
        hi = max(meet, key=lambda x: x[0]) if meet else None  # the meet with the most energy left
        if lo is None:
            continue  # this bound holds everywhere measured
        e_lo, s_lo = lo
        if not (e_lo > 0 and math.isfinite(s_lo)):
            want = min(want, 0.0)
            continue
        if hi is not None and hi[0] > 0 and hi[1] > 0 and hi[0] < e_lo and s_lo > hi[1]:
            e_hi, s_hi = hi
            slope = (math.log(s_lo) - math.log(s_hi)) / (math.log(e_lo) - math.log(e_hi))
            want = min(want, math.exp(math.log(e_lo) + (math.log(goal) - math.log(s_lo)) / slope))
        else:
            want = min(want, e_lo * (goal / s_lo) ** (1.0 / p))
    return want


def meet_tolerance(
    tol: Tolerance,
    candidates: Sequence[str],
    sources: Sequence[Source],
    measure: Callable[[dict[str, float]], dict],
    *,
    tries: int = TRIES,
    ranked_by: str = "first-order sensitivity",
) -> ToleranceResult:
    """The fewest top-ranked ``candidates`` to keep in fp32 for ``tol``. ``measure(kept)`` converts and runs the
    program with ``kept`` (node -> score) in fp32 and returns its errors (``WorstError.m``); it is called first
    with ``{}`` (the all-low program), then once per try. After ``tries`` tries the shortest prefix found that
    meets the tolerance is returned once the bracket is within a quarter of it (more are taken until then)."""
    base = measure({})
    result = ToleranceResult(
        tol, all_low=base, achieved=base, candidates=len(candidates), ranked_by=ranked_by
    )
    result.measured[0] = base
    if tol.met(base):
        return result
    search = _ranked(tol, candidates, sources, result)
    while search.open(tries):
        k = _next_try(search)
        _record(search, k, measure(search.kept(k)))
    return _settled(search)


@dataclass
class _Bracket:
    """The search between tries: the ranked candidates, the energy left after each prefix, each candidate's
    share of the all-low error, and the bracket (``order[:lo]`` misses the tolerance; ``order[:hi]`` meets it)."""

    tol: Tolerance
    order: list[str]
    left: list[float]
    shares: dict[str, float]
    result: ToleranceResult
    informed: bool  # the energies say which prefix removes what
    lo: int = 0
    hi: int | None = None

    def kept(self, k: int) -> dict[str, float]:
        """The first ``k`` candidates, each with its share."""
        return {c: self.shares[c] for c in self.order[:k]}

    def open(self, tries: int) -> bool:
        """Whether to measure another prefix: stop at a bracket of one, or after ``tries`` tries at a bracket
        within a quarter of the prefix."""
        lo, hi = self.lo, self.hi
        return bool(self.order) and (
            hi is None or (hi - lo > 1 and (self.result.tries < tries or hi - lo > max(1, hi // 4)))
        )


def _ranked(
    tol: Tolerance, candidates: Sequence[str], sources: Sequence[Source], result: ToleranceResult
) -> _Bracket:
    """The candidates ranked, each one's estimated share of the all-low error (of what the tolerance allows)."""
    ranking = rank(candidates, sources)
    order, left = ranking.order, ranking.left
    total = left[0] if left[0] > 0 else 1.0
    base_score = tol.score(result.all_low)
    shares = {c: base_score * ranking.gain[c] / total for c in order}
    return _Bracket(tol, order, left, shares, result, informed=left[0] > left[len(order)])


def _next_try(search: _Bracket) -> int:
    """The prefix to measure next: where the energies' model puts the boundary (bisection without energies)."""
    lo, hi, left, n = search.lo, search.hi, search.left, len(search.order)
    if not search.informed:
        return (lo + hi) // 2 if hi is not None else min(max(1, 2 * lo), n)
    points = [(left[k], m) for k, m in search.result.measured.items()]
    goal = 1.0 if hi is not None else 0.95  # a small margin while nothing meets it yet
    want = _target_left(search.tol, points, goal)
    k = next((i for i in range(n + 1) if left[i] <= want), n)
    if hi is None:  # predicted, but at least doubling: a poor estimate costs log2(n) misses at most
        return min(max(k, lo + 1, 2 * lo), n)
    # predicted, but at least a quarter of the bracket in from either end
    step = (hi - lo) // 4
    return min(max(k, lo + 1 + step), hi - 1 - step)


def _record(search: _Bracket, k: int, m: dict) -> None:
    """One try's errors: the bracket narrows; every candidate in fp32 still missing the tolerance ends it."""
    tol, result = search.tol, search.result
    result.measured[k] = m
    result.tries += 1
    if tol.met(m):
        search.hi = k
        return
    search.lo = k
    if k == len(search.order):
        result.floor = m
        raise PrecastError(
            f"tolerance {tol.spec} cannot be met: with every op but the matmul/conv family in fp32 the "
            f"outputs still measure {tol.describe(m)} (all low precision: {tol.describe(result.all_low)}); loosen "
            "the tolerance, or exclude matmuls/convolutions explicitly with exclude_nodes / exclude_ops",
            code="tolerance-unmet",
        )


def _settled(search: _Bracket) -> ToleranceResult:
    """The result: the shortest prefix found that meets the tolerance, its errors and the floor if measured."""
    tol, result, n = search.tol, search.result, len(search.order)
    if search.hi is None:  # no candidates at all
        raise PrecastError(
            f"tolerance {tol.spec} cannot be met: the outputs measure {tol.describe(result.all_low)} and no op "
            "outside the matmul/conv family runs in low precision; loosen the tolerance, or exclude "
            "matmuls/convolutions explicitly with exclude_nodes / exclude_ops",
            code="tolerance-unmet",
        )
    if n in result.measured:
        result.floor = result.measured[n]
    result.kept = search.kept(search.hi)
    result.achieved = result.measured[search.hi]
    return result
