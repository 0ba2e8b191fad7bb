"""The vision half of the real-model tier: timm and torchvision classifiers built the way users build them
(``timm.create_model(name, pretrained=False)``, torchvision's factories with ``weights=None``), seeded random
weights, nothing downloaded.

Random initial weights are not what a trained network holds in two ways that would hide what precast must get
right, so each model is prepared before export:

- parameters a library initialises to one constant (zero-initialised heads and last-in-block norms, layer
  scales of 1e-6, norm weights of 1, zero biases) are drawn again, seeded: otherwise residual branches and
  heads contribute nothing (torchvision's ViT head is all zeros: every output would be 0);
- BatchNorm running statistics come from a few random batches in train mode (a cumulative average), so
  BatchNorm in eval mode is not the identity.

Inputs are small images (32 px where the architecture allows it, else the smallest it accepts); every model
is exported with a dynamic batch (``builders.BATCHES``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from tests.realmodels.builders import BATCHES, SEED, Built, Classifier, _randn, _wrap

CLASSES = 10
STAT_BATCHES = 3  # random batches of 4 images that set the BatchNorm running statistics


def _redraw_constant_parameters(model: nn.Module, generator: torch.Generator) -> None:
    """Draw again every parameter whose elements are all equal: a matrix as ``1/sqrt(fan_in)`` normal, a bias
    as N(0, 0.1), a 1-D scale (norm weight, layer scale) uniform in [0.5, 1.5]."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() < 2 or not bool((p == p.flatten()[0]).all()):
                continue
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            else:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)


def _batchnorm_statistics(model: nn.Module, size: int, generator: torch.Generator) -> None:
    """Running mean/var of every BatchNorm from ``STAT_BATCHES`` random batches (train mode, cumulative
    average: ``momentum=None``), then eval mode."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(STAT_BATCHES):
            model(torch.randn(4, 3, size, size, generator=generator))
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    model.eval()


def prepared(build: Callable[[], nn.Module], size: int) -> nn.Module:
    """``build()`` with seeded weights, constant parameters drawn again, BatchNorm statistics set; eval mode."""
    torch.manual_seed(SEED)
    model = build()
    generator = torch.Generator().manual_seed(SEED + 1)
    _redraw_constant_parameters(model, generator)
    _batchnorm_statistics(model, size, generator)
    return model


def _timm(name: str, size: int = 32, region: bool = False, **kwargs) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        model = prepared(
            lambda: timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs), size
        )
        images = {b: (_randn(b, 3, size, size),) for b in BATCHES}
        options = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        notes = f"timm {name}({options}), {size} px" if options else f"timm {name}, {size} px"
        return Built(name, _wrap(model, Classifier), images, region=region, notes=notes)

    return build


def _torchvision(factory: str, size: int = 32, region: bool = False, **kwargs) -> Callable[[], Built]:
    def build() -> Built:
        import torchvision

        make = getattr(torchvision.models, factory)
        model = prepared(lambda: make(weights=None, num_classes=CLASSES, **kwargs), size)
        images = {b: (_randn(b, 3, size, size),) for b in BATCHES}
        options = "".join(f", {k}={v}" for k, v in kwargs.items())
        notes = f"torchvision.models.{factory}(weights=None{options}), {size} px"
        return Built(f"tv_{factory}", _wrap(model, Classifier), images, region=region, notes=notes)

    return build


# name -> (library, builder). ``region=True``: policy None runs on the program exported with the forward inside
# one bf16 autocast region (half the models, across families). Sizes: 32 px unless the architecture needs more
# (LeViT, MobileViT, EfficientFormerV2 take 64; their attention works on the last feature maps).
VISION: dict[str, tuple[str, Callable[[], Built]]] = {
    "resnet10t": ("timm", _timm("resnet10t", region=True)),
    "efficientnet_b0": ("timm", _timm("efficientnet_b0")),
    "mobilenetv3_small_050": ("timm", _timm("mobilenetv3_small_050", region=True)),
    "regnetx_002": ("timm", _timm("regnetx_002")),
    "convnext_atto": ("timm", _timm("convnext_atto", region=True)),
    "densenet121": ("timm", _timm("densenet121")),
    "vit_tiny_patch16_224": ("timm", _timm("vit_tiny_patch16_224", region=True, img_size=32)),
    "swin_tiny_patch4_window7_224": ("timm", _timm("swin_tiny_patch4_window7_224", img_size=32)),
    "levit_128s": ("timm", _timm("levit_128s", size=64, region=True, img_size=64)),
    "mobilevit_xxs": ("timm", _timm("mobilevit_xxs", size=64)),
    "efficientformerv2_s0": ("timm", _timm("efficientformerv2_s0", size=64, region=True, img_size=64)),
    "ghostnet_050": ("timm", _timm("ghostnet_050")),
    "tv_resnet18": ("torchvision", _torchvision("resnet18", region=True)),
    "tv_mobilenet_v3_small": ("torchvision", _torchvision("mobilenet_v3_small")),
    "tv_vit_b_16": ("torchvision", _torchvision("vit_b_16", region=True, image_size=32)),
    "tv_swin_t": ("torchvision", _torchvision("swin_t")),
}
