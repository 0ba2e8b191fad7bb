"""Portable plans: written from one export, applied to a re-export (new node names, a dynamic batch): the same
decisions and bitwise the same outputs; the ModelOpt / Torch-TensorRT exports name exactly the plan's ops."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import precast
from precast.errors import PrecastError
from precast.policy.plan import load_plan, op_keys


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return torch.softmax(self.head(x) * 3.0, dim=-1)


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
TOL = {"rel": 7e-3}


def _decisions(res) -> dict:
    """key (module path, op, occurrence) -> dtype, for every op of the converted program."""
    keys = op_keys(res.program.graph)
    return {keys[r.name]: r.dtype for r in res.report.nodes if r.name in keys}


def _renamed(ep):
    """The same program with every computing op renamed (what a re-export after a refactor looks like)."""
    ep = ep.run_decompositions({})  # a copy of its own
    outputs = {a.name for a in ep.graph.output_node().all_input_nodes}
    for n in list(ep.graph.nodes):
        if n.op == "call_function" and n.name not in outputs:
            n._rename(f"renamed_{n.name}")
    ep.graph_module.recompile()
    return ep


@pytest.fixture(scope="module")
def original():
    model = Net().eval()
    ep = torch.export.export(model, (X,))
    res = precast.convert(ep, (X,), policy="rules", dtype="bf16", tolerance=TOL, calibration=[(X,)])
    plan = precast.Plan.from_result(res)
    assert 0 < len(plan.fp32) < len(res.report.nodes)  # the search kept some ops, not all
    assert {e.why for e in plan.fp32} <= {"tolerance", "pattern:exp_reduce", "pattern:manual_norm"}
    return model, ep, res, plan


@pytest.mark.parametrize("reexport", ["dynamic_batch", "renamed"])
def test_plan_round_trip(original, reexport, tmp_path):
    model, ep, res, plan = original
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(ep))
    if reexport == "dynamic_batch":
        again = torch.export.export(model, (X,), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    else:
        again = _renamed(torch.export.export(model, (X,)))
        # every op found under its new name (the program's output op keeps its name)
        assert sum(n.startswith("renamed_") for n in plan.nodes(again)) >= len(plan.fp32) - 1
    applied = precast.convert(again, (X,), dtype="bf16", plan=str(path))  # no tolerance search this time
    assert applied.report.policy == "rules"
    assert _decisions(applied) == _decisions(res)
    assert sum(r.rule == "custom:plan" for r in applied.report.nodes) == len(plan.fp32)
    with torch.no_grad():
        want = res.program.module()(X)
        got = applied.program.module()(X)
    assert torch.equal(got, want)
    if reexport == "dynamic_batch":  # and the dynamic program at another batch size agrees with fp32 closely
        x9 = torch.randn(9, 16)
        with torch.no_grad():
            assert torch.allclose(applied.program.module()(x9), model(x9), atol=2e-2)


def test_exports_are_exact_regexes(original):
    _, ep, _, plan = original
    excluded = set(plan.nodes(ep))
    names = [n.name for n in ep.graph.nodes]
    trt = [re.compile(p) for p in plan.torch_tensorrt_excluded_nodes(ep)]
    assert {n for n in names if any(p.search(n) for p in trt)} == excluded
    onnx = pytest.importorskip("onnxscript") and pytest.importorskip("onnx")
    del onnx
    model_proto = torch.onnx.export(ep, (X,), dynamo=True, optimize=False, verbose=False).model_proto
    onnx_names = [n.name for n in model_proto.graph.node]
    mo = [re.compile(p) for p in plan.modelopt_nodes_to_exclude(ep)]
    assert {n for n in onnx_names if any(p.search(n) for p in mo)} == {f"node_{n}" for n in excluded}


def test_plan_refusals(tmp_path):
    plan = precast.Plan("bf16", [])
    with pytest.raises(PrecastError, match="pass policy='torch'"):  # written over autocast, given no policy
        precast.convert(Net().eval(), (X,), plan=dataclasses.replace(plan, policy="torch"))
    with pytest.raises(PrecastError, match="written for bf16"):
        precast.convert(Net().eval(), (X,), dtype="fp16", plan=plan)
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "precast-plan", "version": 1, "dtype": "bf16", "fp32": [{"module": "x"}]}')
    with pytest.raises(PrecastError, match="malformed plan entry"):
        precast.convert(Net().eval(), (X,), plan=str(bad))


def test_cli_counts_the_plan_read_not_the_plan_written(original, tmp_path, capsys):
    """``precast convert --plan P --write-plan W``: the "matched no op" warning counts P's ops against the ops P
    decided; W (every op this conversion kept fp32, P's and the rules' own) is not what was applied."""
    from precast.cli import main

    _, ep, _, plan = original
    one = dataclasses.replace(plan, fp32=plan.fp32[:1])
    read, written, src = tmp_path / "p.json", tmp_path / "w.json", tmp_path / "m.pt2"
    read.write_text(one.to_json(ep))
    torch.export.save(ep, src)
    args = ["convert", str(src), "-o", str(tmp_path / "o.pt2"), "--policy", "rules", "--dtype", "bf16"]
    args += ["--exclude-ops", "aten.layer_norm"]  # the rules keep three ops of their own
    assert main([*args, "--plan", str(read), "--write-plan", str(written)]) == 0
    err = capsys.readouterr().err
    assert len(load_plan(str(written)).fp32) > 1, "the plan written holds the rules' ops too"
    assert "matched no op" not in err, err
