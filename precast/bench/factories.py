"""The models ``precast bench`` runs: model specs to ``(model, inputs)``, the autocast switch, the fp32 reference.

Input: ``--model`` specs. ``module:factory`` (as ``precast convert`` takes) names a callable returning
``(model, example_inputs)``; it is called with ``batch=N`` when it has a ``batch`` parameter, else with no
arguments and the inputs' dim 0 resized to N. A short name (``mlp``) is ``precast.bench.models:mlp``, the
benchmark models (the default: ``mlp``).

Output: ``build(spec, batch)`` -> (model, inputs); ``regions(model, ...)`` and ``fp32_reference(...)``.

Why not patch ``torch.autocast``: the fp32 reference (``eager_fp32``) is the model with its autocast regions
off, and ``--device``/``--dtype`` retarget its regions. Replacing ``torch.autocast`` process-wide for that would
also change every other region in the process (the library's own, another thread's) and the code under test.
Instead a model opts in with the *autocast switch*: each module that opens a region has the attributes
``autocast`` (bool; False runs its body without the region), ``device_type`` and ``dtype``, which its
``torch.autocast(...)`` call reads (``precast.bench.models.Switchable``, ``precast.examples.SeedSubModule``).
``regions()`` sets them on that model instance only. A model without the switch keeps its regions as written
(``--device``/``--dtype`` cannot retarget them), and its fp32 reference is its exported program with the regions
inlined: ``torch.export`` records each region as a higher-order op around plain ops, so inlined they run in the
dtypes the program itself gives them (fp32 unless the code casts) -- the same semantics, run as a graph module.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from precast.bench.measure import resize_batch
from precast.errors import PrecastError, first_line

SHORT_MODULE = "precast.bench.models"
DEMO_SPEC = "precast.examples:seed_model"


def _import(name: str) -> Any:
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like python -m: the current directory (a source checkout) is importable
    return importlib.import_module(name)


def short_names() -> tuple[str, ...]:
    """The short model names (``precast.bench.models.NAMES``)."""
    from precast.bench.models import NAMES

    return NAMES


def default_models() -> list[str]:
    """The models ``precast bench`` runs without ``--model``: ``mlp``."""
    return ["mlp"]


def check_specs(specs: list[str]) -> None:
    """One-line PrecastError for unknown short names."""
    names = short_names()
    unknown = [s for s in specs if ":" not in s and s not in names]
    if unknown:
        raise PrecastError(
            f"bench: unknown model(s) {unknown}; choose from {', '.join(names)} or give module:factory"
        )


def resolve(spec: str) -> Callable[..., Any]:
    """The factory a spec names (see the module docstring); one-line PrecastError when it cannot be found."""
    if ":" not in spec:
        check_specs([spec])
        spec = f"{SHORT_MODULE}:{spec}"
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise PrecastError(f"bench: --model {spec!r}: expected NAME or 'package.module:factory'")
    try:
        module = _import(mod_name)
    except ModuleNotFoundError as exc:
        raise PrecastError(
            f"bench: --model {spec!r}: cannot import module '{mod_name}' ({exc}); check the name and PYTHONPATH"
        ) from exc
    except (Exception, SystemExit) as exc:  # the user's module failed while importing: one line
        raise PrecastError(
            f"bench: --model {spec!r}: importing '{mod_name}' failed: {_failure(exc)}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise PrecastError(f"bench: --model {spec!r}: module '{mod_name}' has no callable '{attr}'")
    return factory


def build(spec: str, batch: int) -> tuple[torch.nn.Module, tuple]:
    """(model in eval mode, example inputs with dim 0 = ``batch``) from the factory ``spec`` names."""
    factory = resolve(spec)
    try:
        takes_batch = "batch" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature (a builtin): call it without arguments
        takes_batch = False
    try:
        made = factory(batch=batch) if takes_batch else factory()
    except (
        Exception,
        SystemExit,
    ) as exc:  # a factory that raises or calls sys.exit: one line, not a traceback
        raise PrecastError(f"bench: --model {spec!r}: the factory failed: {_failure(exc)}") from exc
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise PrecastError(
            f"bench: --model {spec!r}: the factory must return (model, example_inputs), got {type(made).__name__}"
        )
    model, inputs = made
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return model.eval(), resize_batch(inputs, batch)


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {first_line(exc)[:200]}"


# ---- the autocast switch ----------------------------------------------------------------------------------
def switches(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that have the autocast switch (``autocast`` bool, ``device_type``, ``dtype``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "autocast", None), bool)
        and hasattr(m, "device_type")
        and hasattr(m, "dtype")
    ]


@contextlib.contextmanager
def regions(
    model: torch.nn.Module,
    *,
    enabled: bool | None = None,
    device_type: str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[int]:
    """Within the block, the switchable regions of this model instance are on/off (``enabled``) and use
    ``device_type``/``dtype`` (None: as they are); restored after. Yields how many modules have the switch."""
    mods = switches(model)
    saved = [(m.autocast, m.device_type, m.dtype) for m in mods]
    try:
        for m in mods:
            if enabled is not None:
                m.autocast = enabled
            if device_type is not None:
                m.device_type = device_type
            if dtype is not None:
                m.dtype = dtype
        yield len(mods)
    finally:
        for m, (a, d, t) in zip(mods, saved, strict=True):
            m.autocast, m.device_type, m.dtype = a, d, t


def retarget(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> int:
    """Point the switchable regions of ``model`` at ``device_type``/``dtype`` for good; returns their count."""
    for m in switches(model):
        m.device_type, m.dtype = device_type, dtype
    return len(switches(model))


def fp32_reference(model: torch.nn.Module, inputs: tuple) -> tuple[Callable[[], Any], str]:
    """A call of the model with its autocast regions off, and a note (empty for a switchable model)."""
    if switches(model):

        def run() -> Any:
            with regions(model, enabled=False):
                return model(*inputs)

        return run, ""
    from precast.ir.program import Program, strip_dtype_asserts
    from precast.passes.regions import inline_regions

    program = Program(torch.export.export(model, inputs, strict=False))
    inline_regions(program.gm)
    # without export's dtype asserts, which pin the dtypes the regions produced when it traced
    module = strip_dtype_asserts(program.to_exported_program().module())
    note = "no autocast switch: fp32 reference = the exported program with its regions inlined"
    return (lambda: module(*inputs)), note
