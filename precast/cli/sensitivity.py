"""precast sensitivity IN.pt2|pkg.module:factory [--inputs FILE] [--dtype fp16|bf16] [--json] [--plot OUT.png]

Input: a saved program (with ``--inputs``, a tuple of tensors saved with ``torch.save``, or the example inputs
saved with it) or a factory. Output: the ranked table (or JSON), and on request a PNG, a Model Explorer overlay,
a repro folder and a plan (atomic writes). Exit 2 and one line on a user error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from precast.cli.flags import DEVICE_TYPE, DTYPE, SOURCE, add_command, flag
from precast.errors import PrecastError
from precast.io import atomic_path, check_writable
from precast.paths import check_outputs

REPRO_FILES = ("subgraph.pt2", "inputs.pt", "repro.py")  # what --repro's folder gets (explain.write_repro)


ARGUMENTS = (
    SOURCE,
    flag("--inputs", default=None, metavar="FILE.pt", help="one batch (a tuple) saved with torch.save"),
    DTYPE,
    DEVICE_TYPE,
    flag(
        "--policy",
        choices=["none", "torch", "rules", "auto"],
        default="rules",
        help="whose low-precision ops to rank: none (the program's own autocast regions), torch (eager autocast "
        "on the whole forward), rules (default), auto",
    ),
    flag("--metric", choices=["rel", "cosine", "max_abs"], default="rel"),
    flag("--exclude-nodes", nargs="*", default=(), metavar="REGEX"),
    flag("--exclude-ops", nargs="*", default=(), metavar="OP"),
    flag("--include-nodes", nargs="*", default=(), metavar="REGEX"),
    flag("--include-ops", nargs="*", default=(), metavar="OP"),
    flag("--data-max", type=float, default=None),
    flag("--init-max", type=float, default=None),
    flag("--max-reduction-depth", type=int, default=None),
    flag("--patterns", nargs="*", default=None, metavar="NAME"),
    flag(
        "--measure-points",
        type=int,
        default=1,
        choices=[0, 1, 2, 3],
        help="curve points measured on real conversions besides k=0 (default 1; each costs a conversion)",
    ),
    flag("--top", type=int, default=20, help="rows to print (default 20)"),
    flag("--ablation", action="store_true", help="also measure each op alone in low precision (slow)"),
    flag("--json", action="store_true", help="print JSON instead of the table"),
    flag("--plot", default=None, metavar="OUT.png", help="bar chart + cumulative curve (matplotlib)"),
    flag("--model-explorer", default=None, metavar="OUT.json", help="Model Explorer node-data overlay"),
    flag(
        "--repro",
        default=None,
        metavar="DIR",
        help="write the first non-finite (else the worst) op alone: subgraph.pt2, inputs.pt, repro.py",
    ),
    flag("--write-plan", default=None, metavar="OUT.json", help="a plan keeping the top --keep ops fp32"),
    flag("--keep", type=int, default=None, help="with --write-plan: how many ops (the greedy order)"),
    flag(
        "--energies",
        nargs="+",
        default=None,
        metavar="FILE.json",
        help="rank from energies saved before (--write-energies; several: merged, e.g. one per rank) instead of "
        "measuring them (docs/distributed.md)",
    ),
    flag(
        "--write-energies",
        default=None,
        metavar="OUT.json",
        help="save the energies the ranking was made from",
    ),
)


def add_parser(sub: Any) -> None:
    """``precast sensitivity``: the flags of ``ARGUMENTS``, run by ``run`` (convert's option checks see no
    calibration and no --allow)."""
    p = add_command(
        sub,
        "sensitivity",
        ARGUMENTS,
        run=run,
        help="rank the ops whose low precision costs the most accuracy; name the first non-finite op",
        description="For every op the policy runs in low precision, the output error its rounding "
        "alone causes (estimated in one forward and a few backward probes), ranked; the cumulative curve; the "
        "first non-finite op; optionally a repro, a plan, pictures. docs/sensitivity.md",
    )
    p.set_defaults(calibration=None, allow=[])


def run(args: argparse.Namespace) -> int:
    """Every option and file checked, the program and its inputs loaded, the ops ranked; the results written
    and printed."""
    import precast
    from precast.cli.common import load_source

    opts, given = _check(args)
    inputs = _read_inputs(args)
    obj, factory_inputs = load_source(args.source)
    if inputs is None:
        inputs = factory_inputs if factory_inputs is not None else getattr(obj, "example_inputs", None)
    if inputs is None:
        raise PrecastError(f"{args.source}: no inputs saved with the program; give --inputs FILE.pt")
    s = precast.sensitivity(
        obj,
        inputs,
        dtype=args.dtype,
        policy=_policy(args, opts),
        metric=args.metric,
        device_type=args.device_type,
        measure_points=args.measure_points,
        ablation=args.ablation,
        repro=args.repro,
        energies=given,
    )
    _write(args, s)
    _print(args, s)
    return 0


def _check(args: argparse.Namespace) -> tuple[dict[str, Any], list | None]:
    """Every flag and file checked before the (long) load of the program: (the rules' options, the energies
    --energies gave)."""
    from precast.cli.common import check_options, is_factory

    opts = check_options(argparse.Namespace(**{**vars(args), "policy": _convert_policy(args.policy)})).rules
    read = (None if is_factory(args.source) else args.source, args.inputs, *(args.energies or ()))
    _check_outputs(args, read)
    given = None
    if args.energies:
        from precast.numerics.energies import load_energies

        given = [load_energies(f) for f in args.energies]  # checked before the (long) load of the program
    _check_flags(args)
    return opts, given


def _check_outputs(args: argparse.Namespace, read: tuple) -> None:
    """Every file written against every file read, and writable, before anything is written."""
    outputs = {
        "--plot": args.plot,
        "--model-explorer": args.model_explorer,
        "--write-plan": args.write_plan,
        "--write-energies": args.write_energies,
    }
    if args.repro:  # the files the repro folder gets
        outputs.update({f"--repro's {n}": Path(args.repro) / n for n in REPRO_FILES})
    check_outputs(outputs, read)
    for path in (args.plot, args.model_explorer, args.write_plan, args.write_energies):
        if path:
            check_writable(path, read)


def _check_flags(args: argparse.Namespace) -> None:
    """--write-plan's --keep, --repro's folder and --plot's matplotlib, checked before the long work."""
    if args.write_plan and args.keep is None:
        raise PrecastError("--write-plan: say how many of the ranked ops to keep in fp32 with --keep K")
    if args.keep is not None and args.keep < 0:
        raise PrecastError(f"--keep {args.keep}: give a count >= 0")
    if args.repro and Path(args.repro).exists() and not Path(args.repro).is_dir():
        raise PrecastError(f"--repro {args.repro}: exists and is not a folder")
    if args.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415 - checked before the long work
        except ImportError:
            raise PrecastError("--plot needs matplotlib: pip install 'precast[bench]'") from None


def _read_inputs(args: argparse.Namespace) -> Any:
    """--inputs' batch (one tensor: a tuple of it), or None."""
    if not args.inputs:
        return None
    from precast.pipeline.load import load_saved

    inputs = load_saved(Path(args.inputs), "--inputs", "save one batch, a tuple of tensors, with torch.save")
    if not isinstance(inputs, (tuple, list, dict)):
        inputs = (inputs,)
    return inputs


def _policy(args: argparse.Namespace, opts: dict[str, Any]) -> Any:
    """--policy as ``precast.sensitivity`` takes it: a rules/auto policy with the rules' options, "torch", or
    None (the program's own regions)."""
    from precast.policy.auto import AutoPolicy
    from precast.policy.rules.policy import RulesPolicy

    if args.policy in ("rules", "auto"):
        return (AutoPolicy if args.policy == "auto" else RulesPolicy)(dtype=args.dtype, **opts)
    return None if args.policy == "none" else args.policy


def _write(args: argparse.Namespace, s: Any) -> None:
    """The files asked for: the energies, the plot, the Model Explorer overlay, the plan (atomic writes)."""
    from precast.report.sensitivity import model_explorer_sensitivity, plot_sensitivity

    est = s.estimate
    if args.write_energies:
        s.energies.save(args.write_energies)
    if args.plot:
        with atomic_path(args.plot) as tmp:
            plot_sensitivity(est, tmp, top=args.top)
    if args.model_explorer:
        with atomic_path(args.model_explorer) as tmp:
            tmp.write_text(json.dumps(model_explorer_sensitivity(est), indent=2))
    if args.write_plan:
        plan = s.plan(min(args.keep, len(est.order)))
        with atomic_path(args.write_plan) as tmp:
            tmp.write_text(plan.to_json(s.graph))


def _print(args: argparse.Namespace, s: Any) -> None:
    """The ranking on stdout (a table, or JSON), the repro's line; the files written on stderr."""
    from precast.report.sensitivity import sensitivity_text

    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
    else:
        print(sensitivity_text(s.estimate, top=args.top))
        if s.repro is not None:
            says = "reproduces" if s.repro["reproduces"] else "does NOT reproduce"
            print(
                f"repro: {s.repro['dir']} ({s.repro['node']}; {says} alone): python {s.repro['dir']}/repro.py"
            )
    for what, path in (
        ("plot", args.plot),
        ("model explorer", args.model_explorer),
        ("plan", args.write_plan),
    ):
        if path:
            print(f"wrote {what}: {path}", file=sys.stderr)


def _convert_policy(policy: str) -> str | None:
    """The policy name convert's option checks know ("none" is the program's own regions: None)."""
    return None if policy == "none" else policy
