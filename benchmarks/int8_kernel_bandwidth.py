"""How fast torch's CPU weight-only int8 kernel reads its weights, next to the bf16 and fp32 GEMVs it replaces:
why precast's int8 on AOTInductor gains less over bf16 than the bytes say on a given CPU (issue 41).

For each linear shape of the 0.246 B decoder of ``benchmarks/llm_decode.py`` (one token: M = 1), times
``aten._weight_int8pack_mm`` (bf16 activations, int8 weights, bf16 scales: the kernel precast's AOTInductor form
calls), ``aten.mm`` in bf16 and in fp32, each cycling through enough copies of its weight (``--mib`` in all) that
every call reads its weight from memory, not from cache, as a decode step does; prints milliseconds per call, the
weight's GB/s, and the whole decoder's linears (16 layers and the head) per form, beside the bandwidth of summing a
large tensor (``precast.bench.decode.bandwidth_gbs``). The CPU, threads and load are printed with the table.

    PYTHONPATH=. python benchmarks/int8_kernel_bandwidth.py [--threads 1 2] [--repeats 20] [--mib 256]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable

import torch

from precast.bench.decode import Shape, bandwidth_gbs


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call (after two warm calls)."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def forms(n: int, k: int, mib: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Each form's call (cycling through cold copies of its weight) and the bytes of one weight."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, tuple[Callable[[], object], int]] = {}
    x16 = torch.randn(1, k, generator=g).bfloat16()
    scale = torch.rand(n, generator=g).bfloat16()
    for name, dtype, size in (
        ("int8 kernel", torch.int8, 1),
        ("bf16 mm", torch.bfloat16, 2),
        ("fp32 mm", torch.float32, 4),
    ):
        copies = max(2, mib * 2**20 // (n * k * size))
        if dtype is torch.int8:
            ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(copies)]
            cycle = itertools.cycle(ws)
            out[name] = (lambda c=cycle: torch.ops.aten._weight_int8pack_mm(x16, next(c), scale), n * k)
        else:
            ws = [
                torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)
            ]  # [N, K], as a linear stores it
            x = x16.to(dtype)
            cycle = itertools.cycle(ws)
            out[name] = (lambda c=cycle, x=x: torch.mm(x, next(c).t()), n * k * size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--mib", type=int, default=256, help="weight copies per form, in all (more than the caches)"
    )
    args = ap.parse_args()
    from benchmarks.llm_accuracy import cpu_line

    load = os.getloadavg()[0]
    print(f"CPU: {cpu_line()}; torch {torch.__version__}; load {load:.1f}")
    s = Shape()
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n{threads} thread(s); summing a 512 MiB tensor: {bandwidth_gbs(threads):.1f} GB/s")
            print("| linear | N x K | calls/token | form | ms/call | GB/s |\n|---|---|---|---|---|---|")
            totals: dict[str, float] = {}
            for name, n, k, calls in s.linears():
                for form, (fn, nbytes) in forms(n, k, args.mib).items():
                    sec = timed(fn, args.repeats)
                    totals[form] = totals.get(form, 0.0) + sec * calls
                    print(
                        f"| {name} | {n} x {k} | {calls} | {form} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.1f} |"
                    )
            base = totals["bf16 mm"]
            print(
                "decoder linears per token: "
                + ", ".join(f"{f} {t * 1e3:.1f} ms ({base / t:.2f}x bf16)" for f, t in totals.items())
            )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
