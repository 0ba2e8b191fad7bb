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


# ---- conversion cost per node (``precast bench --convert``, benchmarks/convert_cost.py) ------------------
# How it is measured: ``staged_convert`` calls the stage functions of ``precast.convert`` itself, in the order
# ``convert``/``run_pipeline`` calls them, with a ``perf_counter`` (and, in a separate run, ``tracemalloc``)
# around each: no monkeypatching, no profiler hooks, so the times are those of the real code. The mirror can go
# stale when the pipeline changes: every row also times ``precast.convert(..., verify=False)`` end to end, and
# the table prints the ratio of the two (a ratio far from 1 means the mirror no longer matches convert()).
CONVERT_STAGES = (
    "program_copy",  # Program(ep): deep copy of the graph module
    "inline_regions",
    "check_program",  # diagnostics.check_program + constant_bytes
    "fake_state",  # the private ShapeEnv copy and every fake value re-created on it
    "classify",
    "insert_casts",
    "fold_constant_casts",
    "simplify_casts",
    "restore_output_dtypes",  # only with keep_io_types=True
    "check_pass",  # the graph checks after every pass (lint + fake-value refresh), summed
    "report",  # record_decisions, runtime_casts, constant bytes, program info
    "to_exported_program",
)
CHAIN_SIZES = (250, 500, 1000, 2000, 4000, 8000)
CONVERT_POLICIES: tuple[str | None, ...] = (None, "torch")


class OpChain(torch.nn.Module):
    """``n_ops`` ops inside one bf16 autocast region, cycling linear -> add -> relu -> layer_norm on a small
    width, so export and forwards stay cheap while the graph grows: every linear has its own weights (so the
    fold creates one low-precision constant per linear, as in a real model)."""

    def __init__(self, n_ops: int, width: int = 8):
        super().__init__()
        blocks = -(-n_ops // 4)
        self.n_ops = n_ops
        self.linears = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            done, h = 0, x
            for linear, norm in zip(self.linears, self.norms, strict=True):
                for op in range(4):
                    if done == self.n_ops:
                        return h
                    if op == 0:
                        h = linear(x)
                    elif op == 1:
                        h = h + x
                    elif op == 2:
                        h = torch.relu(h)
                    else:
                        x = h = norm(h)
                    done += 1
            return h


def _dynamic_batch(inputs: tuple, varargs: bool) -> tuple:
    b = torch.export.Dim("b", min=1, max=64)
    specs = tuple({0: b} if isinstance(x, torch.Tensor) and x.dim() else None for x in inputs)
    return (specs,) if varargs else specs  # ``forward(self, *xs)``: one spec, a tuple, for ``xs``


def export_for_bench(
    model: torch.nn.Module, inputs: tuple, dynamic: bool = True, varargs: bool = False
) -> tuple[Any, str]:
    """``torch.export`` with a dynamic batch ``Dim("b", min=1, max=64)``; falls back to static shapes (and
    says so in the returned note) when the model cannot be exported with one."""
    if dynamic:
        try:
            shapes = _dynamic_batch(inputs, varargs)
            return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False), ""
        except Exception as exc:  # noqa: BLE001 - reported in the table's note, then exported static
            note = (
                f"static batch (dynamic export failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
            )
    else:
        note = "static shapes"
    return torch.export.export(model, inputs, strict=False), note


def chain_program(n_ops: int, width: int = 8, dynamic: bool = True) -> Any:
    torch.manual_seed(0)
    model = OpChain(n_ops, width).eval()
    return export_for_bench(model, (torch.randn(2, width),), dynamic)[0]


class _Calls(torch.nn.Module):
    """Tensors in, tensors out (what export needs from a library model), with the forward inside one bf16
    autocast region when ``region`` (the program policy None converts)."""

    def __init__(self, model: torch.nn.Module, call: Callable[..., torch.Tensor], region: bool):
        super().__init__()
        self.model, self.call, self.region = model, call, region

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if not self.region:
            return self.call(self.model, *xs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.call(self.model, *xs)


def _ids(batch: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _hf(name: str) -> tuple[torch.nn.Module, Callable, tuple]:
    import transformers as tf

    small = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=64, use_cache=False, **small)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
            **small,
        )
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            **small,
        )
        model = tf.BertModel(cfg)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        return (
            model,
            lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state,
            (_ids(), mask),
        )
    return model, lambda m, ids: m(input_ids=ids, use_cache=False).logits, (_ids(),)


def _timm(name: str) -> tuple[torch.nn.Module, Callable, tuple]:
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    return model, lambda m, x: m(x), (x,)


# name -> (library, builder): each builder returns (model, call, inputs); random weights, small configs
CONVERT_MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Callable, tuple]]]] = {
    "gpt2": ("transformers", lambda: _hf("gpt2")),
    "llama": ("transformers", lambda: _hf("llama")),
    "bert": ("transformers", lambda: _hf("bert")),
    "convnext_atto": ("timm", lambda: _timm("convnext_atto")),
    "efficientvit_m0": ("timm", lambda: _timm("efficientvit_m0")),
    "fastvit_t8": ("timm", lambda: _timm("fastvit_t8")),
}


def model_programs(name: str, policies: tuple[str | None, ...]) -> tuple[dict[str | None, Any], str]:
    """policy -> program for a real architecture: policy None converts the export of the model inside one bf16
    region, "torch" the plain fp32 export. Raises ImportError when its library is missing."""
    library, build = CONVERT_MODELS[name]
    __import__(library)
    torch.manual_seed(0)
    model, call, inputs = build()
    model.eval()
    programs, notes = {}, set()
    for region in sorted({p is None for p in policies}):
        ep, note = export_for_bench(_Calls(model, call, region).eval(), inputs, varargs=True)
        notes.add(note)
        for policy in policies:
            if (policy is None) == region:
                programs[policy] = ep
    return programs, "; ".join(n for n in notes if n)


@dataclass
class ConvertCost:
    """Cost of converting one program with one policy: ms and peak traced Python memory (KiB) per stage."""

    model: str
    policy: str  # "none" | "torch"
    ops: int | None  # the chain's N (None for a real architecture)
    nodes: int = 0  # nodes of the graph the passes work on (after inlining the regions)
    stage_ms: dict[str, float] = field(default_factory=dict)
    stage_cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU time of this process: robust to load
    stage_kib: dict[str, float] = field(default_factory=dict)  # peak Python memory added during the stage
    peak_kib: float | None = None  # peak Python memory of the whole conversion (verify excluded)
    verify_ms: float | None = None
    convert_ms: float | None = None  # precast.convert(verify=False), end to end: the mirror's cross-check
    note: str = ""
    error: str | None = None

    @property
    def total_ms(self) -> float:
        return sum(self.stage_ms.values())

    @property
    def ms_per_node(self) -> float:
        return self.total_ms / self.nodes if self.nodes else float("nan")

    @property
    def cpu_ms_per_node(self) -> float:
        return sum(self.stage_cpu_ms.values()) / self.nodes if self.nodes else float("nan")


class _StageClock:
    """``with clock("stage"): ...`` adds the stage's wall time (and, with ``memory``, the peak traced memory
    above what was allocated when it started) to the totals."""

    def __init__(self, memory: bool):
        self.memory = memory
        self.ms: dict[str, float] = {}
        self.cpu_ms: dict[str, float] = {}
        self.kib: dict[str, float] = {}
        self.peak = 0
        self._base = 0

    def __enter__(self) -> _StageClock:
        import tracemalloc

        if self.memory:
            self._started = not tracemalloc.is_tracing()
            if self._started:
                tracemalloc.start()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        import tracemalloc

        if self.memory and self._started:
            tracemalloc.stop()

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        import tracemalloc

        if self.memory:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.ms[stage] = self.ms.get(stage, 0.0) + (time.perf_counter() - start) * 1e3
            self.cpu_ms[stage] = self.cpu_ms.get(stage, 0.0) + (time.process_time() - cpu) * 1e3
            if self.memory:
                peak = tracemalloc.get_traced_memory()[1]
                self.kib[stage] = max(self.kib.get(stage, 0.0), (peak - before) / 1024)
                self.peak = max(self.peak, peak - self._base)


def staged_convert(
    ep: Any, policy: str | None, *, verify: bool = False, memory: bool = False, keep_io_types: bool = False
) -> tuple[ConvertCost, Any]:
    """``precast.convert(ep, policy=policy)`` stage by stage (same functions, same order), timing each.

    Returns the cost (model/ops left blank) and the converted program. ``verify``: also time verification
    (``verify_ms``, kept out of the stages). ``memory``: traced Python memory per stage (slows every stage:
    take times from a run without it)."""
    import importlib

    import precast.classify as classify_mod
    from precast import diagnostics
    from precast.passes.fold_constants import constant_bytes, fold_constant_casts
    from precast.passes.insert_casts import insert_casts
    from precast.passes.restore_io import output_dtypes, restore_output_dtypes
    from precast.passes.simplify_casts import simplify_casts
    from precast.policy.base import dtype_name
    from precast.policy.torch_policy import TorchPolicy
    from precast.program import Program
    from precast.regions import inline_regions

    # the modules: ``precast.convert`` and ``precast.report`` are also names of functions in ``precast``
    cv = importlib.import_module("precast.convert")
    report = importlib.import_module("precast.report")
    verify_mod = importlib.import_module("precast.verify")
    check_pass = getattr(cv, "check_pass", None) or verify_mod.check_pass
    device = cv.program_device_type(ep)
    low = torch.get_autocast_dtype(device) if policy else None
    cost = ConvertCost(model="", policy=str(policy).lower(), ops=None)
    with _StageClock(memory) as clock:
        with clock("program_copy"):
            program = Program(ep)
        with clock("inline_regions"):
            regions = inline_regions(program.gm)
        cost.nodes = len(program.graph.nodes)
        rep = report.Report(policy=policy, dtype=dtype_name(low) if policy else None, device_type=device)
        with clock("check_program"):
            rep.regions = [cv._region_dict(r) for r in regions]
            diagnostics.check_program(ep, program.gm, regions, rep)
            rep.weight_bytes_before = constant_bytes(program)
        if policy is None and not regions:
            raise PrecastError("bench: the program has no autocast regions: policy None returns it unchanged")
        pol = TorchPolicy(device, low) if policy == "torch" else None
        original_out = output_dtypes(program.graph)
        if hasattr(classify_mod, "fake_state"):
            with clock("fake_state"):
                classify_mod.fake_state(program)
        with clock("classify"):
            result = classify_mod.classify(program, pol, (), on_error=diagnostics.classify_error_handler(rep))
        rep.decomposed = result.decomposed or []
        passes: list[tuple[str, Callable[[Any], Any]]] = [
            ("insert_casts", insert_casts),
            ("fold_constant_casts", fold_constant_casts),
            ("simplify_casts", lambda p: simplify_casts(p.graph, p.input_spec, p.output_specs)),
        ]
        if keep_io_types:
            passes.append(("restore_output_dtypes", lambda p: restore_output_dtypes(p, original_out, True)))
        for name, fn in passes:
            with clock(name):
                fn(program)
            with clock("check_pass"):
                check_pass(program, name)
        with clock("report"):
            rep.nodes = report.record_decisions(program.graph)
            rep.casts = report.runtime_casts(program.graph)
            rep.casts_runtime = len(rep.casts)
            rep.weight_bytes_after = constant_bytes(program)
            cv._record_program_info(program, rep)
        with clock("to_exported_program"):
            out = program.to_exported_program()
    cost.stage_ms = {k: round(v, 3) for k, v in clock.ms.items()}
    cost.stage_cpu_ms = {k: round(v, 3) for k, v in clock.cpu_ms.items()}
    if memory:
        cost.stage_kib = {k: round(v, 1) for k, v in clock.kib.items()}
        cost.peak_kib = round(clock.peak / 1024, 1)
    if verify:
        start = time.perf_counter()
        try:
            cv._verify(out, ep, rep, policy, device, low)
        except Exception as exc:  # noqa: BLE001 - the stage times stand; the row says verification failed
            cost.note = (
                f"verify failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            )
        else:
            cost.verify_ms = round((time.perf_counter() - start) * 1e3, 3)
            report.write_program_info(out, rep)
    return cost, out


def measure_convert_cost(
    ep: Any,
    model: str,
    policy: str | None,
    ops: int | None = None,
    *,
    memory: bool = True,
    verify: bool = True,
    end_to_end: bool = True,
) -> ConvertCost:
    """One row: stage times (and verify time) from one run; with ``memory``, peak memory from a second run
    under tracemalloc; with ``end_to_end``, ``precast.convert(verify=False)`` timed as a cross-check."""
    import precast

    _cold_start(ep)
    cost, _ = staged_convert(ep, policy, verify=verify)
    cost.model, cost.ops = model, ops
    if memory:
        _cold_start(ep)
        mem, _ = staged_convert(ep, policy, memory=True)
        cost.stage_kib, cost.peak_kib = mem.stage_kib, mem.peak_kib
    if end_to_end:
        _cold_start(ep)
        start = time.perf_counter()
        precast.convert(ep, policy=policy, verify=False)
        cost.convert_ms = round((time.perf_counter() - start) * 1e3, 3)
    return cost


def _cold_start(ep: Any) -> None:
    """Every run starts as a first conversion in a fresh process would: FakeTensor's dispatch caches (one per
    class, one per ShapeEnv, which the input program shares with every conversion of it) emptied, garbage
    collected. Without this a second run of the same program reuses the first's cache entries (measured: up to
    4x faster), and the order of the runs would decide the numbers."""
    import gc

    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    mode = detect_fake_mode([n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"])
    cache = getattr(getattr(mode, "shape_env", None), "fake_tensor_cache", None)
    if isinstance(cache, dict):
        cache.clear()
    gc.collect()


def _failed(model: str, policy: str | None, ops: int | None, exc: Exception) -> ConvertCost:
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return ConvertCost(
        model=model, policy=str(policy).lower(), ops=ops, error=f"{type(exc).__name__}: {text}"
    )


def run_convert_bench(
    sizes: tuple[int, ...] = CHAIN_SIZES,
    models: tuple[str, ...] = tuple(CONVERT_MODELS),
    policies: tuple[str | None, ...] = CONVERT_POLICIES,
    *,
    memory: bool = True,
    verify: bool = True,
    end_to_end: bool = True,
    dynamic: bool = True,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> list[ConvertCost]:
    """Conversion cost over the synthetic chain at each N in ``sizes`` and over the real ``models`` whose
    library is installed (a missing one is skipped with its reason passed to ``log``)."""
    unknown = [m for m in models if m not in CONVERT_MODELS]
    if unknown:
        raise PrecastError(
            f"bench --convert: unknown model(s) {unknown}; choose from {', '.join(CONVERT_MODELS)} (the "
            "synthetic chain is measured at the sizes given with --sizes)"
        )
    log = log or (lambda text: print(text, file=sys.stderr))
    results: list[ConvertCost] = []
    with ProgressBar("convert cost", (len(sizes) + len(models)) * len(policies), progress) as bar:
        for n in sizes:
            bar.describe(f"chain N={n}: export")
            ep = chain_program(n, dynamic=dynamic)
            for policy in policies:
                bar.describe(f"chain N={n}: policy {policy}")
                try:
                    results.append(
                        measure_convert_cost(
                            ep, "chain", policy, n, memory=memory, verify=verify, end_to_end=end_to_end
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - one failing row must not sink the table
                    results.append(_failed("chain", policy, n, exc))
                bar.advance()
        for name in models:
            bar.describe(f"{name}: export")
            try:
                programs, note = model_programs(name, policies)
            except ImportError as exc:
                log(f"skipped {name}: {CONVERT_MODELS[name][0]} is not installed ({exc})")
                continue
            except Exception as exc:  # noqa: BLE001
                results.extend(_failed(name, p, None, exc) for p in policies)
                continue
            for policy, ep in programs.items():
                bar.describe(f"{name}: policy {policy}")
                try:
                    cost = measure_convert_cost(
                        ep, name, policy, memory=memory, verify=verify, end_to_end=end_to_end
                    )
                    cost.note = note
                except Exception as exc:  # noqa: BLE001
                    cost = _failed(name, policy, None, exc)
                results.append(cost)
                bar.advance()
    return results


def linearity(results: list[ConvertCost]) -> dict[str, float]:
    """Per policy: CPU ms/node at the chain's largest N over that at its smallest (1.0 = linear in N; CPU time,
    not wall time, so that other processes on the machine do not decide it)."""
    out = {}
    for policy in dict.fromkeys(r.policy for r in results):
        chain = sorted(
            (r for r in results if r.model == "chain" and r.policy == policy and not r.error),
            key=lambda r: r.ops or 0,
        )
        if len(chain) >= 2 and chain[0].cpu_ms_per_node > 0:
            out[f"{policy}: N={chain[-1].ops} vs N={chain[0].ops}"] = round(
                chain[-1].cpu_ms_per_node / chain[0].cpu_ms_per_node, 2
            )
    return out


def _stages_present(results: list[ConvertCost]) -> list[str]:
    seen = {s for r in results for s in r.stage_ms}
    return [s for s in CONVERT_STAGES if s in seen] + sorted(seen - set(CONVERT_STAGES))


def convert_cost_rows(results: list[ConvertCost]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the time table: totals, then ms per node of each stage."""
    stages = _stages_present(results)
    head = ["model", "policy", "N", "nodes", "total ms", "ms/node", "cpu ms/node", *stages, "verify ms/node"]
    head.append("vs convert()")
    rows_ = []
    for r in results:
        n = r.nodes or 1
        if r.error:
            rows_.append(
                [r.model, r.policy, _cell(r.ops), "-", f"error: {r.error[:80]}", *["-"] * (len(head) - 5)]
            )
            continue
        per_stage = [_cell(round(r.stage_ms[s] / n, 4)) if s in r.stage_ms else "-" for s in stages]
        rows_.append(
            [
                r.model + (" *" if r.note else ""),
                r.policy,
                _cell(r.ops),
                str(r.nodes),
                f"{r.total_ms:.0f}",
                f"{r.ms_per_node:.3f}",
                f"{r.cpu_ms_per_node:.3f}",
                *per_stage,
                _cell(round(r.verify_ms / n, 4)) if r.verify_ms is not None else "-",
                f"{r.total_ms / r.convert_ms:.2f}" if r.convert_ms else "-",
            ]
        )
    return head, rows_


def convert_memory_rows(results: list[ConvertCost]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the memory table: peak traced Python memory, then KiB per node of each stage."""
    stages = _stages_present(results)
    head = ["model", "policy", "N", "nodes", "peak MiB", "peak KiB/node", *stages]
    rows_ = []
    for r in results:
        if r.error or r.peak_kib is None:
            continue
        n = r.nodes or 1
        rows_.append(
            [
                r.model,
                r.policy,
                _cell(r.ops),
                str(r.nodes),
                f"{r.peak_kib / 1024:.1f}",
                f"{r.peak_kib / n:.1f}",
                *[f"{r.stage_kib[s] / n:.2f}" if s in r.stage_kib else "-" for s in stages],
            ]
        )
    return head, rows_


def _md_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def convert_cost_markdown(results: list[ConvertCost], machine: dict[str, Any] | None = None) -> str:
    parts = []
    if machine:
        parts.append("Machine: " + ", ".join(f"{k}: {v}" for k, v in machine.items()))
    parts.append(
        "Time (total and per stage: wall ms per node; cpu ms/node: this process's CPU time, all stages, robust "
        "to other load; verification kept apart):\n\n" + _md_table(*convert_cost_rows(results))
    )
    mem = convert_memory_rows(results)
    if mem[1]:
        parts.append("Peak traced Python memory (KiB per node of each stage):\n\n" + _md_table(*mem))
    lin = linearity(results)
    if lin:
        parts.append(
            "Linearity (CPU ms/node at the largest N over the smallest; 1.0 = linear): "
            + ", ".join(f"{k}: {v}" for k, v in lin.items())
        )
    notes = [f"{r.model} ({r.policy}): {r.note}" for r in results if r.note]
    if notes:
        parts.append("\\* " + "; ".join(notes))
    return "\n\n".join(parts) + "\n"


def convert_cost_rich(results: list[ConvertCost]) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, (head, body) in (
        ("conversion cost: ms per node", convert_cost_rows(results)),
        ("conversion cost: peak Python memory, KiB per node", convert_memory_rows(results)),
    ):
        if not body:
            continue
        table = Table(title=title)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 else "right")
        for row in body:
            table.add_row(*row)
        tables.append(table)
    return tables


def write_convert_outputs(
    results: list[ConvertCost], out_dir: str | os.PathLike, machine: dict[str, Any]
) -> list[Path]:
    """convert_cost.json and convert_cost.md in ``out_dir``."""
    from precast.io import atomic_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine,
        "linearity": linearity(results),
        "results": [asdict(r) | {"total_ms": r.total_ms} for r in results],
    }
    with atomic_path(out / "convert_cost.json") as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
    with atomic_path(out / "convert_cost.md") as tmp:
        tmp.write_text("# precast conversion cost per node\n\n" + convert_cost_markdown(results, machine))
    return [out / "convert_cost.json", out / "convert_cost.md"]


def profile_convert(ep: Any, policy: str | None, top: int = 25) -> str:
    """cProfile of ``precast.convert(ep, policy=policy, verify=False)``: the top functions by cumulative time
    (precast's own) and by own time (everything), as text. Profiling slows fake-tensor code ~2-3x: read shares,
    not absolute times."""
    import cProfile
    import io
    import pstats

    import precast

    prof = cProfile.Profile()
    prof.enable()
    precast.convert(ep, policy=policy, verify=False)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(r"precast", top)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()
