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
from precast.numerics.calibration.checks import TOLERANCE_BATCHES
from precast.numerics.calibration.stage import calibrate as calibrate_program
from precast.numerics.distributed import process_group
from precast.pipeline.after_lowering import after_lowering
from precast.pipeline.conversion import begin, run_checks
from precast.pipeline.options import CheckedOptions, ConvertOptions
from precast.pipeline.prepare import prepare
from precast.pipeline.records import CacheOptions, IOOptions, VerifyOptions, WeightOptions, options_of
from precast.pipeline.verify import verify_conversion
from precast.policy.measurements import Calibration
from precast.policy.plan import load_plan
from precast.policy.resolve import POLICY_NAMES, resolve_policy
from precast.quant.budget import WeightBudget, choose_weights, fit_weights
from precast.report.build import fill_report, new_report, unchanged_report, write_program_info
from precast.report.model import Report
from precast.threads import TORCH_LOCK
from precast.weights.streamed import write_weights

__all__ = [
    "POLICY_NAMES",
    "CacheOptions",
    "ConvertOptions",
    "ConvertResult",
    "IOOptions",
    "VerifyOptions",
    "WeightOptions",
    "calibrate",
    "convert",
    "convert_with",
]


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
    policy: Any = None,  # None (the program's own regions), "torch", "rules", "auto" or a policy object
    dtype: torch.dtype | str | None = None,  # the low dtype: "bf16", "fp16" or a torch dtype
    device_type: str | None = None,  # "cpu" or "cuda": whose autocast tables apply
    weights: WeightOptions | str | os.PathLike | None = None,  # the weights' storage format, streamed files
    cache: CacheOptions | None = None,  # the caches the program stores into (an LLM's KV cache)
    io: IOOptions | None = None,  # outputs' dtypes, torch.export's dynamic_shapes
    verify: VerifyOptions | bool = True,  # run the converted program against its reference
    allow: Iterable[str] = (),  # diagnostic codes (precast.codes) whose errors become warnings
    plan: Any = None,  # a precast.Plan (or its JSON file): its ops stay fp32, its weight formats apply
    **shortcuts: Any,  # the release before's keywords (exclude_nodes=, weight_format=, ...): they warn
) -> ConvertResult:
    """Convert a program (or module + example inputs) to explicit mixed precision.

    The rules' options (``exclude_nodes``, ``calibration``, ``tolerance``, ...) are the policy's:
    ``policy=precast.RulesPolicy(...)``. ``weights=precast.WeightOptions(format="int8")`` stores weights in 8/4
    bits (``files=``/``out=``: streamed weights), ``cache=precast.CacheOptions(dtype="bf16")`` holds the KV
    cache low, ``io=precast.IOOptions(keep_types=..., dynamic_shapes=...)``, ``verify=False`` (or a
    ``precast.VerifyOptions``) skips verification. The keywords of the release before (the rules' options,
    ``weight_format``, ``weights_out``, ``cache_dtype``, ``keep_io_types``, ``dynamic_shapes``, ``weights=PATH``)
    still work for one release, each with a ``FutureWarning`` naming its new place; any other keyword is a
    ``TypeError``. README ("API notes", "LLMs") and docs/ (rules, streaming, weight_formats) say more; the
    arguments become one ``ConvertOptions`` (``pipeline/records.py``), converted by ``convert_with``."""
    given = {
        "policy": policy,
        "dtype": dtype,
        "device_type": device_type,
        "weights": weights,
        "cache": cache,
        "io": io,
        "verify": verify,
        "allow": allow,
        "plan": plan,
    }
    return convert_with(program_or_module, example_inputs, options_of(given, shortcuts))


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
        elif options.weight_data is not None:  # int4 weights fitted on the data (checked: rules name int4)
            fitted = load_plan(options.plan).roundings if options.plan is not None else {}
            fit_weights(state, options.weight_data, list(fitted) or None)
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
    """The calibration statistics ``convert(..., policy=RulesPolicy(calibration=...))`` would measure on
    ``data``, as a value: ``.save(path)``, ``precast.load_calibration(path)``, ``.merge(other, ...)``, and
    ``RulesPolicy(calibration=cal)`` (or its path, or a list of them) converts with them without measuring.

    ``dtype``: the low dtype the conversion will use (its subnormal counts; a conversion to another is refused).
    ``keep``: batches kept for the tolerance search (the globally first). ``shard=(rank, world)``: ``data`` is
    ``batches[rank::world]`` (files of all the shards merge into the statistics of all the batches). With
    torch.distributed initialised (or ``group=``), every rank passes its shard and gets the merged statistics
    (docs/distributed.md); ``group=False``: this process alone. (``RulesPolicy(calibration=batches)`` measures in
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
