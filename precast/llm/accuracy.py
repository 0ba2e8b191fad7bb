"""How far a converted decoder's next-token distributions are from the float32 model's, on held-out text: the
numbers users judge an LLM by, which ``precast export-llm`` prints and records (report.json, export.json) and
``precast check`` prints for a decoder.

- ``KLD``: mean KL(fp32 || converted) of the next-token distribution per position, nats/token.
- ``top-1``: the share of positions whose most likely next token is the fp32 model's, with its standard error
  ``sqrt(p (1 - p) / n)`` (positions counted as independent draws, which neighbouring tokens are not quite).
- perplexity of the text under each (the converted and the fp32 model), teacher-forced.

The text is cut into windows of ``window`` tokens (``window + 1`` ids: every position has its next token as the
label), each run from an empty cache (``reset()``, position 0), as many as ``tokens`` asks, through the decoder's
call convention (``precast.llm.convention``: transformers' static-cache recipe). The metrics are
``precast.metrics.next_token_metrics``, summed over positions in chunks (the float64 log-softmax of a 49k
vocabulary stays ~25 MB). Held-out text: what a budget's calibration left unused (``held_out``), else Python's
own documentation (``pydoc_data.topics``, shipped with CPython: nothing is downloaded).

Input: the fp32 reference (the transformers model itself, or a program) and the converted model
(``ExportedProgram``, or a compiled model with the recipe's ``signature`` and ``reset()``), token ids. Output: an ``Agreement`` (``record()`` for JSON, ``line()`` for the terminal); one PrecastError line for
text too short, ids outside the vocabulary, or a model that is not a decoder of the recipe.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError
from precast.llm.convention import Convention, check_tokens, convention
from precast.metrics import next_token_metrics
from precast.report.model import accuracy_line
from precast.runtime.signature import ProgramSignature

DEFAULT_TOKENS = 512  # two windows of 256: top-1's standard error ~1 point at 95 %; ~6 s of CPU on 135 M
DEFAULT_WINDOW = 256
MIN_TOKENS = 32  # fewer held-out tokens than this after a calibration: the built-in sample instead
CHUNK = 64  # positions per float64 log-softmax: ~25 MB per temporary at a 49k vocabulary
SAMPLE = "Python's documentation (pydoc_data)"


@dataclass(frozen=True)
class Agreement:
    """The measurement: ``positions`` teacher-forced positions in ``windows`` windows of ``window`` tokens of
    ``text``, against ``reference``; ``seconds`` both models' runs and the metrics took, at ``threads``."""

    reference: str
    text: str
    positions: int
    windows: int
    window: int
    kld: float
    top1: float
    top1_se: float
    ppl: float
    reference_ppl: float
    seconds: float
    threads: int  # torch's intra-op threads the runs took

    def record(self) -> dict[str, Any]:
        """JSON-ready: the fields as they are, ``kld`` in nats/token, ``top1`` and ``top1_se`` as fractions."""
        return asdict(self)

    def line(self) -> str:
        """``KLD 0.0061 nats/token, top-1 agreement 95.1% (s.e. 1.0%), perplexity 9.87 (fp32 9.80); vs ...``
        (the report's own line: ``precast.report.model.accuracy_line``)."""
        return accuracy_line(self.record())


def decoder_convention(program: ExportedProgram) -> Convention | None:
    """The recipe's call convention of ``program``, or None when it is not a decoder of transformers' recipe
    (token ids and the cache positions of a static cache it writes): then there is no text to measure on."""
    try:
        return convention(ProgramSignature.from_program(program))
    except PrecastError:  # the one answer wanted here: not a decoder of the recipe (any other program)
        return None


def sample_text() -> str:
    """The built-in held-out text: Python's documentation topics (``pydoc_data``, part of CPython)."""
    try:
        import pydoc_data.topics as topics
    except ImportError as exc:  # a Python built without its documentation data
        raise PrecastError(
            f"the built-in held-out text is {SAMPLE}, which this Python lacks ({exc}); give a text file"
        ) from None
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids by a transformers tokenizer or a ``tokenizers.Tokenizer`` (tokenizer.json)."""
    if hasattr(tokenizer, "encode") and not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        return list(tokenizer.encode(text).ids)  # tokenizers.Tokenizer
    from precast.llm.checkpoint import quiet_transformers

    with quiet_transformers():  # "longer than the model's maximum length": the text is cut into windows here
        return list(tokenizer(text)["input_ids"])


def held_out(
    tokenizer: Any, text: str | None, used: int, tokens: int, window: int, name: str = "the text"
) -> tuple[list[int], str]:
    """(ids, what they are): ``text``'s tokens after the first ``used`` (what a calibration read), enough for
    ``tokens`` positions in windows of ``window``; the built-in sample when there is no text, or when a
    calibration left fewer than ``MIN_TOKENS`` of it (a text given to measure on alone: one line instead)."""
    if text is not None:
        rest = encode(tokenizer, text)[used:]
        if len(rest) > MIN_TOKENS:
            what = f"{name} after its {used} calibration tokens" if used else name
            return rest[: _needed(tokens, window)], what
        if not used:
            raise PrecastError(f"{name}: {len(rest)} token(s); give text of at least {MIN_TOKENS + 1} tokens")
    need = _needed(tokens, window)
    sample = sample_text()
    ids = encode(tokenizer, sample[: 16 * need])
    if len(ids) <= need + 16:  # a tokenizer of more than ~16 characters per token: the whole text
        ids = encode(tokenizer, sample)
    return ids[:need], SAMPLE


def on_held_out_text(
    reference: Any,
    converted: ExportedProgram,
    tokenizer: Any,
    *,
    tokens: int = DEFAULT_TOKENS,
    text: str | None = None,
    used: int = 0,
    name: str = "the text",
    reference_name: str = "the fp32 model",
) -> Agreement:
    """What ``precast export-llm`` and ``precast check`` run: ``converted`` against ``reference`` on ``tokens``
    positions of held-out text (``held_out``: ``text`` after its first ``used`` tokens, else the built-in
    sample), in windows of ``DEFAULT_WINDOW`` tokens or the most the program takes per call."""
    window = min(DEFAULT_WINDOW, _convention(converted).chunk, max(tokens, 1))
    ids, what = held_out(tokenizer, text, used, tokens, window, name)
    return measure(reference, converted, ids, window, reference_name=reference_name, text=what)


def _needed(tokens: int, window: int) -> int:
    """Ids for ``tokens`` positions in whole windows (at least one), plus the last label."""
    return max(1, tokens // window) * window + 1


def measure(
    reference: Any,
    converted: Any,
    ids: Sequence[int],
    window: int,
    *,
    reference_name: str = "the fp32 model",
    text: str = "the text",
) -> Agreement:
    """``converted`` against ``reference`` on ``ids`` in windows of ``window`` (the last window shorter when
    the ids end first), each from an empty cache. Each: an ``ExportedProgram`` of the recipe, a runner with its
    call convention (``reset()`` is called before each window when it has one), or (``reference``) the
    transformers model itself, run with no cache."""
    started = time.perf_counter()
    conv = _convention(converted)
    if window < 1 or window > conv.chunk:
        raise PrecastError(
            f"a measurement window of {window} tokens: the program takes 1..{conv.chunk} tokens per call"
        )
    if len(ids) < 2:
        raise PrecastError(f"{text}: {len(ids)} token(s); measuring needs at least 2 (a token and its next)")
    check_tokens(conv, list(ids), "the text's ids", who="")
    run_ref, run_new = _runner(reference, conv), _runner(converted, conv)
    sums = {"kld": 0.0, "top1": 0.0, "nll": 0.0, "ref_nll": 0.0}
    count = windows = 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(list(ids[start : start + window + 1]), dtype=torch.long)
            # both windows' logits live only for this call (one window's pair at a time)
            count += _accumulate(sums, run_new(chunk[:-1]), run_ref(chunk[:-1]), chunk[1:])
            windows += 1
    top1 = sums["top1"] / count
    return Agreement(
        reference=reference_name,
        text=text,
        positions=count,
        windows=windows,
        window=window,
        kld=sums["kld"] / count,
        top1=top1,
        top1_se=math.sqrt(top1 * (1 - top1) / count),
        ppl=math.exp(sums["nll"] / count),
        reference_ppl=math.exp(sums["ref_nll"] / count),
        seconds=round(time.perf_counter() - started, 2),
        threads=torch.get_num_threads(),
    )


def _accumulate(sums: dict[str, float], got: torch.Tensor, want: torch.Tensor, labels: torch.Tensor) -> int:
    """One window's sums over its positions (``next_token_metrics`` per chunk, weighted by its positions)."""
    if got.shape != want.shape:
        raise PrecastError(
            f"the converted model returned logits {tuple(got.shape)}, the reference {tuple(want.shape)}"
        )
    for lo in range(0, labels.numel(), CHUNK):
        m = next_token_metrics(got[lo : lo + CHUNK], want[lo : lo + CHUNK], labels[lo : lo + CHUNK])
        n = m["positions"]
        sums["kld"] += m["kld"] * n
        sums["top1"] += m["top1"] * n
        sums["nll"] += math.log(m["ppl"]) * n
        sums["ref_nll"] += math.log(m["reference_ppl"]) * n
    return labels.numel()


def _convention(model: Any) -> Convention:
    """The recipe's convention of an ``ExportedProgram`` or a runner's ``signature``; one line when neither."""
    if isinstance(model, ExportedProgram):
        return convention(ProgramSignature.from_program(model))
    signature = getattr(model, "signature", None)
    if not isinstance(signature, ProgramSignature):
        raise PrecastError(
            f"measuring on text: {type(model).__name__} has no signature; pass an ExportedProgram of the recipe "
            "or a precast.compile model"
        )
    return convention(signature)


def _runner(model: Any, conv: Convention) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` as ids (n,) -> logits (n, vocab) float32, from position 0 of an empty cache."""
    if _is_transformers(model):
        return lambda ids: _logits(model(input_ids=ids[None], use_cache=False), ids.numel())
    if isinstance(model, ExportedProgram):
        from precast.llm.generate import ProgramModel

        model = ProgramModel(model)
    reset = getattr(model, "reset", None)

    def run(ids: torch.Tensor) -> torch.Tensor:
        if callable(reset):
            reset()
        return _logits(conv.run(model, ids[None].to(conv.ids_dtype), 0), ids.numel())

    return run


def _is_transformers(model: Any) -> bool:
    """A transformers causal LM (the checkpoint's own model): run eagerly with no cache, each window from
    position 0, which is the fp32 model itself and ~2x cheaper than its static-cache export on CPU."""
    library = sys.modules.get("transformers")
    return library is not None and isinstance(model, library.PreTrainedModel)


def _logits(out: Any, n: int) -> torch.Tensor:
    """(n, vocab) float32 logits from a tensor / ``.logits`` / the first of a tuple of shape (1, n, vocab)."""
    if hasattr(out, "logits"):
        out = out.logits
    if isinstance(out, (list, tuple)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != (1, n):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PrecastError(
            f"measuring on text: the model returned {shape} for {n} tokens; expected logits (1, {n}, vocab), "
            "as transformers' recipe returns them"
        )
    return out[0].float()
