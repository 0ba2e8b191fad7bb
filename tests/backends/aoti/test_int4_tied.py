"""A tied embedding and head with the shared table in int4, compiled by AOTInductor (issue 50 item 3): the head's
int4 kernel reads a packed copy of the table while the embedding still gathers the table's int4 rows. The packed
copy was named ``<table>.int4pack``, a path *under* a tensor that stays in the program, which unlifting refused
("references nonexistent attribute int4pack"), so no tied LLM compiled with an int4 table. One compile.

Outputs against the program's eager run: not bitwise. The head's kernel (``_weight_int4pack_mm_for_cpu``) computes
``(q - 8) * s + (8 - z) * s`` with the second term rounded once (torch's zero convention) and its own accumulation
order, where the program computes ``(q - z) * s`` then a float linear: within 1e-5 of the largest output (fp32).
The embedding's rows, the same int4 table dequantized by the same ops, and the int4 weights themselves: bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

import precast
from precast.backends.aoti.int_rewrite import apply_int_weights
from precast.backends.aoti.int_weights import plan_int_weights
from precast.ir.program import constant_sources

REL = 1e-5  # max |compiled - eager| / max |eager|, fp32: the int4 kernel's zero convention and accumulation order


class Tied(torch.nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.lin = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tie_word_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(self.emb(ids))))


class Wrapper(torch.nn.Module):  # as the export-llm recipe holds the checkpoint's model
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


IDS = torch.tensor([[1, 5, 9, 200, 255, 0]])


def _converted(model: torch.nn.Module) -> torch.export.ExportedProgram:
    # strict, as the recipe exports: one placeholder for the table
    ep = torch.export.export(model, (IDS,), strict=True)
    return precast.convert(ep, (IDS,), weights=precast.WeightOptions(format="int4")).program


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    torch.manual_seed(0)
    model = Wrapper(Tied()).eval()
    program = _converted(model)
    cm = precast.compile(
        copy.deepcopy(program),
        cache_dir=tmp_path_factory.mktemp("aoti-cache"),
        progress=False,
        mode="default",
    )
    return model, program, cm


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_the_tied_table_is_int4_and_read_by_the_embedding_and_the_head():
    torch.manual_seed(0)
    program = _converted(Wrapper(Tied()).eval())
    sources = constant_sources(program)
    assert any(
        (s.derive or "").startswith("int4") for s in sources.values() if s.original == "model.emb.weight"
    )
    # one table: the head reads the embedding's
    assert not any("head" in s.original for s in sources.values())
    rewritten, recipes = apply_int_weights(program, plan_int_weights(program))
    table = [
        s.stored for s in sources.values() if s.original == "model.emb.weight" and s.derive.endswith(".q")
    ]
    (table,) = table
    assert table in rewritten.state_dict  # the embedding still gathers the int4 rows
    packed = f"{table}_int4pack"  # beside the table, not under it
    assert packed in rewritten.state_dict and packed in recipes
    assert torch.equal(rewritten.module()(IDS), rewritten.module()(IDS))
    assert _rel(rewritten.module()(IDS), program.module()(IDS)) <= REL


@pytest.mark.aoti
def test_a_tied_int4_table_compiles_and_matches_the_program(tied):
    model, program, cm = tied
    want = program.module()(IDS)
    got = cm(IDS)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel(got, want) <= REL, _rel(got, want)
    assert not torch.equal(got, model(IDS))  # int4, not the float model (the check can fail)
    batch = torch.randint(0, 256, (3, IDS.shape[1]))  # another batch (dim 0 is dynamic)
    want = torch.cat([program.module()(row[None]) for row in batch])  # the program's guards pin batch 1
    assert _rel(cm(batch), want) <= REL


@pytest.mark.aoti
def test_load_weights_requantizes_the_tied_table_for_both_readers(tied):
    """New weights through the tied state_dict (both names): the table re-quantized once, its packed copy
    recomputed, as a fresh conversion of the new weights computes them."""
    model, _, cm = tied
    tuned = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cm.load_weights(tuned.state_dict())
    fresh = _converted(tuned)
    assert _rel(cm(IDS), fresh.module()(IDS)) <= REL
    for name, value in fresh.state_dict.items():
        if name in cm._constants and value.dtype == torch.uint8:  # the int4 weights: bitwise
            assert torch.equal(cm._constants[name], value), name
    cm.load_weights(model.state_dict())
