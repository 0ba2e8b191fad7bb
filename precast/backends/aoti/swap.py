"""``CompiledModel.load_weights``' phases (``backends/aoti/model.py``): the given weights checked against the
stored constants, cast (or quantized) to what the compiled code reads, and the constants computed from them
(the GEMM template's packed copies, freezing's folded constants) recomputed as the compile computed them.

Input: the original weights by name (a mapping, or a ``.safetensors`` file or shards) and what the model stores.
Output: the update the loader takes (stored name -> new tensor), or one PrecastError naming every problem.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from precast.backends.aoti.int_rewrite import derived_copy, original_shape
from precast.backends.aoti.package_cache import StoredConstant
from precast.backends.aoti.packed import gemm_pack, recipe_sources, replay
from precast.errors import NAMES_SHOWN, PrecastError, name_list
from precast.ir.fake import has_data
from precast.passes.fold import cast_constant
from precast.weights.sources import SafetensorsSource

Source = Mapping[str, torch.Tensor] | SafetensorsSource


@dataclass(frozen=True)
class Swap:
    """One ``load_weights`` call: the weights given and what the model makes of them."""

    what: str  # "load_weights(<package>)": the errors' prefix
    source: Source
    by_original: dict[str, list[StoredConstant]]  # original name -> the stored constants made from it
    swappable: set[str]  # the constants the package lets the loader swap
    live: dict[str, Any]  # freezing's folded constants the package reads -> their recipes
    recomputed: set[str]  # the stored constants those are computed from
    kept: list[str]  # originals not given that keep their value (non-persistent buffers, lifted constants)

    @property
    def names(self) -> set[str]:
        """The originals swapped."""
        return {n for n in self.by_original if n not in self.kept}


def plan_swap(
    what: str, source: Source, stored: dict[str, StoredConstant], swappable: set[str], folded: dict[str, Any]
) -> Swap:
    """What swapping ``source`` in means for a model storing ``stored`` whose package swaps ``swappable``."""
    by_original: dict[str, list[StoredConstant]] = {}
    for st in stored.values():
        by_original.setdefault(st.source.original, []).append(st)
    source = aligned_names(source, set(by_original))  # a tied model's two names, the recipe's prefix
    live = {n: r for n, r in folded.items() if n in swappable}
    recomputed = set().union(*(recipe_sources(r) for r in live.values())) if live else set()
    kept = sorted(
        n for n, sts in by_original.items() if n not in source and not any(st.persistent for st in sts)
    )
    return Swap(what, source, by_original, swappable, live, recomputed, kept)


def aligned_names(source: Source, expected: set[str]) -> Source:
    """``source`` keyed by the program's original names where the only differences are (a) a tied model's second
    name of one shared table (``lm_head.weight`` beside ``model.embed_tokens.weight``: the same tensor, or an equal
    one, under both names; the name the program reads is kept) and (b) one prefix a wrapper adds or removes (the
    export-llm recipe's ``model.``: the checkpoint's own names), taken only when exactly one prefix maps every
    other name onto a distinct original the source lacks. Anything else is left for ``check_swap`` to refuse."""
    given = list(source)
    unexpected = [n for n in given if n not in expected]
    if not unexpected:
        return source
    missing = expected - set(given)
    found = []
    # a prefix only when it is the one difference: no given name is an original as it is
    renames = _prefix_renames(unexpected, missing) if len(unexpected) == len(given) else []
    for rename in renames + [{}]:
        named = {n: rename.get(n, n) for n in given}
        if len(set(named.values())) < len(named):
            continue
        if all(v in expected or _tied_to(source, n, named, expected) for n, v in named.items()):
            found.append(named)
    if len(found) == 1:  # every name an original, or the second name of a tied one (dropped)
        named = {n: v for n, v in found[0].items() if v in expected}
    else:  # none, or two prefixes that fit (ambiguous): refused below, in the program's names where one prefix
        # explains most of them (the rest stay unexpected, so nothing loads), the tied second names set aside
        most = [r for r in renames if sum(v in expected for v in r.values()) * 2 > len(given)]
        same = {g: (most[0].get(g, g) if len(most) == 1 else g) for g in given}
        named = {n: v for n, v in same.items() if v in expected or not _tied_to(source, n, same, expected)}
        if named == {g: g for g in given}:
            return source
    if isinstance(source, SafetensorsSource):
        return _RenamedFiles(source, {v: n for n, v in named.items()})
    return {v: source[n] for n, v in named.items()}


def _prefix_renames(unexpected: list[str], missing: set[str]) -> list[dict[str, str]]:
    """Each prefix added to (or removed from) the first unexpected name that makes it a missing original, as a
    renaming of every unexpected name it applies to."""
    first, renames = unexpected[0], []
    for m in sorted(missing):
        if m.endswith("." + first):
            p = m[: -len(first)]
            renames.append({n: p + n for n in unexpected})
        if first.endswith("." + m):
            p = first[: -len(m)]
            renames.append({n: n[len(p) :] for n in unexpected if n.startswith(p)})
    return renames


def _tied_to(source: Source, name: str, named: dict[str, str], expected: set[str]) -> bool:
    """Whether ``name`` is a tied model's second name: its tensor is (or equals) one given under a name that maps
    onto an original the program reads (files: compared after their headers agree, one pair read at a time)."""
    meta = source_meta(source, name)
    if meta is None:
        return False
    for other, v in named.items():
        if other == name or v not in expected or source_meta(source, other) != meta:
            continue
        value, twin = source[name], source[other]
        if no_data(value) or no_data(twin) or twin.device != value.device:
            continue
        same = twin.data_ptr() == value.data_ptr() and twin.stride() == value.stride()
        if same or torch.equal(twin, value):
            return True
    return False


class _RenamedFiles(SafetensorsSource):
    """Safetensors files read under the program's names (``aligned_names``): ``old`` maps each to the files'."""

    def __init__(self, files: SafetensorsSource, old: dict[str, str]):
        self.__dict__.update(files.__dict__)
        self.prefix = ""
        self._old = old
        self.where = {new: files.where[o] for new, o in old.items()}
        self.headers = {new: files.headers[o] for new, o in old.items()}

    def _key(self, name: str) -> str:
        return self._old[name]


def check_swap(swap: Swap, stored: dict[str, StoredConstant], unmatched: list[str]) -> None:
    """One PrecastError naming every problem (the model keeps its weights): names missing or unexpected, tensors
    without data, shapes and dtypes, weights the compiled code folded or packed where precast cannot reach."""
    source, by_original = swap.source, swap.by_original
    missing = sorted(n for n in by_original if n not in source and n not in swap.kept)
    unexpected = sorted(n for n in source if n not in by_original)
    problems = _tensor_problems(swap)
    folded = sorted(
        st.source.stored
        for st in stored.values()
        if st.read and st.source.stored not in swap.swappable and st.source.stored not in swap.recomputed
    )
    if unexpected:
        problems.insert(0, f"unexpected {len(unexpected)}: {name_list(unexpected)}")
    if missing:
        problems.insert(0, f"missing {len(missing)}: {name_list(missing)}")
    if folded:
        problems.append(
            f"compiled code folded {name_list(folded)} into itself (freezing, or "
            "always_keep_tensor_constants=False); recompile without them to swap those"
        )
    if unmatched:
        problems.append(
            f"compiled code packed weights into {name_list(sorted(unmatched))} in a layout "
            "precast cannot reproduce; recompile with mode='default' to swap them"
        )
    if problems:
        given = set(source)
        another = bool(by_original) and len(given & set(by_original)) * 2 < min(len(by_original), len(given))
        hint = "these weights belong to another model (most names differ); pass" if another else "pass"
        raise PrecastError(
            f"{swap.what}: {hint} the original fp32 state_dict of the model the program was converted from "
            f"(the compiled model still serves its previous weights); {len(problems)} problem(s): "
            f"{'; '.join(problems[:NAMES_SHOWN])}{' ...' if len(problems) > NAMES_SHOWN else ''}"
        )


def _tensor_problems(swap: Swap) -> list[str]:
    """Each given original against its stored constants: a tensor holding data the loader can read (those
    that do not, in one line first), its shape and its dtype."""
    source = swap.source
    problems: list[str] = []
    nodata: list[str] = []  # tensors without data the loader could read (fake, meta, ...)
    nodata_why: dict[str, str] = {}
    for name in sorted(set(swap.by_original) & set(source)):
        meta = source_meta(source, name)
        want = swap.by_original[name][0]
        if meta is None:
            problems.append(f"{name} is a {type(source[name]).__name__}, not a tensor")
            continue
        if not isinstance(source, SafetensorsSource):
            why = no_data(source[name])
            if why:
                nodata.append(name)
                nodata_why.setdefault(why, name)
                continue
        shape = original_shape(swap.by_original[name])
        if shape is not None and meta[0] != shape:
            problems.append(f"{name} has shape {meta[0]}, expected {shape}")
        if meta[1] != want.source.original_dtype:
            problems.append(f"{name} has dtype {meta[1]}, expected {want.source.original_dtype}")
    if nodata:
        kinds = ", ".join(f"{why} ({name})" for why, name in nodata_why.items())
        problems.insert(
            0,
            f"{len(nodata)} tensor(s) hold no data the compiled code can read: {kinds}; give real CPU/device "
            f"tensors (e.g. the module's state_dict after loading its weights): {name_list(nodata)}",
        )
    return problems


def stored_update(swap: Swap) -> dict[str, torch.Tensor]:
    """The new value of each stored constant the code reads, computed from its original as the conversion did
    (read one original at a time from files)."""
    source = swap.source
    names = swap.names
    pairs = (
        source.read_many(names) if isinstance(source, SafetensorsSource) else ((n, source[n]) for n in names)
    )
    update: dict[str, torch.Tensor] = {}
    for name, value in pairs:
        for st in swap.by_original[name]:
            if not st.read:
                continue  # never read by the graph (e.g. num_batches_tracked): checked above, nothing to swap
            # a fresh contiguous copy in the stored dtype: cast_constant, the rounding and fp16 clamping
            # fold_constant_casts and the streamed writer apply; a quantized part (int8 / int4 weights:
            # ``derive``) computed from the original as the conversion computed it
            if getattr(st.source, "derive", None):
                update[st.source.stored] = derived_copy(value, st)
            else:
                update[st.source.stored] = stored_copy(value, st.device, st.source.dtype)
    return update


def recompute(
    update: dict[str, torch.Tensor],
    swap: Swap,
    packed: dict[str, Any],
    held: dict[str, torch.Tensor] | None,
) -> None:
    """Add to ``update`` the constants the compile computed from the weights, computed from the new ones: the
    GEMM template's packed copies (``packed``: their plans) and freezing's folded constants (a recipe's other
    weights from ``held``, the model's); drop the weights read only through their folded copies."""
    for name, plan in packed.items():  # the GEMM template's copies, packed as the compile packed them
        if plan["source"] in update:
            update[name] = gemm_pack(
                update[plan["source"]],
                transposed=plan["transposed"],
                block_n=plan["block_n"],
                vnni=plan["vnni"],
            )
    for (
        name,
        recipe,
    ) in swap.live.items():  # freezing's folded constants, recomputed as the compile folded them
        sources = recipe_sources(recipe)
        if sources & set(update):
            others = {n: (held or {}).get(n) for n in sources - set(update)}
            if any(v is None for v in others.values()):
                raise PrecastError(
                    f"{swap.what}: {name} is computed from {sorted(sources)}; pass all of them together"
                )
            update[name] = replay(recipe, {**others, **{n: update[n] for n in sources & set(update)}})
    for name in swap.recomputed - swap.swappable:  # read only through their folded copies: not the package's
        update.pop(name, None)


def weights_source(state_dict: Any, what: str) -> Source:
    """``load_weights``' argument as a source of tensors by name; anything else is one line saying what to pass."""
    if isinstance(state_dict, (str, os.PathLike)):
        return SafetensorsSource(state_dict, what)
    if isinstance(state_dict, torch.nn.Module):
        raise PrecastError(f"{what}: got a {type(state_dict).__name__} module; pass its state_dict()")
    if not isinstance(state_dict, Mapping):
        raise PrecastError(
            f"{what}: got {type(state_dict).__name__}; pass the original model's state_dict (a mapping of names "
            "to tensors), a .safetensors file or a directory of shards"
        )
    odd = [k for k in state_dict if not isinstance(k, str)]
    if odd:
        raise PrecastError(
            f"{what}: the state_dict's keys must be names (str); got {odd[0]!r} ({len(odd)} such)"
        )
    return state_dict


def no_data(value: torch.Tensor) -> str | None:
    """Why ``value`` holds no data the loader can read (its pointer would be used as it is), or None."""
    if isinstance(value, FakeTensor):
        return "a FakeTensor"
    if not has_data(value):
        return f"a {value.device.type} tensor"
    if value.layout != torch.strided or value.is_nested:
        return f"a {str(value.layout).removeprefix('torch.')} tensor"
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(value).__name__} (a tensor subclass)"
    return None


def stored_copy(value: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor on ``device`` in ``dtype``, never sharing memory with ``value``."""
    on = value.detach()
    if on.dtype == dtype or on.device != torch.device(device):
        on = on.to(device=device, copy=True, memory_format=torch.contiguous_format)
    if on.dtype == dtype:
        return on
    return cast_constant(on, dtype)[0].contiguous()  # another dtype: a new tensor


def source_meta(source: Source, name: str) -> tuple[tuple[int, ...], Any] | None:
    """``name``'s shape and dtype in ``source``; None when it is not a tensor."""
    if isinstance(source, SafetensorsSource):
        return source.meta(name)
    value = source[name]
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
