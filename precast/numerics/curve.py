"""The one point of a sensitivity curve (``CurvePoint``), for what ranks ops and what ranks weights alike.

A sensitivity ranking walks a greedy path of plans, each keeping more of the program precise than the one before:
op sensitivity keeps the first ``k`` ops of its order in fp32 (``precast.numerics.sensitivity``), weight
sensitivity upgrades the weight that removes the most error per byte (``precast.quant.sensitivity``). A point is
one plan on that path: what it costs, its estimated error, and what a real conversion measured when one ran.

Input: what a ranking computes. Output: the plain record its curve is a list of.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CurvePoint:
    """One plan on a sensitivity curve's greedy path.

    ``estimate``: its estimated error, in the ranking's metric; ``measured``: that metric measured on a real
    conversion of the plan (None until measured). What the plan keeps: ``k`` (op sensitivity: the first k ops of
    the greedy order in fp32), or ``bytes``, ``bits_per_weight`` and ``formats`` (weight sensitivity: the bytes
    the weights take, per weight element, and format -> number of weights). ``metrics``: every metric the
    measurement gave, by name (weight sensitivity's kld, mse, top1, ppl), ``measured`` among them."""

    estimate: float
    measured: float | None = None
    k: int | None = None
    bytes: int | None = None
    bits_per_weight: float | None = None
    formats: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The fields that are set (None and empty left out), JSON-ready."""
        return {k: v for k, v in vars(self).items() if v is not None and v != {}}
