"""precast convert IN.pt2|pkg.module:factory -o OUT.pt2

Input: a saved program or a factory spec, options. Output: the converted program file (atomic write) and a summary.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from pathlib import Path

import torch

from precast.errors import PrecastError, first_line
from precast.io import check_writable, write_bytes
from precast.pipeline.capture import check_program_file
from precast.policy.resolve import RULE_OPTIONS
from precast.threads import TORCH_LOCK


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a saved program (or a model factory) to explicit mixed precision",
        description="Lower the program's autocast regions (and optionally a policy) to explicit casts, cast "
        "weights once, and save a standard torch.export program.",
    )
    p.add_argument("source", help="a program saved with torch.export.save, or 'package.module:factory'")
    p.add_argument("-o", "--output", required=True, help="where to save the converted program (.pt2)")
    p.add_argument(
        "--policy",
        choices=["torch", "rules", "auto"],
        default=None,
        help="default: the program's own regions; auto: rules, with each matmul/convolution/attention low only "
        "where that is faster on this device (measured, cached)",
    )
    p.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the device's autocast dtype)")
    p.add_argument("--device-type", default=None, choices=["cpu", "cuda"])
    p.add_argument(
        "--cache-dtype",
        default=None,
        metavar="DTYPE",
        help="hold the caches the program stores into (a KV cache) in bf16/fp16, under any policy",
    )
    p.add_argument("--exclude-nodes", nargs="*", default=(), metavar="REGEX")
    p.add_argument("--exclude-ops", nargs="*", default=(), metavar="OP")
    p.add_argument(
        "--include-nodes", nargs="*", default=(), metavar="REGEX", help="rules: force low precision"
    )
    p.add_argument("--include-ops", nargs="*", default=(), metavar="OP", help="rules: force low precision")
    p.add_argument("--data-max", type=float, default=None, help="rules: fp32 where |values| exceed this")
    p.add_argument("--init-max", type=float, default=None, help="rules: fp32 where a constant exceeds this")
    p.add_argument(
        "--max-reduction-depth", type=int, default=None, help="rules: fp32 above this accumulation depth"
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE.pt",
        help="rules: a list of input tuples saved with torch.save, for data_max and tolerance",
    )
    p.add_argument(
        "--calibration-stats",
        nargs="+",
        default=None,
        metavar="FILE.json",
        help="rules: statistics saved by precast.calibrate(...).save (one per shard or rank: merged), used "
        "instead of measuring (docs/distributed.md)",
    )
    p.add_argument(
        "--patterns",
        nargs="*",
        default=None,
        metavar="NAME",
        help="rules: precision-sensitive patterns kept in fp32 (default: all of manual_norm, small_divisor, "
        "exp_reduce, sincos_angles; --patterns alone: none)",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="keep the ops a plan lists in fp32: over --policy torch, rules or auto; without --policy, over the "
        "program's regions for a plan written there (sensitivity --policy none), else rules (docs/sensitivity.md)",
    )
    p.add_argument(
        "--write-plan",
        default=None,
        metavar="OUT.json",
        help="write the ops this conversion keeps in fp32 as a portable plan (with ModelOpt / Torch-TensorRT "
        "exclusion regexes)",
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="DIR",
        help="stream the weights from this folder of safetensors shards (or one .safetensors file): the program "
        "may hold none (exported with fake or meta weights, docs/streaming.md); memory stays about one tensor",
    )
    p.add_argument(
        "--weights-out",
        default=None,
        metavar="DIR",
        help="with --weights: the folder the converted weights go to (default: OUTPUT with the suffix .weights)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the run comparing against the reference")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a .pt2 whose sample inputs or constants need a full unpickle (it can run code: trusted files only)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a summary")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="CODE",
        help="downgrade this diagnostic error to a warning (repeatable), e.g. --allow control-flow",
    )
    p.set_defaults(run=run)


def load_source(source: str, trust_pickle: bool = False):
    """(program_or_module, example_inputs) from a .pt2 path or a module:factory spec."""
    from precast.pipeline.capture import load_factory, load_program

    if _is_factory(source):
        return load_factory(source)
    return load_program(source, trust_pickle=trust_pickle), None


def _is_factory(source: str) -> bool:
    return ":" in source and not Path(source).exists() and not source.endswith(".pt2")


# the rules keywords the CLI takes as flags (precast.policy.resolve.RULE_OPTIONS, defined once as RulesPolicy's
# fields) -> the flag a user types; calibration is a file here, tolerance and custom_rules are Python-only
FLAGS = {
    name: "--" + name.replace("_", "-")
    for name in RULE_OPTIONS
    if name not in ("calibration", "tolerance", "custom_rules")
}


def check_options(args: argparse.Namespace) -> dict:
    """Every option checked before anything is loaded (one-line PrecastError); returns convert's keywords."""
    from precast import codes
    from precast.dtypes import parse_low_dtype as parse_dtype
    from precast.policy.rules.options import RuleOptions

    try:
        low = parse_dtype(args.dtype)
    except PrecastError:
        raise PrecastError(f"--dtype {args.dtype}: choose bf16 or fp16") from None
    if getattr(args, "cache_dtype", None) is not None:
        from precast.api import cache_dtype_of

        try:
            cache_dtype_of(args.cache_dtype)
        except PrecastError:
            raise PrecastError(f"--cache-dtype {args.cache_dtype}: choose bf16, fp16 or fp32") from None
    opts = {name: getattr(args, name) for name in FLAGS if getattr(args, name) not in (None, (), [])}
    if args.patterns is not None:  # `--patterns` alone: none
        opts["patterns"] = tuple(args.patterns)
    stats = getattr(args, "calibration_stats", None)
    rules_only = [FLAGS[name] for name in opts] + (["--calibration"] if args.calibration else [])
    rules_only += ["--calibration-stats"] if stats else []
    if args.calibration and stats:
        raise PrecastError(
            "--calibration and --calibration-stats: give batches to measure or statistics, not both"
        )
    plan = getattr(args, "plan", None)
    if plan is not None and args.policy not in (None, "torch", "rules", "auto"):
        raise PrecastError(f"--plan: applies to --policy torch, rules or auto, not {args.policy}")
    if args.policy not in ("rules", "auto") and not plan and rules_only:
        raise PrecastError(f"{', '.join(rules_only)}: these options need --policy rules (or auto)")
    try:
        RuleOptions.build(low or torch.bfloat16, **opts)
    except PrecastError as exc:
        raise PrecastError(_as_flag(str(exc))) from None
    unknown = [c for c in args.allow if c not in codes.allowable()]
    if unknown:
        raise PrecastError(
            f"--allow {' '.join(unknown)}: unknown diagnostic code; choose from {', '.join(codes.allowable())}"
        )
    if not _is_factory(args.source):
        check_program_file(args.source)
    elif not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", args.source):
        raise PrecastError(f"'{args.source}': expected a saved program path or 'package.module:factory'")
    weights, weights_out = getattr(args, "weights", None), getattr(args, "weights_out", None)
    if weights_out and not weights:
        raise PrecastError("--weights-out: give --weights (the folder the weights are read from) as well")
    if weights and _is_factory(args.source):
        raise PrecastError(
            "--weights: streams the weights of a saved program; a factory's module holds its own"
        )
    if weights and not Path(weights).exists():
        raise PrecastError(f"--weights {weights}: no such folder or file")
    if args.calibration and not Path(args.calibration).is_file():
        raise PrecastError(
            f"--calibration {args.calibration}: no such file; save a list of input tuples with torch.save"
        )
    for f in stats or ():
        if not Path(f).is_file():
            raise PrecastError(
                f"--calibration-stats {f}: no such file; write one with precast.calibrate(...).save"
            )
    return opts


def _as_flag(message: str) -> str:
    """``data_max=-1.0: ...`` -> ``--data-max=-1.0: ...``: name the flag the user typed."""
    for name, flag in FLAGS.items():
        if message.startswith(name):
            return flag + message[len(name) :]
    return message


def _load_calibration(path: str) -> list:
    from precast.pipeline.capture import load_saved

    p = Path(path)
    batches = load_saved(p, "--calibration", "save a list of input tuples with torch.save")
    if not isinstance(batches, (list, tuple)) or not batches:
        raise PrecastError(
            f"--calibration {p}: expected a non-empty list of input tuples, got {type(batches).__name__}"
        )
    return list(batches)


def run(args: argparse.Namespace) -> int:
    opts = check_options(args)
    stats = tuple(getattr(args, "calibration_stats", None) or ())
    inputs_ = (None if _is_factory(args.source) else args.source, args.calibration, *stats)
    check_writable(args.output, inputs_)
    if args.write_plan:
        check_writable(args.write_plan, inputs_)
    if args.plan:
        from precast.policy.plan import load_plan

        opts["plan"] = load_plan(args.plan)  # checked before the (long) load of the program
    if args.calibration:
        opts["calibration"] = _load_calibration(args.calibration)  # small and quick: before the program
    if stats:
        from precast.numerics.calibration import load_calibration

        # a corrupt file or a bad merge is said before the program loads; convert checks each file against it
        cals = [load_calibration(f) for f in stats]
        cals[0].merge(*cals[1:])
        opts["calibration"] = [Path(f) for f in stats]
    import precast

    if args.weights:
        opts["weights"] = args.weights
        opts["weights_out"] = args.weights_out or str(Path(args.output).with_suffix(".weights"))
    started = time.perf_counter()
    obj, inputs = load_source(args.source, args.trust_pickle)
    res = precast.convert(
        obj,
        inputs,
        policy=args.policy,
        dtype=args.dtype,
        device_type=args.device_type,
        verify=not args.no_verify,
        allow=tuple(args.allow),
        cache_dtype=args.cache_dtype,
        **opts,
    )
    buffer = (
        io.BytesIO()
    )  # serialized in memory, written through Python: a full disk is one line, not an abort
    try:
        with TORCH_LOCK:
            torch.export.save(res.program, buffer)
    except Exception as exc:
        raise PrecastError(f"{args.output}: could not save the converted program: {first_line(exc)}") from exc
    write_bytes(args.output, buffer.getvalue(), inputs_)
    if args.write_plan:
        plan = precast.Plan.from_result(res, source=f"precast convert {args.source}")
        write_bytes(args.write_plan, plan.to_json(res.program).encode(), inputs_)
        print(f"wrote {args.write_plan}: {len(plan.fp32)} op(s) kept in fp32", file=sys.stderr)
    if args.plan:
        applied = sum(1 for r in res.report.nodes if r.rule == "custom:plan")
        if applied < len(opts["plan"].fp32):
            print(
                f"warning: --plan {args.plan}: {len(opts['plan'].fp32) - applied} of its {len(opts['plan'].fp32)} "
                "op(s) matched no op of this program (another model, or the plan's ops are decided earlier by "
                "include/exclude rules)",
                file=sys.stderr,
            )
    if args.json:
        print(res.report.to_json())
    else:
        print(res.report.summary())
        print(f"saved {args.output} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0
