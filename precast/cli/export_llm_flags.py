"""``precast export-llm``'s flags: the argument table, and the flags as ``precast.llm.export``'s options record.

The values are checked where the library checks them (``precast.llm.export_options``), named as the flags name
them (``WORDS``, the budget's fields too: ``--bits``/``--kld``, ``--budget-formats``, ``--probes`` make one
``precast.WeightBudget``, checked by ``WeightBudget.check``); only what no option of the library holds (a budget's
flags given without a budget) is checked here.

Input: the parsed flags (``argparse.Namespace``). Output: the parser's table (``ARGUMENTS``), the export's options
record, checked (``check_flags``), or a one-line ``PrecastError`` naming the flag.
"""

from __future__ import annotations

import argparse

from precast.cli.common import as_flags, weight_format_of
from precast.cli.flags import THREADS, Group, allow, flag
from precast.errors import PrecastError
from precast.llm.export_options import (
    BACKENDS,
    DEFAULT_CACHE,
    DEFAULT_EVAL,  # --eval-tokens: precast.llm.accuracy.DEFAULT_TOKENS (a test holds them equal)
    DEFAULT_TOKENS,
    DEFAULT_WINDOW,
    ExportOptions,
)

# how a refusal of the export's options names them here (precast.llm.export_options.ExportOptions.said)
WORDS = {
    "source": "MODEL",
    "out_dir": "-o",
    "gguf": "--gguf",
    "max_cache_len": "--max-cache-len",
    "dtype": "--dtype",
    "cache_dtype": "--cache-dtype",
    "weight_format": "--weight-format",
    "plan": "--plan",
    "calibration_text": "--calibration-text",
    "calibration_window": "--calibration-window",
    "calibration_tokens": "--calibration-tokens",
    "eval_tokens": "--eval-tokens",
    "backend": "--backend",
    "threads": "--threads",
    "allow": "--allow",
    "a budget": "a budget (--bits or --kld)",
    "bits": "--bits",  # the budget's fields (``precast.WeightBudget``)
    "kld": "--kld",
    "formats": "--budget-formats",
    "probes": "--probes",
}

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
        help="plain text the budget (--bits/--kld) is measured on, and int4 weights are fitted on (data-aware "
        "int4: GPTQ + scale search; without it int4 is round-to-nearest)",
    ),
    flag(
        "--calibration-window",
        type=int,
        default=None,
        metavar="W",
        help=f"tokens per calibration window (default {DEFAULT_WINDOW}, or the cache's room when smaller)",
    ),
    flag(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_TOKENS,
        metavar="T",
        help=f"the calibration text's first T tokens are used, in whole windows (default {DEFAULT_TOKENS})",
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


def check_flags(args: argparse.Namespace) -> ExportOptions:
    """Every flag checked before anything loads (one line each, in the flags' words); returns the export's
    options record, checked."""
    # a budget's values (> 0, its formats, probes) are checked by the library (ExportOptions.check), as worded
    chosen = budget_of(args)
    if chosen is None:
        for option, value in (("--budget-formats", args.budget_formats), ("--probes", args.probes)):
            if value is not None:
                raise PrecastError(
                    f"{option} applies to a budget (--bits or --kld) only; drop it or give one"
                )
    options = ExportOptions(
        args.model,
        args.output,
        gguf=args.gguf,
        max_cache_len=args.max_cache_len,
        dtype=args.dtype,
        cache_dtype=args.cache_dtype,
        weight_format=_budget(args, chosen) if chosen else weight_format_of(args.weight_format),
        plan=args.plan,
        calibration_text=args.calibration_text,
        calibration_window=args.calibration_window,
        calibration_tokens=args.calibration_tokens,
        eval_tokens=args.eval_tokens,
        backend=tuple(args.backend),
        threads=getattr(args, "threads", None),
        allow=tuple(args.allow),
        words=WORDS,
    )
    try:  # the conversion's own refusals name its keywords (dtype='int8'): in the flags' words here
        options.check()
    except PrecastError as exc:
        raise PrecastError(as_flags(str(exc), args)) from None
    return options


def _budget(args: argparse.Namespace, chosen: tuple[str, float]) -> object:
    """``--bits B`` / ``--kld K`` (with ``--budget-formats``, ``--probes``) as one ``precast.WeightBudget``,
    measured on the calibration text's windows (``precast.llm.export``)."""
    import precast

    name, value = chosen
    kw: dict[str, object] = {name: value}
    if args.budget_formats:
        kw["formats"] = tuple(args.budget_formats)
    if args.probes is not None:
        kw["probes"] = args.probes
    return precast.WeightBudget(**kw)
