"""Tolerance stage (policy rules with ``tolerance=``): find the ops to keep in fp32 so the outputs meet the
tolerance on the calibration sample, then measure the converted program against it.

Input: the Program (regions inlined, nothing decided yet), the input ExportedProgram, the RulesPolicy and its
checked options, the calibration (its kept sample), the parsed tolerance. Output: a ``ToleranceResult`` whose
``kept`` maps node -> score: the overrides the conversion binds into the rules decider
(``policy.bind(..., fallback=kept)``); neither the policy object nor the program is changed.

Every program the search measures is the one the conversion would build: a fresh ``Program(ep)``, its regions
inlined, ``policy.bind(program, opts, cal, fallback=kept)``, ``precast.passes.lower`` (classify with its
composite decomposition, casts, folding with the weight casts shared by every try through one ``CastCache``
(bitwise the casts a lowering makes alone), simplification, restored output dtypes), run as an
ExportedProgram on private copies of the state it writes. So the error the search measures for its choice
is, bit for bit, the error of the converted program (``tolerance_check`` measures that one again).

The ranking (``precast.numerics.tolerance.search.rank``) needs, for each value an op reads that the low dtype
would round, how much output error that rounding causes. One instrumented forward of the reference program
answers it for all of them: each computing op (and the output) reads each fp32 input through
``t + (-0.0)`` with the zero a leaf that requires grad (bitwise the same value), the rounding error
``rho = t.to(low).float() - t`` is known exactly, and the expected output error it causes, for rounding
errors independent from element to element, is ``sum_k rho_k**2 * |J e_k|**2`` (``J``: the Jacobian from that
read to the outputs, in the metric of the tolerance). The column norms ``|J e_k|**2`` are estimated with
``PROBES`` random-sign vector-Jacobian products (Hutchinson): backward passes of that same forward. When the
program cannot be differentiated, the ranking falls back to each read's own relative rounding error (said in
the tolerance diagnostic).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from precast.errors import first_line
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.graph import output_dtypes
from precast.ir.inputs import placeholder_values, user_values
from precast.ir.op_families import GEMM_OPS
from precast.ir.program import Program, private_state, written_targets
from precast.ir.regions import REGION_META, region_autocast
from precast.metrics import WorstError
from precast.numerics.probes import (
    PROBES,
    Tapping,
    local_energies,
    op_roles,
    probe_energies,
    read_sources,
)
from precast.numerics.tolerance.search import Source, meet_tolerance
from precast.passes import lower
from precast.passes.fold import CastCache
from precast.passes.regions import inline_regions
from precast.policy.base import Policy
from precast.policy.hooks import hook
from precast.policy.measurements import Calibration, Tolerance, ToleranceResult
from precast.policy.rules.taxonomy import op_name


def tolerance_stage(
    program: Program,
    ep: ExportedProgram,
    policy: Policy,
    opts: object,
    cal: Calibration,
    tol: Tolerance,
    log: DiagnosticLog,
    *,
    low: torch.dtype | None = None,
    **bind_kw: Any,
) -> ToleranceResult:
    """Search with programs of its own (each converted as the conversion will): returns the overrides.
    ``bind_kw``: what else the conversion passes to ``policy.bind`` (the auto policy's latency table), so each
    try binds its decider exactly as the conversion will."""
    start = time.perf_counter()
    low = low if low is not None else opts.low  # type: ignore[attr-defined]  # RuleOptions carry theirs
    search = _Search(program, log, _TrySetup(ep, policy, opts, cal, tol, low, bind_kw))
    result = meet_tolerance(
        tol, search.candidates, search.sources, search.measure, ranked_by=search.ranked_by
    )
    result.refs = search.refs
    result.forwards = search.forwards
    result.backwards = search.backwards
    result.seconds = time.perf_counter() - start
    diagnostics.record(log, "tolerance", result.summary())
    return result


@dataclass(frozen=True)
class _TrySetup:
    """What every try is converted and measured with, as the conversion converts: the input ExportedProgram, the
    policy, its options and the rest of ``policy.bind``'s keywords, the calibration (its kept sample: the batches),
    the tolerance, the low dtype."""

    ep: ExportedProgram
    policy: Policy
    opts: object
    cal: Calibration
    tol: Tolerance
    low: torch.dtype
    bind_kw: dict[str, Any]


class _Search:
    """The running half of the search: the reference (instrumented once), the all-low program and its
    candidates, and ``measure(kept)`` (convert with ``kept`` in fp32, run, compare)."""

    def __init__(self, program: Program, log: DiagnosticLog, setup: _TrySetup):
        self.setup = setup
        self.ep, self.low = setup.ep, setup.low
        self.cache_dtype = program.cache_dtype  # every try holds the caches as the conversion does
        self.allowed = list(getattr(log, "allowed", []))
        self.restore = output_dtypes(program.graph)
        self.batches = setup.cal.sample
        self.forwards = self.backwards = 0
        self.casts = CastCache()  # every try casts the same weights: once
        candidate = hook(setup.policy, "tolerance_candidate")
        # the all-low program: its decisions say which ops are candidates and how every op computes
        self.all_low = self._lower({})
        ops = [n for n in self.all_low.graph.nodes if n.op == "call_function"]
        decisions = {n.name: n.meta.get("precast") for n in ops}
        self.candidates = [
            n.name
            for n in ops
            if (d := decisions[n.name]) is not None
            and candidate(d)
            and d.dtype == self.low
            and op_name(n.target) not in GEMM_OPS
        ]
        # the reference: the program's own semantics (its regions lowered as eager autocast runs them)
        has_regions = any(n.meta.get(REGION_META) for n in program.graph.nodes)
        ref = self._lower(None) if has_regions else program
        roles = op_roles(ref, set(n.name for n in program.graph.nodes), decisions, set(self.candidates))
        self.refs, self.sources, self.ranked_by = self._reference(ref, roles)

    def _lower(self, kept: dict[str, float] | None) -> Program:
        """The program the conversion builds with ``kept`` in fp32 (``None``: the program's own semantics)."""
        decide = None if kept is None else functools.partial(self._decider, kept=kept)
        cache_dtype = self.cache_dtype if kept is not None else None  # None: the reference
        log = DiagnosticLog(allowed=self.allowed)
        return lowered_copy(self.ep, decide, log, self.casts, self.restore, cache_dtype)

    def _decider(self, fresh: Program, kept: dict[str, float]) -> Any:
        """The decider the conversion binds into ``fresh`` with ``kept`` in fp32."""
        t = self.setup
        return t.policy.bind(fresh, t.opts, t.cal, fallback=kept, **t.bind_kw)

    def measure(self, kept: dict[str, float]) -> dict:
        """Errors of the program converted with ``kept`` in fp32, run as the converted program runs."""
        converted = self.all_low if not kept and self.all_low is not None else self._lower(kept)
        if not kept:
            self.all_low = None  # measured once: its graph now belongs to the ExportedProgram
        self.forwards += 1
        return check_program(converted.to_exported_program(), self.batches, self.refs)

    def _reference(self, ref: Program, roles: dict[str, str]) -> tuple[list, list[Source], str]:
        """Reference outputs for every batch; the first batch's forward is instrumented for the sources."""
        users = [user_values(ref, self.ep, b, i) for i, b in enumerate(self.batches)]
        refs: list = []
        ranked_by = "first-order sensitivity"
        low = self.low
        readers = {n.name for n in ref.graph.nodes if roles.get(n.name) in ("cand", "low", "fp32")}
        readers.add(ref.graph.output_node().name)
        interp = Tapping(ref.gm, readers)
        outs = None
        try:
            with torch.enable_grad():
                self.forwards += 1
                outs = user_outputs(ref, interp.run(*placeholder_values(ref, users[0])))
                energy = probe_energies(outs, interp, low, self.setup.tol)
            self.backwards += PROBES
        except Exception as exc:  # noqa: BLE001 - said in the tolerance diagnostic: the ranking falls back
            ranked_by = f"local rounding error (no gradients: {type(exc).__name__}: {first_line(exc)})"
            if outs is None:  # the forward itself failed with gradients on: once more without
                interp = Tapping(ref.gm, readers, grad=False)
                with torch.no_grad():
                    self.forwards += 1
                    outs = user_outputs(ref, interp.run(*placeholder_values(ref, users[0])))
            energy = local_energies(interp.taps, low)
        refs.append([o.detach() if isinstance(o, torch.Tensor) else o for o in outs])
        del interp
        with torch.no_grad():
            for u in users[1:]:
                refs.append(user_outputs(ref, _Plain(ref.gm).run(*placeholder_values(ref, u))))
        return refs, read_sources(ref, energy, roles), ranked_by


class _Plain(torch.fx.Interpreter):
    """The reference program as it is: its own regions run as written, so export's dtype checks hold."""

    def run_node(self, n: torch.fx.Node) -> Any:
        with region_autocast(n):
            return super().run_node(n)


def lowered_copy(
    ep: ExportedProgram,
    decide: Callable[[Program], Any] | None,
    log: DiagnosticLog,
    casts: CastCache,
    restore: list[torch.dtype | None],
    cache_dtype: torch.dtype | None = None,
) -> Program:
    """A fresh ``Program(ep)``, its regions inlined, lowered as the conversion lowers it: with the decider
    ``decide(program)`` returns, the outputs restored to ``restore``'s dtypes (``decide`` None: the program's own
    semantics). ``casts``: the weight casts every lowering of the search shares."""
    fresh = Program(ep, cache_dtype)
    inline_regions(fresh.gm)
    if decide is None:
        lower(fresh, None, log, casts=casts)
    else:
        lower(fresh, decide(fresh), log, restore=restore, keep_io=True, casts=casts)
    return fresh


def user_outputs(program: Program, flat_out: Any) -> list:
    leaves = pytree.tree_leaves(flat_out)
    kinds = [s.kind for s in program.output_specs]
    return [v for v, k in zip(leaves, kinds, strict=False) if k == OutputKind.USER_OUTPUT]


def check_program(program: ExportedProgram, batches: Sequence[Any], refs: list) -> dict:
    """Errors of a converted ``program`` over ``batches`` ((args, kwargs) pairs) against ``refs``, the
    reference outputs the search measured. Each batch starts from the program's own state, as each reference
    forward did: a program that writes buffers gets fresh private copies of them per batch (the caller's
    program is never run)."""
    errs = WorstError()
    fresh = bool(written_targets(program))
    module = None
    with torch.no_grad():
        for (args, kwargs), want in zip(batches, refs, strict=True):
            if module is None or fresh:
                module = private_state(program).module()
            errs.update(pytree.tree_leaves(module(*args, **kwargs)), want)
    return errs.m


def tolerance_check(
    out: ExportedProgram,
    result: ToleranceResult,
    cal: Calibration,
    log: DiagnosticLog,
    verification: dict[str, dict],
) -> None:
    """The converted program measured on the search's sample (private copies of the buffers it writes: the
    program handed back has seen no forward); recorded in ``verification["tolerance"]`` (with what the
    search measured for its choice, ``searched``, and its cost), with a ``tolerance-not-met`` warning when
    outside the target."""
    tol = result.tolerance
    start = time.perf_counter()
    final = check_program(out, cal.sample, result.refs)
    result.forwards += 1
    result.seconds += time.perf_counter() - start
    result.final = final
    verification["tolerance"] = {
        "target": tol.spec,
        "achieved": final,
        "searched": result.achieved,
        "kept_fp32": list(result.kept),
        "candidates": result.candidates,
        "forwards": result.forwards,
        "seconds": round(result.seconds, 3),
    }
    if not tol.met(final):
        diagnostics.record(
            log,
            "tolerance-not-met",
            f"the converted program measures {tol.describe(final)} on the {len(cal.sample)} calibration "
            f"batch(es) the search used, outside {tol.spec}",
        )
