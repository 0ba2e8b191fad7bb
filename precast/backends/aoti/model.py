"""``CompiledModel``: a loaded AOTInductor package, called like the program's module, with ``load_weights``.

The package's constants are outside it (``weights/sources.py``): the model owns the tensors the loader reads
(``user_managed``), so it holds each weight once; under max-autotune it holds only the packed copies the code
reads, and repacks them from new originals on ``load_weights`` (its phases: ``backends/aoti/swap.py``).

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
from torch.utils import _pytree as pytree

from precast.backends.aoti.package_cache import StoredConstant
from precast.backends.aoti.packed import recipe_sources
from precast.backends.aoti.swap import check_swap, plan_swap, recompute, stored_update, weights_source
from precast.runtime.owner import StateOwner, holds_state
from precast.runtime.signature import ProgramSignature
from precast.runtime.threads import running_at


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
        threads: int | None = None,
    ):
        self._runner = runner
        # the intra-op thread count the package was compiled for; each call runs at it (runtime/threads.py)
        self.threads = torch.get_num_threads() if threads is None else threads
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
        with running_at(self.threads):  # the caller's torch.get_num_threads() restored after the call
            if self._boxed_run is None:
                return self._runner(*args, **kwargs)
            tensors = list(flat) if self._all_tensors else [t for t in flat if isinstance(t, torch.Tensor)]
            return pytree.tree_unflatten(self._boxed_run(tensors), self._out_spec)

    def __repr__(self) -> str:
        how = "from cache" if self.from_cache else f"compiled in {self.compile_seconds:.1f}s"
        return f"CompiledModel({self.package_path}, {how}, {self.threads} thread(s))"

    @property
    def stateful(self) -> bool:
        """True when the compiled code writes constants (a KV cache) that carry from one call to the next."""
        return bool(self._state)

    @property
    def self_contained(self) -> bool:
        """True when the package holds its weights (compiled with them in the .so): ``precast.save`` can write it
        alone (``backends/aoti/saved.py``)."""
        return self._constants is None

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
            threads=self.threads,
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
        source = weights_source(state_dict, what)
        swap = plan_swap(what, source, self._stored, set(self._runner.get_constant_fqns()), self._folded)
        check_swap(swap, self._stored, self._packed_unmatched)  # on any problem, the model keeps its weights
        update = stored_update(swap)
        recompute(update, swap, self._packed, self._constants)
        self._load_update(update, swap.swappable)
        self._replaced = True
        return {"loaded": sorted(swap.names), "kept": swap.kept}

    def _load_update(self, update: dict[str, torch.Tensor], swappable: set[str]) -> None:
        """Hand ``update`` to the loader: by pointer, kept by the model (constants outside the package), or into
        the package's own buffers (constants in the .so)."""
        if self._constants is None:
            self._load_into_so(update, full=set(update) >= swappable)
            return
        for name in self._unread:  # only their packed copies are read: repacked above, not kept
            update.pop(name, None)
        self._runner.load_constants(update, check_full_update=False, user_managed=True)
        self._constants.update(update)  # the loader reads these pointers now; the old tensors may go

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
