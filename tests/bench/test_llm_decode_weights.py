"""benchmarks/llm_decode_weights.py in --quick mode on precast's OpenVINO forms (bf16 and int8 weights, one
thread, no anchor): both rows measured, the int8 program stores and reads fewer bytes, the ratio against bf16 is
the one the table states; no timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openvino")


def test_weight_format_of_a_form_name():
    from precast.bench.decode.forms import WEIGHTS, weight_format_of

    assert weight_format_of("precast_torch_int8") == "int8"
    assert weight_format_of("precast_openvino_int4") == "int4"
    assert weight_format_of("precast_openvino_int8a") == "int8-asym"
    assert weight_format_of("precast_torch") is None and weight_format_of("precast_torch_autotune") is None
    fixed = [n for n in WEIGHTS if not n.endswith("_q4km")]
    assert {weight_format_of(n) for n in fixed} == {"int8", "int8-asym", "int4"}
    with pytest.raises(ValueError, match="layer count"):
        weight_format_of("precast_openvino_q4km")


def test_q4_k_m_rules_pick_llama_cpps_tensors():
    """The mixed plan's rules: int8 for the head and for v_proj / down_proj of exactly the layers llama.cpp's
    Q4_K_M gives more bits (16 layers: 0, 1, 4, 7, 10, 13, 14, 15), int4 for every other weight; the patterns do not
    let layer 1's rule catch layer 11 or 15."""
    import fnmatch

    from precast.bench.decode.forms import weight_format_of
    from precast.quant.presets import q4_k_m_rules

    rules = weight_format_of("precast_torch_q4km", 16)
    assert rules == q4_k_m_rules(16) and list(rules.items())[-1] == ("*", "int4")

    def fmt(name: str) -> str:
        return next(f for p, f in rules.items() if fnmatch.fnmatchcase(name, p))

    more = [i for i in range(16) if fmt(f"model.model.layers.{i}.mlp.down_proj.weight") == "int8"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(16) if fmt(f"model.model.layers.{i}.self_attn.v_proj.weight") == "int8"] == more
    assert fmt("model.model.layers.1.self_attn.q_proj.weight") == "int4"
    assert fmt("model.model.layers.11.self_attn.v_proj.weight") == "int4"
    assert fmt("model.lm_head.weight") == "int8" and fmt("model.model.embed_tokens.weight") == "int4"


def test_quick_openvino_bf16_and_int8(tmp_path):
    from benchmarks import llm_decode_weights

    argv = [
        "--quick",
        "--forms",
        "precast_openvino",
        "precast_openvino_int8",
        "precast_openvino_q4km",
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
    assert set(runs) == {"precast_openvino", "precast_openvino_int8", "precast_openvino_q4km"}
    bf16, int8 = forms["precast_openvino"], forms["precast_openvino_int8"]
    assert int8["stored_bytes"]["weights"] < 0.75 * bf16["stored_bytes"]["weights"]
    assert int8["read_bytes"] < bf16["read_bytes"]
    assert "weights int8" in int8["note"]
    mixed = forms[
        "precast_openvino_q4km"
    ]  # int4 with a few int8 tensors: fewer bytes than int8, more than int4's half
    assert (
        0.5 * int8["stored_bytes"]["weights"]
        < mixed["stored_bytes"]["weights"]
        < int8["stored_bytes"]["weights"]
    )
    assert "Q4_K_M" in mixed["note"]
    (target,) = [
        t
        for t in payload["targets"]
        if t["against"] == "precast_openvino" and t["form"] == "precast_openvino_int8"
    ]
    ratio = runs["precast_openvino"]["decode_ms"] / runs["precast_openvino_int8"]["decode_ms"]
    assert target["form"] == "precast_openvino_int8" and target["target"] == 1.4
    assert target["speed_ratio"] == round(ratio, 3)
    assert "precast_openvino_int8" in (tmp_path / "llm_decode_weights.md").read_text()
