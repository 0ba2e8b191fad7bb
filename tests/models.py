"""The test model zoo: the package's built-in zoo (shared with `precast demo`/`bench`) plus test-only models."""

from __future__ import annotations

import torch
import torch.nn as nn

from precast.zoo import *  # noqa: F403  (re-export: one zoo for tests and benchmarks)
from precast.zoo import BF16, PLAIN_MODELS, REGION_MODELS, ZOO  # noqa: F401


class Decorated(nn.Module):
    """``@torch.autocast`` as a decorator on forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return torch.relu(self.lin(x))


class OtherDevice(nn.Module):
    """A CUDA autocast region in a CPU program: eager autocast does nothing to CPU tensors there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.float16):
            y = self.lin(x)
        return y


class ViewsOfWeights(nn.Module):
    """Weights reach the cast through views (t, transpose, reshape, expand)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.k = nn.Parameter(torch.randn(4, 4, 16))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w.t()
            b = x @ self.w.transpose(0, 1)  # same view, same cast: shared
            c = torch.bmm(
                x.unsqueeze(0).expand(4, -1, -1), self.k.reshape(4, 16, 4) @ self.k.reshape(4, 4, 16)
            )
        return a.float() + b.float() + c.float().sum(0)


class Einsum(nn.Module):
    """einsum is a composite with no autocast kernel: eager decomposes it under autocast and casts its bmm."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))

    def forward(self, x):
        return torch.einsum("bi,ij->bj", x, self.w)


def decorated():
    torch.manual_seed(0)
    return Decorated().eval(), (torch.randn(4, 16),)


def other_device():
    torch.manual_seed(0)
    return OtherDevice().eval(), (torch.randn(4, 16),)


def views_of_weights():
    torch.manual_seed(0)
    return ViewsOfWeights().eval(), (torch.randn(4, 16),)


def einsum():
    torch.manual_seed(0)
    return Einsum().eval(), (torch.randn(3, 8),)
