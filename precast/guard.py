"""The ambient-autocast guard: a module built from a converted program warns once when it is called under
``torch.autocast`` (eager autocast would re-cast on top of precast's decisions).

Input: a module (``program.module()``). Output: the same module with a forward pre-hook.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


class AmbientAutocastWarning(UserWarning):
    """The converted module was called under ``torch.autocast``."""


AMBIENT_MESSAGE = (
    "precast: a converted program was called under torch.autocast({devices}); eager autocast re-casts on top of "
    "precast's decisions (ops precast kept in float32 run in low precision, weights are cast again on every "
    "call). Call it outside the autocast block [ambient-autocast]"
)


def _warn_if_ambient(module: torch.nn.Module, args: Any) -> None:
    if getattr(module, "_precast_warned_ambient", False):
        return
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if on:
        module._precast_warned_ambient = True
        warnings.warn(AMBIENT_MESSAGE.format(devices=", ".join(on)), AmbientAutocastWarning, stacklevel=3)


def guard_module(module: torch.nn.Module) -> torch.nn.Module:
    """Register the ambient-autocast warning on a module built from a converted program."""
    if not getattr(module, "_precast_guarded", False):
        module.register_forward_pre_hook(_warn_if_ambient)
        module._precast_guarded = True
    return module
