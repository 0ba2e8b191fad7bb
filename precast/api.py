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
from precast.numerics.calibration import TOLERANCE_BATCHES
from precast.numerics.distributed import process_group
from precast.pipeline.after_lowering import after_lowering
from precast.pipeline.conversion import begin, run_checks
from precast.pipeline.options import CheckedOptions, ConvertOptions
from precast.pipeline.prepare import prepare
from precast.pipeline.verify import verify_conversion
from precast.pipeline.weight_budget import WeightBudget, choose_weights
from precast.policy.measurements import Calibration
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
    program_or_module: ExportedProgram | torch.nn.Module,  # what to convert
    example_inputs: Any = None,  # (x,) or (args, kwargs): to export a module, and to verify the result
    *,
    dtype: torch.dtype | str | None = None,  # the low dtype: "bf16", "fp16" or a torch dtype
    device_type: str | None = None,  # "cpu" or "cuda": whose autocast tables apply
    policy: Any = None,  # None (the program's own regions), "torch", "rules", "auto" or a policy object
    exclude_nodes: Iterable[str] = (),  # rules: regexes on node names / module paths kept fp32
    exclude_ops: Iterable[Any] = (),  # rules: ops kept fp32
    include_nodes: Iterable[str] = (),  # rules: regexes on node names / module paths run low
    include_ops: Iterable[Any] = (),  # rules: ops run low
    data_max: float | None = None,  # rules: an op whose activations exceed this absmax stays fp32
    init_max: float | None = None,  # rules: an op whose constants exceed this absmax stays fp32
    max_reduction_depth: int | None = None,  # rules: an op accumulating over more elements stays fp32
    calibration: Iterable[Any] | None = None,  # rules: batches, or a precast.Calibration (or its file)
    tolerance: Any = None,  # rules: the accuracy the tolerance search keeps by putting ops back in fp32
    keep_io_types: bool | None = None,  # outputs cast back to the program's dtypes (None: the policy's)
    dynamic_shapes: Any = None,  # torch.export's dynamic_shapes, when precast exports a module
    custom_rules: Iterable[Any] = (),  # rules: (node, context) -> a reason to keep the node fp32, or None
    patterns: Iterable[str] | str | None = None,  # rules: the precision-sensitive patterns kept fp32
    verify: bool = True,  # run the converted program against its reference on the example inputs
    allow: Iterable[str] = (),  # diagnostic codes (precast.codes) whose errors become warnings
    plan: Any = None,  # a precast.Plan (or its JSON file): its ops stay fp32, its weight formats apply
    cache_dtype: torch.dtype | str | None = None,  # the caches the program stores into, held in this dtype
    weights: str | os.PathLike | None = None,  # safetensors files of the program's weights, streamed
    weights_out: str | os.PathLike | None = None,  # the folder the converted streamed weights go to
    weight_format: Any = None,  # linear/embedding weights in 8 or 4 bits, or a precast.WeightBudget
) -> ConvertResult:
    """Convert a program (or module + example inputs) to explicit mixed precision. Each keyword has its line
    above, and its section in the README ("API notes", "LLMs") and docs/ (rules, streaming, weight_formats,
    sensitivity); they become one ``ConvertOptions`` (``pipeline/options.py``), converted by ``convert_with``."""
    keywords = {
        "exclude_nodes": exclude_nodes,  # the rules keywords first (RulesPolicy's field names)
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
    return convert_with(program_or_module, example_inputs, ConvertOptions.from_keywords(keywords))


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
