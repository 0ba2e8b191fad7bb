"""Verify (the last stage): run the converted program against the reference semantics and compare outputs.

The reference is eager ``torch.autocast`` for policy torch (the caller's module when given, run with private
copies swapped in for every tensor it writes: buffers, and the tensors non-strict export lifted as constants,
``ir/module_state.py``) and the unconverted program otherwise. Both sides run on private copies of the state they write, fresh for each run; a dynamic batch is
also checked at a second size. The converted side runs through the device check (``checks.run_checked``), so
an op the device cannot run is named instead of failing somewhere inside torch.

Input: the converted and the reference program, example inputs. Output: the verification record
(reference, bitwise, max abs error, per-output metrics from ``precast.metrics``, a second batch when dynamic)
and diagnostics (``not-bitwise`` where bitwise was promised, ``measured-error`` otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.utils._pytree import PyTree

from precast.dtypes import dtype_name
from precast.errors import first_line
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.inputs import normalize_inputs
from precast.ir.module_state import private_call
from precast.ir.program import private_state, strip_dtype_asserts, written_targets
from precast.metrics import compare_outputs
from precast.passes.runner import timed
from precast.pipeline import checks
from precast.pipeline.conversion import Conversion
from precast.policy.hooks import hook
from precast.policy.writes import CastWrites


def compare(
    converted: Callable, reference: Callable, args: tuple, kwargs: dict, *, reference_name: str
) -> dict:
    with torch.no_grad():
        got = converted(*args, **kwargs)
        want = reference(*args, **kwargs)
    metrics = compare_outputs(got, want)
    bitwise = all(m["bitwise"] for m in metrics)
    worst = max((m["max_abs"] for m in metrics), default=0.0)
    verdict = "bitwise equal" if bitwise else f"max abs error {worst:.3g}"
    return {
        "reference": reference_name,
        "bitwise": bitwise,
        "max_abs": worst,
        "outputs": metrics,
        "verdict": verdict,
    }


def reference_module(ep: ExportedProgram) -> torch.nn.Module:
    """``ep.module()`` without export's ``_assert_tensor_metadata`` checks, which pin the dtypes seen at export
    and so fail when the program runs under an ambient autocast (eager has no such checks)."""
    return strip_dtype_asserts(ep.module())


@dataclass
class _Verify:
    """One verification's two sides and what its diagnostics need: the converted program, the reference
    (``reference``: its kind, run on ``device`` in ``low``), the log, a run of the converted program to reuse."""

    out: ExportedProgram
    ep: ExportedProgram
    rep: DiagnosticLog
    reference: str
    device: str
    low: torch.dtype | None
    original: torch.nn.Module | None
    origins: dict[str, torch.Tensor]
    ran: PyTree
    promised: bool


def verify_stage(
    out: ExportedProgram,
    ep: ExportedProgram,
    rep: DiagnosticLog,
    reference: str,
    device: str,
    low: torch.dtype | None,
    original: torch.nn.Module | None = None,
    inputs: tuple[tuple, dict] | None = None,
    *,
    ran: PyTree = None,
    origins: dict[str, torch.Tensor] | None = None,
    promised: bool = True,
) -> dict:
    """Run the converted program against the reference semantics, each on private copies of the state it
    writes: neither the caller's module or program nor the returned program changes. ``reference``:
    "autocast" (eager autocast, promised bitwise: a difference is a warning), "program" (the unconverted
    program, promised bitwise) or "measured" (the unconverted program; the difference is information: rules,
    auto, a policy of the user's; ``precast.policy.hooks.PolicyHooks.reference``). ``ran``: the converted
    program's outputs on the example inputs when the device check already ran it there
    (``after_lowering.device_fallback``): not run again. ``origins``: the caller's tensor behind each constant
    of ``ep`` exported from ``original`` (``capture.Captured.origins``), where the reference run swaps in its
    private copies. ``promised=False`` (caches held in a low dtype: ``cache_dtype=``): a difference from the
    reference is the measured error of that choice, not a broken promise.
    Returns the verification record ({} when it could not run; a diagnostic says why)."""
    example = _example_batch(ep, rep, inputs)
    if example is None:
        return {}
    check = _Verify(out, ep, rep, reference, device, low, original, origins or {}, ran, promised)
    batches = [example]
    second = _second_batch(ep, *example)
    if second is not None:
        batches.append(second)  # a dynamic batch dim: a program narrowed to the example size fails here
    compared = _compare_batches(check, batches)
    if compared is None:
        return {}
    results, name = compared
    verification = _with_second_batch(results, batches)
    if not verification["bitwise"]:
        _record_difference(check, verification, results, batches, name)
    return verification


def _example_batch(
    ep: ExportedProgram, rep: DiagnosticLog, inputs: tuple[tuple, dict] | None
) -> tuple[tuple, dict] | None:
    """The example inputs verification runs on, or None (a ``verification-skipped`` warning says why: there
    are none, or they are on a device this machine does not have)."""
    if inputs is None and ep.example_inputs is None:
        diagnostics.record(
            rep,
            "verification-skipped",
            "not verified: the program has no example inputs; pass example_inputs=(x,) to convert",
        )
        return None
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
        return None
    return args, kwargs


def _compare_batches(check: _Verify, batches: list[tuple[tuple, dict]]) -> tuple[list[dict], str] | None:
    """Each batch through the converted program and the reference: one comparison per batch, and the
    reference's name; None when a side cannot run (an error raised, or a diagnostic says why)."""
    results = []
    for i, (a, k) in enumerate(batches):
        # fresh private copies of the written state for each run, on both sides
        if i == 0 and check.ran is not None:
            module, got = None, check.ran
        else:
            module = private_state(check.out).module()  # unlifted once per run
            ok, got = checks.run_checked(module, a, k, check.rep)
            if not ok:
                diagnostics.raise_errors(check.rep)
                return None  # allowed: the program fails on this device, so there is nothing to compare
        ref, name = _reference(
            check.ep, check.reference, check.device, check.low, check.original, check.origins
        )
        try:
            with torch.no_grad():
                want = ref(*a, **k)
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is reported, not raised raw
            diagnostics.record(
                check.rep,
                "verification-skipped",
                f"not verified: {name} itself fails on the example inputs ({type(exc).__name__}: "
                f"{first_line(exc)}); the converted program ran, there is nothing to compare it with",
            )
            return None
        converted = module if got is None else (lambda *_a, _got=got, **_k: _got)
        results.append(compare(converted, lambda *_a, _w=want, **_k: _w, a, k, reference_name=name))
    return results, name


def _with_second_batch(results: list[dict], batches: list[tuple[tuple, dict]]) -> dict:
    """The verification record: the example batch's comparison, with the second batch's (when dynamic) under
    ``second_batch``; a second batch that alone differs makes the whole record not bitwise."""
    verification = results[0]
    if len(results) > 1:
        size = _batch_size(batches[1])
        verification["second_batch"] = {"batch": size, **results[1]}
        if not results[1]["bitwise"] and results[0]["bitwise"]:
            verification["bitwise"] = False
            verification["verdict"] = f"at batch {size}: {results[1]['verdict']}"
    return verification


def _record_difference(
    check: _Verify, verification: dict, results: list[dict], batches: list[tuple[tuple, dict]], name: str
) -> None:
    """The diagnostic for outputs that differ from the reference ``name``: torch.export's own difference from
    eager (``export_baseline`` added to the record), a broken promise (``not-bitwise``), or information
    (``measured-error``)."""
    baseline = (
        _export_baseline(check.out, check.ep, batches)
        if check.reference == "autocast" and check.original is not None and check.promised
        else None
    )
    if baseline is not None:
        baseline["export_vs_eager"] = max(r["max_abs"] for r in results)
        verification["export_baseline"] = baseline
        diagnostics.record(
            check.rep,
            "export-differs-from-eager",
            f"outputs are bitwise the exported program; torch.export's record of the forward itself differs from "
            f"{name} by {baseline['export_vs_eager']:.3g} ({verification['verdict']} here)",
        )
    elif check.reference in ("program", "autocast") and check.promised:
        diagnostics.record(check.rep, "not-bitwise", f"outputs differ from {name}: {verification['verdict']}")
    else:
        # nobody promised rules (or a policy of the user's) are bitwise: the measured difference is information
        diagnostics.record(check.rep, "measured-error", f"outputs vs {name}: {verification['verdict']}")


def _export_baseline(out: ExportedProgram, ep: ExportedProgram, batches: list) -> dict | None:
    """Policy torch on a module, where the converted program differs from eager autocast: when it is bitwise the
    program precast captured (the forward traced under autocast, run as exported), the difference is torch.export's
    record of the forward, not the conversion. None when the converted program differs from that too."""
    for a, k in batches:
        with torch.no_grad():
            got = private_state(out).module()(*a, **k)
            # the captured program holds the policy's autocast region: its writes across dtypes are cast at the
            # write, as in the reference (precast/policy/writes.py)
            with CastWrites():
                exported = reference_module(private_state(ep))(*a, **k)
        metrics = compare_outputs(got, exported)
        if not all(m["bitwise"] for m in metrics):
            return None
    return {"reference": "the exported program (torch.export's record under autocast)", "bitwise": True}


def _reference(ep: ExportedProgram, kind: str, device, low, original, origins: dict) -> tuple[Any, str]:
    """The reference semantics (``kind``: "autocast" or the unconverted program) as a callable on private copies
    of the state it writes, and its name as the report states it: "eager torch.autocast of the module" (policy
    torch given a module), "the program run under torch.autocast" (given a program), "the unconverted
    program"."""
    if kind != "autocast":
        return private_state(ep).module(), "the unconverted program"
    if original is not None:
        reference = _with_private_state(original, ep, origins)
    else:
        reference = reference_module(private_state(ep))

    def ref(*a, **k):
        # the MHA fast path is a fused kernel torch.export never records: compare against the regular path
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            # cache off: eager's cast cache is keyed by tensor, not dtype (stale copies in nested regions)
            # a value written into a tensor of another dtype (a KV cache) is cast at the write, as the
            # conversion does (precast/policy/writes.py): eager autocast itself raises there
            with torch.autocast(device, dtype=low, cache_enabled=False), CastWrites():
                return reference(*a, **k)
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)

    return ref, autocast_label(original is not None, device, low)


def autocast_label(of_module: bool, device: str, low: torch.dtype | None) -> str:
    """The name of the autocast reference verification ran: eager autocast of the caller's module, or the
    program (whose dtype reads were fixed when it was exported) run under autocast."""
    where = f"({device}, {dtype_name(low)})"
    if of_module:
        return f"eager torch.autocast of the module {where}"
    return f"the program run under torch.autocast {where}"


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
    smallest = int(bounds.lower) if bounds is not None else 2
    upper = bounds.upper if bounds is not None else size + 1
    new = size + 1 if size + 1 <= upper else size - 1
    if size is None or new < max(smallest, 1) or new == size:
        return None

    def resize(t):
        if not (isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size):
            return t
        return torch.cat([t, t[:1]]) if new > size else t[:new]

    return pytree.tree_map(resize, (args, kwargs))


def _with_private_state(module: torch.nn.Module, ep: ExportedProgram, origins: dict) -> Any:
    """Call ``module`` on private copies of the tensors ``ep`` (exported from it) writes: its buffers and the
    tensors non-strict export lifted as constants, found in the module by identity (``ir/module_state.py``):
    the caller's tensor behind each (``origins``), else the program's own object."""
    written = {
        t: v
        for t in written_targets(ep)
        if isinstance(v := origins.get(t, ep.state_dict.get(t, ep.constants.get(t))), torch.Tensor)
    }
    return private_call(module, written)


def verify_conversion(state: Conversion, verification: dict[str, dict]) -> dict[str, object]:
    """The verify stage of a conversion: the final program against the policy's reference
    (``reference`` hook; "program" without a policy). Returns ``verification`` with the record first.
    Streamed weights (``weights=``) hold no values to run: a ``verification-skipped`` warning says so."""
    if state.weights is not None:
        diagnostics.record(
            state.log,
            "verification-skipped",
            "not verified: the weights are streamed from files, so no values are in memory to run; run "
            "precast.compile(program, weights=...) on your inputs, or convert in memory to verify",
        )
        return verification
    original = state.source if isinstance(state.source, torch.nn.Module) else None
    reference = hook(state.policy, "reference") if state.policy is not None else "program"
    with timed("verify"):
        result = verify_stage(
            state.lowered.exported,  # type: ignore[union-attr]
            state.captured,
            state.log,
            reference,
            state.device,
            state.low,
            original,
            state.inputs,
            ran=state.ran,
            origins=state.origins,
            promised=promised(state),
        )
    return {**result, **verification} if result else verification


def promised(state: Conversion) -> bool:
    """Whether the conversion promises its reference bitwise: not when caches are held in a low dtype
    (``cache_dtype=``) or weights in 8/4 bits (``weight_format=``), nor when ops are pinned to fp32 over the policy (a plan under policy torch or the regions):
    then the difference from the reference is the measured error of that choice."""
    caches = state.lowered.stats.caches  # type: ignore[union-attr]
    if caches is not None and caches.caches:
        return False
    weights = state.lowered.stats.weights  # type: ignore[union-attr]
    if weights is not None and any(r.stored for r in weights.weights.values()):
        return False  # weights stored in 8/4 bits (weight_format=): their rounding is the measured error
    return bool(getattr(state.policy, "promises_reference", True))
