"""``precast.sensitivity(..., weight_formats=("int8", "int4"))``: which weights can be stored in 8 or 4 bits, and
what each choice costs.

Every linear/embedding weight's estimated output error in every format (``precast.numerics.weight_sensitivity``:
the exact rounding against the fp32 program's Fisher information on the calibration batches), the greedy order
that upgrades the weight removing the most error per byte first, the estimated curve of error against bytes along
it, a few of its points measured on real conversions (``convert(..., weight_format=plan)``, run and compared with
the fp32 program: KLD, top-1 agreement and, given token ids, perplexity), and optionally the ablation truth (each
weight alone in one format) with the rank correlation of estimate and truth. ``plan(...)`` turns a budget into a
portable ``Plan`` (its ``weights``), which ``convert(..., plan=...)`` applies without measuring again.

Input: a program or module, calibration batches, evaluation batches for the measured points. Output:
``WeightSensitivity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.api import convert_with
from precast.dtypes import dtype_name, parse_low_dtype
from precast.errors import PrecastError
from precast.ir.weight_formats import FLOAT, parse_format
from precast.metrics import next_token_metrics
from precast.numerics.weight_sensitivity import (
    Allocation,
    WeightCosts,
    ablate,
    allocate,
    estimate_costs,
    spearman,
)
from precast.pipeline.capture import capture
from precast.pipeline.options import ConvertOptions
from precast.policy.plan import Plan


@dataclass
class CurvePoint:
    """One plan on the greedy path: bytes and estimated error, and (``measured``) what a real conversion gave."""

    bytes: int
    bits_per_weight: float
    estimate: float
    measured: dict = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)  # format -> number of weights


@dataclass
class WeightSensitivity:
    costs: WeightCosts
    policy: Any
    dtype: str
    curve: list[CurvePoint] = field(default_factory=list)
    spearman: float | None = None  # estimate vs ablation truth, over the weights (ablation=)
    ablation_format: str | None = None

    @property
    def elements(self) -> int:
        return sum(torch.Size(w.shape).numel() for w in self.costs.weights.values())

    def ranked(self, fmt: str) -> list[tuple[str, float]]:
        """The weights by estimated error in ``fmt``, worst first."""
        f = parse_format(fmt).name
        rows = [(n, w.estimate[f]) for n, w in self.costs.weights.items() if f in w.estimate]
        return sorted(rows, key=lambda r: -r[1])

    def allocation(
        self,
        *,
        kld: float | None = None,
        mse: float | None = None,
        bytes: float | None = None,
        bits: float | None = None,
    ) -> Allocation:
        """The cheapest formats under one budget (as ``precast.WeightBudget``'s)."""
        given = [v for v in (kld, mse, bytes, bits) if v is not None]
        if len(given) != 1:
            raise PrecastError("give exactly one budget: kld=, mse=, bytes= or bits=")
        if bits is not None:
            bytes = bits * self.elements / 8
        if bytes is not None:
            return allocate(self.costs, max_bytes=bytes)
        return allocate(self.costs, error=kld if kld is not None else mse)

    def plan(self, **budget: float) -> Plan:
        """The allocation under ``budget`` as a portable plan (``convert(..., plan=...)`` applies it)."""
        chosen = self.allocation(**budget)
        policy = (
            self.policy if isinstance(self.policy, str) else "regions" if self.policy is None else "rules"
        )
        return Plan(self.dtype, [], policy, "precast sensitivity (weights)", dict(chosen.formats))

    def to_dict(self) -> dict:
        return {
            "metric": self.costs.metric,
            "probes": self.costs.probes,
            "positions": self.costs.positions,
            "seconds": self.costs.seconds,
            "spearman": self.spearman,
            "ablation_format": self.ablation_format,
            "weights": [
                {
                    "name": w.name,
                    "shape": list(w.shape),
                    "bytes": w.bytes,
                    "estimate": w.estimate,
                    "truth": w.truth,
                }
                for w in self.costs.weights.values()
            ],
            "curve": [vars(p) for p in self.curve],
        }


def _counts(formats: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in formats.values():
        out[f] = out.get(f, 0) + 1
    return out


def measure_plan(
    source: Any,
    inputs: Any,
    options: ConvertOptions,
    formats: dict[str, str],
    batches: Sequence[Any],
    reference: list,
) -> dict:
    """A real conversion with ``formats`` (one rule per weight), run on ``batches`` against the fp32 ``reference``
    outputs (their first floating output): the next-token metrics, perplexity when the first input is token ids."""
    rules = {n.replace("[", "[[]").replace("*", "[*]").replace("?", "[?]"): f for n, f in formats.items()}
    opts = ConvertOptions(**{**vars(options), "weight_format": rules, "verify": False})
    res = convert_with(source, inputs, opts)
    module = res.program.module()
    totals: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        for batch, ref in zip(batches, reference, strict=True):
            out = _first_float(module(*batch))
            ids = (
                batch[0]
                if batch and isinstance(batch[0], torch.Tensor) and not batch[0].is_floating_point()
                else None
            )
            labels = None
            if ids is not None and ids.shape == out.shape[:-1]:
                labels = torch.cat([ids[..., 1:], torch.full_like(ids[..., :1], -100)], -1)
            m = next_token_metrics(out, ref, labels)
            n = m.pop("positions")
            for k, v in m.items():
                totals[k] = (
                    totals.get(k, 0.0)
                    + (v if k not in ("ppl", "reference_ppl") else torch.tensor(v).log().item()) * n
                )
            count += n
    out = {k: v / count for k, v in totals.items()}
    for k in ("ppl", "reference_ppl"):
        if k in out:
            out[k] = float(torch.tensor(out[k]).exp())
    out["weight_bytes"] = sum(r["bytes_after"] for r in res.report.weight_formats)
    return out


def _first_float(out: Any) -> torch.Tensor:
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.float()
    raise PrecastError("weight sensitivity: the program has no floating output to measure")


def weight_sensitivity(
    program_or_module: Any,
    inputs: Any,
    *,
    data: Iterable[Any],
    formats: Sequence[str] = ("int4", "int8"),
    policy: Any = "torch",
    dtype: Any = None,
    metric: str = "kld",
    probes: int = 8,
    evaluate: Iterable[Any] | None = None,
    measure_bits: Sequence[float] = (),
    ablation: bool = False,
    ablation_format: str | None = None,
) -> WeightSensitivity:
    """Estimate every weight's cost per format on ``data`` (calibration batches); measure real conversions at the
    all-cheapest plan, at ``measure_bits`` (bits per weight budgets) and all-float on ``evaluate`` batches (default:
    ``[inputs]``); with ``ablation``, each weight alone in ``ablation_format`` (default: the first format) on the
    evaluation batches, and the Spearman correlation of estimate and truth."""
    low = parse_low_dtype(dtype) or torch.bfloat16
    float_dtype = low if policy is not None else torch.float32
    batch = inputs if isinstance(inputs, tuple) else (inputs,)
    ep = program_or_module
    if isinstance(program_or_module, torch.nn.Module):
        ep = capture(program_or_module, batch, None).program
    fmts = [parse_format(f, "weight_formats").name for f in formats]
    costs = estimate_costs(ep, list(data), fmts, float_dtype=float_dtype, metric=metric, probes=probes)
    result = WeightSensitivity(costs, policy, dtype_name(low))
    evaluation = [
        b if isinstance(b, tuple) else (b,) for b in (evaluate if evaluate is not None else [batch])
    ]
    with torch.no_grad():
        module = ep.module()
        reference = [_first_float(module(*b)) for b in evaluation]
    options = ConvertOptions(policy=policy, dtype=dtype)
    plans = [allocate(costs, error=float("inf"))]  # every weight in its cheapest format
    for bits in measure_bits:
        plans.append(result.allocation(bits=bits))
    plans.append(allocate(costs, formats=(FLOAT.name,), error=0.0))
    for alloc in plans:
        point = CurvePoint(
            alloc.bytes, 8 * alloc.bytes / result.elements, alloc.estimate, formats=_counts(alloc.formats)
        )
        point.measured = measure_plan(
            program_or_module, inputs, options, alloc.formats, evaluation, reference
        )
        result.curve.append(point)
    if ablation:
        f = ablation_format or fmts[0]
        ablate(ep, evaluation, costs, f)
        names = [n for n, w in costs.weights.items() if f in w.truth]
        result.spearman = spearman(
            [costs.weights[n].estimate[f] for n in names], [costs.weights[n].truth[f] for n in names]
        )
        result.ablation_format = f
    return result
