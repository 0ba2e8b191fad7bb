"""Accuracy-driven fallback: move the fewest ops back to fp32 until the outputs meet a tolerance.

``tolerance`` is a dict of one or more bounds, all of which must hold on every batch the search uses (the first
``TOLERANCE_BATCHES`` calibration batches, kept from the single streaming pass) and every user output (compared
with the unconverted program, in float64):

- ``{"max_abs": 1e-2}``: largest absolute elementwise error;
- ``{"rel": 1e-3}``: largest relative L2 error ``||y - y_ref|| / ||y_ref||`` of an output;
- ``{"cosine": 0.9999}``: smallest cosine similarity between output vectors along the last dimension
  (e.g. one per sentence embedding; a 0-d or 1-d output is one vector).

The search runs the program in an interpreter that applies the same decisions the conversion will (so each try
costs one forward per batch, not a conversion): (1) if every low-precision op but the matmul/conv family in fp32
still misses the tolerance, it cannot be met by this fallback: PrecastError. (2) Each candidate's cost is the
error the outputs get when it alone runs in low precision. (3) The fewest top-ranked candidates that meet the
tolerance are found by doubling then bisection. The matmul/conv family is never moved: exclude such an op
explicitly with ``exclude_nodes`` if that is what it takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from precast.classify import ASSERT_METADATA, _decide, apply_decision
from precast.errors import PrecastError
from precast.policy.calibrate import placeholder_values, user_values
from precast.program import Program

KEYS = ("max_abs", "rel", "cosine")
SENSITIVITY_BATCHES = 1  # the per-op ranking uses the first batches only; the search checks all it was given


@dataclass
class Tolerance:
    spec: dict

    def met(self, m: dict) -> bool:
        return all((m["cosine"] >= lim) if k == "cosine" else (m[k] <= lim) for k, lim in self.spec.items())

    def score(self, m: dict) -> float:
        """Error as a fraction of what the tolerance allows (> 1: violated), the worst bound."""
        parts = []
        for k, lim in self.spec.items():
            if k == "cosine":
                parts.append((1.0 - m["cosine"]) / max(1.0 - lim, 1e-300))
            else:
                parts.append(m[k] / lim if lim > 0 else (0.0 if m[k] == 0 else math.inf))
        return max(parts)

    def describe(self, m: dict) -> str:
        return ", ".join(f"{k} {m[k]:.6g}" for k in self.spec)


def parse_tolerance(tolerance: Any) -> Tolerance | None:
    if tolerance is None:
        return None
    if not isinstance(tolerance, dict) or not tolerance:
        raise PrecastError(
            f"tolerance={tolerance!r}: give a dict of bounds, e.g. {{'max_abs': 1e-2}}, {{'rel': 1e-3}} or "
            "{'cosine': 0.9999} (several keys: all must hold)"
        )
    spec = {}
    for k, v in tolerance.items():
        if k not in KEYS:
            raise PrecastError(f"tolerance: unknown bound {k!r}; use {', '.join(KEYS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise PrecastError(f"tolerance[{k!r}]={v!r}: give a finite number >= 0")
        if k == "cosine" and not (0 < v < 1):
            raise PrecastError(
                f"tolerance['cosine']={v!r}: give a similarity between 0 and 1 (exclusive), e.g. 0.9999"
            )
        spec[k] = float(v)
    return Tolerance(spec)


class Errors:
    """Running worst-case error over batches and outputs."""

    def __init__(self):
        self.m = {"max_abs": 0.0, "rel": 0.0, "cosine": 1.0}

    def update(self, got: Sequence[Any], want: Sequence[Any]) -> None:
        for a, e in zip(got, want, strict=True):
            if not isinstance(e, torch.Tensor) or not e.is_floating_point():
                continue
            a, e = a.detach().double(), e.detach().double()
            if not torch.isfinite(a).all() or a.shape != e.shape:
                self.m = {"max_abs": math.inf, "rel": math.inf, "cosine": -1.0}
                return
            if e.numel() == 0:
                continue
            diff = a - e
            self.m["max_abs"] = max(self.m["max_abs"], diff.abs().max().item())
            ref = e.norm().item()
            self.m["rel"] = max(
                self.m["rel"], diff.norm().item() / ref if ref else (0.0 if not diff.any() else math.inf)
            )
            rows_a = a.reshape(-1, a.shape[-1]) if a.dim() >= 1 else a.reshape(1, 1)
            rows_e = e.reshape(-1, e.shape[-1]) if e.dim() >= 1 else e.reshape(1, 1)
            cos = F.cosine_similarity(rows_a, rows_e, dim=-1, eps=1e-30)
            both_zero = (rows_a.norm(dim=-1) == 0) & (rows_e.norm(dim=-1) == 0)
            cos = torch.where(both_zero, torch.ones_like(cos), cos)
            self.m["cosine"] = min(self.m["cosine"], cos.min().item())


class MixedInterpreter(torch.fx.Interpreter):
    """Runs the unconverted graph as the converted one will compute: each op gets the decision classify would
    give it (regions, then ``policy``; ``policy=None``: the program's own semantics)."""

    def __init__(self, gm: torch.fx.GraphModule, policy: Any):
        super().__init__(gm, garbage_collect_values=True)
        self.policy = policy

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        if n.target is ASSERT_METADATA:
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        decision = _decide(n, args, kwargs, self.policy, ())
        target, args, kwargs = apply_decision(n.target, args, kwargs, decision, lambda v, d: v.to(d))
        return target(*args, **kwargs)


def user_outputs(program: Program, flat_out: Any) -> list:
    leaves = pytree.tree_leaves(flat_out)
    kinds = [s.kind for s in program.output_specs]
    return [v for v, k in zip(leaves, kinds, strict=False) if k == OutputKind.USER_OUTPUT]


@dataclass
class FallbackResult:
    tolerance: Tolerance
    all_low: dict  # errors with no fallback
    floor: dict | None = None  # errors with every candidate in fp32
    achieved: dict | None = None
    kept: dict = field(default_factory=dict)  # node -> score
    candidates: int = 0
    tries: int = 0
    refs: list = field(default_factory=list)
    final: dict | None = None

    def summary(self) -> str:
        t = self.tolerance
        if not self.kept:
            return f"tolerance {t.spec} met with no fallback ({t.describe(self.all_low)})"
        names = ", ".join(self.kept)
        return (
            f"tolerance {t.spec}: all-low {t.describe(self.all_low)}; kept {len(self.kept)} of {self.candidates} "
            f"candidate op(s) in fp32 ({names}) -> {t.describe(self.achieved)} ({self.tries} tries)"
        )


def meet_tolerance(
    program: Program, ep: ExportedProgram, policy: Any, tol: Tolerance, batches: Sequence[Any]
) -> FallbackResult:
    """Find the fewest ops to keep in fp32 for ``tol`` on ``batches`` (the calibration's kept sample, each
    forwarded several times); sets ``policy.fallback`` to them."""
    from precast.policy.op_families import GEMM_OPS
    from precast.policy.rules import op_name

    users = [user_values(program, ep, b, i) for i, b in enumerate(batches)]
    gm = program.gm

    def run(pol, which=None) -> list[list]:
        interp = MixedInterpreter(gm, pol)
        with torch.no_grad():
            # constants are fetched again for every forward: a buffer the program writes starts fresh each time
            return [
                user_outputs(program, interp.run(*placeholder_values(program, users[i])))
                for i in (which or range(len(users)))
            ]

    refs = run(None)

    def measure(which=None) -> dict:
        errs = Errors()
        for got, want in zip(run(policy, which), [refs[i] for i in (which or range(len(refs)))], strict=True):
            errs.update(got, want)
        return errs.m

    policy.fallback, policy.force, policy.decided = {}, {}, {}
    base = measure()
    result = FallbackResult(tol, all_low=base, refs=refs, achieved=base)
    if tol.met(base):
        return result
    nodes = {n.name: n for n in gm.graph.nodes}
    low = policy.opts.low
    all_low = [k for k, d in policy.decided.items() if d.rule == "default" and d.dtype == low]
    candidates = [k for k in all_low if op_name(nodes[k].target) not in GEMM_OPS]
    result.candidates = len(candidates)
    policy.fallback = dict.fromkeys(candidates, 0.0)
    result.floor = measure()
    result.tries += 1
    if not tol.met(result.floor):
        policy.fallback = {}
        raise PrecastError(
            f"tolerance {tol.spec} cannot be met: with every op but the matmul/conv family in fp32 the outputs "
            f"still measure {tol.describe(result.floor)} (all low precision: {tol.describe(base)}); loosen the "
            "tolerance, or exclude matmuls/convolutions explicitly with exclude_nodes / exclude_ops",
            code="tolerance-unmet",
        )
    # cost of each candidate: error when it alone is in low precision
    sample = list(range(min(SENSITIVITY_BATCHES, len(users))))
    policy.fallback = {}
    score = {}
    for c in candidates:
        policy.force = {k: torch.float32 for k in all_low if k != c}
        score[c] = tol.score(measure(sample))
    policy.force = {}
    ranked = sorted(candidates, key=lambda c: -score[c])

    cache: dict[int, dict] = {}

    def errors_with(k: int) -> dict:
        if k not in cache:
            policy.fallback = {c: score[c] for c in ranked[:k]}
            cache[k] = measure()
            result.tries += 1
        return cache[k]

    n = len(ranked)
    cache[n] = result.floor  # every candidate in fp32: known to meet it
    lo, hi = 0, 1  # invariant: ranked[:lo] misses the tolerance
    while hi < n and not tol.met(errors_with(hi)):
        lo, hi = hi, hi * 2
    hi = min(hi, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tol.met(errors_with(mid)):
            hi = mid
        else:
            lo = mid
    policy.fallback = {c: score[c] for c in ranked[:hi]}
    result.kept = dict(policy.fallback)
    result.achieved = cache.get(hi) or errors_with(hi)
    policy.decided = {}
    return result


def check_program(module: Callable[..., Any], batches: Sequence[Any], refs: list) -> dict:
    """Errors of the converted program (``module``: a module of it whose written buffers are private) over
    ``batches`` ((args, kwargs) pairs) against ``refs``, the unconverted program's outputs measured by
    ``meet_tolerance``: the caller's program is not run again."""
    errs = Errors()
    with torch.no_grad():
        for (args, kwargs), want in zip(batches, refs, strict=True):
            errs.update(pytree.tree_leaves(module(*args, **kwargs)), want)
    return errs.m
