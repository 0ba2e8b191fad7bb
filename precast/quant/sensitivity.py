"""``precast.weight_sensitivity(program, inputs, data=...)``: which weights can be stored in 8 or 4 bits, and what
each choice costs (``precast.sensitivity(..., weight_formats=...)`` is its shortcut for one release, with a warning).

Every linear/embedding weight's estimated output error in every format (``precast.quant.estimate``:
the exact rounding against the fp32 program's Fisher information on the calibration batches), the greedy order
that upgrades the weight removing the most error per byte first, the estimated curve of error against bytes along
it, a few of its points measured on real conversions (``convert(..., weight_format=plan)``, run and compared with
the fp32 program: KLD, top-1 agreement and, given token ids, perplexity), and optionally the ablation truth (each
weight alone in one format) with the rank correlation of estimate and truth. ``plan(...)`` turns a budget into a
portable ``Plan`` (its ``weights``), which ``convert(..., plan=...)`` applies without measuring again.

Every option is honoured or refused in one line: ``device_type`` and ``dynamic_shapes`` go to the capture and to
every measured conversion; ``metric`` is "kld" or "mse" (the estimate's; nothing else is measured on weights);
batches are tuples, dicts of keyword inputs or (args, kwargs), bound to the program's own input names as
``convert``'s example inputs are (an LLM program exported with keyword inputs takes ``{"input_ids": ...}``).

Input: a program or module, calibration batches, evaluation batches for the measured points. Output:
``WeightSensitivity``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.api import convert_with
from precast.dtypes import dtype_name, parse_low_dtype
from precast.errors import PrecastError
from precast.ir.inputs import bind_inputs
from precast.metrics import next_token_metrics
from precast.numerics.curve import CurvePoint
from precast.pipeline.capture import capture
from precast.pipeline.options import ConvertOptions
from precast.policy.plan import Plan
from precast.quant.estimate import (
    METRICS,
    Allocation,
    WeightCosts,
    ablate,
    allocate,
    estimate_costs,
    spearman,
)
from precast.quant.fit import fit_int4
from precast.quant.formats import FLOAT, WeightFormat, parse_format
from precast.quant.rules import WeightRules

ROUNDINGS = ("data", "rtn")  # how int4 weights are rounded (precast.quant.budget's)


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
            "curve": [p.to_dict() for p in self.curve],
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
    batches: Sequence[tuple[tuple, dict]],
    reference: list,
    fitted: Any = None,
) -> dict:
    """A real conversion with ``formats`` (one rule per weight), run on ``batches`` ((args, kwargs), bound to the
    program's inputs) against the fp32 ``reference`` outputs (their first floating output): the next-token
    metrics, perplexity when the first integer input holds the token ids. ``fitted``: int4 parts fitted on data,
    stored where they cover a weight (``precast.quant.fit``)."""
    rules = dataclasses.replace(WeightRules.exact(formats, "the measured plan"), fitted=fitted)
    opts = dataclasses.replace(options, weight_format=rules, verify=False)
    res = convert_with(source, inputs, opts)
    module = res.program.module()
    totals: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        for (args, kwargs), ref in zip(batches, reference, strict=True):
            out = _first_float(module(*args, **kwargs))
            ids = next((t for t in (*args, *kwargs.values()) if _is_ids(t)), None)
            labels = None
            if ids is not None and ids.shape == out.shape[:-1]:
                labels = torch.cat([ids[..., 1:], torch.full_like(ids[..., :1], -100)], -1)
            m = next_token_metrics(out, ref, labels)
            n = m.pop("positions")
            for k, v in m.items():
                logged = torch.tensor(v).log().item() if k in ("ppl", "reference_ppl") else v
                totals[k] = totals.get(k, 0.0) + logged * n
            count += n
    out = {k: v / count for k, v in totals.items()}
    for k in ("ppl", "reference_ppl"):
        if k in out:
            out[k] = float(torch.tensor(out[k]).exp())
    out["weight_bytes"] = sum(r["bytes_after"] for r in res.report.weight_formats)
    return out


def _is_ids(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 1


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
    formats: Sequence[str | WeightFormat] = ("int4", "int8"),
    policy: Any = "torch",
    dtype: Any = None,
    device_type: str | None = None,
    dynamic_shapes: Any = None,
    metric: str = "kld",
    probes: int = 8,
    evaluate: Iterable[Any] | None = None,
    measure_bits: Sequence[float] = (),
    ablation: bool = False,
    ablation_format: str | WeightFormat | None = None,
    rounding: str = "data",
) -> WeightSensitivity:
    """Estimate every weight's cost per format on ``data`` (calibration batches); measure real conversions at the
    all-cheapest plan, at ``measure_bits`` (bits per weight budgets) and all-float on ``evaluate`` batches (default:
    ``[inputs]``); with ``ablation``, each weight alone in ``ablation_format`` (default: the first format) on the
    evaluation batches, and the Spearman correlation of estimate and truth. ``policy``, ``dtype``,
    ``device_type``, ``dynamic_shapes``: as ``precast.convert``'s, for the capture and every measured conversion;
    ``metric``: "kld" (a program whose first output is logits) or "mse"; ``rounding``: int4 weights fitted on
    ``data`` ("data", as a ``precast.Budget`` does: the estimate, the measured plans and the ablation all use the
    fitted parts) or round-to-nearest ("rtn")."""
    fmts, ablated = _checked(formats, metric, device_type, ablation, ablation_format, rounding)
    low = parse_low_dtype(dtype) or torch.bfloat16
    ep = program_or_module
    if isinstance(program_or_module, torch.nn.Module):
        ep = capture(program_or_module, inputs, dynamic_shapes).program
    batches = list(data)
    scale_dtype = low if policy is not None else torch.float32
    fitted = fit_int4(ep, batches, fmts, scale_dtype) if rounding == "data" else None
    costs = estimate_costs(
        ep, batches, fmts, float_dtype=scale_dtype, metric=metric, probes=probes, fitted=fitted
    )
    result = WeightSensitivity(costs, policy, dtype_name(low))
    evaluation = [
        bind_inputs(ep, b, f"evaluate[{i}]")
        for i, b in enumerate(evaluate if evaluate is not None else [inputs])
    ]
    with torch.no_grad():
        module = ep.module()
        reference = [_first_float(module(*args, **kwargs)) for args, kwargs in evaluation]
    options = ConvertOptions(
        policy=policy, dtype=dtype, device_type=device_type, dynamic_shapes=dynamic_shapes
    )
    plans = [allocate(costs, error=float("inf"))]  # every weight in its cheapest format
    plans += [result.allocation(bits=bits) for bits in measure_bits]
    plans.append(allocate(costs, formats=(FLOAT.name,), error=0.0))
    for alloc in plans:
        measured = measure_plan(
            program_or_module, inputs, options, alloc.formats, evaluation, reference, fitted
        )
        result.curve.append(_point(alloc, result.elements, metric, measured))
    if ablation:
        _ablation(result, ep, evaluation, ablated, fitted)
    return result


def _point(alloc: Allocation, elements: int, metric: str, measured: dict) -> CurvePoint:
    """One measured plan as a point of the curve (``measured``: the estimate's metric; ``metrics``: all)."""
    return CurvePoint(
        alloc.estimate,
        measured=measured.get(metric),
        bytes=alloc.bytes,
        bits_per_weight=8 * alloc.bytes / max(elements, 1),
        formats=_counts(alloc.formats),
        metrics=measured,
    )


def _ablation(result: WeightSensitivity, ep: Any, evaluation: list, fmt: str, fitted: Any = None) -> None:
    """Each weight alone in ``fmt`` (its fitted parts where given) on the evaluation batches ((args, kwargs)
    pairs), and the rank correlation of estimate and truth."""
    costs = result.costs
    ablate(ep, evaluation, costs, fmt, fitted=fitted)
    names = [n for n, w in costs.weights.items() if fmt in w.truth]
    result.spearman = spearman(
        [costs.weights[n].estimate[fmt] for n in names], [costs.weights[n].truth[fmt] for n in names]
    )
    result.ablation_format = fmt


def _checked(
    formats: Sequence[Any],
    metric: str,
    device_type: str | None,
    ablation: bool,
    ablation_format: Any,
    rounding: str = "data",
) -> tuple[list[str], str]:
    """The options checked before anything runs, one line each: (format names, the ablation's format)."""
    if rounding not in ROUNDINGS:
        raise PrecastError(
            f"rounding={rounding!r}: choose 'data' (int4 fitted on data=) or 'rtn' (round-to-nearest)"
        )
    if metric not in METRICS:
        raise PrecastError(
            f"weight sensitivity: metric={metric!r}: choose {' or '.join(map(repr, METRICS))} (the estimate's "
            "metric: 'kld' for a program whose first output is logits, else 'mse')"
        )
    if device_type not in (None, "cpu", "cuda"):
        raise PrecastError(f"device_type={device_type!r}: precast has autocast tables for 'cpu' and 'cuda'")
    if isinstance(formats, (str, WeightFormat)):
        formats = (formats,)
    fmts = [parse_format(f, "weight_formats").name for f in formats]
    if not fmts or not isinstance(ablation, bool):
        raise PrecastError(
            "weight sensitivity: give formats (e.g. ('int4', 'int8')) and ablation=True or False"
        )
    ablated = (
        parse_format(ablation_format, "ablation_format").name if ablation_format is not None else fmts[0]
    )
    if ablated not in fmts:
        raise PrecastError(
            f"ablation_format={ablated!r}: give one of the formats measured ({', '.join(fmts)})"
        )
    return fmts, ablated


def weights_shortcut(
    program_or_module: Any,
    inputs: Any,
    formats: Sequence[Any],
    metric: str | None,
    ablation: bool,
    op_options: dict[str, Any],
    weight_options: dict[str, Any],
    convert_options: dict[str, Any],
) -> WeightSensitivity:
    """``precast.sensitivity(..., weight_formats=...)``, kept one release: a FutureWarning, the op ranking's own
    options (``op_options``: measure_points, repro, group, energies) refused in one line when given, every other
    option passed on (``metric`` None: "kld")."""
    warnings.warn(
        "precast.sensitivity(weight_formats=...) is deprecated and goes in the next release: call "
        "precast.weight_sensitivity(program, inputs, data=..., formats=...)",
        FutureWarning,
        stacklevel=3,
    )
    defaults = {"measure_points": 1, "repro": None, "group": None, "energies": None}
    named = [k for k, v in op_options.items() if not (v is defaults[k] or v == defaults[k])]
    if named:
        raise PrecastError(
            f"{', '.join(f'{k}=' for k in named)}: the op ranking's options; weight sensitivity takes none of "
            "them (precast.weight_sensitivity: data, formats, evaluate, measure_bits, probes, ablation)"
        )
    data = weight_options.pop("data")
    return weight_sensitivity(
        program_or_module,
        inputs,
        data=list(data) if data is not None else [inputs],
        formats=formats,
        metric="kld" if metric is None else metric,
        ablation=ablation,
        **weight_options,
        **convert_options,
    )
