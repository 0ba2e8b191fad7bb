"""int8 / int4 weights read in the kernel by ``precast.compile`` (issue 41; ``backends/aoti/int_weights.py``).

The program's form is fixed: a linear's weight stored as int8 ``q`` + ``scale`` (per output channel) or int4
``packed`` + ``zero`` + ``scale`` (grouped), dequantized in the graph. ``precast.compile`` rewrites each such
linear on its private copy to torch's weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``
on a weight packed by ``_convert_weight_to_int4pack_for_cpu``) and names, in one warning line, those it cannot.

The programs here are built by hand (a module whose forward does exactly the documented ops, exported), with the
parts computed by ``precast.ir.weight_formats.quantize`` and their ``derive`` tags recorded as a conversion records
them, so ``load_weights`` re-quantizes through the real ``stored_value``. One compile for the file: fp32 and bf16
activations, int8 and int4 (both unpack spellings), and an int4 weight no kernel takes (N=8).
"""

from __future__ import annotations

import json
import warnings
import zipfile

import pytest
import torch

import precast
from precast.backends.aoti.int_rewrite import apply_int_weights, int4pack_recipe, scales_zeros_recipe
from precast.backends.aoti.int_weights import int_kernel_configs, plan_int_weights
from precast.backends.aoti.package_cache import MANIFEST
from precast.backends.aoti.packed import replay
from precast.ir.program import META_KEY, constant_sources
from precast.ir.weight_formats import WeightFormat, dequantize, derive_tag, quantize

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16
INT8 = WeightFormat("int8")
# name -> (format, compute dtype, [N, K], bias); in forward order: fp32 int8, fp32 int4, bf16 int8, bf16 int4, and
# an int4 weight with N=8 (torch's int4 packing wants N a multiple of 16): dequantized in the graph, and warned
LAYERS = {
    "a": (INT8, F32, (64, 64), True),
    "b": (WeightFormat("int4", 32), F32, (64, 64), False),
    "d": (INT8, BF16, (64, 64), True),
    "e": (WeightFormat("int4", 64), BF16, (64, 64), False),
    "c": (WeightFormat("int4", 32), BF16, (8, 64), False),
}
KERNEL = ("a", "b", "d", "e")  # the linears a low-bit kernel reads
TOL = {
    "rtol": 2e-2,
    "atol": 2e-2,
}  # bf16 rounding (the kernels keep the weight exact, the graph rounds q * s)


def originals(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_, _, shape, bias) in LAYERS.items():
        out[f"{name}.weight"] = torch.randn(shape, generator=g) / 8
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
    assert sorted((r.kind, r.weight, r.group, r.dtype) for r in plan.rewrites) == [
        ("int4", "b_q", 32, F32),
        ("int4", "e_q", 64, BF16),
        ("int8", "a_q", None, F32),
        ("int8", "d_q", None, BF16),
    ]
    assert plan.dequantized["c_q"] == "int4 N=8 not a multiple of 16 (torch's CPU packing)"
    line = plan.warning(freezing=False)
    assert "\n" not in line and line.startswith(
        "precast.compile: 1 int weight(s) run without a low-bit kernel: c_q"
    )
    assert "dequantized to bfloat16 on every call" in line and "c_zero" not in line
    assert "folded at compile time" in plan.warning(freezing=True)
    assert plan.key()["precast.int_weights"]["int4"] == ["b_q:32", "e_q:64"]


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
    assert calls["aten._weight_int8pack_mm.default"] == 2
    assert calls["aten._weight_int4pack_mm_for_cpu.default"] == 2
    assert calls["aten.linear.default"] == 1  # c only
    state = rewritten.state_dict
    assert state["a_q"].dtype == torch.int8 and state["d_q"].dtype == torch.int8
    assert state["b_q.int4pack"].dtype == torch.uint8 and state["e_q.int4pack"].dtype == torch.uint8
    assert "b_q" not in state and "b_zero" not in state  # read only through their int4pack / int4sz copies
    for name in KERNEL:
        n, k = LAYERS[name][2]
        assert not [t for t, v in state.items() if v.is_floating_point() and v.numel() >= n * k], name
    # the kernels' int weights are read by the kernels only, never through a cast to float
    kernels = {aten._weight_int8pack_mm.default, aten._weight_int4pack_mm_for_cpu.default}
    by_input = rewritten.graph_signature.inputs_to_buffers
    for node in rewritten.graph.nodes:
        if by_input.get(node.name) in ("a_q", "d_q", "b_q.int4pack", "e_q.int4pack"):
            assert {u.target for u in node.users} <= kernels, node.name
    assert set(recipes) == {"b_q.int4pack", "b_scale.int4sz", "e_q.int4pack", "e_scale.int4sz"}
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


def test_compiled_code_calls_the_int_kernels_on_int_constants(compiled):
    cm, _ = compiled
    with zipfile.ZipFile(cm.package_path) as z:
        (wrapper,) = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        code = z.read(wrapper).decode()
    assert code.count("aoti_torch_cpu__weight_int8pack_mm(") == 2
    assert code.count("aoti_torch_cpu__weight_int4pack_mm_cpu_tensor(") == 2
    held = cm._constants
    assert held["a_q"].dtype == torch.int8 and held["d_q"].dtype == torch.int8
    assert held["b_q.int4pack"].dtype == torch.uint8 and held["e_q.int4pack"].dtype == torch.uint8
    for name in KERNEL:  # no float copy of a kernel's weight anywhere among what the model holds
        n, k = LAYERS[name][2]
        assert not [t for t, v in held.items() if v.is_floating_point() and v.numel() >= n * k], name
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    assert manifest["int_weights"]["int8"] == ["a_q", "d_q"] and manifest["int_weights"]["int4"] == [
        "b_q",
        "e_q",
    ]
    folded = manifest["packed"]["folded"]
    assert {"b_q.int4pack", "b_scale.int4sz", "e_q.int4pack", "e_scale.int4sz"} <= set(folded)
    # the kernel's group size, a 0-d constant the lowering adds, is handed to the loader as a literal
    literals = [r for r in folded.values() if r["op"] == "aten::scalar_tensor.default"]
    assert sorted(r["args"][0] for r in literals) == [32, 64]
    assert cm.constant_fqns() == sorted(
        ["a_q", "a_scale", "a_bias", "b_q", "b_zero", "b_scale", "d_q", "d_scale", "d_bias", "e_q", "e_zero"]
        + ["e_scale", "c_q", "c_zero", "c_scale"]
    )


def test_compiled_outputs_match_the_program(compiled, hand):
    cm, _ = compiled
    weights, ep, x = hand
    rewritten, _ = apply_int_weights(ep, plan_int_weights(ep))
    y = cm(x)
    assert y.dtype == BF16 and y.shape == (2, 3, 8)
    torch.testing.assert_close(y.float(), ep.module()(x).float(), **TOL)
    # the same kernels eagerly (the rewritten program): the same bits
    assert torch.equal(y, rewritten.module()(x))
    other = torch.randn(5, 3, 64)  # another batch (dim 0 is dynamic)
    torch.testing.assert_close(cm(other).float(), Hand(weights)(other).float(), **TOL)


def test_load_weights_requantizes_the_originals(compiled, hand):
    """After ``load_weights(B)`` the model serves the program converted from B (the same kernels: the same bits);
    ``load_weights(A)`` gives back A's outputs bitwise. Runs last: it swaps the shared model's weights."""
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
    assert torch.equal(y, rewritten.module()(x))
    torch.testing.assert_close(y.float(), ep_new.module()(x).float(), **TOL)
    assert torch.equal(cm._constants["d_q"], quantize(new["d.weight"], INT8, BF16)["q"])
    assert torch.equal(cm._constants["e_q.int4pack"], rewritten.state_dict["e_q.int4pack"])
    cm.load_weights(weights)
    assert torch.equal(cm(x), before)
