"""Calibrate: run the unconverted program over user data once, streaming, and keep per-node range statistics.

The program run is the one classification sees (regions inlined, nothing cast yet; each op of a region runs
inside that region's autocast, as the program wrote it), so statistics are keyed by the node names the rules and
the report use. The data is consumed once and lazily, whatever it is (a list, a
generator, a DataLoader), and memory does not grow with the number of batches: each batch's activations are
freed as the interpreter goes, each node keeps a few numbers, and only the first ``keep`` batches are kept (for
the tolerance search, which needs several forwards on the same batches).

Batches are tuples of positional inputs, dicts of keyword inputs, or ``(args, kwargs)`` pairs. A dict may be
keyed by the forward's own argument names (``forward(self, X)`` -> ``{"X": t}``, as ModelOpt keys its
calibration files) or by export's sanitized placeholder names (``{"x": t}``).

Across processes (``precast.numerics.distributed``): with a process group (``group=``, or the default one when
torch.distributed is initialised) each rank passes its shard and every rank gets the statistics of all the
shards; a shard's i-th batch is global batch ``i * world + rank`` (the order of ``data[rank::world]``), which
decides the kept sample. Statistics measured before (a ``Calibration``, its file, or a list of them: merged)
are used as given, after checking they were measured on this program for this low dtype.

Input: the Program, its ExportedProgram and an iterable of batches (or given statistics). Output:
``Calibration`` (per-node statistics, the kept sample) and diagnostics saying which data each used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from precast.dtypes import dtype_name
from precast.errors import PrecastError
from precast.ir.diagnostics import Diagnostic, DiagnosticLog
from precast.ir.graph import graph_key
from precast.ir.inputs import bind_inputs, placeholder_values, user_values
from precast.ir.program import Program
from precast.ir.regions import region_autocast
from precast.numerics.calibration.checks import (
    TOLERANCE_BATCHES,
    check_calibration,
    check_coverage,
    measured_nodes,
)
from precast.numerics.calibration.files import load_calibration
from precast.numerics.distributed import rank_and_size, reduce_calibration
from precast.policy.measurements import Calibration, NodeStats, new_part
from precast.progress import ProgressBar

# ---- input names ---------------------------------------------------------------------------------------


# ---- batches -------------------------------------------------------------------------------------------


class _StatsInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, stats: dict[str, NodeStats], low: torch.dtype | None):
        super().__init__(gm, garbage_collect_values=True)
        self.stats, self.low = stats, low

    def run_node(self, n: torch.fx.Node) -> Any:
        # export's dtype checks pin the dtypes of the program's own autocast regions, which this run keeps: they
        # would hold, and cost a check per node
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            return None
        with region_autocast(n):  # the program's own regions run as written (a bf16 island stays bf16)
            out = super().run_node(n)
        if n.op in ("placeholder", "call_function"):
            self.stats.setdefault(n.name, NodeStats()).update(out, self.low)
        return out


def batches_of(data: Any) -> Iterator[Any]:
    if isinstance(data, (torch.Tensor, str, bytes, dict)) or not isinstance(data, Iterable):
        raise PrecastError(
            f"calibration must be an iterable of batches (a list of input tuples, a DataLoader...), got "
            f"{type(data).__name__}; wrap a single batch as [batch]"
        )
    return iter(data)


def calibrate(
    program: Program,
    ep: ExportedProgram,
    data: Iterable[Any],
    *,
    low: torch.dtype | None = None,
    keep: int = 0,
    progress: bool | None = None,  # None: a bar on an interactive terminal outside CI
    source: str = "calibration data",
    shard: tuple[int, int] | None = None,
    group: Any = None,
) -> Calibration:
    """Per-node statistics of the fp32 program over ``data``, read once and lazily; the first ``keep`` batches
    are kept (checked, as (args, kwargs)) in ``Calibration.sample`` for later forwards. ``low``: the dtype
    the conversion lowers to, for the subnormal / flush-to-zero counts. ``shard=(rank, world)``: ``data`` is
    that shard of the batches (``data[rank::world]``); ``group``: a process group to reduce over (its rank and
    size the shard; None: this process alone: ``convert`` measuring its own data never waits for other ranks)."""
    if group is not None:
        given, shard = shard, rank_and_size(group)
        if given is not None and tuple(given) != shard:
            raise PrecastError(
                f"shard={given!r}, but this is rank {shard[0]} of {shard[1]} of the process group"
            )
    rank, world = shard if shard is not None else (0, 1)
    if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
        raise PrecastError(f"shard={shard!r}: give (rank, world) with 0 <= rank < world")
    cal = Calibration(
        source=source, keep=keep, key=graph_key(program.graph), dtype=dtype_name(low), parts=(new_part(),)
    )
    interp = _StatsInterpreter(program.gm, cal.stats, low)
    total = len(data) if hasattr(data, "__len__") else None
    with ProgressBar(f"calibrating on {source}", total, progress) as bar, torch.no_grad():
        for i, batch in enumerate(batches_of(data)):
            where = i * world + rank  # the batch's global index: the order one process would see
            user = user_values(program, ep, batch, where)
            interp.run(*placeholder_values(program, user))
            if len(cal.sample) < keep:
                cal.sample.append(bind_inputs(ep, batch, f"calibration batch {where}"))
                cal.sample_index.append(where)
            cal.batches += 1
            bar.advance()
            del batch, user  # the generator's next batch must not find this one still alive
    if group is not None:
        cal = reduce_calibration(cal, program, ep, group)
    if cal.batches == 0:
        raise PrecastError("calibration data is empty: give at least one batch of inputs")
    return cal


def is_given(data: Any) -> bool:
    """Statistics measured before (a Calibration, its file, or a non-empty list of them), not batches."""
    one = (Calibration, str, os.PathLike)
    return isinstance(data, one) or (
        isinstance(data, (list, tuple)) and bool(data) and all(isinstance(d, one) for d in data)
    )


def given_calibration(data: Any, program: Program, low: torch.dtype | None) -> Calibration:
    """The given statistics (files loaded, several merged), checked against ``program`` and ``low``: measured
    on it for ``low``, of its measured nodes only, and (merged) of every one of them."""
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    cals = []
    names = measured_nodes(program.graph)
    for d in items:
        c = d if isinstance(d, Calibration) else load_calibration(Path(d))
        where = f"calibration {d}" if not isinstance(d, Calibration) else "calibration"
        check_calibration(c, graph_key(program.graph), low, where, names)
        cals.append(c)
    cal = cals[0].merge(*cals[1:])
    one = "calibration" if isinstance(items[0], Calibration) else f"calibration {items[0]}"
    check_coverage(cal, names, one if len(cals) == 1 else f"the {len(cals)} calibrations merged")
    if cal.batches == 0:
        raise PrecastError("calibration: the given statistics cover no batch; calibrate on at least one")
    return cal


def calibrate_stage(
    program: Program,
    ep: ExportedProgram,
    rep: DiagnosticLog,
    data: Any,
    low: torch.dtype,
    *,
    ranges: bool,
    tol: bool,
) -> Calibration | None:
    """One streaming pass over the calibration data (else the example inputs, when a range rule or the
    tolerance needs data): statistics from every batch, the first TOLERANCE_BATCHES kept for the tolerance
    search. The report says which data each used."""
    keep = TOLERANCE_BATCHES if tol else 0
    if data is not None and is_given(data):
        return _given_stage(program, rep, data, low, keep=keep, tol=tol)
    if data is not None:
        cal = calibrate(program, ep, data, low=low, keep=keep)
        searched = f"; the tolerance search used the first {len(cal.sample)}" if tol else ""
        rep.diagnostics.append(
            Diagnostic("info", "calibrated", f"value ranges measured on {cal.batches} batches{searched}")
        )
        return cal
    if not (ranges or tol):
        return None
    return _example_stage(program, ep, rep, low, keep=keep, ranges=ranges)


def _given_stage(
    program: Program, rep: DiagnosticLog, data: Any, low: torch.dtype, *, keep: int, tol: bool
) -> Calibration:
    """Statistics given (a ``Calibration`` or its files), checked against the program, the sample cut to ``keep``."""
    cal = given_calibration(data, program, low)
    if tol and not cal.sample:
        raise PrecastError(
            "tolerance= runs the program on the calibration's kept batches, and these statistics keep none; "
            f"calibrate with keep={TOLERANCE_BATCHES} (precast.calibrate's default)"
        )
    # the search uses the first TOLERANCE_BATCHES, as when convert measures the data itself
    cal.sample, cal.sample_index = cal.sample[:keep], cal.sample_index[:keep]
    searched = f"; the tolerance search used the first {len(cal.sample)}" if tol else ""
    rep.diagnostics.append(
        Diagnostic(
            "info",
            "calibrated",
            f"value ranges measured on {cal.batches} batches (given statistics){searched}",
        )
    )
    return cal


def _example_stage(
    program: Program, ep: ExportedProgram, rep: DiagnosticLog, low: torch.dtype, *, keep: int, ranges: bool
) -> Calibration | None:
    """No calibration data: the example inputs measured, said in the report (none: said too, when ranges needed
    them)."""
    if ep.example_inputs is None:
        if ranges:
            rep.diagnostics.append(
                Diagnostic(
                    "warning",
                    "data-max-inactive",
                    "data_max and flush_to_zero are not applied: no calibration data and the program has no "
                    "example inputs; pass calibration=[inputs, ...]",
                )
            )
        return None
    rep.diagnostics.append(
        Diagnostic(
            "info",
            "ranges-from-example-inputs",
            "no calibration data: value ranges (data_max, flush_to_zero) and errors were measured on the example "
            "inputs only; pass calibration=[inputs, ...] for representative ranges",
        )
    )
    return calibrate(program, ep, [ep.example_inputs], low=low, keep=keep, source="the example inputs")
