"""What the commands that convert share (convert, sensitivity, export-llm), defined once: the program source (a
saved program or a factory spec), the conversion's options record built from the flags and checked before anything
loads, ``--weight-format``'s items as ``convert``'s ``weight_format=``, and a refusal of the options record in the
words of the command line. Command modules import this module (and ``flags``), never each other.

Input: the parsed flags (``argparse.Namespace``), a source string. Output: ``ConvertOptions``, the program and its
inputs, one-line ``PrecastError``s naming the flags.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from precast.errors import PrecastError
from precast.paths import check_input_file
from precast.pipeline.load import check_program_file
from precast.pipeline.options import ConvertOptions
from precast.policy.resolve import RULE_OPTIONS


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
