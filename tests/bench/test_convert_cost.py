"""The conversion-cost benchmark's own code path on a tiny chain (speed is printed by benchmarks/, never
asserted here): the real ``precast.convert`` observed stage by stage."""

from __future__ import annotations

import json
import time

import pytest

import precast
from precast import bench
from precast.passes.runner import observe

N = 8


@pytest.fixture(scope="module")
def chain_ep():
    return bench.chain_program(N)


def test_chain_has_n_ops_in_one_region(chain_ep):
    sub = [m for m in chain_ep.graph_module.modules() if m is not chain_ep.graph_module][0]
    ops = [n for n in sub.graph.nodes if n.op == "call_function"]
    assert len(ops) == N
    assert [str(n.target) for n in ops[:4]] == [
        "aten.linear.default",
        "aten.add.Tensor",
        "aten.relu.default",
        "aten.layer_norm.default",
    ]


def test_stage_clock_counts_nested_stages_once_and_keeps_failures():
    clock = bench.StageClock(memory=True)
    with clock:
        with clock("outer"):
            time.sleep(0.01)
            with clock("inner"):
                block = bytearray(2**20)  # 1 MiB traced inside the inner stage
                time.sleep(0.03)
                del block
        with pytest.raises(ValueError), clock("fails"):
            raise ValueError("x")
    assert list(clock.ms) == ["outer", "inner", "fails"]  # order of first appearance
    assert clock.ms["inner"] >= 30 and 10 <= clock.ms["outer"] < 30  # outer's own time excludes inner's
    assert clock.kib["inner"] >= 1024 and clock.kib["outer"] >= clock.kib["inner"]
    assert clock.failed_in == "fails" and clock.peak >= 2**20


def test_observed_stages_are_those_of_convert(chain_ep):
    """The observer sees the stages of the real conversion and changes nothing: the program that comes out is
    the one an unobserved convert() returns."""
    for policy in (None, "torch"):
        names = []
        with observe(lambda name, names=names: _record(names, name)):
            out = precast.convert(chain_ep, policy=policy, verify=False).program
        want = precast.convert(chain_ep, policy=policy, verify=False).program
        assert out.graph_module.code == want.graph_module.code
        assert out.graph_signature == want.graph_signature
        print(f"\npolicy {policy}: stages {list(dict.fromkeys(names))}")
        assert len(set(names)) >= 3 and "verify" not in names


def _record(names: list[str], name: str):
    import contextlib

    names.append(name)
    return contextlib.nullcontext()


def test_rows_and_positive_times(chain_ep):
    results = [
        bench.measure_convert_cost(chain_ep, "chain", policy, N, memory=True, verify=True)
        for policy in (None, "torch")
    ]
    assert [(r.model, r.policy, r.ops) for r in results] == [("chain", "none", N), ("chain", "torch", N)]
    for r in results:
        assert r.error is None and r.note == "" and r.nodes > N
        assert r.stage_ms and "verify" not in r.stage_ms and set(r.stage_cpu_ms) == set(r.stage_ms)
        assert all(v >= 0 for v in r.stage_ms.values()) and r.total_ms > 0
        assert r.verify_ms > 0 and r.convert_ms > 0 and r.ms_per_node > 0
        print(f"\n{r.policy}: {100 * r.in_stages:.0f}% of convert() in stages: {list(r.stage_ms)}")
        assert 0 < r.in_stages <= 1.0 + 1e-3
        assert r.peak_kib > 0 and set(r.stage_kib) == set(r.stage_ms)
    head, rows = bench.convert_cost_rows(results)
    assert head[:7] == ["model", "policy", "N", "nodes", "total ms", "ms/node", "cpu ms/node"]
    assert head[-1] == "% of convert()" and len(rows) == 2
    assert all(len(row) == len(head) for row in rows)
    text = bench.convert_cost_markdown(results, {"cpu": "test"})
    assert f"| chain | none | {N} |" in text and f"| chain | torch | {N} |" in text
    assert "Peak traced Python memory" in text


def test_linearity_ratio():
    def row(n, ms):
        return bench.ConvertCost(
            "chain", "torch", n, nodes=2 * n, stage_ms={"classify": ms}, stage_cpu_ms={"classify": ms}
        )

    assert bench.linearity([row(250, 500.0), row(8000, 32000.0)]) == {"torch: N=8000 vs N=250": 2.0}


def test_missing_library_is_skipped_with_reason(monkeypatch):
    from precast.bench.convert import models as convert_models

    monkeypatch.setitem(convert_models.CONVERT_MODELS, "fake", ("no_such_library_precast", lambda: None))
    said = []
    assert bench.run_convert_bench((), ("fake",), log=said.append, progress=False) == []
    assert said and "skipped fake: no_such_library_precast is not installed" in said[0]


def test_cli_convert_mode(tmp_path, capsys):
    from precast.cli import main

    code = main(
        [
            "bench",
            "--convert",
            "--model",
            "chain",
            "--sizes",
            "4",
            "--policy",
            "torch",
            "--no-memory",
            "--no-verify",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "ms per node" in out and "chain" in out
    data = json.loads((tmp_path / "convert_cost.json").read_text())
    assert [(r["model"], r["policy"], r["ops"]) for r in data["results"]] == [("chain", "torch", 4)]
    assert data["results"][0]["error"] is None
    assert "| chain | torch | 4 |" in (tmp_path / "convert_cost.md").read_text()


def test_cli_convert_unknown_model_is_one_line_error(capsys):
    from precast.cli import main

    assert main(["bench", "--convert", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) ['nope']" in err and err.count("\n") == 1
