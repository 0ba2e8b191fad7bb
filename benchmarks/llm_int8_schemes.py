"""Which int8 rounding scheme, measured: SmolLM2-135M-Instruct's 2-d weights (every linear and the tied
embedding/head table) rounded per output row with four schemes and the model run on held-out text, in fp32 and
with the whole model in bf16 (weights only; the activations stay the model's own).

- ``sym``: ``s = absmax / 127`` (precast's ``int8``; the form AOTInductor's ``_weight_int8pack_mm`` reads);
- ``asym``: ``s = (max - min) / 255`` with an integer zero point (NNCF's ``INT8_ASYM``, what
  ``optimum-cli --weight-format int8`` stores);
- ``sym_mse`` / ``asym_mse``: the row's range clipped by the ratio in 0.70..0.99 that minimises the row's squared
  rounding error (a data-free scale search);
- ``asym_fp32_scale`` / ``asym_fp16_scale``: asym with its scale exact / on fp16's grid (NNCF stores f16 scales);
  ``precast int8-asym``: precast's own format (its bf16-grid scale rounded up, so the 256 integers cover the row).

Scales are on bf16's grid as precast stores them. Text and metric as ``benchmarks/llm_weights.py``: Python's
documentation topics, 1024 tokens skipped (the calibration part there), the next ``--tokens`` evaluated in windows
of 256, KLD(fp32 || form) in nats/token and top-1 agreement.

    PYTHONPATH=. python -m benchmarks.llm_int8_schemes [--tokens 2048] [--work /tmp/precast-bench] [--schemes ...]
        [--no-bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.llm_accuracy import compare, cpu_line, load_fp32, text_tokens

RATIOS = [r / 100 for r in range(70, 100)]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def sym(w: torch.Tensor, clip: float = 1.0) -> torch.Tensor:
    s = _bf16(w.abs().amax(1, keepdim=True) * clip / 127).clamp_min(1e-12)
    return (w / s).round().clamp(-127, 127) * s


def asym(w: torch.Tensor, clip: float = 1.0) -> torch.Tensor:
    lo = w.amin(1, keepdim=True).clamp(max=0) * clip
    hi = w.amax(1, keepdim=True).clamp(min=0) * clip
    s = _bf16((hi - lo) / 255).clamp_min(1e-12)
    z = (-lo / s).round().clamp(0, 255)
    return ((w / s).round() + z).clamp(0, 255).sub(z) * s


def searched(scheme):
    def run(w: torch.Tensor) -> torch.Tensor:
        best = scheme(w)
        err = ((best - w) ** 2).sum(1, keepdim=True)
        for r in RATIOS:
            c = scheme(w, r)
            e = ((c - w) ** 2).sum(1, keepdim=True)
            better = e < err
            best, err = torch.where(better, c, best), torch.where(better, e, err)
        return best

    return run


def asym_grid(grid: torch.dtype | None):
    """asym with its scale stored in ``grid`` (None: exact fp32), rounded to nearest."""

    def run(w: torch.Tensor) -> torch.Tensor:
        lo, hi = w.amin(1, keepdim=True).clamp(max=0), w.amax(1, keepdim=True).clamp(min=0)
        s = ((hi - lo) / 255).clamp_min(1e-12)
        s = s if grid is None else s.to(grid).float()
        z = (-lo / s).round().clamp(0, 255)
        return ((w / s).round() + z).clamp(0, 255).sub(z) * s

    return run


def precast_format(name: str):
    """precast's own format (``precast.quant.formats``), scales on bf16's grid, read in fp32."""
    from precast.quant.formats import dequantize, parse_format, quantize

    fmt = parse_format(name)
    return lambda w: dequantize(quantize(w, fmt, torch.bfloat16), fmt, torch.float32)


SCHEMES = {
    "sym": sym,
    "asym": asym,
    "sym_mse": searched(sym),
    "asym_mse": searched(asym),
    "asym_fp32_scale": asym_grid(None),
    "asym_fp16_scale": asym_grid(torch.float16),
    "precast int8-asym": precast_format("int8-asym"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--no-bf16", action="store_true", help="the fp32 model only")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    args = ap.parse_args(argv)
    model, tok = load_fp32(args.work)
    evaluation = text_tokens(tok, 1024, args.tokens + 1)
    w = args.window

    def run() -> dict[str, float]:
        total = {"kld": 0.0, "top1": 0.0, "n": 0.0}
        with torch.no_grad():
            for i, s in enumerate(range(0, args.tokens, w)):
                x = evaluation[s : s + w + 1]
                logits = model(input_ids=x[None, :-1]).logits[0].float()
                r = compare(references[i], logits, x[1:])
                for k in total:
                    total[k] += r[k]
        return {"kld": total["kld"] / total["n"], "top1": total["top1"] / total["n"]}

    references = []
    with torch.no_grad():
        for s in range(0, args.tokens, w):
            references.append(model(input_ids=evaluation[None, s : s + w]).logits[0].float())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = [k for k, v in state.items() if v.dim() == 2]
    print(f"{cpu_line()}; torch {torch.__version__}; {len(names)} 2-d weights; {args.tokens} tokens")
    print("| scheme | KLD (fp32 model) | top-1 | KLD (bf16 model) | top-1 |\n|---|---|---|---|---|")
    for label in args.schemes:
        scheme = SCHEMES[label]
        started = time.perf_counter()
        for n in names:
            model.state_dict()[n].copy_(scheme(state[n]))
        f32 = run()
        model.to(torch.bfloat16)
        b16 = {"kld": float("nan"), "top1": float("nan")} if args.no_bf16 else run()
        model.to(torch.float32)
        model.load_state_dict(state)
        print(
            f"| {label} | {f32['kld']:.5f} | {100 * f32['top1']:.2f}% | {b16['kld']:.5f} | {100 * b16['top1']:.2f}% |"
            f" <!-- {time.perf_counter() - started:.0f} s -->",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
