"""precast bench: the harness logic on small models (speed targets are printed by benchmarks/, never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from precast import bench
from precast.bench import factories
from precast.bench.models import MLP
from tests import models


def test_autocast_switch_disables_and_retargets_regions_of_one_instance():
    model, inputs = models.small_mlp(2)
    other, _ = models.small_mlp(2)
    with torch.no_grad():
        bf16 = model(*inputs)
        with bench.regions(model, enabled=False) as n:
            fp32 = model(*inputs)
            assert n == 1 and other.autocast  # only this instance
        plain = MLP(64, depth=3, autocast=False).eval()
        plain.load_state_dict(model.state_dict())
        assert torch.equal(fp32, plain(*inputs))
        with bench.regions(model, dtype=torch.float16):
            half = model(*inputs)
    assert (model.autocast, model.device_type, model.dtype) == (True, "cpu", torch.bfloat16)  # restored
    assert torch.autocast is torch.amp.autocast  # torch itself is never patched
    assert not torch.equal(half, fp32) and not torch.equal(half, bf16) and not torch.equal(bf16, fp32)


def test_fp32_reference_of_a_model_without_the_switch_inlines_its_regions():
    """No autocast attributes: the reference is the exported program with its regions inlined, which computes
    what the model computes with its region off (the same aten ops in fp32)."""
    model, (ids,) = models.tied()
    assert factories.switches(model) == []
    run, note = bench.fp32_reference(model, (ids,))
    assert "regions inlined" in note
    with torch.no_grad():
        got = run()
        want = model.out(torch.tanh(model.mid(model.emb(ids))))
        low = model(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(low, want)  # the model as written does run in bf16


def test_resize_batch_keeps_kinds():
    x, ids = bench.resize_batch((torch.randn(1, 5), torch.randint(0, 9, (2, 3))), 4)
    assert x.shape == (4, 5) and x.dtype == torch.float32
    assert ids.shape == (4, 3) and ids.dtype == torch.int64 and int(ids.max()) < 9


def test_specs_short_names_and_factories():
    model, (x,) = bench.build("mlp", 3)  # precast.bench.models:mlp(batch=3)
    assert isinstance(model, MLP) and x.shape == (3, 1024)
    model, (x,) = bench.build("precast.examples:seed_model", 5)  # no batch parameter: inputs resized
    assert type(model).__name__ == "SeedModel" and x.shape == (5, 128)
    assert bench.default_models() == ["mlp"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown model(s) ['nope']"),
        ("no_such_module_precast:f", "cannot import module 'no_such_module_precast'"),
        ("precast.examples:nope", "module 'precast.examples' has no callable 'nope'"),
    ],
)
def test_bad_model_is_one_line_error(capsys, spec, message):
    from precast.cli import main

    assert main(["bench", "--model", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eager_harness_smoke(tmp_path):
    results = bench.run_bench(
        ["seed"], [3], variants=("eager_fp32", "eager_autocast"), repeats=3, measure_rss=False, progress=False
    )
    by = {r.variant: r for r in results}
    assert set(by) == {"eager_fp32", "eager_autocast"} and all(r.batch == 3 for r in results)
    assert by["eager_fp32"].max_abs_err == 0.0 and by["eager_fp32"].casts_per_forward == 0
    assert 0 < by["eager_autocast"].max_abs_err < 0.1 and by["eager_autocast"].cosine > 0.999
    assert by["eager_autocast"].casts_per_forward >= 4  # 2 weights, 2 biases, 1 input: cast every forward
    assert len(by["eager_autocast"].samples_ms) == 3 and by["eager_autocast"].latency_ms > 0
    assert all(r.note == "" for r in results)  # the seed model has the autocast switch
    paths = bench.write_outputs(results, tmp_path, bench.machine_info())
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["variant"] for r in data["results"]] == ["eager_fp32", "eager_autocast"]
    assert "| seed | 3 | eager_autocast |" in (tmp_path / "bench.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png") in paths and (tmp_path / "bench.png").stat().st_size > 1000


def test_user_factory_without_the_switch():
    results = bench.run_bench(
        ["tests.models:tied"],
        [2],
        variants=("eager_fp32", "eager_autocast"),
        repeats=2,
        measure_rss=False,
        progress=False,
    )
    by = {r.variant: r for r in results}
    assert by["eager_fp32"].max_abs_err == 0.0 and "regions inlined" in by["eager_fp32"].note
    assert by["eager_autocast"].max_abs_err > 0 and "as written" in by["eager_autocast"].note


@pytest.mark.aoti
def test_cast_kernels_and_memory_of_packages(converted_a, compiled_a, compiled_a_in_so, aoti_cache, tmp_path):
    """The default export re-casts weights every forward; precast's package keeps only the input/output casts."""
    import precast

    model, inputs, _ = converted_a
    default = precast.compile(
        torch.export.export(model, inputs, strict=False), cache_dir=aoti_cache, progress=False
    )
    assert bench.aoti_cast_kernels(compiled_a.package_path) <= 2  # x to bf16, logits to fp32
    assert bench.aoti_cast_kernels(default.package_path) > bench.aoti_cast_kernels(compiled_a.package_path)
    rss = bench.load_rss_mb(compiled_a_in_so.package_path, inputs, tmp_path)  # loads it without precast
    print(f"\nRSS after load of the small precast package: {rss} MB")
    assert rss is not None and rss > 0


def test_variants_come_from_the_engine_registry(monkeypatch):
    """Every engine of precast.backends.registry has its variants (its own baselines, or precast_<name>); a
    variant's engine missing its extra is that row's one line naming the pip install, the others still run; the
    generic row is precast's conversion on that engine, computing what the converted program computes."""
    import sys

    import precast
    from precast.backends.registry import NAMES
    from precast.bench import variants

    assert set(variants.ENGINE_VARIANTS) == set(NAMES)
    assert variants.ENGINE_VARIANTS["executorch"] == ("precast_executorch",)
    assert set(variants.VARIANTS) == {"eager_fp32", "eager_autocast", *variants.ENGINE_OF}
    model, inputs = models.small_mlp(2)
    want = precast.convert(model, inputs).program.module()(*inputs)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # ONNX Runtime "not installed"
    fns, facts = variants.build_variants(
        model, inputs, ("eager_fp32", "ort_precast", "precast_executorch"), cache_dir=None
    )
    assert set(fns) == {"eager_fp32", "precast_executorch"}
    error = facts["ort_precast"].error
    assert error.startswith("PrecastError: bench ort_precast: onnxruntime is not installed; ") and (
        "pip install 'precast[onnx]'" in error
    )
    got = fns["precast_executorch"]()
    assert got.dtype == want.dtype and got.shape == want.shape
    # outputs up to 0.14: measured 1.95e-3 apart (bf16 matmuls, another engine's kernels: a few bf16 steps)
    torch.testing.assert_close(got, want, rtol=0, atol=4e-3)
    assert facts["precast_executorch"].compile_s is not None and facts["precast_executorch"].error is None
