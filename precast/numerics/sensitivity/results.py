"""Sensitivity's results: per ranked op its estimate, range and measured truth (``OpSensitivity``), the points
of the cumulative curve (``CurvePoint``, ``precast.numerics.curve``), the whole estimate (``Estimate``) and the metrics it is read in.

Input: what ``precast.numerics.sensitivity.estimator.Estimator`` and ``precast.numerics.sensitivity.ranking.estimate``
compute. Output: the plain records ``precast.explain`` and ``precast.report.sensitivity`` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from precast.numerics.curve import CurvePoint
from precast.numerics.energies import Energies
from precast.numerics.nonfinite import NonFinite

METRICS = ("rel", "cosine", "max_abs")


@dataclass
class OpSensitivity:
    """One op the policy runs in low precision: its estimated output error when it alone runs low (``estimate``,
    in the metric), its share of the summed estimates, its value range (inputs and output, fp32 reference) and
    what the low dtype does to that range (``status``: "overflow", "underflow" or "fine"), and, when measured
    (``ablate``), the true error with it alone in low precision."""

    name: str
    module: str
    op: str
    location: str | None
    energy: float
    estimate: float
    share: float
    absmax: float | None = None
    absmin: float | None = None  # smallest nonzero |value|
    status: str = "fine"
    note: str = ""
    truth: float | None = None


@dataclass
class Estimate:
    dtype: str
    metric: str
    ops: list[OpSensitivity]  # ranked, most sensitive first
    order: list[str]  # the greedy order in which keeping ops in fp32 removes the most error per op
    curve: list[CurvePoint]  # every k, estimated; measured at a few
    all_low: dict  # measured errors of the policy's program (max_abs, rel, cosine)
    ranked_by: str
    forwards: int = 0
    backwards: int = 0
    conversions: int = 0
    seconds: float = 0.0
    fixed: float = 0.0  # estimated error no op of the ranking can remove
    nonfinite: NonFinite | None = None
    extra: dict = field(default_factory=dict)
    energies: Energies | None = None  # what the ranking was made from (mergeable: precast.numerics.energies)


def metric_value(m: dict, metric: str) -> float:
    """The measured errors (``WorstError.m``) in one metric, larger is worse (cosine: 1 - cosine)."""
    return 1.0 - m["cosine"] if metric == "cosine" else m[metric]
