"""precast export-llm MODEL -o DIR [--gguf FILE] [--max-cache-len N] [--dtype bf16|fp16] [--cache-dtype DTYPE]
                     [--weight-format FORMAT... | --bits B | --kld K | --plan PLAN.json]
                     [--calibration-text FILE [--calibration-window W] [--calibration-tokens T]
                      [--budget-formats FORMAT...] [--probes N]] [--backend openvino aoti] [--allow CODE]

The flow of ``optimum-cli export openvino --weight-format int8`` / ``llama-quantize`` in one command: a transformers
checkpoint (a ``save_pretrained`` folder, or a GGUF file) read in fp32, exported with transformers' static-cache
recipe (``precast.llm.checkpoint``), converted (policy torch, bf16, the KV cache in bf16, the weights in the format
asked for, or chosen by measurement on calibration text under a budget, or as a plan says), and written as one
folder: program.pt2, tokenizer.json, plan.json, report.json, export.json, and OpenVINO IR / an AOTInductor package
on request (``precast.cli.artifact``: written whole or not at all).

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
    names = [artifact.PROGRAM, artifact.TOKENIZER, artifact.PLAN, artifact.REPORT, artifact.MANIFEST]
    if "openvino" in args.backend:
        names += [artifact.OPENVINO, Path(artifact.OPENVINO).with_suffix(".bin").name]
    if "aoti" in args.backend:
        names.append(artifact.AOTI)
    return names


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
    steps = ["read", "export", "convert", "save", *args.backend]
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
    with timer.step("export", f"exporting (static cache of {job.cache} positions)"):
        ep = ckpt.export_decoder(job.model.model, job.cache)
    what = "measuring the weights and converting" if job.calibration else "converting"
    with timer.step("convert", what):
        res = convert_with(ep, None, dataclasses.replace(job.options, weight_format=weight_format))
    del ep
    job.model.model = None  # the fp32 weights, freed before the compiles
    return res


def _write_folder(args: argparse.Namespace, job: _Export, timer: _Steps, res: Any) -> dict:
    """The folder written whole or not at all: the converted program and its files, the compiled backends,
    export.json; returns the files written."""
    with artifact.staged(job.out) as stage:
        with timer.step("save", f"saving into {job.out}"):
            files = artifact.write_converted(stage, res, job.model, args.model, args.output)
        if "openvino" in args.backend:
            with timer.step("openvino", "compiling for OpenVINO"):
                files["openvino"] = artifact.write_openvino(stage, res.program)
        if "aoti" in args.backend:
            with timer.step("aoti", "compiling with AOTInductor"):
                files["aoti"] = artifact.write_aoti(stage, res.program)
        record = _record(args, job.source, job.about, job.cache, job.calibration, files, timer.seconds)
        artifact.write_manifest(stage, record)
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


def _record(args: argparse.Namespace, source: Any, about: dict, cache: int, *facts: dict | None) -> dict:
    """export.json's record; ``facts``: the calibration's, the files written, the seconds per step."""
    import torch
    import transformers

    from precast.version import __version__

    calibration, files, seconds = facts
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
            f"warning: no tokenizer written ({tokenizer_note or 'none found'}); generate with --prompt-ids",
            file=sys.stderr,
        )
    took = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
    print(f"wrote {out}: {', '.join(files.values())}, {artifact.MANIFEST} ({took})", file=sys.stderr)
