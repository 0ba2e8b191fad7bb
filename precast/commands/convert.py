"""precast convert IN.pt2|pkg.module:factory -o OUT.pt2"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from precast.errors import PrecastError
from precast.io import atomic_path, check_writable


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
        "--policy", choices=["torch", "rules"], default=None, help="default: the program's own regions"
    )
    p.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the device's autocast dtype)")
    p.add_argument("--device-type", default=None, choices=["cpu", "cuda"])
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
    p.add_argument("--no-verify", action="store_true", help="skip the run comparing against the reference")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a summary")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="CODE",
        help="downgrade this diagnostic error to a warning (repeatable), e.g. --allow control-flow",
    )
    p.set_defaults(run=run)


def load_source(source: str):
    """(program_or_module, example_inputs) from a .pt2 path or a module:factory spec."""
    from precast.capture import load_factory, load_program

    if ":" in source and not Path(source).exists() and not source.endswith(".pt2"):
        return load_factory(source)
    return load_program(source), None


def _load_calibration(path: str) -> list:
    from precast.capture import load_saved

    p = Path(path)
    batches = load_saved(p, "--calibration", "save a list of input tuples with torch.save")
    if not isinstance(batches, (list, tuple)) or not batches:
        raise PrecastError(
            f"--calibration {p}: expected a non-empty list of input tuples, got {type(batches).__name__}"
        )
    return list(batches)


def run(args: argparse.Namespace) -> int:
    import precast

    check_writable(args.output)
    started = time.perf_counter()
    obj, inputs = load_source(args.source)
    opts = {}
    if args.exclude_nodes:
        opts["exclude_nodes"] = args.exclude_nodes
    if args.exclude_ops:
        opts["exclude_ops"] = args.exclude_ops
    for name in ("include_nodes", "include_ops", "data_max", "init_max", "max_reduction_depth"):
        value = getattr(args, name)
        if value not in (None, (), []):
            opts[name] = value
    if args.calibration:
        opts["calibration"] = _load_calibration(args.calibration)
    res = precast.convert(
        obj,
        inputs,
        policy=args.policy,
        dtype=args.dtype,
        device_type=args.device_type,
        verify=not args.no_verify,
        allow=tuple(getattr(args, "allow", ()) or ()),
        **opts,
    )
    with atomic_path(args.output) as tmp:
        try:
            torch.export.save(res.program, str(tmp))
        except Exception as exc:
            raise PrecastError(f"{args.output}: could not save the converted program: {exc}") from exc
    if args.json:
        print(res.report.to_json())
    else:
        print(res.report.summary())
        print(f"saved {args.output} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0
