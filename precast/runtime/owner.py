"""Who holds a stateful model (a KV cache carried from call to call): a generation holds it for its whole length,
and a version counts every change of its state.

A model that writes state between calls (``precast.compile``'s AOTInductor and OpenVINO models, the program run by
``precast.generate``) has one cache: two generations interleaving on it would each read the other's tokens. Every
call, ``reset()`` and ``load_weights`` takes the model's ``StateOwner`` lock (``@holds_state``) and bumps its
``version``; ``precast.generate`` holds the lock for a whole generation, so calls from other threads wait for it to
end, and records the version it left, so ``continue_from=`` can tell that something else ran since. A call from
inside a generation's own streamer (the same thread) would corrupt it: refused in one line.

Input: a model with ``_owner``. Output: calls serialized; a version; one-line PrecastErrors for misuse.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from precast.errors import PrecastError

F = TypeVar("F", bound=Callable[..., Any])


class StateOwner:
    """The lock a generation holds on one model, and the version of the model's state (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.version = 0  # bumped by every call, reset() and load_weights
        self._generating = False  # a generation holds the lock (only its own thread can see True)
        self._streaming = False  # that generation's streamer is running: the model must not be used from it

    @contextmanager
    def generation(self, what: str) -> Iterator[None]:
        """Held for a whole generation: other threads' generations, calls and resets wait until it ends."""
        with self._lock:
            if self._generating:
                raise PrecastError(
                    f"{what}: called from inside a generation on the same model (its streamer); a model holds one "
                    "cache: generate after that generation returns"
                )
            self._generating = True
            try:
                yield
            finally:
                self._generating = False

    def streaming(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        """``callback`` (a generation's streamer), run with the model refused to it: a call or reset() from the
        streamer would write the cache the generation is filling."""

        def run(*args: Any) -> Any:
            self._streaming = True
            try:
                return callback(*args)
            finally:
                self._streaming = False

        return run

    def enter(self, what: str) -> None:
        """Before a call, reset() or load_weights (the lock held): refused from a running generation's streamer;
        else the state's version moves on."""
        if self._streaming:
            raise PrecastError(
                f"{what}: called from the streamer of a generation running on this model; the generation holds "
                "its cache until it returns: use the model after precast.generate returns"
            )
        self.version += 1


def holds_state(method: F) -> F:
    """A method of a stateful model (``self._owner``: a ``StateOwner``) that uses or changes its state: it waits
    for a generation holding the model in another thread, and bumps the state's version."""
    what = "call" if method.__name__ == "__call__" else method.__name__ + "()"

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        with owner._lock:
            owner.enter(f"{type(self).__name__} {what}")
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def owner_of(model: Any) -> StateOwner | None:
    """The model's ``StateOwner``, or None for a model of another library (nothing serializes its calls)."""
    owner = getattr(model, "_owner", None)
    return owner if isinstance(owner, StateOwner) else None
