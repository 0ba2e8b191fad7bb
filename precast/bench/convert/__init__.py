"""``precast bench --convert``: the cost of the conversion itself, stage by stage.

- ``cost``: ``precast.convert`` observed stage by stage (ms and peak traced Python memory per node):
  ``run_convert_bench`` -> ``ConvertCost`` rows, ``linearity``, ``profile_convert``.
- ``gb``: ``--llama``: seconds per GB of weights and resident memory above them, one fresh process per
  (size, policy): ``run_gb_bench`` -> ``GbCost`` rows, ``gb_markdown``, ``write_gb_outputs``.
- ``programs``: the programs converted: the synthetic chain, the real architectures.
- ``models``: those real architectures (small configs, random weights, nothing downloaded).
"""

from precast.bench.convert.cost import (
    CHAIN_SIZES,
    CONVERT_POLICIES,
    ConvertCost,
    StageClock,
    linearity,
    measure_convert_cost,
    observed_convert,
    profile_convert,
    run_convert_bench,
)
from precast.bench.convert.gb import LLAMA_SHAPES, GbCost, gb_markdown, run_gb_bench, write_gb_outputs
from precast.bench.convert.programs import chain_program, export_for_bench, model_programs, real_models

__all__ = [
    "CHAIN_SIZES",
    "CONVERT_POLICIES",
    "LLAMA_SHAPES",
    "ConvertCost",
    "GbCost",
    "StageClock",
    "chain_program",
    "export_for_bench",
    "gb_markdown",
    "linearity",
    "measure_convert_cost",
    "model_programs",
    "observed_convert",
    "profile_convert",
    "real_models",
    "run_convert_bench",
    "run_gb_bench",
    "write_gb_outputs",
]
