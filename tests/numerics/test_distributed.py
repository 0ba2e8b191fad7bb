"""Calibration statistics and sensitivity energies as mergeable values: merges bitwise equal to one pass over the
same batches in any split, files that round-trip and refuse what is not theirs, and a real
``torchrun --nproc-per-node 2`` (gloo, CPU) job whose ranks hold exactly what one process computes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precast
from precast.errors import PrecastError
from tests.numerics import dist_worker as case_mod
from tests.numerics.dist_worker import CONVERT, case, decisions, program_hash

ROOT = Path(__file__).resolve().parents[2]
# one process and the ranks sum the same per-batch energies (float64) in another order
ENERGY_RTOL = 1e-12


@contextlib.contextmanager
def one_thread():
    """The ranks run with OMP_NUM_THREADS=1: so does the one-process reference (same kernels, same bits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bits(cal: precast.Calibration) -> str:
    """The statistics as text, floats by repr: equal strings are equal bits (-0.0 and 0.0 differ)."""
    return (
        json.dumps({k: [repr(x) for x in vars(s).values()] for k, s in cal.stats.items()}) + f"|{cal.batches}"
    )


@pytest.fixture(scope="module")
def setup():
    with one_thread():
        ep, batches = case()
        one = precast.calibrate(ep, batches, dtype="fp16")
    return ep, batches, one


@pytest.mark.parametrize("world", [2, 3, 8])
def test_merged_shards_are_one_pass_bitwise(setup, world):
    ep, batches, one = setup
    with one_thread():
        shards = [
            precast.calibrate(ep, batches[r::world], dtype="fp16", shard=(r, world)) for r in range(world)
        ]
    for merged in (shards[0].merge(*shards[1:]), shards[-1].merge(*reversed(shards[:-1]))):
        assert bits(merged) == bits(one)
        assert merged.sample_index == one.sample_index == list(range(case_mod.BATCHES))
        assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(merged.sample, one.sample, strict=True))
    if world == 3:  # associative: (a + b) + c == a + (b + c)
        a, b, c = shards
        assert bits(a.merge(b).merge(c)) == bits(a.merge(b.merge(c))) == bits(one)


def test_any_partition_merges_to_the_same_statistics(setup):
    ep, batches, one = setup
    with one_thread():
        parts = [
            precast.calibrate(ep, batches[i:j], dtype="fp16", keep=0) for i, j in ((0, 1), (1, 6), (6, 8))
        ]
    assert bits(parts[2].merge(parts[0], parts[1])) == bits(one)


def test_merged_statistics_convert_like_one_process(setup, tmp_path):
    ep, batches, one = setup
    with one_thread():
        ref = precast.convert(ep, calibration=batches, **CONVERT)
        halves = [precast.calibrate(ep, batches[r::2], dtype="fp16", shard=(r, 2)) for r in range(2)]
        for r, h in enumerate(halves):
            h.save(tmp_path / f"rank{r}.json")
        from_files = precast.convert(
            ep, calibration=[tmp_path / "rank1.json", tmp_path / "rank0.json"], **CONVERT
        )
        given = precast.convert(ep, calibration=one, **CONVERT)
    rules = {r[2] for r in decisions(ref.report)}
    assert {"data_max", "tolerance"} <= rules  # the case exercises both the ranges and the kept sample
    for res in (from_files, given):
        assert decisions(res.report) == decisions(ref.report)
        assert program_hash(res.program) == program_hash(ref.program)


def test_file_round_trip_and_safetensors(setup, tmp_path):
    _, batches, one = setup
    one.save(tmp_path / "cal.json")
    back = precast.load_calibration(tmp_path / "cal.json")
    assert bits(back) == bits(one) and (back.key, back.dtype, back.keep) == (one.key, "fp16", 8)
    assert back.sample_index == one.sample_index
    assert all(torch.equal(a[0][0], b[0]) for a, b in zip(back.sample, batches, strict=True))
    json.loads((tmp_path / "cal.json").read_text())  # plain JSON (no NaN/Infinity literals)
    safetensors = pytest.importorskip("safetensors.torch")
    read = safetensors.load_file(str(tmp_path / "cal.sample.safetensors"))
    assert torch.equal(read["b3.0"], batches[3][0])


def test_refusals(setup, tmp_path):
    ep, batches, one = setup
    one.save(tmp_path / "cal.json")
    other = torch.export.export(torch.nn.Linear(16, 8), batches[0])
    with pytest.raises(PrecastError, match="measured on another program"):
        precast.convert(other, calibration=one, **CONVERT)
    with pytest.raises(PrecastError, match="measured for fp16, this conversion lowers to bf16"):
        precast.convert(ep, calibration=tmp_path / "cal.json", policy="rules", dtype="bf16")
    with pytest.raises(PrecastError, match="both hold measurement"):  # the same value twice, whatever keep
        one.merge(one)
    with pytest.raises(PrecastError, match="both hold batch 0"):  # two measurements of overlapping shards
        one.merge(precast.calibrate(ep, batches[:2], dtype="fp16"))
    bf16 = precast.calibrate(ep, batches[:1], dtype="bf16")
    with pytest.raises(PrecastError, match="another low dtype"):
        one.merge(bf16)
    with pytest.raises(PrecastError, match="keep none"):
        precast.convert(ep, calibration=precast.calibrate(ep, batches, dtype="fp16", keep=0), **CONVERT)
    bad = tmp_path / "bad.json"
    for text, needle in (
        ((tmp_path / "cal.json").read_text()[:-40], "not JSON"),
        ('{"format": "precast-plan", "version": 1}', "not a precast-calibration file"),
        ('{"format": "precast-calibration", "version": 1, "stats": {}}', "malformed"),
    ):
        bad.write_text(text)
        with pytest.raises(PrecastError, match=needle) as info:
            precast.load_calibration(bad)
        assert "\n" not in str(info.value)
    side = tmp_path / "cal.sample.safetensors"
    data = bytearray(side.read_bytes())
    data[-1] ^= 1
    side.write_bytes(bytes(data))
    with pytest.raises(PrecastError, match="does not match its sha256"):
        precast.load_calibration(tmp_path / "cal.json")
    side.write_bytes(bytes(data[:20]))
    with pytest.raises(PrecastError, match="sha256"):
        precast.load_calibration(tmp_path / "cal.json")


def test_energies_merge_save_and_reuse(setup, tmp_path):
    ep, batches, _ = setup
    with one_thread():
        one = precast.sensitivity(ep, batches[0], dtype="fp16", data=batches)
        halves = [
            precast.sensitivity(ep, batches[0], dtype="fp16", data=batches[r::2]).energies for r in range(2)
        ]
    merged = halves[1].merge(halves[0])
    assert merged.batches == one.energies.batches == 8 and merged.ranges == one.energies.ranges
    assert merged.energy.keys() == one.energies.energy.keys()
    for k, e in one.energies.energy.items():
        assert merged.energy[k] == pytest.approx(e, rel=ENERGY_RTOL, abs=0)
    merged.save(tmp_path / "e.json")
    assert precast.load_energies(tmp_path / "e.json") == merged  # floats round-trip exactly through JSON
    reused = precast.sensitivity(ep, batches[0], dtype="fp16", energies=[tmp_path / "e.json"])
    assert reused.estimate.order == one.estimate.order
    with pytest.raises(PrecastError, match="cannot merge energies"):
        precast.sensitivity(ep, batches[0], dtype="fp16", metric="cosine", energies=merged)
    (tmp_path / "e.json").write_text('{"format": "precast-energies", "version": 1, "energy": [[1]]}')
    with pytest.raises(PrecastError, match="malformed"):
        precast.load_energies(tmp_path / "e.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_match_one_process(setup, tmp_path):
    """``torchrun --nproc-per-node 2`` (gloo, CPU): each rank calibrates and estimates on its half; every rank's
    merged statistics are bitwise one process's over the same 8 batches, with the same kept sample, the same
    decisions and converted program, and energies within ENERGY_RTOL. A rank with no batches still merges
    (calibration) or stops every rank with one line (sensitivity), never leaving the other waiting."""
    ep, batches, one = setup
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
    ]
    cmd += ["--master-port", str(_free_port()), str(ROOT / "tests/numerics/dist_worker.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with one_thread():
        ref = precast.convert(ep, calibration=batches, **CONVERT)
        sens = precast.sensitivity(ep, batches[0], dtype="fp16", data=batches)
    for rank in range(2):
        got = precast.load_calibration(tmp_path / f"rank{rank}.cal.json")
        assert bits(got) == bits(one) and got.sample_index == one.sample_index
        assert all(torch.equal(a[0][0], b[0]) for a, b in zip(got.sample, batches, strict=True))
        assert bits(precast.load_calibration(tmp_path / f"rank{rank}.uneven.json")) == bits(one)
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "a rank has no batch in data=" in facts["empty_rank"]
        assert facts["decisions"] == decisions(ref.report)
        assert facts["hash"] == program_hash(ref.program)
        assert facts["order"] == sens.estimate.order
        energies = precast.load_energies(tmp_path / f"rank{rank}.energies.json")
        assert energies.batches == 8 and energies.ranges == sens.energies.ranges
        for k, e in sens.energies.energy.items():
            assert energies.energy[k] == pytest.approx(e, rel=ENERGY_RTOL, abs=0)


def test_cli_merges_statistics_and_energies_from_files(setup, tmp_path, capsys):
    """``precast convert --calibration-stats`` merges rank files into the one-process conversion; ``precast
    sensitivity --energies`` ranks from merged energy files; a file of another program exits 2 in one line."""
    from precast.cli import main

    ep, batches, _ = setup
    torch.export.save(ep, tmp_path / "m.pt2")
    torch.save(batches[0], tmp_path / "x.pt")
    with one_thread():
        for r in range(2):
            precast.calibrate(ep, batches[r::2], dtype="fp16", shard=(r, 2)).save(tmp_path / f"c{r}.json")
            precast.sensitivity(ep, batches[0], dtype="fp16", data=batches[r::2]).energies.save(
                tmp_path / f"e{r}.json"
            )
        ref = precast.convert(ep, calibration=batches, policy="rules", dtype="fp16")
        sens = precast.sensitivity(ep, batches[0], dtype="fp16", data=batches)
        common = ["--policy", "rules", "--dtype", "fp16", "--no-verify"]
        rc = main(
            [
                "convert",
                str(tmp_path / "m.pt2"),
                "-o",
                str(tmp_path / "o.pt2"),
                *common,
                "--calibration-stats",
            ]
            + [str(tmp_path / f"c{r}.json") for r in range(2)]
        )
        assert rc == 0
        assert program_hash(torch.export.load(tmp_path / "o.pt2")) == program_hash(ref.program)
        capsys.readouterr()
        argv = ["sensitivity", str(tmp_path / "m.pt2"), "--inputs", str(tmp_path / "x.pt"), "--dtype", "fp16"]
        rc = main(
            [
                *argv,
                "--json",
                "--energies",
                str(tmp_path / "e0.json"),
                str(tmp_path / "e1.json"),
                "--write-energies",
                str(tmp_path / "all.json"),
            ]
        )
        assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["order"] == sens.estimate.order and precast.load_energies(tmp_path / "all.json").batches == 8
    precast.calibrate(torch.nn.Linear(16, 8), batches[:1], batches[0], dtype="fp16").save(
        tmp_path / "other.json"
    )
    rc = main(
        [
            "convert",
            str(tmp_path / "m.pt2"),
            "-o",
            str(tmp_path / "o2.pt2"),
            *common,
            "--calibration-stats",
            str(tmp_path / "other.json"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and "measured on another program" in err
        and "\n" not in err
        and not (tmp_path / "o2.pt2").exists()
    )
