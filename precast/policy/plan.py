"""A portable plan: the set of ops a conversion keeps in fp32, keyed so that a fresh export of the same model
finds them again, and its exports for other tools.

An op is keyed by (module path, op, occurrence): the innermost module that called it (``encoder.layer.0.norm``),
its aten op (``aten.layer_norm.default``), and its index among the ops of that module with that op, in graph
order. Node names (``layer_norm_3``) change when a model is re-exported (a dynamic batch adds ``sym_size``
nodes, a refactor renames things); module paths and the order of ops inside one module do not.

Input: a converted program and its report (``Plan.from_result``), or (graph, node names) (``Plan.from_nodes``);
a JSON file (``load_plan``). Output: ``Plan``, applied by ``convert(..., plan=...)`` as a custom rule
(``PlanRule``, named ``plan``) with the authority of the user's own rules; ``modelopt_nodes_to_exclude`` and
``torch_tensorrt_excluded_nodes``: anchored regular expressions naming exactly the plan's ops in the ONNX graph
``torch.onnx.export(program, dynamo=True)`` writes (``node_<fx name>``, ModelOpt AutoCast's
``--nodes_to_exclude``) and in the program's FX graph (Torch-TensorRT's ``nodes_to_exclude`` /
``autocast_excluded_nodes``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from precast.dtypes import dtype_name, parse_low_dtype
from precast.errors import PrecastError, module_path, name_list
from precast.ir.graph import CAST_META
from precast.paths import check_input_file
from precast.policy.rules.taxonomy import op_name
from precast.quant.rounding import GPTQ, SEARCH

FORMAT = "precast-plan"
VERSION = 1
WEIGHTS_VERSION = 2  # a plan with weight formats: a precast that would drop them (version 1 only) refuses it


@dataclass(frozen=True)
class PlanEntry:
    module: str
    op: str
    occurrence: int
    why: str = ""  # the rule that kept it in fp32 where the plan was written (for people; not matched)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.module, self.op, self.occurrence)


def _keyed(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get(CAST_META) is None


def op_keys(graph: torch.fx.Graph) -> dict[str, tuple[str, str, int]]:
    """node name -> (module path, op, occurrence) for every op of the graph (casts precast wrote left out)."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for n in graph.nodes:
        if not _keyed(n):
            continue
        base = (module_path(n), op_name(n.target))
        out[n.name] = (*base, seen.get(base, 0))
        seen[base] = seen.get(base, 0) + 1
    return out


@dataclass
class Plan:
    """Which ops stay fp32 (``fp32``), for which low dtype and policy; ``source``: where it was written."""

    dtype: str
    fp32: list[PlanEntry] = field(default_factory=list)
    policy: str = "rules"
    source: str = ""
    # weight name (the program's FQN: module path + attribute, stable across exports) -> storage format
    # (``precast.quant.formats``: "int8", "int8-asym", "int4-g64", "float"), applied as ``weight_format=``
    weights: dict[str, str] = field(default_factory=dict)
    # weight name -> how its int4 values were fitted on calibration data ("gptq+search"): a conversion applying
    # the plan needs the data to fit them again (``WeightOptions(data=)``); weights not named: round-to-nearest
    roundings: dict[str, str] = field(default_factory=dict)

    # ---- making one ------------------------------------------------------------------------------------
    @classmethod
    def from_nodes(
        cls,
        graph: torch.fx.Graph,
        names: Iterable[str],
        dtype: Any,
        *,
        why: dict | None = None,
        source: str = "",
    ) -> Plan:
        keys = op_keys(graph)
        why = why or {}
        missing = [n for n in names if n not in keys]
        if missing:
            raise PrecastError(f"plan: no op named {name_list(missing)} in the program")
        entries = [PlanEntry(*keys[n], why=why.get(n, "")) for n in names]
        return cls(dtype_name(parse_low_dtype(dtype)), entries, source=source)

    @classmethod
    def from_result(cls, result: Any, source: str = "") -> Plan:
        """The ops a conversion (``ConvertResult``) kept in fp32 by the policy's rules or the user's."""
        rep = result.report
        weights = {}  # a weight's format, or each read's where they differ (a tied table, int4-g64+int8)
        for r in rep.weight_formats:
            weights.update(r.get("read_formats") or {r["weight"]: r["format"]})
        roundings = {
            r["weight"]: r["rounding"]
            for r in rep.weight_formats
            if r.get("rounding", "").startswith((GPTQ, SEARCH))
        }
        if rep.policy not in ("rules", "auto") and not weights:
            raise PrecastError(
                f"plan: a plan records a rules/auto conversion's fp32 ops or a conversion's weight formats; this "
                f"one ran policy {rep.policy!r} without weight_format="
            )
        if rep.policy not in ("rules", "auto"):
            return cls(rep.dtype or "bf16", [], rep.policy or "regions", source, weights, roundings)
        # scalar_range / no_low_kernel: facts about the op or the device, found again by any conversion there
        kept = [
            r
            for r in rep.nodes
            if r.dtype == "fp32"
            and r.source in ("rules", "user")
            and r.rule not in ("scalar_range", "no_low_kernel")
        ]
        plan = cls.from_nodes(
            result.program.graph,
            [r.name for r in kept],
            rep.dtype,
            why={r.name: r.rule for r in kept},
            source=source,
        )
        return dataclasses.replace(plan, policy=rep.policy, weights=weights, roundings=roundings)

    # ---- files -----------------------------------------------------------------------------------------
    def to_dict(self, program: Any = None) -> dict:
        d = {
            "format": FORMAT,
            "version": WEIGHTS_VERSION if self.weights else VERSION,
            "dtype": self.dtype,
            "policy": self.policy,
            "source": self.source,
            "fp32": [dataclasses.asdict(e) for e in self.fp32],
        }
        if self.weights:
            d["weights"] = dict(self.weights)
        if self.roundings:
            d["roundings"] = dict(self.roundings)
        if program is not None:
            d["exports"] = {
                "modelopt_nodes_to_exclude": self.modelopt_nodes_to_exclude(program),
                "torch_tensorrt_excluded_nodes": self.torch_tensorrt_excluded_nodes(program),
            }
        return d

    def to_json(self, program: Any = None) -> str:
        return json.dumps(self.to_dict(program), indent=2)

    @classmethod
    def from_dict(cls, d: Any, where: str = "plan") -> Plan:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PrecastError(
                f'{where}: not a precast plan (no "format": "{FORMAT}"); write one with '
                "`precast convert --write-plan` or `precast sensitivity --write-plan`"
            )
        if d.get("version") not in (VERSION, WEIGHTS_VERSION):
            raise PrecastError(
                f"{where}: plan version {d.get('version')!r}; this precast reads versions {VERSION} and "
                f"{WEIGHTS_VERSION}"
            )
        weights, roundings = d.get("weights", {}), d.get("roundings", {})
        for key, value in (("weights", weights), ("roundings", roundings)):
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise PrecastError(f'{where}: "{key}" must map weight names to strings (formats, roundings)')
        try:
            entries = [
                PlanEntry(str(e["module"]), str(e["op"]), int(e["occurrence"]), str(e.get("why", "")))
                for e in d["fp32"]
            ]
            return cls(
                dtype_name(parse_low_dtype(d["dtype"])),
                entries,
                str(d.get("policy", "rules")),
                str(d.get("source", "")),
                dict(weights),
                dict(roundings),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PrecastError(f"{where}: malformed plan entry ({type(exc).__name__}: {exc})") from exc

    # ---- applying and resolving -------------------------------------------------------------------------
    def nodes(self, program: Any) -> list[str]:
        """The plan's ops in ``program`` (an ExportedProgram or a graph), by node name; unmatched left out."""
        graph = getattr(program, "graph", program)
        by_key = {k: n for n, k in op_keys(graph).items()}
        return [by_key[e.key] for e in self.fp32 if e.key in by_key]

    def unmatched(self, program: Any) -> list[PlanEntry]:
        keys = set(op_keys(getattr(program, "graph", program)).values())
        return [e for e in self.fp32 if e.key not in keys]

    def rule(self) -> PlanRule:
        return PlanRule(self)

    def modelopt_nodes_to_exclude(self, program: Any) -> list[str]:
        """ModelOpt AutoCast ``--nodes_to_exclude``: one anchored regex per op, for the ONNX graph that
        ``torch.onnx.export(program, dynamo=True)`` writes from ``program`` (it names an op's node
        ``node_<fx name>``)."""
        return [f"^node_{re.escape(n)}$" for n in self.nodes(program)]

    def torch_tensorrt_excluded_nodes(self, program: Any) -> list[str]:
        """Torch-TensorRT autocast's excluded nodes: one anchored regex per op, over ``program``'s FX names."""
        return [f"^{re.escape(n)}$" for n in self.nodes(program)]


class PlanRule:
    """A custom rules-policy rule: fp32 for the ops a plan lists, matched by key in the graph being converted
    (occurrences counted among the ops before the node, which classify has already settled)."""

    __name__ = "plan"

    def __init__(self, plan: Plan):
        self.plan = plan
        self.keys = {e.key: e for e in plan.fp32}

    def __call__(self, node: torch.fx.Node, ctx: Any = None) -> str | None:
        base = (module_path(node), op_name(node.target))
        occurrence = 0
        for n in node.graph.nodes:
            if n is node:
                break
            if _keyed(n) and (module_path(n), op_name(n.target)) == base:
                occurrence += 1
        entry = self.keys.get((*base, occurrence))
        if entry is None:
            return None
        was = f" (where it was written: {entry.why})" if entry.why else ""
        return f"the plan keeps {base[1]} #{occurrence} of {base[0] or 'the top level'} in fp32{was}"


def load_plan(plan: Any) -> Plan:
    """A ``Plan``, a dict, or a path to a JSON file."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        p = check_input_file(plan, "give the path of a plan .json file", "plan")  # a FIFO or device: unopened
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise PrecastError(f"plan {p}: cannot read it ({exc.strerror})") from exc
        except json.JSONDecodeError as exc:
            raise PrecastError(f"plan {p}: not JSON ({exc.msg} at line {exc.lineno})") from exc
        return Plan.from_dict(data, f"plan {p}")
    raise PrecastError(f"plan={plan!r}: give a precast.Plan, a dict, or the path of a plan .json file")


def with_plan(
    plan: Any, policy: Any, custom_rules: Iterable[Any], dtype: Any
) -> tuple[Any, tuple, Any, PlanRule | None]:
    """(policy, custom_rules, dtype, pins) for ``convert`` with ``plan``. Under rules or auto the plan's rule joins
    the user's custom rules (their authority: after include/exclude, before the policy's own rules); under policy
    "torch", a policy object without ``bind``, or the program's regions (policy None with a plan written there),
    its ops are pinned to fp32 over the policy (``pins``: ``precast.policy.pinned.Pinned`` wraps the resolved
    policy). Policy None with a rules plan means "rules", as before."""
    custom_rules = tuple(custom_rules)
    if plan is None:
        return policy, custom_rules, dtype, None
    p = load_plan(plan)
    low = parse_low_dtype(dtype)
    if low is not None and dtype_name(low) != p.dtype:
        raise PrecastError(f"plan: written for {p.dtype}, but dtype={dtype!r}; give the plan's dtype or none")
    dtype = dtype if low is not None else p.dtype
    if policy is None:
        if p.policy == "regions":
            return None, custom_rules, dtype, p.rule()
        if p.policy == "torch":
            raise PrecastError(
                "plan: written under policy 'torch' (autocast semantics); pass policy='torch' to apply it there, "
                "or policy='rules'"
            )
        policy = "rules"
    if isinstance(policy, str):
        if policy == "torch":
            return policy, custom_rules, dtype, p.rule()
        return policy, (*custom_rules, p.rule()), dtype, None
    if dataclasses.is_dataclass(policy) and hasattr(policy, "custom_rules"):
        return (
            dataclasses.replace(policy, custom_rules=(*tuple(policy.custom_rules), p.rule())),
            custom_rules,
            dtype,
            None,
        )
    if not hasattr(policy, "bind"):  # TorchPolicy, or a policy of the user's that decides itself
        return policy, custom_rules, dtype, p.rule()
    raise PrecastError(
        f"plan= applies to policy None, 'torch', 'rules', 'auto', a RulesPolicy/AutoPolicy or a policy without "
        f"bind; got {type(policy).__name__}, which binds its own decider (give it the plan's rule itself)"
    )
