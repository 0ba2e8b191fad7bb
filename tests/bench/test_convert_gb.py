"""``precast bench --convert --llama``: the per-GB conversion cost's own code path on a tiny Llama (speed and
memory are printed by benchmarks/convert_cost.py --llama, never asserted here)."""

from __future__ import annotations

import json
import time

import pytest

from precast.bench.convert.gb import RssClock, rss_bytes


def test_rss_clock_sees_a_stage_allocation():
    import torch

    clock = RssClock(interval=0.001)
    with clock, clock("outer"), clock("inner"):
        big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        time.sleep(0.01)
        del big
    assert clock.rss_peak["inner"] >= 60 << 20 and clock.rss_peak["outer"] >= 60 << 20
    assert clock.peak_extra >= 60 << 20 and rss_bytes() > 0
    assert clock.cpu_ms["inner"] > 0 and set(clock.ms) == {"outer", "inner"}


def test_cli_llama_tiny_rules(tmp_path, capsys):
    pytest.importorskip("transformers")
    from precast.cli import main

    code = main(["bench", "--convert", "--llama", "tiny", "--policy", "rules", "--out", str(tmp_path)])
    assert code == 0
    assert "| tiny | rules |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "convert_gb.json").read_text())["results"]
    assert len(rows) == 1 and rows[0]["error"] is None, rows
    row = rows[0]
    assert row["weight_bytes"] > 4 * row["params"] * 0.99 and row["wall_s"] > 0 and row["cpu_s"] > 0
    # default options, as a user runs it: the device check and the verification ran, each observed
    assert {"classify", "fold_constant_casts", "device_check", "verify"} <= set(row["stage_cpu_s"])
    assert row["peak_extra"] >= max(row["stage_peak"].values()) > 0
    assert "CPU s/GB per stage" in (tmp_path / "convert_gb.md").read_text()


def test_cli_llama_unknown_size_is_one_line_error(capsys):
    from precast.cli import main

    assert main(["bench", "--convert", "--llama", "7b"]) == 2
    err = capsys.readouterr().err
    assert "--llama ['7b']: choose from tiny, 0.2b, 1.1b" in err and err.count("\n") == 1


def test_cli_llama_refuses_options_it_does_not_take(capsys):
    from precast.cli import main

    assert main(["bench", "--convert", "--llama", "tiny", "--sizes", "4", "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert "--sizes, --no-verify do(es) not apply" in err and err.count("\n") == 1
    assert main(["bench", "--llama", "tiny"]) == 2
    assert "add --convert" in capsys.readouterr().err
