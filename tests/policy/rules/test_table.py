"""Each rule of the rules table alone, on a tiny graph: ``rule(RuleCall(node, args, kwargs, decider))``, with no
conversion run (the graph is exported and bound, nothing is classified, cast or lowered)."""

from __future__ import annotations

import torch
from torch import nn

from precast.ir.program import Program
from precast.policy.auto import AUTO_RULES, AutoPolicy
from precast.policy.measurements import Calibration, NodeStats
from precast.policy.rules import table
from precast.policy.rules.policy import RulesPolicy
from precast.policy.rules.table import RuleCall, custom_rule

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Tiny(nn.Module):
    """linear -> relu -> sum -> masked_fill with -1e5 (beyond float16's range, within bfloat16's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 8)

    def forward(self, x, mask):
        h = torch.relu(self.fc(x))
        return h.sum(-1).masked_fill(mask, -1e5)


def _calls(low=BF16, calibration=None, policy=None, **bind) -> dict[str, RuleCall]:
    """Every op of Tiny's graph as the rules see it, with a decider bound to ``policy`` (RulesPolicy())."""
    inputs = (torch.randn(2, 64), torch.zeros(2, dtype=torch.bool))
    program = Program(torch.export.export(Tiny().eval(), inputs))
    policy = policy or RulesPolicy()
    decider = policy.bind(program, policy.options(low), calibration, **bind)
    val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    return {
        n.name: RuleCall(
            n, torch.fx.node.map_aggregate(n.args, val), torch.fx.node.map_aggregate(n.kwargs, val), decider
        )
        for n in program.graph.nodes
        if n.op == "call_function"
    }


def _fires(rule, call) -> tuple | None:
    d = rule(call)
    return None if d is None else (d.dtype, d.source, d.rule)


def test_include_and_exclude_options():
    calls = _calls(policy=RulesPolicy(include_nodes=("relu",), exclude_ops=("aten.linear",)))
    assert _fires(table.include_nodes, calls["relu"]) == (BF16, "user", "include_nodes")
    assert _fires(table.include_nodes, calls["linear"]) is None
    assert _fires(table.exclude_ops, calls["linear"]) == (FP32, "user", "exclude_ops")
    assert _fires(table.exclude_ops, calls["relu"]) is None
    calls = _calls(policy=RulesPolicy(exclude_nodes=(r"^sum",), include_ops=("aten.relu",)))
    assert _fires(table.exclude_nodes, calls["sum_1"]) == (FP32, "user", "exclude_nodes")
    assert _fires(table.include_ops, calls["relu"]) == (BF16, "user", "include_ops")


def test_scalar_range_fires_for_fp16_not_bf16():
    fill = "masked_fill"
    d = table.scalar_range(_calls(FP16)[fill])
    assert (d.dtype, d.rule, d.limit) == (FP32, "scalar_range", torch.finfo(FP16).max)
    assert d.measured == 1e5
    assert table.scalar_range(_calls(BF16)[fill]) is None  # bf16 holds it


def test_init_max_reads_the_constants():
    calls = _calls(policy=RulesPolicy(init_max=1e-3))
    d = table.init_max(calls["linear"])
    assert d.rule == "init_max" and d.dtype == FP32 and d.measured > 1e-3 and d.limit == 1e-3
    assert table.init_max(calls["relu"]) is None  # no constant input
    assert table.init_max(_calls()["linear"]) is None  # bf16: init_max off by default


def test_max_reduction_depth_counts_the_accumulation():
    calls = _calls(policy=RulesPolicy(max_reduction_depth=16))
    d = table.max_reduction_depth(calls["linear"])
    assert (d.rule, d.measured, d.limit) == ("max_reduction_depth", 64.0, 16.0)
    assert table.max_reduction_depth(calls["sum_1"]) is None  # sums over 8
    assert table.max_reduction_depth(_calls()["linear"]) is None  # off by default


def test_data_max_and_flush_to_zero_read_the_calibration():
    stats = {"relu": NodeStats(absmax=1e4), "sum_1": NodeStats(absmax=1e-6)}
    cal = Calibration(stats=stats, batches=1)
    calls = _calls(FP16, cal)
    d = table.data_max(calls["relu"])
    assert (d.rule, d.measured, d.limit) == ("data_max", 1e4, 512.0)  # fp16's default data_max
    assert table.data_max(_calls(FP16)["relu"]) is None  # no calibration: the rule cannot fire
    d = table.flush_to_zero(calls["sum_1"])
    assert d.rule == "flush_to_zero" and d.measured == 1e-6 and d.limit == torch.finfo(FP16).tiny
    assert table.flush_to_zero(calls["linear"]) is None


def test_overrides_of_the_device_fallback_and_the_tolerance_search():
    calls = _calls(device_fp32={"relu": "no kernel"}, fallback={"sum_1": 0.4})
    assert _fires(table.no_low_kernel, calls["relu"]) == (FP32, "rules", "no_low_kernel")
    assert table.no_low_kernel(calls["sum_1"]) is None
    d = table.tolerance(calls["sum_1"])
    assert (d.dtype, d.rule, d.measured) == (FP32, "tolerance", 0.4)
    assert table.tolerance(calls["relu"]) is None


def test_default_and_custom_rules_are_rules_of_the_same_kind():
    calls = _calls()
    assert _fires(table.DEFAULT, calls["relu"]) == (BF16, "rules", "default")
    assert table.is_default(table.DEFAULT(calls["relu"]))

    def wide(node, ctx):
        return "wide input" if any(t.shape[-1] == 64 for t in ctx.constants.values()) else None

    rule = custom_rule(wide)
    assert rule.name == "custom:wide" and custom_rule(rule) is rule
    d = rule(calls["linear"])
    assert (d.dtype, d.source, d.rule, d.reason) == (
        FP32,
        "user",
        "custom:wide",
        "custom rule wide: wide input",
    )
    assert rule(calls["relu"]) is None


def test_the_table_order_and_auto_composes_it():
    calls = _calls(policy=RulesPolicy(custom_rules=(lambda node, ctx: None,)))
    names = [r.name for r in calls["relu"].decider.rules]
    assert names[:7] == [
        "include_nodes",
        "include_ops",
        "exclude_nodes",
        "exclude_ops",
        "scalar_range",
        "no_low_kernel",
        "fp32_kernel",
    ]
    assert names[7] == "custom:<lambda>" and names[-1] == "default"
    assert all(r.doc for r in calls["relu"].decider.rules if not r.name.startswith("custom:"))
    auto = _calls(policy=AutoPolicy(latencies={}))["relu"].decider
    assert auto.rules[-2:] == AUTO_RULES and table.DEFAULT not in auto.rules
    assert auto.rules[:-2] == auto.keep == table.keep_rules(auto.opts)
