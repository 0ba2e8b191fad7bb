"""One progress bar for long work (calibration, benchmarks): rich on stderr when it is a terminal, else silent;
and the quiet default: what the libraries precast drives print and a user cannot act on, held back
(``quiet_libraries``; ``loggers_held_back`` for named loggers; ``PRECAST_VERBOSE=1`` (``verbose()``) or
``precast --verbose`` shows it).

Input: a total and a description. Output: progress on stderr (nothing when not a terminal).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# loggers of libraries precast imports whose records a user cannot act on: torchao's "Failed to load
# torchao/_C_*.so" (its CUDA and mxfp8 kernels, on any CPU build; transformers imports torchao) and torch's pytree
# notes on torchao's enums ("register_constant() on Enum subclasses is deprecated")
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def verbose() -> bool:
    """``PRECAST_VERBOSE`` set (non-empty): show everything the libraries print."""
    return bool(os.environ.get("PRECAST_VERBOSE"))


@contextlib.contextmanager
def quiet_libraries(show: bool | None = None) -> Iterator[None]:
    """For the block: Python warnings not raised from precast's own modules ignored, and ``NOISY_LOGGERS``'
    records below ERROR held back; both restored after. ``show`` (default: ``verbose()``) shows everything.
    precast's own output (reports, diagnostics, errors, warnings raised from ``precast.*``) is never held back."""
    if verbose() if show is None else show:
        yield
        return
    with warnings.catch_warnings(), loggers_held_back(NOISY_LOGGERS):
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", module=r"precast(\.|$)")
        yield


@contextlib.contextmanager
def loggers_held_back(names: tuple[str, ...], level: int = logging.ERROR) -> Iterator[None]:
    """The loggers ``names`` (and their children that set no level of their own) at ``level`` for the block:
    their records below it held back; each logger's own level restored after. The process's other loggers
    untouched."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, before in zip(loggers, levels, strict=True):
            lg.setLevel(before)


def wanted(enabled: bool | None) -> bool:
    """None: show it on an interactive terminal outside CI."""
    if enabled is None:
        return sys.stderr.isatty() and not os.environ.get("CI")
    return enabled


def time_left(seconds: float) -> str:
    """``seconds`` as a person reads a wait: "8 s", "1 min 5 s", "2 h 3 min"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class ProgressBar:
    """``with ProgressBar(text, total) as bar: ... bar.advance(); bar.describe("...")``"""

    def __init__(self, text: str, total: int | None, enabled: bool | None = None):
        self.text, self.total, self.enabled = text, total, wanted(enabled)
        self._bar: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.text, total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def counter(self, text: str, unit: str) -> Callable[[int, int], None]:
        """A part of the current step counted in ``unit``: each call ``(done, total)`` describes the bar as
        "TEXT: done/total UNIT, about 1 min 5 s left", the time left from the rate since the first call."""
        started: list[float] = []

        def count(done: int, total: int) -> None:
            now = time.perf_counter()
            started[:] = started or [now]
            line = f"{text}: {done}/{total} {unit}"
            if 0 < done < total:
                line += f", about {time_left((now - started[0]) / done * (total - done))} left"
            self.describe(line)

        return count

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
