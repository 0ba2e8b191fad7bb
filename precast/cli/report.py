"""precast report FILE.pt2 [--format table|json|model-explorer] [-o OUT]

Input: a saved (converted) program. Output: the report as a table, JSON or Model Explorer node data.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from precast.cli.flags import TRUST_PICKLE, add_command, flag
from precast.errors import PrecastError
from precast.io import check_writable, write_bytes
from precast.pipeline.load import load_program

FORMATS = ("table", "json", "model-explorer")
MIN_WIDTH = 40  # narrower, rich folds every cell to a character or prints nothing


ARGUMENTS = (
    flag("program", help="a program saved with torch.export.save (converted by precast or not)"),
    flag("--format", choices=FORMATS, default="table"),
    flag("-o", "--output", default=None, help="write to this file instead of standard output"),
    flag(
        "--width", type=int, default=None, help=f"table width, at least {MIN_WIDTH} (default: the terminal's)"
    ),
    TRUST_PICKLE,
)


def add_parser(sub: Any) -> None:
    """``precast report``: the flags of ``ARGUMENTS``, run by ``run``."""
    add_command(
        sub,
        "report",
        ARGUMENTS,
        run=run,
        help="explain a converted program: every op's dtype and why, casts, weight bytes, diagnostics",
        description="Rebuild precast's report from a program saved with torch.export.save.",
    )


def run(args: argparse.Namespace) -> int:
    import precast
    from precast.report.render import render, render_table

    if args.width is not None and args.width < MIN_WIDTH:
        raise PrecastError(f"--width {args.width}: give at least {MIN_WIDTH} columns")
    if args.output:
        check_writable(args.output, (args.program,))
    ep = load_program(args.program, trust_pickle=args.trust_pickle)
    rep = precast.report(ep)
    if args.output is None and args.format == "table":
        from rich.console import Console

        render_table(rep, Console(width=args.width) if args.width else None)
        return 0
    text = render(rep, args.format, width=args.width)
    if args.output is None:
        sys.stdout.write(text + "\n")
        return 0
    write_bytes(args.output, (text + "\n").encode(), (args.program,))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
