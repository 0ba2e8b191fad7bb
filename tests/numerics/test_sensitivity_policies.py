"""Sensitivity and plans under every policy (issue 28): the AMP user's question, "why is my autocast model NaN",
answered under policy "torch" (eager autocast on the whole forward) and policy None (the program's own regions),
with the same estimator, first non-finite op, repro and plan as under rules; a plan written there applies with that
policy: autocast semantics everywhere except the plan's ops, which stay fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from tests.helpers import assert_bitwise
from tests.numerics.test_sensitivity import CASES, Block

FP16 = torch.float16


def _run(program, inputs):
    with torch.no_grad():
        return program.module()(*inputs)


# under eager autocast, h (fp16) / y (fp32) divides in fp32: the divide case is finite there (checked below)
TORCH_CASES = [c for c in CASES if c != "divide"]


def test_no_nonfinite_op_where_eager_autocast_is_finite():
    make, inputs, _, _ = CASES["divide"]
    model = make().eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        assert torch.isfinite(model(*inputs)).all()
    s = precast.sensitivity(model, inputs, dtype="fp16", policy="torch", measure_points=0)
    assert s.nonfinite is None and s.estimate.all_low["rel"] < 0.01


@pytest.mark.parametrize("case", TORCH_CASES)
def test_first_nonfinite_op_under_policy_torch(case, tmp_path):
    """Each model overflows fp16 in exactly one op under eager autocast: named with its source line, reproduced
    alone, and a plan keeping it fp32 under policy torch gives finite outputs."""
    make, inputs, module, op = CASES[case]
    model = make().eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        assert not torch.isfinite(model(*inputs)).all()  # the user's complaint, in eager
    s = precast.sensitivity(model, inputs, dtype="fp16", policy="torch", measure_points=0, repro=tmp_path)
    nf = s.nonfinite
    assert nf is not None and nf.op == op and nf.module == module, nf
    assert "overflow" in nf.reason and "65504" in nf.reason
    path, line = nf.location.rsplit(":", 1)
    source = Path(path).read_text().splitlines()[int(line) - 1]
    assert ("self.wo(" in source) if case == "t5_feed_forward" else ("# overflows" in source)
    assert s.repro["node"] == nf.name and s.repro["reproduces"]
    # the ranking is of the ops autocast casts low (an exp or a sum only follows its fp16 input: not ranked)
    assert all(o.op in ("linear", "bmm") for o in s.ops) and (nf.name in {o.name for o in s.ops}) == (
        op == "linear"
    )
    plan = s.plan(1)
    assert plan.policy == "torch" and [e.op for e in plan.fp32] == [op]
    res = precast.convert(model, inputs, policy="torch", dtype=FP16, plan=plan)
    assert torch.isfinite(_run(res.program, inputs)).all()
    (pinned,) = [r for r in res.report.nodes if r.rule == "custom:plan"]
    assert pinned.dtype == "fp32" and res.report.policy == "torch"
    # every other op decided as policy torch decides it
    plain = {
        r.name: (r.dtype, r.rule)
        for r in precast.convert(model, inputs, policy="torch", dtype=FP16).report.nodes
    }
    for r in res.report.nodes:
        if r.name != pinned.name and r.name in plain and r.rule != "follow":
            assert (r.dtype, r.rule) == plain[r.name], r


class Pinnable(nn.Module):
    """linear -> bmm -> linear; ``fp32_bmm`` runs the bmm as eager code that pins it: autocast off, fp32 inputs."""

    def __init__(self, fp32_bmm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(8, 4)
        self.fp32_bmm = fp32_bmm

    def forward(self, x):
        h = self.a(x).view(-1, 4, 8)
        if self.fp32_bmm:
            with torch.autocast("cpu", enabled=False):
                g = torch.bmm(h.float(), h.float().transpose(1, 2))
        else:
            g = torch.bmm(h, h.transpose(1, 2))
        return self.b(torch.softmax(g, -1) @ h)  # softmax follows its input: fp32 after the pinned bmm


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP16])
def test_plan_over_policy_torch_is_eager_autocast_with_that_op_fp32(dtype):
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    model = Pinnable().eval()
    ep = torch.export.export(model, (x,))
    plan = precast.Plan.from_nodes(ep.graph, ["bmm"], dtype)
    plan.policy = "torch"
    res = precast.convert(ep, (x,), policy="torch", dtype=dtype, plan=plan)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want = Pinnable(fp32_bmm=True).eval()(x)
    assert_bitwise(_run(res.program, (x,)), want)
    # a plan changes what policy torch alone computes: the difference is stated, not a broken promise
    codes = {d.code for d in res.report.diagnostics}
    assert not res.report.verification["bitwise"] and "measured-error" in codes and "not-bitwise" not in codes
    # saved and reloaded, the plan applies the same
    again = precast.convert(ep, (x,), policy="torch", dtype=dtype, plan=json.loads(plan.to_json()))
    assert_bitwise(_run(again.program, (x,)), want)


class InRegion(nn.Module):
    """The user's own fp16 region around a sum of squares that overflows (policy None ranks the region's ops)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.head = nn.Linear(8, 64), nn.Linear(1, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=FP16):
            h = self.a(x) * 0 + 100.0
            s = (h * h).sum(-1, keepdim=True)  # overflows: sum
        return self.head(s.float().sqrt())


def test_sensitivity_and_plan_under_policy_none():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    ep = torch.export.export(InRegion().eval(), (x,))
    assert not torch.isfinite(_run(precast.convert(ep).program, (x,))).all()
    s = precast.sensitivity(ep, (x,), policy=None, measure_points=0)
    assert s.estimate.dtype == "fp16" and s.nonfinite is not None and s.nonfinite.op == "sum"
    assert [o.op for o in s.ops] == ["linear"] and s.ops[0].module == "a"  # the head is outside: fp32
    plan = s.plan(1)
    assert plan.policy == "regions"
    res = precast.convert(ep, (x,), plan=plan)  # policy None: the regions as written, the plan's op fp32
    assert torch.isfinite(_run(res.program, (x,))).all()
    assert res.report.policy == "regions" and res.report.node("linear").dtype == "fp16"
    with pytest.raises(PrecastError, match="has none enabled"):
        precast.sensitivity(Block().eval(), (torch.randn(2, 16),), policy=None)


def test_policy_none_refuses_a_torch_plan():
    plan = precast.Plan("fp16", policy="torch")
    with pytest.raises(PrecastError, match="pass policy='torch'"):
        precast.convert(Block().eval(), (torch.randn(2, 16),), plan=plan)


def test_cli_under_policy_torch(tmp_path):
    """NaN under autocast -> sensitivity --policy torch --json -> --write-plan -> convert --policy torch --plan."""
    from precast.cli import main

    make, inputs, _, op = CASES["exp"]
    model = make().eval()
    src, x, plan, out = (tmp_path / n for n in ("m.pt2", "x.pt", "plan.json", "out.pt2"))
    torch.export.save(torch.export.export(model, inputs), src)
    torch.save(inputs, x)
    args = ["sensitivity", str(src), "--inputs", str(x), "--dtype", "fp16", "--policy", "torch", "--json"]
    assert main([*args, "--write-plan", str(plan), "--keep", "1"]) == 0
    assert json.loads(plan.read_text())["policy"] == "torch"
    assert (
        main(
            ["convert", str(src), "-o", str(out), "--policy", "torch", "--dtype", "fp16", "--plan", str(plan)]
        )
        == 0
    )
    assert torch.isfinite(_run(torch.export.load(out), inputs)).all()


def test_cli_json_names_the_first_nonfinite_op(tmp_path, capsys):
    from precast.cli import main

    make, inputs, _, op = CASES["sum_of_squares"]
    src, x = tmp_path / "m.pt2", tmp_path / "x.pt"
    torch.export.save(torch.export.export(make().eval(), inputs), src)
    torch.save(inputs, x)
    assert (
        main(["sensitivity", str(src), "--inputs", str(x), "--dtype", "fp16", "--policy", "torch", "--json"])
        == 0
    )
    nf = json.loads(capsys.readouterr().out)["first_nonfinite"]
    assert nf["op"] == op and "test_sensitivity.py" in nf["location"] and "overflow" in nf["reason"]
