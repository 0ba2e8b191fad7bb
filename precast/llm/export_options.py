"""What ``precast.llm.export`` is asked, as one record, and every value of it checked before a checkpoint is read.

``ExportOptions`` holds the options of an LLM folder's export (the checkpoint, the folder, the cache, the dtypes, the
weights' formats as ``convert``'s ``weight_format=`` takes them, a plan, the calibration text a budget is measured
on, the held-out tokens the result is measured on, the engines written). ``check()`` refuses a bad value or mix in
one line and returns what the export runs with (``Checked``). A refusal names each option as ``words`` says:
``max_cache_len=4`` for a Python caller, ``--max-cache-len 4`` for ``precast export-llm`` (which passes its flags).

Input: the options. Output: ``Checked`` (the conversion's options record, the budget, the engines), or a one-line
``PrecastError``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from precast.errors import PrecastError
from precast.llm.folder import HELD
from precast.paths import check_input_file

BACKENDS = HELD  # the engines (precast.backends.registry) an LLM folder holds: folder_engines
DEFAULT_CACHE = 1024  # positions, or the model's max_position_embeddings when smaller
DEFAULT_WINDOW = 256  # tokens per calibration window, or the cache's room when smaller
DEFAULT_TOKENS = 1024  # the calibration text's first tokens a budget measures on
DEFAULT_EVAL = 512  # held-out tokens the result is measured on: precast.llm.accuracy.DEFAULT_TOKENS (a test)
_NOT_GIVEN = object()
BUDGET_SAID = "a weight budget measured on text (weight_format=precast.WeightBudget(...) without data=)"


@dataclass(frozen=True)
class ExportOptions:
    """An LLM folder's export, asked (``precast.llm.export``'s keywords; docs/llm_export.md "From Python").

    ``weight_format``: what ``precast.convert`` takes ("int8", "int4-g32", a ``{pattern: format}`` mapping, ...), or a
    ``precast.WeightBudget`` without ``data=``: measured on ``calibration_text``'s first ``calibration_tokens``
    tokens in windows of ``calibration_window`` (with ``data=``: measured on those batches, as convert does).
    ``plan``: the weight formats of a plan.json written before. ``eval_tokens``: the result measured against the
    fp32 model on that many held-out tokens (0: not measured). ``backend``: "openvino" and/or "aoti", written into
    the folder (compiled at ``threads``). ``words``: how a refusal names each option (default: ``name=``)."""

    source: str | os.PathLike
    out_dir: str | os.PathLike
    gguf: str | None = None
    max_cache_len: int | None = None
    dtype: Any = "bf16"
    cache_dtype: Any = None
    weight_format: Any = None
    plan: str | os.PathLike | None = None
    calibration_text: str | os.PathLike | None = None
    calibration_window: int | None = None
    calibration_tokens: int = DEFAULT_TOKENS
    eval_tokens: int = DEFAULT_EVAL
    backend: str | tuple[str, ...] = ()
    threads: int | None = None
    allow: tuple[str, ...] = ()
    words: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def said(self, name: str, value: Any = _NOT_GIVEN) -> str:
        """An option as a refusal names it: ``max_cache_len=4`` / ``--max-cache-len 4`` (``words``)."""
        flag = self.words.get(name)
        if value is _NOT_GIVEN:
            return flag or f"{name}="
        return f"{flag} {value}" if flag else f"{name}={value!r}"

    def check(self) -> Checked:
        """Every value and mix checked (files named exist; nothing read but a plan's header); one line each."""
        for name in ("source", "out_dir", "gguf", "plan", "calibration_text"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise PrecastError(f"{self.said(name, value)}: give a path (a str or a pathlib.Path)")
        backends = _backends(self)
        _check_counts(self)
        budget = _budget(self)
        if self.plan is not None:
            _check_plan(self)
        if self.calibration_text is not None:
            check_input_file(self.calibration_text, "give a plain text file", self.said("calibration_text"))
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise PrecastError(f"{self.said('threads', self.threads)}: give a thread count >= 1, or None")
        fitted = budget is None and self.calibration_text is not None  # (checked: the formats name int4)
        return Checked(_convert_options(self, budget, fitted), budget, backends, fitted)


@dataclass(frozen=True)
class Checked:
    """What ``ExportOptions.check`` returns: the conversion's options record (policy torch; its ``weight_format``
    None while a budget still waits for the calibration text's windows), that budget, the engines in order."""

    convert: Any
    budget: Any
    backends: tuple[str, ...]

    fitted_on_text: bool = False  # int4 formats (no budget) fitted on the calibration text's windows

    @property
    def measured_on_text(self) -> bool:
        """The budget is measured on the calibration text (its windows made once the tokenizer is read)."""
        return self.budget is not None and self.budget.data is None


def _backends(o: ExportOptions) -> tuple[str, ...]:
    """``backend``: a name or names among ``BACKENDS``, in order, each once."""
    given = (o.backend,) if isinstance(o.backend, str) else o.backend
    if not isinstance(given, (tuple, list)) or not all(isinstance(b, str) for b in given):
        raise PrecastError(f"{o.said('backend', o.backend)}: give 'openvino', 'aoti', or both as a tuple")
    from precast.backends.registry import NAMES

    for name in given:
        if name not in BACKENDS:
            other = f"precast.compile's engine {name!r} runs no LLM folder; " if name in NAMES else ""
            raise PrecastError(
                f"{o.said('backend', name)}: {other}an LLM folder holds {' or '.join(BACKENDS)} (or neither: the "
                "program alone, run eagerly)"
            )
    return tuple(dict.fromkeys(given))


def _check_counts(o: ExportOptions) -> None:
    """The counts: whole numbers; eval_tokens >= 0, the calibration's >= 1, the cache at least ``MIN_CACHE``."""
    from precast.llm.checkpoint import MIN_CACHE

    for name, least in (
        ("eval_tokens", 0),
        ("calibration_window", 1),
        ("calibration_tokens", 1),
        ("max_cache_len", MIN_CACHE),
    ):
        value = getattr(o, name)
        if value is None and name in ("calibration_window", "max_cache_len"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            what = f"at least {MIN_CACHE} positions" if name == "max_cache_len" else f"a number >= {least}"
            raise PrecastError(f"{o.said(name, value)}: give {what}" + (" (0: not measured)" * (least == 0)))


def int4_rules(o: ExportOptions) -> bool:
    """Whether the formats given (or the plan's) name int4: those the calibration text fits (data-aware int4)."""
    from precast.policy.plan import load_plan
    from precast.quant.rules import WeightRules, weight_rules

    if o.plan is not None:
        rules = WeightRules.exact(load_plan(str(o.plan)).weights, "the plan")
    else:
        rules = weight_rules(o.weight_format)
    return rules is not None and bool(rules.int4)


def _budget(o: ExportOptions) -> Any:
    """The weight budget asked for (``precast.WeightBudget``) or None; the calibration text given with it (and only
    with it) when it measures on text; its other fields checked now, before the read."""
    from precast.quant.budget import WeightBudget

    budget = o.weight_format if isinstance(o.weight_format, WeightBudget) else None
    on_text = budget is not None and budget.data is None
    if budget is not None and on_text and o.calibration_text is None:
        given = next((n for n in ("kld", "mse", "bytes", "bits") if getattr(budget, n) is not None), "")
        # a command line has no data=
        data = "" if "calibration_text" in o.words else ", or the budget's data="
        raise PrecastError(
            f"{o.words.get(given) or o.words.get('a budget', 'a weight budget (weight_format=)')} measures each "
            f"weight's cost on text: give {o.said('calibration_text')} (a plain text file){data}"
        )
    if not on_text:
        given = [
            n
            for n, v in (
                ("calibration_text", o.calibration_text),
                ("calibration_window", o.calibration_window),
            )
            if v is not None
        ]
        given += ["calibration_tokens"] if o.calibration_tokens != DEFAULT_TOKENS else []
        if given and not (o.calibration_text is not None and int4_rules(o)):
            budget_said = o.words.get("a budget", BUDGET_SAID)
            raise PrecastError(
                f"{o.said(given[0])} applies to {budget_said}, or to int4 formats (fitted on the text); drop it "
                "or give one"
            )
    if on_text:  # its own fields (one budget, > 0, formats, probes), with a stand-in for the windows to come
        dataclasses.replace(budget, data=[()]).check(_budget_said(o))
    return budget


def _budget_said(o: ExportOptions) -> Any:
    """How a refusal of the budget's own fields names one: in ``o.words`` (``--bits 4.5``, ``--budget-formats int2``)
    where they name it, else as ``WeightBudget`` does (``WeightBudget: bits=4.5``)."""

    def said(name: str, value: Any) -> str:
        if name not in o.words:
            return f"WeightBudget: {name}={value!r}"
        return o.said(name, f"{value:g}" if isinstance(value, float) else value)

    return said


def _check_plan(o: ExportOptions) -> None:
    """``plan``: a plan file that carries weight formats, not given with ``weight_format``."""
    from precast.policy.plan import load_plan

    if o.weight_format is not None:
        raise PrecastError(
            f"{o.said('plan')} and {o.said('weight_format')}: the weights' formats come from one of them; give one"
        )
    if not load_plan(o.plan).weights:
        raise PrecastError(
            f"{o.said('plan', o.plan)}: carries no weight formats (write one with export-llm or convert)"
        )


def _convert_options(o: ExportOptions, budget: Any, fitted: bool) -> Any:
    """The conversion's options record (policy torch, the KV cache in ``cache_dtype`` or ``dtype``), checked; a
    budget measured on text, or the windows int4 is fitted on (``fitted``), set in once the windows are made."""
    from precast.pipeline.options import ConvertOptions

    options = ConvertOptions(
        policy="torch",
        dtype=o.dtype,
        cache_dtype=o.cache_dtype if o.cache_dtype is not None else o.dtype,
        allow=(o.allow,) if isinstance(o.allow, str) else tuple(o.allow),
        plan=None if o.plan is None else str(o.plan),
        weight_format=None if budget is not None and budget.data is None else o.weight_format,
    )
    dataclasses.replace(options, weight_data=[()] if fitted else None).check()  # the windows to come
    return options
