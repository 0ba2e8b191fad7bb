"""The OpenVINO variants of ``precast bench``: OpenVINO's own default on the fp32 program, and precast's conversion
run as precast decided (``precast.compile(program, backend="openvino")``).

  ov_default   the model with its autocast regions off, compiled with OpenVINO's default precision hint (bf16
               on CPUs with native bf16: it lowers whatever its own heuristics allow)
  ov_precast   ``precast.convert(model, inputs)`` (the model's regions at --dtype) compiled with
               ``precast.compile(backend="openvino")``'s hint (see precast.backends.openvino.precision), so
               OpenVINO runs the dtypes the graph states; the note carries the plan check's summary

Needs ``pip install 'precast[openvino]'``; without it both rows say so. Policy ``auto`` times torch's kernels
(eager / AOTInductor), not OpenVINO's: its row is ``auto_aoti``.

Input: the model, its inputs, the fp32-program builder. Output: a forward callable and the row's facts (compile
time, IR weight size, the plan check).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

OV_VARIANTS = ("ov_default", "ov_precast")


def build_ov_variant(
    variant: str, model: torch.nn.Module, inputs: tuple, fp32_program: Callable, res: Any
) -> Callable[[], Any]:
    """Compile the variant's program with OpenVINO, fill ``res`` (compile_s, package_mb: the weights the IR
    would hold, note) and return a forward callable."""
    import precast
    from precast.backends.openvino.ir_files import weight_bytes
    from precast.backends.openvino.model import compile_openvino

    started = time.perf_counter()
    if variant == "ov_default":
        program, note = fp32_program(model, inputs)
        compiled = compile_openvino(program, precision_hint=None, warn=False)
        res.note = "; ".join(x for x in (note, "OpenVINO's default precision hint") if x)
    else:
        compiled = compile_openvino(precast.convert(model, inputs).program)
        res.note = f"plan: {compiled.plan.summary()}"
    res.compile_s = round(time.perf_counter() - started, 2)
    res.package_mb = round(sum(weight_bytes(compiled.ov_model).values()) / 2**20, 2)
    return lambda m=compiled, x=inputs: m(*x)
