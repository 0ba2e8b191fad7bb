"""Policy "auto": per matmul/convolution/attention op, the faster of fp32 and the low dtype on the device, casts
included, within the rules' accuracy limits. Choices are tested with injected latency tables (deterministic);
one real measurement checks the per-device cache."""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.numerics import latency
from precast.policy.auto import AutoPolicy, OpLatency, choose
from tests import models as zoo
from tests.helpers import assert_bitwise

LINEARS = ("linear", "linear_1", "linear_2", "linear_3")  # zoo.plain_mlp: 4 Linear layers with ReLUs between


def _table(fp32, low, cast_in=1.0, cast_out=1.0):
    return {n: OpLatency(fp32, low, cast_in, cast_out) for n in LINEARS}


# ---- the choice ------------------------------------------------------------------------------------------
def test_choose_pays_for_casts_at_fp32_boundaries_only():
    # a -> b -> c, a reads the user input, c feeds the output
    up = {"a": {None}, "b": {"a"}, "c": {"b"}}
    down = {"a": {"b"}, "b": {"c"}, "c": {None}}
    lat = {n: OpLatency(10.0, 6.0, 3.0, 3.0) for n in "abc"}
    got = choose(lat, up, down)
    # all low: a pays its input cast (9 < 10), c its output cast, b none
    assert {n: c.low for n, c in got.items()} == {"a": True, "b": True, "c": True}
    assert (got["a"].cost_low, got["b"].cost_low, got["c"].cost_low) == (9.0, 6.0, 9.0)
    # b alone may not run low: with its neighbours fp32 it pays both casts (12 > 10), and so everything
    # around it drops in turn
    got = choose(lat, up, down, allowed={"b"})
    assert not any(c.low for c in got.values())


def test_choose_never_picks_a_slower_kernel():
    lat = {"a": OpLatency(10.0, 9.8, 0.0, 0.0)}  # within the noise margin: not worth it
    assert not choose(lat, {"a": {"x"}}, {"a": {"x"}})["a"].low


def test_auto_all_fp32_when_low_does_not_pay_is_bitwise_fp32():
    model, inputs = zoo.plain_mlp()
    pol = AutoPolicy(dtype=torch.bfloat16, latencies=_table(4.0, 24.0))  # bf16 6x slower
    res = precast.convert(model, inputs, policy=pol)
    assert res.report.policy == "auto"
    for name in LINEARS:
        rec = res.report.node(name)
        assert rec.dtype == "fp32" and rec.source == "auto" and rec.rule == "auto:slower"
        assert rec.limit == 4.0 and rec.measured == 26.0  # fp32 µs; low µs with both casts
        assert "bf16 24.0 µs" in rec.reason and "fp32 4.0 µs" in rec.reason
    assert all(n.dtype == "fp32" for n in res.report.nodes)
    (d,) = [d for d in res.report.diagnostics if d.code == "auto-latency"]
    assert "no op pays, every measured op stays fp32" in d.message and "6.0x slower" in d.message
    assert res.report.casts_runtime == 0
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), model(*inputs))


def test_auto_low_where_it_pays_casts_included():
    model, inputs = zoo.plain_mlp()
    pol = AutoPolicy(dtype=torch.bfloat16, latencies=_table(10.0, 2.0), confirm=False)
    res = precast.convert(model, inputs, policy=pol)
    assert [res.report.node(n).dtype for n in LINEARS] == ["bf16"] * 4
    first, middle = res.report.node("linear"), res.report.node("linear_1")
    assert first.measured == 3.0 and middle.measured == 2.0  # only the input cast at the boundary
    assert res.report.node("relu").dtype == "bf16"  # between low ops: follows its inputs
    est = res.report.verification["auto"]["estimated_speedup"]
    assert est == pytest.approx(40.0 / (3.0 + 2.0 + 2.0 + 3.0))
    rules = precast.convert(model, inputs, policy="rules", dtype=torch.bfloat16)
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), rules.program.module()(*inputs))


def test_auto_keeps_the_rules_accuracy_limits():
    model, inputs = zoo.plain_mlp()
    pol = AutoPolicy(
        dtype=torch.bfloat16, latencies=_table(10.0, 2.0), exclude_nodes=("linear_3",), confirm=False
    )
    res = precast.convert(model, inputs, policy=pol)
    assert res.report.node("linear_3").rule == "exclude_nodes" and res.report.node("linear_3").dtype == "fp32"
    assert res.report.node("linear_2").dtype == "bf16"
    assert res.report.node("linear_2").measured == 3.0  # its consumer is fp32: the output cast is paid


def test_auto_op_without_low_kernel_falls_back():
    from tests.pipeline.test_device_fallback import WithFp32Only, _inputs

    model, inputs = WithFp32Only().eval(), _inputs()
    lat = {"linear": OpLatency(10.0, 1.0), "linear_1": OpLatency(10.0, 1.0)}
    res = precast.convert(
        model, inputs, policy=AutoPolicy(dtype=torch.bfloat16, latencies=lat, confirm=False)
    )
    assert [d.node for d in res.report.diagnostics if d.code == "no-low-precision-kernel"] == ["fp32_only"]
    assert res.report.node("fp32_only").dtype == "fp32" and res.report.node("linear").dtype == "bf16"


def test_auto_option_errors():
    model, inputs = zoo.plain_mlp()
    with pytest.raises(precast.PrecastError, match="'auto'"):
        precast.convert(model, inputs, policy="fastest")
    with pytest.raises(precast.PrecastError, match="AutoPolicy says dtype"):
        precast.convert(model, inputs, policy=AutoPolicy(dtype="bf16"), dtype="fp16")


# ---- a real measurement, and the cache ---------------------------------------------------------------------
def test_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    model, inputs = zoo.plain_mlp()
    pol = AutoPolicy(dtype=torch.bfloat16, confirm=False)  # the choice depends on the table alone
    first = precast.convert(model, inputs, policy=pol, verify=False)
    (d,) = [d for d in first.report.diagnostics if d.code == "auto-latency"]
    # linear, linear_1, linear_2 have one shape: timed once
    assert "(shapes: 2 timed now, 0 read from the cache)" in d.message
    entries = json.loads((tmp_path / "latency.json").read_text())["entries"]
    assert len(entries) == 2 and all(e["fp32"] > 0 and e["low"] > 0 for e in entries.values())
    for n in LINEARS:
        rec = first.report.node(n)
        assert rec.limit > 0 and rec.measured > 0

    def no_timing(*_a, **_k):
        raise AssertionError("an op timed again")

    monkeypatch.setattr(latency, "_time", no_timing)
    second = precast.convert(model, inputs, policy=pol, verify=False)
    (d,) = [d for d in second.report.diagnostics if d.code == "auto-latency"]
    assert "(shapes: 0 timed now, 2 read from the cache)" in d.message
    assert [second.report.node(n).dtype for n in LINEARS] == [first.report.node(n).dtype for n in LINEARS]


def test_op_that_cannot_be_timed_stays_fp32_and_is_named(tmp_path, monkeypatch):
    """A kernel that fails while being timed is never a silent skip: the op stays fp32 and a
    ``latency-not-measured`` warning names it."""
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    real = latency.measure_node

    def broken_for_first(node, *args, **kwargs):
        if node.name == LINEARS[0]:
            raise RuntimeError("no kernel for these shapes")
        return real(node, *args, **kwargs)

    monkeypatch.setattr(latency, "measure_node", broken_for_first)
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy=AutoPolicy(dtype=torch.bfloat16, confirm=False), verify=False)
    (d,) = [d for d in res.report.diagnostics if d.code == "latency-not-measured"]
    assert d.severity == "warning" and d.node == LINEARS[0] and "no kernel for these shapes" in d.message
    assert res.report.node(LINEARS[0]).dtype == "fp32"


def test_cli_policy_auto(tmp_path, monkeypatch, capsys):
    from precast.cli import main

    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    model, inputs = zoo.plain_mlp()
    src, out = tmp_path / "in.pt2", tmp_path / "out.pt2"
    torch.export.save(torch.export.export(model, inputs), str(src))
    assert main(["convert", str(src), "-o", str(out), "--policy", "auto", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["policy"] == "auto" and "auto" in rep["verification"]
    assert any(d["code"] == "auto-latency" for d in rep["diagnostics"])


def test_bench_fp32_program_and_note():
    from precast.bench.models import mlp
    from precast.bench.variants import VARIANTS, auto_note, fp32_program

    assert {"aoti_fp32", "auto_aoti"} <= set(VARIANTS)
    model, inputs = mlp(1, width=32)
    program, note = fp32_program(model, inputs)
    assert note == "" and model.autocast  # the switch is restored
    hops = [n for n in program.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert hops == []  # no autocast region: fp32 throughout
    res = precast.convert(
        program, inputs, policy=AutoPolicy(dtype=torch.bfloat16, latencies={}, confirm=False), verify=False
    )
    assert auto_note(res.report).startswith("no matmul/convolution/attention op to measure")


def test_dynamic_dim_measured_at_its_low_end_too(tmp_path, monkeypatch):
    """A matmul whose M is dynamic (a decode step runs it at M=1, the example at 64) is timed at both sizes and
    stays fp32 when the low dtype loses at either: auto must not lower a matmul that is slower at the shapes
    the program runs at (issue 27 item 6)."""
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    seen = []

    def fake(node, constants, low, device, at=None):
        m = node.args[0].meta["val"].shape[0]
        seen.append(("hint" if at is None else "min", latency._size(m, at)))
        if at is not None:  # M=1: the bf16 kernel is the slower one
            return OpLatency(1.0, 3.0, 0.1, 0.1)
        return OpLatency(10.0, 2.0, 0.1, 0.1)  # M=64: bf16 pays

    monkeypatch.setattr(latency, "measure_node", fake)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    x = torch.randn(64, 64)
    pol = AutoPolicy(dtype=torch.bfloat16, confirm=False)
    static = precast.convert(model, (x,), policy=pol, verify=False)
    assert static.report.node("linear").dtype == "bf16" and seen == [("hint", 64)]
    seen.clear()
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "again"))  # the M=64 measurement timed again too
    batch = torch.export.Dim("batch", min=1, max=1024)
    dynamic = precast.convert(model, (x,), policy=pol, verify=False, dynamic_shapes=({0: batch},))
    assert sorted(seen) == [("hint", 64), ("min", 1)]
    assert dynamic.report.node("linear").dtype == "fp32"
