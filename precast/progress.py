"""One progress bar for long work (calibration, benchmarks): rich on stderr when it is a terminal, else silent.

Input: a total and a description. Output: progress on stderr (nothing when not a terminal).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def wanted(enabled: bool | None) -> bool:
    """None: show it on an interactive terminal outside CI."""
    if enabled is None:
        return sys.stderr.isatty() and not os.environ.get("CI")
    return enabled


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

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
