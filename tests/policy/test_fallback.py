"""Accuracy fallback: the fewest ops back to fp32 until the tolerance holds; clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.policy.fallback import Errors, parse_tolerance


class Sensitive(nn.Module):
    """One op (exp of a large argument) carries nearly all the bf16 error; the rest is benign."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        big = torch.exp(h * 0.01 + 8.0)  # bf16 rounding of the argument ~ 8 * 2^-8 relative error in exp
        return (h.tanh() + big / 3000.0).sum(-1, keepdim=True)


def model_inputs():
    torch.manual_seed(0)
    return Sensitive().eval(), (torch.randn(4, 8),)


def cal():
    torch.manual_seed(1)
    return [(torch.randn(4, 8),) for _ in range(3)]


@pytest.mark.parametrize(
    "tol,needle",
    [
        (0.01, "dict of bounds"),
        ({}, "dict of bounds"),
        ({"abs": 1e-2}, "unknown bound 'abs'"),
        ({"cosine": 1.0}, "between 0 and 1"),
        ({"max_abs": -1}, ">= 0"),
    ],
)
def test_parse_tolerance_errors(tol, needle):
    with pytest.raises(PrecastError, match=needle):
        parse_tolerance(tol)


def test_errors_metrics():
    e = Errors()
    e.update([torch.tensor([[1.0, 0.0], [0.0, 2.0]])], [torch.tensor([[1.0, 0.0], [0.0, 1.0]])])
    assert (
        e.m["max_abs"] == 1.0 and e.m["cosine"] == pytest.approx(1.0) and e.m["rel"] == pytest.approx(2**-0.5)
    )
    e.update([torch.tensor([float("nan")])], [torch.tensor([0.0])])
    assert e.m["max_abs"] == float("inf")


def test_fallback_keeps_fewest_ops_and_reports_them():
    model, inputs = model_inputs()
    # patterns=(): exp feeding a sum is a pattern rules keeps in fp32; this test measures the fallback alone
    plain = precast.convert(
        model, inputs, policy="rules", dtype=torch.bfloat16, calibration=cal(), patterns=()
    )
    want = model(*inputs)
    err_plain = (plain.module()(*inputs) - want).abs().max().item()
    assert err_plain > 0.05  # bf16 exp(8+) misses 0.05
    res = precast.convert(
        model,
        inputs,
        policy="rules",
        dtype=torch.bfloat16,
        calibration=cal(),
        tolerance={"max_abs": 0.05},
        patterns=(),
    )
    kept = [n for n in res.report.nodes if n.rule == "tolerance"]
    assert 1 <= len(kept) <= 3, [n.name for n in kept]
    assert all(n.dtype == "fp32" for n in kept)
    assert {"exp", "add", "mul"} & {n.name for n in kept}
    assert res.report.node("linear").dtype == "bf16"  # the matmul family is never moved
    info = res.report.verification["tolerance"]
    assert info["achieved"]["max_abs"] <= 0.05
    assert sorted(info["kept_fp32"]) == sorted(n.name for n in kept)
    assert (res.module()(*inputs) - want).abs().max().item() <= 0.05
    assert any(d.code == "tolerance" and "kept" in d.message for d in res.report.diagnostics)


def test_met_without_fallback():
    model, inputs = model_inputs()
    res = precast.convert(
        model, inputs, policy="rules", dtype=torch.bfloat16, calibration=cal(), tolerance={"max_abs": 10.0}
    )
    assert not [n for n in res.report.nodes if n.rule == "tolerance"]


def test_unmeetable_tolerance_is_an_error():
    model, inputs = model_inputs()
    with pytest.raises(PrecastError, match="cannot be met.*matmul/conv family"):
        precast.convert(
            model,
            inputs,
            policy="rules",
            dtype=torch.bfloat16,
            calibration=cal(),
            tolerance={"max_abs": 1e-9},
        )


class Counter(Sensitive):
    """Sensitive, plus a step counter the forward writes in place (a buffer the program writes)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return super().forward(x)


def test_calibration_and_tolerance_search_leave_callers_state_alone():
    """policy rules + 4 calibration batches + a tolerance: neither the caller's module nor its exported program
    sees a single forward, and the converted program starts from the same state."""
    torch.manual_seed(0)
    model, inputs = Counter().eval(), (torch.randn(4, 8),)
    ep = torch.export.export(model, inputs)
    assert model.count.item() == 0 and ep.state_dict["count"].item() == 0
    kw = dict(
        policy="rules", dtype=torch.bfloat16, calibration=cal() + cal()[:1], tolerance={"max_abs": 0.05}
    )
    res = precast.convert(ep, **kw)
    assert ep.state_dict["count"].item() == 0, "the input program's buffer was written"
    assert model.count.item() == 0, "the caller's module was run"
    res_m = precast.convert(model, inputs, **kw)
    assert model.count.item() == 0, "the caller's module was run"
    for r in (res, res_m):
        (stored,) = [v for k, v in r.program.state_dict.items() if k.startswith("count")]
        assert stored.item() == 0, "the converted program was handed back after forwards on its own state"
