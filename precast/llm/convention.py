"""How ``precast.generate`` calls a decoder: the call convention of transformers' recipe read from the program's
signature (where the token ids and cache positions go, the cache's length, the prompt chunk per call), the last
position's logits read from what a call returns, and the check that a generation fits in the cache.

Input: a ``ProgramSignature``. Output: the convention to call the model with; a one-line PrecastError when the
model does not follow the recipe, the generation would pass the cache's end, or a token id is outside the
vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from precast.errors import PrecastError
from precast.runtime.signature import ProgramSignature

WHAT = "precast.generate"


@dataclass(frozen=True)
class Convention:
    """How to call the model: where its token ids and cache positions go, the cache's length, the prompt chunk."""

    ids: tuple[str, int | str]  # ("kwargs", "input_ids") or ("args", 0)
    positions: tuple[str, int | str]
    ids_dtype: torch.dtype
    positions_dtype: torch.dtype
    cache_length: int
    chunk: int  # tokens per prefill call: the sequence dimension's upper bound, or 1 where it is static
    vocab: int | None = None  # the rows of the embedding table the ids index (None: not found in the graph)

    def call(self, model: Callable, ids: list[int], start: int) -> torch.Tensor:
        """The last position's logits of ``model`` run on ``ids`` from position ``start``."""
        return _last_logits(self.run(model, torch.tensor([ids], dtype=self.ids_dtype), start))

    def run(self, model: Callable, tokens: torch.Tensor, start: int) -> Any:
        """``model``'s output for ``tokens`` [1, n] at positions ``start`` .. ``start + n - 1``, each input
        passed where the convention places it."""
        positions = torch.arange(start, start + tokens.shape[-1], dtype=self.positions_dtype)
        args: dict[int, torch.Tensor] = {}
        kwargs: dict[str, torch.Tensor] = {}
        for (root, key), value in ((self.ids, tokens), (self.positions, positions)):
            if root == "args":
                args[int(key)] = value
            else:
                kwargs[str(key)] = value
        return model(*(args[i] for i in sorted(args)), **kwargs)


def _last_logits(out: Any) -> torch.Tensor:
    """The last position's logits, (vocab,) float32, from a tensor / ``.logits`` / the first of a tuple."""
    if hasattr(out, "logits"):
        out = out.logits
    if isinstance(out, (list, tuple)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PrecastError(
            f"{WHAT}: the model returned {shape}; expected logits of shape (1, seq, vocab) (a decoder exported "
            "with transformers' recipe returns them)"
        )
    return (out[0, -1] if out.dim() == 3 else out[0]).float()


def _where(text: str) -> tuple[str, int | str]:
    match = re.fullmatch(r"args\[(\d+)\]", text) or re.fullmatch(r"kwargs\['([^']+)'\]", text)
    if match is None:
        raise PrecastError(
            f"{WHAT}: the model takes an input at {text}; it drives input_ids and cache_position"
        )
    return ("args", int(match.group(1))) if text.startswith("args") else ("kwargs", match.group(1))


def convention(signature: ProgramSignature) -> Convention:
    """The recipe's call convention read from ``signature``; one line when the model does not follow it."""
    tensors = [s for s in signature.inputs if s.kind == "tensor"]
    others = [s.name for s in signature.inputs if s.kind not in ("tensor", "constant")]
    lengths = {n: L for n, L in signature.positions.items() if any(s.name == n for s in tensors)}
    if len(lengths) != 1:
        raise PrecastError(
            f"{WHAT}: cannot find the cache's positions in the program (inputs {[s.name for s in tensors]}): "
            "generate drives decoders exported with transformers' recipe, whose cache_position input indexes a "
            "static KV cache the program writes (index_copy_)"
        )
    ((pos_name, length),) = lengths.items()
    rest = [s for s in tensors if s.name != pos_name]
    if len(rest) != 1 or others or rest[0].dtype.is_floating_point or len(rest[0].dims) != 2:
        raise PrecastError(
            f"{WHAT}: the program takes {[s.name for s in signature.inputs]}; generate drives one (batch, seq) "
            f"tensor of token ids and {pos_name!r}"
        )
    ids = rest[0]
    pos = next(s for s in tensors if s.name == pos_name)
    batch, seq = ids.dims
    if isinstance(batch, int) and batch != 1:
        raise PrecastError(f"{WHAT}: the program was exported for batch {batch}; generate runs batch 1")
    if isinstance(seq, int):
        if seq != 1:
            raise PrecastError(
                f"{WHAT}: the program takes exactly {seq} tokens per call; export it with a dynamic sequence "
                "length (or 1 token per call) to generate"
            )
        chunk = 1
    elif seq in signature.ranges:
        low, high = signature.ranges[seq]
        if low > 1:
            raise PrecastError(
                f"{WHAT}: the program takes at least {low} tokens per call; a decode step is 1"
            )
        chunk = length if high is None else min(high, length)
    else:
        raise PrecastError(f"{WHAT}: the program's sequence dimension is {seq}; generate needs a plain one")
    where = (_where(ids.where), _where(pos.where))
    return Convention(*where, ids.dtype, pos.dtype, length, chunk, signature.vocab.get(ids.name))


def check_tokens(conv: Convention, ids: list[int], what: str, who: str = WHAT) -> None:
    """One line naming the first of ``ids`` outside the vocabulary (the rows of the embedding table the program's
    ids index), or outside the ids' dtype where the graph does not say: before any call, never the kernel's
    "index out of bounds" or a row read past the table. ``who`` prefixes the line (the CLI's flag names itself)."""
    if conv.vocab is not None:
        low, high, where = 0, conv.vocab, f"the vocabulary, which has {conv.vocab} ids (0..{conv.vocab - 1})"
    else:
        low, high = 0, torch.iinfo(conv.ids_dtype).max + 1
        where = f"[0, {high}) (token ids, {str(conv.ids_dtype).removeprefix('torch.')})"
    for i, t in enumerate(ids):
        if not low <= t < high:
            raise PrecastError(
                f"{who + ': ' if who else ''}{what}[{i}] = {t} is outside {where}; pass ids the model's tokenizer "
                "produces"
            )


def check_room(conv: Convention, start: int, feed: int, max_new_tokens: int) -> None:
    """One line when ``feed`` tokens at ``start`` and ``max_new_tokens`` new ones would pass the cache's end (the
    last new token is chosen, never written)."""
    needed = start + feed + max_new_tokens - 1
    if needed > conv.cache_length:
        room = conv.cache_length - start - feed + 1
        fix = (
            f"give max_new_tokens <= {room}" if room >= 1 else "the prompt does not fit; start a new sequence"
        )
        raise PrecastError(
            f"{WHAT}: {start} cached + {feed} prompt + {max_new_tokens} new tokens need {needed} cache "
            f"positions; the program's cache holds {conv.cache_length}: {fix} (or export with a longer "
            "max_cache_len)"
        )
