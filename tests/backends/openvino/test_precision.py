"""The precision hint precast compiles OpenVINO models with, and the corrections each hint needs
(precast.backends.openvino.precision).

Measured facts the tests hold (OpenVINO 2026.4.1, this CPU: AVX512 with native bf16):
- under the f32 hint OpenVINO's Convert layer f32 -> bf16 (a cast it does not fuse into an element-wise Subgraph,
  e.g. with a dynamic batch) rounds up only when the last kept bit is 1 (about a quarter of random values differ
  from torch's round-to-nearest-even by one ulp); precast's correction makes every cast round to nearest (ties to
  even included) below |x| = 5.2e33;
- under the bf16 hint OpenVINO's conversions round to nearest, and it flushes bf16 subnormals to zero;
- ``precision_hint="auto"`` keeps OpenVINO's bf16 hint only where every layer then runs precast's dtype;
- fp16 runs in fp16 only under the f16 hint, and only where OpenVINO reports fp16 kernels (``FP16`` in the CPU's
  ``OPTIMIZATION_CAPABILITIES``: AVX512-FP16 or AVX2-VNNI-2); the f32 hint runs fp16 ops in f32.

Each test asserts what the CPU's capabilities as OpenVINO reports them imply (its default hint, its capability
list, the layers of its runtime model), so the suite holds on AVX2, AVX512-BF16 and AMX + AVX512-FP16 CPUs.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import precast  # noqa: E402
from precast.backends.openvino.convert import convert  # noqa: E402
from precast.backends.openvino.model import compile_openvino  # noqa: E402
from precast.backends.openvino.plan_check import PlanOverrideWarning  # noqa: E402
from precast.backends.openvino.precision import (  # noqa: E402
    SPLIT_LIMIT,
    hints_to_try,
    native_bf16,
    native_fp16,
)
from precast.metrics import flat_error  # noqa: E402
from tests import models as zoo  # noqa: E402

BF16 = torch.bfloat16


def native() -> bool:
    import openvino as ov

    return native_bf16(ov.Core())


def fp16_kernels() -> bool:
    import openvino as ov

    return native_fp16(ov.Core())


class Cast(torch.nn.Module):
    def forward(self, x):
        return x.to(BF16)


def cast_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    ties = ((x.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)[:512]  # exactly halfway: to even
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 3e33, -3e33, 1e-30, -1e-30])
    return torch.cat([x, ties, special])


def raw_f32_hint(ep, x: torch.Tensor) -> torch.Tensor:
    """OpenVINO's own Convert layer under the f32 hint, without precast's correction (the control). With a dynamic
    batch (as precast.compile makes it) the cast is a Convert layer of its own; with static shapes OpenVINO fuses
    it into an element-wise Subgraph, which rounds correctly."""
    import openvino as ov

    from precast.backends.openvino.kv_state import to_torch
    from precast.runtime.exported import dynamic_batch

    model, _, _ = convert(dynamic_batch(ep))
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    types = [
        str(op.get_rt_info()["layerType"].astype(str))
        for op in compiled.get_runtime_model().get_ordered_ops()
    ]
    assert types == ["Input", "Convert", "Output"], types
    request = compiled.create_infer_request()
    request.infer([ov.Tensor(x.numpy())])
    return to_torch(request.get_output_tensor(0))


def test_f32_hint_casts_round_to_nearest_even():
    x = cast_inputs()
    ep = torch.export.export(Cast(), (x,))
    want = x.to(BF16)
    model = compile_openvino(ep, precision_hint="f32", warn=False)
    got = model(x)
    assert got.dtype == BF16 and torch.equal(got, want)  # == on values: -0.0 and 0.0 compare equal
    # the control: OpenVINO's Convert alone truncates where the last kept bit is 0
    raw = raw_f32_hint(ep, x)[:4096]
    wrong = (raw != want[:4096]).float().mean().item()
    assert 0.2 < wrong < 0.3, wrong
    low_bits = x[:4096].view(torch.int32) & 0xFFFF
    last_bit = (x[:4096].view(torch.int32) >> 16) & 1
    truncated = (low_bits > 0x8000) & (last_bit == 0)
    assert torch.equal(raw != want[:4096], truncated)
    # beyond the split's range a value is converted as it is (never inf or NaN from the split itself)
    big = torch.tensor([1e36, -3e38, float("nan")])
    out = compile_openvino(torch.export.export(Cast(), (big,)), precision_hint="f32", warn=False)(big)
    assert torch.isfinite(out[:2]).all() and out[2].isnan() and SPLIT_LIMIT < 1e36


@pytest.mark.skipif(not native(), reason="OpenVINO's default is f32 on a CPU without native bf16")
def test_bf16_hint_rounds_to_nearest_and_flushes_subnormals():
    x = cast_inputs()
    got = compile_openvino(torch.export.export(Cast(), (x,)), precision_hint="bf16", warn=False)(x)
    want = x.to(BF16)
    normal = want.float().abs() >= torch.finfo(BF16).tiny
    assert torch.equal(got[normal | (want == 0)], want[normal | (want == 0)])
    assert (got[~normal & (want != 0)] == 0).all()  # bf16 subnormals flushed to zero under this hint


def test_hints_to_try():
    # what OpenVINO 2026.4.1 reports on the three kinds of x86 CPU (its plugin.cpp: BF16 with avx512_core_bf16
    # or avx2_vnni_2, FP16 with avx512_core_fp16 or avx2_vnni_2; the default hint bf16 where BF16 is listed)
    avx2 = (["WINOGRAD", "FP32", "INT8", "BIN", "EXPORT_IMPORT"], "f32")
    avx512_bf16 = (["BF16", "WINOGRAD", "FP32", "INT8", "BIN", "EXPORT_IMPORT"], "bf16")
    amx_fp16 = (["BF16", "WINOGRAD", "FP32", "FP16", "INT8", "BIN", "EXPORT_IMPORT"], "bf16")

    class Core:
        def __init__(self, cpu):
            self.capabilities, self.default = cpu

        def get_property(self, device, key):
            assert device == "CPU"
            return {"INFERENCE_PRECISION_HINT": self.default, "OPTIMIZATION_CAPABILITIES": self.capabilities}[
                key
            ]

    for cpu in (avx2, avx512_bf16, amx_fp16):
        core = Core(cpu)
        bf16, fp16 = cpu[1] == "bf16", "FP16" in cpu[0]
        assert hints_to_try("auto", {"bf16", "fp32"}, core) == (["bf16", "f32"] if bf16 else ["f32"])
        assert hints_to_try("auto", {"fp16", "fp32"}, core) == (["f16", "f32"] if fp16 else ["f32"])
        assert hints_to_try("auto", {"bf16", "fp16"}, core) == ["f32"]  # no hint runs both: f32
        assert hints_to_try("auto", {"fp32"}, core) == ["f32"]
        assert hints_to_try("f32", {"bf16"}, core) == ["f32"]
        assert hints_to_try("f16", {"bf16"}, core) == ["f16"]
        assert hints_to_try(None, {"bf16"}, core) == [None]
    # and this CPU, as OpenVINO reports it
    import openvino as ov

    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert native() == ("BF16" in capabilities) and fp16_kernels() == ("FP16" in capabilities)


def test_fp16_plan_runs_in_fp16_where_openvino_has_fp16_kernels():
    """An fp16 plan: under auto, the f16 hint where OpenVINO reports fp16 kernels, every layer then in fp16 and the
    outputs bitwise the program's (OpenVINO's f16 casts round to nearest); elsewhere the f32 hint, each fp16 layer
    run in fp32 and warned. A Linear kept fp32 in an fp16 plan: the f16 hint lowers it, so auto falls back to f32."""
    mlp, x = zoo.plain_mlp()
    res = precast.convert(mlp, x, policy="torch", dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = precast.compile(res.program, backend="openvino")
    overrides = [w for w in caught if issubclass(w.category, PlanOverrideWarning)]
    plan = compiled.plan
    fcs = [layer for layer in plan.layers if layer.layer_type == "FullyConnected"]
    assert len(fcs) == 4 and all(layer.planned == ("fp16",) for layer in fcs)
    if fp16_kernels():
        assert plan.hint == "f16" and compiled.runtime_precision() == "f16" and plan.overridden == []
        assert overrides == [] and [layer.runtime for layer in fcs] == [("fp16",)] * 4
        assert torch.equal(compiled(*x), res.program.module()(*x))
    else:
        assert plan.hint == "f32" and plan.fallback == ""
        assert plan.overridden == fcs and [layer.runtime for layer in fcs] == [("fp32",)] * 4
        # one line for the four layers, not one per layer
        assert len(overrides) == 1 and "in 4 layer(s) under the f32 hint (4 run fp32 for fp16" in str(
            overrides[0].message
        )
        assert "runs fp32 where precast decided fp16" in str(overrides[0].message)
    kept = precast.convert(mlp, x, policy="rules", dtype=torch.float16, exclude_nodes=["linear_3"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanOverrideWarning)
        compiled = precast.compile(kept.program, backend="openvino")
    assert compiled.plan.hint == "f32"
    if fp16_kernels():
        assert "the f16 hint overrides 1 layer(s)" in compiled.plan.fallback
        assert "runs fp16 where precast decided fp32 for linear_3" in compiled.plan.fallback
    fc = [layer for layer in compiled.plan.layers if "linear_3" in layer.nodes]
    assert [layer.runtime for layer in fc] == [("fp32",)]


@pytest.mark.skipif(not native(), reason="OpenVINO's default is f32 on a CPU without native bf16")
def test_auto_keeps_the_bf16_hint_and_the_plans_fp32_ops_in_f32():
    """The fast default: a bf16 plan with an op kept fp32 compiles with OpenVINO's bf16 hint, the kept op marked so
    that the plugin runs it in f32 (it used to lower it, and auto fell back to the slower f32 hint); forcing the
    bf16 hint gives the same model and no warning."""
    model, inputs = zoo.plain_encoder(2)
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)
    compiled = precast.compile(res.program, backend="openvino")
    assert compiled.plan.hint == "bf16" and compiled.plan.overridden == [] and compiled.plan.fallback == ""
    assert compiled.runtime_precision() == "bf16" and "native bf16" in compiled.plan.reason
    mlp, x = zoo.plain_mlp()
    kept = precast.convert(mlp, x, policy="rules", dtype=BF16, exclude_nodes=["linear_3"])
    for options in ({}, {"precision_hint": "bf16"}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no override, no fallback: not a line
            compiled = compile_openvino(kept.program, **options)
        plan = compiled.plan
        assert plan.hint == "bf16" and plan.overridden == [] and plan.fallback == "", plan
        assert "fp32 op(s) of the plan kept in f32" in plan.form
        fcs = {layer.nodes: layer.runtime for layer in plan.layers if layer.layer_type == "FullyConnected"}
        assert fcs[("linear_3",)] == ("fp32",), fcs  # the layer the plan keeps fp32, under the bf16 hint
        assert all(runtime == ("bf16",) for nodes, runtime in fcs.items() if nodes != ("linear_3",)), fcs


def test_plan_fp32_ops_are_marked_for_the_bf16_hint():
    """What the bf16 hint is given (on every CPU): the ops the plan keeps fp32, and only those, carry OpenVINO's
    typed DisablePrecisionConversion (the IR round trip makes it; a string under that key is refused at compile);
    the converted model itself (what save writes) is left unmarked, and the marks change no value."""
    import openvino as ov

    from precast.backends.openvino.keep_f32 import fp32_ops
    from precast.backends.openvino.precision import prepare

    mlp, x = zoo.plain_mlp()
    kept = precast.convert(mlp, x, policy="rules", dtype=BF16, exclude_nodes=["linear_3"])
    ov_model, graph_module, _ = convert(kept.program)
    assert sorted(op.get_type_name() for op in fp32_ops(ov_model, graph_module)) == ["Add", "MatMul"]
    made, form = prepare(ov_model, "bf16", graph_module=graph_module)
    marked = [op for op in made.get_ordered_ops() if "DisablePrecisionConversion_0" in op.get_rt_info()]
    assert sorted(op.get_type_name() for op in marked) == ["Add", "MatMul", "Reshape"]
    assert {op.get_friendly_name().split("/")[0] for op in marked} == {"linear_3"}
    # the bias read apart (else the plugin fuses it into a new, unmarked FullyConnected): marked, not folded
    (apart,) = [op for op in marked if op.get_type_name() == "Reshape"]
    assert "DisableConstantFolding_0" in apart.get_rt_info()
    assert apart.input_value(0).get_node().get_type_name() == "Constant"
    assert form == "lowered by OpenVINO; 2 fp32 op(s) of the plan kept in f32"
    assert not [op for op in ov_model.get_ordered_ops() if "precise_0" in op.get_rt_info()]
    core, feed = ov.Core(), [ov.Tensor(x[0].numpy())]
    unmarked, _ = prepare(ov_model, "bf16")

    def compressed(m) -> int:  # the bf16 weights' casts marked as decompressions (lost by an IR round trip)
        return sum(
            "decompression_0" in op.get_rt_info() and op.get_type_name() == "Convert"
            for op in m.get_ordered_ops()
        )

    assert compressed(made) == compressed(unmarked) == 3
    outs = [
        core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(feed)[0] for m in (made, unmarked)
    ]
    assert (outs[0] == outs[1]).all()


def test_the_default_hint_follows_the_cpu_and_says_why():
    """precision_hint='auto' on a bf16 plan: the bf16 hint where OpenVINO reports native bf16, else f32 (bf16 would
    be emulated), the reason recorded in the plan either way."""
    mlp, x = zoo.plain_mlp()
    res = precast.convert(mlp, x, policy="torch", dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = precast.compile(res.program, backend="openvino")
    plan = compiled.plan
    if native():
        assert plan.hint == "bf16" and compiled.runtime_precision() == "bf16"
        assert plan.reason.startswith("native bf16")
    else:
        assert plan.hint == "f32" and compiled.runtime_precision() == "f32" and plan.fallback == ""
        assert plan.reason.startswith("no native bf16 on this CPU") and "emulated" in plan.reason
    assert plan.to_dict()["reason"] == plan.reason


@pytest.mark.skipif(not native(), reason="OpenVINO's default is f32 on a CPU without native bf16")
def test_undecided_fp32_layers_lowered_by_the_bf16_hint_are_overrides():
    """The unconverted program has no precast decision: under the bf16 hint OpenVINO lowers its Linears, which the
    program computes in fp32, and the check names each one; under auto (no bf16 plan) it stays f32."""
    mlp, x = zoo.plain_mlp()
    ep = torch.export.export(mlp, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forced = compile_openvino(ep, precision_hint="bf16")
    lowered = [layer for layer in forced.plan.overridden if layer.layer_type == "FullyConnected"]
    assert len(lowered) == 4 and all(layer.undecided for layer in lowered)
    assert "where the program computes fp32" in lowered[0].describe()
    auto = compile_openvino(ep)
    assert auto.plan.hint == "f32" and auto.plan.overridden == []
    assert torch.allclose(auto(*x), mlp(*x), rtol=0, atol=1e-4 * mlp(*x).abs().max().item())


class ScaledAttention(torch.nn.Module):
    """Attention with an explicit ``scale=`` (as transformers' BERT passes it)."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.qkv, self.o, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=(d // self.heads) ** -0.5)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


def attention_program():
    torch.manual_seed(0)
    model = ScaledAttention().eval()
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad():
        want = model(x)
    return precast.convert(model, (x,), policy="torch", dtype=BF16).program, x, want


def test_attention_scale_kept_exact():
    """OpenVINO's frontend stores ``scale=`` in the query's dtype (bf16: 0.25 is exact, 1/sqrt(32) is not); precast
    keeps the exact f32 value behind a cast, which the bf16-hint forms read directly."""
    import numpy as np
    import openvino as ov

    program, _, _ = attention_program()
    model, _, _ = convert(program)
    (sdpa,) = [op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention"]
    cast = sdpa.input_value(4).get_node()
    assert cast.get_type_name() == "Convert" and cast.get_output_element_type(0) == ov.Type.bf16
    exact = cast.input_value(0).get_node()
    assert exact.get_output_element_type(0) == ov.Type.f32
    assert exact.get_data().item() == np.float32(16**-0.5)


def softmax_layers(compiled) -> list[tuple[str, str, tuple[str, ...], str]]:
    """What OpenVINO reports about the layers that execute a softmax in ``compiled`` (an ``ov.CompiledModel``):
    per layer of its runtime model whose executed ops include a Softmax, (layer type, the precision it runs in
    (``runtimePrecision``), the element types of its inputs, its output precisions (``outputPrecisions``))."""
    out = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        ops = info["originalLayersNames"].astype(str).split(",")
        if any(name.startswith("Softmax") or "/Softmax" in name for name in ops):
            inputs = tuple(
                op.input_value(i).get_element_type().get_type_name() for i in range(op.get_input_size())
            )
            out.append(
                (
                    info["layerType"].astype(str),
                    info["runtimePrecision"].astype(str),
                    inputs,
                    info["outputPrecisions"].astype(str),
                )
            )
    return out


@pytest.mark.skipif(not native(), reason="OpenVINO's default is f32 on a CPU without native bf16")
def test_bf16_forms_against_the_fp32_model(monkeypatch):
    """Under the bf16 hint: OpenVINO lowering the f32-typed graph (the default form) is at least as close to the
    fp32 model as precast's casts as written with the attention in f32 (the fallback form), which is never further
    than the casts as written alone. How much closer depends on the precision OpenVINO runs the softmax in, which
    the test reads from each form's runtime model (never from layer names): where the casts as written run the
    softmax's layer in bf16 and the fallback runs it in f32, the fallback must be clearly closer (the scores are no
    longer rounded); where both run it in the same reported precision (this Intel Xeon with AVX512-BF16 and no AMX
    runs the attention as one bf16 ``Subgraph`` in every form: 1.78e-5 against 2.49e-5; an AMX Xeon: 1.78e-5 in
    all three) only the ordering is asserted. The fallback form is taken, and said, when the f32 typing fails."""
    from precast.backends.openvino import precision

    program, x, want = attention_program()
    errors, reported = {}, {}
    lowered = precast.compile(program, backend="openvino")
    assert lowered.plan.hint == "bf16" and lowered.plan.form.startswith("lowered by OpenVINO")
    assert lowered.plan.overridden == [] and lowered(x).dtype == BF16  # the program's output dtype
    errors["lowered"] = 1 - flat_error(lowered(x), want)[1]
    reported["lowered"] = softmax_layers(lowered.compiled)

    def fails(model):
        raise RuntimeError("Check 'element::Type::merge' failed\nmore")

    monkeypatch.setattr(precision, "lowered_by_openvino", fails)
    fallback = precast.compile(program, backend="openvino")
    assert fallback.plan.form.startswith("casts as written, attention in f32 (f32 typing failed: Check")
    errors["attention in f32"] = 1 - flat_error(fallback(x), want)[1]
    reported["attention in f32"] = softmax_layers(fallback.compiled)
    monkeypatch.setattr(precision, "attention_in_f32", lambda model: 0)
    as_written = precast.compile(program, backend="openvino")
    errors["as written"] = 1 - flat_error(as_written(x), want)[1]
    reported["as written"] = softmax_layers(as_written.compiled)
    assert all(reported.values()), ("a form has no layer executing the attention's softmax", reported)
    # the casts as written give OpenVINO a bf16 attention under the bf16 hint: it reports running it in bf16
    for _, runs, inputs, outputs in reported["as written"]:
        assert runs == "bf16" and set(inputs) == {"bf16"} and outputs == "bf16", reported
    assert errors["lowered"] <= errors["attention in f32"], (errors, reported)
    assert errors["attention in f32"] <= 1.05 * errors["as written"], (errors, reported)

    def precision(form: str) -> set[str]:
        return {runs for _, runs, _, _ in reported[form]} | {
            t for _, _, ins, _ in reported[form] for t in ins
        }

    if precision("as written") == {"bf16"} and precision("attention in f32") == {"f32"}:
        # the scores rounded to bf16 as written, in f32 in the fallback: the rounding it removes is measurable
        assert errors["attention in f32"] < 0.8 * errors["as written"], (errors, reported)


def runtime_layers(compiled) -> tuple[Counter, Counter]:
    """(the executed layers by type and runtime precision, the constants by precision) of a compiled model."""
    layers, constants = Counter(), Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind, runs = info["layerType"].astype(str), info["runtimePrecision"].astype(str)
        (constants if kind == "Const" else layers)[runs if kind == "Const" else (kind, runs)] += 1
    return layers, constants


@pytest.mark.skipif(not native(), reason="the lowered form is made for the bf16 hint (CPUs with native bf16)")
@pytest.mark.parametrize("name", ["attention", "encoder", "cnn"])
def test_lowered_form_keeps_weights_in_bf16(name, monkeypatch):
    """Under the bf16 hint each matmul's and convolution's bf16 weight is read through a cast OpenVINO keeps as a
    decompression: the compiled model holds the bf16 weight (one bf16 constant per FullyConnected / Convolution
    layer), where an unmarked cast is folded into an f32 copy (the control: no bf16 constant). The same layers run
    in the same precisions and the outputs are bitwise the same; the layer norms' scales stay fused (a marked cast
    there would split them off)."""
    from precast.backends.openvino import precision

    if name == "attention":
        program, x, _ = attention_program()
        inputs = (x,)
    else:
        model, inputs = zoo.plain_encoder() if name == "encoder" else zoo.plain_cnn()
        program = precast.convert(model, inputs, policy="torch", dtype=BF16).program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanOverrideWarning)  # the check is the control's, not the hint's
        kept = compile_openvino(program, precision_hint="bf16", dynamic=False)
        monkeypatch.setattr(precision, "_reads_compressed", lambda reader: False)
        folded = compile_openvino(program, precision_hint="bf16", dynamic=False)
    assert kept.plan.form == folded.plan.form and kept.plan.form.startswith("lowered by OpenVINO")
    layers, constants = runtime_layers(kept.compiled)
    weighted = layers["FullyConnected", "bf16"] + layers["Convolution", "bf16"]
    assert constants["bf16"] == weighted > 0, (layers, constants)
    folded_layers, folded_constants = runtime_layers(folded.compiled)
    assert folded_constants["bf16"] == 0 and folded_layers == layers, (folded_layers, folded_constants)
    assert [layer.runtime for layer in kept.plan.layers] == [layer.runtime for layer in folded.plan.layers]
    assert torch.equal(kept(*inputs), folded(*inputs))


@pytest.mark.skipif(not native(), reason="the lowered form is made for the bf16 hint (CPUs with native bf16)")
def test_a_weight_with_other_readers_keeps_the_plain_cast():
    """A bf16 weight that a matmul and another op read keeps one plain cast to f32 (OpenVINO folds it and the
    constant subgraph behind it, as before): marked as a decompression, the plugin kept the weight's precision and
    ran ``sum(w * w)`` on every call, in other values. Control: a weight only matmuls read is marked."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from precast.backends.openvino.precision import COMPRESSED_CAST, lowered_by_openvino

    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(BF16)

    def model(other_reader: bool):
        x = ops.parameter([2, 64], np.float32, name="x")
        data = ov.Tensor(ov.Type.bf16, ov.Shape([64, 64]))
        data.data.view(np.int16)[...] = weight.view(torch.int16).numpy()
        w = ov.op.Constant(data)
        y = ops.matmul(ops.convert(x, "bf16"), w, False, True)
        if other_reader:
            y = ops.add(y, ops.reduce_sum(ops.multiply(w, w), [0], True))
        return ov.Model([ops.convert(y, "f32")], [x])

    def marked(m) -> int:
        return sum(
            all(key in op.get_rt_info() for key in COMPRESSED_CAST)
            for op in m.get_ordered_ops()
            if op.get_type_name() == "Convert"
        )

    only_matmul, shared = model(False), model(True)
    lowered_by_openvino(only_matmul)
    lowered_by_openvino(shared)
    assert marked(only_matmul) == 1 and marked(shared) == 0
    compiled = ov.Core().compile_model(shared, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    layers, constants = runtime_layers(compiled)
    assert constants["bf16"] == 0 and {kind for kind, _ in layers} == {
        "Input",
        "FullyConnected",
        "Reorder",
        "Output",
    }
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    want = x.to(BF16).float() @ weight.float().T + (weight.float() * weight.float()).sum(0, keepdim=True)
    got = torch.from_numpy(compiled([x.numpy()])[0])
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), (got - want).abs().max()


def test_the_fused_cache_form_reads_bf16_weights_as_compressed_ones(tmp_path):
    """``weights_read_compressed`` (the casts-as-written form of a decoder with OpenVINO's fused cache): a matmul of
    a bf16 activation and a bf16 weight reads the weight through one cast marked as a decompression and the
    activation through an exact cast, its result cast back to bf16 for the same readers; a tied weight's Gather
    keeps reading the constant itself; a matmul of two activations is left alone; the mark comes back after an IR
    round trip (``restore_marks``). Under the bf16 hint (native bf16 only) the plugin keeps the weight bf16 (no f32
    copy of it among the runtime model's constants) and each output is the bf16 rounding of the f32 product
    within one bf16 step, as the form before gave."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from precast.backends.openvino.precision import (
        COMPRESSED_CAST,
        restore_marks,
        weights_read_compressed,
    )

    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(BF16)

    def model():
        x = ops.parameter([2, 64], np.float32, name="x")
        ids = ops.parameter([2], np.int64, name="ids")
        data = ov.Tensor(ov.Type.bf16, ov.Shape([96, 64]))
        data.data.view(np.int16)[...] = weight.view(torch.int16).numpy()
        w = ov.op.Constant(data)
        xb = ops.convert(x, "bf16")
        y = ops.matmul(xb, w, False, True)  # the linear: [2, 96] in bf16
        scores = ops.matmul(y, ops.convert(ops.transpose(y, [1, 0]), "bf16"), False, False)  # two activations
        rows = ops.gather(w, ids, 0)  # the tied embedding's read of the same table
        outs = [ops.convert(y, "f32"), ops.convert(scores, "f32"), ops.convert(rows, "f32")]
        return ov.Model(outs, [x, ids])

    made = model()
    assert weights_read_compressed(made) == 1
    casts = [op for op in made.get_ordered_ops() if all(k in op.get_rt_info() for k in COMPRESSED_CAST)]
    assert len(casts) == 1 and casts[0].get_input_element_type(0) == ov.Type.bf16
    assert [r.get_node().get_type_name() for r in casts[0].output(0).get_target_inputs()] == ["MatMul"]
    gather = next(op for op in made.get_ordered_ops() if op.get_type_name() == "Gather")
    assert gather.input_value(0).get_node().get_type_name() == "Constant"
    matmuls = [op for op in made.get_ordered_ops() if op.get_type_name() == "MatMul"]
    assert [str(m.get_output_element_type(0)) for m in matmuls] == ["<Type: 'float32'>", "<Type: 'bfloat16'>"]
    ov.save_model(made, str(tmp_path / "form.xml"), compress_to_fp16=False)
    read = ov.Core().read_model(str(tmp_path / "form.xml"))
    assert restore_marks(read) == 1
    if not native():
        return
    core = ov.Core()
    compiled = core.compile_model(made, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    before = core.compile_model(model(), "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    assert runtime_layers(compiled)[1]["f32"] == runtime_layers(before)[1]["f32"]  # no f32 copy of the weight
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([3, 90])
    exact = x.to(BF16).float() @ weight.float().T
    for c in (compiled, before):
        y, _, rows = (torch.from_numpy(o) for o in c([x.numpy(), ids.numpy()]).values())
        assert torch.equal(rows, weight[ids].float())
        step = exact.abs().to(BF16).float() * 2**-7  # one bf16 step at each value (8 significant bits)
        assert ((y - exact).abs() <= step).all(), ((y - exact).abs() / step).max()


AVX2_PATHS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OV_CPU_MAX_ISA": "AVX2"}  # the code paths of a CPU without bf16


def f32_form_facts() -> dict:
    """A bf16 MLP with biases (``policy="torch"``) compiled under the f32 hint, with its weights read as compressed
    ones and, as the control, read directly: the forms, the compiled models' constants by precision, their
    FullyConnected layers, and each output's largest distance from the plan as eager runs it, in bf16 steps; and
    the compressed form saved as a folder holds it and opened again (``saved.save_form`` / ``open_form``).
    Also run in a process on AVX2 code paths (``AVX2_PATHS``), so it must stay importable and JSON-valued."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    import openvino as ov

    from precast.backends.openvino import precision
    from precast.backends.openvino.saved import open_form, save_form

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).eval()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    program = precast.convert(mlp, (x,), policy="torch", dtype=BF16).program
    with torch.no_grad():
        want = program.module()(x).float()
    kept = compile_openvino(program, precision_hint="f32", warn=False)
    with mock.patch.object(precision, "weights_read_compressed", lambda model: 0):
        direct = compile_openvino(program, precision_hint="f32", warn=False)
    facts = {"native": native_bf16(ov.Core())}
    with (
        tempfile.TemporaryDirectory() as folder
    ):  # the form as a folder holds it, opened with nothing converted
        xml = Path(folder) / "form.xml"
        reopened = open_form(xml, save_form(kept, xml))
        facts["reopened"] = {
            "bf16_constants": runtime_layers(reopened.compiled)[1]["bf16"],
            "equal": torch.equal(reopened(x), kept(x)),
        }
    for name, model in (("kept", kept), ("direct", direct)):
        layers, constants = runtime_layers(model.compiled)
        step = want.abs().to(BF16).float().clamp_min(2**-100) * 2**-7  # one bf16 step at each value
        got = model(x).float()
        facts[name] = {
            "form": model.plan.form,
            "hint": model.plan.hint,
            "bf16_constants": constants["bf16"],
            "fully_connected": sum(n for (kind, _), n in layers.items() if kind == "FullyConnected"),
            "steps": ((got - want).abs() / step).max().item(),
        }
    return facts


@pytest.mark.parametrize("paths", ["this CPU", "AVX2 code paths"])
def test_the_f32_hint_reads_bf16_weights_as_compressed_ones(paths, tmp_path):
    """Under the f32 hint (the default call's hint on a CPU without native bf16) each bf16 Linear reads its bf16
    weight as a compressed weight and its bias in f32, and its result is rounded to bf16 once, after the bias, as
    torch's bf16 ``linear`` rounds it (``weights_read_compressed`` before ``round_to_nearest``): the compiled model
    keeps each weight in bf16 and every output is within one bf16 step of eager's. The control reads the weights
    directly: on a CPU without native bf16 OpenVINO widens each into an f32 copy (no bf16 constant left: twice
    the bytes streamed per call), and runs the matmuls with their bf16 results unrounded (bf16 is f32 to it
    there: measured, the last Linear's outputs up to 44 bf16 steps from eager's where they cancel). Run here and in a process on AVX2 code paths (``ONEDNN_MAX_CPU_ISA`` /
    ``OV_CPU_MAX_ISA``), which OpenVINO then reports as a CPU without native bf16."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if paths == "this CPU":
        facts = f32_form_facts()
    else:
        root = Path(__file__).resolve().parents[3]
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json; from tests.backends.openvino.test_precision import f32_form_facts; "
                "print(json.dumps(f32_form_facts()))",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=root,
            env={**os.environ, **AVX2_PATHS, "PYTHONPATH": str(root)},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        facts = json.loads(done.stdout.strip().splitlines()[-1])
        assert facts["native"] is False  # OpenVINO takes the limit: f32 is its default there
    kept, direct = facts["kept"], facts["direct"]
    assert kept["hint"] == direct["hint"] == "f32"
    assert kept["form"] == "casts rounded to nearest; 2 bf16 weight read(s) as compressed weights"
    assert direct["form"] == "casts rounded to nearest"
    assert kept["fully_connected"] == direct["fully_connected"] == 2
    assert kept["bf16_constants"] >= 2  # both weights kept in bf16
    # saved and opened again (restore_marks): the same weights kept in bf16, the same outputs
    assert facts["reopened"] == {"bf16_constants": kept["bf16_constants"], "equal": True}
    assert kept["steps"] <= 1.0, facts
    if facts["native"]:
        assert direct["steps"] <= 1.0, facts  # bf16 FullyConnected layers, rounded by the plugin
    else:
        assert direct["bf16_constants"] == 0  # each weight widened into an f32 copy


class BiasAndAdd(torch.nn.Module):
    """A Linear with its bias, and a matmul followed by the program's own add of a constant (``x @ w + c``)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        self.c = torch.nn.Parameter(torch.randn(8, generator=g).to(BF16))

    def forward(self, x):
        return self.linear(x) + (x @ self.w + self.c)


def test_only_a_linears_own_bias_is_added_before_the_rounding():
    """``weights_read_compressed``: a Linear's bias (the same aten op's Add) is added to the f32 product before the
    one cast back to bf16, as torch's bf16 ``linear`` adds it; the program's own ``aten.add`` of a constant after a
    matmul stays after the cast back (torch adds it to the rounded product)."""
    import openvino as ov

    from precast.backends.openvino.precision import weights_read_compressed
    from precast.runtime.exported import dynamic_batch

    x = torch.randn(2, 8)
    program = precast.convert(BiasAndAdd(), (x,), policy="torch", dtype=BF16).program
    ov_model, _, _ = convert(dynamic_batch(program))
    assert weights_read_compressed(ov_model) == 2

    def adds_a_constant(op) -> bool:
        if op.get_type_name() != "Add":
            return False
        source = op.input_value(1).get_node()
        if source.get_type_name() == "Convert":  # the bias, read through its cast to f32
            source = source.input_value(0).get_node()
        return source.get_type_name() == "Constant"

    adds = {
        op.get_friendly_name().split("/")[1]: op for op in ov_model.get_ordered_ops() if adds_a_constant(op)
    }
    assert set(adds) == {"aten.linear.default", "aten.add.Tensor"}, list(adds)
    bias, own = adds["aten.linear.default"], adds["aten.add.Tensor"]
    assert bias.get_output_element_type(0) == ov.Type.f32  # the bias added to the f32 product
    assert bias.input_value(0).get_node().get_type_name() == "MatMul"
    assert own.get_output_element_type(0) == ov.Type.bf16  # the program's add, on the product cast back
    assert own.input_value(0).get_node().get_type_name() == "Convert"


def test_a_saved_bf16_form_gets_its_marks_back(tmp_path):
    """The bf16 form written as IR and read back (what a saved model opens) loses the string marks that keep a
    plan-fp32 Linear's bias apart and a bf16 weight's cast unfolded; ``restore_marks`` puts them back, so the
    Linear the plan keeps fp32 runs f32 again, where OpenVINO reports native bf16 (without them its bias folds
    into a new, unmarked FullyConnected, which the bf16 hint lowers)."""
    import openvino as ov

    from precast.backends.openvino.keep_f32 import BIAS_APART
    from precast.backends.openvino.precision import prepare, restore_marks
    from precast.runtime.exported import dynamic_batch

    mlp, x = zoo.plain_mlp()
    kept = precast.convert(mlp, x, policy="rules", dtype=BF16, exclude_nodes=["linear_3"])
    # a dynamic batch, as precast.compile makes it (a static one lets the plugin fuse the whole MLP in one Subgraph)
    ov_model, graph_module, _ = convert(dynamic_batch(kept.program))
    made, _ = prepare(ov_model, "bf16", graph_module=graph_module)
    ov.save_model(made, str(tmp_path / "form.xml"), compress_to_fp16=False)
    core = ov.Core()
    read = core.read_model(str(tmp_path / "form.xml"))
    assert not [op for op in read.get_ordered_ops() if "DisableConstantFolding_0" in op.get_rt_info()]
    assert restore_marks(read) == 4  # the bias's Reshape, the three bf16 weights' casts
    apart = [op for op in read.get_ordered_ops() if op.get_friendly_name().endswith(BIAS_APART)]
    assert len(apart) == 1 and "DisableConstantFolding_0" in apart[0].get_rt_info()

    def linear_3(model) -> str:
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
        for op in compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            if info["layerType"].astype(str) == "FullyConnected" and "linear_3/" in info[
                "originalLayersNames"
            ].astype(str):
                return info["runtimePrecision"].astype(str)
        raise AssertionError("no FullyConnected runs linear_3")

    if native():
        assert linear_3(read) == "f32"
        assert linear_3(core.read_model(str(tmp_path / "form.xml"))) == "bf16"  # the marks lost: lowered
