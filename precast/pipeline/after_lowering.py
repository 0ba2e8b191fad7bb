"""After lowering: the checks a policy asks for on the converted program (``after_lowering`` hook), in order.
Each may convert the program again through ``Conversion.relower``, which binds the policy's decider with
what the check found.

- ``device_fallback``: run the converted program once on the example inputs; while an op the policy itself
  put in the low dtype fails there (no low-precision kernel on this device), keep it fp32 and convert again,
  at most ``MAX_DEVICE_FALLBACK_ROUNDS`` times. A failure that is not the policy's own choice (a region,
  ``include_ops``, an op outside the decisions) is left to the verification, which reports it as before.
- ``auto_confirm`` (policy auto): the report's summary of what was measured and chosen, then the converted
  program timed against the fp32 one on the example inputs; when it is slower, everything is converted again
  in fp32 (auto is never slower than fp32).

Input: the conversion's state after its first lowering. Output: ``state.lowered`` (maybe converted again),
``state.ran`` (the outputs of the device check's successful run, which verification compares instead of
running the program again), diagnostics, ``state.verification["auto"]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx

from precast.dtypes import dtype_name
from precast.errors import PrecastError, where
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.program import private_state
from precast.numerics.latency import native_note, time_programs
from precast.passes.runner import timed
from precast.pipeline.checks import DeviceFailure, example_batch, run_on_device
from precast.pipeline.conversion import Conversion
from precast.policy.auto import MARGIN
from precast.policy.base import Decision
from precast.policy.hooks import hook
from precast.weights.filled import stand_in

MAX_DEVICE_FALLBACK_ROUNDS = 8


def device_fallback(state: Conversion) -> None:
    """Ops without a low-precision kernel on this device kept fp32, the program converted again."""
    batch = example_batch(state.captured, state.inputs)
    if batch is None or state.lowered is None:
        return
    failed: dict[str, str] = {}  # node -> what failed: bound into the decider as ``device_fp32``
    found: list[DeviceFailure] = []
    for _ in range(MAX_DEVICE_FALLBACK_ROUNDS):
        exported = private_state(state.lowered.exported)
        if (
            state.weights is not None
        ):  # streamed weights: kernels are what is checked, zeros stand in for them
            exported = stand_in(exported)
        run = run_on_device(exported.module(), batch[0], batch[1], DiagnosticLog())
        if run.failure is None:
            # (outputs of stand-in weights are nothing verification could compare)
            state.ran = run.outputs if run.ok and state.weights is None else None
            break
        name = run.failure.node.name
        decision = _decision(state.lowered.program.graph, name)
        owner = getattr(state.lowered.decider, "name", None)
        if decision is None or decision.dtype != state.low or decision.source != owner or name in failed:
            break  # not the policy's own low choice: the verification reports it
        failed[name] = run.failure.what
        found.append(run.failure)
        state.relower(device_fp32=dict(failed))
    for f in found:
        diagnostics.record(
            state.log,
            "no-low-precision-kernel",
            f"{where(f.node)}: no {dtype_name(state.low)} kernel on this device ({f.what}): kept in float32",
            f.node,
            fix="nothing to do; exclude_ops it to skip the retry",
        )


def _decision(graph: torch.fx.Graph, name: str) -> Decision | None:
    """The decision classify gave the node called ``name`` (None: no such op, or no decision)."""
    node = next((n for n in graph.nodes if n.name == name), None)
    return node.meta.get("precast") if node is not None else None


def auto_confirm(state: Conversion) -> None:
    """Policy auto: its summary in the report, and the end-to-end confirmation against fp32."""
    decider, lrun = state.lowered.decider, state.binding.latency_run  # type: ignore[union-attr]
    counts = (lrun.timed, lrun.cached) if lrun is not None else (None, None)
    text, est = decider.summary(native_note(state.device, decider.opts.low), *counts)  # type: ignore[union-attr]
    speed = {"estimated_speedup": est}
    batch = example_batch(state.captured, state.inputs)
    if hook(state.policy, "confirm") and batch is not None and any(c.low for c in decider.choices.values()):  # type: ignore[union-attr]
        conv_ms, ref_ms = time_programs(state.lowered.exported, state.captured, batch, state.device)  # type: ignore[union-attr]
        speed.update(converted_ms=conv_ms, fp32_ms=ref_ms, measured_speedup=ref_ms / conv_ms)
        text += f"; end to end (eager, example inputs): {conv_ms:.3f} ms vs fp32 {ref_ms:.3f} ms"
        if conv_ms > ref_ms * (1 + MARGIN):
            why = f"the converted program measured {conv_ms:.3f} ms vs fp32 {ref_ms:.3f} ms on the example inputs"
            kept = [d for d in state.log.diagnostics if d.code == "no-low-precision-kernel"]
            lowered = state.relower(device_fp32=dict(decider.device_fp32), all_fp32=why)  # type: ignore[union-attr]
            state.log.diagnostics.extend(kept)
            text = lowered.decider.summary("", *counts)[0]  # type: ignore[union-attr]
            speed.update(converted_ms=ref_ms, measured_speedup=1.0, estimated_speedup=1.0)
            state.ran = None  # another program now
        else:
            text += f" ({ref_ms / conv_ms:.2f}x)"
    state.verification["auto"] = speed
    diagnostics.record(state.log, "auto-latency", text)


# the checks a policy may name in its ``after_lowering`` hook, with the stage name each is timed under
AFTER_LOWERING: dict[str, tuple[str, Callable[[Conversion], None]]] = {
    "device_fallback": ("device_check", device_fallback),
    "auto_confirm": ("auto_confirm", auto_confirm),
}


def after_lowering(state: Conversion) -> None:
    """Run the policy's after-lowering checks, in the order it names them."""
    if state.policy is None or state.binding is None:
        return
    for name in hook(state.policy, "after_lowering"):
        if name not in AFTER_LOWERING:
            raise PrecastError(
                f"{type(state.policy).__name__}.after_lowering: {name!r} unknown; choose from "
                f"{', '.join(AFTER_LOWERING)}"
            )
        stage, check = AFTER_LOWERING[name]
        with timed(stage):
            check(state)
