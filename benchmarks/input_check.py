"""What the compiled model's input check costs on the benchmark MLP (4x Linear(1024, 1024) + head, CPU bf16,
batch 1): the check alone, the checked call, and the unchecked runner call, in one run (interleaved repeats).

    .venv/bin/python -m benchmarks.input_check [--repeats 200] [--cache-dir DIR]   # from the repository root

Issue 20 target (printed, never asserted): the check costs under 2% of the call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import precast  # noqa: E402
from precast.bench.models import mlp  # noqa: E402


def per_call_us(fn, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200, help="rounds; each times every variant over --calls")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)

    model, inputs = mlp(args.batch)
    cm = precast.compile(precast.convert(model, inputs).program, cache_dir=args.cache_dir)
    x = inputs[0]
    variants = {
        "check only": lambda: cm.signature.check((x,), {}),
        "checked call (CompiledModel)": lambda: cm(x),
        "unchecked runner call": lambda: cm._runner(x),
        "unchecked loader call": lambda: cm._boxed_run([x]),
    }
    with torch.no_grad():
        for fn in variants.values():
            per_call_us(fn, 50)  # warm up
        samples = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():
                samples[name].append(per_call_us(fn, args.calls))
    med = {name: statistics.median(s) for name, s in samples.items()}
    for name, us in med.items():
        print(f"{name:32s} {us:9.2f} us")
    call = med["checked call (CompiledModel)"]
    print(
        f"check / checked call: {100 * med['check only'] / call:.2f}% (target < 2%); checked call / unchecked "
        f"runner call: {call / med['unchecked runner call']:.3f}x; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, batch {args.batch}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
