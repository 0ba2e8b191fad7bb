"""``precast bench``: eager vs AOTInductor, ONNX Runtime and OpenVINO variants vs precast on a model,
(``--convert``) the cost of the conversion itself, and (``--llm``) LLM decode. Only what the command runs ships
here; the benchmarks' own helpers (real-weight models, OpenVINO's anchor environment) are the source checkout's.

Modules and subpackages (each opens with what it takes and returns):
  factories     ``--model`` specs -> (model, inputs); the autocast switch; the fp32 reference
  models        the short ``--model`` names (seeded random weights)
  measure       latency (interleaved repeats), output error, casts per forward, RSS in a fresh process
  variants      the variants built and run on one model: ``run_bench`` -> ``Result`` rows (``openvino``,
                ``ort``: those engines' variants)
  output        rich tables, markdown, JSON, PNG
  convert/      ``--convert``: ``precast.convert`` observed stage by stage, per node and per GB of weights
  decode/       ``--llm``: the decode forms, measured interleaved

Input: model specs and options. Output: ``Result`` rows (see ``variants``/``convert``) and their files.
"""

from __future__ import annotations

from precast.bench.convert import (
    CHAIN_SIZES,
    CONVERT_POLICIES,
    ConvertCost,
    StageClock,
    chain_program,
    export_for_bench,
    linearity,
    measure_convert_cost,
    model_programs,
    observed_convert,
    profile_convert,
    real_models,
    run_convert_bench,
)
from precast.bench.factories import build, default_models, fp32_reference, regions, resolve, retarget
from precast.bench.measure import (
    aoti_cast_kernels,
    eager_cast_ops,
    interleaved_latency,
    load_rss_mb,
    machine_info,
    resize_batch,
)
from precast.bench.output import (
    convert_cost_markdown,
    convert_cost_rich,
    convert_cost_rows,
    convert_memory_rows,
    to_markdown,
    to_rich_table,
    write_convert_outputs,
    write_outputs,
)
from precast.bench.variants import BASELINE, VARIANTS, Result, build_variants, run_bench

__all__ = [
    "BASELINE",
    "CHAIN_SIZES",
    "CONVERT_POLICIES",
    "VARIANTS",
    "ConvertCost",
    "Result",
    "StageClock",
    "aoti_cast_kernels",
    "build",
    "build_variants",
    "chain_program",
    "convert_cost_markdown",
    "convert_cost_rich",
    "convert_cost_rows",
    "convert_memory_rows",
    "default_models",
    "eager_cast_ops",
    "export_for_bench",
    "fp32_reference",
    "interleaved_latency",
    "linearity",
    "load_rss_mb",
    "machine_info",
    "measure_convert_cost",
    "model_programs",
    "observed_convert",
    "profile_convert",
    "real_models",
    "regions",
    "resize_batch",
    "resolve",
    "retarget",
    "run_bench",
    "run_convert_bench",
    "to_markdown",
    "to_rich_table",
    "write_convert_outputs",
    "write_outputs",
]
