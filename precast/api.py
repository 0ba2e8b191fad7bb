"""``precast.convert``: a short driver over the pipeline's stages (``precast.pipeline``), in order.

Input: an ``ExportedProgram`` or an ``nn.Module`` with example inputs, a policy (None, "torch", "rules", or a
policy object: ``TorchPolicy``, ``RulesPolicy``, or any object with ``name``, ``autocast_state`` and
``decide``), options. Output: ``ConvertResult(program, report)``: a standard ``ExportedProgram`` with explicit
casts and weights cast once, and the report of every decision.

Authority, first decision wins: the program's own autocast regions, the user's rules (include/exclude, custom
rules), the policy (``precast.policy.compose``). Every option is honoured under every policy it applies to,
or refused with one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.dtypes import dtype_name, parse_low_dtype
from precast.errors import PrecastError
from precast.guard import guard_module
from precast.ir import diagnostics
from precast.ir.graph import constant_bytes, output_dtypes
from precast.ir.inputs import check_example_inputs
from precast.ir.program import Program, private_state, program_device_type
from precast.pipeline import checks, lower
from precast.pipeline.capture import capture, policy_region
from precast.pipeline.checks import device_fallback
from precast.pipeline.prepare import auto_confirm, prepare_policy
from precast.pipeline.regions import inline_regions
from precast.pipeline.runner import run_stage, timed
from precast.pipeline.tolerance import tolerance_check
from precast.pipeline.verify import verify_stage
from precast.policy.auto import AutoDecider, AutoPolicy
from precast.policy.rules.policy import RulesDecider, RulesPolicy
from precast.policy.torch_policy import TorchPolicy
from precast.report.build import finish, region_dict, rules_notes, write_program_info
from precast.report.model import Report

POLICY_NAMES = (None, "torch", "rules", "auto")


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
) -> ConvertResult:
    """Convert a program (or module + example inputs) to explicit mixed precision. See the README.

    ``policy``: None (the program's own autocast regions), "torch" / ``TorchPolicy(device_type, dtype)`` (eager
    autocast semantics), "rules" / ``RulesPolicy(...)`` (everything low except what rules keep fp32; the rules
    keywords here are a shorthand for ``RulesPolicy(...)``), or a policy object of your own.
    ``allow``: diagnostic codes (``precast.codes``, e.g. ``"control-flow"``) whose errors become warnings in
    ``report.diagnostics`` instead of stopping the conversion.
    """
    rule_kw = dict(
        exclude_nodes=tuple(exclude_nodes),
        exclude_ops=tuple(exclude_ops),
        include_nodes=tuple(include_nodes),
        include_ops=tuple(include_ops),
        data_max=data_max,
        init_max=init_max,
        max_reduction_depth=max_reduction_depth,
        calibration=calibration,
        tolerance=tolerance,
        custom_rules=tuple(custom_rules),
        patterns=patterns if patterns is None or isinstance(patterns, str) else tuple(patterns),
    )
    kind, pol, low = _resolve_policy(policy, dtype, device_type, rule_kw)
    if isinstance(pol, TorchPolicy):
        device_type = device_type or pol.device_type
    if keep_io_types is not None and not isinstance(keep_io_types, bool):
        raise PrecastError(
            f"keep_io_types={keep_io_types!r}: give True, False or None (the policy's default)"
        )

    # capture
    region = policy_region(program_or_module, kind, device_type, low)
    with timed("capture"):
        ep = capture(
            program_or_module,
            example_inputs,
            dynamic_shapes,
            distinct_values=kind == "torch",
            autocast=region,
        )
    device = device_type or program_device_type(ep)
    if device not in ("cpu", "cuda"):
        raise PrecastError(f"device_type={device!r}: precast has autocast tables for 'cpu' and 'cuda'")
    if low is None and kind is not None:
        low = torch.get_autocast_dtype(device)
    if isinstance(pol, TorchPolicy):
        pol = TorchPolicy(device, low)
    inputs = check_example_inputs(ep, example_inputs) if program_or_module is ep else None

    # program copy, regions, checks
    program = run_stage(None, "program_copy", lambda _: Program(ep))
    regions = run_stage(program, "inline_regions", lambda p: inline_regions(p.gm))
    rep = Report(policy=kind, dtype=dtype_name(low) if kind else None, device_type=device)
    rep.regions = [region_dict(r) for r in regions]
    rep.allowed = diagnostics.parse_allow(allow)
    run_stage(program, "checks", lambda p: checks.check_program(ep, p.gm, regions, rep))
    rep.weight_bytes_before = constant_bytes(program)

    if kind is None and not regions:
        rep.weight_bytes_after = dict(rep.weight_bytes_before)
        diagnostics.record(
            rep,
            "no-regions",
            "the program has no autocast regions: returned unchanged "
            "(use policy='torch' or 'rules' to add mixed precision)",
        )
        # a program of its own (same graph, its own copies of the buffers it writes), not the caller's object
        return ConvertResult(private_state(ep), rep)

    original_out = output_dtypes(program.graph)
    if region is not None and keep_io_types:
        # traced under autocast, the program's outputs are already low: the types to keep are the module's own
        plain = capture(program_or_module, example_inputs, dynamic_shapes, distinct_values=True)
        original_out = output_dtypes(plain.graph)

    # calibrate, latency, tolerance, bind (rules, auto)
    prep = prepare_policy(program, ep, pol, low, device, rep) if isinstance(pol, RulesPolicy) else None
    decider = prep.decider if prep is not None else pol

    # classify, rewrite, fold, simplify, restore outputs
    keep_io = keep_io_types if keep_io_types is not None else isinstance(pol, RulesPolicy)
    restore = original_out  # user outputs only with keep_io; state the program writes always keeps its dtype
    mark = len(rep.diagnostics)

    def report_stage(prog: Program, st: Any) -> ExportedProgram:
        rep.decomposed = st.decomposed
        rep.casts_folded, rep.casts_simplified = st.casts_folded, st.casts_simplified
        rep.constants_created, rep.constants_dropped = st.constants_created, st.constants_dropped
        return run_stage(prog, "report", lambda p: finish(p, rep))

    stats = lower(program, decider, rep, restore=restore, keep_io=keep_io)
    out = report_stage(program, stats)

    # rules/auto: ops without a low-precision kernel on this device go back to fp32, converted again
    ran = None  # the converted program's outputs on the example inputs, when the device check ran it
    if isinstance(decider, RulesDecider):

        def relower(device_fp32: dict[str, str], **extra: Any) -> tuple:
            del rep.diagnostics[mark:]  # the lowering's own diagnostics are recorded afresh
            fresh = run_stage(None, "program_copy", lambda _: Program(ep))
            run_stage(fresh, "inline_regions", lambda p: inline_regions(p.gm))
            d = prep.rebind(fresh, device_fp32=device_fp32, **extra)
            st = lower(fresh, d, rep, restore=restore, keep_io=keep_io)
            return fresh, d, st, report_stage(fresh, st)

        with timed("device_check"):
            fell, ran = device_fallback(out, ep, inputs, decider, rep, relower)
        if fell is not None:
            program, decider, stats, out = fell
        if isinstance(decider, AutoDecider):
            with timed("auto_confirm"):
                fell = auto_confirm(out, ep, inputs, decider, pol, rep, device, relower, prep.latency_run)
            if fell is not None:
                program, decider, stats, out = fell
                ran = None  # another program now

    # report
    if prep is not None:
        rules_notes(rep, prep.calibration, prep.opts)
        if prep.search is not None:
            run_stage(
                program, "tolerance_check", lambda _: tolerance_check(out, prep.search, prep.calibration, rep)
            )

    # verify
    if verify:
        original = program_or_module if isinstance(program_or_module, torch.nn.Module) else None
        # the reference follows the policy's class, not its name (a policy of the user's may call itself "torch")
        ref_kind = kind if pol is None or isinstance(pol, (TorchPolicy, RulesPolicy)) else "custom"
        with timed("verify"):
            result = verify_stage(out, ep, rep, ref_kind, device, low, original, inputs, ran=ran)
        if result:
            rep.verification = {**result, **rep.verification}
    write_program_info(out, rep)
    return ConvertResult(out, rep)


def _resolve_policy(policy: Any, dtype: Any, device_type: str | None, rule_kw: dict) -> tuple:
    """(kind, policy object or None, low dtype or None) from what the user passed; one line for a bad mix."""
    low = parse_low_dtype(dtype)
    given = [k for k, v in rule_kw.items() if v not in (None, ())]
    if isinstance(policy, str) or policy is None:
        if policy not in POLICY_NAMES:
            raise PrecastError(
                f"policy={policy!r}: choose None (the program's own autocast regions), 'torch', 'rules', 'auto', "
                "or a policy object (precast.TorchPolicy, precast.RulesPolicy, precast.AutoPolicy, or your own)"
            )
        if policy not in ("rules", "auto") and given:
            raise PrecastError(
                f"{', '.join(given)}: these options belong to policy='rules' (or 'auto'); pass policy='rules' "
                "to use them"
            )
        if policy == "rules":
            return "rules", RulesPolicy(dtype=low, **rule_kw), low
        if policy == "auto":
            return "auto", AutoPolicy(dtype=low, **rule_kw), low
        if policy == "torch":
            return "torch", TorchPolicy(device_type, low), low
        return None, None, low
    if given:
        raise PrecastError(
            f"{', '.join(given)}: give these options inside the policy object ({type(policy).__name__}(...)), "
            "or use policy='rules' with keywords, not both"
        )
    if isinstance(policy, RulesPolicy):
        mine = parse_low_dtype(policy.dtype)
        if low is not None and mine is not None and low != mine:
            raise PrecastError(
                f"dtype={dtype!r} but the {type(policy).__name__} says dtype={policy.dtype!r}: give one"
            )
        return policy.name, policy, low or mine
    if isinstance(policy, TorchPolicy):
        if low is not None and policy.dtype is not None and low != policy.dtype:
            raise PrecastError(f"dtype={dtype!r} but the TorchPolicy says dtype={policy.dtype}: give one")
        if device_type is not None and policy.device_type not in (None, device_type):
            raise PrecastError(
                f"device_type={device_type!r} but the TorchPolicy says {policy.device_type!r}: give one"
            )
        return "torch", policy, low or policy.dtype
    missing = [a for a in ("name", "autocast_state", "decide") if not hasattr(policy, a)]
    if missing:
        raise PrecastError(
            f"policy={policy!r}: not a policy (missing {', '.join(missing)}); give None, 'torch', 'rules' or an "
            "object with name, autocast_state(device_type) and decide(node, args, kwargs)"
        )
    return str(policy.name), policy, low
