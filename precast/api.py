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

from precast.errors import PrecastError
from precast.guard import guard_module
from precast.ir.program import private_state
from precast.numerics.calibrate import calibrate as calibrate_program
from precast.numerics.calibration import TOLERANCE_BATCHES, Calibration
from precast.numerics.distributed import process_group
from precast.pipeline.after_lowering import after_lowering
from precast.pipeline.conversion import begin, run_checks
from precast.pipeline.options import CheckedOptions, ConvertOptions
from precast.pipeline.prepare import prepare
from precast.pipeline.verify import verify_conversion
from precast.pipeline.weight_budget import WeightBudget, choose_weights
from precast.policy.resolve import POLICY_NAMES, resolve_policy
from precast.report.build import fill_report, new_report, unchanged_report, write_program_info
from precast.report.model import Report
from precast.threads import TORCH_LOCK
from precast.weights.streamed import write_weights

__all__ = ["POLICY_NAMES", "ConvertOptions", "ConvertResult", "calibrate", "convert", "convert_with"]


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
    weight_format: Any = None,
) -> ConvertResult:
    """Convert a program (or module + example inputs) to explicit mixed precision. See the README.

    The keywords become one ``ConvertOptions`` (``precast/pipeline/options.py``; the rules keywords by
    ``RulesPolicy``'s field names), checked there, and converted by ``convert_with``.

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
    ``weight_format``: store the weights of linears and embeddings in 8 or 4 bits, dequantized in the graph
    (``"int8"``: per output channel; ``"int4"``: groups of 64, ``"int4-g32"``/``"int4-g128"``; or a mapping of
    glob patterns over weight names to formats, first match first, ``"float"`` for "as the policy computes";
    docs/weight_formats.md); or ``precast.WeightBudget(kld=..., data=batches)`` (also ``bytes=``, ``bits=``): each
    weight's format chosen by its measured effect on the outputs, the cheapest that meet the budget. Under every
    policy; the report lists each weight's format, why, and bytes.
    """
    rules = {
        "exclude_nodes": exclude_nodes,
        "exclude_ops": exclude_ops,
        "include_nodes": include_nodes,
        "include_ops": include_ops,
        "data_max": data_max,
        "init_max": init_max,
        "max_reduction_depth": max_reduction_depth,
        "calibration": calibration,
        "tolerance": tolerance,
        "custom_rules": custom_rules,
        "patterns": patterns,
    }
    options = ConvertOptions.from_keywords(
        {
            **rules,
            "dtype": dtype,
            "device_type": device_type,
            "policy": policy,
            "keep_io_types": keep_io_types,
            "dynamic_shapes": dynamic_shapes,
            "verify": verify,
            "allow": allow,
            "plan": plan,
            "cache_dtype": cache_dtype,
            "weights": weights,
            "weights_out": weights_out,
            "weight_format": weight_format,
        }
    )
    return convert_with(program_or_module, example_inputs, options)


def convert_with(
    source: ExportedProgram | torch.nn.Module, example_inputs: Any, options: ConvertOptions
) -> ConvertResult:
    """``convert``'s steps over one options record (what ``precast.convert`` and ``precast convert`` run)."""
    # one conversion at a time per process: torch 2.15's export picks up another thread's fake tensors as
    # constants (measured: 'fake tensor in the exported program constant's list'); see precast/threads.py
    with TORCH_LOCK:
        policy, checked = options.check(source)  # every refusal of a bad option, before anything runs
        state = begin(source, example_inputs, policy, checked)  # capture, program copy, regions
        state.log = report = new_report(state, checked.allowed)
        run_checks(state)
        if isinstance(
            options.weight_format, WeightBudget
        ):  # each weight's format measured on its fp32 weights
            report.weight_budget = choose_weights(state, options.weight_format).to_json(options.weight_format)
        if state.unchanged:  # a program of its own (same graph, its own copies of the state it writes)
            return result(private_state(state.captured), unchanged_report(report), checked)
        prepare(state)  # the policy's prepare steps: calibrate, latency, tolerance search
        state.lower_program()  # classify .. restore_io, export
        after_lowering(state)  # the policy's checks after lowering: device fallback, auto's confirmation
        fill_report(state, report)
        if options.verify:
            report.verification = verify_conversion(state, report.verification)
        converted = result(state.lowered.exported, report, checked)  # type: ignore[union-attr]
        write_program_info(converted.program, report)  # after the weights: their record is saved too
        return converted


def result(program: ExportedProgram, report: Report, options: CheckedOptions) -> ConvertResult:
    """The converted program and its report; streamed weights (``weights=``) written to ``weights_out`` first."""
    if options.files is not None:
        report.weights = write_weights(program, options.files, options.given.weights_out)  # type: ignore[arg-type]
    return ConvertResult(program, report)


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
        options = CheckedOptions.of(low, device_type=device_type, dynamic_shapes=dynamic_shapes)
        state = begin(program_or_module, example_inputs, policy, options)
        return calibrate_program(
            state.program,
            state.captured,
            data,
            low=state.low,
            keep=keep,
            progress=progress,
            shard=shard,
            group=process_group(group),
        )
