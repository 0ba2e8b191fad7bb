"""``precast.llm.export``: a transformers checkpoint to the folder ``precast.load`` runs, in one call.

The flow of ``optimum-cli export openvino --weight-format int8`` / ``llama-quantize``: a checkpoint (a
``save_pretrained`` folder, or a GGUF file) read in fp32, exported with transformers' static-cache recipe
(``precast.llm.checkpoint``), converted (policy torch, bf16, the KV cache in bf16, the weights in the format asked
for, or chosen by measurement on calibration text under a budget, or as a plan says), measured against the fp32
weights on held-out text before they are freed (``precast.llm.accuracy``: KLD, top-1 agreement, perplexity), and
written as one folder, whole or not at all (``precast.llm.folder_write``): program.pt2, tokenizer.json, plan.json,
report.json, export.json, and the engines asked for (``precast.llm.folder_engines``). ``precast export-llm`` is this
call with its flags parsed and the result printed.

Input: ``ExportOptions`` (``export``'s keywords). Output: an ``ExportedFolder`` (its path, files, manifest, report;
``.load()``), or a one-line ``PrecastError`` before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import precast.llm.folder_write as write
from precast.errors import PrecastError
from precast.llm.export_options import (
    DEFAULT_CACHE,
    DEFAULT_EVAL,
    DEFAULT_TOKENS,
    DEFAULT_WINDOW,
    Checked,
    ExportOptions,
)
from precast.memory import give_back
from precast.progress import ProgressBar


@dataclass
class ExportedFolder:
    """The folder an export wrote: its path, the files it holds (by role), export.json's record, the conversion's
    report, the seconds per step, and why no tokenizer was written (if so). ``load()`` opens it (``precast.load``)."""

    path: Path
    files: dict[str, str]
    manifest: dict[str, Any]
    report: Any
    seconds: dict[str, float]
    tokenizer_note: str = ""

    def summary(self) -> str:
        """The conversion's summary (``precast.Report.summary``)."""
        return self.report.summary()

    def load(self, **options: Any) -> Any:
        """``precast.load(self.path, **options)``: an ``LLM`` ready to generate."""
        from precast.llm.loaded import load

        return load(self.path, **options)


def export(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    gguf: str | None = None,
    weight_format: Any = None,
    plan: str | os.PathLike | None = None,
    dtype: Any = "bf16",
    cache_dtype: Any = None,
    max_cache_len: int | None = None,
    calibration_text: str | os.PathLike | None = None,
    calibration_window: int | None = None,
    calibration_tokens: int = DEFAULT_TOKENS,
    eval_tokens: int = DEFAULT_EVAL,
    backend: str | tuple[str, ...] = (),
    threads: int | None = None,
    allow: str | tuple[str, ...] = (),
    progress: bool | None = None,
) -> ExportedFolder:
    """Export the checkpoint ``source`` into the new (or empty) folder ``out_dir``; the options are
    ``ExportOptions``' (``precast.llm.export_options``). ``progress``: a progress bar on stderr (default: when
    stderr is a terminal and ``PRECAST_VERBOSE`` allows)."""
    options = ExportOptions(
        source,
        out_dir,
        gguf=gguf,
        max_cache_len=max_cache_len,
        dtype=dtype,
        cache_dtype=cache_dtype,
        weight_format=weight_format,
        plan=plan,
        calibration_text=calibration_text,
        calibration_window=calibration_window,
        calibration_tokens=calibration_tokens,
        eval_tokens=eval_tokens,
        backend=backend,
        threads=threads,
        allow=(allow,) if isinstance(allow, str) else tuple(allow),
    )
    return export_with(options, progress=progress)


@dataclass
class _Export:
    """One run's state: what was checked before the read, then what the read and the conversion found."""

    options: ExportOptions
    checked: Checked
    source: Any  # the checkpoint located (precast.llm.checkpoint.locate)
    out: Path  # the output folder, checked
    text: str | None  # the calibration text
    model: Any = None  # the checkpoint read; its fp32 weights dropped once converted
    about: dict = field(default_factory=dict)
    cache: int = 0  # positions of the static KV cache
    calibration: dict | None = None  # the calibration's record for export.json
    fit_data: list | None = None  # the calibration windows int4 weights are fitted on (no budget)
    accuracy: dict | None = None  # the result against the fp32 model on held-out text (precast.llm.accuracy)


class _Steps:
    """The run's steps on the progress bar, each timed into ``seconds``."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str, describe: str) -> Iterator[None]:
        """One step: described on the bar, timed into ``seconds``; the bar advanced after."""
        self.bar.describe(describe)
        started = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - started, 2)
        self.bar.advance()


def export_with(options: ExportOptions, *, progress: bool | None = None) -> ExportedFolder:
    """Everything checked, the checkpoint read, exported and converted, the folder written whole; the folder
    returned. The transformers' and torch's own warnings are held back unless ``precast --verbose`` /
    ``PRECAST_VERBOSE=1`` asks for them."""
    job = _check_before_read(options)
    steps = ["read", "export", "convert", *(["measure"] if options.eval_tokens else [])]
    steps += [*job.checked.backends, "save"]
    with ProgressBar(f"reading {job.source.name}", len(steps), enabled=progress) as bar:
        timer = _Steps(bar)
        res = _read_and_convert(job, timer)
        files, manifest = _write_folder(job, timer, res)
    return ExportedFolder(job.out, files, manifest, res.report, timer.seconds, job.model.tokenizer_note)


def outputs(backends: tuple[str, ...]) -> list[str]:
    """The files an export with these engines writes into its folder (checked not to be inputs, before)."""
    from precast.llm.folder_weights import REST

    names = [write.PROGRAM, write.TOKENIZER, write.PLAN, write.REPORT, write.MANIFEST]
    if "openvino" in backends:
        names += [write.OPENVINO, Path(write.OPENVINO).with_suffix(".bin").name]
    if "aoti" in backends:
        names.append(write.AOTI)
    return names + ([REST] if backends else [])


def _check_before_read(o: ExportOptions) -> _Export:
    """The options, the output folder, the packages the engines need, the checkpoint's files and the calibration
    text: all checked before a read of minutes."""
    import precast.llm.checkpoint as ckpt

    checked = o.check()
    given = [o.calibration_text, o.plan, o.source, o.gguf]
    names = outputs(checked.backends)
    write.check_output_dir(o.out_dir, given, names, o.said("out_dir"))
    if "openvino" in checked.backends:
        from precast.backends.openvino.convert import require_openvino

        try:  # a missing package is one line naming the extra, before the model loads
            require_openvino()
        except PrecastError as exc:
            raise PrecastError(f"{o.said('backend', 'openvino')}: {exc}") from None
    ckpt.require_transformers()
    source = ckpt.locate(str(o.source), o.gguf, o.said("gguf"))
    out = write.check_output_dir(o.out_dir, [*given, *source.files], names, o.said("out_dir"))
    if source.config is not None and o.max_cache_len is not None:
        ckpt.check_cache_len(o.max_cache_len, source.config, o.said("max_cache_len", o.max_cache_len))
    text = None
    if o.calibration_text is not None:
        text = ckpt.read_text(str(o.calibration_text), o.said("calibration_text"))
    if text is not None and not ckpt.has_tokenizer(source):  # before a read of minutes
        raise PrecastError(
            f"{o.said('calibration_text')} is tokenized with the model's tokenizer; {source.name} has none"
        )
    return _Export(o, checked, source, out, text)


def _read_and_convert(job: _Export, timer: _Steps) -> Any:
    """The checkpoint read in fp32, exported with a static cache, converted; its fp32 weights freed after."""
    import precast.llm.checkpoint as ckpt
    from precast.api import convert_with

    o = job.options
    with timer.step("read", f"reading {job.source.name} in fp32"):
        job.model = ckpt.read(job.source)
    job.about = job.model.about()
    job.cache = o.max_cache_len or min(DEFAULT_CACHE, ckpt.max_positions(job.model.model) or DEFAULT_CACHE)
    ckpt.check_cache_len(job.cache, job.model.model, o.said("max_cache_len", job.cache))
    weight_format = _weight_choice(job)
    if job.checked.budget is not None:  # each of the budget's backward passes on the bar, with the time left
        progress = timer.bar.counter("measuring the weights", "backward passes")
        fitting = timer.bar.counter("fitting the int4 weights on the calibration text", "weights")
        weight_format = dataclasses.replace(weight_format, progress=progress, rounding_progress=fitting)
    with timer.step("export", f"exporting (static cache of {job.cache} positions)"):
        if (
            job.checked.budget is not None
            and job.calibration
            and (window := max(job.calibration["window"], ckpt.EXAMPLE_LENGTH) + 1) < job.cache
        ):
            # the budget measured on one window's cache: no backward pass through the unused positions (the
            # --bits 4.6 peak on SmolLM2-135M: docs/llm_export.md), the same weights (WeightBudget's program=)
            weight_format = dataclasses.replace(
                weight_format, program=ckpt.export_decoder(job.model.model, window)
            )
        ep = ckpt.export_decoder(job.model.model, job.cache)
        give_back()  # glibc keeps freed heap resident (precast.memory)
    what = (
        "measuring the weights and converting"
        if job.checked.budget is not None
        else "fitting the int4 weights on the calibration text and converting"
        if job.fit_data is not None
        else "converting"
    )
    with timer.step("convert", what):
        options = dataclasses.replace(
            job.checked.convert, weight_format=weight_format, weight_data=job.fit_data
        )
        res = convert_with(ep, None, options)
    if o.eval_tokens:
        with timer.step("measure", f"measuring against fp32 on {o.eval_tokens} tokens of held-out text"):
            job.accuracy = _accuracy(job, res)
    del ep, weight_format  # the programs over the fp32 weights (the budget's too)
    job.model.model = None  # the fp32 weights, freed before the compiles
    # and given back: else the heap kept them and the save's serialization peaked above the budget's measuring
    # (--bits 4.6 on SmolLM2-135M: 2557 MiB while saving against 2400 measuring; docs/llm_export.md)
    give_back()  # glibc keeps freed heap resident (precast.memory)
    return res


def _write_folder(job: _Export, timer: _Steps, res: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """The folder written whole or not at all: the engines' artifacts, the weights (once: indexed in the IR's .bin,
    the rest in weights.safetensors) and the converted program without them (with them when no engine was asked
    for), its files, export.json; returns (the files written, export.json's record)."""
    import precast.llm.folder_engines as engines
    from precast.llm.folder_weights import weightless
    from precast.runtime.threads import resolve_threads

    o, backends = job.options, job.checked.backends
    threads = resolve_threads(o.threads, o.said("threads")) if backends else None
    records: dict[str, Any] = {}
    with write.staged(job.out, o.said("out_dir")) as stage:
        files: dict[str, str] = {}
        writers = {"openvino": engines.write_openvino, "aoti": engines.write_aoti}
        for name in backends:  # each engine's form, compiled into the folder
            what, files[name] = _ENGINE_FILES[name]
            with timer.step(name, what):
                records[name] = writers[name](stage, res.program, threads)
        # each weight once: in the IR's .bin (indexed) or weights.safetensors, the program without them
        if backends:
            records["weight_index"], rest = engines.write_weights(stage, res.program, "openvino" in backends)
            files.update({"weights": rest} if rest else {})
        with timer.step("save", f"saving into {job.out}"):
            program = weightless(res.program) if "weight_index" in records else res.program
            write.write_program(stage, program, str(job.out))
            files = {**write.write_converted(stage, res, job.model, str(o.source)), **files}
        manifest = write.write_manifest(stage, {**_record(job, files, timer.seconds), **records})
    return files, manifest


# each engine a folder holds: its step's description, and its file (or folder) in the folder
_ENGINE_FILES = {
    "openvino": ("compiling for OpenVINO", write.OPENVINO),
    "aoti": ("compiling with AOTInductor", write.AOTI),
}


def _weight_choice(job: _Export) -> Any:
    """convert's ``weight_format=``: as asked, or a budget measured on the calibration text's windows (tokenized
    with the model's own tokenizer); the calibration's record kept for export.json."""
    from precast.llm.checkpoint import calibration_windows

    o, budget = job.options, job.checked.budget
    if not job.checked.measured_on_text and not job.checked.fitted_on_text:
        return budget if budget is not None else job.checked.convert.weight_format
    if job.model.tokenizer is None:
        raise PrecastError(
            f"{o.words.get('a budget', 'a weight budget')} measures on text, which needs the model's tokenizer; "
            f"{job.model.source.name} has none ({job.model.tokenizer_note})"
        )
    window = o.calibration_window or min(DEFAULT_WINDOW, job.cache - 1)
    if window > job.cache - 1:
        raise PrecastError(
            f"{o.said('calibration_window', window)}: a window is one call, at most the cache's room "
            f"({job.cache - 1}; {o.said('max_cache_len')})"
        )
    tokens = max(o.calibration_tokens, window)
    where = o.said("calibration_text")
    data = calibration_windows(
        job.model.tokenizer, job.text or "", window, tokens, where, o.said("calibration_window")
    )
    job.calibration = {"file": str(o.calibration_text), "window": window, "windows": len(data)}
    if job.checked.fitted_on_text:  # int4 fitted on the windows (WeightOptions(data=))
        job.fit_data = data
        return job.checked.convert.weight_format
    return dataclasses.replace(budget, data=data)


def _accuracy(job: _Export, res: Any) -> dict | None:
    """The converted program against the fp32 model (the checkpoint as read) on held-out text
    (``precast.llm.accuracy``), into the report (report.json, the summary); None without a tokenizer to read text
    with."""
    from precast.llm.accuracy import on_held_out_text
    from precast.runtime.threads import resolve_threads, running_at

    o = job.options
    if job.model.tokenizer is None:
        return None
    used = job.calibration["windows"] * job.calibration["window"] if job.calibration else 0
    # at threads' count (default: the cores other processes leave free): 2 threads on 2 busy cores ran 3-4x
    # slower than 1
    with running_at(resolve_threads(o.threads, o.said("threads"))):
        agreement = on_held_out_text(
            job.model.model,
            res.program,
            job.model.tokenizer,
            tokens=o.eval_tokens,
            text=job.text,
            used=used,
            name=o.said("calibration_text"),
        )
    res.report.accuracy = agreement.record()
    return res.report.accuracy


def _record(job: _Export, files: dict, seconds: dict) -> dict:
    """export.json's record: what was asked and read, the files written, the seconds per step, the accuracy."""
    import torch
    import transformers

    from precast.version import __version__

    o = job.options
    return {
        "source": {"model": str(o.source), "gguf": str(job.source.gguf) if job.source.gguf else None},
        "architecture": job.about["architecture"],
        "parameters": job.about["parameters"],
        "max_cache_len": job.cache,
        "dtype": _dtype(o.dtype),
        "cache_dtype": _dtype(o.cache_dtype if o.cache_dtype is not None else o.dtype),
        "weights": _weights_record(job),
        "accuracy": job.accuracy,
        "stop_tokens": job.about["stop_tokens"],
        "files": files,
        "seconds": seconds,
        "versions": {
            "precast": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def _dtype(dtype: Any) -> str:
    """A dtype as export.json names it: ``bf16``, ``fp16``, ... (the name given, or torch's dtype's short name)."""
    from precast.dtypes import dtype_name, parse_low_dtype

    return dtype if isinstance(dtype, str) else str(dtype_name(parse_low_dtype(dtype)))


def _weights_record(job: _Export) -> dict[str, Any]:
    """How the weights' formats were chosen: a budget (its limit, the calibration's record), a plan, or the formats
    given, as ``--weight-format`` spells them (``"int8"``, ``"lm_head.weight=int8"``; a typed format as it prints)."""
    o, budget = job.options, job.checked.budget
    if budget is not None:
        limit = {
            k: getattr(budget, k) for k in ("kld", "mse", "bytes", "bits") if getattr(budget, k) is not None
        }
        return {"budget": limit, "calibration": job.calibration}
    fit = {"calibration": job.calibration, "rounding": "int4 fitted on the text"} if job.fit_data else {}
    if o.plan is not None:
        return {"plan": str(o.plan), **fit}
    given = o.weight_format
    if given is None:
        return {"format": None}
    if isinstance(given, Mapping):
        return {"format": [str(v) if k == "*" else f"{k}={v}" for k, v in given.items()], **fit}
    return {"format": [str(given)], **fit}
