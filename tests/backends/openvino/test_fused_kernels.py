"""OpenVINO's fused f32 kernels (RMS, RoPE) accepted where they run ops precast's plan keeps fp32
(precast.backends.openvino.fused_kernels), and the default call on a decoder plan.

The rules are tested on every CPU with stubbed runtime-model ops (what OpenVINO reports for a layer: its type, its
inputs' element types, the layers they come from) and a hand-built FX graph (what the plan does with the layer's
output). The default call's choice is tested where OpenVINO reports native bf16 (its default inference precision:
``native_bf16(core)``): a bf16 Llama plan compiles with the bf16 hint, no layer overridden, the fused layers
accepted, and its logits within the tolerance stated there of the plan as written (the f32 hint) against fp32;
elsewhere the f32 hint, as ``test_precision.py`` holds.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import openvino as ov  # noqa: E402

import precast  # noqa: E402
from precast.backends.openvino.fused_kernels import accepted, rounded_next  # noqa: E402
from precast.backends.openvino.plan_check import HintFallbackWarning, PlanOverrideWarning  # noqa: E402
from precast.backends.openvino.precision import native_bf16  # noqa: E402

aten = torch.ops.aten
BF16 = torch.bfloat16


# ---- the program: is the layer's output rounded next? ----------------------------------------------------------
def rms_graph(reader: str) -> dict[str, torch.fx.Node]:
    """``normed = x * r``; ``out = gamma * normed`` (the RMS kernel's scale); then ``reader`` of ``out``: a cast to
    bf16 through a view ("cast"), an fp32 add ("add"), or a cast to fp16 ("fp16")."""
    g = torch.fx.Graph()
    x, r = g.placeholder("x"), g.placeholder("r")
    gamma = g.get_attr("gamma")
    normed = g.create_node("call_function", aten.mul.Tensor, (x, r), name="mul")
    out = g.create_node("call_function", aten.mul.Tensor, (gamma, normed), name="mul_1")
    g.call_function(aten._assert_tensor_metadata.default, (normed,))  # export's dtype check: computes nothing
    if reader == "add":
        g.output(g.call_function(aten.add.Tensor, (out, x)))
    else:
        view = g.call_function(aten.view.default, (out, [1, -1]))
        dtype = torch.float16 if reader == "fp16" else BF16
        g.output(g.call_function(aten._to_copy.default, (view,), {"dtype": dtype}))
    return {n.name: n for n in g.nodes}


def test_rounded_next_follows_views_and_the_rms_scale_to_the_cast():
    nodes = rms_graph("cast")
    assert rounded_next(["mul"], nodes, BF16, scaled=True)
    assert not rounded_next(["mul"], nodes, BF16)  # the gamma multiply counts only for the RMS kernel
    assert rounded_next(["mul", "mul_1"], nodes, BF16)  # a layer that names both multiplies
    assert not rounded_next(["mul"], rms_graph("add"), BF16, scaled=True)  # an fp32 reader: not rounded
    assert not rounded_next(["mul"], rms_graph("fp16"), BF16, scaled=True)  # rounded, to another dtype
    assert not rounded_next(["missing"], nodes, BF16, scaled=True)


# ---- the runtime layer: stubs of what OpenVINO reports ---------------------------------------------------------
class Layer:
    """A runtime-model op as the plan check reads it: its layer type, its inputs (element type, source layer)."""

    def __init__(self, layer_type: str, inputs: list[tuple[ov.Type, Layer | None]] = ()):
        self.layer_type, self.inputs = layer_type, list(inputs)

    def get_rt_info(self) -> dict:
        class Value(str):
            def astype(self, _):
                return str(self)

        return {"layerType": Value(self.layer_type)}

    def get_input_size(self) -> int:
        return len(self.inputs)

    def get_input_element_type(self, i: int) -> ov.Type:
        return self.inputs[i][0]

    def input_value(self, i: int):
        layer = self.inputs[i][1] or Layer("Input")

        class Port:
            def get_node(self):
                return layer

        return Port()


F32, BF = ov.Type.f32, ov.Type.bf16


def test_accepted_rope_reads_cos_and_sin_in_f32():
    nodes = rms_graph("cast")
    rope = Layer("RoPE", [(BF, Layer("Reshape")), (F32, Layer("Reshape")), (F32, Layer("Reshape"))])
    why = accepted(rope, "RoPE", ("bf16",), ["mul_1"], nodes)
    assert why.startswith("OpenVINO's fused RoPE kernel computes in f32") and "on entry" not in why
    rounded_sin = Layer("RoPE", [(BF, None), (F32, None), (BF, None)])
    assert accepted(rounded_sin, "RoPE", ("bf16",), ["mul_1"], nodes) == ""
    assert accepted(rope, "RoPE", ("bf16",), ["mul_1"], rms_graph("add")) == ""


def test_accepted_rms_says_its_input_is_rounded_on_entry():
    nodes = rms_graph("cast")
    from_f32 = Layer("RMS", [(BF, Layer("Reorder", [(F32, Layer("Eltwise"))]))])
    why = accepted(from_f32, "RMS", ("bf16",), ["mul"], nodes)
    assert "accumulates and scales in f32" in why and "1 input(s) rounded to bf16 on entry" in why
    from_bf16 = Layer("RMS", [(BF, Layer("FullyConnected"))])
    assert "on entry" not in accepted(from_bf16, "RMS", ("bf16",), ["mul"], nodes)
    # only the f32 kernels: a FullyConnected or element-wise layer that lowers a plan-fp32 op stays an override
    assert accepted(Layer("FullyConnected", [(BF, None)]), "FullyConnected", ("bf16",), ["mul"], nodes) == ""
    assert accepted(Layer("Eltwise", [(BF, None)]), "Eltwise", ("bf16",), ["mul"], nodes) == ""


# ---- the default call on a bf16 decoder plan ---------------------------------------------------------------------
NATIVE = native_bf16(ov.Core())


@pytest.fixture(scope="module")
def decoder():
    """The harness's tiny Llama decoder (seeded), its fp32 program, and its bf16 plans (policy torch, KV cache
    bf16) with bf16 and int8-asym weights."""
    from precast.bench.decode import model as decode_model

    shape = decode_model.QUICK
    module = decode_model.llama(shape)
    ep = decode_model.export_decoder(module, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {
            fmt: precast.convert(ep, policy="torch", dtype=BF16, cache_dtype=BF16, weight_format=fmt).program
            for fmt in (None, "int8-asym")
        }
    return shape, ep, plans


def logits(model, shape, steps: int = 4) -> torch.Tensor:
    """A seeded prompt of 8 tokens, then ``steps`` single tokens: each call's last logits, stacked."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, shape.vocab, (1, 8 + steps), generator=g)
    out = [model(input_ids=ids[:, :8], cache_position=torch.arange(8))[0, -1]]
    for i in range(8, 8 + steps):
        out.append(model(input_ids=ids[:, i : i + 1], cache_position=torch.tensor([i]))[0, -1])
    return torch.stack(out).float()


@pytest.mark.skipif(not NATIVE, reason="OpenVINO's default is f32 on a CPU without native bf16")
@pytest.mark.parametrize("fmt", [None, "int8-asym"])
def test_default_call_runs_the_bf16_form_of_a_decoder_plan(decoder, fmt):
    """Native bf16: the default call keeps the bf16 hint (it used to fall back to f32, one HintFallbackWarning),
    overrides no layer, accepts OpenVINO's fused RMS and RoPE layers (named in plan.accepted and in the summary,
    without a warning), runs every int8 weight compressed, and lands within 1.5x the plan-as-written's (f32 hint)
    distance to the fp32 model's logits (relative max error; measured 1.06x (int8-asym) and 1.30x (bf16 weights) on an AVX512-BF16 EPYC)."""
    shape, ep, plans = decoder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = precast.compile(plans[fmt], backend="openvino")
        written = precast.compile(plans[fmt], backend="openvino", precision_hint="f32")
    assert not [w for w in caught if issubclass(w.category, (HintFallbackWarning, PlanOverrideWarning))]
    plan = model.plan
    assert plan.hint == "bf16" and plan.fallback == "" and plan.overridden == [], plan.summary()
    assert model.runtime_precision() == "bf16"
    assert {layer.layer_type for layer in plan.accepted} == {"RMS", "RoPE"}
    assert sum(layer.layer_type == "RMS" for layer in plan.accepted) == 2 * shape.layers + 1
    assert f"accepted {len(plan.accepted)} fused layer(s)" in plan.summary()
    assert len(plan.to_dict()["accepted"]) == len(plan.accepted)
    assert model.weights.complete and written.weights.complete
    # every Linear with a bf16 weight reads it as a compressed weight (precision.weights_read_compressed: the
    # same kernel on the same weight, measured faster than the weight read directly)
    bf16_linears = sum(
        n.target is torch.ops.aten.linear.default
        and n.args[1].op == "placeholder"  # a stored weight (an int8 one is dequantized first)
        and n.args[1].meta["val"].dtype == BF16
        for n in plans[fmt].graph.nodes
    )
    if fmt is None:
        assert bf16_linears == 7 * shape.layers + 1
        assert f"; {bf16_linears} bf16 weight read(s) as compressed weights" in plan.form, plan.form
    else:
        assert bf16_linears == 0 and "compressed weights" not in plan.form, plan.form
    with torch.no_grad():
        want = logits(ep.module(), shape)
    got, as_written = logits(model, shape), logits(written, shape)
    scale = want.abs().max()
    err, err_written = (
        ((got - want).abs().max() / scale).item(),
        ((as_written - want).abs().max() / scale).item(),
    )
    assert err <= 1.5 * err_written, (err, err_written)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
