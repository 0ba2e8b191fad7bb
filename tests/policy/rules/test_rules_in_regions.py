"""Rules and auto around the program's own autocast regions: the regions run as written (calibration, the device
check, the tolerance search), and a value entering an fp32 region (``enabled=False``) is cast back to fp32 at the
boundary, as the region's eager semantics require. Repros from issue 19 (programs nobody here wrote: PyTorch's and
Torch-TensorRT's own autocast tests)."""

from __future__ import annotations

import pytest
import torch

import precast
from precast.dtypes import dtype_name
from precast.metrics import row_cosine


class BF16Island(torch.nn.Module):
    """A bf16 Linear that only works inside its own bf16 region (issue 19, repro 1)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.l(x)


class FP32Head(torch.nn.Module):
    """Torch-TensorRT's nested-autocast shape: a conv body, then a head in autocast(enabled=False) (repro 2)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x).mean((2, 3))
        with torch.autocast("cpu", enabled=False):
            return self.fc(y)


class FP32Norm(torch.nn.Module):
    """A LayerNorm kept in fp32 by an enabled=False region between two Linears; the value leaving the region is
    fp32 and must stay so for the ops of the region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = self.norm(h) * 2.0
        return self.b(h)


def _eager(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("policy", ["rules", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_calibration_runs_a_region_as_written(policy, dtype):
    m, x = BF16Island().eval(), torch.randn(2, 4)
    res = precast.convert(m, (x,), policy=policy, dtype=dtype, calibration=[(x,), (torch.randn(2, 4),)])
    got, want = res.program.module()(x), _eager(m, x)
    # the region's Linear is the program's own bf16 op: it runs in bf16 as written, exactly as eager
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("policy", ["rules", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_value_entering_an_fp32_region_is_cast_back(policy, dtype):
    m, x = FP32Head().eval(), torch.randn(2, 3, 16, 16)
    res = precast.convert(m, (x,), policy=policy, dtype=dtype)
    fc = next(r for r in res.report.nodes if r.op == "aten.linear.default")
    assert fc.dtype == "fp32" and fc.source == "region", fc
    got, want = res.program.module()(x), _eager(m, x)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert row_cosine(got, want) >= 0.9999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_op_of_an_fp32_region_sees_fp32(dtype):
    m, x = FP32Norm().eval(), torch.randn(4, 16)
    res = precast.convert(m, (x,), policy="rules", dtype=dtype, calibration=[(x,)])
    ep = res.program
    region_ops = [r for r in res.report.nodes if r.source == "region"]
    assert {r.op for r in region_ops} >= {"aten.layer_norm.default", "aten.mul.Tensor"}
    assert all(r.dtype == "fp32" for r in region_ops), region_ops
    # the Linears outside the region are the rules' (low); the norm between them is not
    assert [r.dtype for r in res.report.nodes if r.op == "aten.linear.default"] == [dtype_name(dtype)] * 2
    got, want = ep.module()(x), _eager(m, x)
    assert row_cosine(got, want) >= 0.999


def test_tolerance_search_runs_regions_as_written():
    m, x = BF16Island().eval(), torch.randn(8, 4)
    res = precast.convert(m, (x,), policy="rules", dtype=torch.float16, tolerance={"cosine": 0.99999})
    assert torch.equal(res.program.module()(x), _eager(m, x))


def test_policy_none_and_torch_unchanged_by_the_boundary():
    """The boundary cast is the rules' business: under policy None the region program is bitwise itself, and
    under policy torch eager autocast itself would hand the fp32 region a low value (no cast back)."""
    m, x = FP32Head().eval(), torch.randn(2, 3, 16, 16)
    ep = torch.export.export(m, (x,))
    res = precast.convert(ep)
    assert torch.equal(res.program.module()(x), ep.module()(x))
    with pytest.raises(precast.PrecastError, match="dtype-mismatch|different dtypes"):
        precast.convert(m, (x,), policy="torch", dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
        m(x)  # eager agrees: the fp32 head receives a bf16 activation
