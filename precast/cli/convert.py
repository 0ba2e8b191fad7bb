"""precast convert IN.pt2|pkg.module:factory -o OUT.pt2

Input: a saved program or a factory spec, options. Output: the converted program file (atomic write) and a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from precast.cli.flags import DEVICE_TYPE, DTYPE, SOURCE, TRUST_PICKLE, add_command, allow, flag
from precast.errors import PrecastError, first_line
from precast.io import check_writable, write_bytes
from precast.paths import check_input_file, check_outputs
from precast.pipeline.load import check_program_file
from precast.pipeline.options import ConvertOptions
from precast.policy.resolve import RULE_OPTIONS
from precast.threads import TORCH_LOCK

ARGUMENTS = (
    SOURCE,
    flag("-o", "--output", required=True, help="where to save the converted program (.pt2)"),
    flag(
        "--policy",
        choices=["torch", "rules", "auto"],
        default=None,
        help="default: the program's own regions; auto: rules, with each matmul/convolution/attention low only "
        "where that is faster on this device (measured, cached)",
    ),
    DTYPE,
    DEVICE_TYPE,
    flag(
        "--cache-dtype",
        default=None,
        metavar="DTYPE",
        help="hold the caches the program stores into (a KV cache) in bf16/fp16, under any policy",
    ),
    flag(
        "--weight-format",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="store linear/embedding weights in int8 (per output channel, symmetric), int8-asym (with a zero "
        "point, as OpenVINO's int8 export) or int4 (groups of 64; int4-g32, int4-g128): one format for every weight, "
        "and/or PATTERN=FORMAT over weight names, first match first (e.g. 'lm_head.weight=int8' int4; float: as the policy computes); docs/weight_formats.md",
    ),
    flag("--exclude-nodes", nargs="*", default=(), metavar="REGEX"),
    flag("--exclude-ops", nargs="*", default=(), metavar="OP"),
    flag("--include-nodes", nargs="*", default=(), metavar="REGEX", help="rules: force low precision"),
    flag("--include-ops", nargs="*", default=(), metavar="OP", help="rules: force low precision"),
    flag("--data-max", type=float, default=None, help="rules: fp32 where |values| exceed this"),
    flag("--init-max", type=float, default=None, help="rules: fp32 where a constant exceeds this"),
    flag("--max-reduction-depth", type=int, default=None, help="rules: fp32 above this accumulation depth"),
    flag(
        "--calibration",
        default=None,
        metavar="FILE.pt",
        help="rules: a list of input tuples saved with torch.save, for data_max and tolerance",
    ),
    flag(
        "--calibration-stats",
        nargs="+",
        default=None,
        metavar="FILE.json",
        help="rules: statistics saved by precast.calibrate(...).save (one per shard or rank: merged), used "
        "instead of measuring (docs/distributed.md)",
    ),
    flag(
        "--patterns",
        nargs="*",
        default=None,
        metavar="NAME",
        help="rules: precision-sensitive patterns kept in fp32 (default: all of manual_norm, small_divisor, "
        "exp_reduce, sincos_angles; --patterns alone: none)",
    ),
    flag(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="keep the ops a plan lists in fp32: over --policy torch, rules or auto; without --policy, over the "
        "program's regions for a plan written there (sensitivity --policy none), else rules (docs/sensitivity.md)",
    ),
    flag(
        "--write-plan",
        default=None,
        metavar="OUT.json",
        help="write the ops this conversion keeps in fp32 as a portable plan (with ModelOpt / Torch-TensorRT "
        "exclusion regexes)",
    ),
    flag(
        "--weights",
        default=None,
        metavar="DIR",
        help="stream the weights from this folder of safetensors shards (or one .safetensors file): the program "
        "may hold none (exported with fake or meta weights, docs/streaming.md); memory stays about one tensor",
    ),
    flag(
        "--weights-out",
        default=None,
        metavar="DIR",
        help="with --weights: the folder the converted weights go to (default: OUTPUT with the suffix .weights)",
    ),
    flag("--no-verify", action="store_true", help="skip the run comparing against the reference"),
    TRUST_PICKLE,
    flag("--json", action="store_true", help="print the report as JSON instead of a summary"),
    allow(" (repeatable), e.g. --allow control-flow"),
)


def add_parser(sub: Any) -> None:
    """``precast convert``: the flags of ``ARGUMENTS``, run by ``run``."""
    add_command(
        sub,
        "convert",
        ARGUMENTS,
        run=run,
        help="convert a saved program (or a model factory) to explicit mixed precision",
        description="Lower the program's autocast regions (and optionally a policy) to explicit casts, cast "
        "weights once, and save a standard torch.export program.",
    )


def load_source(source: str, trust_pickle: bool = False):
    """(program_or_module, example_inputs) from a .pt2 path or a module:factory spec."""
    from precast.pipeline.load import load_factory, load_program

    if is_factory(source):
        return load_factory(source)
    return load_program(source, trust_pickle=trust_pickle), None


def is_factory(source: str) -> bool:
    return ":" in source and not Path(source).exists() and not source.endswith(".pt2")


# the rules keywords the CLI takes as flags (precast.policy.resolve.RULE_OPTIONS, defined once as RulesPolicy's
# fields) -> the flag a user types; calibration is a file here, tolerance and custom_rules are Python-only
FLAGS = {
    name: "--" + name.replace("_", "-")
    for name in RULE_OPTIONS
    if name not in ("calibration", "tolerance", "custom_rules")
}
# every keyword of ConvertOptions a flag sets, for naming the flag in a refusal
NAMED = {
    **FLAGS,
    **{
        n: "--" + n.replace("_", "-")
        for n in ("dtype", "device_type", "cache_dtype", "weights_out", "weights", "weight_format")
    },
    "calibration": "--calibration",
    "allow": "--allow",
    "plan": "--plan",
}


def options_of(args: argparse.Namespace) -> ConvertOptions:
    """The conversion's options as ``precast.convert`` builds them (``ConvertOptions``), from the flags; the
    calibration files stand for their data until it is loaded."""
    rules = {name: getattr(args, name) for name in FLAGS if getattr(args, name) not in (None, (), [])}
    if args.patterns is not None:  # `--patterns` alone: none
        rules["patterns"] = tuple(args.patterns)
    stats = getattr(args, "calibration_stats", None)
    if args.calibration or stats:
        rules["calibration"] = [Path(f) for f in stats] if stats else Path(args.calibration)
    weights, weights_out = getattr(args, "weights", None), getattr(args, "weights_out", None)
    if weights and not weights_out:  # default: next to the output
        weights_out = str(Path(args.output).with_suffix(".weights"))
    return ConvertOptions(
        policy=args.policy,
        dtype=args.dtype,
        device_type=args.device_type,
        rules=rules,
        verify=not getattr(args, "no_verify", False),
        allow=tuple(args.allow),
        plan=getattr(args, "plan", None),
        cache_dtype=getattr(args, "cache_dtype", None),
        weights=weights,
        weights_out=weights_out,
        weight_format=weight_format_of(getattr(args, "weight_format", None)),
    )


def weight_format_of(items: list[str] | None) -> object:
    """``--weight-format`` as ``convert``'s ``weight_format=``: one FORMAT, or PATTERN=FORMAT rules in order (a
    bare FORMAT among them is every other weight: ``"*"``)."""
    if not items:
        return None
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    rules: dict[str, str] = {}
    for item in items:
        pattern, sep, fmt = item.rpartition("=")
        key = pattern if sep else "*"
        if key in rules:
            raise PrecastError(f"--weight-format: {key!r} is given twice")
        rules[key] = fmt
    if "*" in rules:  # every other weight: after the patterns, wherever it was typed
        rules["*"] = rules.pop("*")
    return rules


def check_options(args: argparse.Namespace) -> ConvertOptions:
    """Every option checked before anything is loaded (one-line PrecastError, naming the flags): the files the
    flags name, then the options record's own ``check`` (what ``precast.convert`` refuses, refused here first)."""
    stats = getattr(args, "calibration_stats", None)
    if args.calibration and stats:
        raise PrecastError(
            "--calibration and --calibration-stats: give batches to measure or statistics, not both"
        )
    if not is_factory(args.source):
        check_program_file(args.source)
    elif not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", args.source):
        raise PrecastError(f"'{args.source}': expected a saved program path or 'package.module:factory'")
    weights = getattr(args, "weights", None)
    if weights and is_factory(args.source):
        raise PrecastError(
            "--weights: streams the weights of a saved program; a factory's module holds its own"
        )
    if weights and not Path(weights).exists():
        raise PrecastError(f"--weights {weights}: no such folder or file")
    # missing, a folder, a FIFO or a device: one line, nothing opened (precast.paths.check_input_file)
    if args.calibration:
        check_input_file(args.calibration, "save a list of input tuples with torch.save", "--calibration")
    for f in stats or ():
        check_input_file(f, "write one with precast.calibrate(...).save", "--calibration-stats")
    options = options_of(args)
    try:
        options.check()
    except PrecastError as exc:
        raise PrecastError(as_flags(str(exc), args)) from None
    return options


def _check_outputs_outside(args: argparse.Namespace, weights_out: str | None) -> None:
    """-o and --write-plan never land on or inside the input weights, nor on the weights output folder."""
    from precast.weights.files import WeightFiles
    from precast.weights.streamed import check_file_outside, check_weights_out, overlaps, resolved

    files = WeightFiles(args.weights)
    outputs = [
        (option, path) for option, path in (("-o", args.output), ("--write-plan", args.write_plan)) if path
    ]
    for option, path in outputs:  # what the user typed first: the weights output may be derived from -o
        check_file_outside(path, files, option)
    if weights_out is None:  # again just before writing: only the outputs against the input weights
        return
    out = check_weights_out(files, weights_out)
    for option, path in outputs:
        if overlaps(resolved(path), [out]) is not None:
            raise PrecastError(
                f"{option} {path}: resolves into the weights output {out}; give the weights and the program "
                "different places"
            )


def as_flags(message: str, args: argparse.Namespace) -> str:
    """A refusal of ``ConvertOptions.check`` in the words of the command line: ``data_max=-1.0: ...`` ->
    ``--data-max=-1.0: ...``, ``dtype='int8': ...`` -> ``--dtype int8: ...``, ``weights= needs weights_out=`` ->
    ``--weights needs --weights-out``, ``policy='rules'`` -> ``--policy rules``."""
    stats = getattr(args, "calibration_stats", None)
    named = {**NAMED, "calibration": "--calibration-stats" if stats else "--calibration"}
    for name in ("dtype", "cache_dtype", "device_type"):  # name=repr: -> --flag value: (the value as typed)
        if message.startswith(f"{name}=") and getattr(args, name, None) is not None:
            message = f"{named[name]} {getattr(args, name)}:" + message.split(":", 1)[1]
    if message.startswith("weight_format=") and getattr(args, "weight_format", None):
        message = f"--weight-format {' '.join(args.weight_format)}:" + message.split(":", 1)[1]
    if message.startswith("allow="):
        message = f"--allow {' '.join(args.allow)}:" + message.split(":", 1)[1]
    message = re.sub(r"policy='(\w+)'", r"--policy \1", message)
    for name in sorted(named, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){name}=(?=[\s:,.;]|$)", named[name], message)
        message = re.sub(rf"(?<![\w-]){name}(?=[=:,])", named[name], message)
    return message


def _load_calibration(path: str) -> list:
    from precast.pipeline.load import load_saved

    p = Path(path)
    batches = load_saved(p, "--calibration", "save a list of input tuples with torch.save")
    if not isinstance(batches, (list, tuple)) or not batches:
        raise PrecastError(
            f"--calibration {p}: expected a non-empty list of input tuples, got {type(batches).__name__}"
        )
    return list(batches)


def run(args: argparse.Namespace) -> int:
    """Every option and file checked, the small inputs read, the program loaded, converted and saved; the report
    printed."""
    from precast.api import convert_with

    options = check_options(args)
    stats = tuple(getattr(args, "calibration_stats", None) or ())
    inputs_ = (None if is_factory(args.source) else args.source, args.calibration, args.plan, *stats)
    _check_writes(args, inputs_)
    plan, rules = _read_small_inputs(args, options, stats)
    started = time.perf_counter()
    obj, inputs = load_source(args.source, args.trust_pickle)
    res = convert_with(obj, inputs, dataclasses.replace(options, rules=rules, plan=plan))
    _save(args, res, inputs_)
    if args.write_plan:
        _write_plan(args, res, inputs_)
    if args.plan:  # the plan read (not the one written): its ops counted against the ops it decided
        _warn_unmatched(args, res, plan)
    if args.json:
        print(res.report.to_json())
    else:
        print(res.report.summary())
        print(f"saved {args.output} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


def _check_writes(args: argparse.Namespace, inputs_: tuple) -> None:
    """Every file written against every file read, and against each other, before anything is written."""
    check_outputs({"the output": args.output, "--write-plan": args.write_plan}, inputs_)
    if args.weights:  # before check_writable, whose probe file would land in the input folder
        _check_outputs_outside(args, args.weights_out or str(Path(args.output).with_suffix(".weights")))
    check_writable(args.output, inputs_)
    if args.write_plan:
        check_writable(args.write_plan, inputs_)


def _read_small_inputs(args: argparse.Namespace, options: ConvertOptions, stats: tuple) -> tuple[Any, dict]:
    """(the --plan, the rules with --calibration's batches): read and checked before the (long) load of the
    program, the --calibration-stats files merged to check them."""
    plan = None
    if args.plan:
        from precast.policy.plan import load_plan

        plan = load_plan(args.plan)  # checked before the (long) load of the program
    rules = dict(options.rules)
    if args.calibration:
        rules["calibration"] = _load_calibration(args.calibration)  # small and quick: before the program
    if stats:
        from precast.numerics.calibration_files import load_calibration

        # a corrupt file or a bad merge is said before the program loads; convert checks each file against it
        cals = [load_calibration(f) for f in stats]
        cals[0].merge(*cals[1:])
    return plan, rules


def program_bytes(program: torch.export.ExportedProgram, output: str) -> bytes:
    """The converted program serialized in memory, to be written through Python (a full disk is one line, not an
    abort); a failure of ``torch.export.save`` is one line naming ``output``."""
    buffer = io.BytesIO()
    try:
        with TORCH_LOCK:
            torch.export.save(program, buffer)
    except Exception as exc:
        raise PrecastError(f"{output}: could not save the converted program: {first_line(exc)}") from exc
    return buffer.getvalue()


def _save(args: argparse.Namespace, res: Any, inputs_: tuple) -> None:
    """The converted program written to -o."""
    data = program_bytes(res.program, args.output)
    if args.weights:  # checked again just before writing: a link changed meanwhile cannot redirect it
        _check_outputs_outside(args, None)
    write_bytes(args.output, data, inputs_)


def _write_plan(args: argparse.Namespace, res: Any, inputs_: tuple) -> None:
    """--write-plan: the ops this conversion kept in fp32, as a plan file."""
    import precast

    plan = precast.Plan.from_result(res, source=f"precast convert {args.source}")
    write_bytes(args.write_plan, plan.to_json(res.program).encode(), inputs_)
    print(f"wrote {args.write_plan}: {len(plan.fp32)} op(s) kept in fp32", file=sys.stderr)


def _warn_unmatched(args: argparse.Namespace, res: Any, plan: Any) -> None:
    """A warning when some of the plan's ops matched no op of the program."""
    applied = sum(1 for r in res.report.nodes if r.rule == "custom:plan")
    if applied < len(plan.fp32):
        print(
            f"warning: --plan {args.plan}: {len(plan.fp32) - applied} of its {len(plan.fp32)} "
            "op(s) matched no op of this program (another model, or the plan's ops are decided earlier by "
            "include/exclude rules)",
            file=sys.stderr,
        )
