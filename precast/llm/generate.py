"""``precast.generate``: token generation for decoders exported with transformers' recipe (a static KV cache held
in buffers the program writes, ``forward(input_ids, cache_position)``), on any runner with that call convention.

    res = precast.generate(model, [1, 17, 42], max_new_tokens=32)              # greedy
    res = precast.generate(model, ids, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=0)   # sampled
    res.new_tokens, res.tokens_per_second

``model``: a ``precast.compile`` model (AOTInductor, or OpenVINO where it keeps the cache as state), or the
(converted) ``ExportedProgram`` itself, run through ``.module()`` on a private copy of the state it writes (the
caller's program is never written). A compiled model must have ``reset()`` and a ``signature``
(``ProgramSignature``): the inputs it takes and the length of the cache its ``cache_position`` indexes, read from
the program's graph (``backends/signature.py``, ``cache_positions``).

Steps: ``reset()`` (a new sequence; ``continue_from=`` a previous result continues it instead), the prompt in one
call where the program's sequence dimension is dynamic (in chunks of its upper bound), one token per call where it
is static, then one call per new token. Before anything runs, the positions the whole generation writes are
checked against the cache's length: past it is one line, never the kernel's abort.

Input: a model, prompt token ids, options. Output: a ``GenerationResult`` (tokens, timings).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.signature import ProgramSignature
from precast.errors import PrecastError
from precast.ir.program import private_state, written_targets
from precast.llm.convention import WHAT, check_room, convention
from precast.llm.sampling import sampler


@dataclass
class GenerationResult:
    """What ``generate`` produced.

    ``tokens``: (1, prompt + new) int64, the prompt then the new tokens. ``new_tokens``: the new token ids.
    ``stop_reason``: ``"stop_token"`` (the last new token is one of the stop tokens) or ``"max_new_tokens"``.
    ``prefill_seconds``: the prompt's calls and the first token's choice; ``decode_seconds``: every later call
    and choice; ``tokens_per_second``: decode steps per second of decode (the first new token comes from the
    prefill). ``next_position``: the cache positions written so far; ``pending``: tokens chosen but not yet
    written into the cache (the last one), which ``continue_from=`` feeds first."""

    tokens: torch.Tensor
    new_tokens: list[int]
    prompt_length: int
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    next_position: int
    pending: list[int]
    model: Any = field(default=None, repr=False)  # the runner that holds the state (continue_from uses it)

    @property
    def decode_steps(self) -> int:
        return max(len(self.new_tokens) - 1, 0)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


class ProgramModel:
    """An ``ExportedProgram`` of the recipe run eagerly (``.module()``) on its own copy of the state it writes:
    called like a compiled model, with ``reset()`` and ``signature``. The program's weights are shared, never
    written; the caller's cache stays as it was."""

    def __init__(self, program: ExportedProgram):
        self.program = program
        self.signature = ProgramSignature.from_program(program)
        self._private = private_state(program)
        self._written = sorted(written_targets(program))
        self._module = self._private.module()

    def reset(self) -> None:
        with torch.no_grad():
            for name in self._written:
                mine = _constant(self._private, name)
                if mine is not None:
                    mine.copy_(_constant(self.program, name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.signature.check(args, kwargs)  # the cache's end, before the kernels index past it
        with torch.no_grad():
            return self._module(*args, **kwargs)


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
        if input_ids.dim() != 1 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise PrecastError(
                f"{WHAT}: input_ids of shape {tuple(input_ids.shape)} {input_ids.dtype}; give one sequence of "
                "integer token ids ((n,) or (1, n))"
            )
        return [int(t) for t in input_ids.tolist()]
    if isinstance(input_ids, Sequence) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in input_ids
    ):
        return list(input_ids)
    raise PrecastError(
        f"{WHAT}: input_ids must be a list of ints or an integer tensor, got {type(input_ids).__name__}"
    )


def _stops(
    stop_tokens: Iterable[int] | int | None, eos_token_id: Iterable[int] | int | None
) -> frozenset[int]:
    out: set[int] = set()
    for given in (stop_tokens, eos_token_id):
        if given is None:
            continue
        for t in [given] if isinstance(given, int) else given:
            if not isinstance(t, int) or isinstance(t, bool):
                raise PrecastError(f"{WHAT}: stop token {t!r} is not an int")
            out.add(t)
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


def generate(
    model: Any,
    input_ids: Any,
    *,
    max_new_tokens: int,
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
    are reproducible. ``stop_tokens`` / ``eos_token_id``: stop after producing one (it is kept in the result).
    ``streamer``: called with each new token id as it is chosen (or transformers' streamer protocol).
    ``continue_from``: a previous result of the same model: no reset, its pending token and ``input_ids``
    (may be empty) are fed first, at the positions after it.
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise PrecastError(f"{WHAT}: max_new_tokens={max_new_tokens!r}; give an int >= 1")
    prompt = _token_list(input_ids)
    chooser = sampler(do_sample, temperature, top_k, top_p, seed, generator)
    stops = _stops(stop_tokens, eos_token_id)
    on_prompt, on_token, on_end = _streaming(streamer)
    if continue_from is not None:
        runner = continue_from.model
        mine = runner is model or getattr(runner, "program", None) in (model, getattr(model, "program", None))
        if runner is None or not mine:
            raise PrecastError(
                f"{WHAT}: continue_from= is a result of another model; pass the model it came from"
            )
        start, feed = continue_from.next_position, continue_from.pending + prompt
    else:
        runner, start, feed = _runner(model), 0, prompt
    if not feed:
        raise PrecastError(f"{WHAT}: input_ids is empty; give at least one prompt token")
    conv = convention(_signature(runner))  # type: ignore[arg-type]
    check_room(conv, start, len(feed), max_new_tokens)
    if continue_from is None:
        runner.reset()  # a new sequence
    on_prompt(prompt)
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
    decode = time.perf_counter() - began
    on_end()
    history = (continue_from.tokens[0].tolist() if continue_from is not None else []) + prompt + new
    return GenerationResult(
        tokens=torch.tensor([history], dtype=torch.int64),
        new_tokens=new,
        prompt_length=len(prompt),
        stop_reason="stop_token" if token in stops else "max_new_tokens",
        prefill_seconds=prefill,
        decode_seconds=decode,
        next_position=position,
        pending=[token],
        model=runner,
    )
