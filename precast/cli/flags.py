"""Flags as data, and the flags more than one ``precast`` command takes, defined once.

A command's parser is a table: ``Flag`` records (the names and ``add_argument``'s keywords, in the order the
usage line shows them), each optionally in a ``Group`` (a titled help section, or mutually exclusive flags);
``add_command`` adds the subcommand and its table in one call.

Input: an argparse parser (or the subparsers action) and a table of flags. Output: the parser with the flags
added.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class Group:
    """A group of flags: a titled help section, or flags of which at most (``required``: exactly) one is given.
    Compared by identity: two groups with the same title are two sections."""

    title: str | None = None
    exclusive: bool = False
    required: bool = False


@dataclass(frozen=True)
class Flag:
    """One ``add_argument`` call: the names (``"source"``, or ``"-o", "--output"``), its keywords, its group."""

    names: tuple[str, ...]
    kw: Mapping[str, Any] = field(default_factory=dict)
    group: Group | None = None


def flag(*names: str, group: Group | None = None, **kw: Any) -> Flag:
    """A table row: ``flag("--top", type=int, default=20, help=...)`` as ``add_argument`` takes it."""
    return Flag(names, kw, group)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add the table's flags in order; each group is made where its first flag comes."""
    made: dict[int, Any] = {}
    for f in flags:
        target: Any = parser
        if f.group is not None:
            if id(f.group) not in made:
                made[id(f.group)] = _make_group(parser, f.group)
            target = made[id(f.group)]
        target.add_argument(*f.names, **f.kw)


def _make_group(parser: argparse.ArgumentParser, group: Group) -> Any:
    """The argparse group a ``Group`` stands for."""
    if group.exclusive:
        return parser.add_mutually_exclusive_group(required=group.required)
    return parser.add_argument_group(group.title)


def add_command(
    sub: Any, name: str, flags: Iterable[Flag], *, run: Any, **parser_kw: Any
) -> argparse.ArgumentParser:
    """The subcommand ``name`` (``parser_kw``: ``help``, ``description``, ...), its flags, and ``run`` as the
    function ``main`` calls. Pass the module's ``run`` when ``add_parser`` runs (tests replace it before)."""
    parser = sub.add_parser(name, **parser_kw)
    add_flags(parser, flags)
    parser.set_defaults(run=run)
    return parser


# --trust-pickle: load a .pt2 that needs a full unpickle (precast/pipeline/archive.py)
TRUST_PICKLE = flag(
    "--trust-pickle",
    action="store_true",
    help="load a .pt2 whose sample inputs or constants need a full unpickle (it can run code: trusted files only)",
)


# where compiled AOTInductor packages are cached (compile, generate)
def _threads(text: str) -> int:
    """An argparse type: a positive thread count in ASCII digits."""
    import argparse

    if not text.strip().isascii() or not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid thread count: {text!r} (a positive integer)")
    return int(text)


THREADS = flag(
    "--threads",
    type=_threads,
    default=None,
    metavar="N",
    help="intra-op threads the engine runs at (default: the physical cores this process may use, less those "
    "other processes keep busy now: precast.runtime.threads; $OMP_NUM_THREADS when set)",
)
CACHE_DIR = flag(
    "--cache-dir", default=None, help="aoti only; default: $PRECAST_CACHE_DIR or the user cache dir"
)
# a program file or a factory spec, and the low dtype and device the conversion assumes (convert, sensitivity)
SOURCE = flag("source", help="a program saved with torch.export.save, or 'package.module:factory'")
DTYPE = flag("--dtype", default=None, help="bf16 or fp16 (default: the device's autocast dtype)")
DEVICE_TYPE = flag("--device-type", default=None, choices=["cpu", "cuda"])

ALLOW_HELP = "downgrade this diagnostic error to a warning"


def allow(more: str = "") -> Flag:
    """``--allow CODE`` (repeatable), its help ``ALLOW_HELP`` followed by ``more``."""
    return flag("--allow", action="append", default=[], metavar="CODE", help=ALLOW_HELP + more)
