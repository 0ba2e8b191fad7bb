"""benchmarks/llm_decode.py in --quick mode on its eager variants (no AOTInductor compile): the table, the
files and the targets section are written; no timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


def test_llm_decode_quick_eager(tmp_path):
    from benchmarks import llm_decode

    argv = ["--quick", "--variant", "eager_fp32", "eager_bf16", "eager_autocast", "--threads", "1"]
    argv += ["--repeats", "1", "--steps", "1", "--no-rss", "--profile", "--out", str(tmp_path)]
    assert llm_decode.main(argv) == 0
    payload = json.loads((tmp_path / "llm_decode.json").read_text())
    runs = payload["runs"]["1"]
    assert set(runs) == {"eager_fp32", "eager_bf16"}  # eager autocast fails on the fp32 static cache
    assert "index_copy_" in payload["variants"]["eager_autocast"]["error"]
    assert payload["variants"]["eager_bf16"]["read_bytes"] < payload["variants"]["eager_fp32"]["read_bytes"]
    assert payload["accuracy"]["eager_bf16"]["cosine_vs_fp32"] > 0.99
    assert payload["profiles"]["kernels"] == {}  # no compiled variant
    assert {r["gemm"] for r in payload["profiles"]["gemv"]["1"]} >= {"q/o proj", "lm_head"}
    text = (tmp_path / "llm_decode.md").read_text()
    assert "decode ms/token" in text and payload["machine"]["cpu"] in text


def test_the_in_process_anchor_needs_the_anchor_in_the_same_run(tmp_path):
    """openvino_anchor_inprocess runs the IR openvino_anchor exported: alone, it is a row error, and the other
    variants still run."""
    from benchmarks import llm_decode

    argv = ["--quick", "--variant", "eager_fp32", "openvino_anchor_inprocess", "--threads", "1"]
    argv += ["--repeats", "1", "--steps", "1", "--no-rss", "--out", str(tmp_path)]
    assert llm_decode.main(argv) == 0
    payload = json.loads((tmp_path / "llm_decode.json").read_text())
    assert set(payload["runs"]["1"]) == {"eager_fp32"}
    assert (
        "needs openvino_anchor in the same run" in payload["variants"]["openvino_anchor_inprocess"]["error"]
    )


def test_interleaved_samples_every_form_in_turn_and_reports_failures():
    from precast.bench import decode

    calls = []

    class Form:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def warm(self):
            if self.fail:
                raise RuntimeError("no such kernel\nsecond line")

        def sample(self, steps, threads):
            calls.append(self.name)
            return 1.0, {"a": 2.0, "b": 4.0}[self.name] + len(calls) * 0.001

    out, failed = decode.interleaved(
        {"a": Form("a"), "bad": Form("bad", fail=True), "b": Form("b")}, 1, 3, 2, lambda m: None
    )
    assert calls == ["a", "b"] * 3  # repeat by repeat, each form once: load hits all alike
    assert failed == {"bad": "RuntimeError: no such kernel"}
    assert out["a"]["decode_ms"] == 2.003 and out["b"]["decode_ms"] == 4.004  # medians
    assert len(out["a"]["decode_samples_ms"]) == 3


def test_read_bytes_counts_weights_whole_one_embedding_row_and_the_cache():
    from precast.bench import decode_model

    state = {
        "model.embed_tokens.weight": torch.zeros(100, 8),  # one row per token: 32 bytes
        "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8, dtype=torch.bfloat16),  # 256
        "static_cache.layers.0.keys": torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16),  # 128, cache
        "model.rotary_emb.inv_freq": torch.zeros(4),  # neither
    }
    held, read = decode_model.read_bytes(state)
    assert held == {"weights": 100 * 8 * 4 + 256, "cache": 128}
    assert read == 32 + 256 + 128


def test_anchor_environment_pins_what_optimum_intel_needs():
    from precast.bench import decode_anchor

    cmds = [" ".join(c) for c in decode_anchor.anchor_env_commands("/tmp/env", "/w/torch.whl")]
    assert cmds[0] == "python3.11 -m venv /tmp/env"
    assert any("/w/torch.whl" in c for c in cmds)  # torch CPU first: optimum-intel must not pull a CUDA one
    assert any("transformers<5.6" in c and "optimum-intel[openvino]==2.2.*" in c for c in cmds)
    assert "openvino==2026.4.1" in cmds[3]
    assert cmds[-1].endswith("uninstall -y -q torchvision")  # its CUDA build breaks import optimum.intel


def test_bench_llm_quick_eager_rows_and_a_missing_anchor_is_a_row_error(tmp_path, monkeypatch):
    from precast.bench import decode, decode_anchor, decode_model

    monkeypatch.setattr(decode_anchor, "ANCHOR_ENV", str(tmp_path / "no-env"))
    monkeypatch.delenv("PRECAST_OV_ANCHOR_PYTHON", raising=False)
    payload = decode.run_decode_bench(
        decode_model.QUICK, [1], 1, 1, forms=("eager_fp32", "eager_bf16", "openvino_anchor")
    )
    assert set(payload["runs"][1]) == {"eager_fp32", "eager_bf16"}
    assert "no anchor environment" in payload["errors"]["openvino_anchor"]
    assert payload["forms"]["eager_bf16"]["read_bytes"] * 2 == pytest.approx(
        payload["forms"]["eager_fp32"]["read_bytes"], rel=0.01
    )
    assert isinstance(payload["load_start"], list) and isinstance(payload["load_end"], list)
    text = decode.decode_markdown(payload)
    assert "| 1 | eager_bf16 |" in text and "no anchor environment" in text


def test_bench_llm_bad_option_is_one_line(capsys):
    from precast.cli import main

    assert main(["bench", "--llm", "--repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert "--repeats" in err and "Traceback" not in err
