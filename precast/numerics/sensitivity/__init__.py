"""Op sensitivity: per op a policy runs in low precision, the output error its rounding causes, ranked, with the
cumulative curve (``ranking``: ``estimate``, ``ablate``), the estimator that measures it (``estimator``), and the
plain records it returns (``results``: ``Estimate``, ``OpSensitivity``, ``CurvePoint``, the metrics).

The public face (what ``precast.explain`` and ``precast.report`` use); the method is described in
``precast.numerics.sensitivity.ranking``.
"""

from precast.numerics.sensitivity.estimator import Estimator
from precast.numerics.sensitivity.ranking import CURVE_FRACTIONS, ablate, estimate
from precast.numerics.sensitivity.results import (
    METRICS,
    CurvePoint,
    Estimate,
    OpSensitivity,
    metric_value,
)

__all__ = [
    "CURVE_FRACTIONS",
    "METRICS",
    "CurvePoint",
    "Estimate",
    "Estimator",
    "OpSensitivity",
    "ablate",
    "estimate",
    "metric_value",
]
