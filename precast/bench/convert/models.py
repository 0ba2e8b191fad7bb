"""Real architectures for the conversion-cost benchmark (``precast bench --convert --model NAME``): small
configs, random weights, nothing downloaded.

``CONVERT_MODELS``: name -> (library, builder); each builder returns ``(model, call, inputs)`` where
``call(model, *inputs)`` runs the model to one tensor. A model whose library (transformers, timm) is missing is
skipped by the benchmark with its reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _ids(batch: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _hf(name: str) -> tuple[torch.nn.Module, Callable, tuple]:
    import transformers as tf

    small = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    # the llama and bert stacks' sizes (gpt2 names them its own way)
    layers = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=64, use_cache=False, **small)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = tf.LlamaConfig(num_key_value_heads=2, use_cache=False, **layers, **small)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(**layers, **small)
        model = tf.BertModel(cfg)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        return (
            model,
            lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state,
            (_ids(), mask),
        )
    return model, lambda m, ids: m(input_ids=ids, use_cache=False).logits, (_ids(),)


def _timm(name: str) -> tuple[torch.nn.Module, Callable, tuple]:
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    return model, lambda m, x: m(x), (x,)


CONVERT_MODELS: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, Callable, tuple]]]] = {
    "gpt2": ("transformers", lambda: _hf("gpt2")),
    "llama": ("transformers", lambda: _hf("llama")),
    "bert": ("transformers", lambda: _hf("bert")),
    "convnext_atto": ("timm", lambda: _timm("convnext_atto")),
    "efficientvit_m0": ("timm", lambda: _timm("efficientvit_m0")),
    "fastvit_t8": ("timm", lambda: _timm("fastvit_t8")),
}
