"""The weight estimate's probes taken where each weight is read: no weight gradient is ever formed.

The Fisher estimate (``precast.quant.estimate``) needs, per probe, weight and format, the projection
``<dL/dW, dW>`` of the loss's gradient on the weight's rounding ``dW``. A linear ``y = x W^T + b`` has
``dL/dW = G^T X`` (``G`` the gradient at its output, ``X`` its input, one row per position), so the projection is
``sum(G * P)`` with ``P = X dW^T``: one matmul per format and batch (a forward's cost), made in the forward pass,
then one matrix-vector product per probe (the formats' ``P`` stacked). An embedding's is ``sum(G * dW[ids])`` (positions holding the padding
index excluded: their rows get no gradient). The program's reads of the weights are rewritten, on the estimator's
private copy, into ``_Tap`` modules whose backward adds the projections and passes on the input's gradient only:
each probe's backward pass computes the activations' gradients (half a backward's matmuls, no weight-sized
tensor). A weight read by any other op (or an embedding scaling gradients by frequency) stays a leaf whose
gradient is projected whole, as before. Mathematically the same sums as projecting ``dL/dW`` (the fp32 sums
differ in order only: tests/quant/test_probes.py holds them to the former's within 1e-4).

The roundings are kept as the stored parts (int8: a quarter of the fp32 ``dW``'s bytes, int4 an eighth), never
all the ``dW`` at once (1.6 GB for SmolLM2-135M's three formats): a batch makes each ``dW`` block of rows by block
(``BLOCK``), within the CPU's cache, by the same ops as before (bitwise the same ``dW``), and uses it at once. A
weight whose ``dW`` is asked for once per batch (every read a linear that does not widen: its projections are
kept) holds no round-to-nearest parts at all: they are remade from the weight block by block when asked
(``Roundings.recompute``; fitted parts are kept). That took export-llm --bits 4.6's peak from 2.52 to 2.42 GB.

Input: the runner's private program, each weight's fp32 value, the formats. Output: per probe, each weight's
projection per format (``Taps.sums``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from precast.quant.formats import FLOAT, WeightFormat, dequantize, fits, quantize, scale_grid

aten = torch.ops.aten
RTN_MARK = "~rtn"  # a fitted weight's round-to-nearest parts, measured beside the fit's (``Fitted.tied``)
# values of a weight rounded, or of its dW made, at a time: 1 MiB in fp32, within a core's L2 cache (at 1 thread
# on SmolLM2's 49152 x 576 table: 3 formats' P in 0.61 s CPU, against 0.65 s by blocks of 2**16 and 2**20)
BLOCK = 1 << 18


@dataclass
class PassCount:
    """The backward passes done, told to the caller's ``progress(done, total)`` (nothing when None)."""

    report: Callable[[int, int], None] | None
    total: int
    done: int = 0

    def __call__(self, step: int = 1) -> None:
        self.done += step
        if self.report is not None:
            self.report(self.done, self.total)


class Roundings:
    """Each weight's rounding per format: the stored parts (or the float dtype), its bytes, ``dW`` on demand.
    ``fitted`` (``precast.quant.fit.Fitted``): int4 parts fitted on data, used where given (the estimate then
    measures the rounding the conversion stores)."""

    def __init__(
        self,
        values: dict[str, torch.Tensor],
        formats: Sequence[WeightFormat],
        float_dtype: torch.dtype,
        fitted: Any = None,
    ) -> None:
        self.values = {n: v.detach().float() for n, v in values.items()}
        self.float_dtype = float_dtype
        self.parts: dict[str, dict[str, tuple[WeightFormat, dict[str, torch.Tensor]]]] = {}
        # (weight, format)s whose round-to-nearest parts are remade from the weight when asked (``recompute``), and
        # those whose parts were fitted on data (never remade)
        self.remade: set[tuple[str, str]] = set()
        self.fitted: set[tuple[str, str]] = set()
        self.bytes: dict[str, dict[str, int]] = {}
        for name, w in self.values.items():
            self.parts[name], self.bytes[name] = {}, {}
            for fmt in (*formats, FLOAT):
                if not fmt.quantized:
                    self.parts[name][fmt.name] = (fmt, {})
                    self.bytes[name][fmt.name] = w.numel() * torch.finfo(float_dtype).bits // 8
                elif not fits(fmt, tuple(w.shape)):
                    given = fitted.get(name, fmt, float_dtype) if fitted is not None else None
                    parts = given if given is not None else _quantize_by_blocks(w, fmt, float_dtype)
                    if given is not None:
                        self.fitted.add((name, fmt.name))
                    self.parts[name][fmt.name] = (fmt, parts)
                    self.bytes[name][fmt.name] = sum(p.numel() * p.element_size() for p in parts.values())
                    if (
                        given is not None and name in fitted.tied
                    ):  # measured both ways (``precast.quant.fit``)
                        self.parts[name][fmt.name + RTN_MARK] = (
                            fmt,
                            _quantize_by_blocks(w, fmt, float_dtype),
                        )
                        self.bytes[name][fmt.name + RTN_MARK] = self.bytes[name][fmt.name]

    def recompute(self, name: str) -> None:
        """Drop the weight's round-to-nearest parts: ``delta`` remakes them from the weight, block by block (each
        row's parts depend on that row alone, so the same bytes). For a weight whose ``dW`` is asked for once per
        batch (a linear whose projections are kept): its int8 parts were ~1/4 of its fp32 bytes held through every
        backward pass, remade in a fraction of the forward's time. Fitted parts stay: they cannot be remade."""
        for fmt, (f, _parts) in self.parts[name].items():
            if f.quantized and (name, fmt) not in self.fitted:
                self.parts[name][fmt] = (f, {})
                self.remade.add((name, fmt))

    def formats(self, name: str) -> list[str]:
        """The formats that can store the weight, in the order asked, "float" last."""
        return list(self.parts[name])

    def delta(self, name: str, fmt: str, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """``dW = stored value - W`` in fp32 (the rows ``rows`` only: a block, or an embedding's rows read)."""
        f, parts = self.parts[name][fmt]
        w = self.values[name] if rows is None else self.values[name][rows]
        if not f.quantized:
            return w.to(self.float_dtype).float() - w
        if (name, fmt) in self.remade:
            return dequantize(_quantize_by_blocks(w, f, self.float_dtype), f, torch.float32) - w
        if rows is not None:  # every part is stored row by row (per output channel, int4 groups within a row)
            parts = {role: p[rows] for role, p in parts.items()}
        return dequantize(parts, f, torch.float32) - w


def _quantize_by_blocks(
    w: torch.Tensor, fmt: WeightFormat, float_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``quantize`` block of rows by block (each row's parts depend on that row alone: the same bytes), each block
    within the CPU's cache; scales in the dtype the weight is read in under the policy (``float_dtype``)."""
    step = max(1, BLOCK // w.shape[1])
    blocks = [quantize(w[i : i + step], fmt, scale_grid(float_dtype)) for i in range(0, w.shape[0], step)]
    return {role: torch.cat([b[role] for b in blocks]) for role in blocks[0]}


class Taps:
    """The weights' reads in ``gm`` rewritten into ``_Tap`` modules (where every read is a linear's weight or an
    embedding's table); ``direct``: the weights read otherwise. ``sums[name][format]``: the projections the
    current backward pass added (``begin`` zeroes them)."""

    def __init__(self, gm: torch.fx.GraphModule, input_spec: dict, roundings: Roundings) -> None:
        self.roundings = roundings
        self.anchor = torch.zeros((), requires_grad=True)  # makes every tap's output need a gradient
        self.sums: dict[str, dict[str, float]] = {}
        self.direct: list[str] = []
        reads: dict[str, list[torch.fx.Node]] = {}
        for node, spec in input_spec.items():
            if spec.target in roundings.values:
                reads.setdefault(spec.target, []).extend(node.users)
        count = 0
        for name, users in reads.items():
            if not users or not all(_tappable(u, name, input_spec) for u in users):
                self.direct.append(name)
                continue
            for user in users:
                gm.add_submodule(
                    f"_precast_tap{count}", _Tap(self, name, user.target is aten.embedding.default)
                )
                with gm.graph.inserting_before(user):
                    tap = gm.graph.call_module(f"_precast_tap{count}", user.args, user.kwargs)
                user.replace_all_uses_with(tap)
                gm.graph.erase_node(user)
                count += 1
            if keeps_projections(roundings.values[name]) and all(
                u.target is aten.linear.default for u in users
            ):
                roundings.recompute(name)  # its dW asked for once per batch (``_TappedLinear``)
        gm.recompile()
        self.begin()

    def begin(self) -> None:
        self.sums = {n: dict.fromkeys(self.roundings.formats(n), 0.0) for n in self.roundings.values}


def keeps_projections(w: torch.Tensor) -> bool:
    """A linear read of ``w`` keeps its projections ``P`` for the batch (it does not widen: out <= in); a widening
    one keeps its input and projects block by block on every backward pass (``_TappedLinear``)."""
    return w.shape[0] <= w.shape[1]


def _tappable(user: torch.fx.Node, name: str, input_spec: dict) -> bool:
    """``user`` reads the weight only as a linear's weight or as an embedding's table (gradients not scaled by
    frequency)."""
    slots = [
        i for i, a in enumerate(user.args) if isinstance(a, torch.fx.Node) and _target(a, input_spec) == name
    ]
    if any(_target(v, input_spec) == name for v in user.kwargs.values() if isinstance(v, torch.fx.Node)):
        return False
    if user.target is aten.linear.default:
        return slots == [1]
    if user.target is aten.embedding.default:
        by_frequency = user.args[3] if len(user.args) > 3 else user.kwargs.get("scale_grad_by_freq", False)
        return slots == [0] and not by_frequency
    return False


def _target(node: torch.fx.Node, input_spec: dict) -> str | None:
    spec = input_spec.get(node)
    return None if spec is None else spec.target


class _Tap(torch.nn.Module):
    """One read of a weight: the op's output, and per format its projection ``P`` (one [formats, ...] tensor, kept
    for the batch's backward passes)."""

    def __init__(self, taps: Taps, name: str, embedding: bool) -> None:
        super().__init__()
        self.taps, self.name, self.embedding = taps, name, embedding

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.embedding:
            return _TappedEmbedding.apply(self, self.taps.anchor, args, kwargs)
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return _TappedLinear.apply(self, self.taps.anchor, x, w, bias)

    def linear_projections(self, x: torch.Tensor) -> torch.Tensor:
        """[formats, out, positions]: ``dW X^T`` per format, made block by block of rows (each block's ``dW`` made
        and used while it is in the CPU's cache, never a whole ``dW`` in memory)."""
        roundings = self.taps.roundings
        formats, (rows, cols) = roundings.formats(self.name), roundings.values[self.name].shape
        xt = x.reshape(-1, cols).t()
        out = torch.empty(len(formats), rows, xt.shape[1])
        step = max(1, BLOCK // cols)
        for start in range(0, rows, step):
            block = slice(start, min(start + step, rows))
            for i, f in enumerate(formats):
                torch.mm(roundings.delta(self.name, f, block), xt, out=out[i, block])
        return out

    def add(self, projections: torch.Tensor, grad: torch.Tensor) -> None:
        """The backward pass's projections: ``sum(G * P)`` per format (one matrix-vector product)."""
        sums = self.taps.sums[self.name]
        for f, s in zip(sums, torch.mv(projections, grad.reshape(-1)).tolist(), strict=True):
            sums[f] += s

    def add_by_blocks(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        """The backward pass's projections from the input kept instead of ``P``: ``<G^T X, dW>`` per format, block
        of rows by block (the block of the weight's gradient and each format's ``dW`` made and used in cache)."""
        roundings, sums = self.taps.roundings, self.taps.sums[self.name]
        rows, cols = roundings.values[self.name].shape
        x2, gt = x.reshape(-1, cols), grad.reshape(-1, rows).t()
        step = max(1, BLOCK // cols)
        for start in range(0, rows, step):
            block = slice(start, min(start + step, rows))
            g = torch.mm(gt[block], x2).reshape(-1)
            for f in sums:
                sums[f] += float(torch.dot(g, roundings.delta(self.name, f, block).reshape(-1)))


class _TappedLinear(torch.autograd.Function):
    """A linear's read. Its projections ``P`` ([formats, out, positions]) are kept where the layer does not
    widen (out <= in: q/k/v/o/down of a decoder layer); else the input is kept and each backward pass projects the
    weight's gradient block by block (gate/up, the head: 3 x out values per position against in), trading the
    gradient's matmul per pass (``add_by_blocks``) for memory (SmolLM2-135M, 256 positions: 627 MB of ``P`` ->
    195 MB; export-llm --bits 4.6's peak 2.84 -> 2.43 GiB for ~20 s more CPU). Taking q/o by blocks too (out <
    in) measured no lower peak (2.44 GiB: the allocator's, not these tensors') for 5 s more CPU."""

    @staticmethod
    def forward(
        ctx: Any, tap: _Tap, anchor: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: Any
    ) -> Any:
        ctx.tap, ctx.weight, ctx.x, ctx.projections = tap, w, None, None
        if keeps_projections(w):
            projections = tap.linear_projections(x)
            ctx.projections = projections.reshape(projections.shape[0], -1)
        else:
            ctx.x = x.detach()
        return aten.linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.projections is None:
            ctx.tap.add_by_blocks(ctx.x, grad)
        else:  # P is [formats, out, positions]: the gradient laid out the same way
            ctx.tap.add(ctx.projections, grad.reshape(-1, grad.shape[-1]).t().contiguous())
        gx = grad.matmul(ctx.weight) if ctx.needs_input_grad[2] else None
        return None, None, gx, None, None


class _TappedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tap: _Tap, anchor: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        ids = args[1]
        padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
        flat = ids.reshape(-1)
        roundings = tap.taps.roundings
        rows = torch.stack([roundings.delta(tap.name, f, flat) for f in roundings.formats(tap.name)])
        if padding >= 0:  # a position holding the padding index gives its row no gradient
            rows *= (flat != padding).unsqueeze(-1)
        ctx.tap, ctx.projections = tap, rows.reshape(rows.shape[0], -1)
        return aten.embedding.default(*args, **kwargs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.tap.add(ctx.projections, grad)
        return None, None, None, None
