"""policy="auto" vs fp32 under AOTInductor, in one run: for the MLP, a CNN and MiniLM, the speed of
``precast.convert(fp32 program, policy="auto") + precast.compile`` against the fp32 program compiled alike,
interleaved repeats, with what auto chose per op and why.

    .venv/bin/python -m benchmarks.auto_speed [--models mlp cnn minilm] [--dtype bf16] [--repeats 30]
                                              [--out docs/benchmarks]            # from the repository root

Target (printed, never asserted): auto >= 1.0x the fp32 AOTInductor speed on this machine. Each model
compiles twice (about 25 s each on a 2-core CPU; cached by precast.compile after the first run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import precast  # noqa: E402
from precast import bench  # noqa: E402
from precast.dtypes import ALIASES  # noqa: E402
from precast.errors import PrecastError  # noqa: E402
from precast.metrics import flat_error  # noqa: E402

MODELS = ("mlp", "cnn", "minilm")


def _build(name: str):
    from precast.bench import models

    return getattr(models, name)()


def run_model(name: str, low: torch.dtype, repeats: int, cache_dir: str | None) -> dict:
    model, inputs = _build(name)
    model.eval()
    with bench.regions(model, enabled=False):  # the fp32 program: the model's autocast switch off
        fp32_ep = torch.export.export(model, inputs, strict=False)
        with torch.no_grad():
            want = model(*inputs)
    started = time.perf_counter()
    res = precast.convert(fp32_ep, inputs, policy="auto", dtype=low)
    convert_s = time.perf_counter() - started
    kw = {"cache_dir": cache_dir, "progress": None}
    compiled = {"fp32_aoti": precast.compile(fp32_ep, **kw), "auto_aoti": precast.compile(res.program, **kw)}
    samples = bench.interleaved_latency(
        {k: (lambda cm=cm: cm(*inputs)) for k, cm in compiled.items()}, repeats
    )
    lat = {k: statistics.median(v) for k, v in samples.items()}
    err, cos = flat_error(compiled["auto_aoti"](*inputs), want)
    rep = res.report
    chosen = [
        {
            "node": n.name,
            "op": n.op,
            "dtype": n.dtype,
            "low_us": n.measured,
            "fp32_us": n.limit,
            "why": n.reason,
        }
        for n in rep.nodes
        if n.source == "auto" and n.rule in ("auto:faster", "auto:slower")
    ]
    summary = next((d.message for d in rep.diagnostics if d.code == "auto-latency"), "")
    return {
        "model": name,
        "fp32_aoti_ms": round(lat["fp32_aoti"], 4),
        "auto_aoti_ms": round(lat["auto_aoti"], 4),
        "auto_vs_fp32_speed": round(lat["fp32_aoti"] / lat["auto_aoti"], 3),
        "ops_by_dtype": rep.nodes_by_dtype(),
        "auto": rep.verification.get("auto", {}),
        "summary": summary,
        "measured_ops": chosen,
        "convert_s": round(convert_s, 2),
        "max_abs_err_vs_fp32": float(f"{err:.4g}"),
        "cosine_vs_fp32": round(cos, 6),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=None, help="write auto_speed.json and auto_speed.md here")
    args = ap.parse_args(argv)
    low = ALIASES[args.dtype]
    rows = []
    for name in args.models:
        try:
            rows.append(run_model(name, low, args.repeats, args.cache_dir))
        except PrecastError as exc:  # MiniLM without its weights package: say so, run the others
            print(f"{name}: skipped: {exc}", file=sys.stderr)
    lines = [
        "| model | fp32 AOTI ms | auto AOTI ms | auto speed vs fp32 (target >= 1.0) | ops by dtype | max abs err |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = ", ".join(f"{k} {v}" for k, v in sorted(r["ops_by_dtype"].items()))
        lines.append(
            f"| {r['model']} | {r['fp32_aoti_ms']:.4f} | {r['auto_aoti_ms']:.4f} | **{r['auto_vs_fp32_speed']:.3f}x** "
            f"| {by} | {r['max_abs_err_vs_fp32']:.3g} |"
        )
    lines.append("")
    for r in rows:
        lines.append(f"- **{r['model']}**: {r['summary']}")
        for op in r["measured_ops"][:6]:
            lines.append(f"  - `{op['node']}` ({op['op']}): {op['dtype']}: {op['why']}")
        if len(r["measured_ops"]) > 6:
            lines.append(f"  - ... {len(r['measured_ops']) - 6} more measured ops")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        machine = bench.machine_info()
        payload = {"machine": machine, "dtype": args.dtype, "repeats": args.repeats, "models": rows}
        (out / "auto_speed.json").write_text(json.dumps(payload, indent=1) + "\n")
        desc = ", ".join(f"{k}: {v}" for k, v in machine.items())
        (out / "auto_speed.md").write_text(
            f"# policy='auto' vs fp32 under AOTInductor (CPU {args.dtype})\n\n"
            f"Command: `.venv/bin/python -m benchmarks.auto_speed --dtype {args.dtype} --repeats {args.repeats} "
            f"--out {args.out}`\n\nMachine: {desc}\n\nMedian of {args.repeats} interleaved repeats.\n\n{table}\n"
        )
        print(f"wrote {out / 'auto_speed.json'}, {out / 'auto_speed.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
