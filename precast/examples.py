"""The demo model: the forum question's model (shared/seeds/000), corrected so that it runs.

Used by ``precast demo`` and as ``precast.examples:seed_model`` wherever a model spec is taken (``precast
convert precast.examples:seed_model``, ``precast bench --model precast.examples:seed_model``).
Input: nothing (seeded random weights). Output: ``seed_model()`` -> ``(model in eval mode on CPU, (x,))`` with
``x`` a (4, 128) fp32 tensor. The benchmark models are ``precast/bench/models.py``; the test models
``tests/models.py`` (a source checkout).
"""

from __future__ import annotations

import torch
import torch.nn as nn

BF16 = torch.bfloat16


class SeedSubModule(nn.Module):
    """Two linears and a relu in one ``torch.autocast`` region; ``autocast=False`` turns the region off."""

    def __init__(self, device_type: str = "cpu", dtype: torch.dtype = BF16, autocast: bool = True):
        super().__init__()
        self.linear1 = nn.Linear(128, 256)
        self.linear2 = nn.Linear(256, 128)
        self.device_type, self.dtype, self.autocast = device_type, dtype, autocast

    def forward(self, x):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=self.autocast):
            x = self.linear1(x)
            x = torch.relu(x)
            x = self.linear2(x)
        return x


class SeedModel(nn.Module):
    """As posted (``fixed=False``), ``output`` receives low-precision activations with fp32 weights and fails
    at run time; ``fixed=True`` leaves the region in fp32 first."""

    def __init__(self, fixed: bool = True, device_type: str = "cpu", dtype: torch.dtype = BF16):
        super().__init__()
        self.sub = SeedSubModule(device_type, dtype)
        self.output = nn.Linear(128, 10)
        self.fixed = fixed

    def forward(self, x):
        x = self.sub(x)
        if self.fixed:
            x = x.float()  # the fix: leave the region in fp32
        x = self.output(x)
        return x


def seed_model(fixed: bool = True) -> tuple[SeedModel, tuple[torch.Tensor]]:
    """The (corrected) seed model with seeded weights, in eval mode, and its example input."""
    torch.manual_seed(0)
    return SeedModel(fixed).eval(), (torch.randn(4, 128),)
