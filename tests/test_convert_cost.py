"""The conversion-cost benchmark's own code path on a tiny chain (speed is printed by benchmarks/, never
asserted here)."""

from __future__ import annotations

import json

import pytest

import precast
from precast import bench

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


def test_staged_convert_is_convert(chain_ep):
    """The mirror calls the same stages as precast.convert: the same program comes out (else the benchmark
    times something else than convert(); update ``staged_convert``)."""
    for policy in (None, "torch"):
        _, out = bench.staged_convert(chain_ep, policy)
        want = precast.convert(chain_ep, policy=policy, verify=False).program
        assert out.graph_module.code == want.graph_module.code
        assert out.graph_signature == want.graph_signature


def test_rows_and_positive_times(chain_ep, capsys):
    results = [
        bench.measure_convert_cost(chain_ep, "chain", policy, N, memory=True, verify=True)
        for policy in (None, "torch")
    ]
    assert [(r.model, r.policy, r.ops) for r in results] == [("chain", "none", N), ("chain", "torch", N)]
    for r in results:
        assert r.error is None and r.nodes > N
        core = set(bench.CONVERT_STAGES) - {"restore_output_dtypes", "fake_state"}  # optional
        assert core <= set(r.stage_ms), core - set(r.stage_ms)
        assert all(v > 0 for v in r.stage_ms.values())
        assert r.verify_ms > 0 and r.convert_ms > 0 and r.ms_per_node > 0
        assert r.peak_kib > 0 and set(r.stage_kib) == set(r.stage_ms)
    head, rows = bench.convert_cost_rows(results)
    assert (
        head[:7] == ["model", "policy", "N", "nodes", "total ms", "ms/node", "cpu ms/node"] and len(rows) == 2
    )
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
    monkeypatch.setitem(bench.CONVERT_MODELS, "fake", ("no_such_library_precast", lambda: None))
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
    assert "| chain | torch | 4 |" in (tmp_path / "convert_cost.md").read_text()


def test_cli_convert_unknown_model_is_one_line_error(capsys):
    from precast.cli import main

    assert main(["bench", "--convert", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown model(s) ['nope']" in err and err.count("\n") == 1
