"""``precast.compile``'s form: measured on the machine it runs on (issue 40), by the CPU's capabilities under
``PRECAST_FORM=flags`` (issue 34 item 4; the test suite's setting, tests/conftest.py), and freezing's folded
constants recomputed at load so every form keeps ``load_weights``.

Without AMX, Inductor's C++ GEMM template decoded bf16 slowest on a Xeon, and Inductor's default ATen ``mm`` streams
a bf16 weight at half the rate oneDNN's blocked kernels do at M=1 (docs/benchmarks/llm_decode.md); on a Zen 4 at
2 threads the same table chose oneDNN at 0.75x the template. ``mode="auto"`` times the candidates once per machine,
thread count and shape set (the timing logic is tested here with injected timings); a blocked weight is recorded as
a recipe and recomputed from the program's weights at load.
"""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.backends.aoti import form_timing, forms
from precast.backends.aoti.forms import as_configured, choose_form, form_of, matmul_weight_bytes, pick
from precast.backends.aoti.package_cache import MANIFEST, cache_key
from precast.backends.aoti.packed import match_folded, recipe_sources, replay, same_bits
from precast.cpu import capabilities as cpu_capabilities
from precast.errors import PrecastError
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


# ---- the measured choice, with injected timings (no compile) ---------------------------------------------------
# the Zen 4 (AVX512-BF16, no AMX) at 2 threads, ms per decode token: the flags table chose onednn-packed
ZEN4 = {"default": 30.2, "onednn-packed": 27.9, "gemm-template": 21.6}


class Timings:
    """A ``measure`` that returns fixed seconds per form and counts its calls."""

    def __init__(self, ms: dict[str, float | str]):
        self.ms, self.calls = ms, []

    def __call__(self, dtype, shapes, candidates):
        self.calls.append((dtype, shapes, candidates))
        return {n: (t / 1e3 if isinstance(t, float) else t) for n, t in self.ms.items() if n in candidates}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The measured path, on a quiet machine (nobody else busy during the timing or after; tests change it)."""
    monkeypatch.delenv(forms.FORM_ENV, raising=False)
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: 0.0)
    monkeypatch.setattr(forms, "busy_now", lambda: 0.0)
    return tmp_path


def test_measured_choice_beats_the_flags_table_where_it_is_wrong(measured):
    ep = linear_program(torch.bfloat16)
    timings = Timings(ZEN4)
    form = choose_form(ep, NO_AMX, cache_dir=measured, measure=timings)
    assert form.name == "gemm-template" and form.configs == forms.FORM_CONFIGS["gemm-template"]
    assert form.record["times_ms"] == ZEN4 and form.record["threads"] == torch.get_num_threads()
    assert {"load", "cores_left", "under_load", "m"} <= set(form.record) and form.record["m"] == 1
    assert "gemm-template is the fastest" in form.why and "21.6 ms" in form.why
    ((dtype, shapes, candidates),) = timings.calls
    assert dtype == torch.bfloat16 and shapes == ((64, 32), (64, 64)) and candidates == forms.CANDIDATES
    assert forms.flags_form(torch.bfloat16, NO_AMX).name == "onednn-packed"  # what the table said


def test_a_cached_choice_is_reused_without_timing(measured):
    ep = linear_program(torch.bfloat16)
    timings = Timings(ZEN4)
    first = choose_form(ep, cache_dir=measured, measure=timings)
    again = choose_form(ep, cache_dir=measured, measure=timings)
    assert len(timings.calls) == 1 and again.to_dict() == first.to_dict()
    data = json.loads((measured / form_timing.FORMS_FILE).read_text())  # JSON, never a pickle
    assert data["version"] == form_timing.FORMS_VERSION and len(data["entries"]) == 1
    # another thread count, dtype or shape set is another measurement
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)
    try:
        choose_form(ep, cache_dir=measured, measure=timings)
    finally:
        torch.set_num_threads(threads)
    choose_form(linear_program(torch.float16), cache_dir=measured, measure=timings)
    assert len(timings.calls) == 3


def test_load_during_the_timing_is_recorded(measured, monkeypatch):
    monkeypatch.setattr(form_timing.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: None)  # no /proc/stat: load average
    form = choose_form(linear_program(torch.bfloat16), cache_dir=measured, measure=Timings(ZEN4))
    assert form.record["under_load"] and form.record["load"] == 64.0
    assert "measured under load: load average 64.0" in form.why


def test_ties_go_to_the_simplest_and_failures_are_never_chosen():
    assert pick({"default": 10.0, "onednn-packed": 9.9, "gemm-template": 12.0})[0] == "default"  # within 2%
    assert pick({"default": 10.0, "onednn-packed": 9.0})[0] == "onednn-packed"
    assert pick({"default": 10.0, "gemm-template": "AOTInductor failed: ..."})[0] == "default"
    assert pick({"default": "failed", "gemm-template": "failed"})[0] == "default"
    assert pick(ZEN4, exclude=("gemm-template",))[0] == "onednn-packed"


def test_streamed_weights_exclude_the_template(measured):
    form = choose_form(
        linear_program(torch.bfloat16), cache_dir=measured, measure=Timings(ZEN4), exclude=("gemm-template",)
    )
    assert form.name == "onednn-packed" and form.record["times_ms"]["gemm-template"] == 21.6


def test_fp32_programs_and_other_devices_are_never_timed(measured):
    timings = Timings(ZEN4)
    assert choose_form(linear_program(torch.float32), cache_dir=measured, measure=timings).name == "default"
    assert choose_form(linear_program(torch.bfloat16), device="cuda", measure=timings).name == "default"
    assert not timings.calls and not (measured / form_timing.FORMS_FILE).exists()


def _int_program(fmt: str = "int8") -> torch.export.ExportedProgram:
    return precast.convert(
        linear_program(torch.bfloat16),
        policy="torch",
        weights=precast.WeightOptions(format=fmt),
        verify=False,
    ).program


@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_int_weight_programs_are_measured_with_their_formats(measured, monkeypatch, fmt):
    """A program whose linears read int8 / int4 weights is timed on a module of its shapes in their formats (before:
    always Inductor's defaults, ATen's weight-only kernels, while the C++ GEMM template runs a 1024 x 2816 int8 GEMV
    in 0.4x their time on a Zen 4); the formats are in the choice's key and its why; the suite's ``flags`` keeps
    the defaults."""
    ep = _int_program(fmt)
    assert forms.int_weights(ep) == (torch.bfloat16, {(64, 32): fmt, (64, 64): fmt})
    timings = Timings(ZEN4)
    form = choose_form(ep, cache_dir=measured, measure=timings)
    assert form.name == "gemm-template" and f"matmul weights in {fmt} (bfloat16 activations)" in form.why
    ((dtype, shapes, _),) = timings.calls
    assert dtype == torch.bfloat16 and shapes == ((64, 32), (64, 64))
    float_key = forms.choice_key(torch.bfloat16, shapes, 1, forms.CANDIDATES)
    assert forms.choice_key(torch.bfloat16, shapes, 1, forms.CANDIDATES, (fmt, fmt)) != float_key
    monkeypatch.setenv(forms.FORM_ENV, "flags")
    assert choose_form(ep, AMX, measure=timings).name == "default" and len(timings.calls) == 1
    monkeypatch.setenv(forms.FORM_ENV, "gemm-template")
    assert choose_form(ep, measure=timings).name == "gemm-template"


def test_the_synthetic_module_stores_the_int_formats():
    """What the int measurement compiles: the synthetic linears with their weights in the program's formats."""
    ep = torch.export.export(
        form_timing._Weights(torch.bfloat16, ((64, 32), (48, 64))).eval(),
        (torch.randn(2, 32).to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16)),
    )
    stored = form_timing._stored_in(ep, ("int8", "float"))
    assert forms.int_weights(stored) == (torch.bfloat16, {(64, 32): "int8"})
    assert forms.matmul_weight_bytes(stored) == {torch.bfloat16: 48 * 64 * 2}


def test_precast_form_overrides_and_a_bad_one_is_one_line(measured, monkeypatch):
    timings = Timings(ZEN4)
    monkeypatch.setenv(forms.FORM_ENV, "onednn-packed")
    assert choose_form(linear_program(torch.bfloat16), measure=timings).name == "onednn-packed"
    monkeypatch.setenv(forms.FORM_ENV, "flags")
    assert choose_form(linear_program(torch.bfloat16), AMX, measure=timings).name == "gemm-template"
    monkeypatch.setenv(forms.FORM_ENV, "fastest")
    with pytest.raises(PrecastError, match=r"PRECAST_FORM='fastest': not a form") as err:
        choose_form(linear_program(torch.bfloat16), measure=timings)
    assert "\n" not in str(err.value) and not timings.calls


@pytest.mark.parametrize(
    "text", ["not json", '{"version": 1, "entries": []}', '{"version": 1, "entries": {"k": 1}}']
)
def test_a_malformed_choice_cache_is_measured_again(measured, text):
    ep = linear_program(torch.bfloat16)
    timings = Timings(ZEN4)
    key = forms.choice_key(torch.bfloat16, ((64, 32), (64, 64)), torch.get_num_threads(), forms.CANDIDATES)
    (measured / form_timing.FORMS_FILE).write_text(text.replace('"k"', f'"{key}"'))
    with pytest.warns(UserWarning, match="form cache"):
        assert choose_form(ep, cache_dir=measured, measure=timings).name == "gemm-template"
    assert len(timings.calls) == 1
    assert key in json.loads((measured / form_timing.FORMS_FILE).read_text())["entries"]


# ---- the form recorded is the one the final configs compile (issue 40 item 9) -----------------------------------
@pytest.mark.parametrize(
    "form,configs,recorded",
    [
        ("onednn-packed", {"freezing": False}, "default"),
        ("onednn-packed", {}, "onednn-packed"),
        ("default", {"freezing": True}, "onednn-packed"),
        ("gemm-template", {"max_autotune": False}, "default"),
        ("gemm-template", {"max_autotune_gemm_backends": "ATEN,CPP"}, "max-autotune"),
        (
            "default",
            {"max_autotune": True, "max_autotune_gemm_backends": "CPP", "freezing": True},
            "gemm-template+freezing",
        ),
    ],
)
def test_the_recorded_form_is_what_the_merged_configs_compile(form, configs, recorded):
    from precast.backends.aoti.compiler import compile_configs

    chosen = forms.Form(form, dict(forms.FORM_CONFIGS[form]), "chosen")
    merged = compile_configs("auto", configs, chosen)
    final = as_configured(chosen, merged)
    assert form_of(merged) == final.name == recorded
    assert final.why == "chosen" if recorded == form else recorded in final.why


# ---- recipes (no compile) --------------------------------------------------------------------------------------
@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT",
)
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


@pytest.mark.aoti
def test_int8_weights_in_the_gemm_template_form_keep_their_values_and_load_weights(aoti_cache, monkeypatch):
    """One compile of int8 weights in the C++ GEMM template form (its own int8 kernel, the scale an epilogue):
    within bf16's rounding of the program run eagerly (the eager dequantized weight is rounded to bf16 first; the
    kernel scales fp32 sums), the package holds no weight, and ``load_weights`` with another model's weights gives
    that model's program's values."""
    monkeypatch.setenv(forms.FORM_ENV, "gemm-template")
    model, inputs = small_model(0)
    w = precast.WeightOptions(format="int8")
    res = precast.convert(model, inputs, policy="torch", weights=w, verify=False)
    cm = precast.compile(res.program, cache_dir=aoti_cache, progress=False)
    assert cm.form["name"] in ("gemm-template", "max-autotune")  # ATen is added beside the template for int8
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    assert manifest["weights"]["external"]

    def near(got: torch.Tensor, want: torch.Tensor) -> bool:
        return float((got.float() - want.float()).abs().max()) <= 2e-2 * float(want.float().abs().max())

    with torch.no_grad():
        before = cm(*inputs).clone()
        assert near(before, res.program.module()(*inputs))
        model_b, _ = small_model(1)
        other = precast.convert(model_b, inputs, policy="torch", weights=w, verify=False).program
        cm.load_weights(model_b.state_dict())
        after = cm(*inputs)
        assert near(after, other.module()(*inputs)) and not near(after, before)


@pytest.mark.aoti
def test_measure_forms_times_what_precast_compiles(tmp_path):
    """One real timing (one candidate, one tiny weight: one compile): compiled by precast.compile into a scratch
    cache that is deleted after."""
    from precast.backends.aoti.compiler import compile as aoti_compile

    times = form_timing.measure_forms(torch.bfloat16, ((16, 32),), {"default": {}}, tmp_path, aoti_compile)
    assert set(times) == {"default"} and isinstance(times["default"], float) and times["default"] > 0
    assert not list((tmp_path / "tmp").glob("forms.*"))


def test_other_processes_busy_during_the_timing_is_under_load(measured, monkeypatch):
    """What other processes took while precast timed (all CPU time less this process's and its children's:
    ``runtime/threads.others_busy``, tested in tests/runtime/test_threads.py), not the load average, which counts
    precast's own compiles just before the timing."""
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: 1.25)
    monkeypatch.setattr(form_timing.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    form = choose_form(linear_program(torch.bfloat16), cache_dir=measured, measure=Timings(ZEN4))
    assert form.record["under_load"] and form.record["others_busy"] == 1.25
    assert "other processes busy on 1.25 core(s)" in form.why
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: 0.1)
    torch.set_num_threads(torch.get_num_threads())
    calm = choose_form(linear_program(torch.float16), cache_dir=measured, measure=Timings(ZEN4))
    assert not calm.record["under_load"]


# ---- per thread count, and provisional under load (issue 49 item 3) ---------------------------------------------
def test_the_choice_is_measured_and_keyed_at_the_compiles_thread_count(measured):
    """``threads=`` (what ``precast.compile(threads=)`` passes) is the count measured at and keyed by, whatever
    this process's own count: a process at 2 threads never takes the choice measured at 1."""
    ep = linear_program(torch.bfloat16)
    before = torch.get_num_threads()
    at = {}
    for n in (1, 2):
        # 1 thread: default fastest; 2: the template
        timings = Timings({**ZEN4, "default": {1: 10.0, 2: 40.0}[n]})
        at[n] = choose_form(ep, cache_dir=measured, measure=timings, threads=n)
        assert len(timings.calls) == 1 and at[n].record["threads"] == n
        assert f"measured on this CPU at {n} thread(s)" in at[n].why
    assert (at[1].name, at[2].name) == ("default", "gemm-template")
    assert torch.get_num_threads() == before
    again = Timings(ZEN4)
    assert choose_form(ep, cache_dir=measured, measure=again, threads=2).to_dict() == at[2].to_dict()
    assert not again.calls
    entries = json.loads((measured / form_timing.FORMS_FILE).read_text())["entries"]
    assert sorted(e["threads"] for e in entries.values()) == [1, 2]


def test_a_choice_timed_under_load_is_timed_again_when_the_machine_is_quiet(measured, monkeypatch):
    """Load 7 gave default 62 ms, packed 2 ms, template 61 ms (issue 49): such a choice serves while the machine
    stays busy and is replaced by the first compile that finds it quiet; a quiet choice is kept."""
    ep = linear_program(torch.bfloat16)
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: 1.5)
    skewed = Timings({"default": 62.0, "onednn-packed": 2.0, "gemm-template": 61.0})
    first = choose_form(ep, cache_dir=measured, measure=skewed, threads=1)
    assert first.name == "onednn-packed" and first.record["under_load"]
    assert "provisional, timed again when the machine is quiet" in first.why
    # still busy: the provisional choice serves, no timing
    monkeypatch.setattr(forms, "busy_now", lambda: 1.0)
    quiet = Timings(ZEN4)
    assert choose_form(ep, cache_dir=measured, measure=quiet, threads=1).to_dict() == first.to_dict()
    assert not quiet.calls
    monkeypatch.setattr(forms, "busy_now", lambda: 0.1)  # quiet now: timed again, replaced
    monkeypatch.setattr(forms, "others_busy", lambda before, after, wall: 0.1)
    second = choose_form(ep, cache_dir=measured, measure=quiet, threads=1)
    assert len(quiet.calls) == 1 and second.name == "gemm-template" and not second.record["under_load"]
    assert choose_form(ep, cache_dir=measured, measure=quiet, threads=1).to_dict() == second.to_dict()
    assert len(quiet.calls) == 1  # a quiet choice is kept
    entries = json.loads((measured / form_timing.FORMS_FILE).read_text())["entries"]
    assert [e["times_ms"] for e in entries.values()] == [ZEN4]


def test_without_proc_stat_quiet_means_the_load_average_within_the_cores_left(monkeypatch):
    monkeypatch.setattr(forms, "busy_now", lambda: None)
    monkeypatch.setattr(forms, "cores", lambda: 4)
    monkeypatch.setattr(form_timing.os, "getloadavg", lambda: (2.5, 2.5, 2.5))
    assert forms.quiet_now(1) and not forms.quiet_now(2)  # 3 cores left, then 2
