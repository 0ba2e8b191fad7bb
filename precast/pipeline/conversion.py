"""The state of one conversion, typed: what ``precast.convert`` threads from stage to stage, and the steps
that start it (capture, program copy, regions, checks) and lower it (classify .. restore_io, then the
ExportedProgram), again when an after-lowering check asks.

Input: what the user gave (a module + inputs or a program), the resolved policy and low dtype. Output: a
``Conversion`` whose ``lowered`` is the current ``Lowered`` (program, decider, stats, ExportedProgram).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils._pytree import PyTree

from precast.errors import PrecastError
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.graph import output_dtypes
from precast.ir.inputs import check_example_inputs
from precast.ir.program import Program, program_device_type
from precast.ir.regions import Region
from precast.passes import LowerStats, lower
from precast.passes.regions import inline_regions
from precast.passes.runner import run_stage, timed
from precast.pipeline import checks
from precast.pipeline.capture import capture, policy_region
from precast.pipeline.options import CheckedOptions
from precast.policy.base import Policy
from precast.policy.hooks import Binding, hook
from precast.weights.files import without_weights

Inputs = tuple[tuple, dict]  # (args, kwargs)


@dataclass
class Lowered:
    """One lowering of the program: the rewritten Program, the decider that decided it, what ``lower`` did,
    and the ExportedProgram made from it."""

    program: Program
    decider: Policy | None
    stats: LowerStats
    exported: ExportedProgram


@dataclass
class Conversion:
    """Everything one conversion knows, stage after stage."""

    source: ExportedProgram | torch.nn.Module  # what the caller gave (never changed)
    captured: ExportedProgram  # the input program: the caller's, or the module's export (capture)
    policy: Policy | None
    low: torch.dtype | None
    device: str
    inputs: Inputs | None  # the example inputs, bound to the program's signature (None: the program's own)
    program: Program  # the private copy of ``captured`` the checks ran on; the first lowering rewrites it
    regions: list[Region]
    restore: list[torch.dtype | None]  # the input program's output dtypes, restored with keep_io_types
    keep_io: bool
    cache_dtype: torch.dtype | None = None  # cache_dtype=: the caches held in this dtype (passes/caches.py)
    weight_rules: Any = None  # weight_format=: the weights stored in 8/4 bits (passes/quantize.WeightRules)
    weights: Any = None  # weights=: the WeightFiles the value-less constants come from (weights/files.py)
    log: DiagnosticLog = field(default_factory=DiagnosticLog)  # the report, as the stages see it
    verification: dict[str, dict] = field(default_factory=dict)  # what after-lowering checks measured
    binding: Binding | None = None  # what the policy's decider is bound with (None: the policy decides)
    lowered: Lowered | None = None
    ran: PyTree = None  # the converted program's outputs on the example inputs, when the device check ran it
    lowering_mark: int = 0  # where the current lowering's diagnostics start in the log
    # a module's: the caller's tensor behind each non-parameter constant of ``ep`` (which holds clones)
    origins: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def unchanged(self) -> bool:
        """Policy None on a program without autocast regions: nothing to convert."""
        return (
            self.policy is None
            and not self.regions
            and self.cache_dtype is None
            and self.weight_rules is None
        )

    def decider_for(self, program: Program, **more: Any) -> Policy | None:
        """The decider classify asks for ``program``: the bound one, or the policy itself."""
        if self.binding is None:
            return self.policy
        return self.binding.bind(self.policy, program, **more)  # type: ignore[arg-type]

    def relower(self, **more: Any) -> Lowered:
        """Convert a fresh copy of the input program again, the decider bound with ``more`` as well
        (``device_fp32=``, ``all_fp32=``); the previous lowering's diagnostics are recorded afresh."""
        del self.log.diagnostics[self.lowering_mark :]
        fresh = run_stage(
            None, "program_copy", lambda _: Program(self.captured, self.cache_dtype, self.weight_rules)
        )
        fresh.weights = self.weights
        run_stage(fresh, "inline_regions", lambda p: inline_regions(p.gm))
        return self._lower(fresh, self.decider_for(fresh, **more))

    def lower_program(self) -> Lowered:
        """The first lowering, of the program the checks ran on."""
        self.lowering_mark = len(self.log.diagnostics)
        return self._lower(self.program, self.decider_for(self.program))

    def _lower(self, program: Program, decider: Policy | None) -> Lowered:
        stats = lower(program, decider, self.log, restore=self.restore, keep_io=self.keep_io)
        exported = run_stage(program, "export", lambda p: p.to_exported_program())
        self.lowered = Lowered(program, decider, stats, exported)
        return self.lowered


def begin(
    source: ExportedProgram | torch.nn.Module,
    example_inputs: PyTree,
    policy: Policy | None,
    options: CheckedOptions,
) -> Conversion:
    """capture -> program copy -> regions: the conversion's state before the checks. ``policy``: the resolved
    policy object (or None); ``options``: what ``ConvertOptions.check`` returned."""
    given, low = options.given, options.low
    if options.files is not None:  # weights= : the program's constants found in the files become meta tensors
        source = without_weights(source, options.files)  # type: ignore[arg-type]
    device_type = given.device_type or (hook(policy, "device_type") if policy is not None else None)
    under_autocast = policy is not None and hook(policy, "capture_under_autocast")
    region = policy_region(source, under_autocast, device_type, low)
    with timed("capture"):
        captured = capture(
            source, example_inputs, given.dynamic_shapes, distinct_values=under_autocast, autocast=region
        )
    ep = captured.program
    device = device_type or program_device_type(ep)
    if device not in ("cpu", "cuda"):
        raise PrecastError(f"device_type={device!r}: precast has autocast tables for 'cpu' and 'cuda'")
    if policy is not None:
        low = low if low is not None else torch.get_autocast_dtype(device)
        policy = hook(policy, "for_device")(device, low)
    inputs = check_example_inputs(ep, example_inputs) if source is ep else None
    program = run_stage(
        None, "program_copy", lambda _: Program(ep, options.cache_dtype, options.weight_rules)
    )
    regions = run_stage(program, "inline_regions", lambda p: inline_regions(p.gm))
    keep_io = given.keep_io_types
    keep_io = keep_io if keep_io is not None else bool(policy and hook(policy, "keep_io_types"))
    restore = output_dtypes(program.graph)
    if region is not None and keep_io:
        # traced under autocast, the program's outputs are already low: the types to keep are the module's own
        plain = capture(source, example_inputs, given.dynamic_shapes, distinct_values=True).program
        restore = output_dtypes(plain.graph)
    state = Conversion(
        source, ep, policy, low, device, inputs, program, regions, restore, keep_io, options.cache_dtype
    )
    state.weight_rules = options.weight_rules
    state.origins = captured.origins
    state.weights = state.program.weights = options.files
    return state


def run_checks(state: Conversion) -> None:
    """Control flow, unused and no-op regions, and (policy torch given a program) dtype reads fixed at export:
    diagnostics before any decision (raises on an error)."""
    run_stage(
        state.program,
        "checks",
        lambda p: checks.check_program(state.captured, p.gm, state.regions, state.log),
    )
    if (
        isinstance(state.source, ExportedProgram)
        and state.policy is not None
        and hook(state.policy, "capture_under_autocast")
    ):
        checks.check_dtype_reads(state.captured, state.log)  # the module route would read them as eager does
    if state.unchanged:
        diagnostics.record(
            state.log,
            "no-regions",
            "the program has no autocast regions: returned unchanged "
            "(use policy='torch' or 'rules' to add mixed precision)",
        )
