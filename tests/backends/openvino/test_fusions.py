"""The rotary embedding in the form OpenVINO fuses (``precast/backends/openvino/fusions.py``).

The module here has transformers' rotary embedding (``x * cos + rotate_half(x) * sin`` on the query and key
projections, cos/sin from fp32 positions), converted with policy "torch" in bf16: the projections are bf16, the
tables fp32, each product promotes. References: the decomposed program before the rewrite (bitwise: the rewrite
computes the same values), the converted program run eagerly (OpenVINO's kernels against torch's, f32 hint:
1e-5 relative to the output's largest magnitude, as the other OpenVINO tests), and the same compile without the
rewrite (which OpenVINO does not fuse).
"""

from __future__ import annotations

import copy
import platform
import warnings

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import openvino as ov  # noqa: E402
import openvino.opset13 as ops  # noqa: E402

import precast  # noqa: E402
import precast.backends.openvino.convert as ov_convert  # noqa: E402
from precast.backends.openvino.fusions import fold_scalar_casts, rotation_reads_promoted  # noqa: E402
from precast.backends.openvino.precision import native_bf16  # noqa: E402

H, D, E = 2, 8, 16
X86 = platform.machine().lower() in ("x86_64", "amd64")  # OpenVINO's CPU plugin registers RoPEFusion there


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(torch.nn.Module):
    """Query and key projections with transformers' rotary embedding, then attention. ``half``: where
    ``rotate_half`` splits (D // 2 is the rotation; anything else is not); ``cos_bf16``: the cos table cast to
    bf16, so that product does not promote."""

    def __init__(self, half: int = D // 2, cos_bf16: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(E, H * D)
        self.k = torch.nn.Linear(E, H * D)
        self.o = torch.nn.Linear(H * D, E)
        self.half = half
        self.cos_bf16 = cos_bf16
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        freqs = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        if self.cos_bf16:
            cos = cos.to(torch.bfloat16)
        q = self.q(x).view(b, s, H, D).transpose(1, 2)
        k = self.k(x).view(b, s, H, D).transpose(1, 2)
        q = q * cos + rotate_half(q, self.half) * sin
        k = k * cos + rotate_half(k, self.half) * sin
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, H * D))


def program(module: torch.nn.Module, policy: str | None = "torch") -> torch.export.ExportedProgram:
    seq = torch.export.Dim("seq", min=2, max=32)
    ep = torch.export.export(module, (torch.randn(1, 5, E),), dynamic_shapes={"x": {1: seq}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if policy is None:
            return precast.convert(ep, policy=None).program
        return precast.convert(ep, policy=policy, dtype=torch.bfloat16).program


@pytest.fixture(scope="module")
def converted() -> torch.export.ExportedProgram:
    return program(Rotary())


def inputs(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, s, E, generator=g) for s in (5, 9, 2)[:n]]


def test_the_rotation_reads_the_promoted_value_bitwise(converted):
    """Both rotations rewritten (q and k): one cast of the bf16 projection feeds the cos product and the rotation,
    the products read no bf16 value, and the graph computes bitwise what it did."""
    before = converted.run_decompositions().module()
    after = copy.deepcopy(before)
    assert rotation_reads_promoted(after) == 2
    casts = [n for n in after.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    wide = [n for n in casts if n.kwargs.get("dtype") == torch.float32 and len(n.users) == 3]
    assert len(wide) == 2
    for n in after.graph.nodes:
        if n.target == torch.ops.aten.mul.Tensor and any(
            a.target == torch.ops.aten.cat.default for a in n.args if isinstance(a, torch.fx.Node)
        ):
            assert all(a.meta["val"].dtype == torch.float32 for a in n.args if isinstance(a, torch.fx.Node))
    with torch.no_grad():
        for x in inputs():
            assert torch.equal(after(x), before(x))


class RotateInput(torch.nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + rotate_half(x, D // 2) * sin


def test_a_rotated_input_is_cast_after_the_inputs():
    """``x`` a program input (bf16, the tables fp32): rewritten, the inputs still first, bitwise the same."""
    args = (torch.randn(1, H, 5, D).bfloat16(), torch.randn(1, 1, 5, D), torch.randn(1, 1, 5, D))
    before = torch.export.export(RotateInput(), args).run_decompositions().module()
    after = copy.deepcopy(before)
    assert rotation_reads_promoted(after) == 1
    ops = [n.op for n in after.graph.nodes]
    assert ops[:3] == ["placeholder"] * 3 and "placeholder" not in ops[3:]
    assert torch.equal(after(*args), before(*args))


@pytest.mark.parametrize(
    "module, policy",
    [(Rotary(half=3), "torch"), (Rotary(), None), (Rotary(cos_bf16=True), "torch")],
    ids=["not-a-half-rotation", "already-fp32", "cos-product-in-bf16"],
)
def test_other_programs_are_left_alone(module, policy):
    """A split that is not the half rotation, products that promote nothing (fp32 throughout), or a cos product
    computed in bf16 (reading x in fp32 would change its rounding): unchanged."""
    gm = program(module, policy).run_decompositions().module()
    code = gm.code
    assert rotation_reads_promoted(gm) == 0
    assert gm.code == code


def runtime_layers(model) -> list[str]:
    return [
        op.get_rt_info()["layerType"].astype(str)
        for op in model.compiled.get_runtime_model().get_ordered_ops()
    ]


def near(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 outputs (the last projection is bf16): within 2**-7 of the largest magnitude, two bf16 ulps there
    (OpenVINO's bf16 matmuls accumulate in another order than torch's)."""
    got, want = got.float(), want.float()
    return got.shape == want.shape and bool((got - want).abs().max() <= 2**-7 * want.abs().max())


@pytest.mark.skipif(not X86, reason="OpenVINO's CPU plugin fuses RoPE on x86-64")
def test_openvino_fuses_the_rotary_embedding(converted, monkeypatch):
    """One RoPE layer per rotation, every layer running the plan (f32 hint: the dtypes the program states), the
    outputs the converted program's; without the rewrite OpenVINO runs the rotation as separate element-wise
    layers, and computes the same outputs. The program's own decision records stay as they were."""
    records = {n.name: copy.deepcopy(n.meta.get("custom")) for n in converted.graph.nodes}
    model = precast.compile(converted, backend="openvino", precision_hint="f32", dynamic=False, warn=False)
    assert runtime_layers(model).count("RoPE") == 2
    # every layer as planned; where OpenVINO has no native bf16 its bf16 matmuls run in fp32 (and only those)
    emulated = [x for x in model.plan.overridden if x.planned == ("bf16",) and x.runtime == ("fp32",)]
    assert model.plan.overridden == ([] if native_bf16(ov.Core()) else emulated), model.plan.summary()
    assert {n.name: n.meta.get("custom") for n in converted.graph.nodes} == records
    monkeypatch.setattr(ov_convert, "rotation_reads_promoted", lambda gm: 0)
    unfused = precast.compile(converted, backend="openvino", precision_hint="f32", dynamic=False, warn=False)
    if native_bf16(ov.Core()):
        # the control: the bf16 casts around the rotation keep OpenVINO from fusing it without the rewrite (where
        # OpenVINO has no native bf16 it computes those ops in f32 and drops the casts: it fuses either way)
        assert runtime_layers(unfused).count("RoPE") == 0
    eager = converted.module()
    with torch.no_grad():
        for x in inputs():
            got, want = model(x), eager(x)
            assert got.dtype == want.dtype == torch.bfloat16
            assert near(got, want) and near(got, unfused(x))


def test_scalar_casts_fold_where_exact_and_only_on_data():
    """``-1`` cast to f32 and multiplied into data: folded (OpenVINO had marked it a decompression, which kept it a
    Convert). A rounding cast (0.1 to bf16) and a cast a weight's decompression reads (its scale): kept. The model
    computes the same outputs."""
    x = ops.parameter([2, 4], ov.Type.f32, name="x")
    minus_one = ops.convert(ops.constant(-1, ov.Type.i32), "f32")
    negated = ops.multiply(x, minus_one)
    tenth = ops.convert(ops.constant(0.1, ov.Type.f32), "bf16")
    scaled = ops.convert(ops.multiply(ops.convert(x, "bf16"), tenth), "f32")
    weight = ops.convert(ops.constant([[1, 2, 3, 4]] * 4, ov.Type.u8), "f32")
    scale = ops.convert(ops.constant(3, ov.Type.u8), "f32")
    projected = ops.matmul(x, ops.multiply(weight, scale), False, True)
    model = ov.Model([negated, scaled, projected], [x])
    before = ov.Core().compile_model(model.clone(), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert fold_scalar_casts(model) == 1
    kept = [
        op.get_input_element_type(0).get_type_name()
        for op in model.get_ordered_ops()
        if op.get_type_name() == "Convert" and op.input_value(0).get_node().get_type_name() == "Constant"
    ]
    assert sorted(kept) == ["f32", "u8", "u8"]  # 0.1 -> bf16 rounds; the weight and its scale
    after = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    feed = torch.randn(2, 4).numpy()
    for a, b in zip(after(feed).values(), before(feed).values(), strict=True):
        assert (a == b).all()
