"""The real-model tier on OpenVINO: BERT, all-MiniLM-L6-v2 (real weights), ViT and a CNN (transformers' ResNet; the
timm/torchvision CNNs where those import), converted with policy "torch" (bf16) and compiled with
``precast.compile(program, backend="openvino")``: outputs against the converted program at two batch sizes (the
program's batch is dynamic), and every executed layer runs the dtype precast decided.

Tolerance (see tests/backends/openvino/test_model.py): 4 bf16 ulps at the output's largest magnitude, and a cosine of at
least 0.9999 against the converted program (measured: <= 1.7 ulps, cosine >= 0.99993).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import precast  # noqa: E402
from precast.backends.openvino.plan_check import PlanOverrideWarning  # noqa: E402
from precast.metrics import flat_error  # noqa: E402
from tests.helpers import openvino_emulated_only, openvino_native_bf16  # noqa: E402
from tests.realmodels.builders import BATCHES  # noqa: E402

BF16 = torch.bfloat16


def resnet_hf():
    """transformers' ResNet from a small config (seeded weights, batch-norm statistics away from 0/1), each batch
    norm fused into its convolution in fp32 first, the route the batch-norm warning gives (OpenVINO would round
    the fp32 statistics of a batch norm with a bf16 input)."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    net = ResNetModel(
        ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    for m in net.eval().modules():
        if isinstance(getattr(m, "normalization", None), torch.nn.BatchNorm2d):
            m.convolution, m.normalization = (
                fuse_conv_bn_eval(m.convolution, m.normalization),
                torch.nn.Identity(),
            )

    class Pooled(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).pooler_output

    g = torch.Generator().manual_seed(2)
    return Pooled(net.eval()).eval(), {b: (torch.randn(b, 3, 32, 32, generator=g),) for b in BATCHES}


def check(res, inputs_by_batch) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = precast.compile(res.program, backend="openvino")
    overrides = [w for w in caught if issubclass(w.category, PlanOverrideWarning)]
    plan = compiled.plan
    native = openvino_native_bf16()
    if (
        not native
    ):  # no bf16 kernels here (plain AVX2): one line for the bf16 layers OpenVINO computes in fp32
        emulated = [w for w in overrides if "computes in fp32" in str(w.message)]
        assert len(emulated) == (1 if plan.overridden else 0), [str(w.message) for w in overrides]
        overrides = [w for w in overrides if w not in emulated]
    # batch norms with fp32 statistics (timm/torchvision CNNs, not fused here) are named, never a layer override
    assert all("batch norm" in str(w.message) for w in overrides)
    assert plan.checked > 0 and openvino_emulated_only(plan), plan.summary()
    assert set(plan.by_runtime) <= {"bf16", "fp32"} and ("bf16" in plan.by_runtime) == native
    module = res.program.module()
    for batch in BATCHES:
        x = inputs_by_batch[batch]
        got, want = compiled(*x), module(*x)
        assert got.dtype == want.dtype and got.shape == want.shape
        err, cos = flat_error(got, want)
        if overrides or not native:
            # OpenVINO folds the named batch norms' fp32 statistics into bf16 convolution weights (rounded once
            # more than precast's program), so the outputs differ by more than a few ulps; still close
            # (torchvision's ResNet-18, 10 logits: cosine 0.99755 measured on torch 2.15 / OpenVINO 2026.4.1); without
            # native bf16, OpenVINO computes the bf16 layers in fp32 from the bf16 values (no rounding between)
            assert cos >= 0.99, cos
        else:
            assert err <= 4 * torch.finfo(BF16).eps * want.abs().max().item() + 1e-5, err
            assert cos >= 0.9999, cos


@pytest.mark.parametrize("name", ["bert", "minilm_hf", "vit", "convnext_atto", "tv_resnet18"])
def test_openvino_runs_the_converted_program(zoo, name):
    model = zoo.model(name)
    res = zoo.convert(name, "torch-bf16").result
    check(res, model.built.inputs)


def test_openvino_transformers_resnet():
    from torch.export import Dim

    module, inputs = resnet_hf()
    batch = Dim("batch", min=1, max=64)
    res = precast.convert(
        module, inputs[BATCHES[0]], policy="torch", dtype=BF16, dynamic_shapes=({0: batch},)
    )
    check(res, inputs)
