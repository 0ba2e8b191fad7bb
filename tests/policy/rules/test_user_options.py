"""Policy "rules", the user's options: exclude/include by node name or op (every form an op can be named in),
include winning over the rules, custom rules."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policy.rules.test_policy import convert, dtypes, net

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
OFF = math.inf  # turns a range rule off


@pytest.mark.parametrize(
    "pattern,expect_fp32",
    [
        (r"^layer_norm$", {"layer_norm"}),  # node name
        (r"^encoder\.1", {"linear_1", "add_1", "layer_norm_1"}),  # module paths encoder.1, encoder.1.fc, ...
        (r"nothing_matches_this", set()),
    ],
)
def test_exclude_nodes(pattern, expect_fp32):
    res = convert(net(), exclude_nodes=[pattern])
    fp32 = {n.name for n in res.report.nodes if n.dtype == "fp32"}
    assert fp32 == expect_fp32
    for name in expect_fp32:
        assert res.report.node(name).rule == "exclude_nodes"


@pytest.mark.parametrize(
    "op",
    [
        "aten.softmax",
        "softmax",
        "aten::softmax",
        "aten.softmax.int",
        torch.ops.aten.softmax,
        torch.ops.aten.softmax.int,
    ],
)
def test_exclude_ops_every_form(op):
    res = convert(net(), exclude_ops=[op])
    assert dtypes(res)["softmax"] == "fp32"
    assert res.report.node("softmax").rule == "exclude_ops"
    assert dtypes(res)["linear"] == "fp16"


def test_exclude_ops_other_overload_does_not_match():
    res = convert(net(), exclude_ops=[torch.ops.aten.softmax.int_out])
    assert dtypes(res)["softmax"] == "fp16"


def test_include_wins_over_depth_and_exclude():
    res = convert(net(), max_reduction_depth=4, include_ops=["linear"], exclude_nodes=["^linear$"])
    d = dtypes(res)
    assert d["linear"] == d["linear_1"] == "fp16"
    assert res.report.node("linear").rule == "include_ops"
    assert d["layer_norm"] == "fp32"  # normalizes over 8 > 4
    res = convert(net(), max_reduction_depth=4, include_nodes=[r"encoder\.0\.norm"])
    assert dtypes(res)["layer_norm"] == "fp16" and dtypes(res)["layer_norm_1"] == "fp32"


def test_custom_rule():
    def big_norms(node, ctx):
        if node.target is torch.ops.aten.layer_norm.default and ctx.module.startswith("encoder.1"):
            return "second block's norm"
        return None

    res = convert(net(), custom_rules=[big_norms])
    rec = res.report.node("layer_norm_1")
    assert rec.dtype == "fp32" and rec.rule == "custom:big_norms" and "second block" in rec.reason
    assert dtypes(res)["layer_norm"] == "fp16"
