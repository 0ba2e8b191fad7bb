"""A tied Llama (``LlamaConfig(tie_word_embeddings=True)``) exported by ``torch.export`` directly, strict and not (no
recipe wrapper): the checkpoint's names choose each **read** of the tied table. ``{"lm_head.weight": "int8", "*":
"int4"}`` stores the head's read in int8 and the embedding's in int4; ``model.embed_tokens.weight`` names the
embedding's read only. The table is one tensor that the program names after one of its modules, and which one
depends on the export: strict keeps ``model.embed_tokens.weight``, non-strict ``lm_head.weight``. Before
(``precast.quant.graph._own_names``), non-strict matched the embedding's read by the program's name too, so
``lm_head.weight=int8`` stored both reads in int8 (and ``model.embed_tokens.weight=int8`` both, strict).

Each read's format is read from the converted graph itself: the head's linear weight through the one recogniser
(``precast.quant.forms.recognise``), the embedding by the dtypes of the tables it gathers from.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import precast
from precast.quant.formats import INT8, Int4
from precast.quant.forms import recognise
from tests.quant.conftest import tied_llama_config

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


@pytest.fixture(scope="module")
def tied_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    config = tied_llama_config(transformers, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))


def _reads(tied_llama, strict: bool, weight_format: dict) -> tuple[object, object]:
    """(the head's weight format, the dtypes of the tables the embedding gathers from) after converting."""
    model, ids = tied_llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (ids,), strict=strict)
        res = precast.convert(ep, (ids,), policy="torch", weights=precast.WeightOptions(format=weight_format))
    graph = res.program.graph
    head = [n for n in graph.nodes if n.target is aten.linear.default][-1]
    assert list(head.meta["nn_module_stack"].values())[-1][0] == "lm_head"
    found = recognise(head.args[1])
    tables = {n.args[0].meta["val"].dtype for n in graph.nodes if n.target is aten.embedding.default}
    return (found.format if found else None), tables


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_lm_head_weight_names_the_heads_read(tied_llama, strict):
    head, table = _reads(tied_llama, strict, {"lm_head.weight": "int8", "*": "int4"})
    assert head == INT8
    # the embedding gathers int4's packed bytes and zero points (uint8) and its scales, stored on the bf16 grid the
    # head's read shares and cast to fp32 after the gather (non-strict before: int8)
    assert table == {torch.uint8, torch.bfloat16}


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_embed_tokens_weight_names_the_embeddings_read(tied_llama, strict):
    head, table = _reads(tied_llama, strict, {"model.embed_tokens.weight": "int8", "*": "int4"})
    assert table == {
        torch.int8,
        torch.bfloat16,
    }  # int8's integers and scales (on the grid: cast after the gather)
    assert head == Int4(64)  # strict before: int8 (the program's name matched the head's read too)
