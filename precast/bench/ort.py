"""The ONNX Runtime variants of ``precast bench``: the same model's fp32 program and its precast conversion,
exported to ONNX (``precast.backends.onnx.export``) and run on ONNX Runtime's CPU provider.

  ort_fp32     the model with its autocast regions off, exported to .onnx: ONNX Runtime's own fp32 baseline
  ort_precast  ``precast.convert(model, inputs)`` (the model's regions at --dtype), exported to .onnx

ONNX Runtime's CPU provider has no bfloat16 kernels for Gemm/MatMul/Conv: with ``--dtype bf16`` the
``ort_precast`` row carries the one-line error naming the op and the route (``--dtype fp16``); see
docs/backends.md. Needs ``pip install 'precast[onnx]'``; without it both rows say so.

Input: the model, its inputs, a work folder. Output: a forward callable and the row's facts (file size, Cast
nodes, export time, the .onnx path for the fresh-process memory measurement); ``ort_load_rss_mb`` and
``bench_ort`` measure an .onnx file with the timers and the fresh-process memory of ``precast.bench.measure``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from precast.bench.measure import fresh_process_rss_mb, interleaved_latency
from precast.errors import PrecastError, first_line

ORT_VARIANTS = ("ort_fp32", "ort_precast")


def build_ort_variant(
    variant: str, model: torch.nn.Module, inputs: tuple, work: Path, fp32_program: Callable, res: Any
) -> Callable[[], Any]:
    """Export the variant's program to ``work/<variant>.onnx``, open an ONNX Runtime session, fill ``res``
    (package_mb, casts_per_forward, compile_s, onnx_path, note) and return a forward callable."""
    import precast
    from precast.backends.onnx.export import export_onnx
    from precast.backends.onnx.runtime import ort_session, run_onnx

    if variant == "ort_fp32":
        program, res.note = fp32_program(model, inputs)
    else:
        program = precast.convert(model, inputs).program
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{variant}.onnx"
    started = time.perf_counter()
    info = export_onnx(program, path)
    session = ort_session(path)  # a missing low-precision kernel: one line naming the op and the route
    res.compile_s = round(time.perf_counter() - started, 2)
    res.package_mb = round(info.size_bytes / 2**20, 2)
    res.casts_per_forward = info.casts
    res.onnx_path = str(path)
    return lambda s=session, x=inputs: run_onnx(s, x)


# the fresh process imports onnxruntime and numpy only, as a deployment would
_ORT_RSS_SCRIPT = r"""
import json, sys
import numpy as np
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import onnxruntime as ort
feed = dict(np.load(sys.argv[2]))
before = rss()
options = ort.SessionOptions()
options.log_severity_level = 3
s = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
s.run(None, feed)
print(json.dumps({"before": before, "after": rss()}))
"""


def ort_load_rss_mb(
    path: str | os.PathLike, inputs: Sequence[Any], workdir: str | os.PathLike
) -> float | None:
    """Resident memory (MiB) a fresh process (onnxruntime + numpy only) gains by creating the session and
    running one forward: the same measure ``precast bench`` takes for AOTInductor packages."""
    if not Path("/proc/self/status").exists():
        return None
    import numpy as np

    from precast.backends.onnx.runtime import ort_feed, ort_session

    feed_path = Path(workdir) / "ort_rss_inputs.npz"
    np.savez(feed_path, **ort_feed(ort_session(path), inputs))
    try:
        return fresh_process_rss_mb(_ORT_RSS_SCRIPT, str(path), str(feed_path))
    except RuntimeError as exc:
        raise PrecastError(f"ort_load_rss_mb: the fresh process failed: {first_line(exc)}") from exc


def bench_ort(
    path: str | os.PathLike,
    inputs: Sequence[Any],
    repeats: int = 20,
    *,
    workdir: str | os.PathLike | None = None,
    measure_rss: bool = True,
) -> dict[str, Any]:
    """Median latency (ms) over ``repeats`` samples, file size (MB), and RSS (MB) of a fresh process.

    Each sample times enough back-to-back calls to last ~20 ms, after 3 warm-up calls
    (``precast.bench.measure.interleaved_latency``, which also interleaves it with other variants).
    """
    from precast.backends.onnx.runtime import ort_runner

    samples = interleaved_latency({"ort": ort_runner(path, inputs)}, repeats)["ort"]
    rss = None
    if measure_rss:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            rss = ort_load_rss_mb(path, inputs, tmp)
    return {
        "latency_ms": round(statistics.median(samples), 4),
        "samples_ms": [round(s, 4) for s in samples],
        "file_mb": round(os.path.getsize(path) / 2**20, 3),
        "rss_mb": rss,
    }
