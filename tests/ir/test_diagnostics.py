"""Each diagnostic: one test that triggers it and one that does not."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import precast
from precast.guard import AmbientAutocastWarning
from tests import models as zoo

BF16 = torch.bfloat16


def codes(res) -> set[str]:
    return {d.code for d in res.report.diagnostics}


# ---- dtype-mismatch --------------------------------------------------------------------------------------
def test_dtype_mismatch_names_output_linear_source_and_fix():
    torch.manual_seed(0)
    with pytest.raises(precast.PrecastError) as info:
        precast.convert(zoo.SeedModel(fixed=False).eval(), (torch.randn(4, 128),))
    err = info.value
    assert err.code == "dtype-mismatch"
    d = err.diagnostic
    assert d.module == "output" and d.node == err.node
    assert d.location and d.location.endswith("examples.py:49")  # `x = self.output(x)`
    assert ".float()" in d.fix and ".float()" in str(err)
    assert "(module output)" in str(err) and "--allow dtype-mismatch" in str(err)


def test_dtype_mismatch_fixed_model_converts():
    res = precast.convert(*zoo.seed_model())
    assert "dtype-mismatch" not in codes(res)
    assert res.report.verification["bitwise"]


def test_dtype_mismatch_allowed_is_a_warning():
    torch.manual_seed(0)
    model = zoo.SeedModel(fixed=False).eval()
    res = precast.convert(model, (torch.randn(4, 128),), allow=("dtype-mismatch",), verify=False)
    (d,) = [d for d in res.report.diagnostics if d.code == "dtype-mismatch"]
    assert d.severity == "warning" and d.allowed


def test_unknown_allow_code():
    with pytest.raises(precast.PrecastError, match="unknown diagnostic code"):
        precast.convert(*zoo.seed_model(), allow=("nope",))


# ---- unused-enabled-input --------------------------------------------------------------------------------
class Flag(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, flag: bool):
        with torch.autocast("cpu", dtype=BF16, enabled=flag):
            y = self.lin(x)
        return y.float()


def test_unused_enabled_input_warns_with_input_and_region():
    res = precast.convert(Flag().eval(), (torch.randn(2, 8), True))
    (d,) = [d for d in res.report.diagnostics if d.code == "unused-enabled-input"]
    assert d.severity == "warning" and d.node == "flag"
    assert "'flag'" in d.message and "autocast(cpu, bf16)" in d.message
    assert d.region == 0 and d.location and "test_diagnostics.py" in d.location


def test_unused_enabled_input_not_raised_without_flag():
    assert "unused-enabled-input" not in codes(precast.convert(*zoo.seed_model()))


# ---- noop-region -----------------------------------------------------------------------------------------
class CudaRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.float16):
            y = self.lin(x)
        return y


def test_noop_region_warns_for_cuda_region_in_cpu_program():
    res = precast.convert(CudaRegion().eval(), (torch.randn(2, 8),))
    (d,) = [d for d in res.report.diagnostics if d.code == "noop-region"]
    assert d.severity == "warning" and "does nothing" in d.message and "cuda" in d.message
    assert d.location and "test_diagnostics.py" in d.location


def test_noop_region_not_raised_for_cpu_region():
    assert "noop-region" not in codes(precast.convert(*zoo.seed_model()))


# ---- control-flow ----------------------------------------------------------------------------------------
class Cond(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        def yes(x):
            with torch.autocast("cpu", dtype=BF16):
                return self.lin(x).float()

        def no(x):
            return x * 2

        return torch.cond(x.sum() > 0, yes, no, (x,))


def test_control_flow_is_an_error_naming_the_cond():
    with pytest.raises(precast.PrecastError, match=r"node 'cond'.*torch.cond") as info:
        precast.convert(Cond().eval(), (torch.randn(2, 8),), policy="torch")
    assert info.value.code == "control-flow"


def test_control_flow_allowed_converts_the_rest():
    res = precast.convert(Cond().eval(), (torch.randn(2, 8),), policy="torch", allow=("control-flow",))
    (d,) = [d for d in res.report.diagnostics if d.code == "control-flow"]
    assert d.severity == "warning" and d.node == "cond"


def test_control_flow_not_raised_for_regions():
    assert "control-flow" not in codes(precast.convert(*zoo.nested()))


# ---- device-unsupported (bf16 LSTM on this CPU's oneDNN) -------------------------------------------------
def _lstm_runs_in_bf16() -> bool:
    model, (x,) = zoo.lstm()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            model(x)
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(_lstm_runs_in_bf16(), reason="this CPU runs the bf16 LSTM")
def test_device_unsupported_names_the_node():
    with pytest.raises(precast.PrecastError) as info:
        precast.convert(*zoo.lstm(), policy="torch")
    err = info.value
    assert err.code == "device-unsupported"
    assert err.diagnostic.module == "rnn" and "mkldnn_rnn_layer" in err.diagnostic.message
    assert err.diagnostic.location and "models.py" in err.diagnostic.location


def test_device_unsupported_not_raised_for_mlp():
    res = precast.convert(*zoo.plain_mlp(), policy="torch")
    assert "device-unsupported" not in codes(res)


# ---- ambient-autocast ------------------------------------------------------------------------------------
def test_ambient_autocast_warns_once_at_call_time():
    model, inputs = zoo.seed_model()
    res = precast.convert(model, inputs)
    for module in (res.module(), precast.guard_module(res.program.module())):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=BF16):
                module(*inputs)
                module(*inputs)
        assert [w.category for w in caught if w.category is AmbientAutocastWarning] == [
            AmbientAutocastWarning
        ]


def test_ambient_autocast_silent_without_autocast():
    model, inputs = zoo.seed_model()
    module = precast.convert(model, inputs).module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(*inputs)
    assert not [w for w in caught if w.category is AmbientAutocastWarning]


# ---- device-check-skipped: a check that could not run is never a silent success ---------------------------
def test_device_check_skipped_when_inputs_do_not_fit_the_signature():
    from precast.pipeline.checks import check_runs
    from precast.report.model import Report

    out = precast.convert(*zoo.seed_model()).program
    rep = Report()
    assert check_runs(out, (), {}, rep)  # nothing failed on the device: the comparison that follows decides
    (d,) = rep.diagnostics
    assert (d.code, d.severity) == ("device-check-skipped", "warning")
    assert "did not run" in d.message and "signature" in d.message


def test_device_check_skipped_when_the_run_fails_outside_an_op(monkeypatch):
    from precast.pipeline.checks import check_runs
    from precast.report.model import Report

    out = precast.convert(*zoo.seed_model()).program

    def broken_placeholder(self, target, args, kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.fx.Interpreter, "placeholder", broken_placeholder)
    rep = Report()
    assert check_runs(out, zoo.seed_model()[1], {}, rep)
    (d,) = rep.diagnostics
    assert d.code == "device-check-skipped" and d.node is not None
    assert f"node '{d.node}'" in d.message and d.message.endswith("boom")


def test_device_check_records_nothing_when_the_program_runs():
    from precast.pipeline.checks import check_runs
    from precast.report.model import Report

    model, inputs = zoo.seed_model()
    rep = Report()
    assert check_runs(precast.convert(model, inputs).program, inputs, {}, rep)
    assert rep.diagnostics == []


# ---- errors.first_line ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc, line",
    [
        (RuntimeError("first\nsecond"), "first"),
        (ValueError("\n\n  shape mismatch  \nmore"), "shape mismatch"),
        (AssertionError(), "AssertionError"),
        (RuntimeError("   \n"), "RuntimeError"),
        (KeyError("k"), "'k'"),
    ],
)
def test_first_line_never_raises_and_names_the_type_when_empty(exc, line):
    from precast.errors import first_line

    assert first_line(exc) == line


# ---- expected differences are information -----------------------------------------------------------------
def test_rules_difference_from_fp32_is_information_with_the_measured_error():
    res = precast.convert(*zoo.plain_mlp(), policy="rules")
    assert "not-bitwise" not in codes(res)
    (d,) = [d for d in res.report.diagnostics if d.code == "measured-error"]
    assert d.severity == "info" and "max abs error" in d.message
    assert not res.report.warnings()


def test_not_bitwise_stays_a_warning_where_bitwise_was_promised():
    from precast.codes import CODES

    assert CODES["not-bitwise"].severity == "warning"
    res = precast.convert(*zoo.plain_mlp(), policy="torch")
    assert res.report.verification["bitwise"] and "not-bitwise" not in codes(res)
