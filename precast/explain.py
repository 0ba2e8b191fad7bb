"""``precast.sensitivity``: which op breaks low precision, and by how much.

Input: an ``ExportedProgram`` or an ``nn.Module``, one batch of inputs, the low dtype, a rules policy ("rules" or a
``RulesPolicy``/``AutoPolicy`` with its options), the metric ("rel", "cosine", "max_abs"). Output:
``Sensitivity``: every op the policy runs in low precision, ranked by the output error its rounding alone causes
(``precast.numerics.sensitivity``), the cumulative curve (estimated for every k, measured at a few), the first
non-finite op (``precast.numerics.nonfinite``), optionally a repro folder (``repro=DIR``) and the single-op
ablation truth (``ablation=True``); ``plan(k)`` keeps the top k in fp32 as a portable ``Plan``; ``energies``:
what the ranking was made from, a mergeable value (``data=`` batches, summed over a process group's ranks, or
given with ``energies=``; docs/distributed.md).

Nothing here changes the caller's program or module: every program measured is a private copy, converted as
``precast.convert`` converts it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast.dtypes import dtype_name, parse_low_dtype
from precast.errors import PrecastError, module_path, user_source_line
from precast.io import atomic_path
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.inputs import check_example_inputs, placeholder_values
from precast.numerics.calibration.stage import batches_of
from precast.numerics.distributed import process_group
from precast.numerics.energies import Energies, load_energies
from precast.numerics.nonfinite import is_nonfinite, op_inputs, op_subgraph, run_watching
from precast.numerics.sensitivity import METRICS, Estimate, Estimator, ablate, estimate
from precast.pipeline.conversion import Conversion, begin
from precast.pipeline.options import CheckedOptions
from precast.pipeline.prepare import prepare
from precast.policy.hooks import binds
from precast.policy.plan import Plan
from precast.policy.resolve import resolve_policy
from precast.policy.rules.policy import RulesPolicy
from precast.quant.sensitivity import WeightSensitivity, weights_shortcut
from precast.report.sensitivity import sensitivity_dict

REPRO_SCRIPT = '''"""Repro written by `precast sensitivity`: {op} ({node}) at {location}.
{why}
Runs the op alone on its captured inputs, in float32 and in {low}; needs only torch."""
from pathlib import Path

import torch

here = Path(__file__).resolve().parent
program = torch.export.load(here / "subgraph.pt2")
inputs = torch.load(here / "inputs.pt", weights_only=True)
low = [t.to(torch.{low}) if t.is_floating_point() else t for t in inputs]


def show(name, out):
    for t in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            d = t.double()
            print(f"{{name:>8}}: dtype {{t.dtype}}, |max| {{d.abs().max().item():.6g}}, "
                  f"inf {{int(torch.isinf(d).sum())}}, nan {{int(torch.isnan(d).sum())}}")


with torch.no_grad():
    ref = program.module()(*inputs)
    got = program.module()(*low)
show("float32", ref)
show("{low}", got)
'''


@dataclass
class Sensitivity:
    estimate: Estimate
    repro: dict | None = None
    graph: Any = field(default=None, repr=False)  # the policy's converted graph (keys for plans)
    policy: str = "rules"  # what a plan written from this ranking applies over (Plan.policy)

    @property
    def energies(self) -> Energies:
        """The per-read error energies the ranking was made from, summed over the batches they were measured on
        (a mergeable value: ``.save(path)``, ``.merge(...)``, ``sensitivity(..., energies=[...])``)."""
        return self.estimate.energies

    @property
    def ops(self) -> list:
        return self.estimate.ops

    @property
    def nonfinite(self) -> Any:
        return self.estimate.nonfinite

    def plan(self, k: int) -> Plan:
        """The first ``k`` ops of the greedy order (the curve's k: the ops whose fp32 removes the most estimated
        error per op, a residual add with the layer norm reading it) in fp32, as a portable plan. Ops whose values
        overflow the low dtype come first: no estimate of rounding error holds while one of them makes inf."""
        overflow = [o.name for o in self.estimate.ops if o.status == "overflow"]
        if self.nonfinite is not None and self.nonfinite.name not in overflow:
            # under autocast it may be an op that only follows a low input (an exp of an fp16 linear): pinning
            # it fp32 is the narrowest fix, and its producer stays low
            overflow.insert(0, self.nonfinite.name)
        names = (overflow + [n for n in self.estimate.order if n not in overflow])[:k]
        why = {n: f"sensitivity: greedy order #{i + 1} ({self.estimate.metric})" for i, n in enumerate(names)}
        plan = Plan.from_nodes(self.graph, names, self.estimate.dtype, why=why, source="precast sensitivity")
        plan.policy = self.policy
        return plan

    def to_dict(self) -> dict:
        d = sensitivity_dict(self.estimate)
        if self.repro is not None:
            d["repro"] = self.repro
        return d


def sensitivity(
    program_or_module: ExportedProgram | torch.nn.Module,
    inputs: Any,
    *,
    dtype: torch.dtype | str | None = None,
    policy: Any = "rules",
    metric: str | None = None,
    device_type: str | None = None,
    dynamic_shapes: Any = None,
    measure_points: int = 1,
    ablation: bool = False,
    repro: str | Path | None = None,
    data: Iterable[Any] | None = None,
    group: Any = None,
    energies: Any = None,
    weight_formats: Sequence[str] | None = None,
    evaluate: Iterable[Any] | None = None,
    measure_bits: Sequence[float] = (),
    probes: int = 8,
) -> Sensitivity | WeightSensitivity:
    """Rank the ops the policy runs in low precision by the output error their rounding causes (docs/sensitivity.md).

    ``inputs``: one batch (as for ``convert``'s ``example_inputs``); ``metric``: "rel" (default), "cosine" or "max_abs";
    ``measure_points``: curve points measured on real conversions (0-3); ``ablation``: also measure each op alone in
    low precision (one conversion per op); ``repro``: a folder for a standalone repro of the first non-finite op
    (else the top-ranked op). ``data`` (batches to estimate the energies on), ``group`` (the ranks whose energies
    are summed) and ``energies`` (measured before, used instead of measuring): docs/sensitivity.md and
    docs/distributed.md.

    ``weight_formats`` (e.g. ``("int4", "int8")``): a shortcut, kept one release with a FutureWarning, for
    ``precast.weight_sensitivity`` (which ranks the weights: docs/weight_formats.md); the options it does not take
    are refused in one line. Returns a ``WeightSensitivity`` then."""
    if weight_formats is not None:  # the shortcut, one release, with a warning (precast.weight_sensitivity)
        given = {"measure_points": measure_points, "repro": repro, "group": group, "energies": energies}
        weights = {"data": data, "evaluate": evaluate, "measure_bits": measure_bits, "probes": probes}
        kw = {"policy": policy, "dtype": dtype, "device_type": device_type, "dynamic_shapes": dynamic_shapes}
        return weights_shortcut(
            program_or_module, inputs, weight_formats, metric, ablation, given, weights, kw
        )
    metric = "rel" if metric is None else metric
    _refuse_weight_options(evaluate=evaluate, measure_bits=measure_bits, probes=probes)
    _check_options(metric, measure_points, ablation, repro, device_type)
    pol, low = _ranked_policy(policy, dtype, device_type)
    group, given, data = _measure_sources(inputs, data, group, energies)
    state, low = _prepared(program_or_module, inputs, pol, low, device_type, dynamic_shapes)
    ep = state.captured
    batch = check_example_inputs(ep, inputs)
    more = {"data": data, "group": group, "given": given}
    result, est = estimate(
        ep, state.policy, state.binding, batch, metric, measure_points=measure_points, low=low, **more
    )
    return _finished(est, result, state.policy, ablation, repro)


def _check_options(
    metric: str, measure_points: int, ablation: bool, repro: str | Path | None, device_type: str | None
) -> None:
    """The op ranking's own options, each checked before anything runs: one line per bad value."""
    if device_type not in (None, "cpu", "cuda"):
        raise PrecastError(f"device_type={device_type!r}: precast has autocast tables for 'cpu' and 'cuda'")
    if metric not in METRICS:
        raise PrecastError(f"metric={metric!r}: choose {', '.join(METRICS)}")
    if type(measure_points) is not int or not 0 <= measure_points <= 3:
        raise PrecastError(f"measure_points={measure_points!r}: give 0, 1, 2 or 3")
    if not isinstance(ablation, bool):
        raise PrecastError(f"ablation={ablation!r}: give True (measure each op alone) or False")
    if repro is not None and not isinstance(repro, (str, os.PathLike)):
        raise PrecastError(f"repro={repro!r}: give the folder (a path) the repro is written to")


def _refuse_weight_options(**given: Any) -> None:
    """Weight sensitivity's own options, given to the op ranking: refused in one line, never ignored."""
    defaults = {"evaluate": None, "measure_bits": (), "probes": 8}
    named = [k for k, v in given.items() if not (v is defaults[k] or v == defaults[k])]
    if named:
        raise PrecastError(
            f"{', '.join(f'{k}=' for k in named)}: weight sensitivity's options, and this call ranks ops; give "
            "weight_formats=(...) to rank the weights, or leave them out"
        )


def _finished(
    est: Estimator, result: Estimate, policy: Any, ablation: bool, repro: str | Path | None
) -> Sensitivity:
    """The ranking as a ``Sensitivity``, with the ablation truth and the repro when asked for."""
    if ablation:
        ablate(est, result.ops)
        result.conversions, result.forwards = est.conversions, est.forwards
    out = Sensitivity(result, graph=est.all_low.graph, policy=plan_policy(policy))
    if repro is not None:
        out.repro = write_repro(est, result, Path(repro))
    return out


def _ranked_policy(
    policy: Any, dtype: torch.dtype | str | None, device_type: str | None
) -> tuple[Any, torch.dtype | None]:
    """The policy whose low-precision ops are ranked, and the low dtype: ``dtype=`` or the policy's own."""
    low = parse_low_dtype(dtype)
    if policy == "rules":
        return RulesPolicy(dtype=low), low
    if isinstance(policy, RulesPolicy):
        if policy.tolerance is not None:  # refused, not dropped: the ranking is what a search starts from
            raise PrecastError(
                f"{type(policy).__name__}(tolerance=...): sensitivity ranks every op the policy runs low, before "
                "any tolerance search; give the policy without tolerance (dataclasses.replace(p, tolerance=None))"
            )
        pol = policy
        mine = parse_low_dtype(policy.dtype)
        if low is not None and mine is not None and mine != low:
            raise PrecastError(
                f"dtype={dtype!r} but the {type(policy).__name__} says dtype={policy.dtype!r}: give one"
            )
        return pol, low or mine
    if policy is None or isinstance(policy, str) or not binds(policy):
        # policy torch (autocast's lower-precision ops), None (the ops of the program's own regions), or a
        # policy object that decides by itself: the same estimator, its trials pinned to fp32 over the policy
        return resolve_policy(policy, low, device_type, {})
    raise PrecastError(
        f"policy={policy!r}: sensitivity ranks the ops a policy runs in low precision; give None, 'torch', "
        "'rules', 'auto', a precast.TorchPolicy / RulesPolicy / AutoPolicy, or a policy without bind"
    )


def _measure_sources(inputs: Any, data: Any, group: Any, energies: Any) -> tuple[Any, list | None, Any]:
    """What the energies come from: the process group (with ``data=``), the energies given, the batches."""
    if inputs is None:
        raise PrecastError("sensitivity needs inputs to measure on: give one batch, e.g. (x,)")
    if energies is not None and (data is not None or group not in (None, False)):
        raise PrecastError(
            "energies= are used as given: measure more with data= (and a process group), not both"
        )
    if group not in (None, False) and data is None:
        raise PrecastError(
            "group= sums the energies each rank measures on its data=: give data= (this rank's batches) too"
        )
    group = process_group(group) if data is not None else None  # every rank estimating on its shard
    given = None
    if energies is not None:
        given = [load_energies(e) for e in (energies if isinstance(energies, (list, tuple)) else [energies])]
        if not given:
            raise PrecastError("energies=[]: give Energies or their files")
    if data is not None:
        data = batches_of(data)
    return group, given, data


def _prepared(
    program_or_module: ExportedProgram | torch.nn.Module,
    inputs: Any,
    pol: Any,
    low: torch.dtype | None,
    device_type: str | None,
    dynamic_shapes: Any,
) -> tuple[Conversion, torch.dtype | None]:
    """The conversion's state up to its decisions (captured, calibrated as ``convert`` prepares it), and the
    low dtype the ranking is for."""
    options = CheckedOptions.of(low, device_type=device_type, dynamic_shapes=dynamic_shapes)
    state = begin(program_or_module, inputs, pol, options)
    state.log = DiagnosticLog()
    prepare(state)  # calibration (fp16's data_max), auto's latencies: as the conversion prepares them
    if state.policy is None:  # the program's regions: their dtype is the low one
        low = _regions_dtype(state, low)
    return state, state.low or low


def _regions_dtype(state: Conversion, low: torch.dtype | None) -> torch.dtype:
    """Under policy None, the low dtype of the program's enabled autocast regions (``low`` if given)."""
    dtypes = {r.dtype for r in state.regions if r.enabled}
    if not dtypes:
        raise PrecastError(
            "sensitivity under policy None ranks the ops of the program's own autocast regions, and this "
            "program has none enabled; give policy='torch' (eager autocast on the whole forward) or 'rules'"
        )
    if low is None and len(dtypes) > 1:
        raise PrecastError(
            f"the program's regions use {', '.join(sorted(map(str, dtypes)))}: give dtype= to say which to rank"
        )
    return low or dtypes.pop()


def plan_policy(policy: Any) -> str:
    """The ``Plan.policy`` a ranking under ``policy`` writes: "regions" for None, else the policy's name."""
    return "regions" if policy is None else str(policy.name)


def write_repro(est: Estimator, result: Estimate, folder: Path) -> dict:
    """The first non-finite op (else the top-ranked op) alone: ``subgraph.pt2`` (fp32), ``inputs.pt`` (its
    captured inputs before precast's casts, in fp32), ``repro.py``; run here once to say whether it reproduces."""
    if folder.exists() and not folder.is_dir():
        raise PrecastError(f"--repro {folder}: exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    low = est.low
    if result.nonfinite is not None:
        node, env = est.nonfinite_node, est.low_env
        why = f"First non-finite op in {dtype_name(low)}: {result.nonfinite.reason}."
    else:
        if not result.ops:
            raise PrecastError("--repro: the policy runs no op in low precision; nothing to reproduce")
        top = result.ops[0]
        node = next(n for n in est.ref.graph.nodes if n.name == top.name)
        _, env = run_watching(est.ref.gm, placeholder_values(est.ref, est.user))
        why = f"Top-ranked op: alone in {dtype_name(low)} it costs {result.metric} ~{top.estimate:.3g}."
    args, kwargs = op_inputs(node, env)
    sub, tensors = op_subgraph(node, args, kwargs)
    with torch.no_grad():
        ref = sub.module()(*tensors)
        got = sub.module()(*[t.to(low) if t.is_floating_point() else t for t in tensors])
    if result.nonfinite is not None:
        reproduces = is_nonfinite(got)
    else:
        reproduces = any(
            not torch.equal(a.to(b.dtype), b)
            for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(ref), strict=True)
            if isinstance(a, torch.Tensor)
        )
    script = REPRO_SCRIPT.format(
        op=node.target,
        node=node.name,
        location=user_source_line(node) or module_path(node) or "?",
        why=why,
        low=str(low).removeprefix("torch."),
    )
    with atomic_path(folder / "subgraph.pt2") as tmp:
        torch.export.save(sub, tmp)
    with atomic_path(folder / "inputs.pt") as tmp:
        torch.save(tuple(t.detach().clone() for t in tensors), tmp)
    with atomic_path(folder / "repro.py") as tmp:
        tmp.write_text(script)
    return {"dir": str(folder), "node": node.name, "op": str(node.target), "reproduces": bool(reproduces)}
