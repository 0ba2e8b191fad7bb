"""Fault test (issue 20): ``kill -9`` at random points of compiles and saves, then verify the cache and the
outputs. Nothing lost, nothing stale, every result bitwise right. Not a timed test.

    .venv/bin/python -m benchmarks.fault_test [--compile-kills 3] [--save-kills 12] [--seed 0]   # repo root

Compile: a child converts and compiles the small test MLP (fresh weights per trial, so a cold key) into a
private temporary cache and is killed at a uniformly random moment of its measured run time. Then every entry
in the cache must be intact (``read_entry``), the key compiles again in a fresh child, whose output must equal
the converted program's own module bitwise.
Save: ``precast convert tests.conftest:... -o out.pt2`` over an existing ``out.pt2`` is killed at a random moment.
Then ``out.pt2`` must be the old file or the new one, whole (it loads, and its module's output equals the
expected one bitwise), and the folder must hold nothing else (no partial or temporary file).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.load_test import CHILD  # noqa: E402

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}


def run_child(seed: int, cache: Path, kill_after: float | None) -> tuple[int, str, float]:
    started = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(seed), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    if kill_after is not None:
        try:
            p.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=900)
    return p.returncode, out, time.perf_counter() - started


def compile_trials(n: int, rng: random.Random, failures: list[str]) -> int:
    from precast.backends.aoti.package_cache import read_entry

    kills = 0
    with tempfile.TemporaryDirectory(prefix="precast-fault-") as tmp:
        cache = Path(tmp) / "cache"
        rc, out, clean = run_child(500, cache, None)  # how long one cold compile takes here
        if rc != 0:
            failures.append(f"the undisturbed compile failed ({rc})")
            return 0
        for t in range(n):
            seed = 501 + t
            at = rng.uniform(0.1, 1.0) * clean
            rc, _, _ = run_child(seed, cache, at)
            killed = rc == -signal.SIGKILL
            kills += killed
            for entry in (cache / "aoti").iterdir():
                manifest, why = read_entry(entry, entry.name)
                if manifest is None:
                    failures.append(f"compile trial {t}: entry {entry.name[:12]} left damaged: {why}")
            rc, out, _ = run_child(seed, cache, None)
            if rc != 0:
                failures.append(f"compile trial {t}: the compile after the kill failed ({rc})")
                continue
            res = json.loads(out.strip().splitlines()[-1])
            if not res["bitwise_vs_program"]:
                failures.append(f"compile trial {t}: output differs from the program's module")
            print(
                f"compile trial {t + 1}: killed at {at:.1f} s of ~{clean:.0f} s ({'killed' if killed else 'had finished'}),"
                f" then {'compiled' if res['compiles'] else 'loaded from cache'}; ok",
                flush=True,
            )
    return kills


SAVE_MODEL = "benchmarks.fault_test:save_model"


def save_model():
    """What the save trials convert: the small test MLP with fixed weights (a module-level factory)."""
    from tests.conftest import small_model

    return small_model(7)


def save_trials(n: int, rng: random.Random, failures: list[str]) -> int:
    import precast
    from precast.pipeline.load import load_program

    model, inputs = save_model()
    want = precast.convert(model, inputs).program.module()(*inputs)
    kills = 0
    with tempfile.TemporaryDirectory(prefix="precast-fault-save-") as tmp:
        folder = Path(tmp) / "out"
        folder.mkdir()
        out = folder / "model.pt2"
        cmd = [sys.executable, "-m", "precast", "convert", SAVE_MODEL, "-o", str(out), "--no-verify"]
        started = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, check=True)
        clean = time.perf_counter() - started
        old = out.read_bytes()
        for t in range(n):
            out.write_bytes(old)
            # half the kills anywhere, half in the last stretch where the file is written
            at = rng.uniform(0.3, 1.05) * clean if t % 2 else rng.uniform(0.85, 1.05) * clean
            p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                p.wait(timeout=at)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=120)
            kills += p.returncode == -signal.SIGKILL
            names = sorted(x.name for x in folder.iterdir())
            if names != ["model.pt2"]:
                failures.append(f"save trial {t}: the folder holds {names}")
            try:
                got = load_program(out).module()(*inputs)
                if not torch.equal(got, want):
                    failures.append(f"save trial {t}: the saved program computes something else")
            except Exception as exc:  # noqa: BLE001 - a torn file is the failure this test looks for
                failures.append(f"save trial {t}: model.pt2 does not load: {exc}")
    print(f"save trials: {n}, killed {kills} mid-run (~{clean:.1f} s per clean run)", flush=True)
    return kills


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-kills", type=int, default=3)
    ap.add_argument("--save-kills", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    failures: list[str] = []
    started = time.perf_counter()
    save_kills = save_trials(args.save_kills, rng, failures)
    compile_kills = compile_trials(args.compile_kills, rng, failures)
    runs = args.save_kills + 2 * args.compile_kills + 1
    print(
        f"fault test: {runs} runs, {args.compile_kills} compile trials ({compile_kills} killed mid-run), "
        f"{args.save_kills} save trials ({save_kills} killed mid-run), failures: {len(failures)}; "
        f"{time.perf_counter() - started:.0f} s, torch {torch.__version__}"
    )
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
