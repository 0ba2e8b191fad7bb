"""Device-aware fallback (policies rules and auto): an op with no low-precision kernel on the device stays fp32,
with a ``no-low-precision-kernel`` diagnostic naming it; policy "torch" keeps eager semantics and its error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import precast
from tests import models as zoo

BF16, FP16 = torch.bfloat16, torch.float16


# an op with a float32 kernel only, on every machine: the deterministic stand-in for a missing kernel
@torch.library.custom_op("precast_test::fp32_only", mutates_args=())
def fp32_only(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise RuntimeError(f"fp32_only: no {x.dtype} kernel")
    return torch.tanh(x) * 2


@fp32_only.register_fake
def _(x):
    return torch.empty_like(x)


class WithFp32Only(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(fp32_only(self.a(x)))


def _inputs():
    return (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)


def _no_kernel(res):
    return [d for d in res.report.diagnostics if d.code == "no-low-precision-kernel"]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_rules_keeps_op_without_low_kernel_fp32(dtype):
    model, inputs = WithFp32Only().eval(), _inputs()
    res = precast.convert(model, inputs, policy="rules", dtype=dtype)
    (d,) = _no_kernel(res)
    assert d.node == "fp32_only" and d.severity == "warning"
    assert "fp32_only" in d.message and "kept in float32" in d.message
    rec = res.report.node("fp32_only")
    assert rec.dtype == "fp32" and rec.rule == "no_low_kernel"
    assert res.report.node("linear").dtype == res.report.dtype  # the rest stays low
    with torch.no_grad():
        got, want = res.program.module()(*inputs), model(*inputs)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_torch_policy_keeps_eager_error():
    class Region(WithFp32Only):
        def forward(self, x):
            with torch.autocast("cpu", dtype=BF16):
                return super().forward(x)

    with pytest.raises(precast.PrecastError) as info:
        precast.convert(Region().eval(), _inputs())  # the program's own region: eager semantics
    assert info.value.code == "device-unsupported"
    with pytest.raises(precast.PrecastError) as info:
        precast.convert(WithFp32Only().eval(), _inputs(), policy="torch")
    assert info.value.code == "device-unsupported"


def test_include_nodes_is_not_overridden():
    with pytest.raises(precast.PrecastError) as info:
        precast.convert(WithFp32Only().eval(), _inputs(), policy="rules", include_nodes=("fp32_only",))
    assert info.value.code == "device-unsupported"


# ---- the oneDNN LSTM layer (the real case: no low-precision primitive on CPUs without native support) -----
class OneDnnLSTM(nn.Module):
    """An LSTM layer through ``aten.mkldnn_rnn_layer``, as eager autocast decomposes ``nn.LSTM`` on CPU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w_ih, self.w_hh = (
            nn.Parameter(torch.randn(96, 16) * 0.2),
            nn.Parameter(torch.randn(96, 24) * 0.2),
        )
        self.b_ih, self.b_hh = nn.Parameter(torch.randn(96) * 0.1), nn.Parameter(torch.randn(96) * 0.1)
        self.head = nn.Linear(24, 4)

    def forward(self, x):  # x: (time, batch, 16)
        h0 = x.new_zeros(x.shape[1], 24)
        y, *_ = torch.ops.aten.mkldnn_rnn_layer(
            x,
            self.w_ih,
            self.w_hh,
            self.b_ih,
            self.b_hh,
            h0,
            h0,
            False,
            [],
            2,
            24,
            1,
            True,
            False,
            False,
            False,
        )
        return self.head(y[-1])


def _lstm_fails(dtype) -> bool:
    model, x = OneDnnLSTM().eval(), torch.randn(5, 2, 16)
    try:
        with torch.no_grad():
            model.to(dtype)(x.to(dtype))
    except RuntimeError:
        return True
    return False


LSTM_FAILS = [d for d in (BF16, FP16) if _lstm_fails(d)]


@pytest.mark.skipif(not LSTM_FAILS, reason="this CPU runs the oneDNN LSTM layer in bf16 and fp16")
def test_rules_keeps_onednn_lstm_fp32():
    dtype = LSTM_FAILS[0]
    model, x = OneDnnLSTM().eval(), torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))
    res = precast.convert(model, (x,), policy="rules", dtype=dtype)
    (d,) = _no_kernel(res)
    assert d.node == "mkldnn_rnn_layer" and "mkldnn_rnn_layer" in d.message
    assert res.report.node("mkldnn_rnn_layer").dtype == "fp32"
    with torch.no_grad():
        torch.testing.assert_close(res.program.module()(x), model(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("factory", [zoo.lstm, zoo.gru])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_rules_recurrent_models_run(factory, dtype):
    """nn.LSTM / nn.GRU under rules: ``aten.lstm``/``aten.gru`` have a low-precision kernel everywhere (the
    native one when oneDNN has none), so they run low, with no fallback, close to fp32."""
    model, inputs = factory()
    res = precast.convert(model, inputs, policy="rules", dtype=dtype)
    assert not _no_kernel(res)
    with torch.no_grad():
        torch.testing.assert_close(res.program.module()(*inputs), model(*inputs), atol=0.02, rtol=0.05)


def test_device_check_returns_the_failing_op_as_data():
    """The device fallback reads (node, exception, device, dtypes), not a message it would have to split."""
    from precast.ir.diagnostics import DiagnosticLog
    from precast.pipeline.checks import run_on_device

    class LowInput(nn.Module):
        def forward(self, x):
            return fp32_only(x.to(BF16))

    ep = torch.export.export(LowInput(), _inputs())
    log = DiagnosticLog()
    run = run_on_device(ep, _inputs(), {}, log)
    f = run.failure
    assert not run.ok and run.outputs is None
    assert f.node.name == "fp32_only" and f.device == "cpu" and isinstance(f.error, RuntimeError)
    assert f.dtypes == ("bfloat16",) and str(f.error).startswith("fp32_only: no torch.bfloat16 kernel")
    (d,) = log.diagnostics
    assert d.code == "device-unsupported" and d.node == "fp32_only" and d.message.endswith(f.what)
