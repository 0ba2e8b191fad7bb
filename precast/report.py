"""precast.Report: one record per node and a summary per program; built at conversion or from a saved program."""

from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram

from precast.errors import module_path, user_source_line
from precast.passes.insert_casts import is_cast
from precast.policy.base import dtype_name
from precast.program import META_KEY

SCHEMA_VERSION = 1
# export's run-time checks: no precision of their own, not worth a row in the report
BOOKKEEPING = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


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
    location: str | None = None  # user's source line, file.py:LINE
    fix: str | None = None  # what to do
    module: str | None = None
    region: int | None = None
    allowed: bool = False  # an error downgraded by convert(allow=...)


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
    casts: list[CastRecord] = field(default_factory=list)  # run-time casts (len == casts_runtime)
    allowed: list[str] = field(default_factory=list)  # diagnostic codes downgraded from error to warning

    @property
    def cast_bytes(self) -> int:
        """Estimated bytes moved per forward by run-time casts (read + write)."""
        return sum(c.bytes for c in self.casts)

    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

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
        return _finite(d)

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
        if self.decomposed:
            lines.append(f"composites decomposed as eager autocast would: {len(self.decomposed)}")
        if self.verification:
            v = self.verification
            lines.append(f"verified against {v.get('reference')}: {v.get('verdict')}")
        for d in self.diagnostics:
            lines.append(
                f"{d.severity}: {d.message}"
                + (f" (fix: {d.fix})" if d.fix and d.fix not in d.message else "")
            )
        return "\n".join(lines)


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


def _finite(obj):
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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
        if not is_cast(node):
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
        info["verification"] = _finite(rep.verification)


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
    from precast.passes.fold_constants import constant_bytes
    from precast.program import Program, constant_sources

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
