"""The graph rewrites, one per module, each a function over a ``Program`` returning its stats, and ``lower``,
which runs them in order through the stage runner (``precast.passes.runner``: times, lints and fake-propagates
each). ``STAGES``: every stage name a conversion reports, in the order ``precast.api.convert_with`` runs them
(the driver's steps in ``precast.pipeline``, the measurements in ``precast.numerics``, the rewrites here):

  capture      module/program -> ExportedProgram (policy torch on a module: traced under torch.autocast)
  program_copy ExportedProgram -> Program (private graph copy, written constants cloned)
  regions      autocast regions inlined, their ops tagged (``inline_regions``)
  checks       control flow, unused regions, no-op regions: diagnostics before any decision
  calibrate    policies that bind (rules, auto, yours): value statistics from the calibration data
  latency      auto: per matmul/conv/attention op, fp32 vs low latency on the device
  tolerance    the tolerance search (``tolerance=``): the ops to keep fp32, found by simulating with ``lower``
  hold_caches  cache_dtype=: the caches the program stores into held in the low dtype (``passes/caches.py``)
  classify     a Decision per op in ``node.meta["precast"]``; composites decomposed as eager autocast would
  rewrite      one cast per (producer, dtype, version) (``insert_casts``)
  fold         casts of read-only constants computed once (``fold_constant_casts``)
  simplify     exact cast rewrites to a fixed point (``simplify_casts``)
  quantize     weight_format=: linear and embedding weights stored in 8/4 bits, dequantized in the graph
               (``quantize_weights``)
  restore_io   keep_io_types: outputs cast back to the input program's dtypes
  export       the Program as a standard ExportedProgram
  after        the policy's after-lowering checks: the device fallback (ops without a low-precision kernel
               on the device kept fp32, converted again), auto's end-to-end confirmation
  report       the report filled from the final program (``precast.report.build``)
  verify       converted vs reference, on private copies of the state each writes

``lower`` runs classify through restore_io: the conversion and the tolerance search's simulation use it alike.

Input: a Program, a policy (decider), a diagnostic log. Output: ``LowerStats`` from ``lower``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from precast.errors import where
from precast.ir import diagnostics
from precast.ir.diagnostics import DiagnosticLog
from precast.ir.program import Program
from precast.passes.caches import HeldCaches, hold_caches
from precast.passes.classify import classify as classify_program  # keeps the submodule name free
from precast.passes.classify import classify_error_handler
from precast.passes.fold import CastCache, fold_constant_casts
from precast.passes.restore_io import restore_output_dtypes
from precast.passes.rewrite import insert_casts
from precast.passes.runner import run_stage
from precast.passes.simplify import simplify_casts
from precast.policy.autocast import UNKNOWN_CATEGORY
from precast.policy.base import Policy
from precast.policy.writes import WRITE_CAST_META
from precast.quant.graph import QuantizeResult, quantize_weights

# the names ``run_stage`` reports, in the order a conversion runs them (a test observes a rules conversion with
# tolerance and auto against this list); "check_pass" follows every rewriting stage
STAGES = (
    "capture",
    "program_copy",
    "inline_regions",
    "checks",
    "calibrate",
    "latency",
    "tolerance",
    "hold_caches",
    "classify",
    "insert_casts",
    "fold_constant_casts",
    "simplify_casts",
    "quantize_weights",
    "restore_output_dtypes",
    "export",
    "device_check",
    "auto_confirm",
    "report",
    "tolerance_check",
    "verify",
)


@dataclass
class LowerStats:
    """What ``lower`` did: ops decided, composites decomposed, casts folded/simplified, constants made."""

    decomposed: list[str] = field(default_factory=list)
    casts_folded: int = 0
    casts_simplified: int = 0
    constants_created: list[str] = field(default_factory=list)
    constants_dropped: list[str] = field(default_factory=list)
    outputs_restored: int = 0
    caches: HeldCaches | None = None  # cache_dtype=: the caches held in the low dtype
    weights: QuantizeResult | None = None  # weight_format=: each weight's storage


def record_unknown_categories(program: Program, log: DiagnosticLog) -> None:
    """One warning naming the ops eager autocast would handle on this torch that precast has no category for."""
    nodes = [
        n for n in program.graph.nodes if getattr(n.meta.get("precast"), "rule", None) == UNKNOWN_CATEGORY
    ]
    if not nodes:
        return
    ops = sorted({str(n.target) for n in nodes})
    diagnostics.record(
        log,
        "autocast-category-unknown",
        f"torch {torch.__version__} registers autocast kernels precast has no category for: {', '.join(ops)} "
        f"({len(nodes)} node(s), first {nodes[0].name}); they run as written",
        nodes[0],
    )


def record_write_casts(program: Program, log: DiagnosticLog) -> None:
    """One info per write whose value precast cast to its destination's dtype (precast/policy/writes.py)."""
    for node in program.graph.nodes:
        write = node.meta.get(WRITE_CAST_META)
        if write is not None:
            diagnostics.record(log, "write-cast", f"{where(node)}: {write.describe()}", node)


def lower(
    program: Program,
    policy: Policy | None,
    log: DiagnosticLog,
    *,
    restore: list[torch.dtype | None] | None = None,
    keep_io: bool = False,
    casts: CastCache | None = None,
) -> LowerStats:
    """classify -> insert casts -> fold -> simplify (-> restore output dtypes when ``restore`` is given: the
    input program's output dtypes), each checked by the runner. Diagnostics go to ``log``. ``casts``: constant
    casts shared by several lowerings of one program (the sensitivity estimator's, a tolerance search's)."""
    stats = LowerStats()
    if program.cache_dtype is not None:
        stats.caches = run_stage(program, "hold_caches", hold_caches, program.cache_dtype, check=True)
    result = run_stage(program, "classify", classify_program, policy, classify_error_handler(log))
    stats.decomposed = result.decomposed or []
    record_unknown_categories(program, log)
    record_write_casts(program, log)
    run_stage(program, "insert_casts", insert_casts, check=True)
    fold = run_stage(program, "fold_constant_casts", fold_constant_casts, casts, check=True)
    stats.casts_folded, stats.constants_created, stats.constants_dropped = (
        fold.folded,
        fold.created,
        fold.dropped,
    )
    if fold.written:
        diagnostics.record(
            log,
            "written-constant-not-folded",
            f"{len(fold.written)} constant(s) the program writes keep their casts at run time (their value "
            f"changes from call to call, so a cast copy made once would go stale): {', '.join(fold.written)}",
        )
    for name, count in fold.clamped.items():
        diagnostics.record(
            log,
            "fp16-clamped",
            f"constant {name}: {count} value(s) beyond float16's range stored clamped to ±65504 (not inf)",
            fix="keep the ops reading it in float32 (init_max, exclude_nodes) if the clamp matters",
        )
    simple = run_stage(
        program, "simplify_casts", lambda p: simplify_casts(p.graph, p.input_spec, p.output_specs), check=True
    )
    stats.casts_simplified = simple.removed
    if program.weight_rules is not None:
        stats.weights = run_stage(
            program, "quantize_weights", quantize_weights, program.weight_rules, check=True
        )
        if stats.weights.skipped:
            diagnostics.record(
                log,
                "weight-not-quantized",
                f"{len(stats.weights.skipped)} weight(s) stay float: "
                + "; ".join(f"{k} {v}" for k, v in sorted(stats.weights.skipped.items())[:5]),
            )
    if restore is not None:
        stats.outputs_restored = run_stage(
            program, "restore_output_dtypes", restore_output_dtypes, restore, keep_io, check=True
        )
    return stats
