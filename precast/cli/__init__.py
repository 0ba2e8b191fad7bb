"""The ``precast`` command line: convert, report, check, sensitivity, compile, generate, export-llm, bench, demo.

Each subcommand lives in ``precast/cli/<name>.py`` (``export-llm``: ``export_llm.py``) with
``add_parser(subparsers)`` and ``run(args) -> int``; what several commands share is in ``flags.py`` and
``common.py`` (a command module never imports another: ``tests/arch/test_cli_commands.py``).
User errors (PrecastError, bad options, an OSError such as a full disk or a read-only destination) print one
line and exit with status 2, no traceback; Ctrl-C exits 130 and SIGTERM 143, after the file being written is
removed (writes go to a temporary file renamed into place). Commands check every option they can before loading
a program or importing a factory (a load can take many seconds).

Input: argv. Output: an exit status (2 and one line on user error, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from precast.errors import PrecastError
from precast.interrupts import INTERRUPTED, end_startup
from precast.progress import quiet_libraries, verbose

COMMANDS = ("convert", "report", "check", "sensitivity", "compile", "generate", "export-llm", "bench", "demo")


class Parser(argparse.ArgumentParser):
    """argparse with precast's error contract: a bad option is one line on stderr and exit status 2 (argparse
    prints the usage block first; ``precast CMD --help`` still shows it). Subcommand parsers inherit it."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="precast", description="Ahead-of-time mixed precision for torch.export programs.")
    parser.add_argument("--version", action="version", version=f"precast {_version()}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the warnings and log lines of the libraries precast drives (torch, transformers, torchao), "
        "held back by default; PRECAST_VERBOSE=1 does the same",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module_name = f"precast.cli.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(sub)
    return parser


def _version() -> str:
    from precast.version import __version__

    return __version__


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every ``atomic_path`` removes its temporary file on the way out."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    end_startup()  # from here Ctrl-C is a KeyboardInterrupt: the file being written is removed on the way out
    try:  # importing the command modules (torch, transformers) takes seconds: Ctrl-C there is one line too
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        # torch's own UserWarnings and torchao's load failures drown the output; --verbose shows them
        with quiet_libraries(show=args.verbose or verbose()):
            return int(args.run(args) or 0)
    except PrecastError as err:
        print(f"precast {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, read-only destination, a file vanished: the system's own words
        where = f"{err.filename}: " if err.filename else ""
        print(f"precast {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"precast {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print(f"precast {args.command}: terminated; nothing was written", file=sys.stderr)
        return 143
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
