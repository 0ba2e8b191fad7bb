"""precast bench: the harness logic on small models (speed targets are printed by benchmarks/, never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from precast import bench, zoo


def test_autocast_as_disables_and_retargets_regions():
    model, inputs = zoo.small_mlp(2)
    with torch.no_grad():
        with bench.autocast_as("cpu", None, enabled=False):
            fp32 = model(*inputs)
        plain = zoo.MLP(64, depth=3, autocast=False).eval()
        plain.load_state_dict(model.state_dict())
        assert torch.equal(fp32, plain(*inputs))
        with bench.autocast_as("cpu", torch.float16):
            half = model(*inputs)
    assert torch.autocast is torch.amp.autocast  # restored
    assert not torch.equal(half, fp32) and not torch.equal(half, model(*inputs))


def test_resize_batch_keeps_kinds():
    x, ids = bench.resize_batch((torch.randn(1, 5), torch.randint(0, 9, (2, 3))), 4)
    assert x.shape == (4, 5) and x.dtype == torch.float32
    assert ids.shape == (4, 3) and ids.dtype == torch.int64 and int(ids.max()) < 9


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
    paths = bench.write_outputs(results, tmp_path, bench.machine_info())
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["variant"] for r in data["results"]] == ["eager_fp32", "eager_autocast"]
    assert "| seed | 3 | eager_autocast |" in (tmp_path / "bench.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png") in paths and (tmp_path / "bench.png").stat().st_size > 1000


def test_unknown_model_is_one_line_error(capsys):
    from precast.cli import main

    assert main(["bench", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) ['nope']" in err and err.count("\n") == 1


@pytest.mark.aoti
def test_cast_kernels_and_memory_of_packages(converted_a, compiled_a, aoti_cache, tmp_path):
    """The default export re-casts weights every forward; precast's package keeps only the input/output casts."""
    import precast

    model, inputs, _ = converted_a
    default = precast.compile(
        torch.export.export(model, inputs, strict=False), cache_dir=aoti_cache, progress=False
    )
    assert bench.aoti_cast_kernels(compiled_a.package_path) <= 2  # x to bf16, logits to fp32
    assert bench.aoti_cast_kernels(default.package_path) > bench.aoti_cast_kernels(compiled_a.package_path)
    rss = bench.load_rss_mb(compiled_a.package_path, inputs, tmp_path)
    print(f"\nRSS after load of the small precast package: {rss} MB")
    assert rss is not None and rss > 0
