"""Fold casts of constants: a cast whose input is a parameter, buffer or lifted constant, directly or through
view-like ops, is computed once at conversion and stored as a new constant of the target dtype.

The cast moves up to the constant (casting commutes exactly with views, which only move or repeat elements),
the view chain is kept on the low-precision constant, and each (constant, dtype) is cast once however many
times it is used. The fp32 constant is dropped when nothing reads it any more, and keeps its name for the new
one in that case, so a user still finds ``encoder.0.weight`` in the converted program (now bf16).

A constant the program writes (an in-place op on it or on a view of it, or a BUFFER_MUTATION output after
``run_decompositions()``) is never folded: its value changes from call to call, so its casts stay at run time
(``FoldResult.written`` names them). A finite value beyond float16's range is stored clamped to ±65504, never as inf
(``FoldResult.clamped``: name -> number of values clamped), as ModelOpt does; ``inf``, ``-inf`` and NaN stay as
they are (``cast_constant``).

Input: a Program after insert_casts. Output: ``FoldResult`` (folded, created, dropped, written, clamped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from precast.dtypes import absmax, dtype_name
from precast.ir.graph import (
    NOOP_CONVERSIONS,
    VIEW_OPS,
    cast_dtype,
    constant_bytes,
    is_cast,
    is_noop_conversion,
)
from precast.ir.mutation import AliasInfo, analyze
from precast.ir.program import ConstantSource, Program


@dataclass
class FoldResult:
    folded: int = 0  # cast nodes removed from the graph
    created: list[str] = field(default_factory=list)  # new constants (FQN)
    dropped: list[str] = field(default_factory=list)  # fp32 constants no longer needed
    bytes_before: dict[str, int] = field(default_factory=dict)
    bytes_after: dict[str, int] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)  # constants the program writes: casts kept at run time
    clamped: dict[str, int] = field(default_factory=dict)  # new constant -> values clamped to the low range


def cast_constant(
    value: torch.Tensor, dtype: torch.dtype, peak: Callable[[torch.Tensor], float] = absmax
) -> tuple[torch.Tensor, int]:
    """``value`` cast to ``dtype`` under one rule, whatever else the tensor holds: a finite value beyond the
    dtype's range is stored as its largest finite value of that sign (a finite weight never becomes inf); ``inf``,
    ``-inf`` and NaN are stored as they are (the low dtype holds them exactly, and the program computed with them).
    Returns the tensor and how many values were clamped (the finite values beyond the range, each stored as the
    largest finite value). ``peak``: how to read its absmax
    (``Program.absmax`` reuses what the rules already read)."""
    if (
        value.is_floating_point()
        and value.device.type != "meta"  # streamed weights: clamped when written (weights/streamed.py)
        and dtype.is_floating_point
        and torch.finfo(dtype).max < torch.finfo(value.dtype).max
        and value.numel()
    ):
        limit = torch.finfo(dtype).max
        # one reduction says whether any value can need the clamp (inf and NaN too: told apart below)
        if not peak(value) <= limit:
            over = torch.isfinite(value) & (value.abs() > limit)
            count = int(over.sum().item())
            if count:
                # only the finite values beyond the range: inf, -inf and NaN are stored as they are
                low = value.to(dtype)
                low[over] = value[over].clamp(-limit, limit).to(dtype)
                return low, count
    return value.to(dtype), 0


@dataclass
class _Cast:
    source: torch.Tensor  # held: its id is never reused while the entry lives
    version: int
    layout: tuple
    value: torch.Tensor
    clamped: int


class CastCache:
    """The constant casts of several lowerings of one program (the sensitivity estimator's, one tolerance
    search's), made once: ``cast(value, dtype)`` is ``cast_constant(value, dtype)``, computed again whenever
    ``value`` is another tensor object or was written since (its version counter, storage, shape and strides
    are part of the key). The cast tensors are shared by the programs lowered with the cache, which only read
    them (a constant the program writes is never folded); a conversion handed to the user never uses one."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], _Cast] = {}
        self.hits = 0

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        if value.is_inference():  # no version counter to tell a write by: never cached
            return cast_constant(value, dtype)
        layout = (
            value.data_ptr(),
            value.device,
            value.dtype,
            value.shape,
            value.stride(),
            value.storage_offset(),
        )
        entry = self._entries.get((id(value), dtype))
        if (
            entry is not None
            and entry.source is value
            and entry.version == value._version
            and entry.layout == layout
        ):
            self.hits += 1
            return entry.value, entry.clamped
        cast, clamped = cast_constant(value, dtype)
        self._entries[(id(value), dtype)] = _Cast(value, value._version, layout, cast, clamped)
        return cast, clamped


def _chain_to_constant(program: Program, node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """[constant placeholder, view1, ..., viewN=node] when node is a chain of views (and no-op conversions)
    over a constant."""
    chain = [node]
    while node.op == "call_function":
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        if node.target not in VIEW_OPS and not is_noop_conversion(node):
            return None
        if any(isinstance(a, torch.fx.Node) for a in node.args[1:]) or any(
            isinstance(v, torch.fx.Node) for v in node.kwargs.values()
        ):
            return None  # symbolic sizes from the graph: leave it alone
        node = node.args[0]
        chain.append(node)
    if node.op != "placeholder" or program.constant_target(node) is None:
        return None
    if not isinstance(program.constant_value(node), torch.Tensor):
        return None
    return list(reversed(chain))


@dataclass
class _Fold:
    """One fold pass's state: the program, the cast cache, the result so far, and what was made per
    (constant, dtype) and per (view, dtype), so each is made once."""

    program: Program
    casts: CastCache | None
    result: FoldResult
    # original placeholder -> FQN, captured before renames
    original_name: dict[torch.fx.Node, str | None]
    cast_constants: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = field(default_factory=dict)
    rebuilt: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)


def fold_constant_casts(program: Program, casts: CastCache | None = None) -> FoldResult:
    """Fold the casts of read-only constants (the module docstring); ``casts``: a cache of constant casts
    shared with other lowerings of the same program (``CastCache``), else each is computed here."""
    result = FoldResult(bytes_before=constant_bytes(program))
    graph = program.graph
    original_name = {n: program.constant_target(n) for n in graph.nodes if n.op == "placeholder"}
    fold = _Fold(program, casts, result, original_name)
    # export keeps a placeholder per name of a tied parameter even when only one is read: not ours to drop
    unused_from_start = {n for n in graph.nodes if n.op == "placeholder" and not n.users}
    alias = analyze(graph, program.input_spec, program.output_specs)
    for node in list(graph.nodes):
        if is_cast(node):
            _fold_cast(fold, node, alias)
    graph.eliminate_dead_code()
    result.dropped = program.remove_unused_constants(keep=unused_from_start)
    _take_original_names(fold)
    result.created = [program.constant_target(n) for n in fold.cast_constants.values() if n.users]
    result.written = sorted(fold.written)
    result.bytes_after = constant_bytes(program)
    graph.lint()
    return result


def _fold_cast(fold: _Fold, node: torch.fx.Node, alias: AliasInfo) -> None:
    """Replace one cast of a read-only constant (through views) by the cast constant, its views replayed."""
    chain = _chain_to_constant(fold.program, node.args[0])
    if chain is None:
        return
    const, views = chain[0], chain[1:]
    if alias.written(const):
        fold.written.add(fold.original_name[const])
        return
    dtype = cast_dtype(node)
    value = fold.program.constant_value(const)
    new_base = const if value.dtype == dtype else _cast_once(fold, const, value, dtype)
    current = _replay_views(fold, node, new_base, views, dtype)
    node.replace_all_uses_with(current)
    fold.program.graph.erase_node(node)
    fold.result.folded += 1


def _cast_once(fold: _Fold, const: torch.fx.Node, value: torch.Tensor, dtype: torch.dtype) -> torch.fx.Node:
    """The constant ``const`` cast to ``dtype``, added to the program (with its source) the first time it is
    asked for."""
    program, key = fold.program, (const, dtype)
    if key not in fold.cast_constants:
        cast_value, clamped = (
            fold.casts.cast(value, dtype)
            if fold.casts is not None
            else cast_constant(value, dtype, program.absmax)
        )
        new = program.add_constant_like(const, cast_value, f"_{dtype_name(dtype)}")
        if clamped:
            fold.result.clamped[program.constant_target(new)] = clamped
        source_of = program.original_of(program.constant_target(const))
        program.sources[program.constant_target(new)] = ConstantSource(
            stored=program.constant_target(new),
            original=source_of.original if source_of else fold.original_name[const],
            original_dtype=source_of.original_dtype if source_of else value.dtype,
            dtype=dtype,
        )
        fold.cast_constants[key] = new
    return fold.cast_constants[key]


def _replay_views(
    fold: _Fold, node: torch.fx.Node, base: torch.fx.Node, views: list[torch.fx.Node], dtype: torch.dtype
) -> torch.fx.Node:
    """The view chain replayed on the cast constant before ``node`` (shared per (view node, dtype))."""
    graph, current = fold.program.graph, base
    for view in views:
        if view.target in NOOP_CONVERSIONS:
            continue  # an identity here (see NOOP_CONVERSIONS)
        key = (view, dtype)
        if key not in fold.rebuilt:
            with graph.inserting_before(node):
                fold.rebuilt[key] = graph.call_function(
                    view.target, (current, *view.args[1:]), dict(view.kwargs)
                )
            fold.rebuilt[key].meta.update({k: v for k, v in view.meta.items() if k != "val"})
            val = view.meta.get("val")
            if isinstance(val, torch.Tensor):
                fold.rebuilt[key].meta["val"] = val.to(dtype)
        current = fold.rebuilt[key]
    return current


def _take_original_names(fold: _Fold) -> None:
    """A cast constant whose fp32 original is gone takes the original's name: names stay recognizable (when
    it is the only cast copy still read; otherwise each keeps its own)."""
    program, result, original_name = fold.program, fold.result, fold.original_name
    read_casts: dict[torch.fx.Node, int] = {}  # constant -> how many of its cast copies are still read
    for (const, _dtype), new in fold.cast_constants.items():
        read_casts[const] = read_casts.get(const, 0) + bool(new.users)
    dropped = set(result.dropped)
    for (const, _dtype), new in fold.cast_constants.items():
        if original_name[const] in dropped and new.users:
            src = program.sources.pop(program.constant_target(new))
            if read_casts[const] == 1:
                if src.stored in result.clamped:
                    result.clamped[original_name[const]] = result.clamped.pop(src.stored)
                program.rename_constant(new, original_name[const])
                program.sources[original_name[const]] = ConstantSource(
                    original_name[const], src.original, src.original_dtype, src.dtype
                )
            else:
                program.sources[src.stored] = src
