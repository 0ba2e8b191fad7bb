"""Data-aware int4 for a program: each int4 weight's stored parts fitted on calibration data, read from the program
itself (``precast.quant.rounding``: GPTQ's column-by-column error compensation with each group's step and zero
point searched against the input channels' importance).

The statistics are the program's own: a private copy of the fp32 program (``estimate.ProgramRunner``: regions inlined,
written state copied per forward, the caller's program never run) has each ``linear`` that reads a weight
rewritten into a module that adds ``x^T x`` of its input to a sum kept per input (q/k/v of one layer read one
input: one sum), then returns the linear's value; one no-grad forward per calibration batch fills the sums. A
weight read by several linears gets the sum of their inputs' sums. Each weight is then fitted (``gptq_int4``; the
group search alone, ``search_int4``, where its inputs had fewer rows than it has input channels: ``GPTQ_ROWS``; the
scales at ``scale_dtype``: the dtype the policy computes in, as ``Int4.quantize`` stores them) and its input's sum
let go once every weight reading it is fitted (SmolLM2-135M's 121 sums are 400 MB in fp32; the weights are taken in
the order of their last linear read, so a tied table, read first by the embedding, is fitted last).

A table no linear reads (an embedding alone) has no inputs to fit against: it keeps round-to-nearest and says so
(``Fitted.rounding``). A weight fitted here is not recomputable from its fp32 value: its parts carry the
data-aware tag (``derive_tag(..., data_aware=True)``).

Input: an ExportedProgram with its weights, calibration batches, the int4 formats, the scale dtype. Output:
``Fitted`` (the parts per (weight, format), how each weight was rounded, the seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError
from precast.ir.inputs import placeholder_values
from precast.quant.estimate import ProgramRunner, weight_reads, weight_value
from precast.quant.formats import Int4, WeightFormat, fits, parse_format
from precast.quant.probes import RTN_MARK
from precast.quant.rounding import GPTQ, RTN, SEARCH, gptq_int4, search_int4

aten = torch.ops.aten


@dataclass
class Fitted:
    """Int4 parts fitted on data: ``parts[(weight, format name)]`` (``Int4.quantize``'s roles and dtypes, the
    scales at ``scale_dtype``), ``rounding[weight]`` (``GPTQ``, or ``RTN`` with why), the seconds spent."""

    scale_dtype: torch.dtype
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = field(default_factory=dict)
    rounding: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    tied: set[str] = field(default_factory=set)  # fitted on a linear's inputs, read by an embedding too

    def keep_better(self, costs: Any) -> None:
        """For each tied weight the estimate measured both ways (``probes.RTN_MARK``), the rounding with the lower
        estimate kept (the fit's objective is the linear's output; the embedding's rows count as well): the other's
        entries dropped from ``costs`` (``WeightCosts``), round-to-nearest's parts kept by dropping the fit's."""
        for name, cost in costs.weights.items():
            for key in [k for k in cost.estimate if k.endswith(RTN_MARK)]:
                fmt = key[: -len(RTN_MARK)]
                rtn, fit = cost.estimate.pop(key), cost.estimate[fmt]
                cost.bytes.pop(key)
                if rtn < fit:
                    cost.estimate[fmt] = rtn
                    self.parts.pop((name, fmt), None)
                    self.rounding[name] = f"{RTN} (measured: {rtn:.3g} against the fit's {fit:.3g})"

    def get(self, name: str, fmt: WeightFormat, grid: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The fitted parts of ``name`` in ``fmt`` with their scales on ``grid`` (the dtype the conversion stores
        the scales on); None when the weight was not fitted in that format. A scale that ``grid`` cannot hold
        exactly is an internal error (the fit runs at the policy's dtype: the grid the pass picks for it)."""
        parts = self.parts.get((name, fmt.name))
        if parts is None:
            return None
        scale = parts["scale"]
        if grid != scale.dtype:
            moved = scale.to(grid)
            if not torch.equal(moved.to(scale.dtype), scale):
                raise PrecastError(
                    f"internal error in pass quantize_weights: {name}'s int4 scales were fitted in {scale.dtype} "
                    f"and are stored in {grid}, which cannot hold them"
                )
            parts = {**parts, "scale": moved}
        return parts


# GPTQ's column update needs its inputs' statistics over at least this many rows per input channel; below it the
# fit is the group search alone (on the tests' tiny Llama, 96 rows for 128 channels: GPTQ's estimate on its own
# rows came out 14x below the error measured on other text)
GPTQ_ROWS = 1.0


class _Sum(torch.nn.Module):
    """A linear's read of a weight: adds ``x^T x`` (fp32) of its input to the sum for that input."""

    def __init__(self, sums: dict[str, torch.Tensor], rows: dict[str, int], key: str) -> None:
        super().__init__()
        self.sums, self.rows, self.key = sums, rows, key

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0]
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        held = self.sums.get(self.key)
        product = flat.T @ flat
        self.sums[self.key] = product if held is None else held.add_(product)
        self.rows[self.key] = self.rows.get(self.key, 0) + flat.shape[0]
        return aten.linear.default(*args, **kwargs)


@dataclass
class _Inputs:
    """The linears' inputs as the program runs: per input (its node's name) the sum of ``x^T x`` and the rows
    summed; per weight the inputs of the linears that read it."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    of: dict[str, list[str]] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)  # weight -> the graph position of its last linear read


def _tap_linears(runner: ProgramRunner, names: set[str]) -> _Inputs:
    """Every linear reading a weight in ``names`` rewritten into a ``_Sum`` (the sums filled as the program runs)."""
    program = runner.program
    targets = {n: s.target for n, s in program.input_spec.items() if s.kind != InputKind.USER_INPUT}
    seen = _Inputs()
    sums, rows, inputs = seen.sums, seen.rows, seen.of
    gm = program.gm
    for i, node in enumerate(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target is not aten.linear.default or len(node.args) < 2:
            continue
        weight = node.args[1]
        name = targets.get(weight) if isinstance(weight, torch.fx.Node) else None
        if name not in names or not isinstance(node.args[0], torch.fx.Node):
            continue
        key = node.args[0].name
        seen.last[name] = i
        inputs.setdefault(name, [])
        if key not in inputs[name]:
            inputs[name].append(key)
        gm.add_submodule(f"_precast_sum{i}", _Sum(sums, rows, key))
        with gm.graph.inserting_before(node):
            tap = gm.graph.call_module(f"_precast_sum{i}", node.args, node.kwargs)
        node.replace_all_uses_with(tap)
        gm.graph.erase_node(node)
    gm.recompile()
    return seen


def fit_int4(
    ep: ExportedProgram,
    data: Iterable[Any],
    formats: Sequence[str | WeightFormat],
    scale_dtype: torch.dtype,
    *,
    names: Iterable[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Fitted:
    """Each linear/embedding weight of ``ep`` (or those in ``names``) fitted in each int4 format of ``formats``
    on ``data`` (the module docstring); ``progress(done, total)``: called after the statistics' forwards (done 0)
    and after each weight is fitted."""
    start = time.perf_counter()
    int4 = [f for f in (parse_format(f, "formats") for f in formats) if isinstance(f, Int4)]
    fitted = Fitted(scale_dtype)
    if not int4:
        return fitted
    runner = ProgramRunner(ep)
    shapes = weight_reads(runner.program)
    wanted = list(shapes) if names is None else [n for n in names if n in shapes]
    batches = list(data)
    if not batches:
        raise PrecastError("data-aware int4: no calibration batches (give a list of input tuples)")
    users = [runner.user_inputs(b, i) for i, b in enumerate(batches)]
    for index, user in enumerate(users):
        runner.check_ids(user, index)
    embedded = {
        runner.program.constant_target(n.args[0])
        for n in runner.program.graph.nodes
        if n.op == "call_function"
        and n.target is aten.embedding.default
        and isinstance(n.args[0], torch.fx.Node)
    }
    seen = _tap_linears(runner, set(wanted))
    # fitted in the order of their last linear read: the inputs' sums are let go as the fit goes, so the largest
    # weight fitted last (a tied table, the head: read first by the embedding) runs beside the fewest sums
    wanted.sort(key=lambda n: seen.last.get(n, -1))
    with torch.no_grad():
        for user in users:
            runner.program.gm(*placeholder_values(runner.program, user))
    del users
    _fit_all(ep, fitted, wanted, int4, seen, progress)
    fitted.tied = {n for n in embedded if any(key[0] == n for key in fitted.parts)}
    fitted.seconds = time.perf_counter() - start
    return fitted


def _fit_all(
    ep: ExportedProgram,
    fitted: Fitted,
    wanted: list[str],
    int4: list[Int4],
    seen: _Inputs,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Fit each weight in ``wanted`` (the module docstring), each input's sum dropped after its last reader."""
    last = {key: name for name in wanted for key in seen.of.get(name, [])}
    if progress is not None:
        progress(0, len(wanted))
    for done, name in enumerate(wanted, 1):
        keys = seen.of.get(name, [])
        if not keys:
            fitted.rounding[name] = f"{RTN} (read by no linear: no inputs to fit against)"
        else:
            _fit_one(ep, fitted, name, int4, seen, keys)
            for key in keys:
                if last.get(key) == name:
                    seen.sums.pop(key, None)
        if progress is not None:
            progress(done, len(wanted))


def _fit_one(
    ep: ExportedProgram, fitted: Fitted, name: str, int4: list[Int4], seen: _Inputs, keys: list
) -> None:
    """One weight in each int4 format: GPTQ + search when its inputs had at least ``GPTQ_ROWS`` rows per input
    channel, else the group search alone against the channels' importance (GPTQ's update fitted to fewer rows than
    channels moves the error where the calibration rows do not look, and other text does)."""
    hessian = seen.sums[keys[0]] if len(keys) == 1 else sum(seen.sums[k] for k in keys)
    rows = sum(seen.rows[k] for k in keys)
    weight = weight_value(ep, name).detach().to(torch.float32)
    enough = rows >= GPTQ_ROWS * weight.shape[1]
    for fmt in int4:
        if fits(fmt, tuple(weight.shape)) is None:
            if enough:
                parts = gptq_int4(weight, hessian, fmt, fitted.scale_dtype)
            else:
                parts = search_int4(weight, torch.diagonal(hessian) / max(rows, 1), fmt, fitted.scale_dtype)
            fitted.parts[(name, fmt.name)] = parts
    fitted.rounding[name] = (
        GPTQ if enough else f"{SEARCH} ({rows} rows for {weight.shape[1]} input channels: too few for GPTQ)"
    )
