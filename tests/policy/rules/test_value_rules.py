"""Policy "rules", the rules that measure values: max_reduction_depth, init_max, data_max, flush_to_zero,
scalar_range; each fires where it should and only there."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precast
from precast.dtypes import dtype_name
from tests.helpers import constant_casts
from tests.policy.rules.test_policy import convert, dtypes, net

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
OFF = math.inf  # turns a range rule off


def test_max_reduction_depth_linear_conv_sdpa_reductions():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = nn.Linear(64, 4)
            self.narrow = nn.Linear(4, 4)
            self.conv = nn.Conv1d(4, 4, 5, padding=2)  # depth 4*5 = 20
            self.conv_dw = nn.Conv1d(4, 4, 3, padding=1, groups=4)  # depth 1*3 = 3

        def forward(self, x):
            h = self.narrow(self.wide(x))  # (2, 4)
            c = self.conv_dw(self.conv(h.unsqueeze(-1).expand(2, 4, 6)))
            q = h.view(2, 1, 1, 4).expand(2, 1, 3, 4)
            a = F.scaled_dot_product_attention(q, q, q)  # head dim 4, keys 3
            return c.sum(-1) + a.mean((1, 2)) + x.sum(-1, keepdim=True)[:, :4]

    torch.manual_seed(0)
    mi = (Deep().eval(), (torch.randn(2, 64),))
    res = convert(mi, dtype=BF16, max_reduction_depth=16)
    d = dtypes(res)
    rec = {n.name: n for n in res.report.nodes}
    assert d["linear"] == "fp32" and rec["linear"].measured == 64 and rec["linear"].limit == 16
    assert d["linear_1"] == "bf16"
    conv = [n for n in res.report.nodes if "conv" in n.op]
    assert [c.dtype for c in conv] == ["fp32", "bf16"] and conv[0].measured == 20
    assert rec["scaled_dot_product_attention"].dtype == "bf16"
    sums = [n for n in res.report.nodes if n.op.startswith("aten.sum")]
    assert {s.measured for s in sums if s.dtype == "fp32"} == {64.0}  # x.sum over 64; c.sum over 6 is fine
    res = convert(mi, dtype=BF16, max_reduction_depth=100)
    assert "fp32" not in {n.dtype for n in res.report.nodes if n.source == "rules"}


def test_init_max_fires_and_not():
    model, inputs = net()
    with torch.no_grad():
        model.encoder[0].fc.weight[0, 0] = 1e5  # > fp16 max 65504
    res = convert((model, inputs))
    rec = res.report.node("linear")
    assert rec.dtype == "fp32" and rec.rule == "init_max" and rec.measured == pytest.approx(1e5)
    assert dtypes(res)["linear_1"] == "fp16"
    assert "fp32" not in {n.dtype for n in convert(net()).report.nodes if n.source == "rules"}


class Scaled(nn.Module):
    """A residual stream scaled past fp16's range (65504) feeding layer_norm."""

    def __init__(self, d=16, scale=3e4):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.down = nn.Linear(d, 4)
        self.scale = scale

    def forward(self, x):
        h = self.up(x) * self.scale
        h = h + h * 3.0
        return self.down(torch.relu(self.norm(h)))


def scaled():
    torch.manual_seed(0)
    return Scaled().eval(), (torch.randn(4, 16),)


def test_fp16_overflow_data_max_keeps_range_in_fp32():
    model, inputs = scaled()
    want = model(*inputs)
    naive = convert((model, inputs), dtype=FP16, data_max=OFF)
    assert not torch.isfinite(naive.module()(*inputs)).all()  # inf/NaN in plain fp16
    torch.manual_seed(1)
    cal = [(torch.randn(4, 16),) for _ in range(4)]
    res = precast.convert(model, inputs, policy="rules", dtype=FP16, calibration=cal)  # data_max 512 default
    got = res.module()(*inputs)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-2  # stated tolerance: 1e-2 absolute
    kept = {n.name for n in res.report.nodes if n.rule == "data_max"}
    assert {"mul", "mul_1", "add", "layer_norm"} <= kept
    assert res.report.node("layer_norm").measured > 65504 and res.report.node("layer_norm").limit == 512
    assert res.report.node("linear").dtype == "fp16"
    text = res.report.summary()
    assert "layer_norm (data_max: absmax" in text and "> 512" in text


def test_data_max_does_not_fire_in_range_and_uses_example_inputs_when_no_data():
    model, inputs = scaled()
    model.scale = 1.0
    res = precast.convert(model, inputs, policy="rules", dtype=FP16)
    assert "fp32" not in {n.dtype for n in res.report.nodes if n.source == "rules"}
    assert any(d.code == "ranges-from-example-inputs" for d in res.report.diagnostics)
    bf = precast.convert(*scaled(), policy="rules", dtype=BF16)  # bf16: no data_max by default
    assert not any(n.rule == "data_max" for n in bf.report.nodes)


class Faint(nn.Module):
    """A normal front end, then two Linears with weights scaled to 1e-5: outputs ~1e-9, below fp16's smallest
    subnormal (5.96e-8), as in torchvision's mobilenet_v3_small with random weights."""

    def __init__(self):
        super().__init__()
        self.front = nn.Linear(16, 16)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)
        with torch.no_grad():
            for lin in (self.a, self.b):
                lin.weight.mul_(1e-5 / lin.weight.abs().max())
                lin.bias.zero_()

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.tanh(self.front(x)))))


def faint():
    torch.manual_seed(0)
    return Faint().eval(), (torch.randn(4, 16),)


@pytest.mark.parametrize("calibrated", [False, True])
def test_flush_to_zero_keeps_faint_ops_in_fp32(calibrated):
    model, inputs = faint()
    want = model(*inputs)
    assert 0 < want.abs().max().item() < 2**-24  # every output flushes to zero in fp16
    assert not torch.nn.functional.linear(inputs[0], model.a.weight).half().eq(0).all()
    torch.manual_seed(1)
    cal = [(torch.randn(4, 16),) for _ in range(3)] if calibrated else None
    res = precast.convert(model, inputs, policy="rules", dtype=FP16, calibration=cal)
    got = res.module()(*inputs)
    assert got.abs().max().item() > 0
    got, want = got.detach().flatten().double(), want.detach().flatten().double()
    assert (got @ want / (got.norm() * want.norm())).item() > 0.99  # (F.cosine_similarity's eps is 1e-8)
    b = res.report.node("linear_2")
    assert b.dtype == "fp32" and b.rule == "flush_to_zero" and b.measured < 2**-24 and b.limit == 2**-14
    assert "flush_to_zero: absmax" in b.reason and "smallest normal fp16" in b.reason
    assert res.report.node("linear").dtype == "fp16"  # the normal front end stays low
    assert "linear_2 (flush_to_zero" in res.report.summary()
    if not calibrated:  # ranges from the example inputs, and the report says so
        assert any(d.code == "ranges-from-example-inputs" for d in res.report.diagnostics)


def test_flush_to_zero_off_for_bf16_and_warned_when_forced_low():
    model, inputs = faint()
    bf = precast.convert(model, inputs, policy="rules", dtype=BF16)  # bf16 has fp32's range
    assert not any(n.rule == "flush_to_zero" for n in bf.report.nodes)
    forced = precast.convert(model, inputs, policy="rules", dtype=FP16, include_nodes=["^linear_2$"])
    assert forced.report.node("linear_2").dtype == "fp16"
    warn = [d for d in forced.report.diagnostics if d.code == "flush-to-zero"]
    assert len(warn) == 1 and warn[0].severity == "warning" and "linear_2" in warn[0].message


def test_init_max_stays_on_for_fp16_and_include_nodes_still_converts():
    """A reader of a constant beyond fp16's range stays fp32 by default; forced to fp16 with include_nodes, the
    conversion still succeeds (the stored constant is clamped to ±65504, with a warning)."""

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("scale", torch.tensor([1e5, 2.0]))

        def forward(self, x):
            return self.fc(x) * self.scale

    torch.manual_seed(0)
    model, inputs = Big().eval(), (torch.randn(3, 2),)
    res = precast.convert(model, inputs, policy="rules", dtype=FP16)
    rec = res.report.node("mul")
    assert (rec.dtype, rec.rule, rec.measured, rec.limit) == ("fp32", "init_max", 1e5, 65504.0)
    forced = precast.convert(model, inputs, policy="rules", dtype=FP16, include_nodes=["^mul$"])
    assert forced.report.node("mul").dtype == "fp16"
    assert torch.isfinite(forced.module()(*inputs)).all()
    assert any(d.code == "fp16-clamped" for d in forced.report.diagnostics)


def test_scalar_beyond_the_low_range_keeps_the_op_fp32():
    """HF's ``masked_fill(mask, torch.finfo(s.dtype).min)`` bakes fp32's min into a plain export; in fp16 the op
    would raise "cannot be converted to type Half without overflow" (MPT, found on a sweep of transformers
    models): the rules keep it fp32 and say why."""

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8)

        def forward(self, x, mask):
            s = self.q(x) @ x.transpose(-1, -2)
            return s.masked_fill(mask, torch.finfo(s.dtype).min).softmax(-1)

    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[1, :, 3] = True
    model = Masked().eval()
    res = precast.convert(torch.export.export(model, (x, mask)), policy="rules", dtype=torch.float16)
    node = res.report.node("masked_fill")
    assert node.dtype == "fp32" and node.rule == "scalar_range"
    torch.testing.assert_close(res.module()(x, mask), model(x, mask), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_norm_keeps_its_weights_fp32_and_casts_none_at_run_time(dtype):
    """``_weight_norm`` computes its norm in fp32 for low inputs (ATen; torch 2.15's decomposition writes that
    as an upcast of ``v``): the rules keep it fp32 (``fp32_kernel``), so no stored weight is upcast on every
    call, after ``run_decompositions()`` too (wav2vec2's positional conv on torch 2.15)."""
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, padding=1), dim=2)
    x = torch.randn(2, 4, 16)
    res = precast.convert(conv.eval(), (x,), policy="rules", dtype=dtype)
    (wn,) = [r for r in res.report.nodes if r.op == "aten._weight_norm.default"]
    assert (wn.dtype, wn.rule) == ("fp32", "fp32_kernel")
    (cv,) = [r for r in res.report.nodes if r.op.startswith("aten.conv1d")]
    assert cv.dtype == dtype_name(dtype)  # the conv itself is still low
    assert constant_casts(res.program) == []
    assert constant_casts(res.program.run_decompositions()) == []
