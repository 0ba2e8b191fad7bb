"""``WeightBudget(program=...)`` (issue 49 item 7): the budget measured on a cheaper program over the same weights
(export-llm's decoder exported with a static cache of one calibration window, not the deployed cache), converted
program unchanged.

The model is a tiny seeded Llama exported with transformers' static-cache recipe twice: a cache of 64 positions
(the converted program) and of one window + 1 (17). The windows start at an empty cache, so both programs compute
the same logits (the masked cache positions add exact zeros to the softmax; only the sums' order may differ):
the estimates agree to 1e-4 relative and the plan is the same, while the measuring program holds a quarter of the
cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import precast
import precast.quant.budget as weight_budget
from precast.errors import PrecastError

transformers = pytest.importorskip("transformers")

CACHE, WINDOW = 64, 16


def _llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=120,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # a sharper next-token distribution than the init's near-uniform one
    return model


@pytest.fixture(scope="module")
def programs():
    from precast.llm.checkpoint import export_decoder

    model = _llama(0)
    window = export_decoder(model, WINDOW + 1)
    deployed = export_decoder(model, CACHE)
    data = [
        {
            "input_ids": torch.randint(3, 120, (1, WINDOW), generator=torch.Generator().manual_seed(i)),
            "cache_position": torch.arange(WINDOW),
        }
        for i in range(2)
    ]
    return deployed, window, data


def _cache_lengths(ep: torch.export.ExportedProgram) -> set[int]:
    """The positions of the program's static KV cache (its 4-d constants/buffers: [batch, heads, positions, dim])."""
    tensors = [*ep.state_dict.values(), *ep.constants.values()]
    return {t.shape[2] for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 4}


def test_the_budget_measures_on_the_given_program_and_plans_the_same(programs, monkeypatch):
    deployed, window, data = programs
    assert _cache_lengths(deployed) == {CACHE} and _cache_lengths(window) == {WINDOW + 1}
    measured: list[tuple[set[int], object]] = []  # per estimate: the measured program's cache, the costs
    real = weight_budget.estimate_costs

    def spy(ep, *args, **kwargs):
        costs = real(ep, *args, **kwargs)
        measured.append((_cache_lengths(ep), costs))
        return costs

    monkeypatch.setattr(weight_budget, "estimate_costs", spy)
    budget = precast.WeightBudget(bits=6, data=data, probes=2)
    # today's budget (measured on the converted program), then the same measured on the window's program
    results = [
        precast.convert(deployed, weights=precast.WeightOptions(format=b), verify=False)
        for b in (budget, dataclasses.replace(budget, program=window))
    ]
    assert [m[0] for m in measured] == [{CACHE}, {WINDOW + 1}]  # the second never ran the deployed cache
    assert all(_cache_lengths(r.program) == {CACHE} for r in results)  # the deployed program is converted
    before, after = ({w["weight"]: w["format"] for w in r.report.weight_formats} for r in results)
    assert after == before and len(set(after.values())) == 2  # the same plan, a mix of both formats
    a, b = (r.report.weight_budget for r in results)
    assert b["bytes"] == a["bytes"] and b["positions"] == a["positions"] == 2 * WINDOW
    assert b["estimate"] == pytest.approx(a["estimate"], rel=1e-4)
    (_, old), (_, new) = measured
    assert list(new.weights) == list(old.weights)
    for name, cost in old.weights.items():  # every weight's estimate per format, not only the plan's sum
        assert new.weights[name].bytes == cost.bytes
        for fmt, value in cost.estimate.items():
            assert new.weights[name].estimate[fmt] == pytest.approx(value, rel=1e-4, abs=1e-12), (name, fmt)


def test_a_program_over_other_weights_is_refused_in_one_line(programs):
    from precast.llm.checkpoint import export_decoder

    deployed, _, data = programs
    other = export_decoder(_llama(1), WINDOW + 1)
    budget = precast.WeightBudget(bits=6, data=data, probes=1, program=other)
    with pytest.raises(PrecastError, match=r"program= holds other values for \S+ than the converted") as err:
        precast.convert(deployed, weights=precast.WeightOptions(format=budget), verify=False)
    assert "\n" not in str(err.value)


def test_program_must_be_an_exported_program(programs):
    _, window, data = programs
    with pytest.raises(PrecastError, match="program=GraphModule: give the torch.export program"):
        precast.WeightBudget(bits=6, data=data, program=window.module()).check()
