"""Decode speed with weights stored in 8 and 4 bits (issue 41), in one interleaved run: precast's plan (policy
torch, bf16, KV cache bf16) with ``weight_format="int8"`` / ``"int8-asym"`` (forms ``..._int8a``) / ``"int4"`` /
a mixed int4/int8 plan (forms ``..._q4km``: llama.cpp's Q4_K_M choice of the tensors in more bits, int8 there and
int4 elsewhere; ``precast.quant.presets.q4_k_m_rules``) on
AOTInductor (``precast.compile()``, no
options) and on OpenVINO (``precast.compile(backend="openvino")``, the default call), beside the same plan with bf16
weights and OpenVINO's own exports of the same seeded weights (optimum-intel; ``optimum-cli --weight-format int8``).

The decoder is ``precast.bench.decode.model``'s Llama-shaped 0.246 B model (random seeded weights; ``--quick``: the
tiny one); the forms, the interleaving, the fresh-process memory and the bandwidth probe are the package harness's
(``precast.bench.decode``, which ``precast bench --llm`` runs). Printed per thread count: ms per token, tokens/s,
bytes a step reads and the share of the measured memory bandwidth that makes, and the targets:

- precast int8 on OpenVINO >= 0.97x the tokens/s of OpenVINO's own int8 export, >= 1.4x precast bf16 on OpenVINO;
- precast int8 on AOTInductor >= 1.3x precast bf16 on AOTInductor.

    PYTHONPATH=. python -m benchmarks.llm_decode_weights --anchor-python /path/to/ov-anchor/bin/python \\
        --out docs/benchmarks

Input: thread counts, repeats, the anchor's Python. Output: a table on stdout, llm_decode_weights.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import decode_anchor  # registers the anchor forms
from precast.bench import decode

FORMS = (
    "precast_torch",
    "precast_torch_int8",
    "precast_torch_int8a",
    "precast_torch_int4",
    "precast_torch_q4km",
    "precast_openvino",
    "precast_openvino_int8",
    "precast_openvino_int8a",
    "precast_openvino_int4",
    "precast_openvino_q4km",
    "openvino_anchor",
    "openvino_anchor_int8",
    "openvino_anchor_int4",
    "openvino_anchor_inprocess",
)
# (faster form, reference form, target): the ratio is reference ms / faster ms
TARGETS = (
    # the bf16 plan against OpenVINO's own bf16 export: its IR in this process (the "same process"), and
    # in the anchor's own process (optimum-intel's model class; memory placement differs by process)
    ("precast_openvino", "openvino_anchor_inprocess", 0.97),
    ("precast_openvino", "openvino_anchor", 0.97),
    ("precast_openvino_int8", "openvino_anchor_int8", 0.97),
    ("precast_openvino_int8", "precast_openvino", 1.4),
    ("precast_openvino_int8a", "openvino_anchor_int8", 0.97),
    ("precast_openvino_int8a", "precast_openvino", 1.4),
    ("precast_torch_int8", "precast_torch", 1.3),
    ("precast_torch_int8a", "precast_torch", 1.3),
    ("precast_openvino_int4", "openvino_anchor_int4", 0.97),
    ("precast_openvino_int4", "precast_openvino", None),
    ("precast_torch_int4", "precast_torch", None),
    ("precast_openvino_q4km", "precast_openvino", None),
    ("precast_torch_q4km", "precast_torch", None),
)


def paired(form: dict[str, Any], ref: dict[str, Any]) -> float | None:
    """The median over repeats of the reference's sample time over the form's, each pair taken in the same repeat
    (seconds apart): a drift in the machine's load moves both samples of a pair alike, where it moves the two
    medians apart."""
    a, b = form.get("decode_samples_ms") or [], ref.get("decode_samples_ms") or []
    if not a or len(a) != len(b):
        return None
    return round(statistics.median(r / f for f, r in zip(a, b, strict=True)), 3)


def targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for threads, table in payload["runs"].items():
        for form, ref, target in TARGETS:
            if form in table and ref in table:
                ratio = table[ref]["decode_ms"] / table[form]["decode_ms"]
                out.append(
                    {"threads": threads, "form": form, "against": ref, "speed_ratio": round(ratio, 3),
                     "paired_ratio": paired(table[form], table[ref]),
                     "target": target, "met": None if target is None else ratio >= target}
                )  # fmt: skip
    return out


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [
        "# Decode with int8 / int4 weights (benchmarks/llm_decode_weights.py)",
        "",
        f"CPU: {m.get('cpu')}; torch {m.get('torch')}; load (1, 5, 15 min) {payload['load_start']} before, "
        f"{payload['load_end']} after; {payload['seconds']:.0f} s; repeats {payload['repeats']}, "
        f"{payload['steps']} decode steps a sample; shape {payload['shape']}.",
        "",
        "| threads | form | ms/token | tokens/s | weights MB | read/token MB | GB/s | share of bandwidth | "
        "memory MB | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for threads, table in payload["runs"].items():
        bw = payload["bandwidth_gbs"].get(threads)
        for name in FORMS:
            if name not in table:
                continue
            ms = table[name]["decode_ms"]
            form = payload["forms"][name]
            read = form.get("read_bytes") or 0
            gbs = read / (ms / 1e3) / 1e9 if read else None
            weights = (form.get("stored_bytes") or {}).get("weights")
            lines.append(
                f"| {threads} | {name} | {ms:.2f} | {1e3 / ms:.1f} | "
                f"{'-' if weights is None else f'{weights / 1e6:.0f}'} | "
                f"{'-' if not read else f'{read / 1e6:.0f}'} | {'-' if gbs is None else f'{gbs:.1f}'} | "
                f"{'-' if gbs is None or not bw else f'{gbs / bw:.2f} of {bw} GB/s'} | "
                f"{'-' if form.get('rss_mb') is None else form['rss_mb']} | {form.get('note') or ''} |"
            )
    lines += [
        "",
        f"First calls: {', '.join(payload.get('first_calls') or [])} (in that order; `--warm-reversed`: the "
        "reverse. The model that takes its first call first in a process can run slower: see precast.bench.decode."
        "harness.interleaved). Speed ratio: of the medians; paired: the median of the ratios of the samples taken "
        "in the same repeat.",
        "",
        "| threads | form | against | speed ratio | paired | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in payload["targets"]:
        lines.append(
            f"| {t['threads']} | {t['form']} | {t['against']} | {t['speed_ratio']} | {t.get('paired_ratio')} | "
            f"{'-' if t['target'] is None else t['target']} | {'-' if t['met'] is None else t['met']} |"
        )
    if payload.get("errors"):
        lines += ["", "Errors:", *[f"- {n}: {e}" for n, e in payload["errors"].items()]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="llm_decode_weights")
    ap.add_argument("--quick", action="store_true", help="the tiny decoder (a smoke run)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: as many as fit)")
    ap.add_argument("--budget", type=float, default=900.0, help="seconds for builds, memory and repeats")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS, metavar="FORM")
    ap.add_argument("--anchor-python", default=None, help="the anchor environment's Python (optimum-intel)")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory measurement")
    ap.add_argument(
        "--warm-reversed",
        action="store_true",
        help="the forms take their first calls in reverse order (run once each way for a same-process figure)",
    )
    ap.add_argument("--work", default="/tmp/precast-llm-decode")
    ap.add_argument("--out", default=None, help="write llm_decode_weights.json and .md here")
    args = ap.parse_args(argv)
    forms = tuple(args.forms)
    if decode_anchor.anchor_python(args.anchor_python) is None:
        forms = tuple(f for f in forms if not f.startswith("openvino_anchor"))
        print(
            "llm_decode_weights: no anchor environment: OpenVINO's own exports are left out", file=sys.stderr
        )
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    payload = decode.run_decode_bench(
        decode.QUICK if args.quick else decode.Shape(),
        args.threads,
        args.repeats,
        args.steps,
        forms=forms,
        anchor=args.anchor_python,
        log=log,
        work=Path(args.work),
        memory=not args.no_rss,
        budget_s=args.budget,
        warm_reversed=args.warm_reversed,
    )
    payload["targets"] = targets(payload)
    text = markdown(payload)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "llm_decode_weights.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (out / "llm_decode_weights.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
