"""Sensitivity's estimator: the reference program instrumented once, the policy's program watched once, the
per-read error energies (measured on the batch or on ``data``, or given), and the real conversions that the
curve's measured points and the ablation run (``Estimator.measure``, ``run_lowered``).

Input: the input ExportedProgram, a policy and its ``Binding`` (or the low dtype), one batch, the metric.
Output: ``Estimator`` (candidates, sources, ranges, ranked ops, ``measure(kept)``); the method is described in
``precast.numerics.sensitivity.ranking``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from precast.dtypes import dtype_name
from precast.errors import PrecastError, first_line, module_path, user_source_line
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.graph import CAST_META, graph_key, output_dtypes
from precast.ir.inputs import placeholder_values, user_values
from precast.ir.program import Program
from precast.ir.regions import POLICY_OP_META, REGION_META
from precast.metrics import WorstError
from precast.numerics.distributed import rank_and_size, reduce_energies
from precast.numerics.energies import Energies, merge_range, range_status
from precast.numerics.nonfinite import first_nonfinite
from precast.numerics.probes import (
    Ranging,
    local_energies,
    op_roles,
    probe_energies,
    read_sources,
    value_range,
)
from precast.numerics.sensitivity.results import METRICS, OpSensitivity
from precast.numerics.tolerance.search import Source
from precast.numerics.tolerance.stage import check_program, lowered_copy, user_outputs
from precast.passes.fold import CastCache
from precast.passes.regions import inline_regions
from precast.policy.measurements import Tolerance
from precast.policy.pinned import pin_names
from precast.policy.rules.taxonomy import op_name, recorded_kind

SELECTIONS = {"embedding", "embedding_bag", "index_select", "gather"}  # ops that only pick values of a table
# random-sign backward passes of the instrumented forward: more than the tolerance search's 2, since the
# ranking itself is the product here (neighbouring layer norms differ by a few percent)
PROBES = 8
# of them, the ones that also differentiate the weights' reads (half the backward's GEMMs)
CONSTANT_PROBES = 4


class Estimator:
    """The reference (instrumented once), the policy's program and its low ops, and ``measure(kept)``."""

    def __init__(
        self,
        ep: ExportedProgram,
        policy: Any,
        binding: Any,
        batch: tuple,
        metric: str,
        low: Any = None,
        **more: Any,
    ):
        if metric not in METRICS:
            raise ValueError(metric)
        self.ep, self.policy, self.binding, self.batch, self.metric = ep, policy, binding, batch, metric
        # energies from ``data`` (reduced over ``group``), else given (``given``: Energies), else from ``batch``
        self.data, self.group, self.given = more.get("data"), more.get("group"), more.get("given")
        # a policy that binds a decider (rules, auto) keeps ops fp32 through it; policy torch and the program's
        # regions (policy None) through ``Pinned`` (precast/policy/pinned.py): the same estimator over either
        self.low = binding.options.low if binding is not None else low
        self.forwards = self.backwards = self.conversions = 0
        self.casts = CastCache()  # every lowering here casts the same weights: once
        program = Program(ep)
        inline_regions(program.gm)
        self.restore = output_dtypes(program.graph)
        self.all_low = self.lower({})
        # the policy's program, watched once: the first op whose output is non-finite from finite inputs
        self.user = user_values(self.all_low, ep, batch, "the inputs")
        self.forwards += 1
        self.nonfinite, self.nonfinite_node, env = first_nonfinite(
            self.all_low.gm, placeholder_values(self.all_low, self.user), self.low
        )
        self.low_env = env if self.nonfinite is not None else {}  # for the repro; else dropped now
        # a run that found no such op went to the end: its outputs are the policy's program's on the batch
        # (the graph ``to_exported_program`` hands over, the same kernels), measured without another forward
        out_node = self.all_low.graph.output_node()
        self.low_outputs = (
            user_outputs(self.all_low, env[out_node]) if self.nonfinite is None and out_node in env else None
        )
        del env
        ops = [n for n in self.all_low.graph.nodes if n.op == "call_function"]
        decisions = {n.name: n.meta.get("precast") for n in ops}
        self.candidates = [n.name for n in ops if self._candidate(n, decisions[n.name])]
        self.nodes = {n.name: n for n in ops}
        has_regions = any(n.meta.get(REGION_META) for n in program.graph.nodes)
        traced_low = any(n.meta.get(POLICY_OP_META) for n in program.graph.nodes)
        if binding is None and (policy is None or traced_low):
            # the program's regions, or a module captured under autocast (its graph recorded low dtypes): the
            # reference is the same lowering with every ranked op pinned to fp32
            self.ref = self.lower(dict.fromkeys(self.candidates, 0.0))
        else:
            self.ref = self.lower(None) if has_regions else program
        self.roles = op_roles(
            self.ref, {n.name for n in program.graph.nodes}, decisions, set(self.candidates)
        )
        key = f"{graph_key(program.graph)}|{'regions' if policy is None else policy.name}|{','.join(self.candidates)}"
        self.energies = Energies(hashlib.sha256(key.encode()).hexdigest()[:32], dtype_name(self.low), metric)
        self.refs, self.sources, self.ranges, self.ranked_by = self._reference()

    def _candidate(self, node: torch.fx.Node, d: Any) -> bool:
        """An op the ranking covers: an op the policy itself put in low precision. Rules and auto: every op
        the policy's own rules put low (not the user's include rules nor regions). Policy torch and the regions
        (policy None): every op autocast casts to the low dtype (its lower-precision ops, a promote to low); an op
        that only follows a low input (an ``exp`` of an fp16 linear) is not a choice of its own: keeping its
        producer fp32 keeps it fp32 too, and its rounding counts there."""
        if d is None or d.dtype != self.low or node.meta.get(CAST_META) is not None:
            return False
        if self.binding is not None:
            return d.rule == "default"
        return d.source == ("region" if self.policy is None else self.policy.name)

    def lower(self, kept: dict[str, float] | None) -> Program:
        """The program the conversion builds with ``kept`` in fp32 (``None``: the program's own semantics)."""
        self.conversions += 1
        decide = None if kept is None else functools.partial(self._decider, kept=kept)
        return lowered_copy(self.ep, decide, DiagnosticLog(), self.casts, self.restore)

    def _decider(self, fresh: Program, kept: dict[str, float]) -> Any:
        """The decider of a lowering with ``kept`` in fp32: the policy pinned (no binding), else bound to ``fresh``."""
        if self.binding is None:
            return pin_names(self.policy, kept, "kept in fp32 by the sensitivity estimate")
        b = self.binding
        return self.policy.bind(fresh, b.options, b.calibration, fallback=kept, **b.extra)

    def measure(self, kept: dict[str, float]) -> dict:
        """Errors of the program converted with ``kept`` in fp32 against the reference, on the batch."""
        program = self.lower(kept)
        self.forwards += 1
        return output_errors(run_lowered(program, self.user), self.refs[0])

    def all_low_errors(self) -> dict:
        """Errors of the policy's program: from the watched run when it went to the end, else measured (the run
        stopped at the first non-finite op)."""
        if self.low_outputs is not None:
            outs, self.low_outputs = self.low_outputs, None
            self.all_low.graph.eliminate_dead_code()  # the graph plans are keyed on: as the conversion's
            return output_errors(outs, self.refs[0])
        self.forwards += 1
        return check_program(self.all_low.to_exported_program(), [self.batch], self.refs)

    def _reference(self) -> tuple[list, list[Source], dict, str]:
        ref, roles = self.ref, self.roles
        # an embedding selects rows of its table exactly: their rounding is its output's, counted where that is
        # read; tapping the whole table (30522 x 384 for MiniLM) would cost a dense gradient per probe
        readers = {
            n.name
            for n in ref.graph.nodes
            if roles.get(n.name) in ("cand", "low", "fp32") and op_name(n.target) not in SELECTIONS
        }
        if self.binding is None:
            # under autocast an op that follows a low input still computes on it (gelu of a bf16 linear output):
            # its reads are rounded by their producers, so they are tapped too
            readers |= {n.name for n in ref.graph.nodes if roles.get(n.name) == "follow" and _computes(n)}
        readers.add(ref.graph.output_node().name)
        if self.given is not None or self.data is not None:  # the energies come from elsewhere
            given = self.given is not None  # given energies: checked against the reads a measurement records
            watch = (readers, set(self.candidates)) if given else (set(), set())
            interp = Ranging(ref.gm, *watch, torch.finfo(self.low).tiny, grad=False, keep=False)
            with torch.no_grad():
                self.forwards += 1
                outs = user_outputs(ref, interp.run(*placeholder_values(ref, self.user)))
        else:
            outs, energy, ranges, ranked_by = self._tap(self.user, readers)
            self.energies.add(energy, ranges)
            self.energies.ranked_by = ranked_by
        if self.given is not None:
            self.energies = self.energies.merge(*self.given) if self.given else self.energies
            self.energies.check_covers(interp.reads, set(interp.ranges), "energies")
        elif self.data is not None:
            rank, world = rank_and_size(self.group) if self.group is not None else (0, 1)
            for i, batch in enumerate(self.data):
                user = user_values(self.all_low, self.ep, batch, f"sensitivity batch {i * world + rank}")
                _, energy, ranges, self.energies.ranked_by = self._tap(user, readers)
                self.energies.add(energy, ranges)
                del user, batch, energy
            if self.group is not None:
                self.energies = reduce_energies(self.energies, self.group)
        if self.energies.batches == 0:
            raise PrecastError("sensitivity: data= holds no batch; give at least one (on every rank)")
        refs = [[o.detach() if isinstance(o, torch.Tensor) else o for o in outs]]
        self.out_shapes = [o.shape for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        sources = read_sources(ref, self.energies.mean(), roles)
        return refs, sources, dict(self.energies.ranges), self.energies.ranked_by

    def _tap(self, user: list, readers: set[str]) -> tuple[list, dict, dict, str]:
        """One batch through the instrumented reference: (outputs, energy per read, range per ranked op, how
        the energies were estimated)."""
        ref, tiny = self.ref, torch.finfo(self.low).tiny
        interp = Ranging(ref.gm, readers, set(self.candidates), tiny)
        ranked_by = "first-order sensitivity"
        tol = Tolerance({self.metric: 1.0})
        outs = None
        try:
            with torch.enable_grad():
                self.forwards += 1
                outs = user_outputs(ref, interp.run(*placeholder_values(ref, user)))
                energy = probe_energies(outs, interp, self.low, tol, PROBES, CONSTANT_PROBES)
            self.backwards += PROBES
        except Exception as exc:  # noqa: BLE001 - said in ranked_by: the estimate falls back to local rounding
            ranked_by = f"local rounding error (no gradients: {type(exc).__name__}: {first_line(exc)})"
            if outs is None:
                interp = Ranging(ref.gm, readers, set(self.candidates), tiny, grad=False)
                with torch.no_grad():
                    self.forwards += 1
                    outs = user_outputs(ref, interp.run(*placeholder_values(ref, user)))
            energy = local_energies(interp.taps, self.low)
        ranges = dict(interp.ranges)
        seen: dict[str, tuple] = {}  # one range per value, however many ops read it
        for (value, reader), t in interp.taps.items():  # an op's range covers the values it reads
            if reader in ranges:
                if value not in seen:
                    seen[value] = value_range(t, tiny)
                ranges[reader] = merge_range(ranges[reader], seen[value])
        return outs, energy, ranges, ranked_by

    def to_metric(self, energy: float) -> float:
        """Estimated error in the metric from an error energy (see ``probe_energies``): rel, the square root;
        cosine, 1 - cosine averaged over output rows; max_abs, the RMS error times sqrt(2 ln n), the expected
        largest of n Gaussian errors."""
        if self.metric == "rel":
            return math.sqrt(max(energy, 0.0))
        rows = sum(max(1, math.prod(s[:-1])) for s in self.out_shapes) or 1
        if self.metric == "cosine":
            return energy / rows
        n = sum(math.prod(s) for s in self.out_shapes) or 1
        return math.sqrt(max(energy, 0.0) / n) * math.sqrt(2 * math.log(max(n, 2)))

    def rank_ops(self) -> list[OpSensitivity]:
        per_op = dict.fromkeys(self.candidates, 0.0)
        for s in self.sources:
            for m in s.members:
                if m in per_op:
                    per_op[m] += s.energy
        total = sum(per_op.values()) or 1.0
        finfo = torch.finfo(self.low)
        out = []
        for name, e in per_op.items():
            node = self.nodes[name]
            rng = self.ranges.get(name)
            status, note = range_status(rng, finfo, dtype_name(self.low))
            out.append(
                OpSensitivity(
                    name,
                    module_path(node),
                    op_name(node.target),
                    user_source_line(node),
                    e,
                    self.to_metric(e),
                    e / total,
                    rng[0] if rng else None,
                    rng[1] if rng else None,
                    status,
                    note,
                )
            )
        # overflow first: an op whose values leave the low dtype's range breaks the outputs outright
        pos = {c: i for i, c in enumerate(self.candidates)}
        out.sort(key=lambda o: (o.status != "overflow", -o.energy, pos[o.name]))
        return out


def _computes(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and op_name(n.target) not in SELECTIONS and recorded_kind(n) == "compute"


def run_lowered(program: Program, user: list) -> list:
    """The user outputs of a lowered ``program`` on one batch (``user``: its user inputs), its graph module run
    directly on private copies of the constants it writes (``placeholder_values``): bitwise what
    ``check_program`` measures of ``program.to_exported_program()`` (the same graph and kernels), without
    building and unlifting an ExportedProgram."""
    program.graph.eliminate_dead_code()  # as ``to_exported_program`` does
    program.gm.recompile()
    with torch.no_grad():
        return user_outputs(program, program.gm(*placeholder_values(program, user)))


def output_errors(outs: list, refs: list) -> dict:
    """Errors of one batch's outputs against its reference outputs (``check_program``'s metrics)."""
    errs = WorstError()
    errs.update(outs, refs)
    return errs.m
