"""Policy "torch": eager ``torch.autocast`` semantics on the whole program, for one device type and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from precast.policy.base import Decision


@dataclass(frozen=True)
class TorchPolicy:
    """Behaves as if the whole forward ran under ``torch.autocast(device_type, dtype)``."""

    device_type: str
    dtype: torch.dtype
    name: str = "torch"

    def autocast_state(self, device_type: str) -> tuple[bool, torch.dtype] | None:
        return (True, self.dtype) if device_type == self.device_type else None

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        # everything goes through autocast_state; the classifier applies the autocast tables
        return None
