"""The ONNX Runtime variants of ``precast bench``: the same model's fp32 program and its precast conversion,
exported to ONNX (``precast.backends.onnx``) and run on ONNX Runtime's CPU provider.

  ort_fp32     the model with its autocast regions off, exported to .onnx: ONNX Runtime's own fp32 baseline
  ort_precast  ``precast.convert(model, inputs)`` (the model's regions at --dtype), exported to .onnx

ONNX Runtime's CPU provider has no bfloat16 kernels for Gemm/MatMul/Conv: with ``--dtype bf16`` the
``ort_precast`` row carries the one-line error naming the op and the route (``--dtype fp16``); see
docs/backends.md. Needs ``pip install 'precast[onnx]'``; without it both rows say so.

Input: the model, its inputs, a work folder. Output: a forward callable and the row's facts (file size, Cast
nodes, export time, the .onnx path for the fresh-process memory measurement).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ORT_VARIANTS = ("ort_fp32", "ort_precast")


def build_ort_variant(
    variant: str, model: torch.nn.Module, inputs: tuple, work: Path, fp32_program: Callable, res: Any
) -> Callable[[], Any]:
    """Export the variant's program to ``work/<variant>.onnx``, open an ONNX Runtime session, fill ``res``
    (package_mb, casts_per_forward, compile_s, onnx_path, note) and return a forward callable."""
    import precast
    from precast.backends.onnx import export_onnx
    from precast.backends.onnx_runtime import ort_session, run_onnx

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
