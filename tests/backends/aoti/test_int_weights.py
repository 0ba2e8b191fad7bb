"""int8 / int8-asym / int4 weights read in the kernel by ``precast.compile`` (issue 41;
``backends/aoti/int_weights.py``).

The program's form is fixed: a linear's weight stored as int8 ``q`` + ``scale`` (per output channel), int8-asym
``q`` (uint8) + ``zero`` + ``scale`` (per output channel) or int4 ``packed`` + ``zero`` + ``scale`` (grouped),
dequantized in the graph. ``precast.compile`` rewrites each such linear on its private copy to torch's weight-only
kernels (``_weight_int8pack_mm``; for int8-asym on ``q - 128`` with a rank-1 correction for the zero point;
``_weight_int4pack_mm_for_cpu`` on a weight packed by ``_convert_weight_to_int4pack_for_cpu``) and names, in one
warning line, those it cannot.

The programs here are built by hand (a module whose forward does exactly the documented ops, exported), with the
parts computed by ``precast.quant.formats.quantize`` and their ``derive`` tags recorded as a conversion records
them, so ``load_weights`` re-quantizes through the real ``stored_value``. One compile for the file: fp32 and bf16
activations, int8, int8-asym (rows not centred on zero: the correction matters) and int4 (both unpack spellings),
and an int4 weight no kernel takes (N=8). int8-asym's per-layer accuracy and a scale no kernel takes are checked on
a second program, exported but not compiled.
"""

from __future__ import annotations

import json
import warnings
import zipfile

import pytest
import torch

import precast
from precast.backends.aoti.int_rewrite import (
    apply_int_weights,
    int4pack_recipe,
    int8_correction_recipe,
    int8_shift_recipe,
    scales_zeros_recipe,
)
from precast.backends.aoti.int_weights import int_kernel_configs, plan_int_weights
from precast.backends.aoti.package_cache import MANIFEST
from precast.backends.aoti.packed import replay
from precast.ir.program import META_KEY, constant_sources
from precast.quant.formats import WeightFormat, dequantize, derive_tag, quantize

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16
INT8 = WeightFormat("int8")
INT8_ASYM = WeightFormat("int8-asym")
# name -> (format, compute dtype, [N, K], bias); in forward order: fp32 int8, fp32 int4, fp32 int8-asym, bf16 int8,
# bf16 int4, bf16 int8-asym, and an int4 weight with N=8 (torch's int4 packing wants N a multiple of 16):
# dequantized in the graph, and warned
LAYERS = {
    "a": (INT8, F32, (64, 64), True),
    "b": (WeightFormat("int4", 32), F32, (64, 64), False),
    "f": (INT8_ASYM, F32, (64, 64), True),
    "d": (INT8, BF16, (64, 64), True),
    "e": (WeightFormat("int4", 64), BF16, (64, 64), False),
    "g": (INT8_ASYM, BF16, (64, 64), False),
    "c": (WeightFormat("int4", 32), BF16, (8, 64), False),
}
KERNEL = ("a", "b", "f", "d", "e", "g")  # the linears a low-bit kernel reads
OFFSET = {"f": 0.05, "g": -0.05}  # rows not centred on zero: int8-asym's zero point far from 128
# bf16 rounding: the kernels keep the weight exact where the graph rounds each (q - z) * s to bf16, over seven
# chained layers with outputs up to ~5 (measured: 0.027 at most, 0.6% of the largest output)
TOL = {"rtol": 2e-2, "atol": 4e-2}


def originals(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, _, shape, bias) in LAYERS.items():
        out[f"{name}.weight"] = torch.randn(shape, generator=g) / 8 + OFFSET.get(name, 0.0)
        if bias:
            out[f"{name}.bias"] = torch.randn(shape[0], generator=g) / 8
    return out


class Hand(torch.nn.Module):
    """The converted program's form, by hand: each weight's parts as buffers, dequantized as documented."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        for name, (fmt, dt, _, bias) in LAYERS.items():
            for role, part in quantize(weights[f"{name}.weight"], fmt, dt).items():
                self.register_buffer(f"{name}_{role}", part)
            if bias:
                self.register_buffer(f"{name}_bias", weights[f"{name}.bias"].to(dt))

    def weight(self, name: str) -> torch.Tensor:
        fmt, dt, (n, k), _ = LAYERS[name]
        if fmt.kind == "int8":
            return aten.mul.Tensor(
                aten._to_copy.default(getattr(self, f"{name}_q"), dtype=dt), getattr(self, f"{name}_scale")
            )
        if fmt.kind == "int8-asym":
            return asym_weight(self, name, dt)
        packed, g = getattr(self, f"{name}_q"), fmt.group
        view = (
            aten.reshape.default if name == "b" else aten.view.default
        )  # the brief's spelling and the pass's
        q = aten.stack.default(
            [aten.bitwise_and.Scalar(packed, 15), aten.bitwise_right_shift.Tensor_Scalar(packed, 4)], -1
        )
        q = aten._to_copy.default(view(q, [n, k // g, g]), dtype=dt)
        w = aten.sub.Tensor(q, aten._to_copy.default(getattr(self, f"{name}_zero"), dtype=dt))
        return view(aten.mul.Tensor(w, getattr(self, f"{name}_scale")), [n, k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, (_, dt, _, bias) in LAYERS.items():
            x = aten.linear.default(
                x.to(dt), self.weight(name), getattr(self, f"{name}_bias") if bias else None
            )
        return x


def asym_weight(mod: torch.nn.Module, name: str, dt: torch.dtype) -> torch.Tensor:
    """int8-asym's dequantization as the conversion writes it: ``(q.to(dt) - zero.to(dt)) * scale``."""
    q = aten._to_copy.default(getattr(mod, f"{name}_q"), dtype=dt)
    z = aten._to_copy.default(getattr(mod, f"{name}_zero"), dtype=dt)
    return aten.mul.Tensor(aten.sub.Tensor(q, z), getattr(mod, f"{name}_scale"))


def program(weights: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """``Hand`` exported, with each stored constant's source recorded as a conversion records it (custom meta on
    the nodes reading it: what ``constant_sources`` reads back)."""
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(Hand(weights), (x,))
    records = {}
    for name, (fmt, dt, _, bias) in LAYERS.items():
        for role in fmt.parts():
            part_dtype = dt if role == "scale" else (torch.int8 if fmt.kind == "int8" else torch.uint8)
            records[f"{name}_{role}"] = [
                f"{name}.weight",
                "float32",
                str(part_dtype)[6:],
                derive_tag(fmt, dt, role),
            ]
        if bias:
            records[f"{name}_bias"] = [f"{name}.bias", "float32", str(dt)[6:]]
    by_input = ep.graph_signature.inputs_to_buffers
    for node in ep.graph.nodes:
        if node.op == "placeholder" and by_input.get(node.name) in records:
            for user in node.users:
                entry = user.meta.setdefault("custom", {}).setdefault(META_KEY, {})
                entry.setdefault("constants", {})[by_input[node.name]] = records[by_input[node.name]]
    return ep


@pytest.fixture(scope="module")
def hand():
    weights = originals(0)
    ep = program(weights)
    return weights, ep, ep.example_inputs[0][0]


@pytest.fixture(scope="module")
def compiled(hand, aoti_cache):
    """The file's one compile (and the warnings it gave)."""
    _, ep, _ = hand
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = precast.compile(ep, cache_dir=aoti_cache, progress=False)
    lines = [str(w.message) for w in caught if "int weight" in str(w.message)]
    return cm, lines


def kernel_calls(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out[str(n.target)] = out.get(str(n.target), 0) + 1
    return out


# ---- no compile -------------------------------------------------------------------------------------------------
def test_the_sources_are_recorded_as_a_conversion_records_them(hand):
    _, ep, _ = hand
    sources = constant_sources(ep)
    assert sources["e_q"].derive == "int4g64-bf16.q" and sources["e_q"].original == "e.weight"
    assert sources["a_scale"].derive == "int8-fp32.scale" and sources["d_bias"].derive is None


def test_plan_takes_the_documented_linears_and_names_the_one_no_kernel_takes(hand):
    _, ep, _ = hand
    plan = plan_int_weights(ep)
    assert sorted((r.kind, r.weight, r.zero, r.group, r.dtype) for r in plan.rewrites) == [
        ("int4", "b_q", "b_zero", 32, F32),
        ("int4", "e_q", "e_zero", 64, BF16),
        ("int8", "a_q", None, None, F32),
        ("int8", "d_q", None, None, BF16),
        ("int8-asym", "f_q", "f_zero", None, F32),
        ("int8-asym", "g_q", "g_zero", None, BF16),
    ]
    # nothing of the int8-asym weights runs dequantized (their zero points not either)
    assert sorted(plan.dequantized) == ["c_q", "c_zero"]
    assert plan.dequantized["c_q"] == "int4 N=8 not a multiple of 16 (torch's CPU packing)"
    line = plan.warning(freezing=False)
    assert "\n" not in line and line.startswith(
        "precast.compile: 1 int weight(s) run without a low-bit kernel: c_q"
    )
    assert "dequantized to bfloat16 on every call" in line and "c_zero" not in line
    assert "folded at compile time" in plan.warning(freezing=True)
    key = plan.key()["precast.int_weights"]
    assert key["int4"] == ["b_q:32", "e_q:64"] and key["int8-asym"] == ["f_q", "g_q"] and key["version"] == 2
    assert plan.to_dict()["int8-asym"] == ["f_q", "g_q"] and plan.to_dict()["int8"] == ["a_q", "d_q"]


def test_the_kernels_get_a_gemm_backend_and_stay_on_the_cpu(hand):
    """The C++ GEMM template form lists only CPP: the ATen int kernels would have no choice (measured: "No choices
    to select" on an AVX2 CPU), so ATEN is added; other devices keep the program's dequantization, warned."""
    _, ep, _ = hand
    plan = plan_int_weights(ep)
    template = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    configs, why = int_kernel_configs(template, plan)
    assert configs["max_autotune_gemm_backends"] == "CPP,ATEN" and "ATen" in why
    assert int_kernel_configs({"freezing": True}, plan) == ({"freezing": True}, None)
    assert int_kernel_configs(template, plan_int_weights(ep, "cuda")) == (template, None)
    gpu = plan_int_weights(ep, "cuda")
    assert not gpu.rewrites and "a_q" in gpu.dequantized and "device cuda" in gpu.warning(False)


def test_rewritten_graph_calls_the_int_kernels_and_holds_no_float_weight(hand):
    weights, ep, x = hand
    before = ep.graph_module.code
    rewritten, recipes = apply_int_weights(ep, plan_int_weights(ep))
    assert ep.graph_module.code == before  # the caller's program is never changed
    calls = kernel_calls(rewritten.graph_module)
    assert calls["aten._weight_int8pack_mm.default"] == 4
    assert calls["aten._weight_int4pack_mm_for_cpu.default"] == 2
    assert calls["aten.sum.dim_IntList"] == 2  # int8-asym's correction, one per linear
    assert calls["aten.linear.default"] == 1  # c only
    state = rewritten.state_dict
    assert state["a_q"].dtype == torch.int8 and state["d_q"].dtype == torch.int8
    assert state["f_q.int8s"].dtype == torch.int8 and state["g_q.int8s"].dtype == torch.int8
    assert state["f_zero.int8c"].dtype == F32 and state["g_zero.int8c"].dtype == F32  # the correction: fp32
    assert state["b_q.int4pack"].dtype == torch.uint8 and state["e_q.int4pack"].dtype == torch.uint8
    assert "b_q" not in state and "b_zero" not in state  # read only through their int4pack / int4sz copies
    assert "f_q" not in state and "f_zero" not in state  # read only through their int8s / int8c copies
    for name in KERNEL:
        n, k = LAYERS[name][2]
        assert not [t for t, v in state.items() if v.is_floating_point() and v.numel() >= n * k], name
    # the kernels' int weights are read by the kernels only, never through a cast to float
    kernels = {aten._weight_int8pack_mm.default, aten._weight_int4pack_mm_for_cpu.default}
    by_input = rewritten.graph_signature.inputs_to_buffers
    for node in rewritten.graph.nodes:
        if by_input.get(node.name) in (
            "a_q",
            "d_q",
            "f_q.int8s",
            "g_q.int8s",
            "b_q.int4pack",
            "e_q.int4pack",
        ):
            assert {u.target for u in node.users} <= kernels, node.name
    assert set(recipes) == {"b_q.int4pack", "b_scale.int4sz", "e_q.int4pack", "e_scale.int4sz"} | {
        "f_q.int8s",
        "f_zero.int8c",
        "g_q.int8s",
        "g_zero.int8c",
    }
    torch.testing.assert_close(rewritten.module()(x).float(), ep.module()(x).float(), **TOL)


def test_int4_recipes_follow_torchs_zero_convention():
    """torch's int4 is (q - 8) * scale + zero_float; ours (q - zero) * scale: zero_float = (8 - zero) * scale."""
    w = originals(3)["b.weight"]
    fmt = WeightFormat("int4", 32)
    parts = quantize(w, fmt, F32)
    values = {"p": parts["q"], "z": parts["zero"], "s": parts["scale"]}
    pack = replay(int4pack_recipe("p", 64, 64), values)
    unpacked = torch.stack([parts["q"] & 15, parts["q"] >> 4], -1).reshape(64, 64).to(torch.int32)
    assert torch.equal(pack, aten._convert_weight_to_int4pack_for_cpu(unpacked, 1))
    sz = replay(scales_zeros_recipe("s", "z", 64, 2, F32), values)
    assert sz.shape == (2, 64, 2) and sz.is_contiguous()
    x = torch.randn(3, 64)
    got = aten._weight_int4pack_mm_for_cpu(x, pack, 32, sz)
    torch.testing.assert_close(got, x @ dequantize(parts, fmt, F32).t(), rtol=1e-5, atol=1e-5)


# int8-asym per layer: name -> (dequantized to, scale dtype; the activation and bias in the scale's dtype). "m" is
# a scale no kernel takes (fp32 while the weight is dequantized to bf16): dequantized, and named with its zero point
ASYM = {"p": (F32, F32), "r": (BF16, BF16), "m": (BF16, F32)}
ASYM_TOL = {F32: 1e-5, BF16: 2e-2}  # max |error| / max |output|: fp32's accumulation order; bf16's rounding


def asym_weights(seed: int) -> dict[str, torch.Tensor]:
    """[48, 96] weights whose rows are not centred on zero (+0.05; row 0 all positive: zero point 0)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ASYM:
        w = torch.randn(48, 96, generator=g) / 8 + 0.05
        w[0] = w[0].abs() + 0.01
        out[name] = w
    return out


class Asym(torch.nn.Module):
    """int8-asym linears side by side, one output each (the form of ``asym_weight``), each with a bias."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        for name, (_, sdt) in ASYM.items():
            for role, part in quantize(weights[name], INT8_ASYM, sdt).items():
                self.register_buffer(f"{name}_{role}", part)
            self.register_buffer(f"{name}_bias", (torch.arange(48) / 48).to(sdt))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(
            aten.linear.default(x.to(sdt), asym_weight(self, name, dt), getattr(self, f"{name}_bias"))
            for name, (dt, sdt) in ASYM.items()
        )


@pytest.fixture(scope="module")
def asym():
    """``Asym`` exported (not compiled), its plan and its rewrite."""
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2))
    ep = torch.export.export(Asym(asym_weights(4)), (x,))
    plan = plan_int_weights(ep)
    return ep, x, plan, apply_int_weights(ep, plan)


def test_int8_asym_recipes_shift_q_and_keep_the_correction_in_fp32():
    """``q8 = q - 128`` exactly (int8); ``c = (zero - 128) * scale`` in fp32 (exact: the kernel's correction is
    computed in fp32 and rounded once, whatever the compute dtype)."""
    w = asym_weights(5)["p"]
    for dt in (F32, BF16, torch.float16):
        parts = quantize(w, INT8_ASYM, dt)
        values = {"q": parts["q"], "z": parts["zero"], "s": parts["scale"]}
        q8 = replay(int8_shift_recipe("q"), values)
        assert q8.dtype == torch.int8 and torch.equal(q8.to(torch.int16), parts["q"].to(torch.int16) - 128)
        c = replay(int8_correction_recipe("z", "s", 48), values)
        want = ((parts["zero"].float() - 128) * parts["scale"].float()).reshape(48)
        assert c.dtype == F32 and c.shape == (48,) and torch.equal(c, want)
        assert parts["zero"][0].item() == 0 and c[0] != 0  # the all-positive row: z8 = -128


def test_int8_asym_rewrite_matches_the_program_per_layer(asym):
    """Each int8-asym linear, rewritten to the int8 kernel on ``q - 128`` and the rank-1 correction, gives the
    program's output within ``ASYM_TOL`` (fp32 1e-5, bf16 2e-2 of the largest output); without the correction
    (rows not centred: the zero point far from 128) it would be off by far more."""
    ep, x, plan, (rewritten, recipes) = asym
    assert sorted((r.kind, r.weight, r.zero, r.dtype) for r in plan.rewrites) == [
        ("int8-asym", "p_q", "p_zero", F32),
        ("int8-asym", "r_q", "r_zero", BF16),
    ]
    assert set(recipes) == {"p_q.int8s", "p_zero.int8c", "r_q.int8s", "r_zero.int8c"}
    want, got = ep.module()(x), rewritten.module()(x)
    state = rewritten.state_dict
    for (name, (dt, _)), w, y in zip(ASYM.items(), want, got, strict=True):
        assert y.dtype == w.dtype and y.shape == (2, 5, 48), name
        err = ((y.float() - w.float()).abs().max() / w.float().abs().max()).item()
        if name == "m":  # not rewritten: the same ops
            assert torch.equal(y, w)
            continue
        assert err <= ASYM_TOL[dt], (name, err)
        c, s = state[f"{name}_zero.int8c"], state[f"{name}_scale"].reshape(48)
        zero = ep.state_dict[f"{name}_zero"].reshape(48)
        assert torch.equal(c != 0, zero != 128) and (zero != 128).sum() >= 40, name  # (zero - 128) * scale
        x2d = x.to(dt).reshape(-1, 96)
        bare = aten._weight_int8pack_mm(x2d, state[f"{name}_q.int8s"], s) + state[f"{name}_bias"]
        bare_err = ((bare.float() - w.float().reshape(-1, 48)).abs().max() / w.float().abs().max()).item()
        assert bare_err > 0.1, (name, bare_err)  # the correction is what makes it right


def test_int8_asym_scale_no_kernel_takes_is_named_with_its_zero_point(asym):
    """A scale in another dtype than the weight is dequantized to: one reason naming the weight; its zero point
    listed as "the zero point of" it, and not in the warning line."""
    _, _, plan, _ = asym
    assert plan.dequantized == {
        "m_q": "int8-asym scale float32 [48, 1], dequantized to bfloat16",
        "m_zero": "the zero point of m_q",
    }
    line = plan.warning(freezing=False)
    assert (
        "\n" not in line
        and "1 int weight(s) run without a low-bit kernel: m_q (int8-asym scale float32" in line
    )
    assert "m_zero" not in line and "p_" not in line and "r_" not in line


def test_a_conversions_int8_asym_weights_are_planned():
    """The conversion pass's own int8-asym output (``weight_format="int8-asym"``) is the form the plan takes:
    both linears rewritten, the embedding's parts not listed; the rewrite gives the program's output."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.a = torch.nn.Embedding(40, 64), torch.nn.Linear(64, 32)
            self.head = torch.nn.Linear(32, 8)

        def forward(self, ids):
            return self.head(torch.relu(self.a(self.emb(ids))))

    torch.manual_seed(0)
    model = M().eval()
    with torch.no_grad():
        model.a.weight += 0.05  # rows not centred
    ids = torch.randint(0, 40, (2, 5))
    try:
        res = precast.convert(model, (ids,), weight_format="int8-asym")
    except TypeError:
        pytest.skip("this precast's convert has no weight_format")
    plan = plan_int_weights(res.program)
    assert sorted((r.kind, r.weight, r.zero) for r in plan.rewrites) == [
        ("int8-asym", "a.weight_int8a", "a.weight_int8a_zero"),
        ("int8-asym", "head.weight_int8a", "head.weight_int8a_zero"),
    ]
    assert plan.dequantized == {} and plan.warning(False) is None
    rewritten, _ = apply_int_weights(res.program, plan)
    want, got = res.program.module()(ids), rewritten.module()(ids)
    scale = want.float().abs().max()
    assert ((got.float() - want.float()).abs().max() / scale).item() <= ASYM_TOL[want.dtype]


def test_a_conversions_own_int_weights_are_planned(hand):
    """The conversion pass's output (``weight_format=``), planned without compiling: its linears are taken, its
    embedding (a gather of int rows) is not warned about."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.a, self.head = (
                torch.nn.Embedding(40, 64),
                torch.nn.Linear(64, 32),
                torch.nn.Linear(32, 8),
            )

        def forward(self, ids):
            return self.head(torch.relu(self.a(self.emb(ids))))

    try:
        res = precast.convert(M().eval(), (torch.randint(0, 40, (2, 5)),), weight_format="int4-g32")
    except TypeError:
        pytest.skip("this precast's convert has no weight_format")
    plan = plan_int_weights(res.program)
    assert [(r.kind, r.weight) for r in plan.rewrites] == [("int4", "a.weight_int4")]
    # N=8 (its zero point named with it); the embedding's parts are not listed
    assert sorted(plan.dequantized) == ["head.weight_int4", "head.weight_int4_zero"]
    assert "run without a low-bit kernel: head.weight_int4 (int4 N=8" in plan.warning(False)


# ---- one compile ------------------------------------------------------------------------------------------------
def test_compile_warns_once_naming_the_weight_no_kernel_takes(compiled):
    _, lines = compiled
    assert len(lines) == 1 and "c_q (int4 N=8" in lines[0] and "\n" not in lines[0]
    assert "1 int weight(s)" in lines[0] and "f_" not in lines[0] and "g_" not in lines[0]


def test_compiled_code_calls_the_int_kernels_on_int_constants(compiled):
    cm, _ = compiled
    with zipfile.ZipFile(cm.package_path) as z:
        (wrapper,) = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        code = z.read(wrapper).decode()
    assert code.count("aoti_torch_cpu__weight_int8pack_mm(") == 4  # int8's two, int8-asym's two
    assert code.count("aoti_torch_cpu__weight_int4pack_mm_cpu_tensor(") == 2
    held = cm._constants
    assert held["a_q"].dtype == torch.int8 and held["d_q"].dtype == torch.int8
    assert held["b_q.int4pack"].dtype == torch.uint8 and held["e_q.int4pack"].dtype == torch.uint8
    assert held["f_q.int8s"].dtype == torch.int8 and held["g_q.int8s"].dtype == torch.int8
    assert held["f_zero.int8c"].shape == (64,) and held["g_zero.int8c"].dtype == F32
    for name in KERNEL:  # no float copy of a kernel's weight anywhere among what the model holds
        n, k = LAYERS[name][2]
        assert not [t for t, v in held.items() if v.is_floating_point() and v.numel() >= n * k], name
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    ints = manifest["int_weights"]
    assert (
        ints["int8"] == ["a_q", "d_q"]
        and ints["int4"] == ["b_q", "e_q"]
        and ints["int8-asym"] == ["f_q", "g_q"]
    )
    folded = manifest["packed"]["folded"]
    assert {"b_q.int4pack", "b_scale.int4sz", "e_q.int4pack", "e_scale.int4sz"} <= set(folded)
    assert {"f_q.int8s", "f_zero.int8c", "g_q.int8s", "g_zero.int8c"} <= set(folded)
    # the kernel's group size, a 0-d constant the lowering adds, is handed to the loader as a literal
    literals = [r for r in folded.values() if r["op"] == "aten::scalar_tensor.default"]
    assert sorted(r["args"][0] for r in literals) == [32, 64]
    assert cm.constant_fqns() == sorted(
        ["a_q", "a_scale", "a_bias", "b_q", "b_zero", "b_scale", "d_q", "d_scale", "d_bias", "e_q", "e_zero"]
        + [
            "e_scale",
            "c_q",
            "c_zero",
            "c_scale",
            "f_q",
            "f_zero",
            "f_scale",
            "f_bias",
            "g_q",
            "g_zero",
            "g_scale",
        ]
    )


def test_compiled_outputs_match_the_program(compiled, hand):
    cm, _ = compiled
    weights, ep, x = hand
    rewritten, _ = apply_int_weights(ep, plan_int_weights(ep))
    y = cm(x)
    assert y.dtype == BF16 and y.shape == (2, 3, 8)
    torch.testing.assert_close(y.float(), ep.module()(x).float(), **TOL)
    # the same kernels eagerly (the rewritten program); not the same bits: int8-asym's correction (a sum, a mul, a
    # sub) is fused by Inductor and rounded once, where eager rounds each op's bf16 output
    torch.testing.assert_close(y.float(), rewritten.module()(x).float(), **TOL)
    other = torch.randn(5, 3, 64)  # another batch (dim 0 is dynamic)
    torch.testing.assert_close(cm(other).float(), Hand(weights)(other).float(), **TOL)


def test_load_weights_requantizes_the_originals(compiled, hand):
    """After ``load_weights(B)`` the model serves the program converted from B (the same kernels, the same
    constants as B's rewrite computes them); ``load_weights(A)`` gives back A's outputs bitwise. Runs last: it swaps the shared model's weights."""
    cm, _ = compiled
    weights, ep, x = hand
    before = cm(x)
    new = {
        k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) / 16
        for k, v in weights.items()
    }
    out = cm.load_weights(new)
    assert out == {"loaded": sorted(new), "kept": []}
    ep_new = program(new)
    rewritten, _ = apply_int_weights(ep_new, plan_int_weights(ep_new))
    y = cm(x)
    assert not torch.equal(y, before)
    torch.testing.assert_close(
        y.float(), rewritten.module()(x).float(), **TOL
    )  # see above: not the same bits
    torch.testing.assert_close(y.float(), ep_new.module()(x).float(), **TOL)
    assert torch.equal(cm._constants["d_q"], quantize(new["d.weight"], INT8, BF16)["q"])
    assert torch.equal(cm._constants["e_q.int4pack"], rewritten.state_dict["e_q.int4pack"])
    for made in ("f_q.int8s", "f_zero.int8c", "g_q.int8s", "g_zero.int8c"):  # int8-asym's, from the new parts
        assert torch.equal(cm._constants[made], rewritten.state_dict[made]), made
    cm.load_weights(weights)
    assert torch.equal(cm(x), before)
