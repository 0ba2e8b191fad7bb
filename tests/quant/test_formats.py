"""The format objects: typed constructors with the strings as shortcuts, and the cost each states counting every
scale and zero point as the conversion stores it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.quant.formats import WeightFormat, parse_format


@pytest.mark.parametrize(
    "typed, spelled",
    [
        (precast.Int8(), "int8"),
        (precast.Int8(asym=True), "int8-asym"),
        (precast.Int8Asym(), "int8-asym"),
        (precast.Int4(), "int4"),
        (precast.Int4(group=64), "int4-g64"),
        (precast.Int4(group=128), "int4-g128"),
        (precast.Float(), "float"),
    ],
)
def test_typed_formats_are_their_strings(typed, spelled):
    parsed = parse_format(spelled)
    assert parsed == typed and hash(parsed) == hash(typed) and type(parsed) is type(typed)
    assert parse_format(typed) is typed and typed.name == parsed.name
    assert WeightFormat(typed.kind, typed.group) == typed  # the untyped spelling builds the typed one
    assert pickle.loads(pickle.dumps(typed)) == typed == copy.deepcopy(typed)


def test_bad_typed_formats_are_one_line():
    with pytest.raises(PrecastError, match=r"Int4\(group=48\): int4 groups are 32, 64, 128"):
        precast.Int4(group=48)
    with pytest.raises(PrecastError, match=r"Int8\(asym='yes'\): give True or False"):
        precast.Int8(asym="yes")
    with pytest.raises(AttributeError):
        precast.Int4().group = 32


@pytest.mark.parametrize("fmt", [precast.Int8(), precast.Int8(asym=True), precast.Int4(group=32)])
def test_the_arithmetic_is_the_objects(fmt):
    """``fmt.quantize`` / ``fmt.dequantize`` are the module functions the conversion and the streamed writer use."""
    from precast.quant import formats

    torch.manual_seed(0)
    w = torch.randn(16, 64)
    parts = fmt.quantize(w, torch.bfloat16)
    assert set(parts) == set(fmt.parts())
    assert all(torch.equal(parts[r], formats.quantize(w, fmt, torch.bfloat16)[r]) for r in parts)
    value = fmt.dequantize(parts, torch.float32)
    assert torch.equal(value, formats.dequantize(parts, fmt, torch.float32))
    assert (value - w).abs().max() <= parts["scale"].float().max()  # within one step of each weight


@pytest.mark.parametrize("policy", ["torch", "rules", None])
@pytest.mark.parametrize("spelled", ["int8", "int8-asym", "int4"])
def test_stored_bits_are_what_the_program_stores(recipe_program, policy, spelled):
    """Every weight's stored bytes (its parts, one scale vector on its grid, any float copy still read) are
    ``fmt.stored_bits(shape, read dtypes)``. A tied table read in fp32 by the embedding under policy torch and in
    bf16 by the head stores one bf16 scale vector (before: an fp32 copy too, 0.105 bits per weight on
    SmolLM2-135M), which the embedding casts after its gather: its rows are still bitwise the fp32 dequantization
    (``test_tied_rows_read_the_one_scale_vector``)."""
    res = precast.convert(recipe_program, policy=policy, weight_format=spelled, verify=False)
    stored = {**res.program.state_dict, **res.program.constants}
    fmt = parse_format(spelled)
    reads = {"torch": {torch.float32, torch.bfloat16}}.get(policy)
    for r in res.report.weight_formats:
        scales = [stored[n].dtype for n in r["stored"] if "_scale" in n]
        assert len(scales) == 1, r
        numel = torch.Size(r["shape"]).numel()
        dtypes = reads if reads and len(r["reads"]) == 2 else scales  # the tied table: both its read dtypes
        assert r["bytes_after"] * 8 == pytest.approx(numel * fmt.stored_bits(tuple(r["shape"]), dtypes)), r
