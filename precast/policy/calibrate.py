"""Calibrate: run the fp32 program over user data and keep per-node range statistics (streaming).

The program run is the one classification sees (regions inlined, nothing cast yet), so statistics are keyed by
the node names the rules and the report use. Memory does not grow with the number of batches: each batch's
activations are freed as the interpreter goes, and each node keeps five numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.capture import normalize_inputs
from precast.errors import PrecastError
from precast.program import Program
from precast.progress import ProgressBar


@dataclass
class NodeStats:
    """Range of a node's floating outputs over every batch (non-finite values counted, not in the range)."""

    absmax: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    batches: int = 0

    def update(self, value: object) -> None:
        seen = False
        for t in pytree.tree_leaves(value):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.numel() == 0:
                continue
            seen = True
            t = t.detach()
            finite = torch.isfinite(t)
            bad = int(t.numel() - finite.sum().item())
            self.nonfinite += bad
            vals = t[finite] if bad else t
            if vals.numel():
                lo, hi = vals.min().item(), vals.max().item()
                self.min, self.max = min(self.min, lo), max(self.max, hi)
                self.absmax = max(self.absmax, abs(lo), abs(hi))
        self.batches += seen


@dataclass
class Calibration:
    stats: dict[str, NodeStats] = field(default_factory=dict)
    batches: int = 0
    source: str = "calibration data"  # or "the example inputs"


def user_input_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n, spec in program.input_spec.items() if spec.kind == InputKind.USER_INPUT]


def flat_inputs(program: Program, ep: ExportedProgram, batch: Any, index: int | str) -> list[Any]:
    """Values for every placeholder of ``program.gm`` (constants, then the batch's user inputs), checked against
    the program's input structure, dtypes and static shapes."""
    args, kwargs = normalize_inputs(batch)
    where = f"calibration batch {index}" if isinstance(index, int) else index
    in_spec = ep.call_spec.in_spec
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if (
        not args
        and kwargs
        and set(kwargs) == set(names)
        and in_spec is not None
        and in_spec.children_specs[1].num_leaves == 0
    ):
        args, kwargs = (
            tuple(kwargs[n] for n in names),
            {},
        )  # keyword batch for a positionally exported program
    try:
        if in_spec is not None:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, in_spec)
        user, spec = pytree.tree_flatten((args, kwargs))
        ok = in_spec is None or spec == in_spec
    except Exception:
        ok = False
    if not ok:
        given = f"{len(args)} positional input(s)" + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        raise PrecastError(
            f"{where}: its structure ({given}) does not match the program's inputs {_signature(ep)}; give each "
            "batch as a tuple of positional inputs or a dict of keyword inputs, like the example inputs"
        )
    nodes = user_input_nodes(program)
    if len(user) != len(nodes):
        raise PrecastError(
            f"{where}: {len(user)} inputs given, the program takes {len(nodes)} {_signature(ep)}"
        )
    for node, value in zip(nodes, user, strict=True):
        want = node.meta.get("val")
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            raise PrecastError(f"{where}: input '{node.name}' should be a tensor, got {type(value).__name__}")
        if value.dtype != want.dtype or value.dim() != want.dim():
            raise PrecastError(
                f"{where}: input '{node.name}' is {_desc(value)}, the program takes {_desc(want)}; "
                "calibration batches must look like the example inputs"
            )
        for d, (got, exp) in enumerate(zip(value.shape, want.shape, strict=True)):
            if isinstance(exp, int) and got != exp:
                raise PrecastError(
                    f"{where}: input '{node.name}' has shape {tuple(value.shape)}, the program was exported with "
                    f"static size {exp} in dim {d}; export with dynamic_shapes or give batches of that shape"
                )
        if value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum().item())
            if bad:
                raise PrecastError(
                    f"{where}: input '{node.name}' contains {bad} NaN/inf values; calibration data must be finite"
                )
    values = iter(user)
    out = []
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = program.input_spec[node]
        if spec.kind == InputKind.USER_INPUT:
            out.append(next(values))
        elif spec.kind == InputKind.TOKEN:
            out.append(None)
        else:
            out.append(program.constant_value(node))
    return out


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _signature(ep: ExportedProgram) -> str:
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return "(" + ", ".join(names) + ")"


class _StatsInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, stats: dict[str, NodeStats]):
        super().__init__(gm, garbage_collect_values=True)
        self.stats = stats

    def run_node(self, n: torch.fx.Node) -> Any:
        # export's dtype checks pin the dtypes of the program's own autocast regions; this fp32 run drops them
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            return None
        out = super().run_node(n)
        if n.op in ("placeholder", "call_function"):
            self.stats.setdefault(n.name, NodeStats()).update(out)
        return out


def batches_of(data: Any) -> Iterator[Any]:
    if isinstance(data, torch.Tensor) or not isinstance(data, Iterable):
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
    progress: bool | None = None,  # None: a bar on an interactive terminal outside CI
    source: str = "calibration data",
) -> Calibration:
    """Per-node range statistics of the fp32 program over ``data`` (batches: input tuples or kwargs dicts)."""
    cal = Calibration(source=source)
    interp = _StatsInterpreter(program.gm, cal.stats)
    total = len(data) if hasattr(data, "__len__") else None
    with ProgressBar(f"calibrating on {source}", total, progress) as bar, torch.no_grad():
        for i, batch in enumerate(batches_of(data)):
            interp.run(*flat_inputs(program, ep, batch, i))
            cal.batches += 1
            bar.advance()
    if cal.batches == 0:
        raise PrecastError("calibration data is empty: give at least one batch of inputs")
    return cal
