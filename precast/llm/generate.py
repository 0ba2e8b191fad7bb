"""``precast.generate``: token generation for decoders exported with transformers' recipe (a static KV cache held
in buffers the program writes, ``forward(input_ids, cache_position)``), on any runner with that call convention.

    res = precast.generate(model, [1, 17, 42], max_new_tokens=32)              # greedy
    res = precast.generate(model, ids, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=0)   # sampled
    res.new_tokens, res.tokens_per_second
    res = precast.generate(model, messages=[{"role": "user", "content": "Hi"}], tokenizer="smol/",
                           max_new_tokens=64)   # a chat: the chat template of the export-llm folder (or of a
                                                # transformers tokenizer); its end-of-turn token stops (llm/chat.py)

``model``: a ``precast.compile`` model (AOTInductor, or OpenVINO where it keeps the cache as state), or the
(converted) ``ExportedProgram`` itself, run through ``.module()`` on a private copy of the state it writes (the
caller's program is never written). A compiled model must have ``reset()`` and a ``signature``
(``ProgramSignature``): the inputs it takes and the length of the cache its ``cache_position`` indexes, read from
the program's graph (``runtime/signature.py``, ``cache_positions``).

Steps: ``reset()`` (a new sequence; ``continue_from=`` a previous result continues it instead), the prompt in one
call where the program's sequence dimension is dynamic (in chunks of its upper bound), one token per call where it
is static, then one call per new token. Before anything runs, the positions the whole generation writes are
checked against the cache's length: past it is one line, never the kernel's abort.

Every argument is checked before the model is called (one PrecastError line): the options, the token ids against
the vocabulary (the rows of the embedding table the program's ids index, read from its graph), the cache's room.

Concurrency and ownership: a model holds one cache. A generation holds its model for its whole length: other
threads' generations on the same model, and their direct calls, ``reset()`` and ``load_weights``, wait until it
returns (``runtime/owner.py``); the same calls from the generation's own streamer are refused. Each result records
the model's state version: ``continue_from=`` a result after anything else ran on the model (another generation, a
call, ``reset()``, ``load_weights``) is refused, as is a result of another model. A model of another library (one
with ``reset()`` and a ``signature``, not built by precast) is not guarded: serialize its use yourself.

Input: a model, prompt token ids, options. Output: a ``GenerationResult`` (tokens, timings).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError
from precast.ir.fake import has_data
from precast.ir.program import private_state, written_targets
from precast.llm.chat import chat_inputs
from precast.llm.convention import WHAT, Convention, check_room, check_tokens, convention
from precast.llm.sampling import Sampler, as_int, sampler
from precast.runtime.owner import StateOwner, holds_state, owner_of
from precast.runtime.signature import ProgramSignature


@dataclass
class GenerationResult:
    """What ``generate`` produced.

    ``tokens``: (1, prompt + new) int64, the prompt then the new tokens. ``new_tokens``: the new token ids.
    ``stop_reason``: ``"stop_token"`` (the last new token is one of the stop tokens) or ``"max_new_tokens"``.
    ``prefill_seconds``: the prompt's calls and the first token's choice; ``decode_seconds``: every later call
    and choice; ``tokens_per_second``: decode steps per second of decode (the first new token comes from the
    prefill). ``next_position``: the cache positions written so far; ``pending``: tokens chosen but not yet
    written into the cache (the last one), which ``continue_from=`` feeds first. ``state_version``: the model's
    state version when the generation returned (``continue_from=`` checks nothing ran on the model since)."""

    tokens: torch.Tensor
    new_tokens: list[int]
    prompt_length: int
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    next_position: int
    pending: list[int]
    model: Any = field(default=None, repr=False)  # the runner that holds the state (continue_from uses it)
    state_version: int | None = field(default=None, repr=False)

    @property
    def decode_steps(self) -> int:
        return max(len(self.new_tokens) - 1, 0)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


class ProgramModel:
    """An ``ExportedProgram`` of the recipe run eagerly (``.module()``) on its own copy of the state it writes:
    called like a compiled model, with ``reset()`` and ``signature``. The program's weights are shared, never
    written; the caller's cache stays as it was. Calls and ``reset()`` wait while a generation holds it."""

    def __init__(self, program: ExportedProgram):
        _check_weights(program)
        self.program = program
        self.signature = ProgramSignature.from_program(program)
        self._owner = StateOwner()
        self._private = private_state(program)
        self._written = sorted(written_targets(program))
        self._module = self._private.module()

    @holds_state
    def reset(self) -> None:
        with torch.no_grad():
            for name in self._written:
                mine = _constant(self._private, name)
                if mine is not None:
                    mine.copy_(_constant(self.program, name))

    @holds_state
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the cache's end and the vocabulary, before the kernels index past them
        self.signature.check(args, kwargs)
        with torch.no_grad():
            return self._module(*args, **kwargs)


def _check_weights(program: ExportedProgram) -> None:
    """One line when the program holds no values for a weight (a streamed conversion's meta tensors)."""
    for name, value in [*program.state_dict.items(), *program.constants.items()]:
        if isinstance(value, torch.Tensor) and not has_data(value):
            raise PrecastError(
                f"{WHAT}: the program's weight {name!r} holds no values ({value.device.type} tensor: a conversion "
                "with streamed weights); compile it with its shards, precast.compile(program, weights=DIR), and "
                "generate with that model"
            )


def _constant(ep: ExportedProgram, name: str) -> torch.Tensor | None:
    value = ep.state_dict.get(name, ep.constants.get(name))
    return value if isinstance(value, torch.Tensor) else None


def _runner(model: Any) -> Any:
    """``model`` as something callable with ``reset()`` and ``signature``."""
    if isinstance(model, ExportedProgram):
        return ProgramModel(model)
    if not callable(model) and isinstance(getattr(model, "program", None), ExportedProgram):
        return ProgramModel(model.program)  # a ConvertResult
    if not callable(model) or not callable(getattr(model, "reset", None)):
        raise PrecastError(
            f"{WHAT}: got {type(model).__name__}; pass precast.compile(program), the ExportedProgram itself, or a "
            "model with reset() and a signature"
        )
    if _signature(model) is None:
        raise PrecastError(f"{WHAT}: {type(model).__name__} has no signature (a precast ProgramSignature)")
    return model


def _signature(model: Any) -> ProgramSignature | None:
    for attr in ("signature", "_signature"):
        sig = getattr(model, attr, None)
        if isinstance(sig, ProgramSignature):
            return sig
    return None


def _token_list(input_ids: Any) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        dtype = input_ids.dtype
        if input_ids.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise PrecastError(
                f"{WHAT}: input_ids of shape {tuple(input_ids.shape)} {input_ids.dtype}; give one sequence of "
                "integer token ids ((n,) or (1, n))"
            )
        return [int(t) for t in input_ids.tolist()]
    if not isinstance(input_ids, Sequence) or isinstance(input_ids, (str, bytes)):
        raise PrecastError(
            f"{WHAT}: input_ids must be a list of ints or an integer tensor, got {type(input_ids).__name__}"
        )
    return _ints(input_ids, "input_ids")


def _ints(values: Iterable[Any], what: str) -> list[int]:
    """Each of ``values`` as an int (ints and integer-likes: ``numpy.int64``, a one-element integer tensor)."""
    out = []
    for i, t in enumerate(values):
        value = as_int(t)
        if value is None:
            raise PrecastError(f"{WHAT}: {what}[{i}] = {t!r} is not an int; give integer token ids")
        out.append(value)
    return out


def _stops(stop_tokens: Any, eos_token_id: Any) -> frozenset[int]:
    """The stop tokens: an int (or integer-like) or an iterable of them each (need not be in the vocabulary)."""
    out: set[int] = set()
    for name, given in (("stop_tokens", stop_tokens), ("eos_token_id", eos_token_id)):
        if given is None:
            continue
        one = as_int(given)
        if one is not None:
            out.add(one)
            continue
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise PrecastError(f"{WHAT}: {name}={given!r}; give a token id (int) or a list of them")
        out.update(_ints(given, name))
    return frozenset(out)


def _streaming(
    streamer: Any,
) -> tuple[Callable[[list[int]], None], Callable[[int], None], Callable[[], None]]:
    """(prompt, token, end) callbacks: a callable gets each new token id; an object with ``put``/``end``
    (transformers' ``TextStreamer`` protocol) gets the prompt, each token and the end as transformers sends them."""
    none = lambda *_: None  # noqa: E731
    if streamer is None:
        return none, none, none
    if callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None)):
        return (
            lambda ids: streamer.put(torch.tensor([ids])),
            lambda t: streamer.put(torch.tensor([t])),
            streamer.end,
        )
    if callable(streamer):
        return none, streamer, none
    raise PrecastError(f"{WHAT}: streamer must be a callable taking a token id, or have put() and end()")


def _continued(model: Any, result: Any) -> Any:
    """The runner ``result`` (a previous generation's) left its state in; one line unless it is ``model``'s."""
    if not isinstance(result, GenerationResult) or result.model is None:
        raise PrecastError(
            f"{WHAT}: continue_from={type(result).__name__}; give a GenerationResult precast.generate returned"
        )
    runner = result.model
    if isinstance(runner, ProgramModel) and runner is not model:  # the program's private copy
        program = model if isinstance(model, ExportedProgram) else None
        if program is None and not callable(model):
            program = getattr(model, "program", None)  # a ConvertResult
        mine = program is not None and runner.program is program
    else:
        mine = runner is model
    if not mine:
        raise PrecastError(
            f"{WHAT}: continue_from= is a result of another model; pass the model it came from"
        )
    return runner


def _check_version(owner: StateOwner | None, result: GenerationResult) -> None:
    if owner is not None and result.state_version is not None and owner.version != result.state_version:
        raise PrecastError(
            f"{WHAT}: continue_from= is stale: the model ran since that result (another generation, a call, "
            "reset() or load_weights), so its cache no longer holds that sequence; continue from the latest "
            "result, or start again with input_ids=continue_from.tokens[0]"
        )


@dataclass(frozen=True)
class _Plan:
    """A generation's checked inputs: the runner, its call convention, the prompt, what to feed from where."""

    runner: Any
    conv: Convention
    prompt: list[int]
    feed: list[int]  # the pending token of continue_from (if any), then the prompt
    start: int
    count: int  # max_new_tokens
    chat_stops: list[int]  # the stop tokens of messages= (its chat template's), else none


def _plan(
    model: Any, input_ids: Any, max_new_tokens: Any, continue_from: Any, chat: tuple[Any, Any]
) -> _Plan:
    """The model, prompt and continuation checked (one line each) before anything runs: the ids in the vocabulary,
    the generation inside the cache. ``chat``: (messages, tokenizer), the prompt when messages is given."""
    count = as_int(max_new_tokens)
    if count is None or count < 1:
        raise PrecastError(f"{WHAT}: max_new_tokens={max_new_tokens!r}; give an int >= 1")
    input_ids, chat_stops = chat_inputs(input_ids, *chat, continue_from)
    prompt = _token_list(input_ids)
    if continue_from is not None:
        runner = _continued(model, continue_from)
        pending = _ints(continue_from.pending, "continue_from.pending")
        start, feed = continue_from.next_position, pending + prompt
    else:
        runner, start, feed = _runner(model), 0, prompt
    if not feed:
        raise PrecastError(f"{WHAT}: input_ids is empty; give at least one prompt token")
    conv = convention(_signature(runner))  # type: ignore[arg-type]
    check_tokens(conv, feed, "input_ids" if continue_from is None else "continue_from.pending + input_ids")
    check_room(conv, start, len(feed), count)
    return _Plan(runner, conv, prompt, feed, start, count, chat_stops)


def _callbacks(
    streamer: Any, owner: StateOwner | None
) -> tuple[Callable[[list[int]], None], Callable[[int], None], Callable[[], None]]:
    """The streamer's callbacks, with the model refused to them while the generation holds it."""
    callbacks = _streaming(streamer)
    if owner is None:
        return callbacks
    on_prompt, on_token, on_end = (owner.streaming(c) for c in callbacks)
    return on_prompt, on_token, on_end


def _decode(
    runner: Any,
    conv: Convention,
    chooser: Sampler,
    feed: list[int],
    start: int,
    stops: frozenset[int],
    max_new_tokens: int,
    on_token: Callable[[int], None],
) -> tuple[list[int], int, float, float]:
    """Prefill ``feed`` at ``start`` in chunks, then decode: (new tokens, next position, prefill s, decode s)."""
    began = time.perf_counter()
    position = start
    for i in range(0, len(feed), conv.chunk):
        logits = conv.call(runner, feed[i : i + conv.chunk], position)
        position += len(feed[i : i + conv.chunk])
    token = chooser.choose(logits)
    prefill = time.perf_counter() - began
    new = [token]
    on_token(token)
    began = time.perf_counter()
    while token not in stops and len(new) < max_new_tokens:
        logits = conv.call(runner, [token], position)
        position += 1
        token = chooser.choose(logits)
        new.append(token)
        on_token(token)
    return new, position, prefill, time.perf_counter() - began


def generate(
    model: Any,
    input_ids: Any = None,
    *,
    max_new_tokens: int,
    messages: Sequence[dict[str, Any]] | None = None,
    tokenizer: Any = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Iterable[int] | int | None = None,
    eos_token_id: Iterable[int] | int | None = None,
    streamer: Any = None,
    continue_from: GenerationResult | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (see the module docstring).

    ``do_sample``: None samples when ``temperature``/``top_k``/``top_p``/``seed``/``generator`` is given, else
    greedy (argmax, the tokens of transformers' ``generate(do_sample=False)``). ``seed``/``generator``: the draws
    are reproducible; a tiny ``temperature`` draws the argmax. ``stop_tokens`` / ``eos_token_id``: stop after
    producing one (it is kept in the result). ``streamer``: called with each new token id as it is chosen (or
    transformers' streamer protocol); it must not use the model. ``continue_from``: a previous result of the same
    model, with nothing run on the model since: no reset, its pending token and ``input_ids`` (may be empty) are
    fed first, at the positions after it. Ids and counts may be integer-likes. ``messages``: a chat (see above).

    Every argument is checked (one PrecastError line) before the model is called. The generation holds the model
    for its whole length: other threads' generations, calls and ``reset()`` on it wait until it returns.
    """
    plan = _plan(model, input_ids, max_new_tokens, continue_from, (messages, tokenizer))
    chooser = sampler(do_sample, temperature, top_k, top_p, seed, generator)
    stops = _stops(stop_tokens, eos_token_id) | frozenset(plan.chat_stops)
    runner, owner = plan.runner, owner_of(plan.runner)
    on_prompt, on_token, on_end = _callbacks(streamer, owner)
    with owner.generation(WHAT) if owner is not None else nullcontext():
        if continue_from is not None:
            _check_version(owner, continue_from)
        else:
            runner.reset()  # a new sequence
        on_prompt(plan.prompt)
        new, position, prefill, decode = _decode(
            runner, plan.conv, chooser, plan.feed, plan.start, stops, plan.count, on_token
        )
        on_end()
        version = owner.version if owner is not None else None
    history = (continue_from.tokens[0].tolist() if continue_from is not None else []) + plan.prompt + new
    return GenerationResult(
        tokens=torch.tensor([history], dtype=torch.int64),
        new_tokens=new,
        prompt_length=len(plan.prompt),
        stop_reason="stop_token" if new[-1] in stops else "max_new_tokens",
        prefill_seconds=prefill,
        decode_seconds=decode,
        next_position=position,
        pending=[new[-1]],
        model=runner,
        state_version=version,
    )
