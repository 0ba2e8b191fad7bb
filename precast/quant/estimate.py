"""Weight sensitivity: per linear/embedding weight and storage format, the output error its rounding causes,
and the cheapest formats under a budget.

The rounding is exact: ``dW = dequantize(quantize(W)) - W`` (``precast.quant.formats``). Its effect on the
outputs is estimated to second order with the Fisher information of the output distribution: for outputs read as
logits (``metric="kld"``), the mean KL divergence per position the perturbation causes is
``KL ~= 1/2 E_y[(grad_W log p(y) . dW)^2]`` with ``y`` drawn from the model's own next-token distribution at every
position (the score's expectation is zero, so draws at different positions add without cross terms). ``probes``
draws, each one backward pass of the fp32 program over the calibration batches, give every weight's estimate for
every format at once: the projections ``<grad_W, dW>`` are taken where each weight is read, no weight's gradient
formed (``precast.quant.probes``: ``sum(G * X dW^T)`` at a linear, ``X dW^T`` made once per batch and
format, or the gradient by blocks of rows where that takes less memory). For ``precast export-llm SmolLM2-135M
--bits 4.6`` (4 windows x 8 probes, 1 thread) the whole command went from 661 s of CPU and a 5.2 GB peak to
146 s and 2.56 GB (2.38 GiB), its estimate unchanged to 1e-6 (the same plan). For any other
output (``metric="mse"``) the draws are random signs on the outputs (Hutchinson): the estimate is the mean squared
output error per element. Two weights' errors add (independent roundings: no cross terms in expectation), so a
plan's estimate is the sum of its weights' estimates.

``ablate`` measures the truth for a weight: the fp32 program run with that one weight replaced by its rounded
value, against the reference (what a conversion of that weight alone computes: policy None is bitwise it). The
greedy allocation (``allocate``) starts every weight at its cheapest format and upgrades, one step at a time, the
weight whose next format removes the most estimated error per byte, until the budget holds: a multiple-choice
knapsack solved greedily on each weight's lower convex hull of (bytes, error).

Nothing here changes the caller's program: the graph runs on a private ``Program`` copy, the weights it
differentiates are detached leaves over the program's values, and written state is copied per forward.

Input: an ExportedProgram, calibration batches, the formats. Output: ``WeightCosts`` (per weight: bytes and
estimated error per format), ``allocate`` -> {weight: format}.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from precast.errors import PrecastError
from precast.ir.inputs import placeholder_values, user_values
from precast.ir.program import Program
from precast.passes.regions import inline_regions
from precast.quant.formats import (
    FLOAT,
    WeightFormat,
    dequantize,
    fits,
    parse_format,
    quantize,
    scale_grid,
)
from precast.quant.probes import PassCount, Roundings, Taps

aten = torch.ops.aten
METRICS = ("kld", "mse")


@dataclass
class WeightCost:
    """One weight: its shape, the dtype it is read in, and per format name the stored bytes and the estimated
    output error of storing it so (nats/position for kld, squared error per element for mse)."""

    name: str
    shape: tuple[int, ...]
    bytes: dict[str, int] = field(default_factory=dict)
    estimate: dict[str, float] = field(default_factory=dict)
    truth: dict[str, float] = field(default_factory=dict)  # ablation: measured alone (``ablate``)


@dataclass
class WeightCosts:
    metric: str
    float_dtype: torch.dtype  # what "float" stores (the policy's low dtype, or fp32)
    weights: dict[str, WeightCost]
    positions: int  # positions (kld) or output elements (mse) the estimate averages over
    probes: int
    seconds: float = 0.0

    def total(self, formats: dict[str, str]) -> tuple[int, float]:
        """(bytes, estimated error) of a plan (weight -> format name; weights not named: float)."""
        b = e = 0.0
        for name, w in self.weights.items():
            f = formats.get(name, FLOAT.name)
            b += w.bytes[f]
            e += w.estimate[f]
        return int(b), e


def weight_reads(program: Program) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of each 2-d float parameter/buffer a linear reads as its weight or an embedding as its table
    (the weights ``weight_format=`` can store in 8/4 bits), in a program whose regions are inlined. A convolution's
    weight (stored per output channel by ``weight_format=`` rules) is not measured: a budget keeps it float and its
    record says so (``precast.quant.budget.NOT_MEASURED``)."""
    targets = {n.name: s.target for n, s in program.input_spec.items() if s.kind != InputKind.USER_INPUT}
    out = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        arg = (
            node.args[1]
            if node.target is aten.linear.default and len(node.args) > 1
            else node.args[0]
            if node.target is aten.embedding.default
            else None
        )
        if isinstance(arg, torch.fx.Node) and arg.name in targets:
            value = program.constant_value(arg)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2:
                out[targets[arg.name]] = tuple(value.shape)
    return out


class ProgramRunner:
    """The fp32 program (a private copy) run with some weights given as tensors of the caller's choosing."""

    def __init__(self, ep: ExportedProgram):
        self.ep = ep
        self.program = Program(ep)
        inline_regions(self.program.gm)
        self.program.gm.recompile()
        kinds = [s.kind for s in self.program.output_specs]
        self.user = [i for i, k in enumerate(kinds) if k == OutputKind.USER_OUTPUT]

    def user_inputs(self, batch: Any, index: int | str) -> list:
        return user_values(self.program, self.ep, batch, index)

    def check_ids(self, user: list, index: int | str) -> None:
        """One line for a token id outside an embedding table's rows, read straight from an input (the run would
        die on torch's raw IndexError deep in the estimate)."""
        placeholders = [n for n in self.program.graph.nodes if n.op == "placeholder"]
        values = dict(zip(placeholders, placeholder_values(self.program, user), strict=True))
        for node in self.program.graph.nodes:
            if node.op != "call_function" or node.target is not aten.embedding.default:
                continue
            ids = values.get(node.args[1])
            table = (
                self.program.constant_value(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            )
            if not isinstance(ids, torch.Tensor) or not isinstance(table, torch.Tensor) or not ids.numel():
                continue
            rows = table.shape[0]
            bad = ids[(ids < 0) | (ids >= rows)]
            if bad.numel():
                raise PrecastError(
                    f"weight sensitivity: batch {index}: token id {int(bad.flatten()[0])} is outside the vocabulary "
                    f"(the embedding {node.name} reads a table of {rows} rows); give ids in 0..{rows - 1}"
                )

    def run(self, user: list, swap: dict[str, torch.Tensor]) -> torch.Tensor:
        """The first floating user output with the constants named in ``swap`` replaced."""
        values = placeholder_values(self.program, user)
        placeholders = [n for n in self.program.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            target = self.program.input_spec[node].target
            if target in swap:
                values[i] = swap[target]
        flat = torch.utils._pytree.tree_leaves(self.program.gm(*values))
        for i in self.user:
            out = flat[i]
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                return out
        raise PrecastError("weight sensitivity: the program has no floating output to measure")


def estimate_costs(
    ep: ExportedProgram,
    data: Iterable[Any],
    formats: Sequence[str | WeightFormat] = ("int4", "int8"),
    *,
    float_dtype: torch.dtype = torch.bfloat16,
    metric: str = "kld",
    probes: int = 8,
    weights: Iterable[str] | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    fitted: Any = None,
) -> WeightCosts:
    """Every eligible weight's estimated error for every format, from ``probes`` backward passes per batch of the
    fp32 program (the module docstring), taken where each weight is read (``precast.quant.probes``).
    ``weights``: a subset (default: all ``weight_reads``). ``progress(done, total)``: called before the first
    backward pass and after each (``total``: batches x probes). ``fitted`` (``precast.quant.fit.Fitted``): int4
    parts fitted on data, measured in place of round-to-nearest's."""
    if metric not in METRICS:
        raise PrecastError(f"metric={metric!r}: choose {', '.join(METRICS)}")
    if not isinstance(probes, int) or probes < 1:
        raise PrecastError(f"probes={probes!r}: give a number of backward passes >= 1")
    fmts = [parse_format(f, "formats") for f in formats]
    start = time.perf_counter()
    runner = ProgramRunner(ep)
    shapes = weight_reads(runner.program)
    names = list(shapes) if weights is None else [n for n in weights if n in shapes]
    if not names:
        raise PrecastError(
            "weight sensitivity: the program has no linear or embedding weight to store in 8/4 bits"
        )
    batches = list(data)
    if not batches:
        raise PrecastError("weight sensitivity: no calibration batches (give a list of input tuples)")
    for index, batch in enumerate(batches):  # before the taps take the embeddings' reads over
        runner.check_ids(runner.user_inputs(batch, index), index)
    roundings = Roundings({n: weight_value(ep, n) for n in names}, fmts, float_dtype, fitted)
    taps = Taps(runner.program.gm, runner.program.input_spec, roundings)
    acc = {n: dict.fromkeys(roundings.formats(n), 0.0) for n in names}
    probing = _Probing(taps, acc, metric, probes, torch.Generator().manual_seed(seed))
    probing.progress = PassCount(progress, len(batches) * probes)
    for index, batch in enumerate(batches):
        _probe_batch(probing, runner, batch, index)
    scale = (0.5 if metric == "kld" else 1.0) / (probes * probing.positions)
    costs = {
        n: WeightCost(n, shapes[n], dict(roundings.bytes[n]), {f: v * scale for f, v in acc[n].items()})
        for n in names
    }
    out = WeightCosts(metric, float_dtype, costs, probing.positions, probes, time.perf_counter() - start)
    if fitted is not None:  # a tied weight measured both ways: the better rounding kept
        fitted.keep_better(out)
    return out


@dataclass
class _Probing:
    """The estimate as the batches add to it: the taps (each weight's rounding per format, the projections of the
    current backward pass), the squared projections summed so far (weight -> format -> sum), the metric, the
    probes per batch, the random draws, the positions (or output elements) seen and the progress."""

    taps: Taps
    acc: dict[str, dict[str, float]]
    metric: str
    probes: int
    generator: torch.Generator
    positions: int = 0
    progress: PassCount = field(default_factory=lambda: PassCount(None, 0))


def _probe_batch(p: _Probing, runner: ProgramRunner, batch: Any, index: int) -> None:
    """One batch's ``probes`` backward passes: each weight's gradient projected on its rounding in each format
    (at its reads, or whole for the weights read otherwise), squared, added to ``p.acc``."""
    user = runner.user_inputs(batch, index)
    roundings, direct = p.taps.roundings, p.taps.direct
    leaves = {n: roundings.values[n].detach().requires_grad_(True) for n in direct}
    deltas = {n: {f: roundings.delta(n, f) for f in roundings.formats(n)} for n in direct}
    if index == 0:
        p.progress(0)
    with torch.enable_grad():
        out = runner.run(user, leaves).float()
        if p.metric == "kld":
            logp = torch.log_softmax(out.reshape(-1, out.shape[-1]), -1)
            p.positions += logp.shape[0]
            # every probe's draw made now, in the order the probes take them (the same draws); the logits let go
            # first and the distribution after (positions x vocabulary each, and multinomial makes a third: the
            # budget's peak was here)
            del out
            probs = logp.detach().exp()
            draws = [torch.multinomial(probs, 1, generator=p.generator) for _ in range(p.probes)]
            del probs
        else:
            p.positions += out.numel()
        for k in range(p.probes):
            if p.metric == "kld":
                loss = logp.gather(1, draws[k]).sum()
            else:
                signs = torch.randint(0, 2, out.shape, generator=p.generator).float() * 2 - 1
                loss = (out * signs).sum()
            p.taps.begin()
            wrt = [p.taps.anchor, *leaves.values()]
            grads = torch.autograd.grad(loss, wrt, retain_graph=k + 1 < p.probes, allow_unused=True)
            for n, g in zip(direct, grads[1:], strict=True):
                for f, d in deltas[n].items():
                    p.taps.sums[n][f] += float((g * d).sum()) if g is not None else 0.0
            for n, sums in p.taps.sums.items():
                for f, s in sums.items():
                    p.acc[n][f] += s**2
            p.progress()


def weight_value(ep: ExportedProgram, name: str) -> torch.Tensor:
    value = ep.state_dict.get(name, ep.constants.get(name))
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        raise PrecastError(
            f"weight sensitivity: {name} holds no values (a weightless program); give the program with its weights"
        )
    return value


def ablate(
    ep: ExportedProgram,
    data: Iterable[Any],
    costs: WeightCosts,
    fmt: str,
    names: Iterable[str] | None = None,
    fitted: Any = None,
) -> None:
    """The truth for each weight (``costs.weights[n].truth[fmt]``): the fp32 program with that weight alone stored
    in ``fmt`` (its parts fitted on data where ``fitted`` has them, ``precast.quant.fit``), against the fp32
    program, on ``data`` (mean KL per position, or mean squared error)."""
    runner = ProgramRunner(ep)
    batches = [runner.user_inputs(b, i) for i, b in enumerate(data)]
    with torch.no_grad():
        refs = [runner.run(u, {}).float() for u in batches]
        f = parse_format(fmt, "fmt")
        for n in names if names is not None else list(costs.weights):
            w = weight_value(ep, n).detach().float()
            if f.quantized and fits(f, tuple(w.shape)):
                continue
            given = fitted.get(n, f, costs.float_dtype) if fitted is not None and f.quantized else None
            rounded = (
                dequantize(given or quantize(w, f, scale_grid(costs.float_dtype)), f, torch.float32)
                if f.quantized
                else w.to(costs.float_dtype).float()
            )
            total = count = 0.0
            for u, ref in zip(batches, refs, strict=True):
                out = runner.run(u, {n: rounded}).float()
                if costs.metric == "kld":
                    r = torch.log_softmax(ref.reshape(-1, ref.shape[-1]).double(), -1)
                    o = torch.log_softmax(out.reshape(-1, out.shape[-1]).double(), -1)
                    total += float((r.exp() * (r - o)).sum())
                    count += r.shape[0]
                else:
                    total += float(((out - ref).double() ** 2).sum())
                    count += out.numel()
            costs.weights[n].truth[f.name] = total / count


def _hull(options: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The lower convex hull of (bytes, error) options, cheapest first, each dearer one strictly better: the
    options a greedy upgrade goes through (a dearer format that is not better, or not better per byte, is
    skipped)."""
    options = sorted(options)
    hull: list[tuple[int, float, str]] = []
    for o in options:
        if hull and o[1] >= hull[-1][1]:
            continue  # dearer and not better
        while len(hull) >= 2:
            (b1, e1, _), (b2, e2, _) = hull[-2], hull[-1]
            # hull[-1] is above the segment hull[-2] -> o: never the best step
            if (e1 - e2) * (o[0] - b1) <= (e1 - o[1]) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


@dataclass
class Allocation:
    """A plan (weight -> format) with its estimated bytes and error, and the greedy path that led to it
    (``steps``: (weight, format, bytes after, error after) for every upgrade, in order)."""

    formats: dict[str, str]
    bytes: int
    estimate: float
    steps: list[tuple[str, str, int, float]] = field(default_factory=list)


def allocate(
    costs: WeightCosts,
    *,
    error: float | None = None,
    max_bytes: float | None = None,
    formats: Sequence[str] | None = None,
) -> Allocation:
    """The cheapest formats under a budget: every weight starts at its cheapest option (among ``formats``, default
    every format measured; "float" always allowed), then upgrades by the best error removed per byte until the
    estimated error is at most ``error`` (or, with ``max_bytes``, while the next upgrade fits). Without a budget:
    the whole path to all-float (the curve)."""
    hulls: dict[str, list[tuple[int, float, str]]] = {}
    for name, w in costs.weights.items():
        allowed = [f for f in w.estimate if formats is None or f in formats or f == FLOAT.name]
        hulls[name] = _hull([(w.bytes[f], w.estimate[f], f) for f in allowed])
    at = dict.fromkeys(hulls, 0)
    total_b = sum(h[0][0] for h in hulls.values())
    total_e = sum(h[0][1] for h in hulls.values())
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        h, i = hulls[name], at[name]
        if i + 1 < len(h):
            gain = (h[i][1] - h[i + 1][1]) / max(h[i + 1][0] - h[i][0], 1)
            heapq.heappush(heap, (-gain, name))

    for name in hulls:
        push(name)
    steps: list[tuple[str, str, int, float]] = []
    while heap:
        if error is not None and total_e <= error:
            break
        _, name = heapq.heappop(heap)
        h, i = hulls[name], at[name]
        extra = h[i + 1][0] - h[i][0]
        if max_bytes is not None and total_b + extra > max_bytes:
            continue  # does not fit: a cheaper upgrade of another weight may
        at[name] = i + 1
        total_b += extra
        total_e += h[i + 1][1] - h[i][1]
        steps.append((name, h[i + 1][2], int(total_b), total_e))
        push(name)
    chosen = {name: hulls[name][i][2] for name, i in at.items()}
    return Allocation(chosen, int(total_b), total_e, steps)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x: Sequence[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
