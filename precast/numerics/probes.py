"""The instrumented forward that tolerance search and sensitivity share (one numerics layer): which op of a
reference program computes how (``op_roles``), which ops round each read (``computing_producers``,
``read_sources``), the tapping forward that keeps every value each op reads (``Tapping``), and the expected output
error each read's rounding causes, from random-sign backward probes (``probe_energies``) or without gradients
(``local_energies``); the tapping forward that also keeps each watched op's value range (``Ranging``).

Input: a reference Program, the decisions of its all-low lowering, one batch. Output: per tapped read, an energy;
per read, the ops whose low precision rounds it (``Source``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

from precast.ir.graph import ASSERT_METADATA, CAST_META
from precast.ir.program import Program
from precast.ir.regions import region_autocast
from precast.numerics.tolerance.search import Source
from precast.policy.measurements import Tolerance
from precast.policy.rules.taxonomy import recorded_kind

PROBES = (
    2  # random-sign backward passes of the instrumented reference forward (the search's; sensitivity: more)
)


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


class Tapping(torch.fx.Interpreter):
    """The reference forward, keeping the fp32 value each computing op (and the output) reads from each input,
    keyed (input node, reader). With ``grad``, the reader gets it through ``t + (-0.0)``, the zero a leaf that
    requires grad: bitwise the same value, and a backward pass gives d outputs / d (that use of t); a value no
    op of this forward computed (a weight, an input) is read through a detached alias that is the leaf itself."""

    def __init__(self, gm: torch.fx.GraphModule, readers: set[str], grad: bool = True, keep: bool = True):
        super().__init__(gm)
        self.readers, self.grad, self.keep = readers, grad, keep
        # the tapped values with ``keep``; every tapped read's key in ``reads`` either way
        self.taps: dict[tuple[str, str], torch.Tensor] = {}
        self.reads: set[tuple[str, str]] = set()
        self.leaves: dict[tuple[str, str], torch.Tensor] = {}
        self.constant_reads: set[tuple[str, str]] = set()  # reads of a value no op computed (weights, inputs)

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
                    self.reads.add(key)
                    if not self.keep:
                        tapped[a] = value
                        return value
                    self.taps[key] = value.detach()
                    if self.grad and value.grad_fn is None:
                        # nothing this forward computed makes it (a weight, an input): an alias of the value is
                        # the leaf, no copy (a weight's reads are most of the tapped values)
                        leaf = value.detach().requires_grad_()
                        self.leaves[key] = leaf
                        self.constant_reads.add(key)
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
    outs: list,
    interp: Tapping,
    low: torch.dtype,
    tol: Tolerance,
    probes: int = PROBES,
    constant_probes: int | None = None,
) -> dict[tuple[str, str], float]:
    """Per tapped read, the expected output error its rounding to ``low`` causes, in the metric of the
    tolerance (cosine: the sum over output rows of 1 - cos; rel: squared relative error; max_abs: squared
    error), estimated with ``probes`` random-sign vector-Jacobian products of the instrumented forward (the
    search uses ``PROBES``; sensitivity, whose product is the ranking itself, more). ``constant_probes``: how
    many of them also take the gradient of the reads of constants (weights): that gradient is a GEMM as large
    as the forward's for every linear, half a backward pass, while a weight's rounding error is fixed and its
    energy converges as fast as an activation's (None: every probe)."""
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
    constant_probes = probes if constant_probes is None else max(1, min(constant_probes, probes))
    activations = [k for k in names if k not in interp.constant_reads]
    counts = {k: (constant_probes if k in interp.constant_reads else probes) for k in names}
    for j in range(probes):
        vs = [random_probe(y.detach(), key, gen) for y in ys]
        wanted = names if j < constant_probes else activations
        if not wanted:
            break
        grads = torch.autograd.grad(
            ys, [interp.leaves[k] for k in wanted], vs, retain_graph=j < probes - 1, allow_unused=True
        )
        for k, g in zip(wanted, grads, strict=True):
            if g is not None:
                g = g.float()
                if k in gsq:
                    gsq[k].addcmul_(g, g)
                else:
                    gsq[k] = g * g
    for k, acc in gsq.items():  # products in float32 (exact enough for an estimate), summed in float64
        rho = rounding_error(interp.taps[k], low)
        energy[k] = float(acc.mul_(rho.square_()).sum(dtype=torch.float64).item()) / counts[k]
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


def value_range(t: torch.Tensor, tiny: float) -> tuple[float, float | None, int, int]:
    """(absmax, smallest nonzero |value|, nonzero values below ``tiny``, nonzero values) of a floating tensor."""
    a = t.detach().abs()
    if a.numel() == 0:
        return (0.0, None, 0, 0)
    lo, hi = torch.aminmax(a)
    absmin = lo.item()
    if absmin > 0:  # no zero (nor NaN): one pass said it all, unless some values are below tiny
        small = int(torch.count_nonzero(a < tiny).item()) if absmin < tiny else 0
        return (hi.item(), absmin, small, a.numel())
    nonzero = a > 0
    count = int(nonzero.sum().item())
    absmin = torch.where(nonzero, a, torch.full_like(a, float("inf"))).amin().item() if count else None
    small = int((nonzero & (a < tiny)).sum().item())
    return (hi.item(), absmin, small, count)


class Ranging(Tapping):
    """The tapping forward, also keeping each watched op's output range."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        readers: set[str],
        watch: set[str],
        tiny: float,
        grad: bool = True,
        keep: bool = True,
    ):
        super().__init__(gm, readers, grad, keep)
        self.watch, self.tiny = watch, tiny
        self.ranges: dict[str, tuple] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.watch and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.ranges[n.name] = value_range(out, self.tiny)
        return out
