"""Preparing the rules and auto policies for one program: calibrate, measure latencies (auto), search the
tolerance, then bind the decider classify asks; and, after lowering, auto's end-to-end confirmation.

Order matters: the tolerance search converts the program once per try exactly as the conversion will, so
everything the final decider is bound with (calibration, the auto latency table) is known before it starts.

Input: the Program, its ExportedProgram, a ``RulesPolicy`` (or ``AutoPolicy``), the low dtype, the device, the
diagnostic log. Output: ``Prepared`` (the bound decider, what it was bound with, the search result);
``auto_confirm`` returns a re-lowered all-fp32 program when the converted one measures slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.export import ExportedProgram

from precast.errors import PrecastError
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.program import Program
from precast.pipeline.calibrate import calibrate_stage
from precast.pipeline.checks import example_batch
from precast.pipeline.latency import measure_program, native_note, time_programs
from precast.pipeline.runner import run_stage
from precast.pipeline.tolerance import tolerance_stage
from precast.policy.auto import MARGIN, AutoPolicy
from precast.policy.rules.measures import Calibration
from precast.policy.rules.options import RuleOptions
from precast.policy.rules.tolerance import FallbackResult, parse_tolerance


@dataclass
class Prepared:
    """A rules/auto policy bound to one program, and everything it was bound with (so a re-lowering binds a
    decider for a fresh copy of the program the same way)."""

    policy: Any
    opts: RuleOptions
    calibration: Calibration | None
    search: FallbackResult | None
    bind_kw: dict = field(default_factory=dict)
    latency_run: Any = None
    decider: Any = None

    @property
    def fallback(self) -> dict | None:
        return self.search.kept if self.search is not None else None

    def rebind(self, program: Program, **extra: Any) -> Any:
        """The same decider for another copy of the program (``extra``: e.g. ``device_fp32=``)."""
        return self.policy.bind(
            program, self.opts, self.calibration, fallback=self.fallback, **self.bind_kw, **extra
        )


def prepare_policy(
    program: Program, ep: ExportedProgram, policy: Any, low: Any, device: str, log: DiagnosticLog
) -> Prepared:
    """calibrate -> latency (auto) -> tolerance -> bind, each a stage of its own."""
    opts = policy.options(low)
    tol = parse_tolerance(policy.tolerance)
    ranges = opts.data_max is not None or opts.data_min is not None
    cal = run_stage(
        program,
        "calibrate",
        lambda p: calibrate_stage(p, ep, log, policy.calibration, low, ranges=ranges, tol=tol is not None),
    )
    if tol is not None and cal is None:
        raise PrecastError("tolerance= needs data to measure the error on: pass calibration=[inputs, ...]")
    prep = Prepared(policy, opts, cal, None)
    if isinstance(policy, AutoPolicy) and policy.latencies is None:  # else: the table given to the policy
        # per matmul/convolution/attention op, fp32 vs low latency on this device (cached)
        prep.bind_kw["latencies"], prep.latency_run = run_stage(
            program, "latency", lambda p: measure_program(p, low, device, policy.cache_dir)
        )
        nodes = {n.name: n for n in program.graph.nodes}
        for name, why in (prep.latency_run.skipped or {}).items():
            diagnostics.record(
                log,
                "latency-not-measured",
                f"{name}: could not be timed on {device} ({why}): kept float32",
                nodes[name],
            )
    if tol is not None:
        prep.search = run_stage(
            program, "tolerance", tolerance_stage, ep, policy, opts, cal, tol, log, **prep.bind_kw
        )
    prep.decider = prep.rebind(program)
    return prep


def auto_confirm(out, ep, inputs, decider, pol, rep, device, relower, lrun) -> tuple | None:
    """Policy auto: the report's summary of what was measured and chosen, then the converted program timed
    against the fp32 one on the example inputs; when it is slower, everything is converted again in fp32
    (auto is never slower than fp32). Returns the new ``relower`` result, or None."""
    counts = (lrun.timed, lrun.cached) if lrun is not None else (None, None)
    text, est = decider.summary(native_note(device, decider.opts.low), *counts)
    speed = {"estimated_speedup": est}
    batch = example_batch(ep, inputs)
    fell = None
    if pol.confirm and batch is not None and any(c.low for c in decider.choices.values()):
        conv_ms, ref_ms = time_programs(out, ep, batch, device)
        speed.update(converted_ms=conv_ms, fp32_ms=ref_ms, measured_speedup=ref_ms / conv_ms)
        text += f"; end to end (eager, example inputs): {conv_ms:.3f} ms vs fp32 {ref_ms:.3f} ms"
        if conv_ms > ref_ms * (1 + MARGIN):
            why = f"the converted program measured {conv_ms:.3f} ms vs fp32 {ref_ms:.3f} ms on the example inputs"
            kept = [d for d in rep.diagnostics if d.code == "no-low-precision-kernel"]
            fell = relower(dict(decider.device_fp32), all_fp32=why)
            rep.diagnostics.extend(kept)
            text = fell[1].summary("", *counts)[0]
            speed.update(converted_ms=ref_ms, measured_speedup=1.0, estimated_speedup=1.0)
        else:
            text += f" ({ref_ms / conv_ms:.2f}x)"
    rep.verification["auto"] = speed
    diagnostics.record(rep, "auto-latency", text)
    return fell
