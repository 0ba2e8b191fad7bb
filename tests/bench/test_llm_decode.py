"""benchmarks/llm_decode.py in --quick mode on its eager variants (no AOTInductor compile): the table, the
files and the targets section are written; no timing is asserted."""

from __future__ import annotations

import json

import pytest

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
