"""Running stages: one function runs every stage of the pipeline, checks the graph a rewriting stage leaves,
and tells an observer (the conversion-cost benchmark) how long each took.

Input: a ``Program`` and a stage function ``fn(program, *args) -> stats``. Output: the stage's stats. A stage
that rewrites the graph (``check=True``) must leave it linting and fake-propagating, or the conversion stops
with a ``PrecastError`` naming the stage ("internal error in pass fold_constant_casts: ..."), never a raw
exception.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, TypeVar

from precast.errors import PrecastError, first_line
from precast.ir.fake import fake_state
from precast.ir.fake_update import check_pass
from precast.ir.program import Program

StageObserver = Callable[[str], ContextManager[object]]
T = TypeVar("T")
_OBSERVER: contextvars.ContextVar[StageObserver | None] = contextvars.ContextVar(
    "precast_stage_observer", default=None
)


@contextlib.contextmanager
def observe(observer: StageObserver) -> Iterator[None]:
    """Within the block, every stage of every conversion runs inside ``observer(stage_name)`` (a context
    manager): how ``precast bench --convert`` times the real conversion stage by stage, with no copy of the
    pipeline. Scoped to the current thread/task (a context variable), nested blocks replace the outer one."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def timed(name: str) -> ContextManager[object]:
    """The observer's context for ``name`` (a no-op without one): for work a driver does between stages."""
    observer = _OBSERVER.get()
    return observer(name) if observer is not None else contextlib.nullcontext()


def run_stage(program: Program | None, name: str, fn: Callable[..., T], *args: Any, check: bool = False) -> T:
    """Run ``fn(program, *args)``; with ``check``, then check the graph it leaves (lint + incremental fake
    propagation) and turn an internal failure into a ``PrecastError`` naming the stage."""
    with timed(name):
        if not check:
            return fn(program, *args)
        fake_state(
            program
        )  # the fake values the check after the pass compares against (made once per program)
        try:
            result = fn(program, *args)
        except PrecastError:
            raise
        except Exception as exc:
            raise PrecastError(
                f"internal error in pass {name}: {type(exc).__name__}: {first_line(exc)} "
                "(please report it with the program that triggers it)",
                code="internal-error",
            ) from exc
    with timed("check_pass"):
        check_pass(program, name)
    return result
