"""NNCF's data-aware int4 on all-MiniLM-L6-v2 at given bits per weight: the anchor of ``benchmarks.minilm_weights``.

Runs in the OpenVINO anchor environment (NNCF, OpenVINO, torch, transformers; it never imports precast):

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.minilm_weights --dump /tmp/minilm_data.pt ...
    ~/.local/share/precast/ov-anchor/bin/python benchmarks/minilm_weights_nncf.py --data /tmp/minilm_data.pt \
        --bits 4.6 5.0 [--group 128] [--recipes se se+gptq awq+se]

``--data`` is what ``minilm_weights --dump`` writes: the model folder, the calibration and evaluation batches
(input_ids, attention_mask) and the fp32 torch embeddings of the evaluation texts. The same torch model (transformers'
BertModel with mean pooling) is converted with ``openvino.convert_model`` of its ``torch.export`` program, compressed with
``nncf.compress_weights(mode=INT4_ASYM, group_size, ratio, all_layers=True, dataset=calibration, ...)`` (the int8
backup per channel; ``ratio`` solved so the stored bits meet the target), run by OpenVINO in fp32
(``INFERENCE_PRECISION_HINT=f32``: the weights alone) and scored by cosine against the fp32 embeddings. Bits per
weight as stored: every u4/u8 constant (weights and zero points) and every f16 constant (scales) of the compressed
model, plus any f32 constant with two dimensions > 1 (a weight left uncompressed; the position table, which
OpenVINO folds into its 128 rows at this static shape), over the torch model's 2-d weight elements. The ratio is
solved from each format's bits, then corrected once from the bits measured when they miss the target by > 0.005.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def wrapper(folder: str) -> torch.nn.Module:
    from transformers import AutoModel

    class MeanPooled(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    bert = AutoModel.from_pretrained(folder, dtype=torch.float32, add_pooling_layer=False)
    return MeanPooled(bert).eval()


def stored_bits(model, elements: int) -> float:
    """Bits per weight the compressed OpenVINO model stores (module docstring)."""
    total = 0
    for op in model.get_ops():
        if op.get_type_name() != "Constant":
            continue
        t = op.get_output_element_type(0).get_type_name()
        shape = list(op.get_output_shape(0))
        n = 1
        for d in shape:
            n *= d
        if t in ("u4", "i4"):
            total += n * 4
        elif t in ("u8", "i8"):
            total += n * 8
        elif t == "f16":
            total += n * 16
        elif t == "f32" and sum(d > 1 for d in shape) >= 2:  # a weight left float, or a folded table
            total += n * 32
    return total / elements


def compress(ov_model, data: dict, recipe: str, ratio: float, group: int):
    import nncf

    flags = set(recipe.split("+"))
    ds = nncf.Dataset(data["calib"], lambda b: (b[0].numpy(), b[1].numpy()))
    return nncf.compress_weights(
        ov_model.clone(),
        mode=nncf.CompressWeightsMode.INT4_ASYM,
        group_size=group,
        ratio=ratio,
        all_layers=True,
        dataset=ds,
        sensitivity_metric=nncf.SensitivityMetric.HESSIAN_INPUT_ACTIVATION,
        awq="awq" in flags,
        scale_estimation="se" in flags,
        gptq="gptq" in flags,
        lora_correction="lora" in flags,
        subset_size=sum(b[0].shape[0] for b in data["calib"]),
    )


def run_recipe(ov_model, data: dict, recipe: str, bits: float, group: int, elements: int) -> dict:
    import openvino as ov

    int4 = 4 + (16 + 4) / group  # u4 values, an f16 scale and a u4 zero point per group
    int8 = 8 + (16 + 8) / 384  # the int8 backup: per output channel, hidden 384 (most rows)
    ratio = min(1.0, max(0.0, (int8 - bits) / (int8 - int4)))
    t = time.perf_counter()
    compressed = compress(ov_model, data, recipe, ratio, group)
    got_bits = stored_bits(compressed, elements)
    if abs(got_bits - bits) > 0.005:
        ratio = min(1.0, max(0.0, ratio + (got_bits - bits) / (int8 - int4)))
        compressed = compress(ov_model, data, recipe, ratio, group)
    seconds = time.perf_counter() - t
    compiled = ov.Core().compile_model(compressed, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = torch.cat([torch.from_numpy(compiled((b[0].numpy(), b[1].numpy()))[0]) for b in data["eval"]])
    ref = data["ref"]
    cos = (torch.nn.functional.normalize(got[: ref.shape[0]].float(), dim=-1) * ref).sum(-1)
    n = data["sentences"]
    return {
        "row": f"NNCF int4-g{group} {recipe} ratio {ratio:.3f}",
        "bits_per_weight": stored_bits(compressed, elements),
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "sentences_mean_cosine": float(cos[:n].mean()),
        "seconds": seconds,
        "load": os.getloadavg()[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--bits", type=float, nargs="+", default=[4.6, 5.0])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--recipes", nargs="+", default=["se", "se+gptq", "awq+se"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import openvino as ov

    data = torch.load(args.data)
    model = wrapper(data["folder"])
    elements = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    ov_model = ov.convert_model(
        torch.export.export(model, tuple(data["eval"][0]))
    )  # tracing fails on BertModel
    print(f"openvino {ov.__version__}; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    rows = []
    for bits in args.bits:
        for recipe in args.recipes:
            try:
                row = run_recipe(ov_model, data, recipe, bits, args.group, elements)
            except Exception as exc:  # an anchor recipe NNCF refuses on this model: recorded, the others run
                row = {
                    "row": f"NNCF int4-g{args.group} {recipe}",
                    "refused": f"{type(exc).__name__}: {exc}"[:300],
                }
            row["target_bits"] = bits
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
