"""``precast.compile``'s form chosen for the CPU (issue 34 item 4), and freezing's folded constants recomputed at
load so that form keeps ``load_weights``.

Without AMX, Inductor's C++ GEMM template decodes bf16 slowest (fp32 FMA on converted values), and Inductor's
default ATen ``mm`` streams a bf16 weight at half the rate oneDNN's blocked kernels do at M=1
(docs/benchmarks/llm_decode.md). ``mode="auto"`` (the default) picks oneDNN's packed linear there and the
template on AMX; a blocked weight is recorded as a recipe and recomputed from the program's weights at load.
"""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.backends.cache import MANIFEST, cache_key
from precast.backends.forms import choose_form, matmul_weight_bytes
from precast.backends.packed import match_folded, recipe_sources, replay, same_bits
from precast.cpu import capabilities as cpu_capabilities
from tests.conftest import small_model

NO_AMX = {"avx512_bf16": True, "avx512_fp16": True, "amx_tile": False, "amx_bf16": False}
AMX = {**NO_AMX, "amx_tile": True, "amx_bf16": True, "amx_fp16": True}
AVX2 = {"avx2": True}


def linear_program(dtype: torch.dtype, lm_head_fp32: bool = False) -> torch.export.ExportedProgram:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 64, bias=False).to(dtype)
            self.b = torch.nn.Linear(64, 64).to(torch.float32 if lm_head_fp32 else dtype)

        def forward(self, x):
            h = self.a(x.to(dtype))
            return self.b(h.to(self.b.weight.dtype))

    return torch.export.export(M().eval(), (torch.randn(2, 32),))


# ---- the choice, as a table of capabilities (no compile) --------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,caps,form",
    [
        (torch.bfloat16, AMX, "gemm-template"),
        (torch.bfloat16, NO_AMX, "onednn-packed"),
        (torch.bfloat16, AVX2, "default"),
        (torch.float16, AMX, "gemm-template"),
        (torch.float16, NO_AMX, "onednn-packed"),
        (torch.float16, {**AMX, "amx_fp16": False}, "onednn-packed"),  # AMX-BF16 only (Sapphire Rapids)
        (torch.float32, AMX, "default"),
        (torch.float32, NO_AMX, "default"),
    ],
)
def test_form_follows_the_weight_dtype_and_the_cpu(dtype, caps, form):
    chosen = choose_form(linear_program(dtype), caps)
    assert chosen.name == form
    assert chosen.why  # recorded on the compiled model
    if form == "gemm-template":
        assert chosen.configs["max_autotune"] and chosen.configs["max_autotune_gemm_backends"] == "CPP"
    if form == "onednn-packed":
        assert chosen.configs == {"freezing": True}


def test_form_weighs_matmul_bytes_not_op_counts():
    # one bf16 linear of 32x64 (4 KiB) and one fp32 of 64x64 (16 KiB): most bytes fp32, the fp32 form
    ep = linear_program(torch.bfloat16, lm_head_fp32=True)
    assert matmul_weight_bytes(ep) == {torch.bfloat16: 32 * 64 * 2, torch.float32: 64 * 64 * 4}
    assert choose_form(ep, NO_AMX).name == "default"
    assert choose_form(ep, {}, device="cuda").name == "default"


def test_capabilities_are_torchs():
    caps = cpu_capabilities()
    reported = dict(torch.cpu.get_capabilities())
    assert caps["avx512_bf16"] == reported.get("avx512_bf16")
    assert caps["amx_tile"] == (bool(reported.get("amx_tile")) and torch.cpu._init_amx())


def test_the_form_is_in_the_cache_key():
    ep = linear_program(torch.bfloat16)
    keys = {cache_key(ep, {"precast.form": f}, True) for f in ("default", "onednn-packed", "gemm-template")}
    assert len(keys) == 3


# ---- recipes (no compile) --------------------------------------------------------------------------------------
def test_a_recipe_replays_onednns_blocked_weight_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    permute = {"op": "aten::permute.default", "args": [{"ref": "l.weight"}, [1, 0]], "kwargs": {}}
    back = {"op": "aten::permute.default", "args": [permute, [1, 0]], "kwargs": {}}
    recipe = {"op": "mkldnn::_reorder_linear_weight.default", "args": [back, 4], "kwargs": {}}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    assert recipe_sources(recipe) == {"l.weight"}
    assert replay(recipe, {"l.weight": w}).is_mkldnn
    assert same_bits(replay(recipe, {"l.weight": w}), packed)
    other = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    assert not same_bits(replay(recipe, {"l.weight": other}), packed)
    # matched only when the replay gives back every bit; a recipe over a stranger, or none, is unmatched
    folded = {
        "_frozen_param1": (recipe, packed),
        "_frozen_param2": (recipe, torch.ops.mkldnn._reorder_linear_weight(other, 4)),
        "_frozen_param3": (None, packed),
        "_frozen_param4": ({"ref": "stranger"}, w),
        "_frozen_param5": (permute, w.t()),
    }
    recipes, unmatched = match_folded(folded, {"l.weight": w})
    assert recipes == {"_frozen_param1": recipe, "_frozen_param5": permute}
    assert unmatched == ["_frozen_param2", "_frozen_param3", "_frozen_param4"]
    assert not same_bits(w.t(), w.t().contiguous())  # strides are part of what the code reads


# ---- one compile in the oneDNN form ------------------------------------------------------------------------------
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_capabilities().get("avx512_bf16"), reason="oneDNN's packed bf16 form needs AVX512-BF16"
)


@pytest.fixture(scope="module")
def onednn(aoti_cache):
    model, inputs = small_model(0)
    res = precast.convert(model, inputs)
    caps = cpu_capabilities()
    cm = precast.compile(res.program, cache_dir=aoti_cache, progress=False)
    return model, inputs, res, cm, caps


@pytest.mark.aoti
def test_default_compile_is_the_form_this_cpu_implies(onednn):
    _, _, res, cm, caps = onednn
    assert cm.form == choose_form(res.program, caps).to_dict()
    if caps.get("amx_tile") and caps.get("amx_bf16"):
        assert cm.form["name"] == "gemm-template"
    elif caps.get("avx512_bf16"):
        assert cm.form["name"] == "onednn-packed"
    else:
        assert cm.form["name"] == "default"
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    assert manifest["form"] == cm.form


@needs_onednn_bf16
@pytest.mark.aoti
def test_onednn_form_reads_blocked_weights_recomputed_at_load(onednn, aoti_cache):
    model, inputs, res, cm, caps = onednn
    if cm.form["name"] != "onednn-packed":
        pytest.skip("this CPU compiles the C++ GEMM template by default (AMX): tested in test_aoti_packed")
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    assert manifest["weights"]["external"]  # the blocked copies are not in the package: precast makes them
    blocked = {n for n, t in cm._constants.items() if t.is_mkldnn}
    assert blocked and blocked <= set(manifest["packed"]["folded"])
    weights = {n for n, t in res.program.state_dict.items() if t.dim() == 2}
    assert weights == set().union(*(recipe_sources(manifest["packed"]["folded"][n]) for n in blocked))
    assert not weights & set(cm._constants)  # the originals are read only through their blocked copies
    # the same code with the blocked weights inside the .so (Inductor's own freezing): bit for bit
    inside = precast.compile(
        res.program,
        cache_dir=aoti_cache,
        mode="default",
        inductor_configs={"freezing": True, "aot_inductor.package_constants_in_so": True},
        progress=False,
    )
    with torch.no_grad():
        assert torch.equal(cm(*inputs), inside(*inputs))


@needs_onednn_bf16
@pytest.mark.aoti
def test_onednn_form_load_weights_equals_a_fresh_compile(onednn, aoti_cache):
    model, inputs, _, cm, _ = onednn
    model_b, _ = small_model(1)
    fresh = precast.compile(precast.convert(model_b, inputs).program, cache_dir=aoti_cache, progress=False)
    with torch.no_grad():
        before = cm(*inputs).clone()
        cm.load_weights(model_b.state_dict())
        assert torch.equal(cm(*inputs), fresh(*inputs)) and not torch.equal(before, fresh(*inputs))
        cm.load_weights(model.state_dict())
        assert torch.equal(cm(*inputs), before)
