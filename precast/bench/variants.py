"""Building and running the variants ``precast bench`` compares, on one model at a time.

Variants (all at the same precision, on the same inputs):
  eager_fp32            the model with its autocast regions off (the accuracy reference; see factories.py)
  eager_autocast        the model as written (eager autocast casts weights on every forward)
  aoti_default          torch.export + AOTInductor defaults (the seed's situation: casts at run time)
  aoti_freezing         AOTInductor with ``freezing=True`` under no_grad (casts folded; weights not swappable)
  aoti_runtime_folding  AOTInductor with run-time constant folding (fp32 weights kept, folded at load)
  precast_aoti          precast.convert + precast.compile
  aoti_fp32             the model with its regions off, exported and compiled: fp32 AOTInductor
  auto_aoti             that fp32 model through precast.convert(policy="auto") + precast.compile: low precision
                        only where it is measured faster on this device (never slower than aoti_fp32)
  ort_fp32, ort_precast the fp32 program and precast's conversion on ONNX Runtime's CPU provider (bench/ort.py)
  ov_default, ov_precast OpenVINO's own default on the fp32 program, and precast's conversion run with the dtypes
                        it states (bench/openvino.py)
  precast_<engine>      precast's conversion compiled by an engine of ``precast.backends.registry`` the bench has
                        no baselines for (``precast_executorch``), with that engine's defaults

The variants come from the engine registry: each engine's are listed under its name (``ENGINE_VARIANTS``), its
extra checked (``Engine.require``: a missing one is the row's one-line error naming ``pip install``) before any
of them is built; a new engine in the registry is a ``precast_<name>`` row without a change here.

Input: model specs (``factories.build``), batch sizes, dtype/device, repeats. Output: ``run_bench`` -> one
``Result`` per (model, batch, variant): median latency of interleaved repeats, speedup vs aoti_default,
package size, resident memory after load in a fresh process, error vs eager_fp32, casts per forward, compile
time; a variant that fails gets its ``error`` and the others still run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from precast.backends.registry import ENGINES, Engine, engine
from precast.bench.factories import (
    build,
    check_specs,
    fp32_reference,
    regions,
    resolve,
    retarget,
    switches,
)
from precast.bench.measure import (
    aoti_cast_kernels,
    eager_cast_ops,
    interleaved_latency,
    load_rss_mb,
    to_device,
)
from precast.bench.openvino import OV_VARIANTS, build_ov_variant
from precast.bench.ort import ORT_VARIANTS, build_ort_variant, ort_load_rss_mb
from precast.dtypes import ALIASES
from precast.errors import PrecastError, first_line
from precast.metrics import flat_error
from precast.progress import ProgressBar

AOTI_VARIANTS = (
    "aoti_default",
    "aoti_freezing",
    "aoti_runtime_folding",
    "precast_aoti",
    "aoti_fp32",
    "auto_aoti",
)
# the engines the bench has its own variants for (baselines beside precast's row); every other engine of the
# registry gets precast_<name>
_OWN = {"aoti": AOTI_VARIANTS, "onnx": ORT_VARIANTS, "openvino": OV_VARIANTS}
ENGINE_VARIANTS: dict[str, tuple[str, ...]] = {
    e.name: _OWN.get(e.name, (f"precast_{e.name}",)) for e in ENGINES
}
ENGINE_OF = {variant: name for name, names in ENGINE_VARIANTS.items() for variant in names}
VARIANTS = ("eager_fp32", "eager_autocast", *ENGINE_OF)
BASELINE = "aoti_default"
# the bench loads each package alone in a fresh process (aoti_load_package, its size and RSS): weights inside the
# .so, as plain AOTInductor builds them (precast.compile's default leaves them out, docs/compile.md)
_IN_SO = {"aot_inductor.package_constants_in_so": True}
AOTI_CONFIGS: dict[str, dict[str, Any]] = {
    "aoti_default": _IN_SO,
    "aoti_freezing": {"freezing": True},
    "aoti_runtime_folding": {"aot_inductor.use_runtime_constant_folding": True, **_IN_SO},
    "precast_aoti": _IN_SO,
    "aoti_fp32": _IN_SO,
    "auto_aoti": _IN_SO,
}


@dataclass
class Result:
    model: str
    batch: int
    variant: str
    latency_ms: float | None = None
    speedup: float | None = None  # vs aoti_default
    package_mb: float | None = None
    rss_mb: float | None = None  # resident memory added by loading the package and one forward
    max_abs_err: float | None = None  # vs eager_fp32
    cosine: float | None = None
    casts_per_forward: int | None = None
    compile_s: float | None = None
    error: str | None = None
    note: str = ""
    package_path: str | None = field(default=None, repr=False)
    onnx_path: str | None = field(default=None, repr=False)
    samples_ms: list[float] = field(default_factory=list, repr=False)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)[:200]}"


def build_variants(
    model: torch.nn.Module,
    inputs: tuple,
    variants: tuple[str, ...],
    *,
    cache_dir: str | os.PathLike | None,
    on_step: Callable[[str], None] | None = None,
    low: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    work: Path | None = None,
) -> tuple[dict[str, Callable[[], Any]], dict[str, Result]]:
    """A callable per variant that built, plus the compile facts of every variant in partial Results (model
    and batch left blank). The model's regions are used as they are set (see ``factories.retarget``);
    ``low``/``device``: what ``auto_aoti`` converts to."""
    setup = _Setup(model, inputs, cache_dir, low, device, work)
    fns: dict[str, Callable[[], Any]] = {}
    facts: dict[str, Result] = {}
    for variant in variants:
        if on_step:
            on_step(variant)
        facts[variant] = res = Result(model="", batch=0, variant=variant)
        try:
            fns[variant] = _build_variant(setup, variant, res)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not sink the table
            res.error = _error_text(exc)
            fns.pop(variant, None)
    return fns, facts


@dataclass
class _Setup:
    """What every variant is built from: the model and its inputs, the AOTInductor cache, what ``auto_aoti``
    converts to, the folder for .onnx files; and the plain export, made once for the variants that share it."""

    model: torch.nn.Module
    inputs: tuple
    cache_dir: str | os.PathLike | None
    low: torch.dtype
    device: str
    work: Path | None
    exported: Any = None


def _build_variant(setup: _Setup, variant: str, res: Result) -> Callable[[], Any]:
    """One variant's callable, its compile facts written into ``res``."""
    model, inputs = setup.model, setup.inputs
    if variant == "eager_fp32":
        fn, res.note = fp32_reference(model, inputs)
        return _eager(fn, res)
    if variant == "eager_autocast":
        return _eager(lambda m=model, x=inputs: m(*x), res)
    runs_on = engine(ENGINE_OF[variant], where=f"bench {variant}")
    runs_on.require(where=f"bench {variant}")
    if variant in ORT_VARIANTS:
        if setup.work is None:
            raise PrecastError(
                "build_variants: the ONNX Runtime variants need work= (a folder for .onnx files)"
            )
        return build_ort_variant(variant, model, inputs, setup.work, fp32_program, res)
    if variant in OV_VARIANTS:
        if setup.device != "cpu":
            raise PrecastError(f"{variant}: OpenVINO runs on the CPU here; use --device cpu")
        return build_ov_variant(variant, model, inputs, fp32_program, res)
    if variant in AOTI_VARIANTS:
        return _aoti_variant(setup, variant, res)
    return _engine_variant(setup, runs_on, res)


def _engine_variant(setup: _Setup, on: Engine, res: Result) -> Callable[[], Any]:
    """precast's conversion compiled by ``on`` with its defaults (an engine the bench has no baselines for);
    the compile time and what the engine made of it into ``res``."""
    import precast

    if setup.device != "cpu":
        raise PrecastError(f"precast_{on.name}: {on.title} runs on the CPU here; use --device cpu")
    program = precast.convert(setup.model, setup.inputs).program
    started = time.perf_counter()
    compiled = on.compile(program)
    res.compile_s = round(time.perf_counter() - started, 2)
    res.note = on.describe(compiled) or on.summary
    return lambda m=compiled, x=setup.inputs: m(*x)


def _eager(fn: Callable[[], Any], res: Result) -> Callable[[], Any]:
    """An eager variant as it is, the casts one forward runs counted into ``res``."""
    with torch.no_grad():
        res.casts_per_forward = eager_cast_ops(fn)
    return fn


def _aoti_variant(setup: _Setup, variant: str, res: Result) -> Callable[[], Any]:
    """An AOTInductor variant: its program (precast's conversion, the fp32 export, auto's conversion of that, or
    the plain export) compiled with the variant's inductor configs; compile time and package facts into ``res``."""
    import precast

    model, inputs = setup.model, setup.inputs
    if variant == "precast_aoti":
        program = precast.convert(model, inputs).program
    elif variant in ("aoti_fp32", "auto_aoti"):
        program, res.note = fp32_program(model, inputs)
        if variant == "auto_aoti":
            conv = precast.convert(program, inputs, policy="auto", dtype=setup.low, device_type=setup.device)
            program, res.note = conv.program, auto_note(conv.report)
    else:
        if setup.exported is None:
            setup.exported = torch.export.export(model, inputs, strict=False)
        program = setup.exported
    started = time.perf_counter()
    cm = precast.compile(
        program, cache_dir=setup.cache_dir, inductor_configs=AOTI_CONFIGS[variant], progress=False
    )
    res.compile_s = round(time.perf_counter() - started, 2)
    res.package_mb = round(os.path.getsize(cm.package_path) / 2**20, 2)
    res.casts_per_forward = aoti_cast_kernels(cm.package_path)
    res.package_path = str(cm.package_path)
    return lambda cm=cm, x=inputs: cm(*x)


def fp32_program(model: torch.nn.Module, inputs: tuple) -> tuple[Any, str]:
    """The model exported with its autocast regions off (fp32 throughout), and a note (empty when it has the
    switch; otherwise the program as exported, regions included)."""
    if switches(model):
        with regions(model, enabled=False):
            return torch.export.export(model, inputs, strict=False), ""
    note = "no autocast switch: exported as written, regions included"
    return torch.export.export(model, inputs, strict=False), note


def auto_note(report: Any) -> str:
    """What policy auto chose, in one line (from its ``auto-latency`` diagnostic)."""
    text = next((d.message for d in report.diagnostics if d.code == "auto-latency"), "")
    return text.removeprefix("auto: ")


def check_options(variants: tuple[str, ...], dtype: str, device: str) -> None:
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise PrecastError(f"bench: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if dtype not in ALIASES:
        raise PrecastError(f"bench: --dtype {dtype!r}; choose bf16 or fp16")
    if device == "cuda" and not torch.cuda.is_available():
        raise PrecastError("bench: --device cuda but torch.cuda.is_available() is False; use --device cpu")


def run_bench(
    models: list[str],
    batches: list[int],
    *,
    dtype: str = "bf16",
    device: str = "cpu",
    repeats: int = 20,
    variants: tuple[str, ...] = VARIANTS,
    cache_dir: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    measure_rss: bool = True,
    progress: bool | None = None,
) -> list[Result]:
    """Benchmark every (model spec, batch) on ``variants``; returns one Result per variant."""
    check_specs(models)
    for spec in models:
        resolve(spec)  # every spec is checked before the first model is built
    check_options(variants, dtype, device)
    low = ALIASES[dtype]
    if workdir is not None:  # the caller's folder: kept
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return _run_all(
            models, batches, Path(workdir), low, device, repeats, variants, cache_dir, measure_rss, progress
        )
    # our own: an unpredictable name (tempfile, 0700), removed afterwards whatever happens
    with tempfile.TemporaryDirectory(prefix="precast-bench-") as work:
        return _run_all(
            models, batches, Path(work), low, device, repeats, variants, cache_dir, measure_rss, progress
        )


def _run_all(
    models: list[str],
    batches: list[int],
    work: Path,
    low: torch.dtype,
    device: str,
    repeats: int,
    variants: tuple[str, ...],
    cache_dir: str | os.PathLike | None,
    measure_rss: bool,
    progress: bool | None,
) -> list[Result]:
    results: list[Result] = []
    with ProgressBar("bench", len(models) * len(batches), progress) as bar:
        for name in models:
            for batch in batches:
                bar.describe(f"{name} batch {batch}: building")
                model, inputs = build(name, batch)
                model, inputs = model.to(device).eval(), to_device(inputs, device)
                switchable = retarget(model, device, low) > 0
                fns, facts = build_variants(
                    model,
                    inputs,
                    variants,
                    cache_dir=cache_dir,
                    on_step=lambda v, name=name, batch=batch: bar.describe(f"{name} batch {batch}: {v}"),
                    low=low,
                    device=device,
                    work=work / f"{name}-b{batch}",
                )
                bar.describe(f"{name} batch {batch}: timing {repeats} interleaved repeats")
                samples = interleaved_latency(fns, repeats, device)
                with torch.no_grad():
                    ref = fns["eager_fp32"]() if "eager_fp32" in fns else None
                    outs = {v: fn() for v, fn in fns.items()}
                base = statistics.median(samples[BASELINE]) if BASELINE in samples else None
                for variant in variants:
                    r = facts[variant]
                    r.model, r.batch = name, batch
                    if not switchable and variant != "eager_fp32":
                        r.note = "no autocast switch: the model's regions run as written (--device/--dtype ignored)"
                    if variant in samples:
                        r.samples_ms = [round(s, 4) for s in samples[variant]]
                        r.latency_ms = round(statistics.median(samples[variant]), 4)
                        if base:
                            r.speedup = round(base / r.latency_ms, 3)
                        if ref is not None:
                            err, cos = flat_error(outs[variant], ref)
                            r.max_abs_err, r.cosine = float(f"{err:.4g}"), round(cos, 6)
                    if measure_rss and r.package_path and device == "cpu":
                        bar.describe(f"{name} batch {batch}: memory of {variant} in a fresh process")
                        r.rss_mb = load_rss_mb(r.package_path, inputs, work)
                    if measure_rss and r.onnx_path:
                        bar.describe(f"{name} batch {batch}: memory of {variant} in a fresh process")
                        r.rss_mb = ort_load_rss_mb(r.onnx_path, inputs, work)
                    results.append(r)
                bar.advance()
    return results
