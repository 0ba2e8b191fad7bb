"""``CompiledModel``: a loaded AOTInductor package, called like the program's module, with ``load_weights``.

The package's constants are outside it (``weights/sources.py``): the model owns the tensors the loader reads
(``user_managed``), so it holds each weight once; under max-autotune it holds only the packed copies the code
reads, and repacks them from new originals on ``load_weights``.

Input: a loader, the stored constants' sources, the packed-weights plan, the constants' values. Output: outputs of
the compiled code; ``load_weights`` by original names (a state_dict, a .safetensors file or a directory of shards).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from precast.backends.aoti.int_rewrite import derived_copy, original_shape
from precast.backends.aoti.package_cache import StoredConstant
from precast.backends.aoti.packed import gemm_pack, recipe_sources, replay
from precast.errors import NAMES_SHOWN, PrecastError, name_list
from precast.passes.fold import cast_constant
from precast.runtime.owner import StateOwner, holds_state
from precast.runtime.signature import ProgramSignature
from precast.weights.files import has_values
from precast.weights.sources import SafetensorsSource


class CompiledModel:
    """A loaded AOTInductor package. Call it like the program's module; swap weights with ``load_weights``."""

    def __init__(
        self,
        runner: Any,
        package_path: Path,
        key: str,
        stored: dict[str, StoredConstant],
        signature: ProgramSignature,
        *,
        from_cache: bool,
        compile_seconds: float,
        load_seconds: float,
        packed: Mapping[str, Any] | None = None,
        constants: dict[str, torch.Tensor] | None = None,
        unread: tuple[str, ...] = (),
        state: Mapping[str, Initial] | None = None,
        form: Mapping[str, Any] | None = None,
    ):
        self._runner = runner
        self._owner = (
            StateOwner()
        )  # precast.generate holds it; every call/reset/load_weights waits and bumps it
        # the constants the code writes (a KV cache) -> their initial values, shared read-only by every model of
        # the same compile: each model holds its own written tensors, reset() restores these
        self._state = dict(state or {})
        # packed constant -> {"source": stored name, "transposed", "block_n", "vnni"}; "unmatched": [names]
        self._packed = dict((packed or {}).get("plans", {}))
        self._packed_unmatched = list((packed or {}).get("unmatched", []))
        # constant freezing folded (oneDNN's blocked weights) -> its recipe over stored names (packed.replay)
        self._folded = dict((packed or {}).get("folded", {}))
        # the form compiled in and why (backends/aoti/forms.py): {"name", "why"}
        self.form = dict(form or {"name": "default", "why": ""})
        # the constants the loader reads through their pointers (package built without them); None: in the .so
        self._constants = constants
        self._unread = frozenset(unread)  # constants the code never reads: not loaded, not kept
        # opaque constants (oneDNN blocked weights) handed to a package holding its constants in the .so: the
        # loader reads them through their pointers (a copying load_constants would read an opaque tensor's
        # handle as dense data), so the model keeps them alive
        self._held: dict[str, torch.Tensor] = {}
        self._replaced = False  # load_weights ran: precast.compile no longer hands this model out
        if constants is not None:
            runner.load_constants(constants, check_full_update=False, user_managed=True)
        self.package_path = Path(package_path)
        self.key = key
        self._stored = stored
        self.signature = signature
        # call the loader directly: AOTICompiledModel.__call__ re-parses its call spec on every call
        loader = getattr(runner, "loader", None)
        self._boxed_run = getattr(loader, "boxed_run", None)
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1]) if self._boxed_run else None
        self._all_tensors = all(s.kind == "tensor" for s in signature.inputs)
        self.from_cache = from_cache
        self.compile_seconds = compile_seconds
        self.load_seconds = load_seconds

    @holds_state  # waits while a generation holds the model in another thread (runtime/owner.py)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.signature.check(
            args, kwargs
        )  # a one-line PrecastError before native code sees a bad input
        if self._boxed_run is None:
            return self._runner(*args, **kwargs)
        tensors = list(flat) if self._all_tensors else [t for t in flat if isinstance(t, torch.Tensor)]
        return pytree.tree_unflatten(self._boxed_run(tensors), self._out_spec)

    def __repr__(self) -> str:
        how = "from cache" if self.from_cache else f"compiled in {self.compile_seconds:.1f}s"
        return f"CompiledModel({self.package_path}, {how})"

    @property
    def stateful(self) -> bool:
        """True when the compiled code writes constants (a KV cache) that carry from one call to the next."""
        return bool(self._state)

    @holds_state
    def reset(self) -> None:
        """Restore every constant the code writes (a KV cache) to the program's initial value: a new sequence.
        Read-only weights are not touched; a model without state has nothing to restore."""
        if not self._state:
            return
        if self._constants is not None:  # the loader reads these tensors: restore them in place
            for name, initial in self._state.items():
                if name in self._constants:  # (a written constant the code never reads is not held)
                    initial.restore(self._constants[name])
            return
        # the written constants live in the package's own buffers (weights in the .so): hand new copies over
        self._runner.load_constants({n: v.new() for n, v in self._state.items()}, check_full_update=False)

    def _sibling(self, runner: Any, load_seconds: float) -> CompiledModel:
        """Another model of the same compile, on ``runner`` (the package loaded again): the read-only weights
        shared with this one, its own copy of each written constant at its initial value."""
        constants = None
        if self._constants is not None:
            constants = {
                n: (self._state[n].new() if n in self._state else t) for n, t in self._constants.items()
            }
        other = CompiledModel(
            runner,
            self.package_path,
            self.key,
            self._stored,
            self.signature,
            from_cache=True,
            compile_seconds=0.0,
            load_seconds=load_seconds,
            packed={"plans": self._packed, "unmatched": self._packed_unmatched, "folded": self._folded},
            constants=constants,
            unread=tuple(self._unread),
            state=self._state,
            form=self.form,
        )
        return (
            other  # weights in the .so: the package loaded again holds the initial values it was built with
        )

    def constant_fqns(self) -> list[str]:
        """Stored names (possibly low precision) of the program's constants the compiled code reads, directly or
        through a copy precast makes from them (the GEMM template's packed copies, freezing's oneDNN blocked
        weights)."""
        names: set[str] = set()
        for n in self._runner.get_constant_fqns():
            if n in self._unread:
                continue
            if n in self._packed:
                names.add(self._packed[n]["source"])
            elif n in self._folded:
                names |= recipe_sources(self._folded[n])
            else:
                names.add(n)
        return sorted(names)

    @holds_state
    def load_weights(
        self, state_dict: Mapping[str, torch.Tensor] | str | os.PathLike
    ) -> dict[str, list[str]]:
        """Replace the weights by the model's ORIGINAL state_dict (fp32, original names), without recompiling.

        ``state_dict``: a mapping of tensors, or the path of a ``.safetensors`` file or of a directory of
        shards with a transformers-style ``model.safetensors.index.json`` (read one tensor at a time: the peak
        is the new weights in their stored dtypes plus one original). Each tensor is cast to the dtype(s) the
        converted program stores it in. Names, shapes and dtypes are checked first; on any mismatch a
        PrecastError lists them all and the model keeps its old weights. Non-persistent buffers and lifted
        constants (``position_ids``, ``inv_freq``: not in ``state_dict()``) are swapped when given by name and
        otherwise keep the value the program baked. Returns ``{"loaded": [...], "kept": [...]}``: the original
        names swapped, and those left as they were.
        """
        what = f"load_weights({self.package_path.name})"
        source = _weights_source(state_dict, what)
        by_original: dict[str, list[StoredConstant]] = {}
        for st in self._stored.values():
            by_original.setdefault(st.source.original, []).append(st)
        swappable = set(self._runner.get_constant_fqns())
        live = {n: r for n, r in self._folded.items() if n in swappable}
        recomputed = set().union(*(recipe_sources(r) for r in live.values())) if live else set()
        kept = sorted(
            n for n, sts in by_original.items() if n not in source and not any(st.persistent for st in sts)
        )
        missing = sorted(n for n in by_original if n not in source and n not in kept)
        unexpected = sorted(n for n in source if n not in by_original)
        problems: list[str] = []
        nodata: list[str] = []  # tensors without data the loader could read (fake, meta, ...)
        nodata_why: dict[str, str] = {}
        for name in sorted(set(by_original) & set(source)):
            meta = _meta(source, name)
            want = by_original[name][0]
            if meta is None:
                problems.append(f"{name} is a {type(source[name]).__name__}, not a tensor")
                continue
            if not isinstance(source, SafetensorsSource):
                why = _no_data(source[name])
                if why:
                    nodata.append(name)
                    nodata_why.setdefault(why, name)
                    continue
            shape = original_shape(by_original[name])
            if shape is not None and meta[0] != shape:
                problems.append(f"{name} has shape {meta[0]}, expected {shape}")
            if meta[1] != want.source.original_dtype:
                problems.append(f"{name} has dtype {meta[1]}, expected {want.source.original_dtype}")
        folded = sorted(
            st.source.stored
            for st in self._stored.values()
            if st.read and st.source.stored not in swappable and st.source.stored not in recomputed
        )
        if nodata:
            kinds = ", ".join(f"{why} ({name})" for why, name in nodata_why.items())
            problems.insert(
                0,
                f"{len(nodata)} tensor(s) hold no data the compiled code can read: {kinds}; give real CPU/device "
                f"tensors (e.g. the module's state_dict after loading its weights): {name_list(nodata)}",
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
        if self._packed_unmatched:
            problems.append(
                f"compiled code packed weights into {name_list(sorted(self._packed_unmatched))} in a layout "
                "precast cannot reproduce; recompile with mode='default' to swap them"
            )
        if problems:
            given = set(source)
            another = bool(by_original) and len(given & set(by_original)) * 2 < min(
                len(by_original), len(given)
            )
            hint = "these weights belong to another model (most names differ); pass" if another else "pass"
            raise PrecastError(
                f"{what}: {hint} the original fp32 state_dict of the model the program was converted from "
                f"(the compiled model still serves its previous weights); {len(problems)} problem(s): "
                f"{'; '.join(problems[:NAMES_SHOWN])}{' ...' if len(problems) > NAMES_SHOWN else ''}"
            )
        names = {n for n in by_original if n not in kept}
        pairs = (
            source.read_many(names)
            if isinstance(source, SafetensorsSource)
            else ((n, source[n]) for n in names)
        )
        update: dict[str, torch.Tensor] = {}
        for name, value in pairs:
            for st in by_original[name]:
                if not st.read:
                    continue  # never read by the graph (e.g. num_batches_tracked): checked above, nothing to swap
                # a fresh contiguous copy in the stored dtype: cast_constant, the rounding and fp16 clamping
                # fold_constant_casts and the streamed writer apply; a quantized part (int8 / int4 weights:
                # ``derive``) computed from the original as the conversion computed it
                if getattr(st.source, "derive", None):
                    update[st.source.stored] = derived_copy(value, st)
                else:
                    update[st.source.stored] = _stored_copy(value, st.device, st.source.dtype)
        for (
            name,
            plan,
        ) in self._packed.items():  # the GEMM template's copies, packed as the compile packed them
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
        ) in live.items():  # freezing's folded constants, recomputed as the compile folded them
            sources = recipe_sources(recipe)
            if sources & set(update):
                held = {n: (self._constants or {}).get(n) for n in sources - set(update)}
                if any(v is None for v in held.values()):
                    raise PrecastError(
                        f"{what}: {name} is computed from {sorted(sources)}; pass all of them together"
                    )
                update[name] = replay(recipe, {**held, **{n: update[n] for n in sources & set(update)}})
        for name in recomputed - swappable:  # read only through their folded copies: not the package's
            update.pop(name, None)
        if self._constants is None:
            self._load_into_so(update, full=set(update) >= swappable)
        else:
            for name in self._unread:  # only their packed copies are read: repacked above, not kept
                update.pop(name, None)
            self._runner.load_constants(update, check_full_update=False, user_managed=True)
            self._constants.update(update)  # the loader reads these pointers now; the old tensors may go
        self._replaced = True
        return {"loaded": sorted(names), "kept": kept}

    @property
    def weights_replaced(self) -> bool:
        """True once ``load_weights`` ran: the model may no longer serve the program's own weights."""
        return self._replaced

    def _load_into_so(self, update: dict[str, torch.Tensor], full: bool) -> None:
        """Swap ``update`` into a package that holds its constants in the .so: dense tensors copied by the loader,
        opaque ones (oneDNN's blocked weights, recomputed by freezing's recipes) handed over by pointer and kept."""
        opaque = {n: t for n, t in update.items() if t.is_mkldnn}
        dense = {n: t for n, t in update.items() if n not in opaque}
        self._runner.load_constants(dense, check_full_update=full and not opaque)
        if opaque:
            self._runner.load_constants(opaque, check_full_update=False, user_managed=True)
            self._held.update(opaque)


def _weights_source(state_dict: Any, what: str) -> Mapping[str, torch.Tensor] | SafetensorsSource:
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


def _no_data(value: torch.Tensor) -> str | None:
    """Why ``value`` holds no data the loader can read (its pointer would be used as it is), or None."""
    if isinstance(value, FakeTensor):
        return "a FakeTensor"
    if not has_values(value):
        return f"a {value.device.type} tensor"
    if value.layout != torch.strided or value.is_nested:
        return f"a {str(value.layout).removeprefix('torch.')} tensor"
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(value).__name__} (a tensor subclass)"
    return None


def _stored_copy(value: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor on ``device`` in ``dtype``, never sharing memory with ``value``."""
    on = value.detach()
    if on.dtype == dtype or on.device != torch.device(device):
        on = on.to(device=device, copy=True, memory_format=torch.contiguous_format)
    if on.dtype == dtype:
        return on
    return cast_constant(on, dtype)[0].contiguous()  # another dtype: a new tensor


@dataclass(frozen=True)
class Initial:
    """A written constant's initial value: ``value`` None for all zeros (the usual empty KV cache: nothing held)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    value: torch.Tensor | None

    def new(self) -> torch.Tensor:
        if self.value is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.value.clone()

    def restore(self, held: torch.Tensor) -> None:
        with torch.no_grad():
            held.zero_() if self.value is None else held.copy_(self.value)


def initial_state(values: Mapping[str, torch.Tensor]) -> dict[str, Initial]:
    """The initial values of the constants a program writes, as ``CompiledModel`` keeps them (a private copy,
    or nothing for an all-zero tensor)."""
    out = {}
    for name, value in values.items():
        v = value.detach()
        zero = v.numel() > 0 and not bool(v.any())
        out[name] = Initial(tuple(v.shape), v.dtype, v.device, None if zero else v.clone())
    return out


def _meta(source: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], Any] | None:
    if isinstance(source, SafetensorsSource):
        return source.meta(name)
    value = source[name]
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
