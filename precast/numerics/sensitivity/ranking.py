"""Sensitivity: per op the policy runs in low precision, the output error its rounding causes; ranked, with the
op's value range against the low dtype's, and the cumulative curve (error left with the top-k ops in fp32).

Input: the input ExportedProgram, a rules policy and what it was prepared with for that program
(``precast.policy.hooks.Binding``: options, calibration), one batch of inputs ((args, kwargs)), the metric ("rel", "cosine" or "max_abs"). Output:
``Estimate`` (ops ranked, the greedy order and its curve, the all-low errors, the cost).

The estimate is the tolerance search's (``precast.numerics.tolerance.stage``): one instrumented forward of the reference
program taps every value each computing op reads (``Tapping``), and ``PROBES`` backward passes of that forward
give, per read, the expected output error its rounding to the low dtype causes (``probe_energies``). A read is
rounded unless every op that makes the value and the op that reads it run in fp32 (``Source.members``), so with
op X alone in low precision (every other op in fp32) exactly the sources X is a member of are rounded: X's
estimate is the sum of their energies. With ``data`` the energies are estimated on each of its batches and the
ranking uses their mean (``precast.numerics.energies``), summed over a process group's ranks first when one is
given (``precast.numerics.distributed``); given ``Energies`` replace the measurement. Unlike the search, the matmul/convolution family is ranked too (the user
asks which op breaks, and may keep any in fp32).

Every program measured here is the one the conversion builds (``policy.bind(..., fallback=kept)`` then
``precast.passes.lower``, its weight casts shared through one ``CastCache``), its graph run on private
copies of the state it writes (``run_lowered``: bitwise what ``check_program`` measures of the exported
program): the measured points of the curve and the single-op ablation (``ablate``) are real conversions, not
simulations. The policy's own program is measured by the watched run that looks for the first non-finite op.
"""

from __future__ import annotations

import time
from typing import Any

from torch.export import ExportedProgram

from precast.dtypes import dtype_name
from precast.numerics.sensitivity.estimator import Estimator
from precast.numerics.sensitivity.results import CurvePoint, Estimate, OpSensitivity, metric_value
from precast.numerics.tolerance.search import rank

# measured curve points: the fewest ops whose estimate leaves this share of the error
CURVE_FRACTIONS = (0.1, 0.5, 0.01)


def estimate(
    ep: ExportedProgram,
    policy: Any,
    binding: Any,
    batch: tuple,
    metric: str = "rel",
    *,
    measure_points: int = 1,
    low: Any = None,
    **more: Any,
) -> tuple[Estimate, Estimator]:
    """Rank, curve (every k estimated; ``measure_points`` of them measured on real conversions), all-low.
    ``low``: the low dtype, for a policy without a binding (torch, or None: the program's regions); ``more``:
    ``data`` (batches to estimate the energies on), ``group`` (to reduce them over), ``given`` (Energies)."""
    start = time.perf_counter()
    est = Estimator(ep, policy, binding, batch, metric, low, **more)
    ops = est.rank_ops()
    ranking = rank(est.candidates, est.sources)
    all_low = est.all_low_errors()
    curve = [CurvePoint(est.to_metric(left), k=k) for k, left in enumerate(ranking.left)]
    curve[0].measured = metric_value(all_low, metric)
    total = ranking.left[0]
    ks: list[int] = []
    for frac in CURVE_FRACTIONS[:measure_points]:
        k = next((i for i, left in enumerate(ranking.left) if left <= total * frac), len(ranking.left) - 1)
        if k > 0 and k not in ks:
            ks.append(k)
    for k in ks:
        kept = dict.fromkeys(ranking.order[:k], 0.0)
        curve[k].measured = metric_value(est.measure(kept), metric)
    result = Estimate(
        dtype_name(est.low),
        metric,
        ops,
        ranking.order,
        curve,
        all_low,
        est.ranked_by,
        forwards=est.forwards,
        backwards=est.backwards,
        conversions=est.conversions,
        fixed=est.to_metric(ranking.fixed),
        nonfinite=est.nonfinite,
    )
    result.seconds, result.energies = time.perf_counter() - start, est.energies
    return result, est


def ablate(est: Estimator, ops: list[OpSensitivity]) -> None:
    """The truth for each op: the program converted with that op alone in low precision (every other op of the
    ranking kept in fp32), measured against the reference. One conversion and one forward per op."""
    everything = dict.fromkeys(est.candidates, 0.0)
    for o in ops:
        kept = {k: v for k, v in everything.items() if k != o.name}
        o.truth = metric_value(est.measure(kept), est.metric)
