"""ONNX Runtime (CPU) for exported .onnx files: sessions with one-line errors naming the op ONNX Runtime lacks a
low-precision kernel for (and the route that works), runs, and the benchmark measurements ``precast bench``
uses (median latency, file size, resident memory of a fresh process).

Input: an .onnx path (``precast.backends.onnx.export_onnx``) and inputs. Output: sessions, torch tensors, stats.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from precast.backends.onnx import require_modules
from precast.errors import PrecastError, first_line

_ORT_FAILURE = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")


_LOW = {10: "float16", 16: "bfloat16"}  # onnx.TensorProto element types


# ---- ONNX Runtime -------------------------------------------------------------------------------------------
def ort_session(path: str | os.PathLike, *, threads: int | None = None) -> Any:
    """An ``onnxruntime.InferenceSession`` on the CPU provider.

    A missing CPU kernel (``NOT_IMPLEMENTED``: ONNX Runtime has few bfloat16 kernels on CPU) becomes a one-line
    PrecastError naming the op(s) and what works instead.
    """
    require_modules("onnxruntime")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the session's warnings are not ours to show
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise PrecastError(_ort_message(path, exc)) from exc


def _ort_message(path: str | os.PathLike, exc: Exception) -> str:
    text = first_line(exc)
    m = _ORT_FAILURE.search(str(exc))
    if m is None:
        return f"{path}: ONNX Runtime cannot load it: {text[:300]}"
    op, version, node = m.groups()
    low = _low_precision_consumers(path)
    dtypes = sorted({d for d, _ in low})
    if not dtypes:
        return f"{path}: ONNX Runtime's CPU provider has no kernel for {op}({version}) (node '{node}'): {text[:200]}"
    others = sorted({o for _, o in low} - {op})
    also = f"; {'/'.join(dtypes)} also feeds {', '.join(others)}" if others else ""
    if "bfloat16" in dtypes:
        route = (
            "convert with dtype=torch.float16 for ONNX Runtime CPU (it runs float16 models, computing ops that "
            "lack a float16 kernel in float32), or serve the bfloat16 program with torch.compile or "
            "precast.compile (AOTInductor)"
        )
    else:
        route = (
            "keep that op in float32 (precast.convert(..., exclude_ops=[...])), or serve the program with "
            "torch.compile or precast.compile (AOTInductor)"
        )
    return (
        f"{path}: ONNX Runtime's CPU provider has no {'/'.join(dtypes)} kernel for {op}({version}) "
        f"(node '{node}'{also}); {route}"
    )


def _low_precision_consumers(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(element type, op type) for every non-Cast node reading a float16/bfloat16 value."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    types.update({i.name: i.data_type for i in g.initializer})
    out = set()
    for node in g.node:
        if node.op_type == "Cast":
            continue
        for name in node.input:
            if types.get(name) in _LOW:
                out.add((_LOW[types[name]], node.op_type))
    return sorted(out)


def ort_can_run(path: str | os.PathLike) -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for every node (the session can be created)."""
    try:
        ort_session(path)
    except PrecastError:
        return False
    return True


def _feed(session: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    leaves = [x for x in torch.utils._pytree.tree_leaves(tuple(inputs)) if isinstance(x, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    if len(leaves) != len(names):
        raise PrecastError(
            f"run_onnx: {len(leaves)} tensor input(s) given, the model takes {len(names)} ({', '.join(names)})"
        )
    feed = {}
    for name, x in zip(names, leaves, strict=True):
        if x.dtype == torch.bfloat16:
            raise PrecastError(f"run_onnx: input {name} is bfloat16, which numpy cannot hold; pass float32")
        feed[name] = x.detach().cpu().contiguous().numpy()
    return feed


def _to_torch(a: Any) -> torch.Tensor:
    if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: reinterpret the bits
        return torch.from_numpy(a.view("uint16").copy()).view(torch.bfloat16)
    return torch.from_numpy(a)


def run_onnx(model: str | os.PathLike | Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run an ``.onnx`` file (or an ``ort_session``) on ONNX Runtime's CPU provider; outputs as torch tensors."""
    session = model if hasattr(model, "get_inputs") else ort_session(model)
    feed = _feed(session, inputs)
    try:
        outs = session.run(None, feed)
    except Exception as exc:  # onnxruntime's InvalidArgument / Fail: wrong shapes or dtypes for this model
        raise PrecastError(f"run_onnx: ONNX Runtime failed: {first_line(exc)[:300]}") from exc
    return [_to_torch(a) for a in outs]


def ort_runner(model: str | os.PathLike | Any, inputs: Sequence[Any]) -> Callable[[], list[Any]]:
    """A zero-argument callable running one forward (inputs converted once), for latency timing."""
    session = model if hasattr(model, "get_inputs") else ort_session(model)
    feed = _feed(session, inputs)
    return lambda: session.run(None, feed)


# ---- benchmark ----------------------------------------------------------------------------------------------
_RSS_SCRIPT = r"""
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

    session = ort_session(path)
    feed_path = Path(workdir) / "ort_rss_inputs.npz"
    np.savez(feed_path, **_feed(session, inputs))
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path), str(feed_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise PrecastError(
            f"ort_load_rss_mb: the fresh process failed: {first_line(proc.stderr or 'no output')}"
        )
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return round(data["after"] - data["before"], 1)


def bench_ort(
    path: str | os.PathLike,
    inputs: Sequence[Any],
    repeats: int = 20,
    *,
    workdir: str | os.PathLike | None = None,
    measure_rss: bool = True,
) -> dict[str, Any]:
    """Median latency (ms) over ``repeats`` samples, file size (MB), and RSS (MB) of a fresh process.

    Each sample times enough back-to-back calls to last ~20 ms (``precast.bench.interleaved_latency``'s rule),
    after 3 warm-up calls. To interleave with other variants, time ``ort_runner(path, inputs)`` in
    ``precast.bench.interleaved_latency`` instead.
    """
    import tempfile

    run = ort_runner(path, inputs)
    for _ in range(3):
        run()
    t = time.perf_counter()
    run()
    inner = max(1, min(1000, int(0.02 / max(time.perf_counter() - t, 1e-6))))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            run()
        samples.append((time.perf_counter() - t) * 1e3 / inner)
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
