"""Convolution weights in ``weight_format=`` (issue 50): int8 / int8-asym per output channel, the weight [O, I, kh, kw]
quantized as its matrix [O, I*kh*kw] and dequantized in the graph as a linear's weight, viewed back to the conv's
shape (``precast.quant.forms.write_conv_weight``). Before, ``weight_format="int8"`` on a CNN stored no conv weight
and said nothing, even with a rule naming one.

References (exact where the semantics are): the converted program's eager output is bitwise the model whose conv
weights are replaced by ``dequantize(quantize(w.reshape(O, -1))).reshape(w.shape)`` (policy None: in fp32; policy
torch: under eager autocast, the weight a bf16 value); every stored part is recomputed bitwise from the original
weight by its tag (``load_weights``, the streamed writer). No engine's recogniser takes a conv weight
(``forms.recognise`` reads linears), so AOTInductor and OpenVINO run it as the float dequantization the graph states:
their outputs match the eager program within the tolerances stated at each test.

The model: a small ResNet-like CNN built here (the floor lane has no torchvision; ``torchvision.models.resnet18``
exports the same ``aten.conv2d.default`` reads): a 7x7 stride-2 stem, a basic block with a depthwise conv, a 1x1
projection with a bias, a linear head (in 64: int4-g64 divides it).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import precast
from precast.quant.formats import INT8, dequantize, parse_format, parse_tag, quantize, scale_grid
from precast.quant.forms import recognise
from precast.quant.graph import stored_value
from tests.helpers import assert_bitwise

aten = torch.ops.aten
CONVS = ["stem.weight", "conv1.weight", "dw.weight", "proj.weight"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False)
        self.bn0 = torch.nn.BatchNorm2d(16)
        self.conv1 = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)  # depthwise: [16, 1, 3, 3]
        self.proj = torch.nn.Conv2d(16, 64, 1)
        self.fc = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        x = torch.relu(x + self.dw(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.relu(self.proj(x)).mean((2, 3)))


def _net() -> tuple[Net, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():  # running statistics that are not the identity
        for bn in (model.bn0, model.bn1):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, (x,)


def _convert(model, inputs, policy, weight_format):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precast.convert(
            model, inputs, policy=policy, weights=precast.WeightOptions(format=weight_format)
        )


def _records(res) -> dict[str, dict]:
    return {r["weight"]: r for r in res.report.weight_formats}


def _dequantized(model: Net, formats: dict[str, str], dtype: torch.dtype) -> Net:
    """The model with each named weight replaced by what its stored parts stand for, read in ``dtype`` (as fp32):
    a conv's as its [O, I*kh*kw] matrix, reshaped back."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, spelled in formats.items():
            fmt, p = parse_format(spelled), out.get_parameter(name)
            parts = quantize(p.reshape(p.shape[0], -1), fmt, scale_grid(dtype))
            parts["scale"] = parts["scale"].to(dtype)
            p.copy_(dequantize(parts, fmt, dtype).reshape(p.shape).float())
    return out


# ---- what is stored --------------------------------------------------------------------------------------------
def test_int8_stores_every_conv_weight_per_output_channel():
    """Before: only ``fc.weight`` had a record (the convs stayed float, unsaid)."""
    model, inputs = _net()
    res = _convert(model, inputs, "torch", "int8")
    records = _records(res)
    assert sorted(records) == sorted([*CONVS, "fc.weight"])
    state = res.program.state_dict
    for name in CONVS:
        r, w = records[name], model.get_parameter(name)
        o, cols = w.shape[0], math.prod(w.shape[1:])
        assert r["format"] == "int8" and r["shape"] == list(w.shape) and r["why"] == "weight_format='int8'"
        q, scale = (state[s] for s in r["stored"])
        assert q.dtype == torch.int8 and q.shape == (o, cols)
        assert scale.dtype == torch.bfloat16 and scale.shape == (o, 1)  # one scale per output channel
        assert r["bytes_before"] == 4 * w.numel()
        assert r["bytes_after"] == o * cols + 2 * o  # the int8 matrix and the bf16 scales, no float copy left
        assert not any(
            k == name or k.startswith(name.replace(".", "_")) for k in state if k not in r["stored"]
        )


@pytest.mark.parametrize("fmt", ["int8", "int8-asym"])
def test_policy_none_is_bitwise_the_dequantized_model(fmt):
    model, inputs = _net()
    res = _convert(model, inputs, None, fmt)
    assert {_records(res)[n]["format"] for n in CONVS} == {fmt}
    ref = _dequantized(model, {n: fmt for n in [*CONVS, "fc.weight"]}, torch.float32)
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), ref(*inputs))
        assert not torch.equal(ref(*inputs), model(*inputs))  # the rounding is there to see


@pytest.mark.parametrize("fmt", ["int8", "int8-asym"])
def test_policy_torch_is_bitwise_eager_autocast_of_the_dequantized_model(fmt):
    model, inputs = _net()
    res = _convert(model, inputs, "torch", fmt)
    ref = _dequantized(model, {n: fmt for n in [*CONVS, "fc.weight"]}, torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = ref(*inputs)
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), want)


def test_every_stored_conv_part_is_recomputed_from_the_original():
    """``load_weights`` and the streamed writer recompute a part from the 4-d original by its tag."""
    model, inputs = _net()
    res = _convert(model, inputs, "torch", "int8-asym")
    derived = [s for s in precast.constant_sources(res.program).values() if s.derive is not None]
    assert sorted(parse_tag(s.derive)[2] for s in derived if s.original == "stem.weight") == [
        "q",
        "scale",
        "zero",
    ]
    for src in derived:
        original = model.get_parameter(src.original).detach()
        assert_bitwise(stored_value(src, original), res.program.state_dict[src.stored])


def test_a_rule_naming_one_conv_weight_stores_that_one():
    """Before: the rule matched the conv's name (so no 'matches no weight' error) and quantized nothing."""
    model, inputs = _net()
    records = _records(_convert(model, inputs, "torch", {"conv1.weight": "int8"}))
    assert records["conv1.weight"]["format"] == "int8"
    assert records["conv1.weight"]["why"] == "weight_format rules: 'conv1.weight'"
    assert {records[n]["format"] for n in ["stem.weight", "dw.weight", "proj.weight", "fc.weight"]} == {
        "float"
    }


def test_int4_on_a_conv_is_int8_and_says_why():
    """int4 stores linears only: a conv the rules give int4 goes one step up to int8 (as a weight whose input
    size no int4 group divides does), and its record says why; the linear stays int4."""
    model, inputs = _net()
    res = _convert(model, inputs, "torch", "int4")
    records = _records(res)
    assert records["fc.weight"]["format"] == "int4-g64"
    for name in CONVS:
        assert records[name]["format"] == "int8"
        assert records[name]["why"] == (
            "weight_format='int4-g64'; int8: a convolution's weight is stored per output channel (int4 stores "
            "linears only)"
        )
    ref = _dequantized(model, {**dict.fromkeys(CONVS, "int8"), "fc.weight": "int4-g64"}, torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = ref(*inputs)
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), want)


def test_a_transposed_convolution_stays_float_and_is_said():
    """A transposed convolution's weight is [in, out, ...]: not stored per output channel; the conversion says
    so (the pass's skipped list, the report's diagnostic) and stores the other conv."""

    class Up(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(self.conv(x))

    torch.manual_seed(0)
    res = _convert(Up().eval(), (torch.randn(1, 3, 8, 8),), None, "int8")
    assert set(_records(res)) == {"conv.weight"}
    assert "up.weight" in res.program.state_dict
    assert "up.weight read by a transposed convolution" in str(res.report.to_dict())


def test_a_budget_keeps_conv_weights_float_and_says_they_were_not_measured():
    """``Budget`` measures linear and embedding weights only: the convs stay float and its record names them.
    Before this change the budget's plan lacked them and the conversion stopped ('written for another model')."""
    from precast.quant.budget import NOT_MEASURED

    model, inputs = _net()
    data = [(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(s)),) for s in (2, 3)]
    budget = precast.Budget(mse=1.0, data=data, probes=1)
    res = _convert(model, inputs, "torch", budget)
    records = _records(res)
    assert {records[n]["format"] for n in CONVS} == {"float"}
    assert res.report.weight_budget["not_measured"] == {"weights": sorted(CONVS), "why": NOT_MEASURED}


def test_a_measured_plan_leaves_conv_weights_float():
    """``weight_sensitivity`` measures linear and embedding weights; its plans name no conv weight, and a plan
    covers only the weights precast measures: applied (its curve's conversions, ``convert(plan=...)``) the convs
    stay float, said as 'no pattern matches' (a plan lacking a linear's weight is still refused: test_rules.py)."""
    model, inputs = _net()
    data = [(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(s)),) for s in (2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sens = precast.weight_sensitivity(model, inputs, data=data, formats=("int8",), probes=1)
    assert [w.name for w in sens.costs.weights.values()] == ["fc.weight"]
    assert sens.curve and all(p.metrics["weight_bytes"] > 0 for p in sens.curve)  # each point converted
    plan = sens.plan(bits=8.5)
    assert plan.weights == {"fc.weight": "int8"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = _records(precast.convert(model, inputs, policy="torch", plan=plan))
    assert records["fc.weight"]["format"] == "int8"
    for name in CONVS:
        assert records[name]["format"] == "float" and records[name]["why"].endswith("no pattern matches")


# ---- the engines -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int8_cnn():
    """The CNN converted with int8 weights under policy None (fp32 compute: the engines' tolerance is fp32's)."""
    model, inputs = _net()
    res = _convert(model, inputs, None, "int8")
    with torch.no_grad():
        return res.program, inputs, res.program.module()(*inputs)


def test_no_recogniser_takes_a_conv_weight(int8_cnn):
    """The engines read the stored integers of linears only (``forms.recognise``): a conv's weight is not
    recognised, so each engine computes its float dequantization (tested to match below)."""
    from precast.backends.aoti.int_weights import plan_int_weights

    program, _, _ = int8_cnn
    convs = [n for n in program.graph.nodes if n.target is aten.conv2d.default]
    assert len(convs) == 4 and all(recognise(c.args[1]) is None for c in convs)
    assert all(c.args[1].target is aten.view.default for c in convs)
    linear = next(n for n in program.graph.nodes if n.target is aten.linear.default)
    assert recognise(linear.args[1]).format == INT8
    assert [r.kind for r in plan_int_weights(program).rewrites] == ["int8"]  # the linear's only


def test_aotinductor_runs_the_conv_weights_dequantized(int8_cnn, aoti_cache):
    """One compile. Tolerance: 1e-5 of the output's peak (fp32 convolutions in another order)."""
    program, inputs, want = int8_cnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = precast.compile(program, backend="aoti", cache_dir=aoti_cache, progress=False)
    got = model(*inputs)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_runs_the_conv_weights_dequantized(int8_cnn):
    """f32 hint. Tolerance: 1e-5 of the output's peak (OpenVINO's fp32 convolution kernels)."""
    pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")
    from precast.backends.openvino.compressed import stored_weights
    from precast.backends.openvino.convert import _decomposed

    program, inputs, want = int8_cnn
    assert [(r.kind, r.form) for r in stored_weights(_decomposed(program).module())] == [("linear", "int8")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = precast.compile(program, backend="openvino", precision_hint="f32")
    got = model(*inputs)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_openvino_runs_the_bf16_programs_conv_weights_dequantized():
    """Policy torch (bf16 convolutions), OpenVINO's default hint. Tolerance: one bf16 step (2**-7) of the output's
    peak (measured: one step, 0.00098 on a peak of 0.19; OpenVINO's bf16 kernels accumulate in another order)."""
    pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")
    model, inputs = _net()
    program = _convert(model, inputs, "torch", "int8").program
    with torch.no_grad():
        want = program.module()(*inputs).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = precast.compile(program, backend="openvino")(*inputs).float()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()


def test_a_streamed_conversion_writes_the_conv_parts_from_the_files(tmp_path):
    """A weightless CNN converted with its weights read from a file (``weights=folder``): the streamed writer
    quantizes each 4-d original by its part's tag; the program run on the written shards is bitwise the in-memory
    conversion."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, inputs = _net()
    (tmp_path / "in").mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, tmp_path / "in" / "model.safetensors")
    with precast.empty_parameters():
        empty = Net().eval()
    ep = precast.export_weightless(empty, inputs)
    given = dict(policy="torch", weight_format="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = precast.convert(model, inputs, verify=False, **given)
        out = precast.convert(ep, weights=tmp_path / "in", weights_out=tmp_path / "out", **given)
    written = safetensors_torch.load_file(next((tmp_path / "out").glob("*.safetensors")))
    for name in CONVS:
        stored = _records(out)[name]["stored"]
        assert stored == _records(ref)[name]["stored"] and set(stored) <= set(written)
        for part in stored:
            assert_bitwise(written[part], ref.program.state_dict[part])
    with torch.no_grad():
        ran = precast.with_weights(out.program, tmp_path / "out").module()(*inputs)
        assert_bitwise(ran, ref.program.module()(*inputs))
