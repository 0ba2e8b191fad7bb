"""Tolerance stage (policy rules with ``tolerance=``): find the ops to keep in fp32 so the outputs meet the
tolerance on the calibration sample, then measure the converted program against it.

Input: the Program (regions inlined, nothing decided yet), the input ExportedProgram, the RulesPolicy and its
checked options, the calibration (its kept sample), the parsed tolerance. Output: a ``ToleranceResult`` whose
``kept`` maps node -> score: the overrides the conversion binds into the rules decider
(``policy.bind(..., fallback=kept)``); neither the policy object nor the program is changed.

Every program the search measures is the one the conversion would build: a fresh ``Program(ep)``, its regions
inlined, ``policy.bind(program, opts, cal, fallback=kept)``, ``precast.pipeline.lower`` (classify with its
composite decomposition, casts, folding with the weight casts shared by every try through one ``CastCache``
(bitwise the casts a lowering makes alone), simplification, restored output dtypes), run as an
ExportedProgram on private copies of the state it writes. So the error the search measures for its choice
is, bit for bit, the error of the converted program (``tolerance_check`` measures that one again).

The ranking (``precast.policy.rules.tolerance_search.rank``) needs, for each value an op reads that the low dtype
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

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from precast.errors import first_line
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.graph import ASSERT_METADATA, CAST_META, output_dtypes
from precast.ir.inputs import placeholder_values, user_values
from precast.ir.op_families import GEMM_OPS
from precast.ir.program import Program, private_state, written_targets
from precast.ir.regions import REGION_META, region_autocast
from precast.metrics import WorstError
from precast.pipeline import lower
from precast.pipeline.fold import CastCache
from precast.pipeline.regions import inline_regions
from precast.policy.base import Policy
from precast.policy.hooks import hook
from precast.policy.rules.measures import Calibration
from precast.policy.rules.taxonomy import op_name, recorded_kind
from precast.policy.rules.tolerance_search import Source, Tolerance, ToleranceResult, meet_tolerance

PROBES = 2  # random-sign backward passes of the instrumented reference forward


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
    search = _Search(program, ep, policy, opts, cal, tol, log, low, bind_kw)
    result = meet_tolerance(
        tol, search.candidates, search.sources, search.measure, ranked_by=search.ranked_by
    )
    result.refs = search.refs
    result.forwards = search.forwards
    result.backwards = search.backwards
    result.seconds = time.perf_counter() - start
    diagnostics.record(log, "tolerance", result.summary())
    return result


class _Search:
    """The running half of the search: the reference (instrumented once), the all-low program and its
    candidates, and ``measure(kept)`` (convert with ``kept`` in fp32, run, compare)."""

    def __init__(
        self,
        program: Program,
        ep: ExportedProgram,
        policy: Policy,
        opts: object,
        cal: Calibration,
        tol: Tolerance,
        log: DiagnosticLog,
        low: torch.dtype,
        bind_kw: dict[str, Any],
    ):
        self.ep, self.policy, self.opts, self.cal, self.tol, self.low = ep, policy, opts, cal, tol, low
        self.bind_kw = bind_kw
        self.cache_dtype = program.cache_dtype  # every try holds the caches as the conversion does
        self.allowed = list(getattr(log, "allowed", []))
        self.restore = output_dtypes(program.graph)
        self.batches = cal.sample
        self.forwards = self.backwards = 0
        self.casts = CastCache()  # every try casts the same weights: once
        candidate = hook(policy, "tolerance_candidate")
        # the all-low program: its decisions say which ops are candidates and how every op computes
        self.all_low = self._lower({})
        ops = [n for n in self.all_low.graph.nodes if n.op == "call_function"]
        decisions = {n.name: n.meta.get("precast") for n in ops}
        self.candidates = [
            n.name
            for n in ops
            if (d := decisions[n.name]) is not None
            and candidate(d)
            and d.dtype == low
            and op_name(n.target) not in GEMM_OPS
        ]
        # the reference: the program's own semantics (its regions lowered as eager autocast runs them)
        has_regions = any(n.meta.get(REGION_META) for n in program.graph.nodes)
        ref = self._lower(None) if has_regions else program
        roles = op_roles(ref, set(n.name for n in program.graph.nodes), decisions, set(self.candidates))
        self.refs, self.sources, self.ranked_by = self._reference(ref, roles)

    def _lower(self, kept: dict[str, float] | None) -> Program:
        """The program the conversion builds with ``kept`` in fp32 (``None``: the program's own semantics)."""
        fresh = Program(self.ep, self.cache_dtype if kept is not None else None)  # None: the reference
        inline_regions(fresh.gm)
        scratch = DiagnosticLog(allowed=self.allowed)
        if kept is None:
            lower(fresh, None, scratch, casts=self.casts)
        else:
            decider = self.policy.bind(fresh, self.opts, self.cal, fallback=kept, **self.bind_kw)
            lower(fresh, decider, scratch, restore=self.restore, keep_io=True, casts=self.casts)
        return fresh

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
                energy = probe_energies(outs, interp, low, self.tol)
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


def op_roles(ref: Program, original: set[str], decisions: dict, candidates: set[str]) -> dict[str, str]:
    """How each op of the reference graph computes in the all-low program: ``cand`` (a candidate), ``fp32``
    (computes in fp32 whatever the search does), ``low`` (a rounding the search cannot move: matmuls,
    region ops, ops other rules keep low), ``follow`` (runs in the dtype of its inputs: views, selections,
    casts)."""
    roles = {}
    for n in ref.graph.nodes:
        if n.op != "call_function":
            continue
        if n.meta.get(CAST_META) is not None or n.target is ASSERT_METADATA:
            roles[n.name] = "follow"
            continue
        if n.name not in original or n.name not in decisions:
            # made by the reference's own lowering (a composite decomposed in a region): fixed
            roles[n.name] = "low"
            continue
        d = decisions[n.name]
        if n.name in candidates:
            roles[n.name] = "cand"
        elif (
            d is None
            or d.source == "none"
            or (d.source == "region" and not (d.casts or d.kwarg_updates or d.new_target is not None))
        ):
            # an op that computes in the dtype its inputs promote to: fp32 in the all-low program (a residual add
            # of a low linear output and an fp32 stream, under autocast) means fp32 however many ops run fp32
            fixed = d is not None and d.dtype == torch.float32 and recorded_kind(n) == "compute"
            roles[n.name] = "fp32" if fixed else "follow"
        elif d.dtype == torch.float32:
            roles[n.name] = "fp32"
        else:
            roles[n.name] = "low"
    return roles


def computing_producers(node: torch.fx.Node, roles: dict[str, str]) -> set[str]:
    """The computing ops whose outputs make ``node``'s value, through ops that only follow their input's dtype
    (placeholders: none; their value is rounded only where a low-precision op reads it)."""
    out, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if roles.get(n.name, "follow") == "follow":
            stack.extend(n.all_input_nodes)
        else:
            out.add(n.name)
    return out


def read_sources(ref: Program, energy: dict[tuple[str, str], float], roles: dict[str, str]) -> list[Source]:
    """One ``Source`` per tapped read (value, reader) with a positive energy: the ops whose low precision rounds
    that read (the computing producers of the value and, when it computes low, the reader), fp32 ops left out."""
    nodes = {n.name: n for n in ref.graph.nodes}
    sources = []
    for (value, reader), e in energy.items():
        members = computing_producers(nodes[value], roles)
        if roles.get(reader) in ("cand", "low"):
            members.add(reader)
        members = {m for m in members if roles.get(m) != "fp32"}
        if members and e > 0:
            sources.append(Source(e, frozenset(members), f"{value}->{reader}"))
    return sources


def local_energies(
    taps: dict[tuple[str, str], torch.Tensor], low: torch.dtype
) -> dict[tuple[str, str], float]:
    """The ranking without gradients: each read's own relative rounding error (squared) in ``low``."""
    return {
        k: rounding_error(t, low).double().pow(2).sum().item() / max(t.double().pow(2).sum().item(), 1e-300)
        for k, t in taps.items()
    }


def rounding_error(t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    t = t.detach()
    return t.to(low).to(t.dtype) - t


class _Plain(torch.fx.Interpreter):
    """The reference program as it is: its own regions run as written, so export's dtype checks hold."""

    def run_node(self, n: torch.fx.Node) -> Any:
        with region_autocast(n):
            return super().run_node(n)


class Tapping(torch.fx.Interpreter):
    """The reference forward, keeping the fp32 value each computing op (and the output) reads from each input,
    keyed (input node, reader). With ``grad``, the reader gets it through ``t + (-0.0)``, the zero a leaf that
    requires grad: bitwise the same value, and a backward pass gives d outputs / d (that use of t); a value no
    op of this forward computed (a weight, an input) is read through a detached alias that is the leaf itself."""

    def __init__(self, gm: torch.fx.GraphModule, readers: set[str], grad: bool = True):
        super().__init__(gm)
        self.readers, self.grad = readers, grad
        self.taps: dict[tuple[str, str], torch.Tensor] = {}
        self.leaves: dict[tuple[str, str], torch.Tensor] = {}

    @staticmethod
    def regions(n: torch.fx.Node) -> Any:
        """The node's regions, as eager runs it; none for an op a lowering decided (its casts are explicit, and
        an op pinned fp32 inside a region must not be lowered again by the region's autocast)."""
        return contextlib.nullcontext() if "precast" in n.meta else region_autocast(n)

    def run_node(self, n: torch.fx.Node) -> Any:
        mutates = isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        if n.name not in self.readers or mutates:  # an op writing an input must get the tensor itself
            with self.regions(n):
                return super().run_node(n)
        tapped: dict[torch.fx.Node, Any] = {}

        def tap(a: torch.fx.Node) -> Any:
            if a not in tapped:
                value = self.env[a]
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    key = (a.name, n.name)
                    self.taps[key] = value.detach()
                    if self.grad and value.grad_fn is None:
                        # nothing this forward computed makes it (a weight, an input): an alias of the value is
                        # the leaf, no copy (a weight's reads are most of the tapped values)
                        leaf = value.detach().requires_grad_()
                        self.leaves[key] = leaf
                        value = leaf
                    elif self.grad:
                        zero = torch.full_like(value, -0.0, requires_grad=True)
                        self.leaves[key] = zero
                        value = value + zero
                tapped[a] = value
            return tapped[a]

        args = torch.fx.node.map_arg(n.args, tap)
        kwargs = torch.fx.node.map_arg(n.kwargs, tap)
        with self.regions(n):  # the program's own regions run as written
            return getattr(self, n.op)(n.target, args, kwargs)


def probe_energies(
    outs: list, interp: Tapping, low: torch.dtype, tol: Tolerance, probes: int = PROBES
) -> dict[tuple[str, str], float]:
    """Per tapped read, the expected output error its rounding to ``low`` causes, in the metric of the
    tolerance (cosine: the sum over output rows of 1 - cos; rel: squared relative error; max_abs: squared
    error), estimated with ``probes`` random-sign vector-Jacobian products of the instrumented forward (the
    search uses ``PROBES``; sensitivity, whose product is the ranking itself, more)."""
    key = "cosine" if "cosine" in tol.spec else ("rel" if "rel" in tol.spec else "max_abs")
    ys = [y for y in outs if isinstance(y, torch.Tensor) and y.is_floating_point() and y.requires_grad]
    names = list(interp.leaves)
    energy = dict.fromkeys(interp.taps, 0.0)
    if not ys or not names:
        return energy
    gen = torch.Generator().manual_seed(0)
    # E over probes of (g * rho)**2 = rho**2 * mean(g**2): accumulate g**2 in float32 (a gradient is float32;
    # its square's rounding is far below the probes' own sampling error), multiply by rho**2 once per read
    gsq: dict[tuple[str, str], torch.Tensor] = {}
    for j in range(probes):
        vs = [random_probe(y.detach(), key, gen) for y in ys]
        grads = torch.autograd.grad(
            ys, [interp.leaves[k] for k in names], vs, retain_graph=j < probes - 1, allow_unused=True
        )
        for k, g in zip(names, grads, strict=True):
            if g is not None:
                g = g.float()
                if k in gsq:
                    gsq[k].addcmul_(g, g)
                else:
                    gsq[k] = g * g
    for k, acc in gsq.items():  # products in float32 (exact enough for an estimate), summed in float64
        rho = rounding_error(interp.taps[k], low)
        energy[k] = float(acc.mul_(rho.square_()).sum(dtype=torch.float64).item()) / probes
    return energy


def random_probe(y: torch.Tensor, key: str, gen: torch.Generator) -> torch.Tensor:
    """A random-sign vector v with E[(v . J rho)**2] = the metric's error for the output error J rho."""
    sign = torch.randint(0, 2, y.shape, generator=gen).to(y.dtype) * 2 - 1
    if key == "max_abs":
        return sign
    if key == "rel":
        norm = y.norm().item()
        return sign / norm if norm > 0 else torch.zeros_like(y)
    rows = y.reshape(-1, y.shape[-1]) if y.dim() >= 1 else y.reshape(1, 1)
    s = sign.reshape(rows.shape)
    norm = rows.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, rows / norm.clamp_min(1e-300), torch.zeros_like(rows))
    # 1 - cos(y + e, y) ~ |e minus its part along y|**2 / (2 |y|**2), row by row
    v = (s - (s * unit).sum(-1, keepdim=True) * unit) * torch.where(
        norm > 0, (0.5**0.5) / norm.clamp_min(1e-300), torch.zeros_like(norm)
    )
    return v.reshape(y.shape)


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
