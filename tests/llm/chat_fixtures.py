"""What the chat tests build themselves: a word-level tokenizer with ChatML's special tokens and a chat template,
saved as transformers' ``save_pretrained`` writes it, and a decoder of transformers' recipe whose greedy next token
is always the input token + 1 (so what it answers, and when it reaches the end-of-turn token, is known).

Vocabulary (ids chosen so the counting decoder answers "Paris" then ``<|im_end|>`` after ``assistant``):
0 ``<unk>``, 1 ``<|im_start|>``, 2 ``user``, 3 ``system``, 4..9 ``w4``..``w9``, 10 ``assistant``, 11 ``Paris``,
12 ``<|im_end|>``, 13 ``<|endoftext|>`` (the end-of-sequence token), 14..31 ``w14``..``w31``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

VOCAB = 32
IM_START, USER, SYSTEM, ASSISTANT, PARIS, IM_END, EOS = 1, 2, 3, 10, 11, 12, 13
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def vocabulary() -> dict[str, int]:
    words = {"<unk>": 0, "<|im_start|>": 1, "user": 2, "system": 3, "assistant": 10, "Paris": 11}
    words |= {"<|im_end|>": 12, "<|endoftext|>": 13}
    return words | {f"w{i}": i for i in range(VOCAB) if i not in words.values()}


def tokenizer(template: str | None = CHATML):
    """A transformers fast tokenizer over ``vocabulary()``; ``<|im_start|>``, ``<|im_end|>`` and
    ``<|endoftext|>`` special; ``template`` its chat template (None: none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if template is not None:
        tok.chat_template = template
    return tok


def tokenizer_folder(folder: Path, template: str | None = CHATML) -> Path:
    """``tokenizer(template)`` saved with ``save_pretrained`` into ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(template).save_pretrained(folder)
    return folder


class Counting(nn.Module):
    """transformers' recipe's call convention (``forward(input_ids, cache_position)``, a static cache written
    with ``index_copy_``); logits one-hot at ``input_id + 1`` (mod the vocabulary), scaled: greedy counts up."""

    def __init__(self, length: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, VOCAB)
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(VOCAB).roll(1, dims=1) * 10)
        self.register_buffer("cache", torch.zeros(1, length, VOCAB))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        self.cache.index_copy_(1, cache_position, x)
        return x + 0.0 * self.cache[:, : x.shape[1]]


def counting_program(length: int = 32) -> torch.export.ExportedProgram:
    """``Counting`` exported like the recipe: the sequence length dynamic (1 .. length - 1)."""
    from torch.export import Dim

    seq = Dim("seq", min=1, max=length - 1)
    kwargs = {"input_ids": torch.tensor([[1, 2, 3]]), "cache_position": torch.arange(3)}
    shapes = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    with torch.no_grad():
        return torch.export.export(Counting(length).eval(), (), kwargs, dynamic_shapes=shapes)
