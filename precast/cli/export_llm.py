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
from pathlib import Path
from typing import Any

from precast.cli import artifact
from precast.cli.convert import as_flags, weight_format_of
from precast.errors import PrecastError
from precast.paths import check_input_file
from precast.progress import ProgressBar

BACKENDS = ("openvino", "aoti")
DEFAULT_CACHE = 1024  # positions, or the model's max_position_embeddings when smaller
DEFAULT_WINDOW = 256
DEFAULT_TOKENS = 1024


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-llm",
        help="a transformers checkpoint (folder or GGUF) to a deployable folder: exported, converted, int8/int4",
        description="Read a transformers checkpoint (a folder save_pretrained wrote, or a GGUF file) in fp32, "
        "export it with transformers' static-cache recipe, convert it (policy torch, --dtype, the KV cache in "
        "--cache-dtype, the linear/embedding weights in --weight-format or chosen under a --bits/--kld budget "
        "measured on --calibration-text, or as --plan says) and write one folder: program.pt2, tokenizer.json, "
        "plan.json, report.json, export.json (and model.xml/.bin, model.aoti.pt2 with --backend). "
        "Then: precast generate DIR --prompt TEXT --max-new-tokens N. docs/llm_export.md",
    )
    p.add_argument(
        "model", help="a folder save_pretrained wrote (config.json + safetensors), or a .gguf file"
    )
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="a new (or empty) folder")
    p.add_argument(
        "--gguf",
        metavar="FILE",
        help="read the model from this GGUF file inside/beside MODEL (needs gguf, accelerate)",
    )
    p.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        metavar="N",
        help=f"positions the static KV cache holds, prompt and new tokens (default: {DEFAULT_CACHE}, or the "
        "model's max_position_embeddings when smaller)",
    )
    p.add_argument(
        "--dtype", default="bf16", help="the compute dtype under policy torch: bf16 (default) or fp16"
    )
    p.add_argument(
        "--cache-dtype", default=None, metavar="DTYPE", help="the KV cache's dtype (default: --dtype)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--weight-format",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="linear/embedding weights in int8 (per output channel), int4 (groups of 64), int4-g32, int4-g128, "
        "float, and/or PATTERN=FORMAT over weight names (as precast convert; default: float, the --dtype)",
    )
    how.add_argument(
        "--bits",
        type=float,
        default=None,
        metavar="B",
        help="choose each weight's format: at most B bits per weight on average",
    )
    how.add_argument(
        "--kld",
        type=float,
        default=None,
        metavar="K",
        help="choose each weight's format: estimated KL divergence <= K nats/token",
    )
    how.add_argument(
        "--plan", default=None, metavar="PLAN.json", help="the formats a plan.json written before says"
    )
    p.add_argument(
        "--calibration-text",
        default=None,
        metavar="FILE",
        help="--bits/--kld: plain text the budget is measured on",
    )
    p.add_argument(
        "--calibration-window",
        type=int,
        default=None,
        metavar="W",
        help=f"--bits/--kld: tokens per window (default {DEFAULT_WINDOW}, or the cache's room when smaller)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_TOKENS,
        metavar="T",
        help=f"--bits/--kld: the text's first T tokens are measured on, in whole windows (default {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--budget-formats",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="--bits/--kld: the 8/4-bit formats chosen among besides float (default: int4 int8)",
    )
    p.add_argument(
        "--probes",
        type=int,
        default=None,
        metavar="N",
        help="--bits/--kld: backward passes per window (default 8)",
    )
    p.add_argument(
        "--backend",
        nargs="+",
        choices=BACKENDS,
        default=(),
        help="also write OpenVINO IR (model.xml + model.bin) and/or an AOTInductor package (model.aoti.pt2)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="CODE",
        help="downgrade this diagnostic error to a warning",
    )
    p.set_defaults(run=run)


def _budget(args: argparse.Namespace) -> tuple[str, float] | None:
    if args.bits is not None:
        return "bits", args.bits
    if args.kld is not None:
        return "kld", args.kld
    return None


def check_flags(args: argparse.Namespace) -> Any:
    """Every flag checked before anything loads (one line each); returns the conversion's options record."""
    from precast.pipeline.options import ConvertOptions

    budget = _budget(args)
    if budget is not None:
        name, value = budget
        if not value > 0 or value != value or value == float("inf"):
            raise PrecastError(f"--{name} {value:g}: give a number > 0")
        if args.calibration_text is None:
            raise PrecastError(
                f"--{name} measures each weight's cost on text: give --calibration-text FILE (plain text)"
            )
        check_input_file(args.calibration_text, "give a plain text file", "--calibration-text")
    else:
        given = [
            flag
            for flag, value in (
                ("--calibration-text", args.calibration_text),
                ("--calibration-window", args.calibration_window),
                ("--budget-formats", args.budget_formats),
                ("--probes", args.probes),
            )
            if value is not None
        ]
        if args.calibration_tokens != DEFAULT_TOKENS:
            given.append("--calibration-tokens")
        if given:
            raise PrecastError(f"{given[0]} applies to a budget (--bits or --kld) only; drop it or give one")
    for flag, value in (
        ("--calibration-window", args.calibration_window),
        ("--calibration-tokens", args.calibration_tokens),
        ("--probes", args.probes),
    ):
        if value is not None and value < 1:
            raise PrecastError(f"{flag} {value}: give a number >= 1")
    if args.max_cache_len is not None:
        from precast.llm.checkpoint import MIN_CACHE

        if args.max_cache_len < MIN_CACHE:
            raise PrecastError(f"--max-cache-len {args.max_cache_len}: give at least {MIN_CACHE} positions")
    if budget is not None and args.budget_formats:
        from precast.ir.weight_formats import parse_format

        for f in args.budget_formats:
            try:
                fmt = parse_format(f, "--budget-formats")
            except PrecastError as exc:  # --budget-formats='int2': ... -> --budget-formats int2: ...
                raise PrecastError(f"--budget-formats {f}:" + str(exc).split(":", 1)[1]) from None
            if not fmt.quantized:
                raise PrecastError(f"--budget-formats {f}: name 8/4-bit formats (float is always one)")
    if args.plan is not None:
        from precast.policy.plan import load_plan

        if not load_plan(args.plan).weights:
            raise PrecastError(
                f"--plan {args.plan}: carries no weight formats (write one with export-llm or convert)"
            )
    options = ConvertOptions(
        policy="torch",
        dtype=args.dtype,
        cache_dtype=args.cache_dtype or args.dtype,
        allow=tuple(args.allow),
        plan=args.plan,
        weight_format=weight_format_of(args.weight_format),
    )
    try:
        options.check()
    except PrecastError as exc:
        raise PrecastError(as_flags(str(exc), args)) from None
    return options


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


def _run(args: argparse.Namespace) -> int:
    from precast.llm import checkpoint as ckpt

    options = check_flags(args)
    args.backend = tuple(dict.fromkeys(args.backend))
    given = [args.calibration_text, args.plan, args.model, args.gguf]
    out = artifact.check_output_dir(args.output, given, outputs(args))
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
    steps = ["read", "export", "convert", "save", *args.backend]
    seconds: dict[str, float] = {}
    with ProgressBar(f"reading {source.name}", len(steps)) as bar:

        @contextlib.contextmanager
        def step(name: str, describe: str) -> Iterator[None]:  # timed into seconds; the bar advanced after
            bar.describe(describe)
            started = time.perf_counter()
            yield
            seconds[name] = round(time.perf_counter() - started, 2)
            bar.advance()

        with step("read", f"reading {source.name} in fp32"):
            model = ckpt.read(source)
        about = model.about()
        cache = args.max_cache_len or min(DEFAULT_CACHE, ckpt.max_positions(model.model) or DEFAULT_CACHE)
        ckpt.check_cache_len(cache, model.model)
        weight_format, calibration = _weight_choice(args, options, model, text, cache)
        with step("export", f"exporting (static cache of {cache} positions)"):
            ep = ckpt.export_decoder(model.model, cache)
        what = "measuring the weights and converting" if calibration else "converting"
        with step("convert", what):
            import dataclasses

            from precast.api import convert_with

            res = convert_with(ep, None, dataclasses.replace(options, weight_format=weight_format))
        del ep
        model.model = None  # the fp32 weights, freed before the compiles
        with artifact.staged(out) as stage:
            with step("save", f"saving into {out}"):
                files = artifact.write_converted(stage, res, model, args.model, args.output)
            if "openvino" in args.backend:
                with step("openvino", "compiling for OpenVINO"):
                    files["openvino"] = artifact.write_openvino(stage, res.program)
            if "aoti" in args.backend:
                with step("aoti", "compiling with AOTInductor"):
                    files["aoti"] = artifact.write_aoti(stage, res.program)
            record = _record(args, source, about, cache, calibration, files, seconds)
            artifact.write_manifest(stage, record)
    _print(res, out, files, seconds, model.tokenizer_note)
    return 0


def _weight_choice(args: argparse.Namespace, options: Any, model: Any, text: str | None, cache: int) -> tuple:
    """(convert's weight_format=, the calibration's record): the flag's formats, or a budget over the text's
    windows (tokenized with the model's own tokenizer)."""
    budget = _budget(args)
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
    budget = _budget(args)
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
