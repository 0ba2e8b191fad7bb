"""Shared fixtures of the weight-format tests."""

from __future__ import annotations

import pytest
import torch


def tied_llama_config(transformers, **overrides):
    """The weight-format tests' tiny Llama (one layer, hidden 64, 96 tokens) with a tied embedding/head."""
    defaults = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    }
    return transformers.LlamaConfig(**{**defaults, **overrides})


@pytest.fixture(scope="module")
def recipe_program() -> torch.export.ExportedProgram:
    """A tiny Llama with a tied embedding/head, exported by the LLM recipe (``precast export-llm``'s): its
    program names every weight with the wrapper's ``model.`` prefix."""
    transformers = pytest.importorskip("transformers")
    from precast.llm.checkpoint import export_decoder

    config = tied_llama_config(transformers)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ep = export_decoder(model, 16)
    assert "model.model.embed_tokens.weight" in ep.state_dict  # the names the rules must see through
    return ep
