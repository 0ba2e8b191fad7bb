"""precast.sensitivity: the ranking against single-op ablation, the first non-finite op (named, with its source
line, reproduced alone by the repro folder), the pictures, and the CLI. Plans: tests/policy/test_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import precast
from benchmarks.sensitivity_accuracy import spearman
from precast.errors import PrecastError

ALL_LOW = precast.RulesPolicy(data_max=float("inf"), patterns=())  # no rule keeps an op in fp32


class Block(nn.Module):
    """A small residual block: linears, GELU, a residual add, layer norm, softmax."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        h = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return torch.softmax(self.head(h) * 4.0, dim=-1)


def test_ranking_matches_single_op_ablation():
    model = Block().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    s = precast.sensitivity(model, (x,), dtype="bf16", ablation=True)
    names = [o.name for o in s.ops]
    assert len(names) >= 7 and all(o.truth is not None for o in s.ops)
    rho = spearman([o.estimate for o in s.ops], [o.truth for o in s.ops])
    assert rho >= 0.7, (rho, [(o.name, o.estimate, o.truth) for o in s.ops])
    top_true = {o.name for o in sorted(s.ops, key=lambda o: -o.truth)[:3]}
    assert len(top_true & set(names[:3])) >= 2
    # the measured curve: the all-low program's error at k=0, less with the greedy top-k in fp32
    measured = [p for p in s.estimate.curve if p.measured is not None]
    assert measured[0].k == 0 and len(measured) >= 2
    assert measured[-1].measured < measured[0].measured
    # the caller's module is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # every op is located in this file
    assert all(o.location and "test_sensitivity.py" in o.location for o in s.ops)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.b.weight.mul_(1e5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + 1).sum(-1)  # overflows: b


class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) * 0 + 12.0
        return torch.exp(h).mean(-1)  # overflows: exp


class SumOfSquares(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)

    def forward(self, x):
        h = self.a(x) * 0 + 100.0
        sq = h * h
        return sq.sum(-1, keepdim=True).sqrt()  # overflows: sum


class Divide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.a(x) * 0 + 100.0
        return h / y  # overflows: div


def _t5_feed_forward():
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5LayerFF

    cfg = transformers.T5Config(d_model=32, d_ff=64, dropout_rate=0.0, feed_forward_proj="relu")

    class FF(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.ff = T5LayerFF(cfg)
            with torch.no_grad():  # large activations, as T5 v1.1's wo output has
                self.ff.DenseReluDense.wo.weight.mul_(1e5)

        def forward(self, x):
            return self.ff(x)

    return FF()


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
CASES = {
    "linear": (Linear, (X,), "b", "linear"),
    "exp": (Exp, (X,), "", "exp"),
    "sum_of_squares": (SumOfSquares, (X,), "", "sum"),
    "divide": (Divide, (X, torch.full((2, 8), 1e-3)), "", "div"),
    "t5_feed_forward": (
        _t5_feed_forward,
        (torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3)),),
        "ff.DenseReluDense.wo",
        "linear",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_nonfinite_op_named_and_reproduced(case, tmp_path):
    make, inputs, module, op = CASES[case]
    model = make().eval()
    with torch.no_grad():
        assert torch.isfinite(model(*inputs)).all()  # fine in fp32
    s = precast.sensitivity(model, inputs, dtype="fp16", policy=ALL_LOW, measure_points=0, repro=tmp_path)
    nf = s.nonfinite
    assert nf is not None and nf.op == op and nf.module == module, nf
    # the watched run stopped at that op: the all-low program is measured by a forward of its own
    assert s.estimate.all_low["rel"] == float("inf") and s.estimate.forwards == 3
    assert "overflow" in nf.reason and "65504" in nf.reason
    path, line = nf.location.rsplit(":", 1)
    if case == "t5_feed_forward":
        assert (
            path.endswith("modeling_t5.py")
            and "self.wo(" in Path(path).read_text().splitlines()[int(line) - 1]
        )
    else:
        assert path == __file__ and "# overflows" in Path(path).read_text().splitlines()[int(line) - 1]
    # the repro alone: fp32 finite, fp16 inf, from the saved subgraph and inputs
    assert s.repro["node"] == nf.name and s.repro["reproduces"]
    sub = torch.export.load(tmp_path / "subgraph.pt2")
    ins = torch.load(tmp_path / "inputs.pt", weights_only=True)
    with torch.no_grad():
        assert torch.isfinite(sub.module()(*ins)).all()
        assert torch.isinf(sub.module()(*[t.half() if t.is_floating_point() else t for t in ins])).any()
    assert len([n for n in sub.graph.nodes if n.op == "call_function"]) == 1


def test_repro_script_runs_alone(tmp_path):
    s = precast.sensitivity(
        Exp().eval(), (X,), dtype="fp16", policy=ALL_LOW, measure_points=0, repro=tmp_path
    )
    assert s.nonfinite.name == "exp"
    out = subprocess.run(
        [sys.executable, "repro.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    lines = dict(line.strip().split(": ", 1) for line in out.splitlines())
    assert "inf 0," in lines["float32"] and "inf 16," in lines["float16"]


def test_no_nonfinite_under_default_rules():
    # the default rules keep the overflowing op in fp32 (data_max): nothing non-finite, nothing to name
    s = precast.sensitivity(Exp().eval(), (X,), dtype="fp16", measure_points=0)
    assert s.nonfinite is None and "exp" not in {o.name for o in s.ops}


def test_bad_options_one_line():
    with pytest.raises(PrecastError, match="metric='l2'"):
        precast.sensitivity(Block(), (torch.randn(2, 16),), metric="l2")
    with pytest.raises(PrecastError, match="policy='fastest'"):
        precast.sensitivity(Block(), (torch.randn(2, 16),), policy="fastest")


def test_pictures(tmp_path, monkeypatch):
    from precast.report.sensitivity import model_explorer_sensitivity, plot_sensitivity

    s = precast.sensitivity(Block().eval(), (torch.randn(4, 16),), dtype="bf16", measure_points=1)
    overlay = model_explorer_sensitivity(s.estimate)["graph"]["results"]
    worst = s.ops[0].name
    assert set(overlay) == {o.name for o in s.ops} and overlay[worst]["value"] == max(
        v["value"] for v in overlay.values()
    )
    pytest.importorskip("matplotlib")
    plot_sensitivity(s.estimate, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PrecastError, match=r"pip install 'precast\[bench\]'"):
        plot_sensitivity(s.estimate, tmp_path / "t.png")


def test_cli(tmp_path, capsys):
    from precast.cli import main

    ep = torch.export.export(Exp().eval(), (X,))
    torch.export.save(ep, tmp_path / "m.pt2")
    torch.save((X,), tmp_path / "x.pt")
    base = ["sensitivity", str(tmp_path / "m.pt2"), "--inputs", str(tmp_path / "x.pt"), "--dtype", "fp16"]
    assert main([*base, "--write-plan", str(tmp_path / "p.json")]) == 2
    assert "--keep" in capsys.readouterr().err
    args = [*base, "--data-max", "inf", "--patterns", "--json", "--repro", str(tmp_path / "r")]
    args += [
        "--write-plan",
        str(tmp_path / "p.json"),
        "--keep",
        "1",
        "--model-explorer",
        str(tmp_path / "me.json"),
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_nonfinite"]["name"] == "exp" and out["repro"]["reproduces"]
    assert (tmp_path / "r" / "repro.py").exists() and json.loads((tmp_path / "me.json").read_text())["graph"]
    plan = json.loads((tmp_path / "p.json").read_text())
    assert len(plan["fp32"]) == 1
    assert plan["exports"]["torch_tensorrt_excluded_nodes"] == [f"^{out['order'][0]}$"]
    # the plan applied by convert: that op in fp32, the rest as the rules say
    conv = ["convert", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "o.pt2"), "--dtype", "fp16"]
    assert main([*conv, "--plan", str(tmp_path / "p.json"), "--data-max", "inf", "--patterns"]) == 0
    rep = precast.report(torch.export.load(tmp_path / "o.pt2"))
    assert [r.name for r in rep.nodes if r.rule == "custom:plan"] == [out["order"][0]]
    (tmp_path / "bad.json").write_text("{}")
    capsys.readouterr()
    assert main([*conv, "--plan", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "not a precast plan" in err and len(err.strip().splitlines()) == 1


class Counting(nn.Module):
    """Writes a buffer on every call (a running count) and reads it after the write."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("calls", torch.zeros(16))

    def forward(self, x):
        self.calls.add_(1.0)
        return self.norm(torch.nn.functional.gelu(self.lin(x)) + self.calls).softmax(-1)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_measured_errors_are_the_exported_programs_bitwise(dtype):
    """The all-low errors (taken from the watched run) and each measured point (the lowered graph run on private
    state) are bitwise what ``check_program`` measures of the same program exported and unlifted; the
    estimator runs one forward fewer for the all-low program; nobody's buffer moves."""
    from precast.ir.diagnostics import DiagnosticLog
    from precast.ir.program import private_state
    from precast.numerics.sensitivity import estimate
    from precast.numerics.sensitivity.estimator import run_lowered
    from precast.numerics.tolerance.stage import check_program
    from precast.pipeline.conversion import begin
    from precast.pipeline.options import CheckedOptions
    from precast.pipeline.prepare import prepare
    from tests.helpers import assert_bitwise

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    ep = torch.export.export(Counting().eval(), (x,))
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    low = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    state = begin(ep, (x,), ALL_LOW, CheckedOptions.of(low))
    state.log = DiagnosticLog()
    prepare(state)
    batch = ((x,), {})
    result, est = estimate(state.captured, state.policy, state.binding, batch, "rel", measure_points=1)
    # the reference forward (tapped), the watched all-low run, one measured point: no forward for the all-low
    assert result.nonfinite is None and result.forwards == 3 and result.conversions == 2
    assert result.all_low == check_program(est.lower({}).to_exported_program(), [batch], est.refs)
    assert result.all_low["rel"] > 0
    for kept in ({}, dict.fromkeys(result.order[:2], 0.0), dict.fromkeys(est.candidates, 0.0)):
        program = est.lower(kept)
        for _ in range(2):  # each run starts from the program's own state
            got = run_lowered(program, est.user)
            exported = private_state(est.lower(kept).to_exported_program())
            with torch.no_grad():
                want = exported.module()(x)
            assert_bitwise(got, [want])
        assert est.measure(kept) == check_program(est.lower(kept).to_exported_program(), [batch], est.refs)
    assert all(torch.equal(before[k], v) for k, v in ep.state_dict.items())
