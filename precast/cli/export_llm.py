"""precast export-llm MODEL -o DIR [--gguf FILE] [--max-cache-len N] [--dtype bf16|fp16] [--cache-dtype DTYPE]
                     [--weight-format FORMAT... | --bits B | --kld K | --plan PLAN.json]
                     [--calibration-text FILE [--calibration-window W] [--calibration-tokens T]
                      [--budget-formats FORMAT...] [--probes N]] [--eval-tokens N] [--backend openvino aoti]
                     [--allow CODE]

The flow of ``optimum-cli export openvino --weight-format int8`` / ``llama-quantize`` in one command: a transformers
checkpoint (a ``save_pretrained`` folder, or a GGUF file) read in fp32, exported with transformers' static-cache
recipe (``precast.llm.checkpoint``), converted (policy torch, bf16, the KV cache in bf16, the weights in the format
asked for, or chosen by measurement on calibration text under a budget, or as a plan says), and written as one
folder: program.pt2, tokenizer.json, plan.json, report.json, export.json, and OpenVINO IR / an AOTInductor package
on request (``precast.cli.artifact``: written whole or not at all). Before the fp32 weights are freed, the result
is measured against them on ``--eval-tokens`` of held-out text (``precast.llm.accuracy``): KLD, top-1 agreement,
perplexity, in the summary, report.json and export.json.

Input: a checkpoint, options. Output: the artifact folder; the report's summary on stdout, one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precast.cli import artifact
from precast.cli.export_llm_flags import (  # noqa: F401 - BACKENDS, DEFAULT_TOKENS: importable from here too
    ARGUMENTS,
    BACKENDS,
    DEFAULT_CACHE,
    DEFAULT_TOKENS,
    DEFAULT_WINDOW,
    budget_of,
    check_flags,
)
from precast.cli.flags import add_command
from precast.errors import PrecastError
from precast.progress import ProgressBar


def add_parser(sub: Any) -> None:
    """``precast export-llm``: the flags of ``ARGUMENTS`` (``precast.cli.export_llm_flags``), run by ``run``."""
    add_command(
        sub,
        "export-llm",
        ARGUMENTS,
        run=run,
        help="a transformers checkpoint (folder or GGUF) to a deployable folder: exported, converted, int8/int4",
        description="Read a transformers checkpoint (a folder save_pretrained wrote, or a GGUF file) in fp32, "
        "export it with transformers' static-cache recipe, convert it (policy torch, --dtype, the KV cache in "
        "--cache-dtype, the linear/embedding weights in --weight-format or chosen under a --bits/--kld budget "
        "measured on --calibration-text, or as --plan says) and write one folder: program.pt2, tokenizer.json, "
        "plan.json, report.json, export.json (and model.xml/.bin, model.aoti.pt2 with --backend). "
        "Then: precast generate DIR --prompt TEXT --max-new-tokens N. docs/llm_export.md",
    )


def outputs(args: argparse.Namespace) -> list[str]:
    from precast.llm.folder_weights import REST

    names = [artifact.PROGRAM, artifact.TOKENIZER, artifact.PLAN, artifact.REPORT, artifact.MANIFEST]
    if "openvino" in args.backend:
        names += [artifact.OPENVINO, Path(artifact.OPENVINO).with_suffix(".bin").name]
    if "aoti" in args.backend:
        names.append(artifact.AOTI)
    return names + ([REST] if args.backend else [])


def run(args: argparse.Namespace) -> int:
    from precast.llm.checkpoint import SHOW_LIBRARIES

    token = SHOW_LIBRARIES.set(bool(getattr(args, "verbose", False)))
    try:
        return _run(args)
    finally:
        SHOW_LIBRARIES.reset(token)


@dataclass
class _Export:
    """One run's state: what was checked before the read, then what the read and the conversion found."""

    options: Any  # the conversion's options record (check_flags)
    source: Any  # the checkpoint located (precast.llm.checkpoint.locate)
    out: Path  # the output folder, checked
    text: str | None  # --calibration-text's text
    model: Any = None  # the checkpoint read; its fp32 weights dropped once converted
    about: dict = field(default_factory=dict)
    cache: int = 0  # positions of the static KV cache
    calibration: dict | None = None  # the calibration's record for export.json
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


def _run(args: argparse.Namespace) -> int:
    """Everything checked, the checkpoint read, exported and converted, the folder written; the summary
    printed."""
    job = _check_before_read(args)
    steps = ["read", "export", "convert", *(["measure"] if args.eval_tokens else []), *args.backend, "save"]
    with ProgressBar(f"reading {job.source.name}", len(steps)) as bar:
        timer = _Steps(bar)
        res = _read_and_convert(args, job, timer)
        files = _write_folder(args, job, timer, res)
    _print(res, job.out, files, timer.seconds, job.model.tokenizer_note)
    return 0


def _check_before_read(args: argparse.Namespace) -> _Export:
    """The flags, the output folder, the packages the backends need, the checkpoint's files and the calibration
    text: all checked before a read of minutes."""
    from precast.llm import checkpoint as ckpt

    options = check_flags(args)
    args.backend = tuple(dict.fromkeys(args.backend))
    given = [args.calibration_text, args.plan, args.model, args.gguf]
    artifact.check_output_dir(args.output, given, outputs(args))
    if "openvino" in args.backend:
        from precast.backends.openvino.convert import require_openvino

        try:  # a missing package is one line naming the extra, before the model loads
            require_openvino()
        except PrecastError as exc:
            raise PrecastError(f"--backend openvino: {exc}") from None
    ckpt.require_transformers()
    source = ckpt.locate(args.model, args.gguf)
    out = artifact.check_output_dir(args.output, [*given, *source.files], outputs(args))
    if source.config is not None and args.max_cache_len is not None:
        ckpt.check_cache_len(args.max_cache_len, source.config)
    text = ckpt.read_text(args.calibration_text) if args.calibration_text else None
    if text is not None and not ckpt.has_tokenizer(source):  # before a read of minutes
        raise PrecastError(
            f"--calibration-text is tokenized with the model's tokenizer; {source.name} has none"
        )
    return _Export(options, source, out, text)


def _read_and_convert(args: argparse.Namespace, job: _Export, timer: _Steps) -> Any:
    """The checkpoint read in fp32, exported with a static cache, converted; its fp32 weights freed after."""
    import dataclasses

    from precast.api import convert_with
    from precast.llm import checkpoint as ckpt

    with timer.step("read", f"reading {job.source.name} in fp32"):
        job.model = ckpt.read(job.source)
    job.about = job.model.about()
    job.cache = args.max_cache_len or min(DEFAULT_CACHE, ckpt.max_positions(job.model.model) or DEFAULT_CACHE)
    ckpt.check_cache_len(job.cache, job.model.model)
    weight_format, job.calibration = _weight_choice(args, job.options, job.model, job.text, job.cache)
    if job.calibration:  # each of the budget's backward passes on the bar, with the time left
        progress = timer.bar.counter("measuring the weights", "backward passes")
        weight_format = dataclasses.replace(weight_format, progress=progress)
    with timer.step("export", f"exporting (static cache of {job.cache} positions)"):
        ep = ckpt.export_decoder(job.model.model, job.cache)
        _give_back_freed_memory()
    what = "measuring the weights and converting" if job.calibration else "converting"
    with timer.step("convert", what):
        res = convert_with(ep, None, dataclasses.replace(job.options, weight_format=weight_format))
    if args.eval_tokens:
        with timer.step("measure", f"measuring against fp32 on {args.eval_tokens} tokens of held-out text"):
            job.accuracy = _accuracy(args, job, res)
    del ep
    job.model.model = None  # the fp32 weights, freed before the compiles
    return res


def _give_back_freed_memory() -> None:
    """The heap the export freed, given back to the system (glibc's ``malloc_trim``; elsewhere nothing): glibc keeps
    freed blocks below its mmap threshold, ~0.9 GB after exporting SmolLM2-135M (RSS 1991 -> 1090 MiB), which
    stayed in the peak of every later step (the weight budget's measuring, the conversion)."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux" or not (name := ctypes.util.find_library("c")):
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        import gc

        gc.collect()
        trim(0)


def _write_folder(args: argparse.Namespace, job: _Export, timer: _Steps, res: Any) -> dict:
    """The folder written whole or not at all: the engines' artifacts, the weights (once: indexed in the IR's .bin,
    the rest in weights.bin) and the converted program without them (with them when no engine was asked for), its
    files, export.json; returns the files written."""
    from precast.llm import folder_engines as engines
    from precast.llm.folder_weights import weightless
    from precast.runtime.threads import resolve_threads

    threads = resolve_threads(args.threads, "--threads") if args.backend else None
    records: dict[str, Any] = {}
    with artifact.staged(job.out) as stage:
        files = {}
        if "openvino" in args.backend:
            with timer.step("openvino", "compiling for OpenVINO"):
                records["openvino"] = engines.write_openvino(stage, res.program, threads)
            files["openvino"] = artifact.OPENVINO
        if "aoti" in args.backend:
            with timer.step("aoti", "compiling with AOTInductor"):
                records["aoti"] = engines.write_aoti(stage, res.program, threads)
            files["aoti"] = artifact.AOTI
        if (
            args.backend
        ):  # each weight once: in the IR's .bin (indexed) or weights.bin, the program without them
            records["weight_index"], rest = engines.write_weights(
                stage, res.program, "openvino" in args.backend
            )
            files.update({"weights": rest} if rest else {})
        with timer.step("save", f"saving into {job.out}"):
            program = weightless(res.program) if "weight_index" in records else res.program
            artifact.write_program(stage, program, args.output)
            files = {**artifact.write_converted(stage, res, job.model, args.model), **files}
        record = _record(
            args, job.source, job.about, job.cache, job.calibration, files, timer.seconds, job.accuracy
        )
        artifact.write_manifest(stage, {**record, **records})
    return files


def _weight_choice(args: argparse.Namespace, options: Any, model: Any, text: str | None, cache: int) -> tuple:
    """(convert's weight_format=, the calibration's record): the flag's formats, or a budget over the text's
    windows (tokenized with the model's own tokenizer)."""
    budget = budget_of(args)
    if budget is None:
        return options.weight_format, None
    import precast
    from precast.llm.checkpoint import calibration_windows

    name, value = budget
    if model.tokenizer is None:
        raise PrecastError(
            f"--{name} measures on text, which needs the model's tokenizer; {model.source.name} has none "
            f"({model.tokenizer_note})"
        )
    window = args.calibration_window or min(DEFAULT_WINDOW, cache - 1)
    if window > cache - 1:
        raise PrecastError(
            f"--calibration-window {window}: a window is one call, at most the cache's room ({cache - 1}; "
            "--max-cache-len)"
        )
    data = calibration_windows(model.tokenizer, text or "", window, max(args.calibration_tokens, window))
    kw: dict[str, Any] = {name: value, "data": data}
    if args.budget_formats:
        kw["formats"] = tuple(args.budget_formats)
    if args.probes:
        kw["probes"] = args.probes
    record = {"file": str(args.calibration_text), "window": window, "windows": len(data)}
    return precast.WeightBudget(**kw), record


def _accuracy(args: argparse.Namespace, job: _Export, res: Any) -> dict | None:
    """The converted program against the fp32 model (the checkpoint as read) on held-out text (``precast.llm.accuracy``), into the
    report (report.json, the summary); None without a tokenizer to read text with (the summary says so)."""
    from precast.llm.accuracy import on_held_out_text
    from precast.runtime.threads import resolve_threads, running_at

    if job.model.tokenizer is None:
        return None
    used = job.calibration["windows"] * job.calibration["window"] if job.calibration else 0
    # at --threads' count (default: the cores other processes leave free): 2 threads on 2 busy cores ran 3-4x
    # slower than 1
    with running_at(resolve_threads(getattr(args, "threads", None), "--threads")):
        agreement = on_held_out_text(
            job.model.model,
            res.program,
            job.model.tokenizer,
            tokens=args.eval_tokens,
            text=job.text,
            used=used,
            name="--calibration-text",
        )
    res.report.accuracy = agreement.record()
    return res.report.accuracy


def _record(args: argparse.Namespace, source: Any, about: dict, cache: int, *facts: dict | None) -> dict:
    """export.json's record; ``facts``: the calibration's, the files written, the seconds per step, the accuracy
    measured."""
    import torch
    import transformers

    from precast.version import __version__

    calibration, files, seconds, accuracy = facts
    budget = budget_of(args)
    weights: dict[str, Any] = (
        {"budget": {budget[0]: budget[1]}, "calibration": calibration}
        if budget
        else {"plan": str(args.plan)}
        if args.plan
        else {"format": args.weight_format}
    )
    return {
        "source": {"model": str(args.model), "gguf": str(source.gguf) if source.gguf else None},
        "architecture": about["architecture"],
        "parameters": about["parameters"],
        "max_cache_len": cache,
        "dtype": args.dtype,
        "cache_dtype": args.cache_dtype or args.dtype,
        "weights": weights,
        "accuracy": accuracy,
        "stop_tokens": about["stop_tokens"],
        "files": files,
        "seconds": seconds,
        "versions": {
            "precast": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def _print(res: Any, out: Path, files: dict, seconds: dict, tokenizer_note: str) -> None:
    lines = res.report.summary().splitlines()
    infos = [line for line in lines if line.startswith("info: ")]
    print("\n".join(line for line in lines if not line.startswith("info: ")))
    if infos:
        print(f"{len(infos)} info diagnostic(s): {out / artifact.REPORT}")
    if "tokenizer" not in files:
        print(
            f"warning: no tokenizer written ({tokenizer_note or 'none found'}); generate with --prompt-ids (and no "
            "accuracy against fp32 was measured: it reads text)",
            file=sys.stderr,
        )
    took = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
    print(f"wrote {out}: {', '.join(files.values())}, {artifact.MANIFEST} ({took})", file=sys.stderr)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    weights = sum(res.report.weight_bytes_after.values())
    print(
        f"folder {size / 2**20:.1f} MiB for {weights / 2**20:.1f} MiB of weights as stored "
        f"({size / max(weights, 1):.2f}x: each weight once)",
        file=sys.stderr,
    )
