"""Engine x model table: does the converted program run on each engine users deploy on, how far from the converted
program's own outputs, how big is the artifact and how fast, each against the same engine on the fp32 program.

    python benchmarks/engines.py [--models mlp cnn encoder bert] [--repeats 15] [--out docs/benchmarks/engines.md]

Per model: the fp32 program is ``torch.export`` with a dynamic batch; "after precast" is
``precast.convert(fp32_program, policy="torch", dtype=D)`` for D in bf16 and fp16 (eager autocast's semantics).
Engines: eager (``program.module()``), torch.compile (inductor, default configs), AOTInductor
(``precast.compile``; runs? and max diff come from a fresh process that imports only torch and loads the package with
``torch._inductor.aoti_load_package``), ONNX Runtime CPU (``precast.backends.onnx.export``), OpenVINO
(``precast.compile(program, backend="openvino")``: the program's own dtypes; and "OpenVINO default": OpenVINO's own
precision hint, bf16 wherever it chooses on a CPU with native bf16) and ExecuTorch (``precast.backends.executorch``)
when installed. Latency: median of interleaved repeats in this process (each
repeat times every variant in turn), batch 8. Max diff: max |engine(x) - converted_program.module()(x)|.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precast  # noqa: E402
from precast.errors import PrecastError, first_line  # noqa: E402
from tests import models as zoo  # noqa: E402

BATCH = 8
THREADS = 1  # one intra-op thread everywhere: on a shared machine, OpenMP barriers over busy cores dominate
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ENGINES = (
    "eager",
    "torch.compile",
    "AOTInductor",
    "ONNX Runtime",
    "OpenVINO",
    "OpenVINO default",
    "ExecuTorch",
)


def _bert() -> tuple[torch.nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    from tests.realmodels.builders import TextModel, _ids, _mask, _seeded

    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=512, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    model = TextModel(_seeded(lambda: BertModel(cfg)), False).eval()
    return model, (_ids(BATCH, 16, 1000), _mask(BATCH, 16))


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "mlp": lambda: (zoo.MLP(1024, autocast=False).eval(), (torch.randn(BATCH, 1024),)),
    "cnn": lambda: zoo.plain_cnn(BATCH),
    "encoder": lambda: zoo.plain_encoder(BATCH),
    "bert": _bert,
}


def fp32_program(model: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    batch = Dim("batch", min=1, max=1024)
    return torch.export.export(model, inputs, dynamic_shapes=tuple({0: batch} for _ in inputs), strict=False)


def _flat(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return torch.cat([t.detach().float().flatten() for t in leaves])


def max_diff(out: Any, ref: Any) -> float:
    return (_flat(out) - _flat(ref)).abs().max().item()


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median per-call latency (ms); each sample times ~20 ms of back-to-back calls, variants in turn."""
    with torch.no_grad():
        inner = {}
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            t = time.perf_counter()
            fn()
            inner[name] = max(1, min(1000, int(0.02 / max(time.perf_counter() - t, 1e-6))))
        samples: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                for _ in range(inner[name]):
                    fn()
                samples[name].append((time.perf_counter() - t) * 1e3 / inner[name])
    return {n: statistics.median(s) for n, s in samples.items()}


_FRESH = r"""
import json, sys
import torch, torch._inductor
m = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.load(sys.argv[2])
with torch.no_grad():
    out = m(*x)
torch.save(out, sys.argv[3])
print(json.dumps({"precast_imported": any(k.split(".")[0] == "precast" for k in sys.modules)}))
"""


def aoti_fresh(package: Path, inputs: tuple, work: Path) -> Any:
    torch.save(inputs, work / "in.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH, str(package), str(work / "in.pt"), str(work / "out.pt")],
        capture_output=True, text=True, timeout=600, cwd=work,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(first_line(proc.stderr or "fresh process failed"))
    assert not json.loads(proc.stdout.strip().splitlines()[-1])["precast_imported"]
    return torch.load(work / "out.pt")


class Row(dict):
    pass


def engine_variants(
    engine: str, ep: Any, inputs: tuple, work: Path, tag: str, cache: Path
) -> tuple[Callable, Any, int | None]:
    """(timed callable, outputs for the diff, artifact bytes) of one program on one engine."""
    if engine == "eager":
        module = ep.module()
        path = work / f"{tag}.pt2"
        torch.export.save(ep, path)
        return (lambda: module(*inputs)), module(*inputs), path.stat().st_size
    if engine == "torch.compile":
        torch._dynamo.reset()
        compiled = torch.compile(ep.module())
        with torch.no_grad():
            out = compiled(*inputs)
        return (lambda: compiled(*inputs)), out, None
    if engine == "AOTInductor":
        # aoti_fresh loads the package alone (no precast): its weights inside the .so
        configs = {"aot_inductor.package_constants_in_so": True}
        cm = precast.compile(ep, cache_dir=cache, progress=False, inductor_configs=configs)
        out = aoti_fresh(cm.package_path, inputs, work)
        return (lambda: cm(*inputs)), out, cm.package_path.stat().st_size
    if engine == "ONNX Runtime":
        from precast.backends.onnx.export import export_onnx
        from precast.backends.onnx.runtime import ort_runner, ort_session, run_onnx

        path = work / f"{tag}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_onnx(ep, path)
        session = ort_session(path, threads=THREADS)
        out = run_onnx(session, inputs)
        return ort_runner(session, inputs), out, path.stat().st_size
    if engine in ("OpenVINO", "OpenVINO default"):
        from precast.backends.openvino.model import compile_openvino

        hint = "auto" if engine == "OpenVINO" else None
        model = compile_openvino(ep, threads=THREADS, precision_hint=hint, warn=False)
        files = model.save(work / f"{tag}.xml")
        return (lambda: model(*inputs)), model(*inputs), files["xml_bytes"] + files["bin_bytes"]
    if engine == "ExecuTorch":
        from precast.backends.executorch import export_executorch, run_executorch

        path = work / f"{tag}.pte"
        export_executorch(ep, path)
        data = path.read_bytes()
        return (lambda: run_executorch(data, *inputs)), run_executorch(data, *inputs), len(data)
    raise ValueError(engine)


def short_reason(message: str) -> str:
    """The cause without the route (docs/backends.md has the routes): fits a table cell."""
    m = re.search(r"has no (\w+) kernel for (\w+\(\d+\))", message)
    if m:
        return f"ORT CPU has no {m.group(1)} kernel for {m.group(2)}"
    return message.split(";")[0].removeprefix("export_onnx: ")[:160]


def openvino_available() -> str | None:
    try:
        import openvino  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


def _openvino_version() -> str:
    try:
        import openvino
    except ImportError:
        return "not installed"
    return openvino.__version__.split("-")[0]


def executorch_available() -> str | None:
    try:
        import executorch  # noqa: F401

        import precast.backends.executorch  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


def measure(name: str, repeats: int, cache: Path, work_root: Path) -> list[Row]:
    model, inputs = MODELS[name]()
    with torch.no_grad():
        ep32 = fp32_program(model, inputs)
    rows: list[Row] = []
    et_missing = executorch_available()
    ov_missing = openvino_available()
    for dname, dtype in DTYPES.items():
        res = precast.convert(ep32, inputs, policy="torch", dtype=dtype)
        with torch.no_grad():
            ref = res.program.module()(*inputs)
        for engine in ENGINES:
            row = Row(model=name, dtype=dname, engine=engine)
            rows.append(row)
            if engine == "ExecuTorch" and et_missing:
                row["runs"] = f"not measured: {et_missing}"
                continue
            if engine.startswith("OpenVINO") and ov_missing:
                row["runs"] = f"not measured: {ov_missing}"
                continue
            work = Path(tempfile.mkdtemp(dir=work_root))
            fns, sizes = {}, {}
            try:
                fn, out, size = engine_variants(engine, res.program, inputs, work, f"{name}_{dname}", cache)
                fns["after"], sizes["after"] = fn, size
                row["runs"] = "yes"
                row["max_diff"] = max_diff(out, ref)
            except (PrecastError, Exception) as exc:  # noqa: BLE001 - a failing engine is a row, not a crash
                row["runs"] = f"no: {short_reason(first_line(exc))}"
                continue
            try:
                fn32, _, size32 = engine_variants(engine, ep32, inputs, work, f"{name}_fp32", cache)
                fns["fp32"], sizes["fp32"] = fn32, size32
                lat = interleaved(fns, repeats)
                row["latency_ms"], row["latency_fp32_ms"] = lat["after"], lat["fp32"]
                row["latency_ratio"] = lat["after"] / lat["fp32"]
                if sizes["after"] and sizes["fp32"]:
                    row["size_mb"], row["size_fp32_mb"] = sizes["after"] / 2**20, sizes["fp32"] / 2**20
                    row["size_ratio"] = sizes["after"] / sizes["fp32"]
            except Exception as exc:  # noqa: BLE001
                row["note"] = f"fp32 baseline failed: {first_line(exc)[:120]}"
            print(f"{name} {dname} {engine}: {dict(row)}", file=sys.stderr, flush=True)
    return rows


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: list[Row], seconds: float) -> str:
    import onnxruntime

    head = ["model", "dtype", "engine", "runs?", "max diff vs converted", "artifact MB (fp32 → after)",
            "size ratio", "latency ms (fp32 → after)", "latency ratio"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        size = f"{r['size_fp32_mb']:.2f} → {r['size_mb']:.2f}" if "size_mb" in r else "-"
        lat = f"{r['latency_fp32_ms']:.3f} → {r['latency_ms']:.3f}" if "latency_ms" in r else "-"
        runs = r.get("runs", "-").replace("|", "\\|")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['engine']} | {runs} | {_f(r.get('max_diff'), '.3g')} | {size} | "
            f"{_f(r.get('size_ratio'), '.2f')} | {lat} | {_f(r.get('latency_ratio'), '.2f')} |"
        )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, openvino {_openvino_version()}, "
        f"batch {BATCH}"
    )
    return f"""# Engines: does the converted program run where users deploy?

Generated by `python benchmarks/engines.py` ({seconds:.0f} s). Machine: {machine}, {THREADS} thread.

- **after precast**: `precast.convert(fp32_program, policy="torch", dtype=...)`; **fp32**: the same model's
  `torch.export` program (dynamic batch). Both run on the same engine for the ratios (after / fp32).
- **max diff**: max |engine output − `converted_program.module()` output| on the same inputs (0 = bitwise).
- **artifact**: eager: the `.pt2` (`torch.export.save`); torch.compile: none (it compiles in process);
  AOTInductor: the package `precast.compile` writes (runs? and max diff measured in a fresh process importing
  only torch); ONNX Runtime: the `.onnx` file (CPU provider, default session options); OpenVINO: the IR
  (`.xml` + `.bin`), "OpenVINO" with `precast.compile(backend="openvino")`'s default hint (the program's own dtypes:
  OpenVINO's bf16 hint where every layer then honours precast's plan, else `INFERENCE_PRECISION_HINT=f32`), "OpenVINO
  default" with OpenVINO's own hint; ExecuTorch: the `.pte`.
- **latency**: median of interleaved repeats in one process, one intra-op thread for every engine
  (`torch.set_num_threads(1)`, ORT `intra_op_num_threads=1`, OpenVINO `INFERENCE_NUM_THREADS=1`), on a shared
  2-core machine: ratios are indicative.

{chr(10).join(lines)}

Reading it: see [docs/backends.md](../backends.md) (ONNX Runtime's CPU provider has no bfloat16 kernels for
Gemm/MatMul/Conv…; for fp16 it inserts Casts around ops without an fp16 kernel and folds the weights' Casts once at
session creation, so fp16 there saves file size, not compute).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "engines.md"))
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--cache-dir", default=None, help="AOTInductor cache (default: a temporary one)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    import logging

    logging.disable(logging.WARNING)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "cache"
        rows: list[Row] = []
        for name in args.models:
            try:
                rows += measure(name, args.repeats, cache, Path(tmp))
            except ImportError as exc:
                print(f"{name}: skipped ({exc})", file=sys.stderr)
    text = markdown(rows, time.perf_counter() - started)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
