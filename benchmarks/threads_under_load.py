"""AOTInductor decode at 1 and 2 threads, with and without other processes on the cores (issue 49 item 3): why
``precast.runtime.threads.default_threads()`` leaves out the cores other processes keep busy.

    PYTHONPATH=. python -m benchmarks.threads_under_load [--hogs 0 1] [--repeats 5] [--steps 16] [--hog-seconds 90]

A Llama-shaped decoder with random weights (bf16, 4 layers, hidden 512, intermediate 1408, vocab 8000, a static
cache of 128), exported with transformers' recipe and compiled by ``precast.compile(mode="default", threads=N)`` for
each N. For each number of hogs (``python -c "while True: pass"`` processes, each bounded by ``timeout``), the two
counts are sampled interleaved (each repeat runs one sample of each: load hits both alike): the median ms per decode
token, the best, and the cores other processes kept busy meanwhile (``/proc/stat`` less this process's own time).
It prints the CPU, the load averages and what ``default_threads()`` says at each step. Not a timed test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import precast
from precast import cpu
from precast.bench.decode import Shape, decode_inputs, export_decoder, llama
from precast.runtime.threads import cpu_seconds, default_threads, others_busy, usable_cores

SHAPE = Shape(
    layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1408, vocab=8000, cache_len=128, context=32
)


def sample(cm, prompt: torch.Tensor, tokens: list[torch.Tensor], steps: int) -> float:
    """ms per decode token over ``steps`` tokens after the prompt."""
    cm.reset()
    cm(input_ids=prompt, cache_position=torch.arange(SHAPE.context))
    positions = [torch.tensor([SHAPE.context + i]) for i in range(steps)]
    t = time.perf_counter()
    for i in range(steps):
        cm(input_ids=tokens[i], cache_position=positions[i])
    return (time.perf_counter() - t) * 1e3 / steps


def phase(models: dict, hogs: int, repeats: int, steps: int, hog_seconds: int) -> None:
    prompt, tokens = decode_inputs(SHAPE)
    procs = [
        subprocess.Popen(["timeout", str(hog_seconds), sys.executable, "-c", "while True: pass"])
        for _ in range(hogs)
    ]
    try:
        time.sleep(1.0 if hogs else 0.0)
        times: dict[int, list[float]] = {n: [] for n in models}
        before, started = cpu_seconds(), time.perf_counter()
        with torch.no_grad():
            for cm in models.values():  # warm
                sample(cm, prompt, tokens, 2)
            for _ in range(repeats):
                for n, cm in models.items():
                    times[n].append(sample(cm, prompt, tokens, steps))
        busy = others_busy(before, cpu_seconds(), time.perf_counter() - started)
        chosen = default_threads()
    finally:
        for p in procs:  # each started here, ended here by its own id
            p.terminate()
            p.wait()
    cells = ", ".join(
        f"{n} thread(s): {statistics.median(t):.2f} ms/token median, {min(t):.2f} best "
        f"({1e3 / statistics.median(t):.1f} tokens/s)"
        for n, t in times.items()
    )
    busy_text = "unknown" if busy is None else f"{busy:.2f}"
    print(
        f"hogs={hogs}: {cells}; other processes busy on {busy_text} core(s) during the samples (hogs included); "
        f"default_threads() -> {chosen}; loadavg {os.getloadavg()}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hog-seconds", type=int, default=90)
    args = parser.parse_args()
    print(
        f"CPU: {cpu.model_name()} ({cpu.capability()}), {usable_cores()} usable core(s), "
        f"torch {torch.__version__}; loadavg {os.getloadavg()}",
        flush=True,
    )
    ep = export_decoder(llama(SHAPE, torch.bfloat16), SHAPE)
    models = {}
    for n in (1, 2):
        t = time.perf_counter()
        models[n] = precast.compile(ep, mode="default", threads=n, progress=False)
        print(f"compiled at {n} thread(s) in {time.perf_counter() - t:.1f} s ({models[n]})", flush=True)
    for hogs in args.hogs:
        phase(models, hogs, args.repeats, args.steps, args.hog_seconds)


if __name__ == "__main__":
    main()
