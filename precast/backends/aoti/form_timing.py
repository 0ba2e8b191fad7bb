"""Timing ``precast.compile``'s candidate forms, and the cache of the measured choices (``backends/aoti/forms.py``).

- ``measure_forms``: a synthetic module with one weight per shape (the program's matmul weight shapes, its 16-bit
  dtype; int8 / int4 weights converted to their formats), compiled in each form by the compile function it is
  given (``precast.compile``: what is timed is what would run), timed interleaved at M=1 by ``time_interleaved``
  (the best round of each: load only adds time).
- ``load_choices`` / ``store_choice``: ``<cache dir>/forms.json``, JSON (never unpickled), written atomically under
  a file lock; a file that is not JSON or of another shape is a miss with a warning, never a crash.

Input: a dtype, weight shapes, each form's configs, a compile function. Output: seconds per call by form; entries.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from precast.entries import read_entries, write_entries
from precast.errors import PrecastError, first_line
from precast.io import cache_root, private_dir
from precast.runtime.threads import running_at, usable_cores

FORMS_FILE = "forms.json"
FORMS_VERSION = 1
M = 1  # the rows a decode step at batch 1 multiplies
ROUNDS = 30
ROUND_S = 0.05  # one round: about this long a loop of calls per form
BUDGET_S = 3.0  # at most this long timing each form (after its warm-up)
Shapes = tuple[tuple[int, int], ...]  # distinct (out, in) matmul weight shapes


def _entry_ok(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("times_ms"), dict)
        and all(isinstance(n, str) and type(t) in (int, float, str) for n, t in e["times_ms"].items())
        and type(e.get("threads")) is int
        and type(e.get("cores_left")) is int
        and type(e.get("load")) in (int, float)
        and isinstance(e.get("under_load"), bool)
        and isinstance(e.get("dtype"), str)
        and isinstance(e.get("shapes"), list)
        and type(e.get("m")) is int
    )


def load_choices(path: Path) -> dict[str, dict[str, Any]]:
    """The cached choices; a malformed file or entry is measured again with a warning (``entries.read_entries``)."""
    return read_entries(path, "form cache", FORMS_VERSION, _entry_ok)


def store_choice(path: Path, key: str, entry: dict[str, Any]) -> None:
    write_entries(path, "form cache", FORMS_VERSION, _entry_ok, {key: entry})


def cores() -> int:
    """The physical cores this process may use (affinity, cgroup quota: ``runtime/threads.usable_cores``)."""
    return usable_cores()


# ---- timing the candidates -----------------------------------------------------------------------------------
class _Weights(torch.nn.Module):
    """One bias-free linear per weight shape, each reading its own input: the program's GEMVs, without the rest."""

    def __init__(self, dtype: torch.dtype, shapes: Shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False) for n, k in shapes)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.02)
        self.to(dtype)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer, x in zip(self.layers, xs, strict=True))


def measure_forms(
    dtype: torch.dtype,
    shapes: Shapes,
    configs: Mapping[str, Mapping[str, Any]],
    root: str | os.PathLike | None,
    compile_fn: Callable[..., Any],
    threads: int | None = None,
    formats: tuple[str, ...] | None = None,
) -> dict[str, float | str]:
    """Seconds per call of the synthetic module at M=1 compiled by ``compile_fn`` (``precast.compile``) with each
    form's inductor ``configs`` (an error's text for a form that does not compile here), compiled for and timed
    interleaved at ``threads`` (default: the current count); compiled into a temporary cache under ``root`` (the
    precast cache dir), deleted after. ``formats``: each shape's weight format (``"float"``, or an int8 / int4
    format the module's weight is converted to, read in ``dtype``)."""
    threads = torch.get_num_threads() if threads is None else threads

    module = _Weights(dtype, shapes).eval()
    g = torch.Generator().manual_seed(1)
    example = tuple(torch.randn(2, k, generator=g).to(dtype) for _, k in shapes)
    step = tuple(x[:M].clone() for x in example)
    ep = torch.export.export(module, example)
    if formats and any(f != "float" for f in formats):
        ep = _stored_in(ep, formats)
    scratch = Path(tempfile.mkdtemp(prefix="forms.", dir=private_dir(cache_root(root) / "tmp")))
    out: dict[str, float | str] = {}
    runs: dict[str, Callable[[], Any]] = {}
    try:
        for name, form_configs in configs.items():
            try:
                cm = compile_fn(
                    ep,
                    mode="default",
                    cache_dir=scratch,
                    inductor_configs=dict(form_configs),
                    progress=False,
                    threads=threads,
                )
            except PrecastError as exc:  # recorded in the choice (and so in cm.form), never chosen
                out[name] = first_line(exc)[:200]
                continue
            runs[name] = lambda cm=cm: cm(*step)
        with torch.no_grad(), running_at(threads):
            out.update(time_interleaved(runs))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {n: out[n] for n in configs if n in out}


def _stored_in(ep: torch.export.ExportedProgram, formats: tuple[str, ...]) -> torch.export.ExportedProgram:
    """The synthetic program with each layer's weight in its format (``precast.convert``, policy None: the
    activations stay in the module's dtype), dequantized in the graph as the program being compiled has it."""
    import warnings

    from precast.api import WeightOptions, convert

    rules = {f"layers.{i}.weight": f for i, f in enumerate(formats) if f != "float"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the synthetic module's own conversion notes
        return convert(ep, policy=None, weights=WeightOptions(format=rules), verify=False).program


def time_interleaved(runs: Mapping[str, Callable[[], Any]], rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds per call of each function: every round (at most ``rounds``) runs each in turn for about
    ``ROUND_S``; the best round of each (load only ever adds time), within ``BUDGET_S`` per function."""
    sizes: dict[str, int] = {}
    for name, fn in runs.items():
        fn()
        t0 = time.perf_counter()
        fn()
        sizes[name] = max(1, min(10_000, int(ROUND_S / max(time.perf_counter() - t0, 1e-7))))
    best = dict.fromkeys(runs, float("inf"))
    spent = 0.0
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            for _ in range(sizes[name]):
                fn()
            took = time.perf_counter() - t0
            spent += took
            best[name] = min(best[name], took / sizes[name])
        if spent > BUDGET_S * max(len(runs), 1):
            break
    return best
