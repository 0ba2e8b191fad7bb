"""``load_weights`` on an export-llm folder's AOTInductor model by the checkpoint's own names (issue 50 item 3): the
recipe's wrapper adds ``model.`` to every name, and a tied checkpoint (``tie_word_embeddings``, as SmolLM2's) saves
the table once. The checkpoint folder's ``model.safetensors`` and the transformers model's state_dict (the table
under both names) load, bitwise as the same weights given under the program's names; a real mismatch is one line.
One export and one compile of a tiny seeded tied Llama."""

from __future__ import annotations

import shutil

import pytest
import torch

import precast
from precast.errors import PrecastError

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.cli.test_cli_llm_export import save_checkpoint

    root = tmp_path_factory.mktemp("tied")
    save_checkpoint(root / "untied")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "untied")
    model.config.tie_word_embeddings = True  # the same seeded model, tied
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(root / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "untied" / name, root / "ckpt" / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "ckpt")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.manual_seed(1)
    with torch.no_grad():  # a fine-tuned checkpoint: every weight moved, the tie kept
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(root / "tuned")  # the tied table saved once, as transformers saves it
    precast.export_llm(str(root / "ckpt"), root / "out", weight_format="int8")
    llm = precast.load(root / "out", backend="aoti", cache_dir=root / "cache")
    return root, model, llm.model


def test_the_checkpoint_and_its_state_dict_load_as_the_programs_names(folder):
    root, tuned, cm = folder
    originals = {st.source.original for st in cm._stored.values()}
    assert "model.model.embed_tokens.weight" in originals and "model.lm_head.weight" not in originals
    file = root / "tuned" / "model.safetensors"
    with pytest.raises(PrecastError):  # not silently: the file under its own names holds no lm_head.weight
        cm.load_weights({"lm_head.weight": tuned.state_dict()["lm_head.weight"]})
    by_program = {f"model.{n}": t for n, t in tuned.state_dict().items() if f"model.{n}" in originals}
    cm.load_weights(by_program)
    want = {n: t.clone() for n, t in cm._constants.items()}
    for weights in (file, tuned.state_dict()):
        cm.load_weights(root / "ckpt" / "model.safetensors")  # the original weights between the two
        assert any(not torch.equal(cm._constants[n], t) for n, t in want.items())
        loaded = cm.load_weights(weights)
        assert sorted(loaded["loaded"]) == sorted(by_program)
        for name, value in want.items():
            assert torch.equal(cm._constants[name], value), name


def test_another_models_weights_are_still_refused_in_one_line(folder):
    root, tuned, cm = folder
    sd = tuned.state_dict()
    sd["model.extra.weight"] = torch.zeros(3)
    with pytest.raises(PrecastError, match="unexpected 1: model.model.extra.weight") as err:
        cm.load_weights(sd)
    assert "\n" not in str(err.value)
