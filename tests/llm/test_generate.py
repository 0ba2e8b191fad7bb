"""``precast.generate`` on ``tests.models.TinyDecoder`` (the recipe's ``input_ids`` / ``cache_position``
convention, a static cache of 8 positions): the exported program itself (eager, a private copy of its state) and
the AOTInductor model compiled once per session. Against a hand-written greedy loop on the program's module, bitwise;
the LLM tier (tests/realmodels/test_llm.py) compares with transformers' own ``generate``.
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time

import numpy as np
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
        (dict(max_new_tokens=2, stop_tokens=["a"]), r"stop_tokens\[0\] = 'a' is not an int"),
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


# ---- issue 40: misuse is one line before any call; one generation holds its model ----------------------------
@pytest.fixture(scope="module")
def openvino_decoder(tiny_decoder):
    """The tiny decoder compiled by OpenVINO (its cache as OpenVINO state), once for this module."""
    pytest.importorskip("openvino")
    return precast.compile(tiny_decoder, backend="openvino", warn=False)


@pytest.fixture(params=["program", pytest.param("aoti", marks=pytest.mark.aoti), "openvino"])
def route(request, tiny_decoder):
    """(model, what generate is given) on every backend: the program's runner (``ProgramModel``: the witness of
    its calls), the session's AOTInductor model, the OpenVINO model."""
    if request.param == "program":
        model = ProgramModel(tiny_decoder)
    else:
        model = request.getfixturevalue("compiled_decoder" if request.param == "aoti" else "openvino_decoder")
    return request.param, model


BAD = [
    (dict(input_ids=[1, -1]), r"input_ids\[1\] = -1 is outside the vocabulary, which has 32 ids"),
    (dict(input_ids=[1, 2**40]), r"input_ids\[1\] = 1099511627776 is outside the vocabulary"),
    (dict(input_ids=[32]), r"input_ids\[0\] = 32 is outside the vocabulary"),
    (dict(input_ids=[1, 2**64]), r"input_ids\[1\] = 18446744073709551616 is outside"),
    (dict(input_ids=torch.tensor([[1, 40]])), r"input_ids\[1\] = 40 is outside"),
    (dict(input_ids=[1, 2.0]), r"input_ids\[1\] = 2.0 is not an int"),
    (dict(input_ids="abc"), "input_ids must be a list of ints"),
    (dict(max_new_tokens=2.0), r"max_new_tokens=2.0; give an int >= 1"),
    (dict(seed=2**64), r"seed=18446744073709551616; give an int in \[-2\*\*63, 2\*\*64\)"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(generator="x"), "generator='x'; give a torch.Generator"),
    (dict(stop_tokens=5.0), r"stop_tokens=5.0; give a token id \(int\) or a list of them"),
    (dict(eos_token_id=[np.int64(3), 5.0]), r"eos_token_id\[1\] = 5.0 is not an int"),
    (dict(stop_tokens="5"), "stop_tokens='5'"),
    (dict(temperature=True), "temperature=True"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=2.5), "top_k=2.5"),
    (dict(do_sample="yes"), "do_sample='yes'"),
    (dict(streamer=5), "streamer must be a callable"),
    (dict(continue_from="r1"), "continue_from=str; give a GenerationResult"),
]


@pytest.mark.parametrize("kwargs, match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_are_one_line_before_any_call(route, kwargs, match):
    """Every bad argument on every backend: one PrecastError line, and the model neither called nor reset (its
    state version, which every call and reset() bumps, unchanged). Before the fix, ids outside the vocabulary ran
    (OpenVINO read rows past its table; the program and AOTInductor failed after the prefill), and the rest raised
    TypeError/ValueError/RuntimeError with a traceback."""
    _, model = route
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 3, **kwargs}
    before = model._owner.version
    with pytest.raises(precast.PrecastError, match=match) as err:
        precast.generate(model, **kwargs)
    assert "\n" not in str(err.value)
    assert model._owner.version == before


def test_integer_likes_are_token_ids_and_counts(tiny_decoder):
    """numpy and 0-d tensor integers are accepted wherever an int is (ids, stop tokens, counts, seed)."""
    greedy = greedy_reference(tiny_decoder, PROMPT, 5)
    ids = [np.int64(1), torch.tensor(2), 3]
    res = precast.generate(tiny_decoder, ids, max_new_tokens=np.int64(5), stop_tokens=np.int64(greedy[1]))
    assert res.new_tokens == greedy[: greedy.index(greedy[1]) + 1]
    res = precast.generate(tiny_decoder, PROMPT, max_new_tokens=5, eos_token_id=torch.tensor(greedy[0]))
    assert res.new_tokens == greedy[:1]
    seeded = dict(max_new_tokens=4, temperature=1.5)
    assert (
        precast.generate(tiny_decoder, PROMPT, seed=np.int64(3), **seeded).new_tokens
        == precast.generate(tiny_decoder, PROMPT, seed=3, **seeded).new_tokens
    )


def test_direct_calls_check_the_vocabulary(route):
    """A direct call with an id outside the embedding table: one line before native code reads past it."""
    _, model = route
    with pytest.raises(precast.PrecastError, match="token id 32 is outside the vocabulary, which has 32 ids"):
        model(input_ids=torch.tensor([[1, 32]]), cache_position=torch.arange(2))


def test_tiny_temperature_draws_the_argmax(route, tiny_decoder):
    """temperature 1e-39 passes ``> 0``; dividing the float32 logits by it overflowed to inf and multinomial
    raised after the prefill. The scores are relative to the best logit in float64: the argmax, whatever the seed."""
    _, model = route
    greedy = greedy_reference(tiny_decoder, PROMPT, 4)
    for t in (1e-39, 1e-300, 5e-324):
        for s in range(2):
            assert (
                precast.generate(model, PROMPT, max_new_tokens=4, temperature=t, seed=s).new_tokens == greedy
            )


def test_streamed_program_is_refused_before_any_call(tiny_decoder):
    """A program whose weights are meta tensors (a conversion with streamed weights) cannot run eagerly: one line
    naming the weight, before the prefill ("not on the expected device meta" before the fix)."""
    ep = copy.deepcopy(tiny_decoder)
    for name, value in list(ep.state_dict.items()):
        ep.state_dict[name] = torch.nn.Parameter(torch.empty_like(value, device="meta"), requires_grad=False)
    with pytest.raises(
        precast.PrecastError, match="weight 'emb.weight' holds no values .*weights=DIR"
    ) as err:
        precast.generate(ep, PROMPT, max_new_tokens=2)
    assert "\n" not in str(err.value)


def test_two_threads_take_turns_on_one_model(route, tiny_decoder):
    """Generations in several threads on one model: each holds the model for its whole length, so each gets the
    tokens it gets alone. The streamer waits (0.3 s at most) until every thread has prefilled: before the fix every
    thread then reset and prefilled the one cache under the others, which decoded from it (wrong tokens, no error);
    now the others wait for the holder, which goes on after its wait."""
    _, model = route
    prompts = [[1, 2, 3], [7, 8], [30, 4, 11], [9]]
    want = [greedy_reference(tiny_decoder, p, 4) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def wait_for_the_others(_token: int) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=0.3)

    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = precast.generate(
            model, prompts[i], max_new_tokens=4, streamer=wait_for_the_others
        ).new_tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want


def test_direct_calls_from_another_thread_wait_for_the_generation(route, tiny_decoder):
    """reset() and a call from another thread while a generation holds the model wait until it returns (before
    the fix they ran at once: the reset emptied the cache under the generation, which went on with wrong tokens)."""
    _, model = route
    started, times = threading.Event(), {}

    def slow(_token: int) -> None:
        started.set()
        time.sleep(0.05)
        times["last token"] = time.perf_counter()

    def other() -> None:
        started.wait(timeout=60)
        model.reset()
        times["reset"] = time.perf_counter()
        model(input_ids=torch.tensor([[9, 9]]), cache_position=torch.arange(2))

    t = threading.Thread(target=other)
    t.start()
    res = precast.generate(model, PROMPT, max_new_tokens=5, streamer=slow)
    t.join(timeout=60)
    assert res.new_tokens == greedy_reference(tiny_decoder, PROMPT, 5)
    assert times["reset"] > times["last token"]  # the reset waited for the generation's end


def test_the_streamer_cannot_use_the_model_it_streams(route):
    """From the streamer (the generation's own thread) a call, reset() or generate on the same model is one line:
    the generation holds the cache it is filling."""
    _, model = route
    for use in (
        lambda: model.reset(),
        lambda: model(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])),
        lambda: precast.generate(model, PROMPT, max_new_tokens=1),
    ):

        def streamer(_token: int, use=use) -> None:
            use()

        with pytest.raises(precast.PrecastError, match="generation") as err:
            precast.generate(model, PROMPT, max_new_tokens=2, streamer=streamer)
        assert "\n" not in str(err.value)
    assert precast.generate(model, PROMPT, max_new_tokens=2).new_tokens  # the model is usable again


def test_continue_from_only_the_models_latest_result(route, tiny_decoder):
    """``continue_from=`` a result after anything else ran on the model (another generation, a call, reset()) is
    refused in one line (before the fix it continued the other conversation's cache); the latest continues."""
    _, model = route
    greedy = greedy_reference(tiny_decoder, PROMPT, 5)
    stale = re.escape("continue_from= is stale")
    for meddle in (
        lambda: precast.generate(model, [9, 9], max_new_tokens=2),
        lambda: model.reset(),
        lambda: model(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0])),
    ):
        r1 = precast.generate(model, PROMPT, max_new_tokens=2)
        meddle()
        with pytest.raises(precast.PrecastError, match=stale) as err:
            precast.generate(model, [], max_new_tokens=3, continue_from=r1)
        assert "\n" not in str(err.value)
    r1 = precast.generate(model, PROMPT, max_new_tokens=2)
    r2 = precast.generate(model, [], max_new_tokens=1, continue_from=r1)
    with pytest.raises(precast.PrecastError, match=stale):  # r2 moved the cache on
        precast.generate(model, [], max_new_tokens=1, continue_from=r1)
    r3 = precast.generate(model, [], max_new_tokens=2, continue_from=r2)
    assert r1.new_tokens + r2.new_tokens + r3.new_tokens == greedy


def test_continue_from_another_model_is_refused(tiny_decoder):
    """A result of model A continued on model B: one line (before the fix any two models without ``.program``, or
    two runners of one program, passed the check and A's cache was continued). The program itself may continue its
    own results: each generate on it gets a private copy of its cache, so another generation in between is fine."""
    a, b = ProgramModel(tiny_decoder), ProgramModel(tiny_decoder)
    r = precast.generate(a, PROMPT, max_new_tokens=2)
    with pytest.raises(precast.PrecastError, match="a result of another model"):
        precast.generate(b, [], max_new_tokens=2, continue_from=r)
    greedy = greedy_reference(tiny_decoder, PROMPT, 5)
    r = precast.generate(tiny_decoder, PROMPT, max_new_tokens=2)
    precast.generate(tiny_decoder, [5, 6], max_new_tokens=3)  # its own private cache
    assert (
        r.new_tokens + precast.generate(tiny_decoder, [], max_new_tokens=3, continue_from=r).new_tokens
        == greedy
    )


@pytest.mark.aoti
def test_continue_from_another_compiled_model_is_refused(tiny_decoder, compiled_decoder, aoti_cache):
    other = precast.compile(
        tiny_decoder, cache_dir=aoti_cache, progress=False
    )  # the cached package, loaded again
    assert other is not compiled_decoder
    r = precast.generate(compiled_decoder, PROMPT, max_new_tokens=2)
    for wrong in (other, tiny_decoder):
        with pytest.raises(precast.PrecastError, match="a result of another model"):
            precast.generate(wrong, [], max_new_tokens=2, continue_from=r)


@pytest.mark.aoti
def test_continue_from_after_load_weights_is_refused(tiny_decoder, compiled_decoder):
    """``load_weights`` changes what the cache was computed with: a result from before it is stale."""
    r = precast.generate(compiled_decoder, PROMPT, max_new_tokens=2)
    compiled_decoder.load_weights(dict(tiny_decoder.state_dict))  # the same weights: only the version moves
    with pytest.raises(precast.PrecastError, match="continue_from= is stale"):
        precast.generate(compiled_decoder, [], max_new_tokens=2, continue_from=r)
    want = precast.generate(tiny_decoder, PROMPT, max_new_tokens=4).new_tokens
    assert precast.generate(compiled_decoder, PROMPT, max_new_tokens=4).new_tokens == want
