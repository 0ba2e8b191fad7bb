"""How ``precast.generate`` chooses each next token: greedy (argmax), or a draw after temperature, top-k and top-p
(transformers' order), reproducible from a seed or generator; the sampling options checked.

The scores are computed in float64 after subtracting the largest logit, so any temperature > 0 works: a tiny one
(1e-39) divides the gaps to the best token into -inf instead of overflowing, and the draw degenerates to the argmax.

Input: the sampling options, then each step's logits. Output: a token id; a one-line PrecastError for a bad option.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from precast.errors import PrecastError
from precast.llm.convention import WHAT


@dataclass(frozen=True)
class Sampler:
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token: the argmax, or a draw after temperature, top-k and top-p (transformers' order)."""
        if not self.do_sample:
            return int(logits.argmax())
        best = logits.max()
        if not bool(torch.isfinite(best)):  # NaN propagates to the max; +inf, or every logit -inf
            raise PrecastError(
                f"{WHAT}: the model returned logits whose largest value is {float(best)}; nothing to sample from "
                "(check the model's numerics, e.g. precast.sensitivity, or generate greedily)"
            )
        # float64, relative to the best token: a tiny temperature sends the others to -inf, never to NaN
        scores = (logits.double() - best.double()) / self.temperature
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


def as_int(value: Any) -> int | None:
    """``value`` as an int when it is one or an integer-like (``numpy.int64``, a one-element integer tensor:
    ``operator.index``), else None; a bool is not a token id or a count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # not an integer-like (a float, a str, a float tensor)
        return None


def _number(value: Any, name: str, fits: str, ok: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not ok(float(value)):
        raise PrecastError(f"{WHAT}: {name}={value!r}; give a number {fits}")
    return float(value)


def _count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    n = as_int(value)
    if n is None or n < 1:
        raise PrecastError(f"{WHAT}: {name}={value!r}; give an int >= 1")
    return n


def _generator(seed: Any, generator: Any) -> torch.Generator | None:
    if seed is not None and generator is not None:
        raise PrecastError(f"{WHAT}: give seed= or generator=, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise PrecastError(f"{WHAT}: generator={generator!r}; give a torch.Generator (or seed=)")
        if generator.device.type != "cpu":
            raise PrecastError(
                f"{WHAT}: generator on {generator.device}; the draws run on the CPU: give a CPU torch.Generator"
            )
        return generator
    if seed is None:
        return None
    value = as_int(seed)
    if value is None or not -(2**63) <= value < 2**64:  # torch.Generator.manual_seed's range
        raise PrecastError(f"{WHAT}: seed={seed!r}; give an int in [-2**63, 2**64)")
    return torch.Generator().manual_seed(value)


def sampler(
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    generator: torch.Generator | None,
) -> Sampler:
    """The checked sampling options (one PrecastError line for a bad one) as the chooser of each next token."""
    if do_sample is not None and not isinstance(do_sample, bool):
        raise PrecastError(f"{WHAT}: do_sample={do_sample!r}; give True, False or None")
    asked = [
        n for n, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None
    ]
    if do_sample is None:
        do_sample = bool(asked) or seed is not None or generator is not None
    if not do_sample and asked:
        raise PrecastError(
            f"{WHAT}: {', '.join(asked)} given with do_sample=False; they apply to sampling only"
        )
    temp = _number(temperature, "temperature", "> 0", lambda t: 0 < t < math.inf)
    k = _count(top_k, "top_k")
    p = _number(top_p, "top_p", "in (0, 1]", lambda t: 0 < t <= 1)
    return Sampler(do_sample, 1.0 if temp is None else temp, k, p, _generator(seed, generator))
