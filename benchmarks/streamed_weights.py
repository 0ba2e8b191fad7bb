"""Streamed weights at scale (issue 29, item 1): a Llama larger than the memory the conversion may use, converted
from its safetensors shards, bitwise the in-memory conversion of the same program, then run.

    PYTHONPATH=. python -m benchmarks.streamed_weights --size 1.1b --policies torch rules --out docs/benchmarks

Every step is a fresh process that reports its own peak resident memory (``ru_maxrss``):
  make      random weights (seeded per tensor) written as transformers writes them: shards + index JSON
  export    ``precast.empty_parameters`` + ``precast.export_weightless``: the program without its weights
  stream    ``precast convert W.pt2 --weights DIR -o OUT.pt2`` (the CLI, in process): peak RSS is the figure
  memory    the same program with its weights in memory (``precast.with_weights``), converted in memory: the
            reference; sha256 of the graph, of every converted weight, and of the logits on one input
  run       the streamed output loaded (``precast.with_weights``) and run on the same input: logits hashed
Nothing is downloaded; the model is built from a config.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SIZES = {  # TinyLlama's shapes (1.1 B) and llm_decode's (0.25 B)
    "1.1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "0.25b": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}
SHARD_BYTES = 1 << 30  # transformers' max_shard_size="1GB"-like shards


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config(size: str):
    import transformers

    return transformers.LlamaConfig(**SIZES[size], tie_word_embeddings=False)


class Logits(torch.nn.Module):
    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, use_cache=False).logits


def _ids() -> torch.Tensor:
    return torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))


def stage_make(work: Path, size: str) -> dict:
    import transformers
    from safetensors.torch import save_file

    import precast

    with precast.empty_parameters():
        model = transformers.LlamaForCausalLM(_config(size))
    folder = work / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    parts: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}

    def flush() -> None:  # one shard in memory at a time, as save_pretrained holds it
        parts.append(sorted(current))
        save_file(current, str(folder / f"part-{len(parts):05d}"), metadata={"format": "pt"})
        current.clear()

    for i, (name, p) in enumerate(model.state_dict().items()):
        g = torch.Generator().manual_seed(i)
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02
        if current and sum(v.nbytes for v in current.values()) + t.nbytes > SHARD_BYTES:
            flush()
        current[name] = t
    flush()
    weight_map = {}
    for i, names in enumerate(parts, 1):
        shard = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        os.replace(folder / f"part-{i:05d}", folder / shard)
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"shards": len(parts)}


def stage_export(work: Path, size: str) -> dict:
    import transformers

    import precast

    with precast.empty_parameters():
        model = transformers.LlamaForCausalLM(_config(size)).eval()
    ep = precast.export_weightless(Logits(model), (_ids(),))
    torch.export.save(ep, work / "w.pt2")
    return {"program_bytes": (work / "w.pt2").stat().st_size}


def stage_stream(work: Path, policy: str) -> dict:
    import precast.pipeline.capture  # noqa: F401 - imports outside the measured conversion
    import precast.pipeline.load  # noqa: F401
    from precast.cli import main

    base = _peak_mib()
    start, cpu = time.perf_counter(), time.process_time()
    rc = main(
        [
            "convert",
            str(work / "w.pt2"),
            "--weights",
            str(work / "weights"),
            "-o",
            str(work / f"{policy}.pt2"),
            "--weights-out",
            str(work / f"{policy}.weights"),
            "--dtype",
            "bf16",
            *(["--policy", policy] if policy != "none" else []),
        ]
    )
    return {
        "rc": rc,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
        "baseline_mib": base,
    }


def _hash(t: torch.Tensor) -> str:
    from precast.weights.files import tensor_bytes

    return hashlib.sha256(tensor_bytes(t.contiguous())).hexdigest()[:24]


def stage_memory(work: Path, policy: str) -> dict:
    import precast
    from precast.pipeline.load import load_program

    ep = precast.with_weights(load_program(work / "w.pt2"), work / "weights")
    res = precast.convert(ep, policy=None if policy == "none" else policy, dtype="bf16", verify=False)
    state = {**res.program.state_dict, **res.program.constants}
    hashes = {k: _hash(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        logits = res.program.module()(_ids())
    return {
        "graph": hashlib.sha256(res.program.graph_module.code.encode()).hexdigest()[:24],
        "weights": hashes,
        "logits": _hash(logits),
    }


def stage_run(work: Path, policy: str) -> dict:
    import precast

    ep = precast.with_weights(torch.export.load(work / f"{policy}.pt2"), work / f"{policy}.weights")
    state = {**ep.state_dict, **ep.constants}
    hashes = {k: _hash(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        logits = ep.module()(_ids())
    torch.save(logits, work / f"{policy}.eager_logits.pt")
    return {
        "graph": hashlib.sha256(ep.graph_module.code.encode()).hexdigest()[:24],
        "weights": hashes,
        "logits": _hash(logits),
    }


CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller, where the machine lets root make one


def stage_compiled(work: Path, policy: str) -> dict:
    """The streamed output compiled with AOTInductor, its weights loaded from the output shards."""
    import precast

    start = time.perf_counter()
    model = precast.compile(torch.export.load(work / f"{policy}.pt2"), weights=work / f"{policy}.weights")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model(_ids())
    torch.save(logits, work / f"{policy}.compiled_logits.pt")
    return {"compile_seconds": seconds, "from_cache": model.from_cache}


def child(stage: str, work: Path, arg: str, cap_mib: int | None = None) -> dict:
    """Run one stage in a fresh process; with ``cap_mib``, inside a memory cgroup of that limit (page cache
    included, as the kernel charges it), whose peak usage is reported too."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.streamed_weights",
        "--stage",
        stage,
        "--work",
        str(work),
        "--arg",
        arg,
    ]
    group = None
    if cap_mib is not None:
        group = CGROUP / f"precast-bench-{os.getpid()}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(cap_mib * 2**20))
        cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if out.returncode != 0:
            raise SystemExit(f"{stage} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if group is not None:
            result["cgroup_peak_mib"] = int((group / "memory.max_usage_in_bytes").read_text()) / 2**20
            result["cgroup_limit_hits"] = int((group / "memory.failcnt").read_text())
            result["cap_mib"] = cap_mib
        return result
    finally:
        if group is not None:
            group.rmdir()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1.1b", choices=sorted(SIZES))
    ap.add_argument("--policies", nargs="+", default=["torch", "rules"])
    ap.add_argument(
        "--work", default=None, help="folder for the weights and programs (default: a temp folder)"
    )
    ap.add_argument("--out", default=None, help="write streamed_weights.json here")
    ap.add_argument(
        "--compile", action="store_true", help="also compile each output with AOTInductor, run it"
    )
    ap.add_argument(
        "--cap-mib", type=int, default=None, help="run each streamed conversion in a memory cgroup"
    )
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stage:
        stage = {
            "make": stage_make,
            "export": stage_export,
            "stream": stage_stream,
            "memory": stage_memory,
            "run": stage_run,
            "compiled": stage_compiled,
        }[args.stage]
        result = stage(Path(args.work), args.arg)
        result["peak_mib"] = _peak_mib()
        print(json.dumps(result))
        return 0
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="precast-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    made = (
        child("make", work, args.size)
        if not (work / "weights" / "model.safetensors.index.json").exists()
        else None
    )
    weights = sum(f.stat().st_size for f in (work / "weights").glob("*.safetensors"))
    largest = max(f.stat().st_size for f in (work / "weights").glob("*.safetensors"))
    exported = child("export", work, args.size)
    rows = []
    for policy in args.policies:
        streamed = child("stream", work, policy, args.cap_mib)
        reference = child("memory", work, policy)
        ran = child("run", work, policy)
        compiled = {}
        if args.compile:
            compiled = child("compiled", work, policy)
            a = torch.load(work / f"{policy}.eager_logits.pt").float()
            b = torch.load(work / f"{policy}.compiled_logits.pt").float()
            compiled["cosine_vs_eager"] = float(
                torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
            )
            ea, eb = a.reshape(-1, a.shape[-1]).argmax(-1), b.reshape(-1, b.shape[-1]).argmax(-1)
            compiled["argmax_agree"] = f"{int((ea == eb).sum())}/{ea.numel()}"
        rows.append(
            {
                "policy": policy,
                "weights_gb": weights / 1e9,
                "largest_shard_gb": largest / 1e9,
                "stream_seconds": streamed["seconds"],
                "s_per_gb": streamed["seconds"] / (weights / 1e9),
                "stream_peak_gb": streamed["peak_mib"] * 2**20 / 1e9,
                "stream_peak_over_shard_gb": (streamed["peak_mib"] * 2**20 - largest) / 1e9,
                "cap_mib": streamed.get("cap_mib"),
                "cgroup_peak_mib": streamed.get("cgroup_peak_mib"),
                "cgroup_limit_hits": streamed.get("cgroup_limit_hits"),
                "memory_peak_gb": reference["peak_mib"] * 2**20 / 1e9,
                "graph_equal": ran["graph"] == reference["graph"],
                "weights_equal": ran["weights"] == reference["weights"],
                "tensors": len(ran["weights"]),
                "logits_equal": ran["logits"] == reference["logits"],
                "run_peak_gb": ran["peak_mib"] * 2**20 / 1e9,
                "compiled": compiled,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    meta = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "size": args.size,
        "export_peak_gb": exported["peak_mib"] * 2**20 / 1e9,
        "program_bytes": exported["program_bytes"],
        "make": made,
        "load": os.getloadavg(),
    }
    if args.out:
        out = Path(args.out)
        (out / "streamed_weights.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
