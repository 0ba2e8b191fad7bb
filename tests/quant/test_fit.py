"""Data-aware int4 wired into the conversion (issue 50 items 1-2): the statistics read from the program itself equal
a module's hooks', the budget measures and the program stores the fitted parts (tagged as such), the report and
the plan say which rounding each weight got, and every way to ask for it without what it needs is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.quant.activation_stats import collect_input_stats
from precast.quant.fit import fit_int4
from precast.quant.formats import Int4, dequantize, quantize
from precast.quant.rounding import GPTQ, gptq_int4

INT4 = Int4(group=64)
TABLE = "model.model.embed_tokens.weight"
UP = "model.model.layers.0.mlp.up_proj.weight"


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(128, 192)
        self.down = torch.nn.Linear(192, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _inputs(n: int, seed: int) -> torch.Tensor:
    """Rows whose channels differ in scale by 100x and correlate (the statistics then differ from the identity)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, 128)
    mix = torch.eye(128) + 0.3 * torch.randn(128, 128, generator=torch.Generator().manual_seed(7))
    return (torch.randn(n, 128, generator=g) @ mix) * scales


@pytest.fixture(scope="module")
def mlp() -> tuple[MLP, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = MLP().eval()
    rows = torch.export.Dim("rows", min=2, max=1024)
    return model, torch.export.export(model, (_inputs(4, 0),), dynamic_shapes={"x": {0: rows}})


def test_the_programs_inputs_fit_as_the_modules_hooks(mlp):
    """One batch: the program's sums equal the module's hooks' (fp32 products), so the parts are bitwise GPTQ's."""
    model, ep = mlp
    batch = (_inputs(256, 1),)  # >= one row per input channel (192 for down): GPTQ (fit.GPTQ_ROWS)
    fitted = fit_int4(ep, [batch], [INT4], torch.float32)
    stats = collect_input_stats(model, [batch])
    for name in ("up.weight", "down.weight"):
        want = gptq_int4(model.state_dict()[name], stats[name].hessian, INT4, torch.float32)
        got = fitted.parts[(name, INT4.name)]
        assert all(torch.equal(got[r], want[r]) for r in want), name
        assert fitted.rounding[name] == GPTQ


def _error(ep, data) -> float:
    with torch.no_grad():
        out = ep.module()(*data)
    return float(((out.float() - _REF(data)) ** 2).mean())


_MODEL: list[MLP] = []


def _REF(data):  # noqa: N802 - the fp32 reference
    with torch.no_grad():
        return _MODEL[0](*data).float()


def test_fitted_int4_is_closer_on_held_out_inputs(mlp):
    """The same format, fitted on 256 rows: the output error on rows not fitted on is well below
    round-to-nearest's (measured here: ~0.4x; the test holds it to <= 0.8x)."""
    model, ep = mlp
    _MODEL[:] = [model]
    calib, held = [(_inputs(256, 2),)], (_inputs(256, 3),)
    rtn = precast.convert(ep, weights=precast.WeightOptions(format="int4"), verify=False)
    fit = precast.convert(ep, weights=precast.WeightOptions(format="int4", data=calib), verify=False)
    assert {r["rounding"] for r in rtn.report.weight_formats} == {"rtn"}
    assert {r["rounding"] for r in fit.report.weight_formats} == {GPTQ}
    assert _error(fit.program, held) <= 0.8 * _error(rtn.program, held)


def test_the_caller_program_is_untouched(mlp):
    _, ep = mlp
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    graph = str(ep.graph)
    precast.convert(ep, weights=precast.WeightOptions(format="int4", data=[(_inputs(32, 4),)]), verify=False)
    assert str(ep.graph) == graph
    assert all(torch.equal(before[k], v) for k, v in ep.state_dict.items())


def _batches() -> list[dict]:
    """140 rows: at least one per input channel of every linear (64, and 128 for down_proj): GPTQ throughout."""
    return [_batch(1 + 10 * i, n=14) for i in range(10)]


def _batch(start: int, n: int = 6, vocab: int = 96) -> dict:
    return {
        "input_ids": (torch.arange(start, start + n) * 7 % vocab)[None],
        "cache_position": torch.arange(n),
    }


def _stored(res, weight: str) -> dict[str, torch.Tensor]:
    """The int4 parts the converted program stores for ``weight``, by role (bf16 scales: the head's read)."""
    ep = res.program
    record = next(r for r in res.report.weight_formats if r["weight"] == weight)
    values = {name: ep.state_dict.get(name, ep.constants.get(name)) for name in record["stored"]}
    parts = {}
    for name, value in values.items():
        role = "zero" if "_int4_zero" in name else "scale" if "_int4_scale" in name else "q"
        if role == "scale" and value.dtype != torch.bfloat16:
            continue
        parts[role] = value
    return parts


def test_the_budget_measures_and_stores_the_fitted_parts(recipe_program):
    """Policy torch (bf16): every weight int4 at 4.5 bits; each stored part is the fit's, bitwise, and the record
    says so; the tied table (fitted on the head's inputs, read by the embedding too) is measured both ways and
    keeps the rounding with the lower estimate, saying which; ``rounding="rtn"`` stores round-to-nearest's."""
    data = _batches()
    budget = precast.Budget(bits=4.5, data=data, probes=1)
    res = precast.convert(
        recipe_program, policy="torch", weights=precast.WeightOptions(format=budget), verify=False
    )
    fitted = fit_int4(recipe_program, data, [INT4], torch.bfloat16)
    assert fitted.tied == {TABLE}
    assert res.report.weight_budget["rounding"] == "data"
    for record in res.report.weight_formats:
        name = record["weight"]
        if name == TABLE:  # measured both ways: the stored parts are the rounding the record names
            kept_fit = record["rounding"] == GPTQ
            assert kept_fit or record["rounding"].startswith("rtn (measured: "), record["rounding"]
            want = (
                fitted.parts[(name, INT4.name)]
                if kept_fit
                else quantize(recipe_program.state_dict[name], INT4, torch.bfloat16)
            )
        else:
            assert record["rounding"] == GPTQ, name
            want = fitted.parts[(name, INT4.name)]
        got = _stored(res, name)
        assert all(torch.equal(got[r], want[r]) for r in ("q", "scale", "zero")), name
    rtn = precast.convert(
        recipe_program,
        policy="torch",
        weights=precast.WeightOptions(format=dataclasses.replace(budget, rounding="rtn")),
        verify=False,
    )
    want = quantize(recipe_program.state_dict[UP], INT4, torch.bfloat16)
    assert all(torch.equal(_stored(rtn, UP)[r], want[r]) for r in ("q", "scale", "zero"))
    assert {r["rounding"] for r in rtn.report.weight_formats} == {"rtn"}


def test_the_estimate_measures_the_fitted_rounding(recipe_program):
    """The budget's int4 estimate is the fitted rounding's: lower in total than round-to-nearest's."""
    data = [_batch(1), _batch(11)]
    est = {}
    for how in ("data", "rtn"):
        budget = precast.Budget(bits=4.5, data=data, probes=4, rounding=how)
        res = precast.convert(
            recipe_program, policy="torch", weights=precast.WeightOptions(format=budget), verify=False
        )
        est[how] = res.report.weight_budget["estimate"]
    assert est["data"] < est["rtn"]


def test_a_plan_fitted_on_data_needs_the_data_again(recipe_program):
    """The plan records the roundings; applied without data it is one line (before: round-to-nearest, silently);
    with the same data the program is the same, bitwise."""
    data = _batches()
    res = precast.convert(
        recipe_program, policy="torch", weights=precast.WeightOptions(format="int4", data=data), verify=False
    )
    plan = precast.Plan.from_result(res)
    assert set(plan.roundings.values()) == {GPTQ}
    again = precast.Plan.from_dict(plan.to_dict())
    assert again.roundings == plan.roundings
    with pytest.raises(PrecastError, match=r"plan= fitted \d+ int4 weight\(s\) on calibration data") as e:
        precast.convert(recipe_program, policy="torch", plan=again, verify=False)
    assert "\n" not in str(e.value)
    redo = precast.convert(
        recipe_program, policy="torch", plan=again, weights=precast.WeightOptions(data=data), verify=False
    )
    assert redo.program.state_dict.keys() == res.program.state_dict.keys()
    assert all(torch.equal(redo.program.state_dict[k], v) for k, v in res.program.state_dict.items())


@pytest.mark.parametrize(
    "weights, message",
    [
        (precast.WeightOptions(format="int8", data=[()]), r"no int4 format is given"),
        (precast.WeightOptions(data=[()]), r"no int4 format is given"),
        (precast.WeightOptions(format="int4", data=torch.zeros(3)), r"give the calibration batches"),
        (
            precast.WeightOptions(format=precast.Budget(bits=5.0, data=[()]), data=[()]),
            r"give the calibration batches once, as Budget\(data=",
        ),
    ],
)
def test_data_without_what_it_fits_is_one_line(mlp, weights, message):
    _, ep = mlp
    with pytest.raises(PrecastError, match=message) as e:
        precast.convert(ep, weights=weights, verify=False)
    assert "\n" not in str(e.value)


def test_a_bad_rounding_is_one_line(mlp):
    _, ep = mlp
    budget = precast.Budget(bits=5.0, data=[(_inputs(4, 0),)], rounding="awq")
    with pytest.raises(PrecastError, match=r"rounding='awq'.*choose 'data'.*or 'rtn'"):
        precast.convert(ep, weights=precast.WeightOptions(format=budget), verify=False)


def test_dequantized_fitted_weight_is_what_the_program_computes(mlp):
    """Eager run of the converted program equals the model with the fitted weights dequantized in (fp32 policy
    None: the weights read in fp32, the rest of the program unchanged)."""
    model, ep = mlp
    data = [(_inputs(64, 5),)]
    res = precast.convert(ep, weights=precast.WeightOptions(format="int4", data=data), verify=False)
    fitted = fit_int4(ep, data, [INT4], torch.float32)
    ref = MLP().eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name in ("up", "down"):
            getattr(ref, name).weight.copy_(
                dequantize(fitted.parts[(f"{name}.weight", INT4.name)], INT4, torch.float32)
            )
        x = _inputs(16, 6)
        assert torch.equal(res.program.module()(x), ref(x))


def test_too_few_rows_for_gptq_is_the_search_and_says_so(mlp):
    """64 calibration rows for 128 (up) and 192 (down) input channels: GPTQ's update would fit the error into
    directions the rows never look at (on test_estimate's tiny Llama its estimate came out 14x below the error on
    other text); the group search against the channels' importance alone is stored, bitwise, and the record says
    why."""
    from precast.quant.rounding import search_int4

    model, ep = mlp
    batch = (_inputs(64, 1),)
    fitted = fit_int4(ep, [batch], [INT4], torch.float32)
    stats = collect_input_stats(model, [batch])
    for name, k in (("up.weight", 128), ("down.weight", 192)):
        assert fitted.rounding[name] == f"search (64 rows for {k} input channels: too few for GPTQ)"
        want = search_int4(model.state_dict()[name], stats[name].importance, INT4, torch.float32)
        got = fitted.parts[(name, INT4.name)]
        assert all(torch.equal(got[r], want[r]) for r in want), name


@pytest.mark.parametrize("fit, rtn, kept", [(2.0, 1.0, "rtn"), (1.0, 2.0, "fit")])
def test_a_tied_weight_keeps_the_rounding_measured_better(fit, rtn, kept):
    """``Fitted.keep_better``: the estimate measured a tied table both ways; the lower is kept, its bytes once."""
    from precast.quant.estimate import WeightCost, WeightCosts
    from precast.quant.fit import Fitted

    fitted = Fitted(torch.bfloat16, parts={("t", "int4-g64"): {"q": torch.zeros(1)}}, rounding={"t": GPTQ})
    cost = WeightCost(
        "t",
        (4, 64),
        {"int4-g64": 10, "int4-g64~rtn": 10, "float": 40},
        {"int4-g64": fit, "int4-g64~rtn": rtn, "float": 0.0},
    )
    costs = WeightCosts("kld", torch.bfloat16, {"t": cost}, positions=1, probes=1)
    fitted.keep_better(costs)
    assert cost.estimate == {"int4-g64": min(fit, rtn), "float": 0.0} and cost.bytes == {
        "int4-g64": 10,
        "float": 40,
    }
    if kept == "rtn":
        assert fitted.parts == {} and fitted.rounding["t"] == "rtn (measured: 1 against the fit's 2)"
    else:
        assert ("t", "int4-g64") in fitted.parts and fitted.rounding["t"] == GPTQ
