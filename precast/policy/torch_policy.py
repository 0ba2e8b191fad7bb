"""Policy "torch": eager ``torch.autocast`` semantics on the whole program, for one device type and dtype.

Input: device type and dtype. Output: the autocast state classify applies to every op outside regions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.fx

from precast.policy.base import Decision


@dataclass(frozen=True)
class TorchPolicy:
    """Behaves as if the whole forward ran under ``torch.autocast(device_type, dtype)``. Pass it as
    ``convert(..., policy=TorchPolicy("cuda", torch.float16))``; ``policy="torch"`` is the same with defaults."""

    device_type: str | None = None  # None: the program's device type
    dtype: torch.dtype | None = None  # None: that device's autocast dtype
    name: str = "torch"
    # hooks (precast.policy.hooks.PolicyHooks): traced under autocast on a module, verified bitwise against
    # eager autocast, no preparation, no after-lowering checks
    capture_under_autocast: ClassVar[bool] = True
    reference: ClassVar[str] = "autocast"
    prepare_steps: ClassVar[tuple[str, ...]] = ()

    def for_device(self, device_type: str, dtype: torch.dtype | None) -> TorchPolicy:
        """This policy for the program's device type and low dtype (a subclass stays its class)."""
        return replace(self, device_type=device_type, dtype=dtype)

    def autocast_state(self, device_type: str) -> tuple[bool, torch.dtype] | None:
        return (True, self.dtype) if device_type == self.device_type else None

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Decision | None:
        # everything goes through autocast_state; the classifier applies the autocast tables
        return None
