"""precast convert IN.pt2|pkg.module:factory -o OUT.pt2

Input: a saved program or a factory spec, options. Output: the converted program file (atomic write) and a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from precast.cli.common import check_options, is_factory, load_source
from precast.cli.flags import DEVICE_TYPE, DTYPE, SOURCE, TRUST_PICKLE, add_command, allow, flag
from precast.errors import PrecastError
from precast.io import check_writable, program_bytes, write_bytes
from precast.paths import check_outputs
from precast.pipeline.options import ConvertOptions

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
        from precast.numerics.calibration.files import load_calibration

        # a corrupt file or a bad merge is said before the program loads; convert checks each file against it
        cals = [load_calibration(f) for f in stats]
        cals[0].merge(*cals[1:])
    return plan, rules


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
