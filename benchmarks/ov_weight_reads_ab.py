"""bf16 weights read as compressed weights against read directly, one OpenVINO hint, one process (issue 49).

Compiles precast's converted decoder (the decode benchmark's cached program, ``--program``) twice with
``precast.compile(backend="openvino", precision_hint=HINT)``: as precast makes it (each bf16 Linear reads its
weight through a cast marked as a decompression: ``precision.weights_read_compressed``) and with that step
switched off (the weights read directly, the control). Prefills a seeded prompt of 256 tokens, then times decode
steps in blocks of 4, the two models alternating (the order flipped every block), and prints each model's median
ms/token, the paired ratio (the median of the ratios of samples taken back to back) and the ratio of medians, the
prefill logits' largest difference and top-1 agreement, and the CPU, its load and what OpenVINO reports of it.
Run it on AVX2 code paths with ``ONEDNN_MAX_CPU_ISA=AVX2 OV_CPU_MAX_ISA=AVX2``.

    PYTHONPATH=. python -m benchmarks.ov_weight_reads_ab [--hint f32] [--threads 1] [--steps 64] [--rounds 3]
        [--program /tmp/precast-llm-decode/precast_openvino-*.program.pt2]

The program: ``python -m benchmarks.llm_decode_weights --forms precast_openvino`` leaves it in its work folder.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from unittest import mock

import torch

import precast
from precast import cpu
from precast.backends.openvino import precision


def _compile(program, hint: str, threads: int, direct: bool):
    if not direct:
        return precast.compile(program, backend="openvino", threads=threads, precision_hint=hint, warn=False)
    with mock.patch.object(precision, "weights_read_compressed", lambda model: 0):
        return precast.compile(program, backend="openvino", threads=threads, precision_hint=hint, warn=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hint", default="f32", help="precision_hint= of both compiles (default f32)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round (a multiple of 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--program", default="/tmp/precast-llm-decode/precast_openvino-*.program.pt2")
    args = ap.parse_args()
    found = sorted(glob.glob(args.program))
    if not found:
        raise SystemExit(
            f"no program at {args.program}: run python -m benchmarks.llm_decode_weights --forms precast_openvino"
        )
    import openvino as ov

    torch.set_num_threads(args.threads)
    core = ov.Core()
    print(
        f"CPU: {cpu.model_name()} ({cpu.low_precision_flags()}); OpenVINO {ov.get_version()}: native bf16 "
        f"{precision.native_bf16(core)}; "
        f"load {os.getloadavg()[0]:.2f}; threads {args.threads}; hint {args.hint}; program {found[0]}"
    )
    program = torch.export.load(found[0])
    models = {"compressed": _compile(program, args.hint, args.threads, False)}
    models["direct"] = _compile(program, args.hint, args.threads, True)
    for name, m in models.items():
        print(f"{name}: form {m.plan.form!r}, overridden {len(m.plan.overridden)}")
    ctx, steps = 256, args.steps - args.steps % 4
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 32000, (1, ctx), generator=g)
    toks = torch.randint(0, 32000, (steps, 1, 1), generator=g)
    times: dict[str, list[float]] = {n: [] for n in models}
    first: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, m in models.items():
                out = m(input_ids=prompt, cache_position=torch.arange(ctx))
                first.setdefault(name, (out[0] if isinstance(out, (tuple, list)) else out).float())
            order = list(models.items())
            for b in range(0, steps, 4):
                order = order[::-1]
                for name, m in order:
                    t0 = time.perf_counter()
                    for i in range(b, b + 4):
                        m(input_ids=toks[i], cache_position=torch.tensor([ctx + i]))
                    times[name].append((time.perf_counter() - t0) / 4)
    for name in models:
        print(
            f"{name}: median {statistics.median(times[name]) * 1e3:.2f} ms/token ({len(times[name])} samples)"
        )
    paired = statistics.median(c / d for c, d in zip(times["compressed"], times["direct"], strict=True))
    medians = statistics.median(times["compressed"]) / statistics.median(times["direct"])
    print(f"compressed / direct time: paired {paired:.4f}, ratio of medians {medians:.4f}")
    a, b = first["compressed"], first["direct"]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"prefill logits: max abs difference {(a - b).abs().max().item():.4g}, top-1 agreement {agree:.4f}")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
