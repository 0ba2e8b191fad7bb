"""benchmarks/llm_decode.py in --quick mode on its eager variants (no AOTInductor compile): the table, the
files and the targets section are written; no timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_the_in_process_anchor_needs_the_anchor_in_the_same_run(tmp_path):
    """openvino_anchor_inprocess runs the IR openvino_anchor exported: alone, it is a row error, and the other
    variants still run."""
    from benchmarks import llm_decode

    argv = ["--quick", "--variant", "eager_fp32", "openvino_anchor_inprocess", "--threads", "1"]
    argv += ["--repeats", "1", "--steps", "1", "--no-rss", "--out", str(tmp_path)]
    assert llm_decode.main(argv) == 0
    payload = json.loads((tmp_path / "llm_decode.json").read_text())
    assert set(payload["runs"]["1"]) == {"eager_fp32"}
    assert (
        "needs openvino_anchor in the same run" in payload["variants"]["openvino_anchor_inprocess"]["error"]
    )


def test_interleaved_samples_every_form_in_turn_and_reports_failures():
    from precast.bench import decode

    calls = []

    class Form:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def warm(self):
            if self.fail:
                raise RuntimeError("no such kernel\nsecond line")

        def sample(self, steps, threads):
            calls.append(self.name)
            return 1.0, {"a": 2.0, "b": 4.0}[self.name] + len(calls) * 0.001

    out, failed = decode.interleaved(
        {"a": Form("a"), "bad": Form("bad", fail=True), "b": Form("b")}, 1, 3, 2, lambda m: None
    )
    assert calls == ["a", "b"] * 3  # repeat by repeat, each form once: load hits all alike
    assert failed == {"bad": "RuntimeError: no such kernel"}
    assert out["a"]["decode_ms"] == 2.003 and out["b"]["decode_ms"] == 4.004  # medians
    assert len(out["a"]["decode_samples_ms"]) == 3
    # a time budget already spent: the fewest repeats a median takes, never fewer
    calls.clear()
    out, _ = decode.interleaved({"a": Form("a")}, 1, 10, 2, lambda m: None, deadline=0.0)
    assert len(out["a"]["decode_samples_ms"]) == decode.MIN_REPEATS == 2


def test_interleaved_takes_first_calls_in_the_order_asked():
    """The forms' first calls (where an OpenVINO model packs its weights) in the order given, or reversed; the
    repeats sample in the order given either way."""
    from precast.bench import decode

    events = []

    class Form:
        def __init__(self, name):
            self.name = name

        def warm(self):
            events.append(("warm", self.name))

        def sample(self, steps, threads):
            events.append(("sample", self.name))
            return 1.0, 2.0

    forms = {"a": Form("a"), "b": Form("b"), "c": Form("c")}
    decode.interleaved(forms, 1, 1, 2, lambda m: None)
    assert [n for kind, n in events if kind == "warm"] == ["a", "b", "c"]
    events.clear()
    decode.interleaved(forms, 1, 1, 2, lambda m: None, warm_reversed=True)
    assert [n for kind, n in events if kind == "warm"] == ["c", "b", "a"]
    assert [n for kind, n in events if kind == "sample"] == ["a", "b", "c"]


def test_paired_ratio_is_the_median_of_same_repeat_ratios():
    from benchmarks.llm_decode_weights import paired

    # load doubles both samples of repeats 2 and 3, and the reference's alone in repeat 4: the medians' ratio is
    # 22 / 10, the paired one stays the 1.1 every undisturbed pair shows
    form = {"decode_samples_ms": [10.0, 20.0, 20.0, 10.0, 10.0]}
    ref = {"decode_samples_ms": [11.0, 22.0, 22.0, 22.0, 11.0]}
    assert paired(form, ref) == 1.1
    assert paired(form, {"decode_samples_ms": [11.0]}) is None  # not the same repeats
    assert paired({}, ref) is None


def test_read_bytes_counts_weights_whole_one_embedding_row_and_the_cache():
    from precast.bench.decode import model as decode_model

    state = {
        "model.embed_tokens.weight": torch.zeros(100, 8),  # one row per token: 32 bytes
        "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8, dtype=torch.bfloat16),  # 256
        "static_cache.layers.0.keys": torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16),  # 128, cache
        "model.rotary_emb.inv_freq": torch.zeros(4),  # neither
    }
    held, read = decode_model.read_bytes(state)
    assert held == {"weights": 100 * 8 * 4 + 256, "cache": 128}
    assert read == 32 + 256 + 128


def test_anchor_environment_pins_the_running_torch_and_fails_fast():
    """The anchor's venv is the running interpreter's; torch is the running release as a CPU build (the local
    wheel, else the CPU index) and stays pinned in the constraints optimum-intel installs under (its dependencies
    once replaced torch 2.13.0 with a 6 GB CUDA build of 2.15.0); every pip call fails fast on an unreachable
    index."""
    import sys

    from benchmarks.harness import decode_anchor

    cmds = decode_anchor.anchor_env_commands("/tmp/env", None, torch_version="2.13.0+cpu")
    assert cmds[0] == [sys.executable, "-m", "venv", "/tmp/env"]
    pins = cmds[1][-1].splitlines()
    assert "torch==2.13.0" in pins and "transformers<5.6" in pins and "openvino==2026.4.1" in pins
    torch_cmd, optimum = cmds[2], cmds[3]
    assert "torch==2.13.0+cpu" in torch_cmd
    assert torch_cmd[torch_cmd.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert optimum[optimum.index("-c") + 1] == cmds[1][-2] and "optimum-intel[openvino]==2.2.*" in optimum
    for pip in (torch_cmd, optimum):
        assert pip[pip.index("--retries") + 1] == "0" and pip[pip.index("--timeout") + 1] == "15"
    assert (
        cmds[-1][-1] == "torchvision" and "uninstall" in cmds[-1]
    )  # its CUDA build breaks import optimum.intel
    wheel = decode_anchor.anchor_env_commands("/tmp/env", "/w/torch.whl", python="/usr/bin/python3.12")
    assert (
        wheel[0][0] == "/usr/bin/python3.12" and "/w/torch.whl" in wheel[2] and "--index-url" not in wheel[2]
    )
    # a PyPI build (no local label): its CPU twin
    assert "torch==2.15.0+cpu" in decode_anchor.anchor_env_commands("/e", torch_version="2.15.0")[2]


def test_build_anchor_env_stops_at_the_first_failure_in_one_line(monkeypatch, capsys, tmp_path):
    """The anchor's environment is the source checkout's (benchmarks/harness): its decode script builds it, and
    the first failing command is one line (pip's own reason), exit status 2."""
    import subprocess

    from benchmarks import llm_decode
    from benchmarks.harness import decode_anchor

    ran = []

    def fake_run(cmd, **kw):
        ran.append(cmd)
        fails = "install" in cmd and any(c.startswith("torch==") for c in cmd)
        err = "WARNING: Retrying\nERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu\n"
        return subprocess.CompletedProcess(cmd, 1 if fails else 0, "", err if fails else "")

    monkeypatch.setattr(decode_anchor.subprocess, "run", fake_run)
    assert llm_decode.main(["--build-anchor-env", str(tmp_path / "env")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("llm_decode: --build-anchor-env: ")
    assert "ERROR: Could not find a version" in last and "is partial" in last and "Traceback" not in err
    assert len(ran) == 3  # venv, constraints, torch: nothing after the failure


def test_precast_bench_llm_builds_no_anchor(monkeypatch, capsys):
    """The package's ``precast bench --llm`` has no anchor flags and no anchor form (the optimum-intel
    environment is the source checkout's); an anchor form no harness registered is a row error saying so."""
    from precast.bench import decode
    from precast.bench.decode import forms as decode_forms
    from precast.cli import main

    assert not any(f.startswith("openvino_anchor") for f in decode.FORMS)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--llm", "--build-anchor-env", "/tmp/x"])
    assert exit_.value.code == 2 and "unrecognized arguments: --build-anchor-env" in capsys.readouterr().err
    monkeypatch.setattr(
        decode_forms, "BUILDERS", {k: v for k, v in decode_forms.BUILDERS.items() if k != "openvino_anchor"}
    )
    with pytest.raises(RuntimeError, match="openvino_anchor: the source checkout's anchor harness builds it"):
        decode_forms.builder("openvino_anchor")
    with pytest.raises(RuntimeError, match="nosuch: no such form"):
        decode_forms.builder("nosuch")
    with pytest.raises(ValueError, match="have builders already"):
        decode_forms.register({"eager_fp32": decode_forms.build_eager})


def test_bench_llm_quick_eager_rows_and_a_missing_anchor_is_a_row_error(tmp_path, monkeypatch):
    from benchmarks.harness import decode_anchor  # registers the anchor forms
    from precast.bench import decode
    from precast.bench.decode import model as decode_model

    monkeypatch.setattr(decode_anchor, "ANCHOR_ENV", str(tmp_path / "no-env"))
    monkeypatch.delenv("PRECAST_OV_ANCHOR_PYTHON", raising=False)
    payload = decode.run_decode_bench(
        decode_model.QUICK,
        [1],
        1,
        1,
        forms=("eager_fp32", "eager_bf16", "openvino_anchor"),
        work=tmp_path,
        memory=False,
    )
    assert set(payload["runs"][1]) == {"eager_fp32", "eager_bf16"}
    assert "no anchor environment" in payload["errors"]["openvino_anchor"]
    assert payload["forms"]["eager_bf16"]["read_bytes"] * 2 == pytest.approx(
        payload["forms"]["eager_fp32"]["read_bytes"], rel=0.01
    )
    assert isinstance(payload["load_start"], list) and isinstance(payload["load_end"], list)
    # the fastest hand-cast form here is eager_bf16 (the only one): its own ratio is 1
    assert payload["ratios"][1]["eager_bf16"]["vs_fastest_hand_cast"] == {"form": "eager_bf16", "ratio": 1.0}
    text = decode.decode_markdown(payload)
    assert "| 1 | eager_bf16 |" in text and "no anchor environment" in text
    assert "x fastest hand-cast" in text and "x anchor" in text and "resident MiB" in text


def test_ratios_to_the_fastest_hand_cast_form_and_the_anchor():
    from precast.bench import decode

    table = {
        "eager_bf16": {"decode_ms": 40.0},
        "aoti_bf16": {"decode_ms": 25.0},
        "aoti_bf16_autotune": {"decode_ms": 20.0},  # the fastest hand-cast form: max-autotune counts
        "precast_torch": {"decode_ms": 16.0},
        "openvino_anchor": {"decode_ms": 32.0},
        "eager_fp32": {"decode_ms": 80.0},  # fp32: never the hand-cast reference
    }
    r = decode.ratios(table)
    assert r["precast_torch"] == {
        "vs_fastest_hand_cast": {"form": "aoti_bf16_autotune", "ratio": 1.25},
        "vs_anchor": 2.0,
    }
    assert (
        r["eager_fp32"]["vs_fastest_hand_cast"]["ratio"] == 0.25 and r["openvino_anchor"]["vs_anchor"] == 1.0
    )
    assert decode.ratios({"eager_fp32": {"decode_ms": 1.0}}) == {"eager_fp32": {}}  # no reference ran


def test_the_table_shows_memory_against_the_anchor():
    from precast.bench import decode

    run = {"prefill_ms": 10.0, "decode_ms": 20.0}
    payload = {
        "machine": {"cpu": "X", "cpu_capability": "AVX2", "torch": "2.13"},
        "load_start": [1.0, 1.0, 1.0],
        "load_end": [2.0, 2.0, 2.0],
        "shape": {},
        "repeats": 3,
        "steps": 8,
        "seconds": 12.0,
        "bandwidth_gbs": {2: 10.0},
        "forms": {
            "precast_openvino": {"rss_mb": 300.0, "read_bytes": 10**8, "compile_s": 5.0, "reloadable": "-"},
            "openvino_anchor": {"rss_mb": 400.0, "read_bytes": 10**8, "compile_s": 9.0, "reloadable": "-"},
        },
        "runs": {2: {"precast_openvino": run, "openvino_anchor": {"prefill_ms": 12.0, "decode_ms": 25.0}}},
        "errors": {},
    }
    payload["ratios"] = {2: decode.ratios(payload["runs"][2])}
    text = decode.decode_markdown(payload)
    row = next(ln for ln in text.splitlines() if ln.startswith("| 2 | precast_openvino |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5:9] == [
        "-",
        "1.25",
        "300.0",
        "0.75",
    ]  # no hand-cast form ran; 1.25x the anchor; 0.75x its memory
    assert "[1.0, 1.0, 1.0] before, [2.0, 2.0, 2.0] after" in text


def test_bench_llm_bad_option_is_one_line(capsys):
    from precast.cli import main

    assert main(["bench", "--llm", "--repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert "--repeats" in err and "Traceback" not in err


def test_the_anchor_ir_is_fed_as_optimum_intel_feeds_it():
    """The anchor's IR run in this process (decode and whole-window accuracy alike): input ids at their positions,
    an all-ones mask up to the last one, beam 0; a window starts from an empty state."""
    import numpy as np

    from benchmarks.harness.decode_anchor import infer_logits, window_runner

    class Request:
        def __init__(self):
            self.fed, self.resets = [], 0

        def infer(self, feed):
            self.fed.append(feed)

        def reset_state(self):
            self.resets += 1

        def get_output_tensor(self, i):
            return type("T", (), {"data": np.arange(15, dtype=np.float32).reshape(1, 3, 5)})()

    r = Request()
    out = window_runner(r)(torch.tensor([[5, 6, 7]]))
    assert r.resets == 1 and torch.equal(out, torch.arange(15.0).reshape(3, 5))
    feed = r.fed[0]
    assert feed["input_ids"].tolist() == [[5, 6, 7]] and feed["position_ids"].tolist() == [[0, 1, 2]]
    assert feed["attention_mask"].tolist() == [[1, 1, 1]] and feed["position_ids"].dtype == np.int64
    assert feed["beam_idx"].tolist() == [0] and feed["beam_idx"].dtype == np.int32
    infer_logits(r, torch.tensor([[9]]), torch.tensor([4]))
    assert r.fed[1]["attention_mask"].shape == (1, 5) and r.fed[1]["position_ids"].tolist() == [[4]]
    assert r.resets == 1  # a decode step keeps the state
