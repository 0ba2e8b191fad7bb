"""benchmarks/llm_decode_weights.py in --quick mode on precast's OpenVINO forms (bf16 and int8 weights, one
thread, no anchor): both rows measured, the int8 program stores and reads fewer bytes, the ratio against bf16 is
the one the table states; no timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openvino")


def test_weight_format_of_a_form_name():
    from precast.bench.decode_forms import WEIGHTS, weight_format_of

    assert weight_format_of("precast_torch_int8") == "int8"
    assert weight_format_of("precast_openvino_int4") == "int4"
    assert weight_format_of("precast_openvino_int8a") == "int8-asym"
    assert weight_format_of("precast_torch") is None and weight_format_of("precast_torch_autotune") is None
    assert {weight_format_of(n) for n in WEIGHTS} == {"int8", "int8-asym", "int4"}


def test_quick_openvino_bf16_and_int8(tmp_path):
    from benchmarks import llm_decode_weights

    argv = [
        "--quick",
        "--forms",
        "precast_openvino",
        "precast_openvino_int8",
        "--threads",
        "1",
        "--repeats",
        "2",
    ]
    argv += ["--steps", "2", "--no-rss", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]
    assert llm_decode_weights.main(argv) == 0
    payload = json.loads((tmp_path / "llm_decode_weights.json").read_text())
    assert not payload["errors"], payload["errors"]
    runs, forms = payload["runs"]["1"], payload["forms"]
    assert set(runs) == {"precast_openvino", "precast_openvino_int8"}
    bf16, int8 = forms["precast_openvino"], forms["precast_openvino_int8"]
    assert int8["stored_bytes"]["weights"] < 0.75 * bf16["stored_bytes"]["weights"]
    assert int8["read_bytes"] < bf16["read_bytes"]
    assert "weights int8" in int8["note"]
    (target,) = [t for t in payload["targets"] if t["against"] == "precast_openvino"]
    ratio = runs["precast_openvino"]["decode_ms"] / runs["precast_openvino_int8"]["decode_ms"]
    assert target["form"] == "precast_openvino_int8" and target["target"] == 1.4
    assert target["speed_ratio"] == round(ratio, 3)
    assert "precast_openvino_int8" in (tmp_path / "llm_decode_weights.md").read_text()
