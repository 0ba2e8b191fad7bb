"""Weight sensitivity and budgets (issue 41 item 2): every weight's estimated cost per format against the truth (the
program with that weight alone rounded), the greedy allocation under a budget, and ``WeightBudget`` in convert.

The model is a small seeded Llama (transformers config, random weights): its absolute numbers mean nothing, the
relations do (the estimate ranks like the truth, a budget holds, a plan reproduces its conversion bitwise)."""

from __future__ import annotations

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.quant.estimate import (
    WeightCost,
    WeightCosts,
    ablate,
    allocate,
    estimate_costs,
    spearman,
)
from tests.helpers import assert_bitwise

transformers = pytest.importorskip("transformers")


class Logits(torch.nn.Module):
    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        tie_word_embeddings=True,
    )
    model = Logits(transformers.LlamaForCausalLM(cfg).eval())
    batches = [
        (torch.randint(0, 384, (1, 48), generator=torch.Generator().manual_seed(i)),) for i in range(4)
    ]
    return model, torch.export.export(model, batches[0]), batches


@pytest.fixture(scope="module")
def costs(llama):
    _, ep, batches = llama
    c = estimate_costs(ep, batches[:2], ("int4", "int8", "int8-asym"), float_dtype=torch.bfloat16, probes=8)
    ablate(ep, batches[2:], c, "int4-g64")
    return c


def test_the_estimate_ranks_weights_as_their_ablation_does(costs):
    names = list(costs.weights)
    assert len(names) == 1 + 2 * 7  # the tied table (embedding + head) and 7 linears per layer
    est = [costs.weights[n].estimate["int4-g64"] for n in names]
    truth = [costs.weights[n].truth["int4-g64"] for n in names]
    assert spearman(est, truth) > 0.8
    # and the totals agree to within a factor of two (second order, 8 draws, other text)
    assert 0.5 < sum(est) / sum(truth) < 2.0
    for w in costs.weights.values():  # int8 rounds 16x finer than int4: far cheaper everywhere
        assert w.estimate["int8"] < w.estimate["int4-g64"] / 20
        assert w.bytes["int4-g64"] < w.bytes["int8"] < w.bytes["int8-asym"] < w.bytes["float"]
        # int8-asym: a step as fine as int8's, placed differently (one weight's estimate from 8 draws varies by
        # 2x either way between the two roundings; their sums over the weights agree within 25%)
        assert 0 < w.estimate["int8-asym"] < w.estimate["int4-g64"] / 20
    sym, asym = (sum(w.estimate[f] for w in costs.weights.values()) for f in ("int8", "int8-asym"))
    assert 0.75 < asym / sym < 1.25


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


def _synthetic() -> WeightCosts:
    """Three weights; b's int8 is no better than its int4 (dominated: the greedy path skips it), c's float no
    better than its int8."""
    sizes = {"int4": 10, "int8": 20, "float": 40}
    w = {
        "a": WeightCost("a", (8, 64), sizes, {"int4": 5.0, "int8": 1.0, "float": 0.0}),
        "b": WeightCost("b", (8, 64), sizes, {"int4": 2.0, "int8": 2.0, "float": 0.2}),
        "c": WeightCost("c", (8, 64), sizes, {"int4": 0.1, "int8": 0.0, "float": 0.0}),
    }
    return WeightCosts("kld", torch.bfloat16, w, positions=1, probes=1)


def test_allocation_takes_the_best_error_per_byte_first_and_honours_the_budget():
    costs = _synthetic()
    path = allocate(costs)
    # error removed per byte: a int8 0.4, b float 0.06 (its int8 skipped), a float 0.05, c int8 0.01
    steps = [(n, f) for n, f, _, _ in path.steps]
    assert steps == [("a", "int8"), ("b", "float"), ("a", "float"), ("c", "int8")]
    assert path.formats == {"a": "float", "b": "float", "c": "int8"}
    by_error = allocate(costs, error=3.0)  # 7.1 -> 3.1 -> 1.3
    assert by_error.formats == {"a": "int8", "b": "float", "c": "int4"}
    assert by_error.estimate == pytest.approx(1.3)
    by_bytes = allocate(costs, max_bytes=45)  # a's int8 (+10) fits; nothing after it does
    assert by_bytes.formats == {"a": "int8", "b": "int4", "c": "int4"} and by_bytes.bytes == 40
    assert costs.total(by_bytes.formats) == (by_bytes.bytes, pytest.approx(by_bytes.estimate))


def test_a_budget_converts_with_the_cheapest_formats_that_meet_it(llama, tmp_path):
    model, _, batches = llama
    res = precast.convert(
        model, batches[3], policy="torch", weight_format=precast.WeightBudget(bits=5.0, data=batches[:2])
    )
    b = res.report.weight_budget
    assert b["bits_per_weight"] <= 5.0 and set(b["formats"]) <= {"int4-g64", "int8", "float"}
    assert len({r["format"] for r in res.report.weight_formats}) >= 2  # a mix, not one format for all
    assert "weight budget {'bits': 5.0}" in res.report.summary()
    # its plan converts the same program again, without measuring
    plan = precast.Plan.from_result(res)
    path = tmp_path / "weights.json"
    path.write_text(plan.to_json())
    # (its int4 weights were fitted on the budget's data: the plan says which, and is given the data again)
    assert {v.split(" ")[0] for v in plan.roundings.values()} <= {"gptq+search", "search"} and plan.roundings
    again = precast.convert(
        model, batches[3], policy="torch", plan=path, weights=precast.WeightOptions(data=batches[:2])
    )
    assert_bitwise(again.program.module()(*batches[3]), res.program.module()(*batches[3]))
    assert again.report.weight_budget == {}


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (dict(data=[]), "give exactly one budget"),
        (dict(kld=0.1, bits=4), "give exactly one budget"),
        (dict(kld=-1.0, data=[]), "kld=-1.0: give a number > 0"),
        (dict(bits=4.5), "data= is the calibration batches"),
        (dict(bits=4.5, data=[], formats=("float",)), "name the 8/4-bit formats"),
        (dict(bits=4.5, data=[], probes=0), "probes=0"),
        (dict(bits=0.5, data="BATCHES"), "data= is the calibration batches"),
    ],
)
def test_bad_budgets_are_one_line(llama, budget, message):
    model, _, batches = llama
    with pytest.raises(PrecastError) as err:
        precast.convert(model, batches[0], policy="torch", weight_format=precast.WeightBudget(**budget))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_budget_no_format_can_meet_is_one_line(llama):
    model, _, batches = llama
    with pytest.raises(PrecastError, match="the cheapest formats take .* over the budget"):
        precast.convert(
            model, batches[0], weight_format=precast.WeightBudget(bits=2.0, data=batches[:1], probes=1)
        )


def test_sensitivity_of_weights_measures_its_curve_on_real_conversions(llama):
    model, ep, batches = llama
    s = precast.sensitivity(
        ep,
        batches[0],
        policy="torch",
        weight_formats=("int4", "int8"),
        data=batches[:2],
        evaluate=batches[2:],
        measure_bits=(5.0,),
        probes=4,
    )
    assert isinstance(s, precast.WeightSensitivity)
    cheapest, five, everything = s.curve
    assert cheapest.formats == {"int4-g64": 15} and everything.formats == {"float": 15}
    assert cheapest.bytes < five.bytes <= 5.0 * s.elements / 8 < everything.bytes
    # measured on real conversions: more bits, less error; the estimate within 3x of the measurement
    assert cheapest.metrics["kld"] > five.metrics["kld"] > everything.metrics["kld"]
    assert 1 / 3 < cheapest.estimate / cheapest.metrics["kld"] < 3
    assert cheapest.metrics["top1"] <= everything.metrics["top1"]
    assert "ppl" in cheapest.metrics and cheapest.metrics["ppl"] > 0
    plan = s.plan(bits=5.0)
    assert plan.weights == s.allocation(bits=5.0).formats and plan.policy == "torch"
