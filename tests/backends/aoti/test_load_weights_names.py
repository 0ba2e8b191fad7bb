"""``CompiledModel.load_weights`` by the names a user holds (issue 50 item 3): a tied model's own state_dict (one
table under two names), the checkpoint an export-llm program was built from (the recipe's wrapper adds ``model.``
to every name), and a safetensors file of those names all load; a real mismatch is still one line. One compile
(a tiny tied model under a ``model.`` wrapper, int8 weights, as the LLM recipe's program is)."""

from __future__ import annotations

import copy

import pytest
import torch

import precast
from precast.backends.aoti.swap import aligned_names
from precast.errors import PrecastError

safetensors_torch = pytest.importorskip("safetensors.torch")

EXPECTED = {"model.emb.weight", "model.lin.weight", "model.lin.bias"}


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.lin = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight  # tie_word_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(self.emb(ids))))


class Wrapper(torch.nn.Module):  # the export-llm recipe's: the checkpoint's model as ``self.model``
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def _sd(names: list[str]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(4, 4) for n in names}


def test_checkpoint_names_gain_the_recipes_prefix():
    sd = _sd(["emb.weight", "lin.weight", "lin.bias"])
    out = aligned_names(sd, EXPECTED)
    assert set(out) == EXPECTED and out["model.lin.bias"] is sd["lin.bias"]


def test_a_prefix_the_program_lacks_is_removed():
    sd = _sd(["wrapper.model.emb.weight", "wrapper.model.lin.weight", "wrapper.model.lin.bias"])
    assert set(aligned_names(sd, EXPECTED)) == EXPECTED


def test_a_tied_tables_second_name_is_dropped_when_it_is_the_same_or_an_equal_tensor():
    sd = _sd(["model.emb.weight", "model.lin.weight", "model.lin.bias"])
    for twin in (sd["model.emb.weight"], sd["model.emb.weight"].clone()):
        out = aligned_names({**sd, "model.head.weight": twin}, EXPECTED)
        assert set(out) == EXPECTED and out["model.emb.weight"] is sd["model.emb.weight"]
    # the checkpoint's names and the tie together: model.state_dict() of a tied checkpoint
    inner = {
        "emb.weight": sd["model.emb.weight"],
        "head.weight": sd["model.emb.weight"],
        "lin.weight": sd["model.lin.weight"],
        "lin.bias": sd["model.lin.bias"],
    }
    assert set(aligned_names(inner, EXPECTED)) == EXPECTED


def test_real_mismatches_are_left_for_the_check_to_refuse():
    sd = _sd(["model.emb.weight", "model.lin.weight", "model.lin.bias"])
    differs = {**sd, "model.head.weight": sd["model.emb.weight"] + 1}  # a head that is not the table
    assert set(aligned_names(differs, EXPECTED)) == set(differs)
    tied_and_extra = {**sd, "model.head.weight": sd["model.emb.weight"], "model.extra": torch.zeros(1)}
    assert set(aligned_names(tied_and_extra, EXPECTED)) == EXPECTED | {"model.extra"}  # the tie aside
    # one name no prefix explains: the prefix taken for the others, that name stays unexpected (refused)
    other = _sd(["emb.weight", "lin.weight", "other.bias"])
    assert set(aligned_names(other, EXPECTED)) == {"model.emb.weight", "model.lin.weight", "model.other.bias"}
    few = _sd(["emb.weight", "a.bias", "b.bias"])  # the prefix explains too few to say: the names as given
    assert aligned_names(few, EXPECTED) is few
    partial = {**_sd(["emb.weight", "lin.weight"]), "model.lin.bias": torch.zeros(4)}  # prefixes mixed
    assert aligned_names(partial, EXPECTED) is partial
    # two prefixes fit equally (a.x and b.x both missing): ambiguous, not guessed
    assert set(aligned_names({"x": torch.zeros(1)}, {"a.x", "b.x"})) == {"x"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    torch.manual_seed(0)
    model = Wrapper(Tied()).eval()
    ids = torch.tensor([[1, 5, 9, 63]])
    # strict, as the recipe exports: the tied table is one placeholder (``model.emb.weight``) the head reads too
    ep = torch.export.export(model, (ids,), strict=True)
    res = precast.convert(ep, (ids,), weights=precast.WeightOptions(format="int8"))
    cache = tmp_path_factory.mktemp("aoti-cache")
    cm = precast.compile(copy.deepcopy(res.program), cache_dir=cache, progress=False, mode="default")
    return model, ids, res, cm


def _new_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A fine-tuned copy: every weight moved, the tie kept."""
    tuned = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert tuned.model.head.weight is tuned.model.emb.weight
    return tuned


@pytest.mark.aoti
def test_load_weights_takes_the_names_a_user_holds(compiled, tmp_path):
    model, ids, res, cm = compiled
    originals = {st.source.original for st in cm._stored.values()}
    assert originals == EXPECTED  # the recipe's shape: no ``model.head.weight`` (the defect's "unexpected")
    tuned = _new_weights(model)
    by_program = {n: t for n, t in tuned.state_dict().items() if n in originals}
    before = cm(ids)
    cm.load_weights(by_program)  # the names as the program holds them: accepted before this change too
    reference = cm(ids)
    assert not torch.equal(reference, before)
    file = tmp_path / "ckpt.safetensors"  # the checkpoint's names, the tied table saved twice (equal copies)
    safetensors_torch.save_file({n: t.clone() for n, t in tuned.model.state_dict().items()}, str(file))
    ways = {
        "the tied model's own state_dict": tuned.state_dict(),
        "the checkpoint's state_dict": tuned.model.state_dict(),
        "the checkpoint's safetensors": file,
    }
    for way, weights in ways.items():
        cm.load_weights(model.state_dict())  # back to the old weights between ways
        assert torch.equal(cm(ids), before), way
        loaded = cm.load_weights(weights)
        assert sorted(loaded["loaded"]) == sorted(by_program), way
        # bitwise: the same stored tensors as by the program's names
        assert torch.equal(cm(ids), reference), way


@pytest.mark.aoti
def test_load_weights_still_refuses_a_real_mismatch_in_one_line(compiled):
    model, ids, _, cm = compiled
    before = cm(ids)
    sd = model.state_dict()
    bad = {**sd, "model.extra.weight": sd["model.emb.weight"] + 1}  # a tensor the model does not have
    with pytest.raises(PrecastError, match="unexpected 1: .*model.extra.weight") as err:
        cm.load_weights(bad)
    assert "\n" not in str(err.value)
    renamed = {("x." + n if "lin" in n else n): t for n, t in sd.items()}  # a prefix on some names only
    with pytest.raises(PrecastError, match="missing"):
        cm.load_weights(renamed)
    assert torch.equal(cm(ids), before)
