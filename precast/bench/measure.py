"""Measurements for ``precast bench``: latency, output error, casts per forward, resident memory, the machine.

- ``interleaved_latency(fns, repeats)`` -> per-call latency samples (ms) per callable: every repeat times each
  callable in turn, so drift (thermal, other load) hits all alike; CUDA events on GPU.
- errors come from ``precast.metrics.flat_error`` (the one home of error metrics).
- ``eager_cast_ops(fn)`` / ``aoti_cast_kernels(package)`` -> casts per forward, counted at dispatch (eager) or as
  calls to generated cast kernels in an AOTInductor package's wrapper.
- ``load_rss_mb(package, inputs, workdir)`` -> resident memory a *fresh process* gains by loading the package and
  running one forward (a subprocess of this interpreter; Linux only, else None).
- ``resize_batch(inputs, batch)``, ``to_device(obj, device)``, ``machine_info(device)``.

Input: callables, packages, devices. Output: milliseconds, megabytes, counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from precast import cpu


# ---- inputs and outputs -----------------------------------------------------------------------------------
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


def to_device(obj: Any, device: str) -> Any:
    """Every tensor in the pytree ``obj`` moved to ``device``."""
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


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


def fresh_process_rss_mb(script: str, *args: str) -> float:
    """Resident memory (MiB) ``script`` gains in a fresh interpreter (it prints ``{"before": MiB, "after": MiB}``
    as its last line); raises ``RuntimeError`` with the subprocess's error output when it fails."""
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr or "no output")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return round(data["after"] - data["before"], 1)


def load_rss_mb(package: str | os.PathLike, inputs: tuple, workdir: Path) -> float | None:
    """Resident memory (MiB) a fresh process gains by loading ``package`` and running one forward; None where
    /proc is missing or the subprocess fails."""
    if not Path("/proc/self/status").exists():
        return None
    args_path = workdir / "rss_inputs.pt"
    torch.save(to_device(inputs, "cpu"), args_path)
    try:
        return fresh_process_rss_mb(_RSS_SCRIPT, str(package), str(args_path))
    except RuntimeError:
        return None  # the table shows no figure for this variant


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
    """Per-call latency samples (ms) for each function, timed in turn ``repeats`` times (under no_grad, after
    3 warm-up calls each)."""
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


# ---- the machine ------------------------------------------------------------------------------------------
def machine_info(device: str = "cpu") -> dict[str, Any]:
    """torch version, CPU model and capability, cores/threads, load average (and the GPU on cuda)."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu_capability": cpu.capability(),
        "cpu": cpu.model_name(),
        # what decides bf16/fp16 speed (a VM's model name may not say)
        "low_precision_isa": cpu.low_precision_flags(),
    }
    info["cores"] = os.cpu_count()
    info["threads"] = torch.get_num_threads()
    with contextlib.suppress(OSError):
        info["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)  # other processes skew CPU timings
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
