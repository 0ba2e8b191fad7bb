"""The weight memory of precast -> OpenVINO under the bf16 hint ("lowered by OpenVINO"): bf16 weights kept as
OpenVINO decompressions against the control, each cast folded into an f32 copy (the form before).

    PYTHONPATH=. python benchmarks/ov_weight_memory.py [--models minilm cnn mlp] [--threads 1] [--repeats 15]

For each model (``benchmarks/cpu_engines.py``'s all-MiniLM-L6-v2 with its real weights, batch 8 x 128, and its
ResNet-18-shaped CNN, batch 8 x 3 x 112 x 112; ``mlp``: 16 x Linear(1024, 1024), batch 8), the program is
``precast.convert(fp32_program, policy="torch", dtype=torch.bfloat16)`` and each form is compiled with
``precision_hint="bf16"`` in a fresh process: the resident memory it adds (compile + first call, psutil's RSS), the
bf16 / f32 constants of the compiled model, and its output. Then both forms in one process, timed interleaved
(median of ``--repeats``, ``--threads`` OpenVINO threads). Printed: RSS kept / folded, latency kept / folded, and
whether the outputs are bitwise equal. Needs a CPU where OpenVINO's bf16 hint is native (else it says so and stops).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("kept", "folded")


def mlp() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(16):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).eval(), (torch.randn(8, 1024),)


def model_named(name: str) -> tuple[torch.nn.Module, tuple]:
    if name == "mlp":
        return mlp()
    from benchmarks.cpu_engines import MODELS

    return MODELS[name]()


def program(name: str) -> tuple[torch.export.ExportedProgram, tuple]:
    import precast
    from benchmarks.cpu_engines import export

    model, inputs = model_named(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precast.convert(export(model, inputs), policy="torch", dtype=torch.bfloat16).program, inputs


def compiled(prog: torch.export.ExportedProgram, form: str, threads: int):
    from precast.backends.openvino import precision
    from precast.backends.openvino.model import compile_openvino

    keep = precision._reads_compressed
    if form == "folded":  # the control: every bf16 weight read through a plain cast, which OpenVINO folds
        precision._reads_compressed = lambda reader: False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compile_openvino(prog, precision_hint="bf16", threads=threads, warn=False)
    finally:
        precision._reads_compressed = keep


def constants(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in model.compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) == "Const":
            kind = info["runtimePrecision"].astype(str)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def one_form(name: str, form: str, threads: int, out: str) -> None:
    """In a fresh process: RSS added by compiling ``form`` and its first call; its constants and output."""
    import gc

    import psutil

    prog, inputs = program(name)
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    model = compiled(prog, form, threads)
    y = model(*inputs)
    added = process.memory_info().rss - before
    torch.save({"y": y, "rss": added, "constants": constants(model), "form": model.plan.form}, out)


def measure(name: str, threads: int, repeats: int, work: Path) -> dict:
    row: dict = {"model": name}
    outputs = {}
    for form in FORMS:
        out = work / f"{name}-{form}.pt"
        subprocess.run(
            [sys.executable, __file__, "--one", name, form, str(out), "--threads", str(threads)],
            check=True,
            cwd=ROOT,
        )
        got = torch.load(out)
        outputs[form] = got["y"]
        row[form] = {"rss_mib": got["rss"] / 2**20, "constants": got["constants"], "form": got["form"]}
    row["bitwise_equal"] = bool(torch.equal(outputs["kept"], outputs["folded"]))
    prog, inputs = program(name)
    models = {form: compiled(prog, form, threads) for form in FORMS}
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for form in FORMS:  # OpenVINO's first calls at a shape run slower (about 20 here)
        for _ in range(30):
            models[form](*inputs)
    for _ in range(repeats):
        for form in FORMS:
            start = time.perf_counter()
            models[form](*inputs)
            times[form].append(time.perf_counter() - start)
    for form in FORMS:
        row[form]["ms"] = statistics.median(times[form]) * 1e3
    row["rss_ratio"] = row["kept"]["rss_mib"] / row["folded"]["rss_mib"]
    row["speed_ratio"] = row["folded"]["ms"] / row["kept"]["ms"]  # > 1: kept is faster
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["minilm", "cnn", "mlp"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "FORM", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_form(*args.one[:2], args.threads, args.one[2])
        return
    import tempfile

    import openvino as ov

    from precast.backends.openvino.precision import native_bf16

    if not native_bf16(ov.Core()):
        sys.exit(
            "ov_weight_memory: OpenVINO's bf16 hint is not native on this CPU (the form is never made here)"
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            row = measure(name, args.threads, args.repeats, Path(tmp))
            rows.append(row)
            print(
                f"{name}: RSS kept {row['kept']['rss_mib']:.1f} MiB / folded {row['folded']['rss_mib']:.1f} MiB "
                f"= {row['rss_ratio']:.3f}x; constants kept {row['kept']['constants']} folded "
                f"{row['folded']['constants']}; latency kept {row['kept']['ms']:.3f} ms / folded "
                f"{row['folded']['ms']:.3f} ms (folded/kept {row['speed_ratio']:.3f}x); bitwise equal: "
                f"{row['bitwise_equal']}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
