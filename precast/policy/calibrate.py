"""Calibrate: run the fp32 program over user data once, streaming, and keep per-node range statistics.

The program run is the one classification sees (regions inlined, nothing cast yet), so statistics are keyed by
the node names the rules and the report use. The data is consumed once and lazily, whatever it is (a list, a
generator, a DataLoader), and memory does not grow with the number of batches: each batch's activations are
freed as the interpreter goes, each node keeps a few numbers, and only the first ``keep`` batches are kept (for
the tolerance search, which needs several forwards on the same batches).

Batches are tuples of positional inputs, dicts of keyword inputs, or ``(args, kwargs)`` pairs. A dict may be
keyed by the forward's own argument names (``forward(self, X)`` -> ``{"X": t}``, as ModelOpt keys its
calibration files) or by export's sanitized placeholder names (``{"x": t}``).
"""

from __future__ import annotations

import math
import re
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

# batches kept from the single pass over the calibration data for the tolerance search (several forwards each)
TOLERANCE_BATCHES = 8


@dataclass
class NodeStats:
    """Range of a node's floating outputs over every batch (non-finite values counted, not in the range).

    With a low dtype given, also how many finite values are nonzero, how many of those are subnormal in the low
    dtype (below its smallest normal, ``torch.finfo(low).tiny``: few significant bits left) and how many flush
    to zero there (at most half its smallest subnormal, which rounds to 0).
    """

    absmax: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    batches: int = 0
    count: int = 0  # finite floating values seen
    nonzero: int = 0
    subnormal: int = 0  # nonzero values below the low dtype's smallest normal (flushed ones included)
    flushed: int = 0  # nonzero values that become 0 in the low dtype

    def update(self, value: object, low: torch.dtype | None = None) -> None:
        seen = False
        for t in pytree.tree_leaves(value):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.numel() == 0:
                continue
            seen = True
            self._update_tensor(t.detach(), low)
        self.batches += seen

    def _update_tensor(self, t: torch.Tensor, low: torch.dtype | None) -> None:
        finite = torch.isfinite(t)
        bad = int(t.numel() - finite.sum().item())
        self.nonfinite += bad
        vals = t[finite] if bad else t
        self.count += vals.numel()
        if not vals.numel():
            return
        lo, hi = vals.min().item(), vals.max().item()
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.absmax = max(self.absmax, abs(lo), abs(hi))
        if low is None:
            return
        mag = vals.abs()
        nonzero = mag > 0
        self.nonzero += int(nonzero.sum().item())
        small = nonzero & (mag < torch.finfo(low).tiny)
        if small.any():
            self.subnormal += int(small.sum().item())
            self.flushed += int((small & (mag <= smallest_subnormal(low) / 2)).sum().item())


def smallest_subnormal(dtype: torch.dtype) -> float:
    """2**-24 for float16, 2**-133 for bfloat16: the smallest positive value the dtype holds."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


@dataclass
class Calibration:
    stats: dict[str, NodeStats] = field(default_factory=dict)
    batches: int = 0
    source: str = "calibration data"  # or "the example inputs"
    sample: list[tuple[tuple, dict]] = field(default_factory=list)  # the first batches, as (args, kwargs)


def user_input_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n, spec in program.input_spec.items() if spec.kind == InputKind.USER_INPUT]


# ---- input names ---------------------------------------------------------------------------------------


def export_name(name: str) -> str:
    """The placeholder name torch.export gives the input argument ``name`` (``placeholder_naming_pass``:
    every character outside [a-zA-Z0-9] becomes '_', then lowercased)."""
    return re.sub(r"[^a-zA-Z0-9]", "_", name).lower()


def input_names(ep: ExportedProgram) -> tuple[list[str], list[str]]:
    """(positional, keyword) argument names of the program's forward as the user wrote them (``X``, not export's
    ``x``): from ``module_call_graph[0].signature.forward_arg_names`` (kept by torch.export.save), else the
    user-input placeholder names when each positional argument is one tensor."""
    in_spec = ep.call_spec.in_spec
    n_pos, keywords = in_spec.child(0).num_children, list(in_spec.child(1).context)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    names = list(getattr(sig, "forward_arg_names", None) or [])
    if len(names) == n_pos + len(keywords) and names[n_pos:] == keywords:
        return names[:n_pos], keywords
    users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if all(c.is_leaf() for c in in_spec.child(0).children()) and len(users) >= n_pos:
        return users[:n_pos], keywords
    return [f"args[{i}]" for i in range(n_pos)], keywords


def bind_inputs(ep: ExportedProgram, batch: Any, where: str) -> tuple[tuple, dict]:
    """``batch`` as the (args, kwargs) the program's forward takes: keyword inputs named like the forward's own
    arguments (exactly, else by export's sanitizing rule: ``{"x": t}`` for ``X``) fill its positional
    parameters; an unknown name is an error listing the names the program takes."""
    args, kwargs = normalize_inputs(batch)
    if not kwargs or not _args_kwargs_spec(ep):
        return args, kwargs
    positional, keywords = input_names(ep)
    expected = positional + keywords
    given: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = _resolve_name(key, expected, where)
        if name in given or name in positional[: len(args)]:
            raise PrecastError(f"{where}: input '{name}' is given twice ({key!r} names it again)")
        given[name] = value
    if len(args) > len(positional):
        return args, kwargs  # the structure check says what is wrong
    missing = [n for n in positional[len(args) :] if n not in given]
    if missing:
        raise PrecastError(
            f"{where}: no value for input(s) {', '.join(missing)}; the program's inputs are "
            f"({', '.join(expected)})"
        )
    args = args + tuple(given.pop(n) for n in positional[len(args) :])
    return args, {k: given[k] for k in keywords if k in given}


def _args_kwargs_spec(ep: ExportedProgram) -> bool:
    """Whether the program's input spec is export's usual (args tuple, kwargs dict) pair."""
    spec = ep.call_spec.in_spec
    return spec is not None and spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict


def _resolve_name(key: Any, expected: list[str], where: str) -> str:
    if key in expected:
        return key
    found = [n for n in expected if isinstance(key, str) and export_name(n) == export_name(key)]
    if len(found) == 1:
        return found[0]
    raise PrecastError(
        f"{where}: no input named {key!r}; the program's inputs are ({', '.join(expected)}) (the forward's "
        "argument names; export's lowercased names are accepted too)"
    )


# ---- batches -------------------------------------------------------------------------------------------


def user_values(program: Program, ep: ExportedProgram, batch: Any, index: int | str) -> list[Any]:
    """The batch's user inputs, flat in placeholder order, checked against the program's input structure,
    dtypes and static shapes (one PrecastError naming the batch and the input)."""
    where = f"calibration batch {index}" if isinstance(index, int) else index
    user = flat_user_inputs(ep, *bind_inputs(ep, batch, where), where)
    nodes = user_input_nodes(program)
    if len(user) != len(nodes):
        raise PrecastError(
            f"{where}: {len(user)} inputs given, the program takes {len(nodes)} {_signature(ep)}"
        )
    for node, value in zip(nodes, user, strict=True):
        _check_value(node, value, where)
    return user


def flat_user_inputs(ep: ExportedProgram, args: tuple, kwargs: dict, where: str) -> list[Any]:
    """The user inputs flat, after checking their structure against the program's (one clear error)."""
    in_spec = ep.call_spec.in_spec
    user, spec = pytree.tree_flatten((args, kwargs))
    if in_spec is not None and spec != in_spec:
        given = f"{len(args)} positional input(s)" + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        raise PrecastError(
            f"{where}: its structure ({given}) does not match the program's inputs {_signature(ep)}; give the "
            "inputs as a tuple of positional inputs or a dict keyed by argument name, like the example inputs"
        )
    return user


def _check_value(node: torch.fx.Node, value: Any, where: str) -> None:
    want = node.meta.get("val")
    if not isinstance(want, torch.Tensor):
        return
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


def placeholder_values(program: Program, user: list[Any]) -> list[Any]:
    """Values for every placeholder of ``program.gm``: constants, then ``user``, for one forward (call it again
    for every forward). Constants come from ``program.constant_value`` only (never the caller's program); a
    constant the program writes (``program.written``) is copied once more, so each forward starts from the
    program's state and leaves it as it was: the converted program starts where the caller's did, and the
    tolerance search never measures a moving target."""
    values = iter(user)
    out = []
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        kind = program.input_spec[node].kind
        if kind == InputKind.USER_INPUT:
            out.append(next(values))
        elif kind == InputKind.TOKEN:
            out.append(None)
        else:
            value = program.constant_value(node)
            written = program.constant_target(node) in program.written and isinstance(value, torch.Tensor)
            out.append(value.detach().clone() if written else value)
    return out


def flat_inputs(program: Program, ep: ExportedProgram, batch: Any, index: int | str) -> list[Any]:
    """Values for every placeholder of ``program.gm`` (constants, then the batch's checked user inputs)."""
    return placeholder_values(program, user_values(program, ep, batch, index))


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _signature(ep: ExportedProgram) -> str:
    if not _args_kwargs_spec(ep):
        names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        return "(" + ", ".join(names) + ")"
    positional, keywords = input_names(ep)
    return "(" + ", ".join(positional + [f"{k}=" for k in keywords]) + ")"


class _StatsInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, stats: dict[str, NodeStats], low: torch.dtype | None):
        super().__init__(gm, garbage_collect_values=True)
        self.stats, self.low = stats, low

    def run_node(self, n: torch.fx.Node) -> Any:
        # export's dtype checks pin the dtypes of the program's own autocast regions; this fp32 run drops them
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            return None
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
) -> Calibration:
    """Per-node statistics of the fp32 program over ``data``, read once and lazily; the first ``keep`` batches
    are kept (checked, as (args, kwargs)) in ``Calibration.sample`` for later forwards. ``low``: the dtype
    the conversion lowers to, for the subnormal / flush-to-zero counts."""
    cal = Calibration(source=source)
    interp = _StatsInterpreter(program.gm, cal.stats, low)
    total = len(data) if hasattr(data, "__len__") else None
    with ProgressBar(f"calibrating on {source}", total, progress) as bar, torch.no_grad():
        for i, batch in enumerate(batches_of(data)):
            user = user_values(program, ep, batch, i)
            interp.run(*placeholder_values(program, user))
            if len(cal.sample) < keep:
                cal.sample.append(bind_inputs(ep, batch, f"calibration batch {i}"))
            cal.batches += 1
            bar.advance()
            del batch, user  # the generator's next batch must not find this one still alive
    if cal.batches == 0:
        raise PrecastError("calibration data is empty: give at least one batch of inputs")
    return cal
