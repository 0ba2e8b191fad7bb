"""Load test (issue 20): 8 processes compile and load the same key at once while 4 threads in this process
convert modules, repeated. Nothing lost, nothing stale, every result bitwise right. Not a timed test.

    .venv/bin/python -m benchmarks.load_test [--rounds 3] [--procs 8] [--threads 4]   # from the repository root

Each round starts ``--procs`` children on one key (the small test MLP with the round's weights; round 3 reuses
round 1's key, so it is served from the cache). Each child converts, compiles into a fresh private temporary
cache shared by all, runs the compiled model and reports its key, whether it compiled, and its output. Checks:
one key per round, exactly one compile per key over the whole run (compile observers in the children), every
child's output bitwise equal to the others' and to the converted program's own module, every thread's
conversion bitwise equal to a conversion done alone beforehand, and every cache entry intact afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, precast
from precast.backends.aoti.package_cache import observe_compiles
from tests.conftest import small_model
seed, cache = int(sys.argv[1]), sys.argv[2]
model, inputs = small_model(seed)
res = precast.convert(model, inputs)
compiled = []
with observe_compiles(compiled.append):
    cm = precast.compile(res.program, cache_dir=cache, progress=False)
out = cm(*inputs)
want = res.program.module()(*inputs)
print(json.dumps({"key": cm.key, "compiles": len(compiled), "from_cache": cm.from_cache,
                  "out": out.tolist(), "bitwise_vs_program": bool(torch.equal(out, want))}))
"""


def start_child(seed: int, cache: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(seed), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)},
    )


def converter_threads(
    n: int, stop: threading.Event, failures: list[str]
) -> tuple[list[threading.Thread], list]:
    """``n`` threads converting small modules (4 seeds) until ``stop``; each result compared bitwise."""
    import precast
    from tests.conftest import small_model

    models = [small_model(100 + i) for i in range(4)]
    reference = [precast.convert(m, x).program.module()(*x) for m, x in models]
    done = [0]
    lock = threading.Lock()

    def work(i: int) -> None:
        k = i
        while not stop.is_set():
            m, x = models[k % 4]
            try:
                got = precast.convert(m, x).program.module()(*x)
                ok = torch.equal(got, reference[k % 4])
            except Exception as exc:  # noqa: BLE001 - counted as a failure and reported
                ok, got = False, f"{type(exc).__name__}: {exc}"
            with lock:
                done[0] += 1
                if not ok:
                    failures.append(f"thread {i}: conversion {k % 4} differs or failed: {str(got)[:200]}")
            k += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    return threads, done


def main(argv: list[str] | None = None) -> int:
    from precast.backends.aoti.package_cache import read_entry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args(argv)

    failures: list[str] = []
    keys_compiled: dict[str, int] = {}
    runs = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="precast-load-") as tmp:
        cache = Path(tmp) / "cache"
        stop = threading.Event()
        threads, conversions = converter_threads(args.threads, stop, failures)
        for t in threads:
            t.start()
        for r in range(args.rounds):
            seed = [11, 12][r % 2]  # round 3 reuses round 1's key: served from the cache
            procs = [start_child(seed, cache) for _ in range(args.procs)]
            results = []
            for p in procs:
                out, err = p.communicate(timeout=900)
                runs += 1
                if p.returncode != 0:
                    failures.append(f"round {r}: child exit {p.returncode}: {err.strip()[-300:]}")
                    continue
                results.append(json.loads(out.strip().splitlines()[-1]))
            keys = {res["key"] for res in results}
            if len(keys) != 1:
                failures.append(f"round {r}: {len(keys)} keys for one program")
            for res in results:
                keys_compiled[res["key"]] = keys_compiled.get(res["key"], 0) + res["compiles"]
                if res["out"] != results[0]["out"]:
                    failures.append(f"round {r}: outputs differ between processes")
                if not res["bitwise_vs_program"]:
                    failures.append(f"round {r}: compiled output differs from the program's module")
            fresh = sum(not res["from_cache"] for res in results)
            print(
                f"round {r + 1}: {len(results)}/{args.procs} processes ok, {fresh} compiled, "
                f"{conversions[0]} thread conversions so far",
                flush=True,
            )
        stop.set()
        for t in threads:
            t.join(timeout=300)
        for key, n in keys_compiled.items():
            if n != 1:
                failures.append(f"key {key[:12]} compiled {n} times (want exactly 1)")
        for entry in (cache / "aoti").iterdir():
            manifest, why = read_entry(entry, entry.name)
            if manifest is None:
                failures.append(f"cache entry {entry.name[:12]}: {why}")
        leftovers = list((cache / "tmp").iterdir())
        if leftovers:
            failures.append(f"{len(leftovers)} leftover build folders in the cache's tmp/")
    print(
        f"load test: {args.rounds} rounds x {args.procs} processes = {runs} process runs, {len(keys_compiled)} keys, "
        f"{sum(keys_compiled.values())} compiles, {conversions[0]} thread conversions ({args.threads} threads), "
        f"failures: {len(failures)}; {time.perf_counter() - started:.0f} s, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
