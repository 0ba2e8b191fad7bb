"""llama.cpp's quantization with an importance matrix on a model whose weights were never quantized:
all-MiniLM-L6-v2 (fp32 safetensors), scored as ``benchmarks/minilm_weights.py`` scores precast (issue 50, Figures:
the llama.cpp anchor repeated away from SmolLM2's Q4_1 grid).

    PYTHONPATH=. python -m benchmarks.minilm_weights_llamacpp [--llamacpp ~/.cache/precast-llamacpp]
        [--types Q4_K_M+table=q4_0 IQ4_NL:pure+table=iq4_nl ...] [--out docs/benchmarks/FILE.json]

1. The package's model folder converted by llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` (the llama.cpp
   that ``benchmarks/llm_weights_llamacpp.py --build-llamacpp`` built); read back, every tensor must equal the
   model's bitwise (checked: the names map back).
2. ``llama-imatrix -c SEQ`` on the calibration paragraphs ``minilm_weights`` uses (the first 64 long paragraphs of
   ``pydoc_data.topics``). llama-imatrix refuses a vocabulary that appends an end token (BERT appends [SEP]), so
   it runs on a copy of the GGUF with ``tokenizer.ggml.add_eos_token`` false: each chunk without its [SEP].
3. ``llama-quantize --imatrix`` for each ``--types`` entry: ``TYPE`` (llama.cpp's mixture rules), ``:pure``
   (``--pure``: every weight in TYPE), ``+table=T`` (``--token-embedding-type T``). On this model every row is 384
   or 1536 wide: K-quants (256-wide blocks) fit only ``ffn_down`` (1536); llama.cpp falls back to Q5_0 for the rest,
   and leaves the word table in f32 unless told (7.3 bits per weight for plain Q4_K_M).
4. Each GGUF dequantized with ``gguf`` (fp32), written into the fp32 model, run in fp32 on the evaluation texts
   (the harness's 36 sentences and the 28 held-out paragraphs, padded to ``--seq``): mean and min cosine of the
   sentence embeddings against fp32; bits per weight over the model's 2-D weights as the GGUF stores them
   (``n_bytes``; precast's rows count the same weights).

Measure precast at the same bits with ``benchmarks/minilm_weights.py --policies none --bits B``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.harness.minilm import SENTENCES, load_minilm, model_dir
from benchmarks.llm_accuracy import cpu_line
from benchmarks.llm_weights_llamacpp import CACHE, run_logged, tool, vendored
from benchmarks.minilm_weights import batches, texts

TYPES = (
    "Q4_K_M+table=q4_0",
    "Q4_K_M",
    "IQ4_NL:pure+table=iq4_nl",
    "Q4_0:pure+table=q4_0",
    "Q4_1:pure+table=q4_1",
)
# llama.cpp's BERT tensor names -> transformers' BertModel (under MeanPooled's "bert.")
NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


def hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``bert.encoder.layer.3.attention.self.query.weight``."""
    stem, leaf = name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, i, kind = stem.split(".", 2)
        return f"bert.encoder.layer.{i}.{NAMES[kind]}.{leaf}"
    return f"bert.{NAMES[stem]}.{leaf}"


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, str]]:
    """The GGUF's tensors dequantized to fp32 by HF name, the bytes each stores, and each one's type."""
    import gguf
    from gguf.quants import dequantize

    values, nbytes, types = {}, {}, {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dimension first
        values[name] = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float().reshape(shape)
        nbytes[name], types[name] = int(t.n_bytes), t.tensor_type.name
    return values, nbytes, types


def quantize(root: Path, f32: Path, imatrix: Path, spec: str, work: Path) -> Path:
    """``llama-quantize --imatrix`` of ``f32`` by ``spec`` (``TYPE[:pure][+table=T]``)."""
    head, _, table = spec.partition("+table=")
    qtype, _, mode = head.partition(":")
    out = work / f"{spec.replace(':', '-').replace('+', '-').replace('=', '-')}.gguf"
    cmd = [str(tool(root, "llama-quantize")), "--imatrix", str(imatrix)]
    cmd += ["--pure"] if mode == "pure" else []
    cmd += ["--token-embedding-type", table] if table else []
    run_logged([*cmd, str(f32), str(out), qtype], out.with_suffix(".log"))
    return out


def no_eos_copy(src: Path, dst: Path) -> Path:
    """``src`` with ``tokenizer.ggml.add_eos_token`` false (llama-imatrix's requirement)."""
    import shutil

    import gguf

    shutil.copyfile(src, dst)
    field = gguf.GGUFReader(str(dst), "r+").fields["tokenizer.ggml.add_eos_token"]
    field.parts[field.data[0]][0] = False
    return dst


def f32_gguf(args: argparse.Namespace, state: dict[str, torch.Tensor]) -> Path:
    """The model as an F32 GGUF (llama.cpp's converter, made once), checked to map back to ``state`` bitwise."""
    f32 = args.work / "f32.gguf"
    if not f32.exists():
        script = vendored(args.llamacpp) / "convert_hf_to_gguf.py"
        cmd = [sys.executable, str(script), str(model_dir()), "--outtype", "f32", "--outfile", str(f32)]
        run_logged(cmd, f32.with_suffix(".log"))
    back, _, _ = read(f32)
    wrong = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
    if wrong:
        raise SystemExit(f"minilm_weights_llamacpp: the F32 GGUF does not map back: {wrong[:4]}")
    return f32


def make_imatrix(args: argparse.Namespace, f32: Path, calib: list[str]) -> tuple[Path, float]:
    """``llama-imatrix`` on the calibration paragraphs in chunks of ``--seq`` (a copy without [SEP]); its seconds."""
    calib_txt = args.work / "calibration.txt"
    calib_txt.write_text("\n\n".join(calib))
    imatrix = args.work / "imatrix.dat"
    started = time.perf_counter()
    no_eos = no_eos_copy(f32, args.work / "f32-no-eos.gguf")
    cmd = [str(tool(args.llamacpp, "llama-imatrix")), "-m", str(no_eos), "-f", str(calib_txt)]
    cmd += ["-c", str(args.seq), "-b", str(args.seq), "-ub", str(args.seq), "-t", "2", "-o", str(imatrix)]
    run_logged(cmd, imatrix.with_suffix(".log"))
    return imatrix, time.perf_counter() - started


def score(
    path: Path, keys: list[str], eval_batches: list, ref: torch.Tensor, elements: dict[str, int]
) -> dict:
    """One GGUF's row: its weights dequantized into the fp32 model, cosine against ``ref``, bits as stored."""
    values, nbytes, types = read(path)
    trial = load_minilm()
    trial.load_state_dict({k: values[k] for k in keys})
    with torch.no_grad():
        got = torch.cat([trial(*b) for b in eval_batches])[: ref.shape[0]]
    cos = (torch.nn.functional.normalize(got, dim=-1) * ref).sum(-1)
    return {
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "sentences_mean_cosine": float(cos[: len(SENTENCES)].mean()),
        "bits_per_weight": 8 * sum(nbytes[k] for k in elements) / sum(elements.values()),
        "types": dict(Counter(types[k] for k in elements)),
        "table": types["bert.embeddings.word_embeddings.weight"],
    }


def table(result: dict) -> str:
    lines = [
        f"CPU: {result['cpu']}; {result['llamacpp']}; {result['evaluation_texts']} evaluation texts at seq "
        f"{result['seq']}",
        "| llama.cpp type (imatrix) | bits/weight | mean cosine | min cosine | tensors |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['type']} | {r['bits_per_weight']:.2f} | {r['mean_cosine']:.4f} | {r['min_cosine']:.4f} | "
            f"{', '.join(f'{t} {c}' for t, c in r['types'].items())} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp", type=Path, default=CACHE)
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/precast-bench/minilm-llamacpp"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    sys.path.insert(0, str(vendored(args.llamacpp) / "gguf-py"))  # the gguf that matches this llama.cpp
    model = load_minilm()
    state = dict(model.state_dict())
    f32 = f32_gguf(args, state)
    calib, held = texts(64, 28)
    imatrix, imatrix_s = make_imatrix(args, f32, calib)
    evaluation = SENTENCES + held
    eval_batches = batches(evaluation, args.seq)
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in eval_batches])[: len(evaluation)]
    elements = {n: p.numel() for n, p in model.named_parameters() if p.dim() == 2}
    rows = []
    for spec in args.types:
        path = quantize(args.llamacpp, f32, imatrix, spec, args.work)
        rows.append({"type": spec, **score(path, list(state), eval_batches, ref, elements)})
        r = rows[-1]
        print(
            f"{spec}: mean cosine {r['mean_cosine']:.4f} (min {r['min_cosine']:.4f}), {r['bits_per_weight']:.2f} "
            f"bits, {r['types']}",
            file=sys.stderr,
        )
    result = {
        "cpu": cpu_line(),
        "load": [load, os.getloadavg()[0]],
        "llamacpp": str(vendored(args.llamacpp).parent.parent.name),
        "imatrix_seconds": imatrix_s,
        "evaluation_texts": len(evaluation),
        "seq": args.seq,
        "rows": rows,
    }
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
