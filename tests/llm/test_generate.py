"""``precast.generate`` on ``tests.models.TinyDecoder`` (the recipe's ``input_ids`` / ``cache_position``
convention, a static cache of 8 positions): the exported program itself (eager, a private copy of its state) and
the AOTInductor model compiled once per session. Against a hand-written greedy loop on the program's module, bitwise;
the LLM tier (tests/realmodels/test_llm.py) compares with transformers' own ``generate``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import precast
from precast.llm import ProgramModel
from tests import models as zoo

PROMPT = [1, 2, 3]


def greedy_reference(ep, prompt: list[int], n: int) -> list[int]:
    """Prefill in one call, then one token per call, argmax of the last position: on a private copy."""
    module = copy.deepcopy(ep).module()
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([prompt]), cache_position=torch.arange(len(prompt)))
        out, pos = [int(logits[0, -1].argmax())], len(prompt)
        while len(out) < n:
            logits = module(input_ids=torch.tensor([[out[-1]]]), cache_position=torch.tensor([pos]))
            out.append(int(logits[0, -1].argmax()))
            pos += 1
    return out


def test_greedy_on_the_program_equals_a_hand_written_loop(tiny_decoder):
    before = tiny_decoder.state_dict["cache"].clone()
    res = precast.generate(tiny_decoder, PROMPT, max_new_tokens=5)
    assert res.new_tokens == greedy_reference(tiny_decoder, PROMPT, 5)
    assert res.tokens.tolist() == [PROMPT + res.new_tokens]
    assert (
        res.stop_reason == "max_new_tokens" and res.next_position == 7 and res.pending == res.new_tokens[-1:]
    )
    assert res.decode_steps == 4 and res.tokens_per_second > 0 and res.prefill_seconds > 0
    assert torch.equal(tiny_decoder.state_dict["cache"], before)  # the caller's program never written
    # a second generation starts a new sequence: the same tokens
    assert precast.generate(tiny_decoder, PROMPT, max_new_tokens=5).new_tokens == res.new_tokens


def test_static_sequence_program_prefills_token_by_token():
    dynamic, static = zoo.tiny_decoder_program(), zoo.tiny_decoder_program(dynamic=False)
    calls = []
    model = ProgramModel(static)
    inner = model._module
    model._module = lambda **kw: calls.append(kw["input_ids"].shape[1]) or inner(**kw)
    got = precast.generate(model, PROMPT, max_new_tokens=4)
    assert calls == [1, 1, 1, 1, 1, 1]  # 3 prompt tokens one by one, then 3 decode steps
    want = precast.generate(dynamic, PROMPT, max_new_tokens=4).new_tokens
    assert got.new_tokens == want == greedy_reference(dynamic, PROMPT, 4)


def test_sampling_is_reproducible_and_follows_its_options(tiny_decoder):
    kw = dict(max_new_tokens=5, temperature=1.5)
    a = precast.generate(tiny_decoder, PROMPT, seed=0, **kw).new_tokens
    assert a == precast.generate(tiny_decoder, PROMPT, seed=0, **kw).new_tokens
    g = torch.Generator().manual_seed(0)
    assert a == precast.generate(tiny_decoder, PROMPT, generator=g, **kw).new_tokens
    draws = {tuple(precast.generate(tiny_decoder, PROMPT, seed=s, **kw).new_tokens) for s in range(8)}
    assert len(draws) > 1  # temperature 1.5 over 32 tokens: 8 seeds do not all draw the greedy path
    greedy = greedy_reference(tiny_decoder, PROMPT, 5)
    # top_k=1 and a tiny top_p keep only the most likely token: the greedy path whatever the seed
    for opts in ({"top_k": 1}, {"top_p": 1e-6}):
        for s in range(3):
            assert precast.generate(tiny_decoder, PROMPT, seed=s, **kw, **opts).new_tokens == greedy


def test_stop_tokens_streamer_and_continuation(tiny_decoder):
    greedy = greedy_reference(tiny_decoder, PROMPT, 5)
    seen: list[int] = []
    res = precast.generate(
        tiny_decoder, PROMPT, max_new_tokens=5, stop_tokens=[greedy[2]], streamer=seen.append
    )
    first = greedy.index(greedy[2])
    assert res.new_tokens == greedy[: first + 1] == seen and res.stop_reason == "stop_token"
    # continuing a result feeds its pending token first: two halves make the whole greedy run
    part = precast.generate(tiny_decoder, PROMPT, max_new_tokens=2)
    rest = precast.generate(tiny_decoder, [], max_new_tokens=3, continue_from=part)
    assert part.new_tokens + rest.new_tokens == greedy
    assert rest.tokens.tolist() == [PROMPT + greedy]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(max_new_tokens=7),
            r"0 cached \+ 3 prompt \+ 7 new tokens need 9 .* holds 8: give max_new_tokens <= 6",
        ),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=2, do_sample=False, temperature=0.5), "do_sample=False"),
        (dict(max_new_tokens=2, temperature=0), "temperature=0"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p=1.5"),
        (dict(max_new_tokens=2, top_k=0), "top_k=0"),
        (dict(max_new_tokens=2, seed=1, generator=torch.Generator()), "not both"),
        (dict(max_new_tokens=2, stop_tokens=["a"]), "stop token 'a'"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(tiny_decoder, kwargs, match):
    with pytest.raises(precast.PrecastError, match=match) as err:
        precast.generate(tiny_decoder, PROMPT, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_models_and_prompts_are_one_line(tiny_decoder):
    with pytest.raises(precast.PrecastError, match="input_ids is empty"):
        precast.generate(tiny_decoder, [], max_new_tokens=2)
    with pytest.raises(precast.PrecastError, match="one sequence of integer token ids"):
        precast.generate(tiny_decoder, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2)
    model, inputs = zoo.small_mlp(2)
    with pytest.raises(precast.PrecastError, match="cannot find the cache's positions"):
        precast.generate(torch.export.export(model, inputs), PROMPT, max_new_tokens=2)
    with pytest.raises(precast.PrecastError, match="pass precast.compile"):
        precast.generate(object(), PROMPT, max_new_tokens=2)


@pytest.mark.aoti
def test_compiled_model_generates_the_programs_tokens(tiny_decoder, compiled_decoder):
    """Greedy on the AOTInductor model: the program's tokens (its logits within 1e-5 of the program's); seeded
    sampling reproducible; the cache-end check fires before the compiled code runs."""
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=5).new_tokens
    assert precast.generate(compiled_decoder, PROMPT, max_new_tokens=5).new_tokens == want
    kw = dict(max_new_tokens=5, temperature=1.5, top_p=0.9)
    assert (
        precast.generate(compiled_decoder, PROMPT, seed=3, **kw).new_tokens
        == precast.generate(compiled_decoder, PROMPT, seed=3, **kw).new_tokens
    )
    with pytest.raises(precast.PrecastError, match="holds 8"):
        precast.generate(compiled_decoder, [1] * 7, max_new_tokens=3)
    # the last position of the cache is usable: 3 prompt + 6 new tokens write positions 0..7
    assert len(precast.generate(compiled_decoder, PROMPT, max_new_tokens=6).new_tokens) == 6


def test_streamer_protocol_of_transformers(tiny_decoder):
    """An object with put()/end() (transformers' TextStreamer) gets the prompt, each new token, then end()."""

    class Streamer:
        def __init__(self):
            self.seen: list = []

        def put(self, value: torch.Tensor) -> None:
            self.seen.append(value.tolist())

        def end(self) -> None:
            self.seen.append("end")

    s = Streamer()
    res = precast.generate(tiny_decoder, PROMPT, max_new_tokens=3, streamer=s)
    assert s.seen == [[PROMPT], *([t] for t in res.new_tokens), "end"]
