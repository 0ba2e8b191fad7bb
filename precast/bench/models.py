"""The benchmark models: what ``precast bench --model NAME`` runs (``NAME`` is short for
``precast.bench.models:NAME``).

Each factory takes ``batch`` (and model-specific sizes) and returns ``(model in eval mode on CPU,
example_inputs)`` with seeded random weights (a model with real weights, such as all-MiniLM-L6-v2, is the source checkout's,
given as ``module:factory``). Every model writes its low-precision work inside ``torch.autocast`` regions that follow the bench's *autocast switch*: each
module that opens a region has the attributes ``autocast`` (bool: ``False`` runs the body without the region),
``device_type`` and ``dtype`` (what the region uses). ``precast bench`` sets them on the model it built to get
the fp32 reference (``eager_fp32``: regions off) and to retarget the regions for ``--device``/``--dtype``,
without patching ``torch.autocast``. ``NAMES``: the short names, in the order ``--help`` lists them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from precast.examples import seed_model

BF16 = torch.bfloat16


def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)


class Switchable(nn.Module):
    """A module with one switchable autocast region (the bench's autocast switch; see the module docstring)."""

    def __init__(self, autocast: bool = True, device_type: str = "cpu", dtype: torch.dtype = BF16):
        super().__init__()
        self.autocast, self.device_type, self.dtype = autocast, device_type, dtype

    def region(self) -> contextlib.AbstractContextManager:
        """``torch.autocast(device_type, dtype)``, or no region at all when ``autocast`` is False."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


# ---- MLP: 4x Linear(1024, 1024) + head, all under one autocast region -------------------------------------
class MLP(Switchable):
    def __init__(self, width: int = 1024, depth: int = 4, out: int = 10, autocast: bool = True):
        super().__init__(autocast)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x):
        if not self.autocast:
            return self._body(x)
        with self.region():
            x = self._body(x)
        return x.float()

    def _body(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def mlp(batch: int = 1, width: int = 1024) -> tuple[MLP, tuple[torch.Tensor]]:
    _seed()
    return MLP(width).eval(), (torch.randn(batch, width),)


# ---- CNN with conv / batchnorm / pool ---------------------------------------------------------------------
class CNN(Switchable):
    def __init__(self, autocast: bool = True):
        super().__init__(autocast)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        with self.region():
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = F.relu(self.bn2(self.conv2(x)))
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
            x = self.fc(x)
        return x.float()


def cnn(batch: int = 2) -> tuple[CNN, tuple[torch.Tensor]]:
    _seed()
    m = CNN().eval()
    for bn in (m.bn1, m.bn2):  # non-trivial running statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m, (torch.randn(batch, 3, 16, 16),)


# ---- transformer encoder layer with attention -------------------------------------------------------------
class Encoder(Switchable):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 1, autocast: bool = True):
        super().__init__(autocast)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )

    def forward(self, x):
        with self.region():
            for layer in self.layers:
                x = layer(x)
        return x.float()


def encoder(batch: int = 2, seq: int = 8) -> tuple[Encoder, tuple[torch.Tensor]]:
    _seed()
    return Encoder().eval(), (torch.randn(batch, seq, 64),)


# ---- any model inside one region ----------------------------------------------------------------------------
class AutocastRegion(Switchable):
    """A model written without autocast, run inside one ``torch.autocast`` region (floating outputs back to
    fp32): the seed's situation for any model."""

    def __init__(
        self, model: nn.Module, device_type: str = "cpu", dtype: torch.dtype = BF16, autocast: bool = True
    ):
        super().__init__(autocast, device_type, dtype)
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.region():
            out = self.model(*args, **kwargs)
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out
        )


def seed(batch: int = 4) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The demo model (``precast.examples.seed_model``) at ``batch`` rows."""
    model, (x,) = seed_model()
    if batch != x.shape[0]:
        x = torch.randn(batch, x.shape[1], generator=torch.Generator().manual_seed(0))
    return model, (x,)


NAMES = ("seed", "mlp", "cnn", "encoder")
