"""``precast.convert``: a short driver over the pipeline's stages (``precast.pipeline``), in order, over one
typed state (``precast.pipeline.conversion.Conversion``).

Input: an ``ExportedProgram`` or an ``nn.Module`` with example inputs, a policy (None, "torch", "rules", "auto",
or a policy object: ``TorchPolicy``, ``RulesPolicy``, ``AutoPolicy``, or any object with ``name``,
``autocast_state`` and ``decide``, which may opt into the hooks of ``precast.policy.hooks``), options.
Output: ``ConvertResult(program, report)``: a standard ``ExportedProgram`` with explicit casts and weights
cast once, and the report of every decision.

Authority, first decision wins: the program's own autocast regions, then the policy (the rules policy puts the
user's include/exclude options and custom rules first). Every option is honoured under every policy it
applies to, or refused with one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.dtypes import parse_low_dtype
from precast.errors import PrecastError
from precast.guard import guard_module
from precast.ir import diagnostics
from precast.ir.program import private_state
from precast.numerics.calibrate import calibrate as calibrate_program
from precast.numerics.calibrate import is_given
from precast.numerics.calibration import TOLERANCE_BATCHES, Calibration
from precast.numerics.distributed import process_group
from precast.pipeline.after_lowering import after_lowering
from precast.pipeline.conversion import begin, run_checks
from precast.pipeline.prepare import prepare
from precast.pipeline.verify import verify_conversion
from precast.policy.pinned import Pinned
from precast.policy.plan import with_plan
from precast.policy.resolve import POLICY_NAMES, resolve_policy, rule_options
from precast.report.build import fill_report, new_report, unchanged_report, write_program_info
from precast.report.model import Report
from precast.threads import TORCH_LOCK
from precast.weights.files import WeightFiles, weightless
from precast.weights.streamed import check_weights_out, write_weights

__all__ = ["POLICY_NAMES", "ConvertResult", "calibrate", "convert"]


def cache_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``cache_dtype=`` as a dtype: bf16/fp16 names or dtypes, float32 for "as the program gives it"."""
    if value is None:
        return None
    if value in (torch.float32, "fp32", "float32"):
        return torch.float32
    try:
        return parse_low_dtype(value)
    except PrecastError as exc:
        raise PrecastError(f"cache_dtype={value!r}: give 'bf16', 'fp16', 'fp32' or a torch dtype") from exc


@dataclass
class ConvertResult:
    program: ExportedProgram
    report: Report

    def module(self) -> torch.nn.Module:
        """``program.module()`` that warns once when called under an ambient ``torch.autocast``
        (``precast.guard_module`` does the same for any module built from a converted program)."""
        return guard_module(self.program.module())


def convert(
    program_or_module: ExportedProgram | torch.nn.Module,
    example_inputs: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    policy: Any = None,
    exclude_nodes: Iterable[str] = (),
    exclude_ops: Iterable[Any] = (),
    include_nodes: Iterable[str] = (),
    include_ops: Iterable[Any] = (),
    data_max: float | None = None,
    init_max: float | None = None,
    max_reduction_depth: int | None = None,
    calibration: Iterable[Any] | None = None,
    tolerance: Any = None,
    keep_io_types: bool | None = None,
    dynamic_shapes: Any = None,
    custom_rules: Iterable[Any] = (),
    patterns: Iterable[str] | str | None = None,
    verify: bool = True,
    allow: Iterable[str] = (),
    plan: Any = None,
    cache_dtype: torch.dtype | str | None = None,
    weights: str | os.PathLike | None = None,
    weights_out: str | os.PathLike | None = None,
) -> ConvertResult:
    """Convert a program (or module + example inputs) to explicit mixed precision. See the README.

    ``policy``: None (the program's own autocast regions), "torch" / ``TorchPolicy(device_type, dtype)`` (eager
    autocast semantics), "rules" / ``RulesPolicy(...)`` (everything low except what rules keep fp32; the rules
    keywords here, ``precast.policy.resolve.RULE_OPTIONS``, are a shorthand for ``RulesPolicy(...)``), "auto"
    / ``AutoPolicy(...)``, or a policy object of your own (``precast.policy.hooks``).
    ``allow``: diagnostic codes (``precast.codes``, e.g. ``"control-flow"``) whose errors become warnings in
    ``report.diagnostics`` instead of stopping the conversion.
    ``plan``: a ``precast.Plan`` (or its JSON file): its ops stay fp32, a custom rule (docs/sensitivity.md).
    ``cache_dtype``: hold the caches the program stores into (a KV cache) in this dtype (``"bf16"``,
    ``torch.float16``...), under any policy; refused with one line where a written buffer is not a cache
    (``precast/passes/caches.py``). The report states the cache bytes before and after.
    ``weights``: a folder of safetensors shards (or one file) holding the program's weights, which the program
    itself need not hold (exported with fake or meta weights, docs/streaming.md): the conversion decides on the
    graph and writes the converted weights into ``weights_out`` one tensor at a time; ``res.program`` then holds
    meta tensors for them (``precast.compile(res.program, weights=weights_out)`` runs it).
    """
    # one conversion at a time per process: torch 2.15's export picks up another thread's fake tensors as
    # constants (measured: 'fake tensor in the exported program constant's list'); see precast/threads.py
    with TORCH_LOCK:
        files = streamed_source(program_or_module, weights, weights_out, policy, calibration, tolerance)
        if files is not None:
            program_or_module = weightless(program_or_module, files)
        policy, custom_rules, dtype, pins = with_plan(plan, policy, custom_rules, dtype)
        chosen, low = resolve_policy(policy, dtype, device_type, rule_options(locals()))
        if pins is not None:  # a plan over policy torch or the program's regions: its ops pinned to fp32
            chosen = Pinned(chosen, pins, rule="custom:plan")
        state = begin(
            program_or_module,
            example_inputs,
            chosen,
            low,
            device_type,
            dynamic_shapes,
            keep_io_types,
            cache_dtype_of(cache_dtype),
        )
        state.weights = state.program.weights = files
        state.log = report = new_report(state, allow)
        run_checks(state)
        if state.unchanged:  # a program of its own (same graph, its own copies of the state it writes)
            out = private_state(state.ep)
            if files is not None:
                report.weights = write_weights(out, files, weights_out)  # type: ignore[arg-type]
            return ConvertResult(out, unchanged_report(report))
        prepare(state)
        state.lower_program()
        after_lowering(state)
        fill_report(state, report)
        if verify and files is not None:
            diagnostics.record(
                report,
                "verification-skipped",
                "not verified: the weights are streamed from files, so no values are in memory to run; run "
                "precast.compile(program, weights=...) on your inputs, or convert in memory to verify",
            )
        elif verify:
            report.verification = verify_conversion(state, report.verification)
        if files is not None:
            report.weights = write_weights(state.lowered.exported, files, weights_out)  # type: ignore[arg-type]
        write_program_info(state.lowered.exported, report)
        return ConvertResult(state.lowered.exported, report)


def streamed_source(
    source: Any, weights: Any, weights_out: Any, policy: Any, calibration: Any, tolerance: Any
) -> WeightFiles | None:
    """``weights=``: the files, once the options it cannot serve are refused (one line each)."""
    if weights is None:
        if weights_out is not None:
            raise PrecastError(
                "weights_out= is where streamed weights go: give weights= (their source) as well"
            )
        return None
    if not isinstance(source, ExportedProgram):
        raise PrecastError(
            "weights= streams the weights of an ExportedProgram (exported with fake or meta weights, "
            "docs/streaming.md); a module holds its weights already: convert it without weights="
        )
    if weights_out is None:
        raise PrecastError("weights= needs weights_out=: the folder the converted weights are written to")
    if calibration is not None and not is_given(calibration):
        raise PrecastError(
            "calibration= batches run the program, which streamed weights cannot (no values in memory); pass "
            "statistics measured beforehand (precast.calibrate, docs/distributed.md), or convert in memory"
        )
    if tolerance is not None:
        raise PrecastError(
            "tolerance= runs the converted program on data, which streamed weights cannot (no values in "
            "memory); convert in memory, or leave it out"
        )
    if policy == "auto" or type(policy).__name__ == "AutoPolicy":
        raise PrecastError(
            "policy='auto' times the converted program, which streamed weights cannot run; use 'torch', "
            "'rules' or a plan"
        )
    files = WeightFiles(weights)
    check_weights_out(files.path, weights_out)  # before the conversion, not after it
    return files


def calibrate(
    program_or_module: ExportedProgram | torch.nn.Module,
    data: Iterable[Any],
    example_inputs: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    dynamic_shapes: Any = None,
    keep: int = TOLERANCE_BATCHES,
    shard: tuple[int, int] | None = None,
    group: Any = None,
    progress: bool | None = None,
) -> Calibration:
    """The calibration statistics ``convert(..., policy="rules", calibration=...)`` would measure on ``data``,
    as a value: ``.save(path)``, ``precast.load_calibration(path)``, ``.merge(other, ...)``, and
    ``convert(..., calibration=cal)`` (or its path, or a list of them) converts with them without measuring.

    ``dtype``: the low dtype the conversion will use (its subnormal counts; a conversion to another is refused).
    ``keep``: batches kept for the tolerance search (the globally first). ``shard=(rank, world)``: ``data`` is
    ``batches[rank::world]`` (files of all the shards merge into the statistics of all the batches). With
    torch.distributed initialised (or ``group=``), every rank passes its shard and gets the merged statistics
    (docs/distributed.md); ``group=False``: this process alone. (``convert(calibration=batches)`` measures in
    its process alone: a conversion on rank 0 only never waits for the others.)"""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise PrecastError(f"keep={keep!r}: give a number of batches >= 0")
    with TORCH_LOCK:
        policy, low = resolve_policy("rules", dtype, device_type, {})
        state = begin(program_or_module, example_inputs, policy, low, device_type, dynamic_shapes, None)
        return calibrate_program(
            state.program,
            state.ep,
            data,
            low=state.low,
            keep=keep,
            progress=progress,
            shard=shard,
            group=process_group(group),
        )
