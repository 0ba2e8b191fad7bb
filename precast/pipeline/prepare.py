"""Preparing a policy that binds a decider per program (rules, auto, or a policy of the user's with ``bind``):
the steps it asks for (``prepare_steps``: calibrate, latency, tolerance search), then the binding classify's
decider is made with.

Order matters: the tolerance search converts the program once per try exactly as the conversion will, so
everything the final decider is bound with (calibration, the auto latency table) is known before it starts.

Input: the conversion's state (program, input program, policy, low dtype, device, log). Output:
``state.binding`` (``precast.policy.hooks.Binding``), or None for a policy that decides by itself.
"""

from __future__ import annotations

from precast.errors import PrecastError
from precast.ir import diagnostics
from precast.numerics.calibration.stage import calibrate_stage, is_given
from precast.numerics.latency import measure_program
from precast.numerics.tolerance.search import parse_tolerance
from precast.numerics.tolerance.stage import tolerance_stage
from precast.passes.runner import run_stage
from precast.pipeline.conversion import Conversion
from precast.policy.hooks import Binding, binds, hook
from precast.policy.rules.options import RuleOptions

# the steps a policy may ask for, in the order they run
PREPARE_STEPS = ("calibrate", "latency", "tolerance")


def prepare(state: Conversion) -> None:
    """calibrate -> latency -> tolerance search -> binding, each a stage of its own, as the policy asks."""
    policy = state.policy
    if not binds(policy) or state.low is None:
        return
    steps = hook(policy, "prepare_steps")
    unknown = [s for s in steps if s not in PREPARE_STEPS]
    if unknown:
        raise PrecastError(
            f"{type(policy).__name__}.prepare_steps: {', '.join(map(repr, unknown))} unknown; choose from "
            f"{', '.join(PREPARE_STEPS)}"
        )
    low, program, log = state.low, state.program, state.log
    binding = Binding(options=hook(policy, "options")(low))
    tol = parse_tolerance(hook(policy, "tolerance")) if "tolerance" in steps else None
    opts = binding.options
    ranges = isinstance(opts, RuleOptions) and (opts.data_max is not None or opts.data_min is not None)
    data = hook(policy, "calibration")
    # streamed weights: nothing can run; statistics measured beforehand (precast.calibrate) serve as they are
    if "calibrate" in steps and state.weights is not None and not (data is not None and is_given(data)):
        if ranges:
            diagnostics.record(
                log,
                "data-max-inactive",
                "data_max and flush_to_zero are not applied: the weights are streamed from files, so nothing "
                "runs the program during conversion; pass statistics measured with precast.calibrate (docs/"
                "distributed.md) as calibration=, or convert in memory",
            )
    elif "calibrate" in steps:
        binding.calibration = run_stage(
            program,
            "calibrate",
            lambda p: calibrate_stage(p, state.captured, log, data, low, ranges=ranges, tol=tol is not None),
        )
    if tol is not None and binding.calibration is None:
        raise PrecastError("tolerance= needs data to measure the error on: pass calibration=[inputs, ...]")
    if "latency" in steps and hook(policy, "latencies") is None:  # else: the table given to the policy
        # per matmul/convolution/attention op, fp32 vs low latency on this device (cached)
        binding.extra["latencies"], binding.latency_run = run_stage(
            program,
            "latency",
            lambda p: measure_program(p, low, state.device, hook(policy, "cache_dir")),
        )
        nodes = {n.name: n for n in program.graph.nodes}
        for name, why in (binding.latency_run.skipped or {}).items():
            diagnostics.record(
                log,
                "latency-not-measured",
                f"{name}: could not be timed on {state.device} ({why}): kept float32",
                nodes[name],
            )
    if tol is not None:
        opts, cal, extra = binding.options, binding.calibration, binding.extra
        binding.search = run_stage(
            program,
            "tolerance",
            lambda p: tolerance_stage(p, state.captured, policy, opts, cal, tol, log, low=low, **extra),
        )
    state.binding = binding
