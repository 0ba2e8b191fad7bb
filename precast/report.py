"""precast.Report: one record per node and a summary per program; built at conversion or from a saved program."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram

from precast.errors import module_path, user_source_line
from precast.passes.insert_casts import is_cast
from precast.policy.base import dtype_name
from precast.program import META_KEY

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
class Diagnostic:
    severity: str  # "error" | "warning" | "info"
    code: str
    message: str
    node: str | None = None
    location: str | None = None


@dataclass
class Report:
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
    diagnostics: list[Diagnostic] = field(default_factory=list)
    verification: dict = field(default_factory=dict)

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
        return d

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
            f" (activations only); removed as redundant: {self.casts_simplified}",
            f"weights: {before:.2f} MiB -> {after:.2f} MiB ("
            + ", ".join(f"{k} {v / mb:.2f} MiB" for k, v in sorted(self.weight_bytes_after.items()))
            + ")",
        ]
        if self.decomposed:
            lines.append(f"composites decomposed as eager autocast would: {len(self.decomposed)}")
        if self.verification:
            v = self.verification
            lines.append(f"verified against {v.get('reference')}: {v.get('verdict')}")
        for d in self.diagnostics:
            lines.append(f"{d.severity}: {d.message}")
        return "\n".join(lines)


def record_decisions(graph: torch.fx.Graph) -> list[NodeRecord]:
    """NodeRecords from node.meta['precast'] (in memory), written also into custom meta for saved programs."""
    records = []
    for node in graph.nodes:
        decision = node.meta.get("precast")
        if node.op != "call_function" or decision is None:
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


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def report(ep: ExportedProgram) -> Report:
    """Rebuild a Report from a converted program (in memory or loaded with torch.export.load)."""
    from precast.passes.fold_constants import constant_bytes
    from precast.program import Program, constant_sources

    rep = Report()
    for node in ep.graph.nodes:
        entry = (node.meta.get("custom") or {}).get(META_KEY) or {}
        if "decision" in entry:
            rep.nodes.append(NodeRecord(**entry["decision"]))
        if "program" in entry:
            for k, v in entry["program"].items():
                setattr(rep, k, v)
    rep.casts_runtime = sum(1 for n in ep.graph.nodes if is_cast(n))
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
