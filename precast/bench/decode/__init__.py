"""LLM decode on a CPU, measured: ``precast bench --llm``'s harness (and the source checkout's decode scripts').

- ``harness``: the forms measured interleaved at each thread count (``run_decode_bench``, ``interleaved``,
  ``InProcess``), the machine's bandwidth and load, the markdown table (``decode_markdown``).
- ``forms``: every decode form, one builder each (``build_variants``; ``register`` takes more builders: the
  source checkout's anchor harness adds OpenVINO's own export there).
- ``model``: the seeded Llama-shaped decoder (``Shape``, ``QUICK``, ``llama``, ``wrapped``), its export
  (``export_decoder``, ``decode_inputs``), the bytes a decode step reads (``read_bytes``).
- ``rss``: a form's resident memory in a fresh process.
"""

from precast.bench.decode.forms import VARIANTS, register
from precast.bench.decode.harness import (
    FORMS,
    MIN_REPEATS,
    InProcess,
    bandwidth_gbs,
    decode_markdown,
    interleaved,
    load_average,
    measure,
    ratios,
    run_decode_bench,
)
from precast.bench.decode.model import QUICK, Shape, decode_inputs, export_decoder, llama, read_bytes, wrapped

__all__ = [
    "FORMS",
    "MIN_REPEATS",
    "QUICK",
    "VARIANTS",
    "InProcess",
    "Shape",
    "bandwidth_gbs",
    "decode_inputs",
    "decode_markdown",
    "export_decoder",
    "interleaved",
    "llama",
    "load_average",
    "measure",
    "ratios",
    "read_bytes",
    "register",
    "run_decode_bench",
    "wrapped",
]
