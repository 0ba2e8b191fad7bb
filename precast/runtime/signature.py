"""What a compiled program accepts, checked before native code runs (engine-independent).

A compiled engine (AOTInductor, OpenVINO, ...) does not check its inputs by default: a program taking
``(B, 128)`` called with ``(4, 16)`` reads past its buffers and returns NaN or a plausible number. A
``ProgramSignature`` holds what each user input must be -- tensor or not, dtype, device type, rank, static sizes,
the symbols of dynamic sizes and their ranges (``range_constraints``) -- precomputed once from the program's input
specs, so ``check`` costs a few attribute reads per input on the hot path.

    sig = ProgramSignature.from_program(ep)    # once, when the engine's callable is built
    flat = sig.check(args, kwargs)             # every call: the user inputs in the program's order, or PrecastError

An integer input that indexes an embedding table (a decoder's ``input_ids``) is checked against the table's row
count (``vocab``, read from the graph): an id outside ``[0, rows)`` reads past the table in compiled code (garbage
or the kernel's "index out of bounds" abort), so it is one line naming the id instead.

Input: an ExportedProgram (or the dict ``to_dict`` wrote, e.g. in a cache manifest). Output: the checked, flat
user inputs, or a one-line PrecastError naming the argument, the expected and the actual shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, SymIntArgument, TensorArgument
from torch.utils import _pytree as pytree

from precast.errors import PrecastError, first_line
from precast.runtime.positions import cache_positions, check_positions
from precast.runtime.sizes import evaluate as _evaluate
from precast.runtime.sizes import parse_expr as _parse_expr


@dataclass(frozen=True)
class _Input:
    """One user input: what it must be. ``dims``: an int (static), a symbol name, or a compound expression."""

    name: str  # the placeholder's name (the forward's parameter name for a plain argument)
    where: str  # how the caller passes it: args[0], kwargs['mask']
    kind: str  # "tensor", "symint", "constant" or "other" (not checked)
    dtype: torch.dtype | None = None
    device: str | None = None
    dims: tuple[int | str, ...] = ()
    value: Any = None  # a constant input's value

    def shape_text(self) -> str:
        return "(" + ", ".join(str(d) for d in self.dims) + ("," if len(self.dims) == 1 else "") + ")"


class ProgramSignature:
    """The user inputs a program takes, checked on every call of a compiled engine (see the module docstring)."""

    def __init__(
        self,
        inputs: list[_Input],
        in_spec: pytree.TreeSpec,
        ranges: dict[str, tuple[int, int | None]],
        positions: dict[str, int] | None = None,
        vocab: dict[str, int] | None = None,
    ):
        self.inputs = tuple(inputs)
        self.in_spec = in_spec
        self.ranges = dict(ranges)
        # input name -> the length of the cache it indexes (``cache_positions``): its values must lie in [0, L)
        self.positions = dict(positions or {})
        index = {spec.name: pos for pos, spec in enumerate(self.inputs)}
        self._positions = [(index[n], length) for n, length in self.positions.items() if n in index]
        # input name -> the rows of the embedding table it indexes (``vocab_sizes``): its values must lie in [0, V)
        self.vocab = dict(vocab or {})
        self._vocab = [(index[n], rows) for n, rows in self.vocab.items() if n in index]
        self._positional = in_spec == pytree.tree_flatten((tuple(range(len(inputs))), {}))[1]
        # the hot path, precomputed: per tensor input (position, dtype, device type, rank, static, symbolic)
        self._tensor_checks = []
        self._compound: list[tuple[int, int, Any]] = []
        for pos, spec in enumerate(self.inputs):
            if spec.kind != "tensor":
                continue
            static = tuple((i, d) for i, d in enumerate(spec.dims) if isinstance(d, int))
            # range_constraints also lists derived sizes (2*s0): those are compared to their value once bound
            symbolic = tuple((i, d) for i, d in enumerate(spec.dims) if _is_symbol(d) and d in self.ranges)
            for i, d in enumerate(spec.dims):
                if isinstance(d, str) and (i, d) not in symbolic:
                    self._compound.append((pos, i, _parse_expr(d)))
            self._tensor_checks.append((pos, spec.dtype, spec.device, len(spec.dims), static, symbolic))
        self._others = [
            (pos, spec) for pos, spec in enumerate(self.inputs) if spec.kind in ("symint", "constant")
        ]

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_program(cls, ep: ExportedProgram) -> ProgramSignature:
        """The user inputs of ``ep`` as its input specs, placeholder metadata and range constraints describe them."""
        in_spec = ep.call_spec.in_spec
        if in_spec is None:
            raise PrecastError(
                "ProgramSignature: the program has no call spec (not from torch.export.export?)"
            )
        vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
        user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        where = _paths(in_spec)
        if len(where) != len(user):
            raise PrecastError(
                f"ProgramSignature: the call spec has {len(where)} leaves but the program {len(user)} user inputs"
            )
        inputs = []
        for spec, path in zip(user, where, strict=True):
            arg = spec.arg
            if isinstance(arg, TensorArgument) and isinstance(vals.get(arg.name), torch.Tensor):
                val = vals[arg.name]
                dims = tuple(_dim(d) for d in val.shape)
                inputs.append(_Input(arg.name, path, "tensor", val.dtype, val.device.type, dims))
            elif isinstance(arg, SymIntArgument):
                inputs.append(_Input(arg.name, path, "symint", dims=(_dim(vals.get(arg.name)),)))
            elif isinstance(arg, ConstantArgument) and isinstance(
                arg.value, (int, float, bool, str, type(None))
            ):
                inputs.append(_Input(arg.name, path, "constant", value=arg.value))
            else:
                inputs.append(_Input(getattr(arg, "name", "?"), path, "other"))
        ranges = {}
        for sym, vr in ep.range_constraints.items():
            ranges[str(sym)] = (_finite(vr.lower) or 0, _finite(vr.upper))
        return cls(inputs, in_spec, ranges, cache_positions(ep), vocab_sizes(ep))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for a cache manifest); ``from_dict`` reads it back."""
        return {
            "in_spec": pytree.treespec_dumps(self.in_spec),
            "ranges": {k: list(v) for k, v in self.ranges.items()},
            "positions": dict(self.positions),
            "vocab": dict(self.vocab),
            "inputs": [
                {
                    "name": s.name,
                    "where": s.where,
                    "kind": s.kind,
                    "dtype": str(s.dtype).removeprefix("torch.") if s.dtype is not None else None,
                    "device": s.device,
                    "dims": list(s.dims),
                    "value": s.value,
                }
                for s in self.inputs
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProgramSignature:
        """The inverse of ``to_dict``; a malformed dict is a PrecastError (a cache entry to rebuild)."""
        try:
            inputs = []
            for d in data["inputs"]:
                dtype = getattr(torch, d["dtype"]) if d["dtype"] is not None else None
                if dtype is not None and not isinstance(dtype, torch.dtype):
                    raise ValueError(f"not a dtype: {d['dtype']}")
                dims = tuple(x if isinstance(x, int) else str(x) for x in d["dims"])
                inputs.append(
                    _Input(
                        str(d["name"]), str(d["where"]), str(d["kind"]), dtype, d["device"], dims, d["value"]
                    )
                )
            ranges = {
                str(k): (int(v[0]), None if v[1] is None else int(v[1])) for k, v in data["ranges"].items()
            }
            positions = {str(k): int(v) for k, v in data.get("positions", {}).items()}
            # a manifest written before the vocabulary check holds none: no check (cache.FORMAT unchanged)
            vocab = {str(k): int(v) for k, v in data.get("vocab", {}).items()}
            return cls(inputs, pytree.treespec_loads(data["in_spec"]), ranges, positions, vocab)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise PrecastError(
                f"ProgramSignature: malformed signature data ({type(exc).__name__}: {exc})"
            ) from exc

    # ---- the check --------------------------------------------------------------------------------------------
    def check(self, args: tuple, kwargs: dict) -> list[Any]:
        """The user inputs in the order the program takes them, after checking each against its spec.

        Raises a one-line PrecastError naming the first argument that does not fit (count, dtype, device, rank,
        a static size, a dynamic size out of its range or disagreeing with another input's same dimension).
        """
        if not kwargs and self._positional and len(args) == len(self.inputs):
            flat = args
        else:
            flat = self._flatten(args, kwargs)
        bound: dict[str, int] = {}
        for pos, dtype, device, rank, static, symbolic in self._tensor_checks:
            t = flat[pos]
            if not isinstance(t, torch.Tensor):
                self._fail(pos, f"expected a tensor, got {type(t).__name__}")
            if t.dtype != dtype or t.device.type != device or t.dim() != rank:
                self._fail(pos, self._got(t))
            shape = t.shape
            for i, size in static:
                if shape[i] != size:
                    self._fail(pos, self._got(t))
            for i, sym in symbolic:
                size = shape[i]
                seen = bound.setdefault(sym, size)
                if seen != size:
                    self._fail(pos, f"{self._got(t)}: dim {i} is {sym}, which another input gives as {seen}")
                lo, hi = self.ranges[sym]
                if size < lo or (hi is not None and size > hi):
                    top = "inf" if hi is None else hi
                    self._fail(pos, f"{self._got(t)}: dim {i} ({sym}) must be in [{lo}, {top}]")
        for pos, i, expr in self._compound:
            want = _evaluate(expr, bound)
            if want is not None and flat[pos].shape[i] != want:
                self._fail(
                    pos, f"{self._got(flat[pos])}: dim {i} must be {self.inputs[pos].dims[i]} = {want}"
                )
        for pos, spec in self._others:
            self._check_other(pos, spec, flat[pos], bound)
        for pos, length in self._positions:
            check_positions(flat[pos], length, self.inputs[pos].name, self.inputs[pos].where)
        for pos, rows in self._vocab:
            check_ids(flat[pos], rows, self.inputs[pos].name, self.inputs[pos].where)
        return list(flat)

    def _flatten(self, args: tuple, kwargs: dict) -> list[Any]:
        from torch.export._tree_utils import reorder_kwargs

        want = ", ".join(f"{s.name} ({s.where})" for s in self.inputs) or "no inputs"
        try:
            flat, spec = pytree.tree_flatten((tuple(args), reorder_kwargs(dict(kwargs), self.in_spec)))
        except (ValueError, KeyError, TypeError, AssertionError, RuntimeError) as exc:
            raise PrecastError(
                f"compiled program: takes {want}; got {len(args)} positional argument(s) and "
                f"keywords {sorted(kwargs)} ({first_line(exc)})"
            ) from None
        if spec != self.in_spec:
            raise PrecastError(
                f"compiled program: takes {want}; got {len(args)} positional argument(s) and keywords "
                f"{sorted(kwargs)}"
            )
        return flat

    def _check_other(self, pos: int, spec: _Input, value: Any, bound: dict[str, int]) -> None:
        if spec.kind == "constant":
            if value != spec.value:
                self._fail(pos, f"the program was exported with the constant {spec.value!r}, got {value!r}")
            return
        if not isinstance(value, int) or isinstance(value, bool):
            self._fail(pos, f"expected an int, got {type(value).__name__}")
        sym = spec.dims[0]
        if isinstance(sym, int):
            if value != sym:
                self._fail(pos, f"expected {sym}, got {value}")
        elif sym in self.ranges:
            lo, hi = self.ranges[sym]
            if value < lo or (hi is not None and value > hi):
                self._fail(pos, f"{value} is out of its range [{lo}, {'inf' if hi is None else hi}]")
            if bound.setdefault(sym, value) != value:
                self._fail(pos, f"{value} disagrees with {sym} = {bound[sym]} from another input")

    def _got(self, t: torch.Tensor) -> str:
        return f"got shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device.type}"

    def _fail(self, pos: int, detail: str) -> None:
        spec = self.inputs[pos]
        if spec.kind == "tensor":
            dtype = str(spec.dtype).removeprefix("torch.")
            want = f"expected shape {spec.shape_text()} {dtype} on {spec.device}"
        else:
            want = f"expected {spec.kind} {spec.dims[0] if spec.dims else spec.value!r}"
        raise PrecastError(
            f"compiled program: input {spec.name!r} ({spec.where}): {want}, {detail}; pass inputs shaped like "
            "the program's example inputs"
        )

    def __repr__(self) -> str:
        parts = [
            f"{s.name}: {s.shape_text()} {s.dtype}" if s.kind == "tensor" else s.name for s in self.inputs
        ]
        return f"ProgramSignature({', '.join(parts)})"


def _paths(in_spec: pytree.TreeSpec) -> list[str]:
    """``args[0]``, ``kwargs['mask']``: how the caller passes each leaf of the program's call spec."""
    leaves = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    out = []
    for path, _ in pytree.tree_flatten_with_path(leaves)[0]:
        head, rest = path[0], path[1:]
        root = "args" if getattr(head, "idx", 1) == 0 else "kwargs"
        out.append(root + pytree.keystr(rest))
    return out


def _finite(bound: Any) -> int | None:
    """A range bound as an int; None for an infinite one (torch's ``int_oo``, sympy's ``oo``)."""
    # int_oo claims is_finite; sympy.Integer is exactly the finite integers
    return int(bound) if isinstance(bound, int) or getattr(bound, "is_Integer", False) else None


def _dim(size: Any) -> int | str:
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        if expr.is_number:
            return int(expr)
        return str(expr)
    return str(size)


def _is_symbol(dim: int | str) -> bool:
    return isinstance(dim, str) and dim.isidentifier()


# ops that read rows of a table by an index tensor: op -> (the table's argument, the index's argument)
_ROW_READS = {"aten::embedding": (0, 1), "aten::index_select": (0, 2), "aten::index": (0, 1)}
# ops that pass an index tensor's values through unchanged (views, copies, integer casts)
_SAME_VALUES = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::flatten",
    "aten::clone",
    "aten::contiguous",
    "aten::alias",
    "aten::detach",
    "aten::expand",
    "aten::_to_copy",
    "aten::to",
}


def vocab_sizes(ep: ExportedProgram) -> dict[str, int]:
    """User input name -> the rows of the embedding table it indexes (a decoder's vocabulary): for each row read
    (``embedding``, ``index_select`` along dim 0, ``index``) of a table with a static row count whose index is a
    user input itself (through views, copies and integer casts only, so every value of the input is a row number),
    the smallest such count. Read from the graph, never from names; empty when no input indexes a table."""
    users = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    found: dict[str, int] = {}
    for node in ep.graph.nodes:
        rows_and_index = _row_read(node)
        if rows_and_index is None:
            continue
        rows, index = rows_and_index
        while (
            isinstance(index, torch.fx.Node)
            and index.op == "call_function"
            and _schema_name(index) in _SAME_VALUES
            and index.args
        ):
            index = index.args[0]
        if isinstance(index, torch.fx.Node) and index.op == "placeholder" and index.name in users:
            found[index.name] = min(found.get(index.name, rows), rows)
    return found


def _row_read(node: torch.fx.Node) -> tuple[int, Any] | None:
    """(the table's static row count, the index argument) when ``node`` reads rows of a table, else None."""
    if node.op != "call_function":
        return None
    where = _ROW_READS.get(_schema_name(node))
    if where is None or len(node.args) <= where[1]:
        return None
    table, index = node.args[where[0]], node.args[where[1]]
    if _schema_name(node) == "aten::index_select" and node.args[1] != 0:
        return None
    if _schema_name(node) == "aten::index":  # index(table, [rows, ...]): the first index reads rows
        if not isinstance(index, (list, tuple)) or not index:
            return None
        index = index[0]
    val = table.meta.get("val") if isinstance(table, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or not isinstance(val.shape[0], int):
        return None
    return val.shape[0], index


def _schema_name(node: torch.fx.Node) -> str:
    return getattr(getattr(node.target, "_schema", None), "name", "")


def check_ids(t: Any, rows: int, name: str, where: str) -> None:
    """Every value of ``t`` (an input indexing an embedding table) in ``[0, rows)``: one line naming the first
    id outside it, before compiled code reads past the table."""
    if t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        return
    flat = t.detach().reshape(-1)
    if t.numel() <= 256:  # a decode step or a prompt: one conversion to Python, no tensor ops
        values = flat.tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(v) for v in torch.aminmax(flat))
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise PrecastError(
            f"compiled program: input {name!r} ({where}): token id {bad} is outside the vocabulary, which has "
            f"{rows} ids (0..{rows - 1}: the rows of the embedding table it indexes); pass ids the model's "
            "tokenizer produces"
        )
