"""The conversion pipeline: capture -> inline regions -> classify -> insert casts -> fold -> simplify -> verify."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast import diagnostics
from precast.capture import capture, normalize_inputs
from precast.classify import classify, fake_state
from precast.errors import PrecastError, first_line
from precast.passes.fold_constants import constant_bytes, fold_constant_casts
from precast.passes.insert_casts import insert_casts
from precast.passes.restore_io import output_dtypes, restore_output_dtypes
from precast.passes.simplify_casts import simplify_casts
from precast.policy.base import dtype_name
from precast.policy.torch_policy import TorchPolicy
from precast.program import META_KEY, Program, private_state, strip_dtype_asserts, written_targets
from precast.regions import inline_regions
from precast.report import Report, record_decisions, runtime_casts, write_program_info
from precast.verify import check_pass, compare

POLICIES = (None, "torch", "rules")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ConvertResult:
    program: ExportedProgram
    report: Report

    def module(self) -> torch.nn.Module:
        """``program.module()`` that warns once when called under an ambient ``torch.autocast``
        (``precast.guard_module`` does the same for any module built from a converted program)."""
        return diagnostics.guard_module(self.program.module())


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in (torch.bfloat16, torch.float16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise PrecastError(
        f"dtype={dtype!r}: precast lowers to torch.bfloat16 or torch.float16 ('bf16' / 'fp16')"
    )


def program_device_type(ep: ExportedProgram) -> str:
    """Device type of the program's floating constants (else its inputs); error if they disagree."""
    devices = {
        v.device.type
        for v in list(ep.state_dict.values()) + list(ep.constants.values())
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    if not devices:
        devices = {
            n.meta["val"].device.type
            for n in ep.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        }
    if len(devices) > 1:
        raise PrecastError(
            f"the program's floating parameters live on several device types ({', '.join(sorted(devices))}); pass "
            "device_type='cuda' or 'cpu' to say which autocast table to apply"
        )
    return devices.pop() if devices else "cpu"


def convert(
    program_or_module: ExportedProgram | torch.nn.Module,
    example_inputs: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    policy: str | None = None,
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

    ``allow``: diagnostic codes (``precast.diagnostics.CODES``, e.g. ``"control-flow"``) whose errors become
    warnings in ``report.diagnostics`` instead of stopping the conversion.
    """
    if policy not in POLICIES:
        raise PrecastError(
            f"policy={policy!r}: choose None (the program's own autocast regions), 'torch' or 'rules'"
        )
    low = parse_dtype(dtype)
    region = _policy_region(program_or_module, policy, device_type, low)
    ep = capture(
        program_or_module, example_inputs, dynamic_shapes, distinct_values=policy == "torch", autocast=region
    )
    device = device_type or program_device_type(ep)
    if device not in ("cpu", "cuda"):
        raise PrecastError(f"device_type={device!r}: precast has autocast tables for 'cpu' and 'cuda'")
    if low is None and policy is not None:
        low = torch.get_autocast_dtype(device)

    inputs = _example_inputs(ep, example_inputs) if program_or_module is ep else None
    program = Program(ep)
    regions = inline_regions(program.gm)
    rep = Report(policy=policy, dtype=dtype_name(low) if policy else None, device_type=device)
    rep.regions = [_region_dict(r) for r in regions]
    rep.allowed = diagnostics.parse_allow(allow)
    diagnostics.check_program(ep, program.gm, regions, rep)
    rep.weight_bytes_before = constant_bytes(program)

    rule_opts = dict(
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
    if policy != "rules":
        given = [k for k, v in rule_opts.items() if v not in (None, ())]
        if given:
            raise PrecastError(
                f"{', '.join(given)}: these options belong to policy='rules'; pass policy='rules' to use them"
            )
    if keep_io_types is not None and not isinstance(keep_io_types, bool):
        raise PrecastError(
            f"keep_io_types={keep_io_types!r}: give True, False or None (the policy's default)"
        )

    if policy is None and not regions:
        rep.weight_bytes_after = dict(rep.weight_bytes_before)
        diagnostics.record(
            rep,
            "no-regions",
            "the program has no autocast regions: returned unchanged "
            "(use policy='torch' or 'rules' to add mixed precision)",
        )
        # a program of its own (same graph, its own copies of the buffers it writes), not the caller's object
        return ConvertResult(private_state(ep), rep)

    if policy == "rules":
        from precast.policy.rules import convert_with_rules

        return convert_with_rules(
            program,
            ep,
            rep,
            low=low,
            device=device,
            keep_io_types=keep_io_types,
            verify=verify,
            inputs=inputs,
            **rule_opts,
        )

    pol = TorchPolicy(device, low) if policy == "torch" else None
    original_out = output_dtypes(program.graph)
    if region is not None and keep_io_types:
        # traced under autocast, the program's outputs are already low: the types to keep are the module's own
        plain = capture(program_or_module, example_inputs, dynamic_shapes, distinct_values=True)
        original_out = output_dtypes(plain.graph)
    run_pipeline(program, pol, rep)
    if keep_io_types:
        run_pass(program, "restore_output_dtypes", restore_output_dtypes, original_out, True)
    out = finish(program, rep)
    if verify:
        original = program_or_module if isinstance(program_or_module, torch.nn.Module) else None
        _verify(out, ep, rep, policy, device, low, original, inputs)
    write_program_info(out, rep)
    return ConvertResult(out, rep)


def _policy_region(module: Any, policy: str | None, device_type: str | None, low) -> tuple | None:
    """For policy "torch" on a module: the autocast (device, dtype) to export its forward in (see capture), when
    that autocast can run here (a CUDA autocast needs a GPU; without one the policy applies to the plain export)."""
    if policy != "torch" or not isinstance(module, torch.nn.Module):
        return None
    floats = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    device = device_type or (floats[0].device.type if floats else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        return None
    return device, low if low is not None else torch.get_autocast_dtype(device)


def _example_inputs(ep: ExportedProgram, example_inputs: Any) -> tuple[tuple, dict] | None:
    """Inputs given beside a program: checked against its signature now (one clear error), used to verify."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, str) or not isinstance(example_inputs, (torch.Tensor, tuple, list, dict)):
        raise PrecastError(
            f"example_inputs: got {type(example_inputs).__name__}; give the program's inputs as a tuple (x,), "
            "a dict of keyword inputs or (args, kwargs)"
        )
    args, kwargs = normalize_inputs(example_inputs)
    try:
        flat = ep._graph_module_flat_inputs(args, kwargs)  # export's own structure and shape checks
    except Exception as exc:
        raise PrecastError(
            f"example_inputs do not match the program's signature ({first_line(exc)}); give inputs like the "
            "ones it was exported with"
        ) from exc
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, flat, strict=True):
        want = node.meta.get("val")
        if isinstance(want, torch.Tensor) and isinstance(value, torch.Tensor) and value.dtype != want.dtype:
            raise PrecastError(
                f"example_inputs: input '{node.name}' is {value.dtype}, the program takes {want.dtype}; give "
                "inputs like the ones it was exported with"
            )
    return args, kwargs


def run_pass(program: Program, name: str, fn: Any, *args: Any) -> Any:
    """Run one pass, then check the graph it leaves: it lints and fake-propagates, or the conversion stops with
    a PrecastError naming the pass (an internal failure, never a raw exception)."""
    fake_state(program)  # the fake values the check after the pass compares against (made once per program)
    try:
        result = fn(program, *args)
    except PrecastError:
        raise
    except Exception as exc:
        raise PrecastError(
            f"internal error in pass {name}: {type(exc).__name__}: {first_line(exc)} "
            "(please report it with the program that triggers it)",
            code="internal-error",
        ) from exc
    check_pass(program, name)
    return result


def run_pipeline(program: Program, policy: Any, rep: Report, user_rules: tuple = ()) -> None:
    """classify -> insert casts -> fold -> simplify, recording what each stage did in the report."""
    result = classify(program, policy, user_rules, on_error=diagnostics.classify_error_handler(rep))
    rep.decomposed = result.decomposed or []  # classify fake-propagates as it goes; it rewrites nothing yet
    run_pass(program, "insert_casts", insert_casts)
    fold = run_pass(program, "fold_constant_casts", fold_constant_casts)
    rep.casts_folded = fold.folded
    rep.constants_created = fold.created
    rep.constants_dropped = fold.dropped
    if fold.written:
        diagnostics.record(
            rep,
            "written-constant-not-folded",
            f"{len(fold.written)} constant(s) the program writes keep their casts at run time (their value "
            f"changes from call to call, so a cast copy made once would go stale): {', '.join(fold.written)}",
        )
    for name, count in fold.clamped.items():
        diagnostics.record(
            rep,
            "fp16-clamped",
            f"constant {name}: {count} value(s) beyond float16's range stored clamped to ±65504 (not inf)",
            fix="keep the ops reading it in float32 (init_max, exclude_nodes) if the clamp matters",
        )
    simple = run_pass(
        program,
        "simplify_casts",
        lambda p: simplify_casts(p.graph, p.input_spec, p.output_specs),
    )
    rep.casts_simplified = simple.removed


def finish(program: Program, rep: Report) -> ExportedProgram:
    rep.nodes = record_decisions(program.graph)
    rep.casts = runtime_casts(program.graph)
    rep.casts_runtime = len(rep.casts)
    rep.weight_bytes_after = constant_bytes(program)
    _record_program_info(program, rep)
    return program.to_exported_program()


def _record_program_info(program: Program, rep: Report) -> None:
    """Program-level report fields go on the first op node's custom meta (placeholder meta is not saved)."""
    first = next((n for n in program.graph.nodes if n.op == "call_function"), None)
    if first is None:
        return
    info = {
        "policy": rep.policy,
        "dtype": rep.dtype,
        "device_type": rep.device_type,
        "regions": rep.regions,
        "casts_folded": rep.casts_folded,
        "casts_simplified": rep.casts_simplified,
        "weight_bytes_before": rep.weight_bytes_before,
        "decomposed": rep.decomposed,
    }
    first.meta.setdefault("custom", {}).setdefault(META_KEY, {})["program"] = info


def _region_dict(region) -> dict:
    d = dataclasses.asdict(region)
    d["dtype"] = dtype_name(region.dtype)
    return d


def reference_module(ep: ExportedProgram) -> torch.nn.Module:
    """``ep.module()`` without export's ``_assert_tensor_metadata`` checks, which pin the dtypes seen at export
    and so fail when the program runs under an ambient autocast (eager has no such checks)."""
    return strip_dtype_asserts(ep.module())


def _verify(
    out: ExportedProgram, ep: ExportedProgram, rep: Report, policy, device, low, original=None, inputs=None
) -> None:
    """Run the converted program against the reference semantics, each on private copies of the state it
    writes: neither the caller's module or program nor the returned program changes."""
    if inputs is None and ep.example_inputs is None:
        diagnostics.record(
            rep,
            "verification-skipped",
            "not verified: the program has no example inputs; pass example_inputs=(x,) to convert",
        )
        return
    args, kwargs = inputs if inputs is not None else normalize_inputs(ep.example_inputs)
    if (
        any(
            isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in pytree.tree_leaves((args, kwargs))
        )
        and not torch.cuda.is_available()
    ):
        diagnostics.record(
            rep,
            "verification-skipped",
            "not verified: the example inputs are on a device this machine does not have; run precast check "
            "on a machine with it",
        )
        return
    batches = [(args, kwargs)]
    second = _second_batch(ep, args, kwargs)
    if second is not None:
        batches.append(second)  # a dynamic batch dim: a program narrowed to the example size fails here
    results = []
    for a, k in batches:
        # fresh private copies of the written state for each run, on both sides
        module = private_state(out).module()  # unlifted once per run
        ok, got = diagnostics.run_checked(module, a, k, rep)
        if not ok:
            diagnostics.raise_errors(rep)
            return  # allowed: the program fails on this device, so there is nothing to compare
        ref, name = _reference(ep, policy, device, low, original)
        try:
            with torch.no_grad():
                want = ref(*a, **k)
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is reported, not raised raw
            diagnostics.record(
                rep,
                "verification-skipped",
                f"not verified: {name} itself fails on the example inputs ({type(exc).__name__}: "
                f"{first_line(exc)}); the converted program ran, there is nothing to compare it with",
            )
            return
        converted = module if got is None else (lambda *_a, _got=got, **_k: _got)
        results.append(compare(converted, lambda *_a, _w=want, **_k: _w, a, k, reference_name=name))
    rep.verification = results[0]
    if len(results) > 1:
        size = _batch_size(batches[1])
        rep.verification["second_batch"] = {"batch": size, **results[1]}
        if not results[1]["bitwise"] and results[0]["bitwise"]:
            rep.verification["bitwise"] = False
            rep.verification["verdict"] = f"at batch {size}: {results[1]['verdict']}"
    if rep.verification["bitwise"]:
        return
    if policy == "rules":
        # nobody promised rules are bitwise: the measured difference from fp32 is information
        diagnostics.record(rep, "measured-error", f"outputs vs {name}: {rep.verification['verdict']}")
    else:
        diagnostics.record(rep, "not-bitwise", f"outputs differ from {name}: {rep.verification['verdict']}")


def _reference(ep: ExportedProgram, policy, device, low, original) -> tuple[Any, str]:
    """The reference semantics as a callable on private copies of the state it writes, and its name."""
    if policy != "torch":
        return private_state(ep).module(), "the unconverted program"
    if original is not None:
        reference = _with_private_buffers(original, written_targets(ep))
    else:
        reference = reference_module(private_state(ep))

    def ref(*a, **k):
        # the MHA fast path is a fused kernel torch.export never records: compare against the regular path
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            # cache off: eager's cast cache is keyed by tensor, not dtype (stale copies in nested regions)
            with torch.autocast(device, dtype=low, cache_enabled=False):
                return reference(*a, **k)
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)

    return ref, f"eager torch.autocast({device}, {dtype_name(low)})"


def _batch_size(batch: tuple[tuple, dict]) -> int | None:
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()]
    return leaves[0].shape[0] if leaves else None


def _second_batch(ep: ExportedProgram, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The example inputs at another batch size, when every input's dim 0 is one dynamic symbol of the
    program (within its range); None otherwise."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = [
        n
        for n, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True)
        if spec.kind.name == "USER_INPUT"
    ]
    dims = [
        n.meta["val"].shape[0]
        for n in user
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
    ]
    exprs = {d.node.expr if isinstance(d, torch.SymInt) else d for d in dims}
    if len(exprs) != 1:
        return None
    expr = exprs.pop()
    if not isinstance(expr, sympy.Symbol):
        return None  # static, or a derived size: leave it to the example batch
    size = _batch_size((args, kwargs))
    bounds = ep.range_constraints.get(expr)
    lower = int(bounds.lower) if bounds is not None else 2
    upper = bounds.upper if bounds is not None else size + 1
    new = size + 1 if size + 1 <= upper else size - 1
    if size is None or new < max(lower, 1) or new == size:
        return None

    def resize(t):
        if not (isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size):
            return t
        return torch.cat([t, t[:1]]) if new > size else t[:new]

    return pytree.tree_map(resize, (args, kwargs))


def _with_private_buffers(module: torch.nn.Module, written: set[str]) -> Any:
    """Call ``module`` with private copies of the tensors its forward writes (the caller's stay as they are)."""
    if not written:
        return module
    own = dict(module.named_parameters(remove_duplicate=False)) | dict(
        module.named_buffers(remove_duplicate=False)
    )
    missing = written - own.keys()
    if missing:
        raise PrecastError(
            f"cannot verify against {type(module).__name__}: the program writes {', '.join(sorted(missing))}, "
            "which the module does not have under those names; pass the exported program instead, or verify=False"
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        copies = {k: own[k].detach().clone() for k in written}
        return torch.func.functional_call(module, copies, args, kwargs, strict=False)

    return call
