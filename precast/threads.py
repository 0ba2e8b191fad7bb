"""What makes precast safe to call from several threads: one lock around torch's non-thread-safe parts, and
logger silencing by filters (never a global level change another thread could observe or leave behind).

torch.export's tracing keeps process-global state (non-strict export's ``CURRENT_PATCHER``, the
deserializer's ``_CURRENT_DESERIALIZER``, AOTInductor's compile context): two threads inside it at once fail.
precast holds ``TORCH_LOCK`` around ``torch.export.export``, ``run_decompositions``, ``torch.export.load`` /
``save``, AOTInductor compile and load, and a whole ``convert`` (on torch 2.15 an export in one thread picked up
another thread's fake tensors as constants while that thread's conversion propagated fake values): conversions
in several threads are safe and run one at a time. ``TORCH_LOCK`` is reentrant, so nested precast calls in one thread do not deadlock.

Input: a logger name and level. Output: context managers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

TORCH_LOCK = threading.RLock()


class _Below(logging.Filter):
    """Drops records under ``level`` (only while installed; other records pass untouched)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Drop ``name``'s records below ``level`` for the duration (its level and handlers are left alone).

    A filter on a logger applies to records logged on that logger itself; torch logs on the module's own logger,
    so name the exact logger (``torch.export._trace``, not ``torch.export``) or its children are unaffected --
    ``quiet_loggers`` takes several.
    """
    logger = logging.getLogger(name)
    f = _Below(level)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...], level: int = logging.ERROR) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(quiet_logger(name, level))
        yield
