"""A compiled program that writes state (a KV cache): each ``precast.compile`` call gives a model of its own (the
package and the read-only weights shared, the state never), ``reset()`` restores the program's initial state,
and a cache position past the cache's end is one line before the native code runs.

The program: ``tests.models.TinyDecoder`` (the recipe's ``input_ids`` / ``cache_position`` convention, a static
cache of 8 positions written by ``index_copy_``), compiled once per session (``compiled_decoder``). References:
the program's own module on a private copy of its state (``copy.deepcopy(ep).module()``), run step by step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import precast

pytestmark = pytest.mark.aoti

PROMPT_A, PROMPT_B = [1, 2, 3], [9, 8, 7]


def step(model, ids: list[int], start: int) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), cache_position=torch.arange(start, start + len(ids))).detach()


def eager(ep):
    return copy.deepcopy(ep).module()


def test_two_compiles_of_a_stateful_program_are_two_models(tiny_decoder, compiled_decoder, aoti_cache):
    """Two conversations interleaved on two models of the same program: each decodes what it would alone (the
    old in-process cache returned the same object twice, so the second prefill overwrote the first's cache)."""
    other = precast.compile(tiny_decoder, cache_dir=aoti_cache, progress=False)
    assert other is not compiled_decoder and other.stateful
    assert other.key == compiled_decoder.key and other.from_cache
    # read-only weights shared (held once), the written cache not
    mine, theirs = compiled_decoder._constants, other._constants
    if mine is not None:
        assert mine["emb.weight"].data_ptr() == theirs["emb.weight"].data_ptr()
        assert mine["cache"].data_ptr() != theirs["cache"].data_ptr()
    a, b = compiled_decoder, other
    steps_a, steps_b = [(4, 3), (6, 4)], [(5, 3), (10, 4)]

    def alone(model, prompt, steps):
        model.reset()
        step(model, prompt, 0)
        return [step(model, [t], p) for t, p in steps]

    want_a, want_b = alone(a, PROMPT_A, steps_a), alone(b, PROMPT_B, steps_b)
    ref = eager(tiny_decoder)
    step(ref, PROMPT_A, 0)
    for (t, p), w in zip(steps_a, want_a, strict=True):  # the compiled code computes the program's values
        torch.testing.assert_close(w, step(ref, [t], p), rtol=0, atol=1e-5)
    a.reset(), b.reset()
    step(a, PROMPT_A, 0), step(b, PROMPT_B, 0)
    for (ta, pa), (tb, pb), wa, wb in zip(steps_a, steps_b, want_a, want_b, strict=True):
        assert torch.equal(step(a, [ta], pa), wa)
        assert torch.equal(step(b, [tb], pb), wb)
    assert not torch.equal(want_a[-1], want_b[-1])


def test_reset_restores_the_initial_cache(tiny_decoder, compiled_decoder):
    """After a prefill and reset(), a decode step at position 3 reads positions 0..2 as the program's initial
    (zero) cache: what a fresh copy of the program computes for the same step, not what the prefill wrote."""
    m = compiled_decoder
    m.reset()
    prefilled = (step(m, PROMPT_A, 0), step(m, [4], 3))[1]
    m.reset()
    after_reset = step(m, [4], 3)
    torch.testing.assert_close(after_reset, step(eager(tiny_decoder), [4], 3), rtol=0, atol=1e-5)
    assert (after_reset - prefilled).abs().max() > 0.1
    # the program's own buffer is never written by the compiled model
    assert not tiny_decoder.state_dict["cache"].any()


def test_cache_position_past_the_end_is_one_line_before_native_code(compiled_decoder):
    m = compiled_decoder
    m.reset()
    before = step(m, PROMPT_A, 0)
    for bad in ([8], [-1], [6, 7, 8]):
        ids = [5] * len(bad)
        with pytest.raises(precast.PrecastError, match=r"cache position.* outside the cache, which holds 8"):
            m(input_ids=torch.tensor([ids]), cache_position=torch.tensor(bad))
    # the first position a run of tokens is written from + its length: transformers writes position[0] + arange
    with pytest.raises(precast.PrecastError, match="positions 6..8"):
        m(input_ids=torch.tensor([[5, 5, 5]]), cache_position=torch.tensor([6, 6, 6]))
    # nothing ran: the model's cache is as the prefill left it
    m.reset()
    assert torch.equal(step(m, PROMPT_A, 0), before)
    assert step(m, [5], 7).shape == (1, 1, 32)  # the last position is fine
