"""``precast export-llm``'s flags: the argument table, and every value checked before anything loads.

Input: the parsed flags (``argparse.Namespace``). Output: the parser's table (``ARGUMENTS``), the conversion's
options record (``check_flags``), or a one-line ``PrecastError`` naming the flag.
"""

from __future__ import annotations

import argparse
from typing import Any

from precast.cli.convert import as_flags, weight_format_of
from precast.cli.flags import THREADS, Group, allow, flag
from precast.errors import PrecastError
from precast.paths import check_input_file

BACKENDS = ("openvino", "aoti")
DEFAULT_CACHE = 1024  # positions, or the model's max_position_embeddings when smaller
DEFAULT_WINDOW = 256
DEFAULT_TOKENS = 1024
DEFAULT_EVAL = 512  # --eval-tokens: precast.llm.accuracy.DEFAULT_TOKENS (a test holds them equal)

HOW = Group(exclusive=True)  # the weights' formats: given, chosen under a budget, or a plan's

ARGUMENTS = (
    THREADS,
    flag("model", help="a folder save_pretrained wrote (config.json + safetensors), or a .gguf file"),
    flag("-o", "--output", required=True, metavar="DIR", help="a new (or empty) folder"),
    flag(
        "--gguf",
        metavar="FILE",
        help="read the model from this GGUF file inside/beside MODEL (needs gguf, accelerate)",
    ),
    flag(
        "--max-cache-len",
        type=int,
        default=None,
        metavar="N",
        help=f"positions the static KV cache holds, prompt and new tokens (default: {DEFAULT_CACHE}, or the "
        "model's max_position_embeddings when smaller)",
    ),
    flag("--dtype", default="bf16", help="the compute dtype under policy torch: bf16 (default) or fp16"),
    flag("--cache-dtype", default=None, metavar="DTYPE", help="the KV cache's dtype (default: --dtype)"),
    flag(
        "--weight-format",
        group=HOW,
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="linear/embedding weights in int8 (per output channel, symmetric), int8-asym (with a zero point), "
        "int4 (groups of 64), int4-g32, int4-g128, float, and/or PATTERN=FORMAT over weight names (as precast "
        "convert; default: float, the --dtype)",
    ),
    flag(
        "--bits",
        group=HOW,
        type=float,
        default=None,
        metavar="B",
        help="choose each weight's format: at most B bits per weight on average",
    ),
    flag(
        "--kld",
        group=HOW,
        type=float,
        default=None,
        metavar="K",
        help="choose each weight's format: estimated KL divergence <= K nats/token",
    ),
    flag(
        "--plan",
        group=HOW,
        default=None,
        metavar="PLAN.json",
        help="the formats a plan.json written before says",
    ),
    flag(
        "--calibration-text",
        default=None,
        metavar="FILE",
        help="--bits/--kld: plain text the budget is measured on",
    ),
    flag(
        "--calibration-window",
        type=int,
        default=None,
        metavar="W",
        help=f"--bits/--kld: tokens per window (default {DEFAULT_WINDOW}, or the cache's room when smaller)",
    ),
    flag(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_TOKENS,
        metavar="T",
        help=f"--bits/--kld: the text's first T tokens are measured on, in whole windows (default {DEFAULT_TOKENS})",
    ),
    flag(
        "--budget-formats",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="--bits/--kld: the 8/4-bit formats chosen among besides float (default: int4 int8)",
    ),
    flag(
        "--probes",
        type=int,
        default=None,
        metavar="N",
        help="--bits/--kld: backward passes per window (default 8)",
    ),
    flag(
        "--eval-tokens",
        type=int,
        default=DEFAULT_EVAL,
        metavar="N",
        help=f"measure the result against the fp32 model on N tokens of held-out text (the calibration text's "
        f"unused part, else Python's documentation): KLD, top-1 agreement, perplexity (default {DEFAULT_EVAL}; "
        "0: not measured)",
    ),
    flag(
        "--backend",
        nargs="+",
        choices=BACKENDS,
        default=(),
        help="also write OpenVINO IR (model.xml + model.bin) and/or an AOTInductor package (model.aoti.pt2)",
    ),
    allow(),
)


def budget_of(args: argparse.Namespace) -> tuple[str, float] | None:
    """("bits", B) or ("kld", K) when a budget chooses the weights' formats, else None."""
    if args.bits is not None:
        return "bits", args.bits
    if args.kld is not None:
        return "kld", args.kld
    return None


def check_flags(args: argparse.Namespace) -> Any:
    """Every flag checked before anything loads (one line each); returns the conversion's options record."""
    chosen = budget_of(args)
    if chosen is not None:
        _check_budget(args, *chosen)
    else:
        _refuse_calibration_flags(args)
    _check_counts(args)
    if chosen is not None and args.budget_formats:
        _check_budget_formats(args.budget_formats)
    if args.plan is not None:
        _check_plan(args.plan)
    return _options(args)


def _check_budget(args: argparse.Namespace, name: str, value: float) -> None:
    """--bits/--kld: a finite number > 0, with the calibration text it is measured on."""
    if not value > 0 or value != value or value == float("inf"):
        raise PrecastError(f"--{name} {value:g}: give a number > 0")
    if args.calibration_text is None:
        raise PrecastError(
            f"--{name} measures each weight's cost on text: give --calibration-text FILE (plain text)"
        )
    check_input_file(args.calibration_text, "give a plain text file", "--calibration-text")


def _refuse_calibration_flags(args: argparse.Namespace) -> None:
    """Without a budget, the first calibration flag given is refused."""
    given = [
        option
        for option, value in (
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


def _check_counts(args: argparse.Namespace) -> None:
    """The counts given: at least 1, the cache at least ``MIN_CACHE`` positions."""
    if args.eval_tokens < 0:
        raise PrecastError(f"--eval-tokens {args.eval_tokens}: give a number >= 0 (0: not measured)")
    for option, value in (
        ("--calibration-window", args.calibration_window),
        ("--calibration-tokens", args.calibration_tokens),
        ("--probes", args.probes),
    ):
        if value is not None and value < 1:
            raise PrecastError(f"{option} {value}: give a number >= 1")
    if args.max_cache_len is not None:
        from precast.llm.checkpoint import MIN_CACHE

        if args.max_cache_len < MIN_CACHE:
            raise PrecastError(f"--max-cache-len {args.max_cache_len}: give at least {MIN_CACHE} positions")


def _check_budget_formats(formats: list[str]) -> None:
    """--budget-formats: known 8/4-bit formats."""
    from precast.ir.weight_formats import parse_format

    for f in formats:
        try:
            fmt = parse_format(f, "--budget-formats")
        except PrecastError as exc:  # --budget-formats='int2': ... -> --budget-formats int2: ...
            raise PrecastError(f"--budget-formats {f}:" + str(exc).split(":", 1)[1]) from None
        if not fmt.quantized:
            raise PrecastError(f"--budget-formats {f}: name 8/4-bit formats (float is always one)")


def _check_plan(path: str) -> None:
    """--plan: a plan file that carries weight formats."""
    from precast.policy.plan import load_plan

    if not load_plan(path).weights:
        raise PrecastError(f"--plan {path}: carries no weight formats (write one with export-llm or convert)")


def _options(args: argparse.Namespace) -> Any:
    """The conversion's options record (policy torch), checked; a refusal in the words of the flags."""
    from precast.pipeline.options import ConvertOptions

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
