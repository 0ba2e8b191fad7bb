"""precast.Report: one record per node and a summary per program; built at conversion or from a saved program.

Input: records built by ``report/build.py``. Output: ``Report`` with views, ``summary()``, ``to_json()``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from precast.ir.diagnostics import DiagnosticLog

SCHEMA_VERSION = 1


@dataclass
class NodeRecord:
    name: str
    op: str
    dtype: str | None  # dtype the op computes/outputs in after conversion
    source: str  # who decided: region, torch, rules, user, none
    rule: str  # autocast category or rule name
    reason: str
    module: str
    location: str | None  # user's source line, file.py:LINE
    region: int | None = None
    measured: float | None = None
    limit: float | None = None


@dataclass
class CastRecord:
    """A cast left in the converted graph: work done on every forward."""

    name: str
    src_dtype: str | None
    dtype: str | None
    shape: list[int]
    bytes: int  # input + output bytes moved per forward (symbolic dims at their example/hint value)
    symbolic: bool  # the shape had symbolic dims
    module: str
    location: str | None


@dataclass
class Report(DiagnosticLog):
    """What a conversion did and why: per-op decisions, casts, weight bytes, diagnostics, verification."""

    nodes: list[NodeRecord] = field(default_factory=list)
    policy: str | None = None
    dtype: str | None = None
    device_type: str | None = None
    regions: list[dict] = field(default_factory=list)
    casts_runtime: int = 0  # cast nodes left in the converted graph (activations changing dtype)
    casts_folded: int = 0  # casts of constants computed once at conversion
    casts_simplified: int = 0
    weight_bytes_before: dict[str, int] = field(default_factory=dict)
    weight_bytes_after: dict[str, int] = field(default_factory=dict)
    constants_created: list[str] = field(default_factory=list)
    constants_dropped: list[str] = field(default_factory=list)
    decomposed: list[str] = field(default_factory=list)
    # cache_dtype=: {"dtype" (held in), "caches": [{"name" (the program's placeholder), "dtype_before",
    # "dtype_after", "bytes_before", "bytes_after"}], "bytes_before", "bytes_after"} (docs/report.md)
    cache: dict = field(default_factory=dict)
    # weight_format=: one record per linear/embedding weight: {"weight" (original name), "names" (matched by),
    # "shape", "format" (float | int8 | int4-gN), "why", "bytes_before", "bytes_after", "reads", "stored"}
    weight_formats: list[dict] = field(default_factory=list)
    # weight_format=WeightBudget(...): {"budget", "metric", "estimate", "bytes", "bits_per_weight", "formats",
    # "probes", "positions", "seconds"}
    weight_budget: dict = field(default_factory=dict)
    # weights=: {"source", "output", "files", "tensors", "bytes_read", "bytes_written", "clamped", "seconds"}
    weights: dict = field(default_factory=dict)
    verification: dict = field(default_factory=dict)
    # precast export-llm: the converted decoder against the fp32 model on held-out text (precast/llm/accuracy.py):
    # {"reference", "text", "positions", "windows", "window", "kld", "top1", "top1_se", "ppl", "reference_ppl",
    # "seconds", "threads"}; {} when not measured
    accuracy: dict = field(default_factory=dict)
    casts: list[CastRecord] = field(default_factory=list)  # run-time casts (len == casts_runtime)

    @property
    def cast_bytes(self) -> int:
        """Estimated bytes moved per forward by run-time casts (read + write)."""
        return sum(c.bytes for c in self.casts)

    # ---- views -----------------------------------------------------------------------------------------
    def nodes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            key = n.dtype or "-"
            out[key] = out.get(key, 0) + 1
        return out

    def node(self, name: str) -> NodeRecord:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        d["nodes_by_dtype"] = self.nodes_by_dtype()
        d["cast_bytes"] = self.cast_bytes
        return json_finite(d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def summary(self) -> str:
        mb = 1024 * 1024
        before = sum(self.weight_bytes_before.values()) / mb
        after = sum(self.weight_bytes_after.values()) / mb
        lines = [
            f"policy: {self.policy or 'regions only'}"
            + (f" ({self.device_type}, {self.dtype})" if self.policy else ""),
            f"autocast regions lowered: {len(self.regions)}",
            f"ops: {len(self.nodes)}  by dtype: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.nodes_by_dtype().items())),
            f"casts folded into constants: {self.casts_folded}; casts left at run time: {self.casts_runtime}"
            f" (activations only, {_human_bytes(self.cast_bytes)} moved per forward); removed as redundant: "
            f"{self.casts_simplified}",
            f"weights: {before:.2f} MiB -> {after:.2f} MiB ("
            + ", ".join(f"{k} {v / mb:.2f} MiB" for k, v in sorted(self.weight_bytes_after.items()))
            + ")",
        ]
        if self.cache:
            c = self.cache
            lines.append(
                f"caches held in {c['dtype']}: {len(c['caches'])}, {c['bytes_before'] / mb:.2f} MiB -> "
                f"{c['bytes_after'] / mb:.2f} MiB"
            )
        if self.weight_formats:
            lines.append(_weight_formats_line(self.weight_formats))
        if self.weight_budget:
            b = self.weight_budget
            lines.append(
                f"weight budget {b['budget']}: estimated {b['metric']} {b['estimate']:.3g} at "
                f"{b['bits_per_weight']:.2f} bits per weight, measured in {b['seconds']:.1f} s"
            )
        if self.weights:
            w = self.weights
            lines.append(
                f"weights streamed: {w['tensors']} tensors, {w['bytes_read'] / mb:.1f} MiB read from {w['source']}, "
                f"{w['bytes_written'] / mb:.1f} MiB written to {w['output']} ({w['files']} file(s))"
            )
        if self.decomposed:
            lines.append(f"composites decomposed as eager autocast would: {len(self.decomposed)}")
        if self.verification:
            v = self.verification
            lines.append(f"verified against {v.get('reference')}: {v.get('verdict')}")
        if self.accuracy:
            lines.append(f"accuracy: {accuracy_line(self.accuracy)}")
        for d in self.diagnostics:
            lines.append(
                f"{d.severity}: {d.message}"
                + (f" (fix: {d.fix})" if d.fix and d.fix not in d.message else "")
            )
        return "\n".join(lines)


def accuracy_line(a: dict) -> str:
    """``KLD 0.0061 nats/token, top-1 agreement 95.1% (s.e. 1.0%), perplexity 9.87 (fp32 9.80); vs ...``: a
    decoder against its fp32 reference on text (``Report.accuracy``, ``precast.llm.accuracy.Agreement``)."""
    return (
        f"KLD {a['kld']:.4f} nats/token, top-1 agreement {100 * a['top1']:.1f}% (s.e. {100 * a['top1_se']:.1f}%), "
        f"perplexity {a['ppl']:.2f} (fp32 {a['reference_ppl']:.2f}); vs {a['reference']} on {a['positions']} "
        f"tokens of {a['text']}, {a['seconds']:.1f} s at {a.get('threads', '?')} thread(s)"
    )


def json_finite(obj: object) -> object:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_finite(v) for v in obj]
    return obj


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _weight_formats_line(records: list[dict]) -> str:
    """``weight formats: 30 int8, 1 float (64.5 MiB -> 17.1 MiB)``: the linear/embedding weights by format."""
    mb = 1024 * 1024
    counts: dict[str, int] = {}
    for r in records:
        counts[r["format"]] = counts.get(r["format"], 0) + 1
    before = sum(r["bytes_before"] for r in records) / mb
    after = sum(r["bytes_after"] for r in records) / mb
    return (
        "weight formats: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f" ({before:.2f} MiB -> {after:.2f} MiB; per weight: report.weight_formats)"
    )
