"""Which precision hint OpenVINO compiles precast's program with, and the two corrections each hint needs so that
OpenVINO computes the dtypes the program states as well as it can.

Measured on OpenVINO 2026.4.1's CPU plugin (2-core AMD EPYC with avx512_bf16), all-MiniLM-L6-v2 batch 8 x 128:

- **Under the f32 hint a ``Convert`` layer f32 -> bf16 does not round to nearest.** It rounds up only when the last
  kept bit is 1: of the values whose discarded half is above one half, half are truncated (a quarter of all random
  values differ from torch's ``.to(torch.bfloat16)``, each by one bf16 ulp; tested bitwise). A cast OpenVINO fuses
  into an element-wise ``Subgraph`` rounds correctly; one it runs as a layer of its own (with a dynamic batch, or
  after a layer norm) does not. In MiniLM most casts precast writes before a bf16 op are such layers, so the program
  ran with a worse rounding than it states (cosine vs fp32 0.999979 instead of 0.999984). ``round_to_nearest`` puts Veltkamp's split in
  front of each such Convert: ``c = x * 65537; hi = c - (c - x)`` is ``x`` rounded to bf16's 8 significant bits,
  to nearest (ties aside, 1 in 65536 values), in f32 arithmetic, so the Convert that follows is exact. Where
  ``x * 65537`` overflows (|x| > 5.2e33) the split is skipped for that value (``Select``). It costs about 4% of the
  model's time. Under the bf16 hint the plugin's own conversions round to nearest, and the split must NOT be used:
  its f32 arithmetic would itself be lowered to bf16.
- **A bf16 ``ScaledDotProductAttention`` is decomposed in bf16**: the scores are rounded to bf16 before the softmax.
  torch's CPU kernel (what eager autocast and precast's plan mean by attention in bf16) multiplies in bf16 but
  keeps the scores and the softmax in fp32, and so does OpenVINO for an f32 attention under the bf16 hint.
  ``attention_in_f32`` gives the attention f32 inputs (exact upcasts of the bf16 values) and casts its output
  back to bf16, for the bf16 hint only (under the f32 hint it would compute the whole attention in f32: 8% slower).

``hints_to_try``: with ``precision_hint="auto"`` (the default), a program whose plan lowers ops to bf16, on a CPU
whose OpenVINO default is bf16 (native bf16), is compiled with the bf16 hint first: it runs at OpenVINO's own bf16
speed and rounds correctly. Under that hint OpenVINO may still lower an op precast kept in fp32 (its heuristics keep
only the graph's tail and some element-wise ops in fp32); the plan check (``openvino_plan.check_plan``) then finds
the override and the program is compiled again with the f32 hint, which honours every dtype the graph states.

Input: an ``openvino.Model`` converted from precast's program. Output: a corrected copy, and the hints to try.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HINTS = ("auto", "f32", "bf16", None)  # None: OpenVINO's own default (bf16 where native), no correction
VELTKAMP = 65537.0  # 2**16 + 1: splits an f32 significand (24 bits) into bf16's 8 bits and the 16 below
SPLIT_LIMIT = 3.4e38 / VELTKAMP  # beyond this x * 65537 overflows: those values are converted as they are


def native_bf16(core: Any) -> bool:
    """Whether OpenVINO's CPU plugin infers in bf16 by default here (a CPU with native bf16 arithmetic)."""
    hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    return str(getattr(hint, "get_type_name", lambda: hint)()) == "bf16"


def hints_to_try(precision_hint: str | None, planned: set[str], core: Any) -> list[str | None]:
    """The hints to compile with, in order (the first whose plan check finds no override is kept)."""
    if precision_hint != "auto":
        return [precision_hint]
    if "bf16" in planned and "fp16" not in planned and native_bf16(core):
        return ["bf16", "f32"]
    return ["f32"]


def prepare(model: Any, hint: str | None) -> Any:
    """A copy of ``model`` corrected for ``hint`` (the model itself is kept as converted: it is what ``save``
    writes)."""
    if hint == "f32":
        model = model.clone()
        round_to_nearest(model)
    elif hint == "bf16":
        model = model.clone()
        attention_in_f32(model)
    return model


def _is_f32_to_bf16(op: Any) -> bool:
    import openvino as ov

    return (
        op.get_type_name() == "Convert"
        and op.get_input_element_type(0) == ov.Type.f32
        and op.get_output_element_type(0) == ov.Type.bf16
    )


def round_to_nearest(model: Any) -> int:
    """Veltkamp's split in front of every Convert f32 -> bf16 (see the module docstring); returns how many."""
    import openvino.opset13 as ops

    converts = [op for op in model.get_ordered_ops() if _is_f32_to_bf16(op)]
    for op in converts:
        x = op.input_value(0)
        c = ops.multiply(x, ops.constant(np.float32(VELTKAMP)))
        hi = ops.subtract(c, ops.subtract(c, x))
        small = ops.less(ops.abs(x), ops.constant(np.float32(SPLIT_LIMIT)))
        op.input(0).replace_source_output(ops.select(small, hi, x).output(0))
    if converts:
        model.validate_nodes_and_infer_types()
    return len(converts)


def attention_in_f32(model: Any) -> int:
    """Every ScaledDotProductAttention with bf16 inputs given f32 inputs and its output cast back to bf16 (see the
    module docstring); returns how many."""
    import openvino as ov
    import openvino.opset13 as ops

    found = [
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() == "ScaledDotProductAttention" and op.get_output_element_type(0) == ov.Type.bf16
    ]
    for op in found:
        readers = list(op.output(0).get_target_inputs())
        for i in range(op.get_input_size()):
            if op.get_input_element_type(i) == ov.Type.bf16:
                op.input(i).replace_source_output(ops.convert(op.input_value(i), "f32").output(0))
        op.validate_and_infer_types()
        back = ops.convert(op.output(0), "bf16")
        for reader in readers:
            reader.replace_source_output(back.output(0))
    if found:
        model.validate_nodes_and_infer_types()
    return len(found)
