"""``precast bench``: eager vs AOTInductor variants vs precast + AOTInductor on the built-in zoo.

Variants (all at the same precision, on the same inputs):
  eager_fp32            the model with its autocast regions disabled (the accuracy reference)
  eager_autocast        the model as written (eager autocast casts weights on every forward)
  aoti_default          torch.export + AOTInductor defaults (the seed's situation: casts at run time)
  aoti_freezing         AOTInductor with ``freezing=True`` under no_grad (casts folded; weights not swappable)
  aoti_runtime_folding  AOTInductor with run-time constant folding (fp32 weights kept, folded at load)
  precast_aoti          precast.convert + precast.compile

Latency: median over interleaved repeats (each repeat times every variant in turn, so drift hits all alike;
CUDA events on GPU). Resident memory after load: each package is loaded in a fresh subprocess.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from precast import zoo
from precast.errors import PrecastError
from precast.progress import ProgressBar

VARIANTS = (
    "eager_fp32",
    "eager_autocast",
    "aoti_default",
    "aoti_freezing",
    "aoti_runtime_folding",
    "precast_aoti",
)
BASELINE = "aoti_default"
AOTI_CONFIGS: dict[str, dict[str, Any]] = {
    "aoti_default": {},
    "aoti_freezing": {"freezing": True},
    "aoti_runtime_folding": {"aot_inductor.use_runtime_constant_folding": True},
    "precast_aoti": {},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _minilm_factory() -> Callable | None:
    try:
        from precast import minilm  # written separately; optional
    except ImportError:
        return None
    return getattr(minilm, "minilm", None)


def bench_models() -> dict[str, Callable]:
    """name -> factory(batch) returning (model, example_inputs)."""
    models: dict[str, Callable] = {
        "seed": lambda batch: zoo.seed_model(),
        "mlp": lambda batch: zoo.mlp(batch),
        "cnn": lambda batch: zoo.cnn(batch),
        "encoder": lambda batch: zoo.encoder(batch),
    }
    minilm = _minilm_factory()
    if minilm is not None:
        models["minilm"] = lambda batch: _in_region(*minilm(batch=batch))
    return models


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
    samples_ms: list[float] = field(default_factory=list, repr=False)


def _in_region(model: torch.nn.Module, inputs: Any) -> tuple[torch.nn.Module, Any]:
    """all-MiniLM-L6-v2 is written without autocast: run it inside one region, as the other models are."""
    return zoo.AutocastRegion(model).eval(), inputs


# ---- model preparation ------------------------------------------------------------------------------------
@contextlib.contextmanager
def autocast_as(device: str, dtype: torch.dtype | None, enabled: bool = True) -> Iterator[None]:
    """Make every ``torch.autocast(...)`` the model enters use ``device``/``dtype`` (or be disabled).

    The zoo's regions are written for CPU bf16; this retargets them for ``--device``/``--dtype`` and turns them
    off for the fp32 reference, without editing the models."""
    original = torch.autocast

    class _Retargeted(original):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            device_type: str,
            dtype_: torch.dtype | None = None,
            enabled_: bool = True,
            cache_enabled: bool | None = None,
            **kwargs: Any,
        ):
            dtype_ = kwargs.pop("dtype", dtype_)
            on = kwargs.pop("enabled", enabled_)
            super().__init__(
                device, dtype=dtype or dtype_, enabled=bool(on) and enabled, cache_enabled=cache_enabled
            )

    torch.autocast = _Retargeted  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]


def resize_batch(inputs: tuple, batch: int) -> tuple:
    """The example inputs with dim 0 resized to ``batch`` (seeded, same distribution kind)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] == batch:
            out.append(x)
        elif x.is_floating_point():
            out.append(torch.randn((batch, *x.shape[1:]), generator=g, dtype=x.dtype))
        else:
            hi = int(x.max()) + 1 if x.numel() else 2
            out.append(torch.randint(0, hi, (batch, *x.shape[1:]), generator=g, dtype=x.dtype))
    return tuple(out)


def _to(obj: Any, device: str) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


def _flat(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return torch.cat([t.detach().float().flatten().cpu() for t in leaves])


def errors(out: Any, ref: Any) -> tuple[float, float]:
    a, b = _flat(out), _flat(ref)
    if a.shape != b.shape:
        raise PrecastError(f"bench: output has {a.numel()} values, the fp32 reference {b.numel()}")
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item() if a.numel() else 1.0
    return (a - b).abs().max().item() if a.numel() else 0.0, cos


# ---- cast counting ----------------------------------------------------------------------------------------
_CAST_KERNEL = re.compile(r"\b(\w*(?:_to_copy|convert_element_type)\w*)\s*\(")


def aoti_cast_kernels(package: str | os.PathLike) -> int:
    """Calls per forward to generated kernels named for a cast (``cpp_fused__to_copy_0``...) in the wrapper.

    A fused kernel that casts as part of other work (``..._to_copy_addmm...``) counts too: it still reads
    fp32 and writes low precision on every call."""
    with zipfile.ZipFile(package) as z:
        wrappers = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        text = "\n".join(z.read(n).decode(errors="replace") for n in wrappers)
    run = text.split("run_impl(", 1)[-1]  # only calls inside the forward, not the declarations
    return sum(
        1
        for line in run.splitlines()
        if _CAST_KERNEL.search(line) and not line.lstrip().startswith(("void ", "extern", "//", "#"))
    )


def eager_cast_ops(fn: Callable[[], Any]) -> int:
    """``aten::_to_copy`` calls in one eager forward (autocast's casts included: they dispatch below it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


# ---- memory in a fresh process ----------------------------------------------------------------------------
_RSS_SCRIPT = r"""
import json, sys, torch, torch._inductor
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
args = torch.load(sys.argv[2])
before = rss()
m = torch._inductor.aoti_load_package(sys.argv[1])
with torch.no_grad():
    m(*args)
print(json.dumps({"before": before, "after": rss()}))
"""


def load_rss_mb(package: str | os.PathLike, inputs: tuple, workdir: Path) -> float | None:
    """Resident memory (MiB) a fresh process gains by loading ``package`` and running one forward."""
    if not Path("/proc/self/status").exists():
        return None
    args_path = workdir / "rss_inputs.pt"
    torch.save(_to(inputs, "cpu"), args_path)
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(package), str(args_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return None
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return round(data["after"] - data["before"], 1)


# ---- timing -----------------------------------------------------------------------------------------------
def _inner_count(fn: Callable[[], Any], device: str, budget_s: float = 0.02) -> int:
    """Calls per sample so that a sample lasts about ``budget_s`` (timer noise stays small)."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t, 1e-6)
    return max(1, min(1000, int(budget_s / once)))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], Any], n: int, device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e3 / n


def interleaved_latency(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    device: str = "cpu",
    on_repeat: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Per-call latency samples (ms) for each function, timed in turn ``repeats`` times."""
    with torch.no_grad():
        for fn in fns.values():  # warm up
            for _ in range(3):
                fn()
        inner = {name: _inner_count(fn, device) for name, fn in fns.items()}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(_time_ms(fn, inner[name], device))
            if on_repeat:
                on_repeat()
    return samples


# ---- the benchmark ----------------------------------------------------------------------------------------
def build_variants(
    model: torch.nn.Module,
    inputs: tuple,
    variants: tuple[str, ...],
    *,
    device: str,
    dtype: torch.dtype,
    cache_dir: str | os.PathLike | None,
    on_step: Callable[[str], None] | None = None,
) -> tuple[dict[str, Callable[[], Any]], dict[str, Result]]:
    """Callables per variant (plus compile facts in partial Results)."""
    import precast

    fns: dict[str, Callable[[], Any]] = {}
    facts: dict[str, Result] = {}
    exported = None
    for variant in variants:
        if on_step:
            on_step(variant)
        facts[variant] = res = Result(model="", batch=0, variant=variant)
        try:
            if variant == "eager_fp32":

                def run_fp32(m=model, x=inputs):
                    with autocast_as(device, dtype, enabled=False):
                        return m(*x)

                fns[variant] = run_fp32
                res.casts_per_forward = eager_cast_ops(run_fp32)
            elif variant == "eager_autocast":

                def run_autocast(m=model, x=inputs):
                    with autocast_as(device, dtype):
                        return m(*x)

                fns[variant] = run_autocast
                with torch.no_grad():
                    res.casts_per_forward = eager_cast_ops(run_autocast)
            else:
                if variant == "precast_aoti":
                    with autocast_as(device, dtype):
                        program = precast.convert(model, inputs).program
                else:
                    if exported is None:
                        with autocast_as(device, dtype):
                            exported = torch.export.export(model, inputs, strict=False)
                    program = exported
                started = time.perf_counter()
                cm = precast.compile(
                    program, cache_dir=cache_dir, inductor_configs=AOTI_CONFIGS[variant], progress=False
                )
                res.compile_s = round(time.perf_counter() - started, 2)
                fns[variant] = lambda cm=cm, x=inputs: cm(*x)
                res.package_mb = round(os.path.getsize(cm.package_path) / 2**20, 2)
                res.casts_per_forward = aoti_cast_kernels(cm.package_path)
                res.package_path = str(cm.package_path)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - one failing variant must not sink the table
            res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            fns.pop(variant, None)
    return fns, facts


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
    """Benchmark every (model, batch) on ``variants``; returns one Result per variant."""
    available = bench_models()
    unknown = [m for m in models if m not in available]
    if unknown:
        raise PrecastError(f"bench: unknown model(s) {unknown}; choose from {', '.join(available)}")
    if dtype not in DTYPES:
        raise PrecastError(f"bench: --dtype {dtype!r}; choose bf16 or fp16")
    if device == "cuda" and not torch.cuda.is_available():
        raise PrecastError("bench: --device cuda but torch.cuda.is_available() is False; use --device cpu")
    low = DTYPES[dtype]
    work = Path(workdir or os.environ.get("TMPDIR", "/tmp")) / f"precast-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    with ProgressBar("bench", len(models) * len(batches), progress) as bar:
        for name in models:
            for batch in batches:
                bar.describe(f"{name} batch {batch}: building")
                model, inputs = available[name](batch)
                inputs = resize_batch(inputs, batch)
                model, inputs = model.to(device).eval(), _to(inputs, device)
                fns, facts = build_variants(
                    model,
                    inputs,
                    variants,
                    device=device,
                    dtype=low,
                    cache_dir=cache_dir,
                    on_step=lambda v, name=name, batch=batch: bar.describe(f"{name} batch {batch}: {v}"),
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
                    if variant in samples:
                        r.samples_ms = [round(s, 4) for s in samples[variant]]
                        r.latency_ms = round(statistics.median(samples[variant]), 4)
                        if base:
                            r.speedup = round(base / r.latency_ms, 3)
                        if ref is not None:
                            err, cos = errors(outs[variant], ref)
                            r.max_abs_err, r.cosine = float(f"{err:.4g}"), round(cos, 6)
                    pkg = getattr(r, "package_path", None)
                    if measure_rss and pkg and device == "cpu":
                        bar.describe(f"{name} batch {batch}: memory of {variant} in a fresh process")
                        r.rss_mb = load_rss_mb(pkg, inputs, work)
                    results.append(r)
                bar.advance()
    return results


# ---- output -----------------------------------------------------------------------------------------------
COLUMNS = (
    ("model", "model"),
    ("batch", "batch"),
    ("variant", "variant"),
    ("latency_ms", "latency ms"),
    ("speedup", "vs default"),
    ("package_mb", "package MB"),
    ("rss_mb", "RSS MB"),
    ("max_abs_err", "max abs err"),
    ("cosine", "cosine"),
    ("casts_per_forward", "casts/fwd"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e-2 and value else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def rows(results: list[Result]) -> list[list[str]]:
    out = []
    for r in results:
        d = asdict(r)
        cells = [_cell(d[k]) for k, _ in COLUMNS]
        if r.error:
            cells[3] = f"error: {r.error[:60]}"
        out.append(cells)
    return out


def to_markdown(results: list[Result], machine: dict[str, Any]) -> str:
    head = [h for _, h in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    desc = ", ".join(f"{k}: {v}" for k, v in machine.items())
    return (
        f"# precast bench\n\nMachine: {desc}\n\nLatency: median of interleaved repeats; RSS: resident memory a "
        "fresh process gains by loading the package and running one forward; errors vs eager fp32; casts/fwd: "
        "`aten::_to_copy` calls (eager, counted at dispatch) or calls to generated cast kernels (AOTI wrapper).\n\n"
        + "\n".join(lines)
        + "\n"
    )


def to_rich_table(results: list[Result]) -> Any:
    from rich.table import Table

    table = Table(title="precast bench")
    for key, head in COLUMNS:
        table.add_column(head, justify="left" if key in ("model", "variant") else "right")
    for row in rows(results):
        table.add_row(*row)
    return table


def machine_info(device: str = "cpu") -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    info["cores"] = os.cpu_count()
    info["threads"] = torch.get_num_threads()
    with contextlib.suppress(OSError):
        info["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)  # other processes skew CPU timings
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_outputs(results: list[Result], out_dir: str | os.PathLike, machine: dict[str, Any]) -> list[Path]:
    """bench.json, bench.md and (when matplotlib is installed) bench.png in ``out_dir``; returns the paths."""
    from precast.io import atomic_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    payload = {"machine": machine, "results": [asdict(r) for r in results]}
    with atomic_path(out / "bench.json") as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
    written.append(out / "bench.json")
    with atomic_path(out / "bench.md") as tmp:
        tmp.write_text(to_markdown(results, machine))
    written.append(out / "bench.md")
    png = plot(results, out / "bench.png")
    if png:
        written.append(png)
    return written


def plot(results: list[Result], path: Path) -> Path | None:
    """Latency per variant, one group per (model, batch). None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from precast.io import atomic_path

    groups = sorted({(r.model, r.batch) for r in results}, key=lambda g: (g[0], g[1]))
    variants = [v for v in VARIANTS if any(r.variant == v for r in results)]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        ys = []
        for g in groups:
            r = next((r for r in results if (r.model, r.batch) == g and r.variant == variant), None)
            ys.append(r.latency_ms if r and r.latency_ms else 0.0)
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("median latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path
