"""Ctrl-C while the ``precast`` command starts: one line and exit status 130, never a traceback.

``precast`` (the console script) and ``python -m precast`` both import the package before the command's own
``main`` runs, and that import (torch, transformers) takes seconds: an interrupt there would escape as a
KeyboardInterrupt traceback from the import machinery, with status -2. ``precast/__init__.py`` calls
``guard_startup()`` first thing: in the ``precast`` command's process only (read from ``sys.orig_argv``; a library
``import precast`` keeps Python's own behaviour), it sets a SIGINT handler that prints one line and exits 130.
Nothing is written before ``main`` runs, so there is nothing to remove. ``precast.cli.main`` calls
``end_startup()`` before it parses the command line, which puts Python's handler back: from there an interrupt is
a KeyboardInterrupt that ``main`` turns into the same line after removing the file being written.

Input: the process's command line. Output: the SIGINT handler during start-up (stdlib only: it runs before torch).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

INTERRUPTED = "precast: interrupted; nothing was written"


def is_command(argv: list[str]) -> bool:
    """Whether ``argv`` (an ``sys.orig_argv``: the interpreter first) runs the ``precast`` command: the console
    script (``.../bin/precast``, ``precast.exe`` on Windows) or ``python -m precast``."""
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # interpreter options that take the next argument
            next(args, None)
        elif arg == "-m":
            return next(args, None) == "precast"
        elif arg.startswith("-m"):
            return arg == "-mprecast"
        elif arg == "-c" or arg.startswith("-c") and not arg.startswith("--"):
            return False
        elif not arg.startswith("-"):  # the script: the first argument that is not an interpreter option
            return os.path.basename(arg) in ("precast", "precast.exe", "precast-script.py")
    return False


def _on_startup_sigint(signum: int, frame: FrameType | None) -> None:
    # os._exit: unwinding would run the import machinery's handlers and atexit hooks of half-imported libraries
    sys.stderr.write(INTERRUPTED + "\n")
    sys.stderr.flush()
    os._exit(130)


def guard_startup() -> None:
    """In the ``precast`` command's process, answer Ctrl-C during start-up with one line and status 130."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not is_command(list(getattr(sys, "orig_argv", sys.argv))):
        return
    # a parent that set SIGINT ignored (nohup, a job control shell) keeps it so
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_startup_sigint)


def end_startup() -> None:
    """Put Python's SIGINT handler back (a KeyboardInterrupt from here on), if ``guard_startup`` set its own."""
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGINT) is _on_startup_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)
