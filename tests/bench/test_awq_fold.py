"""benchmarks/awq_fold.py (AWQ's scaling folded into a transformers Llama, for ``llm_weights --awq``) and
benchmarks/minilm_weights_llamacpp.py's own parts: the fold keeps the float function (bitwise with powers of two),
the search never does worse than no scaling by its own measure, and llama.cpp's BERT names map to BertModel's."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _llama():
    from tests.quant.conftest import tied_llama_config

    config = tied_llama_config(transformers, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("pow2", [True, False], ids=["powers-of-two", "as-searched"])
def test_the_fold_keeps_the_float_function(pow2):
    from benchmarks.awq_fold import fold_awq

    model = _llama()
    # uneven channels, as real activations have: what AWQ's scales answer
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(torch.linspace(0.2, 3.0, 128))
    ids = [torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    scaled = copy.deepcopy(model)
    alphas = fold_awq(scaled, ids, group=64, pow2=pow2)
    assert len(alphas) == 4 * 2 and all(v["error"] <= 1.0 for v in alphas.values())
    assert any(v["alpha"] > 0 for v in alphas.values())  # something was scaled
    changed = [
        n for n, p in scaled.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])
    ]
    assert changed
    folded = ("layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert all(any(f in n for f in folded) for n in changed), (
        changed
    )  # the tied head and final norm left alone
    with torch.no_grad():
        probe = torch.arange(20)[None]
        want, got = model(input_ids=probe).logits, scaled(input_ids=probe).logits
    if pow2:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_search_returns_no_scaling_when_none_helps():
    from benchmarks.awq_fold import search_scale

    x = torch.ones(64, 64)  # every channel alike: every alpha gives the same scales (all 1)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    s, alpha, ratio = search_scale(x, [w], 64)
    assert alpha == 0.0 and ratio == 1.0 and torch.equal(s, torch.ones(64))


def test_llamacpp_bert_names_map_to_bertmodel():
    from benchmarks.minilm_weights_llamacpp import hf_name

    assert hf_name("token_embd.weight") == "bert.embeddings.word_embeddings.weight"
    assert hf_name("token_embd_norm.bias") == "bert.embeddings.LayerNorm.bias"
    assert hf_name("blk.3.attn_q.weight") == "bert.encoder.layer.3.attention.self.query.weight"
    assert (
        hf_name("blk.0.attn_output_norm.weight") == "bert.encoder.layer.0.attention.output.LayerNorm.weight"
    )
    assert hf_name("blk.5.ffn_down.bias") == "bert.encoder.layer.5.output.dense.bias"
    assert hf_name("blk.5.layer_output_norm.weight") == "bert.encoder.layer.5.output.LayerNorm.weight"
