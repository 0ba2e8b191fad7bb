"""How ``precast.generate`` chooses each next token: greedy (argmax), or a draw after temperature, top-k and top-p
(transformers' order), reproducible from a seed or generator; the sampling options checked.

Input: the sampling options, then each step's logits. Output: a token id; a one-line PrecastError for a bad option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from precast.errors import PrecastError
from precast.llm.convention import WHAT


@dataclass(frozen=True)
class _Sampler:
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token: the argmax, or a draw after temperature, top-k and top-p (transformers' order)."""
        if not self.do_sample:
            return int(logits.argmax())
        scores = logits / self.temperature
        if self.top_k is not None and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1.0:
            # keep the smallest set of most likely tokens whose probability reaches top_p (at least one)
            ordered, order = torch.sort(scores, descending=False)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative <= (1 - self.top_p)
            drop[-1] = False
            scores = scores.masked_fill(drop.scatter(0, order, drop), -math.inf)
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sampler(
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    generator: torch.Generator | None,
) -> _Sampler:
    asked = [
        n for n, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None
    ]
    if do_sample is None:
        do_sample = bool(asked) or seed is not None or generator is not None
    if not do_sample and asked:
        raise PrecastError(
            f"{WHAT}: {', '.join(asked)} given with do_sample=False; they apply to sampling only"
        )
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
        raise PrecastError(f"{WHAT}: temperature={temperature!r}; give a number > 0")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise PrecastError(f"{WHAT}: top_k={top_k!r}; give an int >= 1")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise PrecastError(f"{WHAT}: top_p={top_p!r}; give a number in (0, 1]")
    if seed is not None and generator is not None:
        raise PrecastError(f"{WHAT}: give seed= or generator=, not both")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PrecastError(f"{WHAT}: seed={seed!r}; give an int")
        generator = torch.Generator().manual_seed(seed)
    return _Sampler(do_sample, float(temperature or 1.0), top_k, top_p, generator)
