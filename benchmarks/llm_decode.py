"""LLM decode on a CPU: prefill latency, per-token decode latency, tokens/s, resident memory and weight bytes read
per token against the machine's measured memory bandwidth, for fp32, eager autocast, the hand-cast bf16 forms and
precast (policy "torch" and "auto", through ``precast.compile``), in one interleaved run at each thread count.

    PYTHONPATH=. python -m benchmarks.llm_decode [--quick] [--threads 1 2] [--out docs/benchmarks]

The model is a Llama-shaped decoder with random weights (default 0.24 B parameters: hidden 1024, 16 layers, 16
heads / 4 kv heads, intermediate 2816, vocab 32000), exported with transformers' ExecuTorch recipe
(``TorchExportableModuleForDecoderOnlyLM``: a static KV cache of ``--cache-len`` held in buffers written by
``index_copy_``), batch 1. Each compiled variant is one program taking ``input_ids`` of any length up to the
cache (the sequence dimension exported dynamic): the prefill runs ``--context`` tokens at positions 0..context-1,
then decode runs one token at a time at positions context, context+1, ... (the static cache's attention reads all
``--cache-len`` slots whatever the position, so every decode step costs the same).

Variants (``--variant`` picks a subset):
  eager_fp32          the fp32 module, eager
  eager_autocast      the fp32 module under ``torch.autocast("cpu", bfloat16)``
  eager_bf16          hand-cast: ``model.to(torch.bfloat16)`` before wrapping (cache bf16 too), eager
  aoti_fp32           AOTInductor on the fp32 program (weights reloadable)
  aoti_fp32_frozen    ... with ``freezing=True`` (weights packed into the code's constants: not reloadable)
  aoti_bf16           AOTInductor on the hand-cast program
  aoti_bf16_frozen    ... with ``freezing=True``
  aoti_bf16_autotune  ... with ``max_autotune=True``, C++ GEMM backend (the template packs weights at compile time)
  precast_torch       ``precast.convert(ep, policy="torch", cache=CacheOptions(dtype=bf16))`` then ``precast.compile`` with no
                      options: the form measured fastest here at the largest --threads value
                      (precast/backends/aoti/forms.py; the note says which, with the times; run --threads 1 and
                      --threads 2 separately for each count's own choice)
  precast_torch_default   the same with ``mode="default"`` (Inductor's defaults: ATen mm on unpacked weights)
  precast_auto        ``policy="auto"`` (each matmul kept fp32 unless bf16 is faster here at its shapes)
  precast_torch_autotune / precast_auto_autotune   the same through ``precast.compile(..., mode="max-autotune",
                      inductor_configs={"max_autotune_gemm_backends": "CPP"})``
                      (load_weights repacks the template's copies)
  precast_openvino    policy torch bf16 + bf16 cache through ``precast.compile(backend="openvino")``, the default
                      call (the hint this CPU implies; the cache as OpenVINO state; a row error where this precast
                      refuses a program that writes buffers)
  openvino_anchor     OpenVINO's own export of the same seeded weights (``save_pretrained``, then optimum-intel
                      ``OVModelForCausalLM.from_pretrained(export=True)``, stateful), ``INFERENCE_PRECISION_HINT`` and
                      ``KV_CACHE_PRECISION`` bf16, in its own environment (optimum-intel 2.2 needs transformers
                      < 5.6: ``--build-anchor-env [DIR]`` builds it, default precast's data folder
                      (``benchmarks.harness.decode_anchor.ANCHOR_ENV``: ``<user data dir>/precast/ov-anchor``, where
                      ``precast bench --llm`` looks too); ``--anchor-python`` or $PRECAST_OV_ANCHOR_PYTHON point at
                      another). One persistent process per thread count takes its turn in every
                      interleaved repeat; its resident memory is what that fresh process gained loading the IR.
  openvino_anchor_inprocess   the anchor's IR (exported by ``openvino_anchor`` in this run) loaded by this
                      process's OpenVINO (the same version, checked) and run through a bare infer request
                      (``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``), interleaved in the same
                      process as precast's forms: the like-for-like comparison of the two OpenVINO models

Every form is measured in one interleaved run per thread count, with the load average printed before and after.
The forms, their building, the interleaved measuring and the fresh-process memory are the package's
(``precast/bench/decode/forms.py``, ``decode.py``, ``decode_rss.py``): ``precast bench --llm`` runs the same code on
a default subset, with each row's ratio to the fastest hand-cast form and to the anchor; this script adds every
form, the accuracy check, the targets and the profile.

Targets (printed, never asserted): precast through precast.compile with no options, weights reloadable with
load_weights, >= 0.97x the fastest hand-cast bf16 form's speed (issue 34 item 4) and >= 1.5x the fastest fp32
form's at 2 threads, resident memory <= 0.55x fp32's; precast on OpenVINO >= 0.97x the anchor's tokens/s, <= 0.8x
its memory, >= 60% of the measured bandwidth at 1 thread (issue 34 item 3).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: the repository root is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.harness import decode_anchor  # noqa: E402 - registers the anchor forms
from precast import cpu  # noqa: E402 - after the path set-up above
from precast.bench import decode  # noqa: E402 - after the path set-up
from precast.bench.decode import forms as decode_forms  # noqa: E402
from precast.bench.decode import model as decode_model  # noqa: E402
from precast.bench.decode import rss as decode_rss  # noqa: E402

# the forms, their building, measuring and fresh-process memory live in the package's harness
# (precast/bench/decode/), which ``precast bench --llm`` runs too: this script adds the profile, the accuracy
# check, the targets and its own table
EAGER, HAND, PRECAST, OPENVINO, VARIANTS = (
    decode_forms.EAGER,
    decode_forms.HAND,
    decode_forms.PRECAST,
    decode_forms.OPENVINO,
    decode_forms.VARIANTS,
)
CPP_GEMM, FP32_FORMS, BF16_HAND_FORMS = (
    decode_forms.CPP_GEMM,
    decode_forms.FP32_FORMS,
    decode_forms.BF16_HAND_FORMS,
)
Variant, build_variants, convert_llm = (
    decode_forms.Variant,
    decode_forms.build_variants,
    decode_forms.convert_llm,
)
Shape, QUICK, llama, wrapped, read_bytes = (
    decode_model.Shape,
    decode_model.QUICK,
    decode_model.llama,
    decode_model.wrapped,
    decode_model.read_bytes,
)
export, inputs, bandwidth_gbs = decode_model.export_decoder, decode_model.decode_inputs, decode.bandwidth_gbs
measure = decode.measure
fresh_rss_mb = decode_rss.fresh_rss_mb


# ---- measuring ----------------------------------------------------------------------------------------------
def accuracy(variants: dict[str, Variant], shape: Shape) -> dict[str, dict[str, float]]:
    """Logits of the first decoded token after the prompt, against eager fp32's: cosine and max abs error."""
    from precast.metrics import flat_error

    prompt, tokens = inputs(shape)
    ctx = shape.context
    logits = {}
    with torch.no_grad():
        for name, v in variants.items():
            if v.run is None or v.anchors is not None:
                continue
            v.run(input_ids=prompt, cache_position=torch.arange(ctx))
            logits[name] = v.run(input_ids=tokens[0], cache_position=torch.tensor([ctx])).float()
    ref = logits.get("eager_fp32")
    if ref is None:
        return {}
    out = {}
    for name, y in logits.items():
        err, cos = flat_error(y, ref)
        out[name] = {"cosine_vs_fp32": round(cos, 6), "max_abs_err_vs_fp32": float(f"{err:.4g}")}
    return out


def memory_only(variants: dict[str, Variant], shape: Shape, log: Callable[[str], None]) -> int:
    """``--memory-only``: each variant's fresh-process resident memory and its ratio to aoti_fp32's."""
    rss = fresh_rss_mb(variants, shape, log)
    ref = rss.get("aoti_fp32") or rss.get("eager_fp32")
    print("| variant | resident MiB (fresh process) | vs fp32 | weights + cache MiB | reloadable |")
    print("|---|---:|---:|---:|---|")
    for name, v in variants.items():
        mb = rss[name]
        ratio = f"{mb / ref:.3f}" if mb and ref else "-"
        held = sum(v.stored_bytes.values()) / 2**20
        print(
            f"| {name} | {mb if mb is not None else v.error or '-'} | {ratio} | {held:.0f} | {v.reloadable} |"
        )
    return 0


# ---- profile ------------------------------------------------------------------------------------------------
# torch.profiler sees none of an AOTInductor package's kernels (only the few ATen calls its wrapper makes), so the
# profile is what the compiled code calls per decode step, and how fast each kind of GEMM runs at decode shapes
_GEMM_KINDS = {
    "aten mm/addmm (unpacked weight)": ("aoti_torch_cpu_mm_out", "aoti_torch_cpu_addmm_out"),
    "oneDNN linear (frozen, packed weight)": ("aoti_torch_cpu__linear_pointwise",),
    "C++ GEMM template (packed weight)": ("CppMicroGemm", "cpp_fused_mm", "cpp_fused__unsafe_view_mm"),
}


def kernel_inventory(package: str | os.PathLike) -> dict[str, int]:
    """Calls per forward, by kind, in an AOTInductor package's generated wrapper: GEMMs through ATen on the
    weights as stored, through oneDNN on frozen packed weights, through the C++ GEMM template on packed copies."""
    import zipfile

    with zipfile.ZipFile(package) as z:
        text = "\n".join(
            z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith(".wrapper.cpp")
        )
    run = text.split("run_impl(", 1)[-1]
    out = {}
    for kind, needles in _GEMM_KINDS.items():
        out[kind] = sum(
            1
            for line in run.splitlines()
            if any(n in line for n in needles)
            and "(" in line
            and not line.lstrip().startswith(("void ", "//", "#"))
        )
    return out


def gemv_probe(shape: Shape, threads: int, repeats: int = 15) -> list[dict[str, Any]]:
    """One decode step's GEMMs (M=1) per distinct weight shape: ms and GB/s of the weight read for ATen's mm on an
    fp32 and a bf16 weight (what a package compiled without freezing calls) and eager ``F.linear`` in bf16."""
    torch.set_num_threads(threads)
    shapes = {name: (n, k) for name, n, k, _ in shape.linears()}
    rows = []
    g = torch.Generator().manual_seed(0)
    # oneDNN blocks a bf16 weight only where the CPU reports avx_ne_convert or AVX512 BW/VL/DQ (its own check)
    caps = cpu.capabilities()
    packs_bf16 = bool(caps.get("avx_ne_convert")) or all(
        caps.get(f) for f in ("avx512_bw", "avx512_vl", "avx512_dq")
    )
    with torch.no_grad():
        for name, (n, k) in shapes.items():
            w32 = torch.randn(n, k, generator=g) * 0.02
            x32 = torch.randn(1, k, generator=g)
            w16, x16 = w32.to(torch.bfloat16), x32.to(torch.bfloat16)
            fns = {
                "fp32 mm": (lambda x=x32, w=w32: torch.mm(x, w.t()), 4),
                "bf16 mm": (lambda x=x16, w=w16: torch.mm(x, w.t()), 2),
                "bf16 F.linear": (lambda x=x16, w=w16: torch.nn.functional.linear(x, w), 2),
            }
            if packs_bf16:  # what precast.compile's onednn-packed form calls (the weight blocked at load)
                blocked = torch.ops.mkldnn._reorder_linear_weight(w16, 1)
                fns["bf16 oneDNN packed"] = (
                    lambda x=x16, w=blocked: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    2,
                )
            row: dict[str, Any] = {"gemm": name, "n x k": f"{n} x {k}"}
            for label, (fn, size) in fns.items():
                for _ in range(3):
                    fn()
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                ms = statistics.median(times) * 1e3
                row[label] = {"ms": round(ms, 4), "GB/s": round(n * k * size / (ms / 1e3) / 1e9, 2)}
            rows.append(row)
    return rows


# ---- the report ---------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    from precast import bench

    info = bench.machine_info()
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    info["isa"] = sorted(
        f for f in flags if f in {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile"}
    )
    import transformers

    info["transformers"] = transformers.__version__
    return info


def ov_targets(
    rows: dict[int, dict[str, dict[str, Any]]],
    rss: dict[str, float | None],
    read: dict[str, int],
    bandwidth: dict[int, float],
) -> list[dict[str, Any]]:
    """precast on OpenVINO against OpenVINO's own export (issue 34 item 3): tokens/s >= 0.97x, resident memory
    <= 0.8x, >= 60% of the measured bandwidth at 1 thread."""
    out = []
    for threads, table in rows.items():
        ours, anchor = table.get("precast_openvino"), table.get("openvino_anchor")
        same = table.get("openvino_anchor_inprocess")
        if not ours:
            continue
        gbs = read["precast_openvino"] / (ours["decode_ms"] / 1e3) / 1e9
        row: dict[str, Any] = {
            "threads": threads,
            "bandwidth_share": {
                "ratio": round(gbs / bandwidth[threads], 3),
                "target": 0.6 if threads == 1 else None,
            },
        }
        if anchor:
            row["vs_anchor"] = {
                "speed_ratio": round(anchor["decode_ms"] / ours["decode_ms"], 3),
                "target": 0.97,
            }
        if same:  # the anchor's IR run in this process, interleaved with precast's model
            row["vs_anchor_in_process"] = {"speed_ratio": round(same["decode_ms"] / ours["decode_ms"], 3)}
        if rss.get("precast_openvino") and rss.get("openvino_anchor"):
            row["memory_vs_anchor"] = {
                "ratio": round(rss["precast_openvino"] / rss["openvino_anchor"], 3),
                "target": 0.8,
            }
        out.append(row)
    return out


def targets(rows: dict[int, dict[str, dict[str, Any]]], rss: dict[str, float | None]) -> list[dict[str, Any]]:
    """Each precast variant against the fastest hand-cast bf16 form and the fastest fp32 form at each thread
    count, and its memory against fp32's."""
    out = []
    for threads, table in rows.items():

        def fastest(names: tuple[str, ...], table=table) -> tuple[str, float] | None:
            got = [(table[n]["decode_ms"], n) for n in names if n in table]
            return (min(got)[1], min(got)[0]) if got else None

        hand, f32 = fastest(BF16_HAND_FORMS), fastest(FP32_FORMS)
        for name in PRECAST:
            if name not in table:
                continue
            ms = table[name]["decode_ms"]
            row: dict[str, Any] = {"threads": threads, "variant": name}
            if hand:
                row["vs_fastest_hand_cast"] = {
                    "form": hand[0],
                    "speed_ratio": round(hand[1] / ms, 3),
                    "target": 0.97,
                }
            if f32:
                row["vs_fastest_fp32"] = {
                    "form": f32[0],
                    "speed_ratio": round(f32[1] / ms, 3),
                    "target": 1.5 if threads == 2 else None,
                }
            ref = rss.get("aoti_fp32") or rss.get("eager_fp32")
            if rss.get(name) and ref:
                row["memory_vs_fp32"] = {"ratio": round(rss[name] / ref, 3), "target": 0.55}
            out.append(row)
    return out


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    shape = payload["shape"]
    lines = [
        "# LLM decode on a CPU: fp32, eager autocast, hand-cast bf16 and precast",
        "",
        f"Command: `PYTHONPATH=. python -m benchmarks.llm_decode {payload['argv']}`",
        "",
        f"CPU: **{m.get('cpu')}** ({', '.join(m.get('isa', [])) or 'no bf16/fp16 ISA flags'}; torch capability "
        f"{m.get('cpu_capability')}), {m.get('cores')} cores; torch {m.get('torch')}, transformers "
        f"{m.get('transformers')}. Load average (1, 5, 15 min) {payload['load_start']} at the start, {payload['load_end']} "
        "at the end (other jobs share the cores: medians of interleaved repeats, compare ratios within a row set).",
        "",
        f"Model: Llama-shaped, random weights, {payload['params'] / 1e9:.3f} B parameters (hidden {shape['hidden']}, "
        f"{shape['layers']} layers, {shape['heads']} heads / {shape['kv_heads']} kv heads, intermediate "
        f"{shape['intermediate']}, vocab {shape['vocab']}); transformers' static cache of {shape['cache_len']}, "
        f"batch 1; prefill {shape['context']} tokens, then decode at positions {shape['context']}.. "
        f"({payload['steps']} steps per sample, median of {payload['repeats']} interleaved repeats).",
        "",
        "Memory read bandwidth (summing a 512 MiB tensor): "
        + ", ".join(f"{t} thread(s) {bw:.1f} GB/s" for t, bw in payload["bandwidth_gbs"].items())
        + ".",
        "",
        "| threads | variant | prefill ms | decode ms/token | tokens/s | resident MiB (fresh process) | weights + cache MiB "
        "| read/token MB | GB/s (of measured) | cosine vs fp32 | load_weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    var = payload["variants"]
    for threads, table in payload["runs"].items():
        for name, v in var.items():
            r = table.get(name)
            if r is None:
                continue
            bw = payload["bandwidth_gbs"][threads]
            gbs = v["read_bytes"] / (r["decode_ms"] / 1e3) / 1e9
            acc = payload["accuracy"].get(name, {})
            lines.append(
                f"| {threads} | {name} | {r['prefill_ms']:.1f} | **{r['decode_ms']:.2f}** | {1e3 / r['decode_ms']:.1f} | "
                f"{v['rss_mb'] if v['rss_mb'] is not None else '-'} | "
                f"{(v['stored_bytes'].get('weights', 0) + v['stored_bytes'].get('cache', 0)) / 2**20:.0f} | "
                f"{v['read_bytes'] / 1e6:.0f} | {gbs:.1f} ({gbs / bw:.0%}) | {acc.get('cosine_vs_fp32', '-')} | "
                f"{v['reloadable']} |"
            )
    failed = [(n, v["error"]) for n, v in var.items() if v["error"]]
    if failed:
        lines += ["", "Variants that did not run:", ""] + [f"- `{n}`: {e}" for n, e in failed]
    notes = [(n, v["note"]) for n, v in var.items() if v["note"]]
    if notes:
        lines += ["", "Notes:", ""] + [f"- `{n}`: {e}" for n, e in notes]
    if payload["targets"]:
        lines += [
            "",
            "## Targets",
            "",
            "| threads | precast variant | vs fastest hand-cast bf16 (>= 0.97) | "
            "vs fastest fp32 (>= 1.5 at 2 threads) | memory vs fp32 (<= 0.55) |",
            "|---|---|---|---|---|",
        ]
        for t in payload["targets"]:
            h, f, mem = t.get("vs_fastest_hand_cast"), t.get("vs_fastest_fp32"), t.get("memory_vs_fp32")

            def cell(d, key="speed_ratio"):
                if not d:
                    return "-"
                ok = (
                    ""
                    if d.get("target") is None
                    else (
                        " met"
                        if (d[key] <= d["target"] if key == "ratio" else d[key] >= d["target"])
                        else " **missed**"
                    )
                )
                return f"{d[key]}x{' (' + d['form'] + ')' if 'form' in d else ''}{ok}"

            lines.append(
                f"| {t['threads']} | {t['variant']} | {cell(h)} | {cell(f)} | {cell(mem, 'ratio')} |"
            )
    if payload.get("openvino_targets"):
        lines += [
            "",
            "## Targets: precast on OpenVINO against OpenVINO's own export",
            "",
            "| threads | tokens/s vs the anchor (>= 0.97) | vs the anchor's IR in this process | resident memory "
            "vs the anchor (<= 0.8) | share of measured bandwidth (>= 0.6 at 1 thread) |",
            "|---|---|---|---|---|",
        ]
        for t in payload["openvino_targets"]:
            a, mem, bw = t.get("vs_anchor"), t.get("memory_vs_anchor"), t["bandwidth_share"]
            same = t.get("vs_anchor_in_process")
            lines.append(
                f"| {t['threads']} | {a['speed_ratio'] if a else '-'} | {same['speed_ratio'] if same else '-'} | "
                f"{mem['ratio'] if mem else '-'} | {bw['ratio']} |"
            )
    prof = payload.get("profiles") or {}
    if prof.get("kernels"):
        kinds = list(_GEMM_KINDS)
        lines += [
            "",
            "## Profile: what each compiled variant calls per decode step (its generated wrapper)",
            "",
        ]
        lines += ["| variant | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for name, inv in prof["kernels"].items():
            lines.append(f"| {name} | " + " | ".join(str(inv.get(k, 0)) for k in kinds) + " |")
    if prof.get("gemv"):
        lines += [
            "",
            "## Profile: one decode step's GEMMs at M=1, outside any model (median ms, weight GB/s)",
            "",
        ]
        if prof.get("bandwidth_best_gbs"):
            bw = ", ".join(f"{t} thread(s) {v} GB/s" for t, v in prof["bandwidth_best_gbs"].items())
            lines += [f"Read bandwidth when this profile was taken (best of 7 sums of 512 MiB): {bw}.", ""]
        labels = ["fp32 mm", "bf16 mm", "bf16 F.linear", "bf16 oneDNN packed"]
        lines += [
            "| threads | GEMM | n x k | " + " | ".join(labels) + " |",
            "|---|---|---|" + "---|" * len(labels),
        ]
        for t, rows in prof["gemv"].items():
            for r in rows:
                cells = " | ".join(
                    f"{r[lb]['ms']} ms ({r[lb]['GB/s']} GB/s)" if lb in r else "-" for lb in labels
                )
                lines.append(f"| {t} | {r['gemm']} | {r['n x k']} | {cells} |")
    if payload.get("analysis"):
        lines += ["", "## Why", "", payload["analysis"].strip()]
    return "\n".join(lines).rstrip() + "\n"


def profile_section(
    variants: dict[str, Any], shape: Shape, threads: list[int], names: list[str]
) -> dict[str, Any]:
    """The kernel inventory of each compiled variant (``names``, or all) and the GEMV probe per thread count."""
    out: dict[str, Any] = {"kernels": {}, "gemv": {}}
    for name, v in variants.items():
        package = v.package if isinstance(v, Variant) else v.get("package")
        if package and (not names or name in names):
            out["kernels"][name] = kernel_inventory(package)
    out["bandwidth_best_gbs"] = {}
    for t in threads:
        out["gemv"][t] = gemv_probe(shape, t)
        out["bandwidth_best_gbs"][t] = round(bandwidth_gbs(t, best=True), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model (2 layers, hidden 128, cache 64): a smoke run"
    )
    for field in dataclasses.fields(Shape):
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variant", nargs="+", default=None, choices=VARIANTS, metavar="V")
    ap.add_argument("--skip", nargs="+", default=[], choices=VARIANTS, metavar="V")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 15; --quick 3)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per sample (default 8; --quick 4)")
    ap.add_argument("--work", default="/tmp/precast-llm-decode", help="compiled baseline packages (reused)")
    ap.add_argument("--cache-dir", default=None, help="precast's package cache (default: its own)")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory measurement")
    ap.add_argument(
        "--memory-only", action="store_true", help="build the variants and measure only fresh-process memory"
    )
    ap.add_argument("--profile", nargs="*", default=None, metavar="V", help="profile these variants' decode")
    ap.add_argument("--out", default=None, help="write llm_decode.json and llm_decode.md here")
    ap.add_argument(
        "--reprofile",
        default=None,
        metavar="JSON",
        help="re-take the profile section of an earlier run's llm_decode.json (its packages) and rewrite it",
    )
    ap.add_argument("--analysis", default=None, metavar="FILE", help="markdown for the 'Why' section")
    ap.add_argument(
        "--anchor-python",
        default=None,
        help=f"the Python of the OpenVINO anchor's environment (default $PRECAST_OV_ANCHOR_PYTHON or "
        f"{decode_anchor.ANCHOR_ENV}/bin/python)",
    )
    ap.add_argument(
        "--build-anchor-env",
        nargs="?",
        const=decode_anchor.ANCHOR_ENV,
        default=None,
        metavar="DIR",
        help="build the anchor's environment (optimum-intel 2.2, transformers < 5.6, torch CPU) and exit",
    )
    ap.add_argument("--torch-wheel", default=None, help="with --build-anchor-env: a local torch CPU wheel")
    args = ap.parse_args(argv)
    if args.build_anchor_env:
        try:
            decode_anchor.build_anchor_env(
                args.build_anchor_env, args.torch_wheel, log=lambda m: print(m, file=sys.stderr, flush=True)
            )
        except RuntimeError as exc:
            print(f"llm_decode: --build-anchor-env: {exc}", file=sys.stderr)
            return 2
        return 0

    if args.reprofile:
        payload = json.loads(Path(args.reprofile).read_text())
        payload["runs"] = {int(k): v for k, v in payload["runs"].items()}
        payload["bandwidth_gbs"] = {int(k): v for k, v in payload["bandwidth_gbs"].items()}
        threads = sorted(payload["runs"])
        payload["profiles"] = profile_section(
            payload["variants"], Shape(**payload["shape"]), threads, args.profile or []
        )
        payload["profile_load"] = round(os.getloadavg()[0], 2)
        if args.analysis:
            payload["analysis"] = Path(args.analysis).read_text()
        text = markdown(payload)
        print(text)
        out = Path(args.out or Path(args.reprofile).parent)
        (out / "llm_decode.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (out / "llm_decode.md").write_text(text)
        return 0
    base = QUICK if args.quick else Shape()
    shape = Shape(
        **{
            f.name: getattr(args, f.name) if getattr(args, f.name) is not None else getattr(base, f.name)
            for f in dataclasses.fields(Shape)
        }
    )
    if shape.intermediate is None or shape.context >= shape.cache_len:
        ap.error("--context must be below --cache-len")
    repeats = args.repeats or (3 if args.quick else 15)
    steps = args.steps or (4 if args.quick else 8)
    names = tuple(n for n in (args.variant or decode_forms.DEFAULT_VARIANTS) if n not in args.skip)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    load_start = decode.load_average()
    log(f"load average (1, 5, 15 min) at the start: {load_start}")
    # precast.compile() measures its form at the thread count it compiles under (backends/aoti/forms.py): a run with
    # one --threads value compiles at that count, so `--threads 1` and `--threads 2` runs each get their own choice
    torch.set_num_threads(max(args.threads))
    variants, fp32_state = build_variants(
        names, shape, work, args.cache_dir, log, tuple(args.threads), args.anchor_python
    )
    if args.memory_only:
        return memory_only(variants, shape, log)
    params = sum(v.numel() for k, v in fp32_state.items() if "cache" not in k and "inv_freq" not in k)
    bandwidth = {}
    runs = {}
    for threads in args.threads:
        bandwidth[threads] = round(bandwidth_gbs(threads), 2)
        log(f"threads={threads}: bandwidth {bandwidth[threads]} GB/s")
        runs[threads] = measure(variants, shape, threads, repeats, steps, log)
    torch.set_num_threads(max(args.threads))
    acc = accuracy(variants, shape)
    for v in variants.values():
        for proc in (v.anchors or {}).values():
            proc.close()
    # the anchor's figure is its own fresh process's; the anchor's IR in this process has the anchor's row
    rss = {n: v.rss_mb for n, v in variants.items()} if args.no_rss else fresh_rss_mb(variants, shape, log)
    profiles: dict[str, Any] = {}
    if args.profile is not None:
        profiles = profile_section(variants, shape, args.threads, args.profile)
    payload = {
        "argv": " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "load_start": load_start,
        "load_end": decode.load_average(),
        "shape": dataclasses.asdict(shape),
        "params": params,
        "repeats": repeats,
        "steps": steps,
        "bandwidth_gbs": bandwidth,
        "variants": {
            n: {
                "error": v.error,
                "note": v.note,
                "reloadable": v.reloadable,
                "compile_s": None if v.compile_s is None else round(v.compile_s, 1),
                "stored_bytes": v.stored_bytes,
                "read_bytes": v.read_bytes,
                "rss_mb": rss.get(n),
                "package": str(v.package) if v.package else None,
            }
            for n, v in variants.items()
        },
        "runs": runs,
        "accuracy": acc,
        "targets": targets(runs, rss),
        "openvino_targets": ov_targets(runs, rss, {n: v.read_bytes for n, v in variants.items()}, bandwidth),
        "profiles": profiles,
    }
    log(f"load average (1, 5, 15 min) at the end: {payload['load_end']}")
    text = markdown(payload)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "llm_decode.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (out / "llm_decode.md").write_text(text)
        log(f"wrote {out / 'llm_decode.json'}, {out / 'llm_decode.md'}")
    return 0


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():  # torchao's load failures and torch's notes on them; PRECAST_VERBOSE=1 shows them
        sys.exit(main())
