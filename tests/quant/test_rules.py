"""Weight rules keyed by the names users write: the checkpoint's (``lm_head.weight``) on the LLM recipe's program
(whose wrapper names it ``model.lm_head.weight``), and nothing silent: a pattern that matches nothing, a pattern an
earlier ``*`` shadows, a plan written for another model each stop the conversion in one line."""

from __future__ import annotations

import dataclasses

import pytest

import precast
from precast.cli.common import weight_format_of
from precast.errors import PrecastError


def _formats(ep, weight_format) -> dict[str, str]:
    res = precast.convert(ep, policy="torch", weight_format=weight_format)
    return {r["weight"]: r["format"] for r in res.report.weight_formats}


TABLE = "model.model.embed_tokens.weight"
UP = "model.model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "weight_format",
    [
        {"lm_head.weight": "int8", "*": "int4"},  # README's "Weights in 8 and 4 bits"
        weight_format_of(["lm_head.weight=int8", "int4"]),  # docs/llm_export.md's --weight-format
        {"lm_head.weight": precast.Int8(), "*": precast.Int4(group=64)},  # the typed formats
    ],
)
def test_the_checkpoints_names_match_the_recipes_program(recipe_program, weight_format):
    """The head (a read of the tied table by ``lm_head``) in int8, every other weight int4: on the old code the
    pattern matched nothing and the head silently went int4 (``int4-g64`` alone)."""
    formats = _formats(recipe_program, weight_format)
    assert formats[TABLE] == "int4-g64+int8"  # the embedding's read int4, the head's int8
    assert formats[UP] == "int4-g64"


def test_checkpoint_prefixes_match_too(recipe_program):
    """``model.layers.*`` (the checkpoint's decoder layers, docs/weight_formats.md) matches the program's
    ``model.model.layers.*``; the table no pattern names stays float."""
    formats = _formats(recipe_program, {"model.layers.*": "int8"})
    assert formats[UP] == "int8" and formats[TABLE] == "float"


def test_a_pattern_that_matches_nothing_is_one_line(recipe_program):
    with pytest.raises(
        PrecastError, match=r"pattern 'lm_head\.wieght' matches no weight of this program"
    ) as e:
        _formats(recipe_program, {"lm_head.wieght": "int8", "*": "int4"})
    assert "\n" not in str(e.value)


def test_a_pattern_after_a_star_is_one_line(recipe_program):
    with pytest.raises(PrecastError, match=r"pattern 'lm_head\.weight' never applies.*earlier pattern '\*'"):
        _formats(recipe_program, {"*": "int4", "lm_head.weight": "int8"})


def test_a_plan_for_another_model_is_refused(recipe_program):
    """A plan naming weights the program lacks, or lacking weights it has, is refused (before: the weights it
    named were quantized and the rest silently left float)."""
    res = precast.convert(recipe_program, policy="torch", weight_format="int8")
    plan = precast.Plan.from_result(res)
    other = dataclasses.replace(plan, weights={f"encoder.{k}": v for k, v in plan.weights.items()})
    with pytest.raises(PrecastError, match=r"the plan names 8 weight\(s\) this program lacks.*another model"):
        precast.convert(recipe_program, policy="torch", plan=other)
    partial = dataclasses.replace(plan, weights={UP: "int8"})
    with pytest.raises(PrecastError, match=r"the plan names no format for 7 weight\(s\).*another model"):
        precast.convert(recipe_program, policy="torch", plan=partial)
    again = precast.convert(recipe_program, policy="torch", plan=plan)  # its own plan: the same formats
    assert {r["weight"]: r["format"] for r in again.report.weight_formats} == plan.weights


def test_the_q4_k_m_preset_on_the_recipes_program(recipe_program):
    """llama.cpp's Q4_K_M choice (``precast.quant.presets``) over the program's names: the head, and ``v_proj`` /
    ``down_proj`` of the layers it names (layer 0 of 1: ``i >= 7n/8``), in int8; every other weight int4."""
    from precast.quant.presets import q4_k_m_rules

    formats = _formats(recipe_program, q4_k_m_rules(1))
    layer = "model.model.layers.0."
    assert formats[layer + "self_attn.v_proj.weight"] == formats[layer + "mlp.down_proj.weight"] == "int8"
    assert formats[layer + "self_attn.q_proj.weight"] == formats[UP] == "int4-g64"
    assert formats[TABLE] == "int4-g64+int8"  # the tied table: int4 as the embedding, int8 as the head
