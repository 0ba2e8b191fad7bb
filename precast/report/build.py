"""Building the report: per-op records from the decisions in ``node.meta["precast"]``, the casts left at run
time, weight bytes, and the program-level fields saved with the program (so ``precast.report(ep)`` rebuilds
the same report from a saved program).

Input: the converted graph / ``ExportedProgram``. Output: ``Report`` fields (``report.model``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable
from dataclasses import asdict

import torch
from torch.export import ExportedProgram

from precast.dtypes import dtype_name
from precast.errors import module_path, user_source_line
from precast.ir import diagnostics
from precast.ir.diagnostics import Diagnostic
from precast.ir.graph import constant_bytes, is_cast
from precast.ir.program import META_KEY, Program
from precast.numerics.tolerance.stage import tolerance_check
from precast.passes.runner import timed
from precast.pipeline.conversion import Conversion
from precast.policy.measurements import Calibration
from precast.policy.rules.options import RuleOptions
from precast.quant.forms import is_dequant
from precast.report.model import CastRecord, NodeRecord, Report, json_finite

# export's run-time checks: no precision of their own, not worth a row in the report
BOOKKEEPING = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


def record_decisions(graph: torch.fx.Graph) -> list[NodeRecord]:
    """NodeRecords from node.meta['precast'] (in memory), written also into custom meta for saved programs."""
    records = []
    for node in graph.nodes:
        decision = node.meta.get("precast")
        if node.op != "call_function" or decision is None or node.target in BOOKKEEPING:
            continue
        rec = NodeRecord(
            name=node.name,
            op=_op_name(node),
            dtype=dtype_name(decision.dtype),
            source=decision.source,
            rule=decision.rule,
            reason=decision.reason,
            module=module_path(node),
            location=user_source_line(node),
            region=decision.region,
            measured=decision.measured,
            limit=decision.limit,
        )
        records.append(rec)
        node.meta.setdefault("custom", {}).setdefault(META_KEY, {})["decision"] = asdict(rec)
    return records


def _concrete(dim) -> tuple[int, bool]:
    """(value, was_symbolic) for a shape entry: a symbolic dim takes its example value (the hint), or 1 when
    it has none (an unbacked, data-dependent size); the record is marked symbolic either way."""
    if isinstance(dim, int):
        return dim, False
    node = getattr(dim, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint), True
    env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
    value = expr.xreplace(env.var_to_val) if env is not None and expr is not None else None
    return (int(value), True) if getattr(value, "is_number", False) else (1, True)


def runtime_casts(graph: torch.fx.Graph) -> list[CastRecord]:
    """One CastRecord per cast node left in ``graph``, with its bytes moved (from the nodes' meta values)."""
    out = []
    for node in graph.nodes:
        if not is_cast(node) or is_dequant(node):  # a stored weight's decompression: not an activation
            continue
        src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        dims = [_concrete(d) for d in val.shape]
        numel = math.prod(d for d, _ in dims)
        in_size = src.dtype.itemsize if isinstance(src, torch.Tensor) else val.dtype.itemsize
        out.append(
            CastRecord(
                name=node.name,
                src_dtype=dtype_name(src.dtype) if isinstance(src, torch.Tensor) else None,
                dtype=dtype_name(val.dtype),
                shape=[d for d, _ in dims],
                bytes=numel * (in_size + val.dtype.itemsize),
                symbolic=any(s for _, s in dims),
                module=module_path(node),
                location=user_source_line(node),
            )
        )
    return out


def write_program_info(ep: ExportedProgram, rep: Report) -> None:
    """Store the report's diagnostics and allowed codes with the program (custom meta, saved by
    torch.export.save), so ``precast.report`` on a saved program shows them."""
    first = next((n for n in ep.graph.nodes if n.op == "call_function"), None)
    if first is None:
        return
    info = first.meta.setdefault("custom", {}).setdefault(META_KEY, {}).setdefault("program", {})
    info["diagnostics"] = [asdict(d) for d in rep.diagnostics]
    info["allowed"] = list(rep.allowed)
    if rep.verification:
        info["verification"] = json_finite(rep.verification)
    if rep.weights:
        info["weights"] = rep.weights


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def _owns_decision(node: torch.fx.Node, decision: dict) -> bool:
    """Whether a stored decision is this node's own record. torch.export.save gives the ``getitem`` nodes of
    an op with several outputs (unbind, split, var_mean, max.dim) a copy of the op's custom meta; the op's own
    node is the one whose name the record carries, so each op is listed once."""
    return node.target is not operator.getitem and decision.get("name", node.name) == node.name


def report(ep: ExportedProgram) -> Report:
    """Rebuild a Report from a converted program (in memory or loaded with torch.export.load)."""
    from precast.ir.graph import constant_bytes
    from precast.ir.program import Program, constant_sources

    rep = Report()
    for node in ep.graph.nodes:
        entry = (node.meta.get("custom") or {}).get(META_KEY) or {}
        if "decision" in entry and _owns_decision(node, entry["decision"]):
            rep.nodes.append(NodeRecord(**entry["decision"]))
        if "program" in entry:
            for k, v in entry["program"].items():
                if k == "diagnostics":
                    v = [Diagnostic(**d) for d in v]
                if hasattr(rep, k):
                    setattr(rep, k, v)
    rep.casts = runtime_casts(ep.graph)
    rep.casts_runtime = len(rep.casts)
    rep.weight_bytes_after = constant_bytes(Program(ep))
    sources = constant_sources(ep)
    if not rep.weight_bytes_before:
        before: dict[str, int] = {}
        seen = set()
        for src in sources.values():
            if src.original in seen:
                continue
            seen.add(src.original)
            value = ep.state_dict.get(src.stored, ep.constants.get(src.stored))
            if isinstance(value, torch.Tensor):
                key = dtype_name(src.original_dtype) or "?"
                before[key] = before.get(key, 0) + value.numel() * src.original_dtype.itemsize
        rep.weight_bytes_before = before
    return rep


def new_report(state: Conversion, allow: Iterable[str]) -> Report:
    """The report of a conversion once its program is captured: policy, dtype, device, regions, allowed codes,
    the weight bytes before conversion."""
    policy = None if state.policy is None else str(state.policy.name)
    rep = Report(policy=policy, dtype=dtype_name(state.low) if policy else None, device_type=state.device)
    rep.regions = [region_dict(r) for r in state.regions]
    rep.allowed = diagnostics.parse_allow(allow)
    rep.weight_bytes_before = constant_bytes(state.program)
    return rep


def unchanged_report(rep: Report) -> Report:
    """Nothing converted: the weights are as they were."""
    rep.weight_bytes_after = dict(rep.weight_bytes_before)
    return rep


def fill_report(state: Conversion, rep: Report) -> None:
    """The report stage: per-op records, run-time casts, weight bytes and what ``lower`` did, from the final
    lowering; program-level fields saved with the program; then, for a policy with rules options, the ops the
    rules kept fp32 and the tolerance search's check of the converted program."""
    lowered = state.lowered
    st = lowered.stats
    rep.decomposed = st.decomposed
    rep.casts_folded, rep.casts_simplified = st.casts_folded, st.casts_simplified
    rep.constants_created, rep.constants_dropped = st.constants_created, st.constants_dropped
    rep.cache = st.caches.to_json() if st.caches is not None else {}
    rep.weight_formats = st.weights.to_json() if st.weights is not None else []
    rep.verification = {**rep.verification, **state.verification}
    with timed("report"):
        rep.nodes = record_decisions(lowered.program.graph)
        rep.casts = runtime_casts(lowered.program.graph)
        rep.casts_runtime = len(rep.casts)
        rep.weight_bytes_after = constant_bytes(lowered.program)
        _record_program_info(lowered.program, rep)
    binding = state.binding
    if binding is not None and isinstance(binding.options, RuleOptions):
        rules_notes(rep, binding.calibration, binding.options)
    if binding is not None and binding.search is not None:
        with timed("tolerance_check"):
            tolerance_check(lowered.exported, binding.search, binding.calibration, rep, rep.verification)


def _record_program_info(program: Program, rep: Report) -> None:
    """Program-level report fields go on the first op node's custom meta (placeholder meta is not saved)."""
    first = next((n for n in program.graph.nodes if n.op == "call_function"), None)
    if first is None:
        return
    info = {
        "policy": rep.policy,
        "dtype": rep.dtype,
        "device_type": rep.device_type,
        "regions": rep.regions,
        "casts_folded": rep.casts_folded,
        "casts_simplified": rep.casts_simplified,
        "weight_bytes_before": rep.weight_bytes_before,
        "decomposed": rep.decomposed,
        "cache": rep.cache,
        "weight_formats": rep.weight_formats,
        "weight_budget": rep.weight_budget,
    }
    first.meta.setdefault("custom", {}).setdefault(META_KEY, {})["program"] = info


def region_dict(region) -> dict:
    d = dataclasses.asdict(region)
    d["dtype"] = dtype_name(region.dtype)
    return d


def warn_flushed(rep: Report, cal: Calibration | None, opts: RuleOptions) -> None:
    """Ops left in the low dtype (by include_nodes/include_ops or an autocast region) whose outputs flush to
    zero or go subnormal there: the conversion may return zeros, so say so."""
    if cal is None or opts.data_min is None:
        return
    low = dtype_name(opts.low)
    hit = [
        (r, cal.stats[r.name])
        for r in rep.nodes
        if r.dtype == low and r.name in cal.stats and 0 < cal.stats[r.name].absmax < opts.data_min
    ]
    if hit:
        rep.diagnostics.append(
            Diagnostic(
                "warning",
                "flush-to-zero",
                f"{len(hit)} op(s) run in {low} although their outputs (absmax below {opts.data_min:.3g}) are "
                f"subnormal or flush to zero there: "
                + "; ".join(f"{r.name} (absmax {st.absmax:.3g}, {r.rule})" for r, st in hit[:10])
                + ("; ..." if len(hit) > 10 else ""),
                node=hit[0][0].name,
                location=hit[0][0].location,
            )
        )


def rules_notes(rep: Report, cal: Calibration | None, opts: RuleOptions) -> None:
    """After a rules conversion: which ops the rules kept in fp32 (info) and which low ops flush to zero."""
    warn_flushed(rep, cal, opts)
    kept = [r for r in rep.nodes if r.source in ("rules", "user") and r.dtype == "fp32"]
    if kept:
        diagnostics.record(
            rep,
            "kept-fp32",
            f"{len(kept)} op(s) kept in fp32 by rules: "
            + "; ".join(
                f"{r.name} ({r.reason})" + (f" at {r.location}" if r.location else "") for r in kept[:20]
            )
            + ("; ..." if len(kept) > 20 else ""),
        )
