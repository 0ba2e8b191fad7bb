"""benchmarks/llm_weights_anchors.py's own logic (no NNCF, no model): which of NNCF's data-aware recipes
``compress_weights`` accepts, the bytes its LoRA adapters add, the best recipe per budget, and the stored bytes of
an OpenVINO model built here with NNCF's decompression chains (a weight and its LoRA adapters)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.llm_weights_anchors import (
    allowed_recipes,
    best_per_budget,
    lora_adapter_bytes,
    recipe_flags,
    recipe_name,
    recipe_table,
    weight_storage,
)

FLAGS = ("awq", "scale_estimation", "gptq", "lora_correction")


def test_allowed_recipes_are_every_combination_nncf_accepts():
    """NNCF 3.4's OpenVINO path refuses exactly one pairing: gptq with lora_correction (quantize_model.py)."""
    names = allowed_recipes()
    combos = {tuple(recipe_flags(n)[f] for f in FLAGS) for n in names}
    everything = {tuple(bool(m >> i & 1) for i in range(4)) for m in range(16)}
    assert combos == {c for c in everything if not (c[2] and c[3])} and len(names) == len(combos) == 12
    assert names[0] == "none" and not any(recipe_flags("none").values())
    for n in names:
        assert recipe_name(recipe_flags(n)) == n
    assert recipe_flags("awq+se+gptq") == {
        "awq": True,
        "scale_estimation": True,
        "gptq": True,
        "lora_correction": False,
    }


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("gptq+lora", "refuses gptq with lora_correction"),
        ("awq+se+gptq+lora", "refuses gptq with lora_correction"),
        ("awq+awq", "each once"),
        ("awq+hqq", "each once"),
        ("", "each once"),
    ],
)
def test_recipe_flags_refuse_in_one_line(name, match):
    with pytest.raises(ValueError, match=match) as e:
        recipe_flags(name)
    assert "\n" not in str(e.value)


def test_lora_adapter_bytes_by_hand():
    """A q_proj [576, 576] at rank 8: A [8, 576] and B [576, 8] in u8 (9216 bytes), an f16 scale and a u8 zero point
    per row of each (3 * (8 + 576) bytes); the reduction axis names the input side."""
    assert lora_adapter_bytes([576, 576], [1], 8) == 9216 + 3 * 584
    # a down_proj [576, 1536]: in = 1536, out = 576; transposed (reduction axis 0) swaps them
    assert lora_adapter_bytes([576, 1536], [1], 8) == 8 * 1536 + 8 * 576 + 3 * (8 + 576)
    assert lora_adapter_bytes([1536, 576], [0], 8) == 8 * 1536 + 8 * 576 + 3 * (8 + 576)


def test_best_per_budget_never_picks_a_refused_row():
    rows = [
        {"bits": 4.6, "recipe": "none", "kld": 0.40, "ratio": 0.9, "bits_per_weight": 4.6, "top1": 0.6, "ppl": 30.0,
         "seconds": 9.0},
        {"bits": 4.6, "recipe": "awq+se", "kld": 0.20, "ratio": 0.9, "bits_per_weight": 4.6, "top1": 0.7,
         "ppl": 25.0, "seconds": 90.0},
        {"bits": 4.6, "recipe": "gptq", "error": "failed: boom"},
        {"bits": 6.0, "recipe": "none", "kld": 0.10, "ratio": 0.5, "bits_per_weight": 6.0, "top1": 0.8, "ppl": 22.0,
         "seconds": 9.0},
        {"bits": 6.0, "recipe": "lora", "error": "refused"},
    ]  # fmt: skip
    best = best_per_budget(rows)
    assert {b: r["recipe"] for b, r in best.items()} == {4.6: "awq+se", 6.0: "none"}
    table = recipe_table(rows).splitlines()
    assert "| 4.6 | **awq+se** | 0.9000 | 4.600 | **0.2000** |" in table[2]
    assert table[3].startswith("| 4.6 | none |") and "failed: boom" in table[4]
    assert table[5].startswith("| 6.0 | **none** |") and "refused" in table[6]


def _chain(ops, ov, name: str, ints: np.ndarray, kind, group: bool):
    """NNCF's decompression chain of a weight: integers - zero point, times an f16 scale (grouped: then reshaped to
    2-d), converted to f32; the arrays it stores."""
    rows = ints.shape[0]
    zp = np.full((*ints.shape[:-1], 1), 8, np.uint8)
    scale = np.full((*ints.shape[:-1], 1), 0.01, np.float16)
    w = ops.convert(ops.constant(ints, dtype=kind, name=name), ov.Type.f16)
    w = ops.subtract(w, ops.convert(ops.constant(zp, dtype=kind, name=f"{name}/zero_point"), ov.Type.f16))
    w = ops.multiply(w, ops.constant(scale, name=f"{name}/scale"))
    if group:
        w = ops.reshape(w, ops.constant(np.array([rows, -1], np.int64)), special_zero=False)
    return ops.convert(w, ov.Type.f32), (ints, zp, scale)


def _stored(arrays, kind_bits: int) -> int:
    return sum(math.ceil(a.size * (kind_bits if a.dtype == np.uint8 else 8 * a.itemsize) / 8) for a in arrays)


def test_weight_storage_charges_lora_adapters_as_bytes_not_weights(tmp_path):
    """A MatMul over a u4 weight (group 64) with NNCF's LoRA adapters beside it (u8 A [8, 128], B [8192, 8]: B alone
    has 65536 elements, as many as the smallest weight counted): the adapters' bytes are stored (``lora_bytes``,
    within ``other_bytes``) and their elements are not weights."""
    ov = pytest.importorskip("openvino")
    ops = pytest.importorskip("openvino.opset13")
    out, inner, rank = 8192, 128, 8
    rng = np.random.default_rng(0)
    x = ops.parameter([1, 4, inner], ov.Type.f32, name="x")
    weight, w_arrays = _chain(ops, ov, "mm", rng.integers(0, 16, (out, 2, 64), np.uint8), ov.Type.u4, True)
    a, a_arrays = _chain(
        ops, ov, "mm_lora_A", rng.integers(0, 256, (rank, inner), np.uint8), ov.Type.u8, False
    )
    b, b_arrays = _chain(ops, ov, "mm_lora_B", rng.integers(0, 256, (out, rank), np.uint8), ov.Type.u8, False)
    y = ops.matmul(x, weight, transpose_a=False, transpose_b=True)
    lora = ops.matmul(ops.matmul(x, a, False, True), b, False, True)
    model = ov.Model([ops.add(y, lora)], [x])
    ov.save_model(model, str(tmp_path / "m.xml"), compress_to_fp16=False)
    got = weight_storage(str(tmp_path / "m.xml"))
    assert got["elements"] == out * inner and got["readers"] == 1
    assert got["bytes"] == _stored(w_arrays, 4)
    assert got["bits_per_weight"] == 8 * got["bytes"] / (out * inner)
    assert got["lora_bytes"] == _stored(a_arrays, 8) + _stored(b_arrays, 8)
    assert got["lora_bytes"] == lora_adapter_bytes([out, inner], [1], rank)
    assert got["other_bytes"] >= got["lora_bytes"]
