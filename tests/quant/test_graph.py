"""Weight formats (issue 41 item 1): linear and embedding weights stored in int8 / int4, dequantized in the graph.

The references are exact where the semantics are: a converted program's output is bitwise the model whose weights
are replaced by ``dequantize(quantize(w))`` (policy None: in fp32; policy torch: under eager autocast, the weight a
bf16 value), every stored part is recomputed bitwise from the original weight by its tag, and the report's bytes
are the parts' own."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.quant.formats import (
    WeightFormat,
    dequantize,
    derive_tag,
    fits,
    parse_format,
    parse_tag,
    quantize,
    scale_grid,
)
from precast.quant.graph import stored_value
from tests.helpers import assert_bitwise


class Net(torch.nn.Module):
    """An embedding, two linears (one without bias), a tied head, and a matmul through a transpose."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(96, 64)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)
        self.head = torch.nn.Linear(64, 96, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.down(torch.relu(self.up(h))) + h
        return self.head(h)


def _net(tied: bool = True) -> tuple[Net, tuple]:
    torch.manual_seed(0)
    model = Net(tied).eval()
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    return model, (ids,)


def _value(w: torch.Tensor, fmt: WeightFormat, dtype: torch.dtype) -> torch.Tensor:
    """What a weight stored in ``fmt`` and read in ``dtype`` stands for: its scales on the grid, read in ``dtype``."""
    parts = quantize(w, fmt, scale_grid(dtype))
    parts["scale"] = parts["scale"].to(dtype)
    return dequantize(parts, fmt, dtype)


def _dequantized(model: Net, fmt: WeightFormat, dtype: torch.dtype, names: list[str]) -> Net:
    """The model with each named weight replaced by the value its stored parts stand for (as fp32)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name in names:
            p = out.get_parameter(name)
            p.copy_(_value(p, fmt, dtype).float())
    return out


# ---- the formats ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("int8", "int8"),
        ("int8-sym", "int8"),
        ("int8-asym", "int8-asym"),
        ("INT8_ASYM", "int8-asym"),
        ("int4", "int4-g64"),
        ("int4-asym", "int4-g64"),
        ("int4-g32", "int4-g32"),
        ("int4-g128", "int4-g128"),
        ("INT4_g64", "int4-g64"),
        ("float", "float"),
    ],
)
def test_format_spellings(spelling, name):
    fmt = parse_format(spelling)
    assert fmt.name == name
    assert parse_format(fmt.name) == fmt


@pytest.mark.parametrize(
    "bad", ["int3", "int4-g48", "fp8", "", 8, None, "int4-sym", "int8-asym-g64", "float-asym"]
)
def test_bad_formats_are_one_line(bad):
    with pytest.raises(PrecastError) as err:
        parse_format(bad)
    assert "\n" not in str(err.value) and (
        "'int8'" in str(err.value)
        or "groups are 32, 64, 128" in str(err.value)
        or "asymmetric" in str(err.value)
    )


@pytest.mark.parametrize("fmt", ["int8", "int8-asym", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_is_within_half_a_step(fmt, dtype):
    fmt = parse_format(fmt)
    w = (
        torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
        * torch.linspace(0.01, 3, 48)[:, None]
    )
    w[3] = 0.0  # a zero row stores zeros exactly
    w[5, :64] = 2.5  # a constant group
    parts = quantize(w, fmt, dtype)
    back = dequantize(parts, fmt, torch.float32)
    if fmt.kind == "int8":
        assert parts["q"].dtype == torch.int8 and parts["q"].abs().max() <= 127
        step = parts["scale"].float()
    elif fmt.kind == "int8-asym":
        assert parts["q"].dtype == torch.uint8 and parts["q"].shape == (48, 128)
        assert parts["zero"].dtype == torch.uint8 and parts["zero"].shape == (48, 1)
        step = parts["scale"].float()
    else:
        assert parts["q"].dtype == torch.uint8 and parts["q"].shape == (48, 64)
        assert parts["zero"].max() <= 15 and parts["scale"].shape == (48, 128 // fmt.group, 1)
        step = parts["scale"].float().repeat_interleave(fmt.group, dim=1).reshape(48, 128)
    assert parts["scale"].dtype == dtype
    # half a step, plus the scale's own rounding (bf16: 2**-8 relative) over up to 15 steps for int4 (its scale
    # rounded to nearest); int8's integers are clamped to 127 steps of the stored scale, int8-asym's scale is
    # rounded up so its 255 steps cover the row: half a step exactly
    slack = 0.5 + (15 * 2**-8 if dtype == torch.bfloat16 and fmt.kind != "int8-asym" else 1e-5)
    assert ((back - w).abs() <= step * slack + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(128))
    # the reference computed in the dtype the graph computes in is what the program gives: bitwise below


def test_int4_packing_is_low_nibble_first():
    w = torch.arange(64, dtype=torch.float32).reshape(1, 64)  # one group: min 0, max 63 -> step 4.2
    parts = quantize(w, parse_format("int4-g64"), torch.float32)
    q = torch.stack([parts["q"] & 15, parts["q"] >> 4], -1).reshape(1, 64)
    assert parts["zero"].item() == 0 and q[0, 0] == 0 and q[0, -1] == 15
    assert (q[0, 1:] >= q[0, :-1]).all()  # monotone: the order of the values survives the packing


def test_int8_asym_uses_the_rows_range():
    """A row whose values are not centred on zero: asymmetric int8's grid covers only its range (a finer step than
    symmetric int8's absmax / 127), the zero point puts 0 on the grid, and the rounding error is smaller."""
    w = torch.rand(8, 256, generator=torch.Generator().manual_seed(0)) * 0.3 - 0.05  # in [-0.05, 0.25]
    a, s = parse_format("int8-asym"), parse_format("int8")
    pa, ps = quantize(w, a, torch.float32), quantize(w, s, torch.float32)
    assert (pa["scale"] < ps["scale"]).all()
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    assert torch.allclose(pa["scale"], (hi - lo) / 255)
    assert torch.equal(pa["zero"], torch.round(-lo / pa["scale"]).to(torch.uint8))
    assert pa["q"].min() == 0 and pa["q"].max() == 255  # the whole range used
    zero_w = torch.zeros(1, 256)
    assert torch.equal(dequantize(quantize(zero_w, a, torch.float32), a, torch.float32), zero_w)
    err = lambda f, p: (dequantize(p, f, torch.float32) - w).pow(2).mean()  # noqa: E731
    assert err(a, pa) < 0.6 * err(s, ps)
    assert (
        a.bits((8, 256), torch.bfloat16) == 8 + 24 / 256 and s.bits((8, 256), torch.bfloat16) == 8 + 16 / 256
    )


def test_tags_round_trip_and_unknown_tags_are_one_line():
    for fmt in ("int8", "int8-asym", "int4-g32", "int4-g128"):
        f = parse_format(fmt)
        for role in f.parts():
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                assert parse_tag(derive_tag(f, dt, role)) == (f, dt, role)
    assert parse_tag("int8a-bf16.zero")[0] == parse_format("int8-asym")
    for bad in ("int8.q", "int4-bf16.q", "int2g64-bf16.q", "int8-bf16.zero2", "int8ag64-bf16.q"):
        with pytest.raises(PrecastError, match="unknown stored weight part"):
            parse_tag(bad)


def test_fits_names_why():
    assert fits(parse_format("int8"), (10, 7)) is None
    assert "multiple of the int4 group 64" in fits(parse_format("int4"), (16, 96))
    assert "3-d" in fits(parse_format("int8"), (2, 3, 4))


def test_quantize_on_meta_gives_the_parts_shapes():
    parts = quantize(torch.empty(32, 128, device="meta"), parse_format("int4-g32"), torch.bfloat16)
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in parts.items()} == {
        "q": ((32, 64), torch.uint8, "meta"),
        "scale": ((32, 4, 1), torch.bfloat16, "meta"),
        "zero": ((32, 4, 1), torch.uint8, "meta"),
    }


# ---- the conversion -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "int8-asym", "int4-g32", "int4-g64"])
def test_policy_none_is_bitwise_the_dequantized_model(fmt):
    model, inputs = _net()
    before = copy.deepcopy(model.state_dict())
    res = precast.convert(model, inputs, weight_format=fmt)
    f = parse_format(fmt)
    want = _dequantized(model, f, torch.float32, ["emb.weight", "up.weight", "down.weight"])(*inputs)
    assert_bitwise(res.program.module()(*inputs), want)
    for k, v in model.state_dict().items():  # the caller's module is not changed
        assert torch.equal(v, before[k])
    kinds = {k: (v.dtype, tuple(v.shape)) for k, v in res.program.state_dict.items()}
    assert kinds[f"up.weight_{f.suffix}"][0] == (torch.int8 if f.kind == "int8" else torch.uint8)
    assert "up.weight" not in kinds and "down.weight" not in kinds  # no float copy left behind
    assert {r["format"] for r in res.report.weight_formats} == {f.name}
    assert res.report.verification["bitwise"] is False
    assert "not-bitwise" not in {
        d.code for d in res.report.diagnostics
    }  # the rounding is stated, not a warning


@pytest.mark.parametrize("fmt", ["int8", "int8-asym"])
def test_policy_torch_is_bitwise_eager_autocast_of_the_dequantized_model(fmt):
    model, inputs = _net(tied=False)
    res = precast.convert(model, inputs, policy="torch", weight_format=fmt)
    f = parse_format(fmt)
    ref = _dequantized(model, f, torch.bfloat16, ["up.weight", "down.weight", "head.weight"])
    with torch.no_grad():  # the embedding runs fp32 under autocast: its parts are fp32
        ref.emb.weight.copy_(_value(model.emb.weight, f, torch.float32))
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(*inputs)
    assert_bitwise(res.program.module()(*inputs), want)
    scales = {k: v.dtype for k, v in res.program.state_dict.items() if "_scale" in k}
    assert scales == {
        f"emb.weight_{f.suffix}_scale": torch.float32,
        f"up.weight_{f.suffix}_scale": torch.bfloat16,
        f"down.weight_{f.suffix}_scale": torch.bfloat16,
        f"head.weight_{f.suffix}_scale": torch.bfloat16,
    }


@pytest.mark.parametrize("fmt", ["int8", "int8-asym", "int4-g32"])
def test_a_tied_table_read_in_two_dtypes_stores_its_parts_once(fmt):
    """The embedding reads the tied table in fp32 under autocast, the head in bf16: one set of integers and one bf16
    scale vector (before: an fp32 copy of the scales too, 0.105 bits per weight on SmolLM2-135M's table), the
    embedding casting its gathered rows' scales to fp32. Bitwise eager autocast of the model whose table holds the
    value the parts stand for (the bf16 grid's, exact in fp32 and in bf16)."""
    model, inputs = _net(tied=True)
    res = precast.convert(model, inputs, policy="torch", weight_format=fmt)
    f = parse_format(fmt)
    state = res.program.state_dict
    table = sorted((k, v.dtype) for k, v in state.items() if k.startswith("head.weight_"))
    want_parts = [(f"head.weight_{f.suffix}", torch.int8 if fmt == "int8" else torch.uint8)]
    want_parts.append((f"head.weight_{f.suffix}_scale", torch.bfloat16))
    if fmt != "int8":
        want_parts.append((f"head.weight_{f.suffix}_zero", torch.uint8))
    assert table == sorted(want_parts)
    (head,) = [r for r in res.report.weight_formats if r["weight"] == "head.weight"]
    assert head["bytes_after"] * 8 == 96 * 64 * f.stored_bits((96, 64), {torch.bfloat16})
    ref = Net(
        tied=False
    ).eval()  # the table's two reads: the value in fp32 (the embedding), in bf16 (the head)
    ref.load_state_dict(_dequantized(model, f, torch.bfloat16, ["up.weight", "down.weight"]).state_dict())
    grid = quantize(model.emb.weight.detach(), f, torch.bfloat16)
    with torch.no_grad():
        ref.emb.weight.copy_(dequantize(grid, f, torch.float32))
        ref.head.weight.copy_(dequantize(grid, f, torch.bfloat16).float())
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(*inputs)
    assert_bitwise(res.program.module()(*inputs), want)


@pytest.mark.parametrize(
    ("policy", "fmt"),
    [(None, "int4-g32"), ("torch", "int4-g32"), ("rules", "int4-g32"), ("torch", "int8-asym")],
)
def test_every_stored_part_is_recomputed_from_the_original(policy, fmt):
    model, inputs = _net()
    res = precast.convert(model, inputs, policy=policy, weight_format=fmt)
    originals = dict(model.named_parameters(remove_duplicate=False))
    sources = precast.constant_sources(res.program)
    derived = [s for s in sources.values() if s.derive is not None]
    # three parts per weight (the tied table under policy torch, read in fp32 and bf16, too: one scale vector)
    roles = [(s.original, parse_tag(s.derive)[2]) for s in derived]
    assert sorted(r for _, r in roles if _ != "head.weight") == ["q", "q", "scale", "scale", "zero", "zero"]
    assert sorted(r for o, r in roles if o == "head.weight") == ["q", "scale", "zero"]
    for src in sources.values():
        if src.original in originals:
            got = stored_value(src, originals[src.original].detach())
            assert_bitwise(got, res.program.state_dict[src.stored])


def test_report_names_each_weight_its_format_why_and_bytes():
    model, inputs = _net()
    res = precast.convert(
        model, inputs, policy="torch", weight_format={"head.weight": "int8", "down.*": "float", "*": "int4"}
    )
    records = {r["weight"]: r for r in res.report.weight_formats}
    # the tied table: read by the embedding (fp32) and the head (bf16); the rule names the head's read by its path,
    # the embedding's read is 'emb.weight' only (though the program names the tensor head.weight): '*' gives it int4
    assert records["head.weight"]["format"] == "int4-g64+int8"
    assert records["head.weight"]["why"] == "weight_format rules; weight_format rules: 'head.weight'"
    assert set(records["head.weight"]["names"]) >= {"head.weight", "emb.weight"}
    assert records["down.weight"]["format"] == "float" and records["up.weight"]["format"] == "int4-g64"
    up = records["up.weight"]
    assert up["bytes_before"] == 128 * 64 * 4
    assert up["bytes_after"] == 128 * 32 + 128 * 1 * 2 + 128 * 1  # packed + bf16 scales + zero points
    assert records["down.weight"]["bytes_after"] == 64 * 128 * 2  # its bf16 copy
    assert "weight formats: 1 float, 1 int4-g64, 1 int4-g64+int8" in res.report.summary()
    # saved and loaded, the report and the tags come back
    again = precast.report(_roundtrip(res.program))
    assert again.weight_formats == res.report.weight_formats
    assert precast.constant_sources(_roundtrip(res.program)) == precast.constant_sources(res.program)


def _roundtrip(ep, tmp=[]):  # noqa: B006 - one temp dir per test session is enough
    import tempfile

    if not tmp:
        tmp.append(tempfile.mkdtemp())
    path = f"{tmp[0]}/p.pt2"
    torch.export.save(ep, path)
    return torch.export.load(path)


def test_a_saved_program_runs_bitwise_and_keeps_its_weights():
    model, inputs = _net()
    res = precast.convert(model, inputs, policy="torch", weight_format="int8")
    loaded = _roundtrip(res.program)
    assert_bitwise(loaded.module()(*inputs), res.program.module()(*inputs))
    copied = copy.deepcopy(res.program)
    assert_bitwise(copied.module()(*inputs), res.program.module()(*inputs))


def test_int4_that_does_not_fit_a_weight_goes_to_int8_and_says_why():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(48, 16)  # 48 is not a multiple of 32

        def forward(self, x):
            return self.a(x)

    torch.manual_seed(0)
    res = precast.convert(Odd().eval(), (torch.randn(3, 48),), weight_format="int4-g32")
    (record,) = res.report.weight_formats
    assert record["format"] == "int8"
    assert record["why"].endswith("int8: its input size 48 is not a multiple of the int4 group 32")


def test_a_weight_read_by_a_matmul_stays_float_and_is_named():
    class MatmulWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 32))
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x @ self.w.t())

    torch.manual_seed(0)
    res = precast.convert(MatmulWeight().eval(), (torch.randn(4, 32),), weight_format="int8")
    assert [r["weight"] for r in res.report.weight_formats] == ["lin.weight"]
    (d,) = [d for d in res.report.diagnostics if d.code == "weight-not-quantized"]
    assert "w read by aten.mm" in d.message or "w read by aten.matmul" in d.message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("int3", "weight_format='int3': give 'int8'"),
        ({"up.*": "int5"}, "weight_format['up.*']='int5'"),
        ({"": "int8"}, "glob patterns over weight names"),
    ],
)
def test_bad_weight_format_options_are_one_line(value, message):
    model, inputs = _net()
    with pytest.raises(PrecastError) as err:
        precast.convert(model, inputs, weight_format=value)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_plans_carry_weight_formats_and_apply_them(tmp_path):
    model, inputs = _net()
    res = precast.convert(model, inputs, policy="rules", weight_format={"up.weight": "int4-g32", "*": "int8"})
    plan = precast.Plan.from_result(res)
    assert plan.weights == {"head.weight": "int8", "down.weight": "int8", "up.weight": "int4-g32"}
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert json.loads(path.read_text())["version"] == 2
    again = precast.convert(model, inputs, policy="rules", plan=path)
    assert_bitwise(again.program.module()(*inputs), res.program.module()(*inputs))
    assert again.report.weight_formats == [{**r, "why": "the plan"} for r in res.report.weight_formats]
    with pytest.raises(PrecastError, match="plan= carries weight formats and weight_format= is given"):
        precast.convert(model, inputs, policy="rules", plan=path, weight_format="int8")


def test_a_plan_of_a_tied_table_read_in_two_formats_applies_again(tmp_path):
    """The README's rule ``{"lm_head.weight": "int8", "*": "int4"}`` on a tied model stores the table
    ``int4-g64+int8`` (the embedding's read int4, the head's int8). Its plan keys each read's format by the read's
    own name; before, it recorded "int4-g64+int8", which the plan's reader refused as a format."""
    model, inputs = _net()
    rules = {"head.weight": "int8", "*": "int4"}
    res = precast.convert(model, inputs, policy="torch", weight_format=rules)
    (table,) = [r for r in res.report.weight_formats if r["weight"] == "head.weight"]
    assert table["format"] == "int4-g64+int8"
    assert table["read_formats"] == {"emb.weight": "int4-g64", "head.weight": "int8"}
    plan = precast.Plan.from_result(res)
    assert plan.weights == {
        "emb.weight": "int4-g64",
        "head.weight": "int8",
        "up.weight": "int4-g64",
        "down.weight": "int4-g64",
    }
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = precast.convert(model, inputs, policy="torch", plan=path)
    assert_bitwise(again.program.module()(*inputs), res.program.module()(*inputs))
    (reapplied,) = [r for r in again.report.weight_formats if r["weight"] == "head.weight"]
    assert reapplied["format"] == "int4-g64+int8" and reapplied["read_formats"] == table["read_formats"]
    assert all(not r["read_formats"] for r in res.report.weight_formats if r["weight"] != "head.weight")


def test_the_cli_flag_takes_a_format_and_pattern_rules(tmp_path, capfd):
    from precast.cli import main

    model, inputs = _net(tied=False)
    src, out = tmp_path / "net.pt2", tmp_path / "int.pt2"
    torch.export.save(torch.export.export(model, inputs), src)
    argv = ["convert", str(src), "--policy", "torch", "-o", str(out), "--no-verify"]
    assert (
        main([*argv, "--weight-format", "int8", "up.weight=int4-g32"]) == 0
    )  # rules first, a bare format last
    formats = {r["weight"]: r["format"] for r in precast.report(torch.export.load(out)).weight_formats}
    assert formats == {
        "up.weight": "int4-g32",
        "down.weight": "int8",
        "head.weight": "int8",
        "emb.weight": "int8",
    }
    out.unlink()
    capfd.readouterr()
    assert main([*argv, "--weight-format", "int5"]) == 2
    err = capfd.readouterr().err.strip()
    assert (
        err.endswith(
            "--weight-format int5: give 'int8' (symmetric), 'int8-asym', 'int4' (group 64), 'int4-g32', "
            "'int4-g128' or 'float' (stored in the dtype its op computes in)"
        )
        and "\n" not in err
    )
    assert not out.exists()
