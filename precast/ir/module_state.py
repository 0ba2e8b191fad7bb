"""The tensors a module's forward writes, found in the module, and a call of the module on private copies of them.

A program exported from a module names the constants it writes by FQN: a registered buffer (``key_cache_0``), or
a tensor non-strict ``torch.export`` lifted as a constant (``lifted_tensor_3``: a plain tensor attribute, or a
tensor held by an object the module reaches, such as transformers' ``static_cache.layers[i].keys``). Export
keeps the module's own tensor objects in the program, so each one is found in the module by identity, at every
place that holds it (a KV cache is both a registered buffer and ``layers[i].keys``); a plain module attribute
is found by name as well.

The reference run of verification swaps a fresh clone into each of those places, runs the forward, and puts the
caller's tensors back (``finally``): the caller's state is never written, and never read by a forward whose
writes would land in it.

Input: a module and the written constants of the program exported from it. Output: a callable running the
module's forward on private copies (``private_call``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from precast.errors import PrecastError, name_list

# nn.Module's own bookkeeping (hooks, flags): never holds the model's tensors; _parameters, _buffers and
# _modules are walked as the names they register
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"_parameters", "_buffers", "_modules"}
_REGISTRIES = ("_parameters", "_buffers", "_modules")
# how many objects the walk visits at most: a module reaching a large object graph is searched this far
WALK_LIMIT = 200_000


@dataclass(frozen=True)
class Slot:
    """One place holding a tensor: ``container[key]`` (a dict: a module's ``_buffers`` / ``_parameters``, an
    object's ``__dict__``; or a list), reached from the module as ``path``; ``container`` is None when the
    place cannot be assigned (a tuple)."""

    container: dict | list | None
    key: Any
    path: str


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _walkable(obj: object) -> bool:
    """An object whose attributes may hold the model's tensors: a module or an instance of a plain class (not a
    type, function, Python module, a builtin value, or one of torch's own objects)."""
    if isinstance(obj, torch.nn.Module):
        return True
    if isinstance(obj, (type, torch.Tensor, torch.dtype, torch.device, str, bytes, int, float, bool)):
        return False
    cls = type(obj)
    # torch's own plain objects (an fx Graph and its nodes' meta, hook handles) hold no model state
    return (
        cls.__module__ not in ("builtins", "types")
        and not cls.__module__.startswith("torch.")
        and hasattr(obj, "__dict__")
    )


def tensor_slots(module: torch.nn.Module) -> dict[int, list[Slot]]:
    """id(tensor) -> every place holding it, reached from ``module`` through submodules, attributes, lists,
    tuples and dicts (each object visited once, at most ``WALK_LIMIT`` of them)."""
    return {k: slots for k, (_, slots) in reachable_tensors(module).items()}


def reachable_tensors(module: torch.nn.Module) -> dict[int, tuple[torch.Tensor, list[Slot]]]:
    """id(tensor) -> (the tensor, every place holding it): ``tensor_slots`` with the tensors themselves."""
    found: dict[int, tuple[torch.Tensor, list[Slot]]] = {}
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(module, "")]

    def visit(container: dict | list | None, key: Any, value: object, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), (value, []))[1].append(Slot(container, key, path))
        elif id(value) not in seen and (isinstance(value, (list, tuple, dict)) or _walkable(value)):
            stack.append((value, path))

    while stack and len(seen) < WALK_LIMIT:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            attrs = vars(obj)
            for registry in _REGISTRIES:
                table = attrs.get(registry) or {}
                for name, value in table.items():
                    if value is not None:
                        visit(table, name, value, _join(path, name))
            for name, value in attrs.items():
                if name not in _MODULE_INTERNALS and name not in _REGISTRIES:
                    visit(attrs, name, value, _join(path, name))
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                visit(obj, i, value, f"{path}[{i}]")
        elif isinstance(obj, tuple):
            for i, value in enumerate(obj):
                visit(None, i, value, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for key, value in obj.items():
                visit(obj, key, value, f"{path}[{key!r}]")
        else:
            attrs = vars(obj)
            for name, value in attrs.items():
                visit(attrs, name, value, _join(path, name))
    return found


def _swappable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor holding data, not a Parameter: a tensor subclass, a meta or fake tensor is left
    alone (export cannot write data it does not have)."""
    return type(tensor) is torch.Tensor and tensor.device.type != "meta" and tensor.layout == torch.strided


def _clone(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    return value.detach().clone()


@contextlib.contextmanager
def _swapped(
    places: list[tuple[torch.Tensor, list[Slot]]], clones: dict[int, torch.Tensor] | None = None
) -> Iterator[None]:
    """Each tensor replaced at every place holding it by one clone (``clones[id(tensor)]``, else a fresh one);
    the originals back on exit."""
    done: list[tuple[Slot, torch.Tensor]] = []
    try:
        for tensor, slots in places:
            copy = clones[id(tensor)] if clones is not None else _clone(tensor)
            for slot in slots:
                slot.container[slot.key] = copy  # type: ignore[index]
                done.append((slot, tensor))
        yield
    finally:
        for slot, tensor in reversed(done):
            slot.container[slot.key] = tensor  # type: ignore[index]


@contextlib.contextmanager
def private_tensors(module: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """While exporting ``module``: every tensor it reaches that is not a Parameter (registered buffers, plain
    tensor attributes, a cache held by a plain object) replaced by one private clone at every place holding it,
    the caller's back on exit. Yields id(clone) -> the caller's tensor.

    Non-strict ``torch.export`` writes the tensors it lifts as constants: measured on torch 2.13 with
    transformers' static cache, a static-shape export leaves ``cumulative_length`` at the traced length and
    the cache's keys with ``requires_grad=True``. Exporting the clones keeps the caller's module as it was, and
    the program holds precast's copies. Parameters stay shared (read-only weights; cloning them would double
    the model in memory); a tensor only in tuples, one sharing its storage with another (a view), and a tensor
    subclass, meta or fake tensor stay as they are."""
    reached = reachable_tensors(module)
    places, origins = [], {}
    # a tensor sharing its storage with another one (a view of a buffer) stays as it is: separate clones
    # would lose the aliasing the forward may rely on
    storages: dict[int, int] = {}
    for tensor, _ in reached.values():
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != "meta":
            key = tensor.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
    for tensor, where in reached.values():
        assignable = [s for s in where if s.container is not None]
        if _swappable(tensor) and assignable and storages[tensor.untyped_storage().data_ptr()] == 1:
            places.append((tensor, assignable))
    clones = {id(t): _clone(t).requires_grad_(t.requires_grad) for t, _ in places}
    with _swapped(places, clones):
        for tensor, _ in places:
            origins[id(clones[id(tensor)])] = tensor
        yield origins


def private_call(module: torch.nn.Module, written: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """``module``'s forward run on fresh private copies of the tensors it writes (``written``: the program's FQN
    -> the module's own tensor object, as export recorded it), found at every place that holds them; the
    caller's tensors are back in place when the call returns or raises. One PrecastError when a written tensor
    is not reachable from the module, or only through a tuple, which cannot be swapped."""
    if not written:
        return module
    slots = tensor_slots(module)
    named = dict(module.named_parameters(remove_duplicate=False)) | dict(
        module.named_buffers(remove_duplicate=False)
    )
    places: dict[int, tuple[torch.Tensor, list[Slot]]] = {}
    missing, fixed = [], []
    for fqn, tensor in sorted(written.items()):
        if id(tensor) not in slots and fqn in named:
            tensor = named[fqn]  # the program holds another object of the same name (a copy of the buffer)
        where = slots.get(id(tensor))
        if not where:
            missing.append(fqn)
        elif any(s.container is None for s in where):
            fixed.append(next(s.path for s in where if s.container is None))
        else:
            places[id(tensor)] = (tensor, where)
    what = type(module).__name__
    if missing:
        raise PrecastError(
            f"cannot verify against {what}: the program writes {name_list(missing)}, which precast cannot find in "
            "the module (not a parameter, buffer or tensor reachable from its attributes); pass the exported "
            "program instead, or verify=False"
        )
    if fixed:
        raise PrecastError(
            f"cannot verify against {what}: its forward writes the tensor at {fixed[0]}, which sits in a tuple "
            "precast cannot swap for a private copy; keep it in a list or attribute, pass the exported program "
            "instead, or verify=False"
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        with _swapped(list(places.values())):
            return module(*args, **kwargs)

    return call


def written_paths(module: torch.nn.Module, written: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The program's FQN -> the module attribute paths holding that tensor (``static_cache.layers[0].keys``),
    for the tensors found; for reports and tests."""
    slots = tensor_slots(module)
    return {fqn: sorted(s.path for s in slots.get(id(t), [])) for fqn, t in written.items()}
