"""Accuracy anchors for precast's int8 / int4 weights: what OpenVINO's own tools reach on the same model, the same
text and the same measure as ``benchmarks/llm_weights.py``, at the same stored bytes.

    PYTHONPATH=. python -m benchmarks.llm_weights_anchors --anchor-python /work/venv-ovanchor/bin/python
        [--bits 4.62 5.0] [--metric HESSIAN_INPUT_ACTIVATION] [--modes f32] [--int8-modes f32 default bf16]
        [--precast-plans bf16 "int8 (table bf16)" int8 int4-g64 "measured 4.62 bits" "measured 5.0 bits"]
        [--precast-eager | --no-precast]
        [--recipes all | none awq+se awq+se+gptq awq+se+lora ... [--table-int8 6.0]] [--cached-only]
        [--fresh] [--out docs/benchmarks/llm_weights_anchors.json]

Model: SmolLM2-135M-Instruct, real weights (``llm_accuracy.load_fp32``; its fp32 ``save_pretrained`` folder under
``--work``). Text: as ``llm_weights``: ``pydoc_data.topics``; the first ``--calibration`` tokens calibrate, the
next ``--tokens`` are evaluated in windows of ``--window`` from an empty cache; KLD of the next-token distribution
against the fp32 exported program run eagerly (nats/token), top-1 agreement with its argmax, perplexity.

What it runs (the anchor's tools in the anchor's environment, ``--anchor-python``: optimum-intel 2.2, NNCF 3.4;
every OpenVINO model is then run by this process's OpenVINO, teacher-forced like ``llm_accuracy.anchor_runner``):

1. ``optimum-cli export openvino --task text-generation-with-past --weight-format fp32`` and ``... int8``
   (optimum's int8: NNCF ``INT8_ASYM`` per output channel on every weight, the tied embedding/head table included);
2. NNCF's own data-aware mixed int4/int8 choice on the fp32 export: ``nncf.compress_weights(mode=INT4_ASYM,
   group_size=64, ratio=R, sensitivity_metric=--metric, dataset=<the calibration windows>, all_layers=True)``
   (``all_layers=False``, NNCF's default, keeps the tied table in int8: ~5.1 bits at the least, above both budgets).
   R is solved for each ``--bits``: a first pass records NNCF's own sensitivity order (its ``MixedPrecisionCriterion``
   scores), the stored bytes of every prefix of that order in int4 are computed, and R is set between the largest
   prefix that fits and the next, so NNCF's own greedy loop picks exactly that prefix; the bytes are then counted on
   the saved model. Also NNCF's int4 with ``ratio=1``: its default ``all_layers=False`` (the table int8) and
   ``all_layers=True`` (every weight int4, the counterpart of precast's ``int4-g64``). Cached per target under
   ``--work``/anchors (``--fresh`` redoes them);
   ``--recipes``: NNCF's data-aware *rounding* on top of that selection, in place of the int8 export and the ratio=1
   rows: for every ``--bits`` (``all_layers=True``) and every ``--table-int8`` budget (``all_layers=False``), each
   recipe (``awq``, ``se`` = scale_estimation, ``gptq``, ``lora`` = lora_correction, joined by ``+``; ``none``: the
   selection alone; ``all``: the 12 combinations NNCF accepts, gptq with lora being refused) passed to the same
   call at the same solved R (LoRA: R solved again with its int8 adapters' bytes). NNCF 3.4's LoRA correction dies
   on an int4 embedding (statistics exist for MatMuls only): the child gives adapters to MatMuls only (recorded as
   ``patched``). A refusal or failure is recorded and tabled, and the next recipe runs. Scores are cached beside
   each model; ``--cached-only`` compresses nothing (docs/benchmarks/llm_weights_nncf_data_aware.md);
3. precast's own rows (``llm_weights.main --only ... --openvino --no-eager``; ``--precast-eager``: the eager rows
   too; its weight-sensitivity estimate cached under ``--work``/anchors), in this process: ``bf16`` is precast's
   compute floor (policy torch, bf16 weights and cache), the others add the weight formats to it.

Each OpenVINO model runs under ``--modes``, optimum's int8 export under ``--int8-modes``: ``f32``
(``INFERENCE_PRECISION_HINT`` f32, ``KV_CACHE_PRECISION`` f32, ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` 0: the least
compute noise), ``default`` (no configuration: what OpenVINO picks on this CPU; the resolved properties are in the
table) and ``bf16`` (``llm_accuracy.anchor_runner``'s configuration: bf16 hint and cache). A window prefilled from
an empty state never reads its cache back, so the cache precision does not enter these numbers on OpenVINO.

Bytes: for every MatMul / Gather reading a weight (a constant of >= 65536 elements at the end of its
decompression chain: Convert / Subtract / Multiply / Reshape), the constants of that chain (the weight's integers,
its scales, its zero points), each counted once (the tied table is one constant read by the embedding and the
head), ``Constant.get_byte_size()`` (u4: two per byte); bits per weight = 8 * bytes / the elements of those weights
(134,479,872 for SmolLM2-135M, the same count as precast's); an NNCF model also pays for every constant it holds
beyond the fp32 export's (LoRA adapters, AWQ's unfolded activation scales). precast counts its stored parts (integers, bf16
scales, int4 zero points) of the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRECAST_PLANS = ("bf16", "int8 (table bf16)", "int8", "int4-g64", "measured 4.62 bits", "measured 5.0 bits")
MODES = {
    "f32": {
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
    },
    "default": {},
    "bf16": {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"},
}
PROPERTIES = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "KEY_CACHE_PRECISION",
    "VALUE_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
    "EXECUTION_MODE_HINT",
)
# NNCF's data-aware rounding algorithms (``nncf.compress_weights`` flags), by their short names in a recipe
RECIPE_PARTS = {"awq": "awq", "se": "scale_estimation", "gptq": "gptq", "lora": "lora_correction"}
_CHAIN_ALL = {"Convert", "Subtract", "Multiply"}
_CHAIN_DATA = {"Reshape", "Transpose", "Unsqueeze", "Squeeze"}
_MIN_WEIGHT = 65536


# ---------------------------------------------------------------------------------------------------------------
# NNCF's data-aware recipes (stdlib only: runs in both environments)


def recipe_flags(name: str) -> dict[str, bool]:
    """``"awq+se+gptq"`` -> the ``nncf.compress_weights`` flags it sets (``"none"``: the data-aware selection alone,
    plain rounding). Refuses, in one line, an unknown part and what NNCF 3.4 refuses (GPTQ with LoRA correction:
    ``compress_weights`` raises "Simultaneous use of Lora correction and GPTQ algorithms is not supported")."""
    parts = [] if name == "none" else name.split("+")
    unknown = [p for p in parts if p not in RECIPE_PARTS]
    if unknown or len(set(parts)) != len(parts) or not parts and name != "none":
        raise ValueError(
            f"recipe {name!r}: write 'none' or parts joined by '+' from {', '.join(RECIPE_PARTS)}, each once"
        )
    if "gptq" in parts and "lora" in parts:
        raise ValueError(f"recipe {name!r}: NNCF 3.4 refuses gptq with lora_correction; choose one of them")
    return {flag: short in parts for short, flag in RECIPE_PARTS.items()}


def recipe_name(flags: dict[str, bool]) -> str:
    """The canonical name of a set of flags (parts in ``RECIPE_PARTS`` order): the inverse of ``recipe_flags``."""
    parts = [short for short, flag in RECIPE_PARTS.items() if flags.get(flag)]
    return "+".join(parts) or "none"


def allowed_recipes() -> list[str]:
    """Every combination of NNCF's four data-aware algorithms that ``compress_weights`` accepts: 12 of the 16
    (the 4 with both GPTQ and LoRA correction are refused), in ``RECIPE_PARTS`` bit order, ``none`` first."""
    names = []
    for mask in range(1 << len(RECIPE_PARTS)):
        flags = {flag: bool(mask >> i & 1) for i, flag in enumerate(RECIPE_PARTS.values())}
        if not (flags["gptq"] and flags["lora_correction"]):
            names.append(recipe_name(flags))
    return names


def lora_adapter_bytes(shape: list[int], reduction_axes: list[int], rank: int) -> int:
    """Stored bytes of the LoRA correction adapters NNCF adds beside one int4 weight of ``shape``: A [rank, in] and
    B [out, rank], each INT8_ASYM per row (its ``use_int8_adapters`` default): u8 integers, an f16 scale and a u8
    zero point per row."""
    (axis,) = reduction_axes
    inner, outer = shape[axis], math.prod(shape) // shape[axis]
    return rank * inner + 3 * rank + outer * rank + 3 * outer


def best_per_budget(rows: list[dict]) -> dict[float, dict]:
    """For each budget (``bits``), the evaluated row of least KLD; refused rows (no ``kld``) never win."""
    best: dict[float, dict] = {}
    for r in rows:
        if r.get("kld") is not None and (r["bits"] not in best or r["kld"] < best[r["bits"]]["kld"]):
            best[r["bits"]] = r
    return best


def recipe_table(rows: list[dict]) -> str:
    """Markdown: per budget, each recipe's stored bits, KLD, top-1, perplexity and NNCF's seconds, the best (least
    KLD) in bold; a refused or failed recipe says what NNCF said."""
    best = best_per_budget(rows)
    lines = [
        "| budget | recipe | R | bits as stored | KLD vs fp32 | top-1 | ppl | NNCF seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["bits"], r.get("kld") is None, r.get("kld") or 0)):
        if r.get("kld") is None:
            lines.append(f"| {r['bits']} | {r['recipe']} | | | {r['error']} | | | |")
            continue
        mark = "**" if best[r["bits"]] is r else ""
        lines.append(
            f"| {r['bits']} | {mark}{r['recipe']}{mark} | {r['ratio']:.4f} | {r['bits_per_weight']:.3f} | "
            f"{mark}{r['kld']:.4f}{mark} | {100 * r['top1']:.1f}% | {r['ppl']:.2f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Stored bytes of an OpenVINO model's weights (stdlib + openvino only: runs in both environments)


def weight_users(model) -> list[tuple[object, list[object]]]:
    """(MatMul/Gather, the constants of its weight's decompression chain) for every op that reads a weight."""
    users = []
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind not in ("MatMul", "Gather"):
            continue
        stack, consts = [op.input_value(1 if kind == "MatMul" else 0).get_node()], []
        while stack:
            node = stack.pop()
            t = node.get_type_name()
            if t == "Constant":
                consts.append(node)
            elif t in _CHAIN_ALL:
                stack += [node.input_value(i).get_node() for i in range(node.get_input_size())]
            elif t in _CHAIN_DATA:
                stack.append(node.input_value(0).get_node())
        if any("_lora_" in c.get_friendly_name() for c in consts):
            continue  # a LoRA correction adapter (NNCF): stored beside a weight, not a weight (weight_storage)
        if any(math.prod(c.get_output_shape(0)) >= _MIN_WEIGHT for c in consts):
            users.append((op, consts))
    return users


def _layer(name: str) -> str:
    """``__module.model.layers.3.mlp.down_proj/aten::linear/MatMul`` -> ``layers.3.mlp.down_proj``."""
    name = name.split("/")[0]
    for prefix in ("__module.model.", "__module."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def weight_storage(xml: str) -> dict:
    """Stored bytes, elements and per-layer format of an OpenVINO model's weights (see the module's doc)."""
    import openvino as ov

    model = ov.Core().read_model(xml)
    # every constant of every chain, once (by name: the tied table is one constant)
    seen: dict[str, object] = {}
    weights: dict[str, list[int]] = {}  # the weight constants (integers, or the float weight): their shapes
    layers: dict[str, str] = {}
    for op, consts in weight_users(model):
        weight = max(consts, key=lambda c: math.prod(c.get_output_shape(0)))
        shape = list(weight.get_output_shape(0))
        fmt = weight.get_element_type().get_type_name()
        if len(shape) == 3:  # grouped: [out, groups, group]
            fmt += f"-g{shape[-1]}"
        layers[_layer(op.get_friendly_name())] = fmt
        weights[weight.get_friendly_name()] = shape
        for c in consts:
            seen.setdefault(c.get_friendly_name(), c)
    stored = sum(c.get_byte_size() for c in seen.values())
    elements = sum(math.prod(s) for s in weights.values())
    # every other constant (norms, rotary tables; NNCF's LoRA adapters and AWQ's inserted activation scales): the
    # caller charges what a compressed model holds beyond its float export's (``added_bytes``)
    other = {
        op.get_friendly_name(): op.get_byte_size()
        for op in model.get_ordered_ops()
        if op.get_type_name() == "Constant" and op.get_friendly_name() not in seen
    }
    counts: dict[str, int] = {}
    for fmt in layers.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return {
        "bytes": stored,
        "elements": elements,
        "bits_per_weight": 8 * stored / elements,
        "other_bytes": sum(other.values()),
        "lora_bytes": sum(b for n, b in other.items() if "_lora_" in n),
        "readers": len(layers),
        "formats": counts,
        "layers": layers,
        "weights": weights,
    }


# ---------------------------------------------------------------------------------------------------------------
# The NNCF side: runs in the anchor's environment (``--nncf-child spec.json``), never imports precast


def _nncf_child(spec_path: str) -> int:
    import nncf
    import numpy as np
    import openvino as ov
    from nncf.quantization.algorithms.weight_compression import mixed_precision as mp

    spec = json.loads(Path(spec_path).read_text())
    core = ov.Core()
    items = []
    for window in spec["calibration"]:
        n = len(window)
        items.append(
            {
                "input_ids": np.array([window], np.int64),
                "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, np.int32),
            }
        )
    dataset = nncf.Dataset(items)
    metric = getattr(nncf.SensitivityMetric, spec["metric"])
    record: dict = {}

    class Recorded(Exception):
        pass

    original_apply = mp.MixedPrecisionCriterion.apply

    def apply(self, model, graph, statistic_points=None, dataset=None, weight_params=None):
        calc = self._calc_sensitivity

        def recording(*a, **k):
            scores = calc(*a, **k)
            record["order"] = [
                {
                    "node": wp.node_with_weight.node_name,
                    "weight": wp.weight_name,
                    "shape": list(wp.weight_shape),
                    "reduction_axes": list(wp.reduction_axes),
                    "node_type": wp.node_with_weight.node_type,
                    "num_weights": int(wp.num_weights),
                    "score": float(s),
                }
                for wp, s in zip(weight_params, scores, strict=True)
            ]
            if record.get("abort"):
                raise Recorded
            return scores

        self._calc_sensitivity = recording
        return original_apply(self, model, graph, statistic_points, dataset, weight_params)

    mp.MixedPrecisionCriterion.apply = apply
    base = weight_storage(spec["fp32_xml"])
    elements = base["elements"]

    def compress(ratio: float, all_layers: bool, flags: dict | None = None):
        model = core.read_model(spec["fp32_xml"])
        started = time.perf_counter()
        out = nncf.compress_weights(
            model,
            mode=nncf.CompressWeightsMode.INT4_ASYM,
            group_size=spec["group_size"],
            ratio=ratio,
            all_layers=all_layers,
            sensitivity_metric=metric,
            dataset=dataset,
            subset_size=len(items),
            **(flags or {}),
        )
        return out, time.perf_counter() - started

    rank = nncf.AdvancedCompressionParameters().lora_correction_params.adapter_rank
    # NNCF 3.4's LoRA correction reads activation statistics that it collects for MatMuls only: with the tied table
    # in int4 (all_layers) it dies on the embedding (KeyError on its Gather). Patched: adapters where statistics
    # exist (every int4 MatMul, the head included); the table's Gather keeps the recipe's rounding, no adapter.
    from nncf.quantization.algorithms.weight_compression.lora_correction import LoraCorrectionAlgorithm

    lora_applicable = LoraCorrectionAlgorithm.is_applicable

    def applicable_with_statistics(self, wc_params) -> bool:
        return lora_applicable(self, wc_params) and wc_params.node_with_weight.node_name in self._statistics

    LoraCorrectionAlgorithm.is_applicable = applicable_with_statistics

    # INT8_ASYM per output channel: u8 integers, an f16 scale and a u8 zero point per row
    def int8_bytes(shape):
        return math.prod(shape) + shape[0] * 3

    # INT4_ASYM groups: u4 integers, an f16 scale and a u4 zero point per group
    def int4_bytes(shape):
        n = math.prod(shape)
        groups = n // spec["group_size"]
        return n // 2 + 2 * groups + (groups + 1) // 2

    order = None
    for target in spec["targets"]:
        entry = dict(target)
        flags = recipe_flags(target.get("recipe", "none"))
        adapters = rank if flags["lora_correction"] else 0  # LoRA: adapters beside every int4 weight
        ratio = target.get("ratio")
        if ratio is None:  # solve R for the bits
            if order is None:
                record["abort"] = True
                with contextlib.suppress(Recorded):
                    compress(0.5, target["all_layers"])
                record["abort"] = False
                order = record["order"]
            total = sum(o["num_weights"] for o in order)
            # as NNCF's loop: ascending scores, a stable sort
            ranked = sorted(range(len(order)), key=lambda i: order[i]["score"])
            # every weight int8 (NNCF's backup: the ratio-defining ones not chosen, and those outside the ratio),
            # then the prefix of the ascending order int4
            defining = {o["weight"] for o in order}
            stored = sum(int8_bytes(o["shape"]) for o in order) + sum(
                int8_bytes(shape) for name, shape in base["weights"].items() if name not in defining
            )
            prefix, cum = 0, [0]
            for i in ranked:
                cum.append(cum[-1] + order[i]["num_weights"])
            budget = target["bits"] * elements / 8
            k = 0
            while stored > budget and k < len(ranked):
                o = order[ranked[k]]
                stored += int4_bytes(o["shape"]) - int8_bytes(o["shape"])
                if adapters and o["node_type"] == "MatMul":
                    stored += lora_adapter_bytes(o["shape"], o["reduction_axes"], adapters)
                k += 1
            prefix = k
            ratio = 1.0 if prefix == len(ranked) else (cum[prefix] + cum[prefix + 1]) / 2 / total
            entry.update(
                ratio=ratio,
                predicted_bits=8 * stored / elements,
                int4_prefix=prefix,
                ratio_defining=len(order),
                ratio_defining_weights=total,
                outside_ratio=sorted(n for n in base["weights"] if n not in defining),
            )
            first_order = [o["weight"] for o in order]
        entry["flags"] = flags
        if adapters:
            entry["patched"] = (
                "LoRA adapters on int4 MatMuls only (NNCF 3.4 dies on the int4 embedding's Gather)"
            )
        try:
            model, seconds = compress(ratio, target["all_layers"], flags)
        except Exception as e:  # NNCF refused or failed: recorded in the result and the table; the next runs
            refused = isinstance(
                e, (nncf.ParameterNotSupportedError, nncf.ValidationError, nncf.UnsupportedModelError)
            )
            entry["refused" if refused else "failed"] = f"{type(e).__name__}: {e}"
            Path(target["result"]).write_text(json.dumps(entry, indent=1))
            print(f"{target['name']}: NNCF {'refused' if refused else 'failed'}: {e}", file=sys.stderr)
            continue
        out = Path(target["out"])
        out.mkdir(parents=True, exist_ok=True)
        ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False)
        entry["compress_seconds"] = seconds
        entry["ratio"] = ratio
        if target.get("ratio") is None:
            entry["sensitivity"] = sorted(record["order"], key=lambda o: o["score"])
            entry["same_order_as_first_pass"] = [o["weight"] for o in record["order"]] == first_order
        entry["storage"] = weight_storage(str(out / "openvino_model.xml"))
        from importlib.metadata import version

        entry["versions"] = {p: version(p) for p in ("nncf", "openvino", "optimum-intel")}
        Path(target["result"]).write_text(json.dumps(entry, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# This process: exports, NNCF (both through the anchor's environment), evaluation, precast's rows


def _brief(target: dict) -> dict:
    """A target's result without its per-weight lists (kept in its cache file)."""
    out = {k: v for k, v in target.items() if k not in ("sensitivity", "outside_ratio", "storage")}
    if "storage" in target:
        out["storage"] = {k: v for k, v in target["storage"].items() if k not in ("layers", "weights")}
    return out


def _recipe_label(target: dict) -> str:
    return target.get("recipe", "none") + (
        "" if target["all_layers"] else " (all_layers=False: the table int8)"
    )


def vnni() -> list[str]:
    """The CPU's int8 dot-product extensions (what OpenVINO's dynamic quantization of activations needs)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in ("avx_vnni", "avx512_vnni", "amx_int8") if f in flags]
    return []


def _anchor_export(python: str, model_dir: Path, out: Path, weight_format: str, log: Path) -> float | None:
    """``optimum-cli export openvino`` in the anchor's environment (reused when present): seconds, or None."""
    if (out / "openvino_model.xml").exists():
        return None
    cli = Path(python).parent / "optimum-cli"
    started = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    with log.open("w") as f:
        subprocess.run(
            [
                str(cli), "export", "openvino", "--model", str(model_dir),
                "--task", "text-generation-with-past", "--weight-format", weight_format, str(tmp),
            ],
            check=True, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    tmp.rename(out)
    return time.perf_counter() - started


def ov_runner(xml: str, config: dict):
    """The OpenVINO model (stateful, optimum's inputs) compiled for the CPU with ``config``, teacher-forced from an
    empty state, as ``llm_accuracy.anchor_runner``; and the properties it resolved."""
    import openvino as ov

    from benchmarks.harness.decode_anchor import window_runner

    compiled = ov.Core().compile_model(xml, "CPU", config)
    resolved = {}
    for p in PROPERTIES:
        with contextlib.suppress(Exception):
            value = compiled.get_property(p)
            resolved[p] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    request = compiled.create_infer_request()

    return window_runner(request), resolved


def _evaluate(run, references) -> dict:
    import torch

    from benchmarks.llm_accuracy import compare

    sums = {"kld": 0.0, "top1": 0.0, "nll": 0.0, "n": 0.0}
    with torch.no_grad():
        for inputs, targets, ref in references:
            for k, v in compare(ref, run(inputs), targets).items():
                sums[k] += v
    return {
        "kld": sums["kld"] / sums["n"],
        "top1": sums["top1"] / sums["n"],
        "ppl": math.exp(sums["nll"] / sums["n"]),
        "positions": int(sums["n"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchor-python", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--bits", type=float, nargs="*", default=[4.62, 5.0])
    ap.add_argument("--metric", default="HESSIAN_INPUT_ACTIVATION", help="nncf.SensitivityMetric member")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["f32"])
    ap.add_argument("--int8-modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--precast-plans", nargs="*", default=list(PRECAST_PLANS))
    ap.add_argument("--no-precast", action="store_true")
    ap.add_argument("--precast-eager", action="store_true", help="precast's eager (torch) rows as well")
    ap.add_argument(
        "--precast-fp32",
        nargs="*",
        default=["int8", "int4-g64"],
        help="formats for precast with policy=None (fp32 compute) on OpenVINO: the rounding alone, like the anchors",
    )
    ap.add_argument(
        "--recipes",
        nargs="*",
        default=None,
        help="NNCF's data-aware rounding: for each --bits, each recipe ('none', or parts joined by '+' from "
        f"{', '.join(RECIPE_PARTS)}; 'all': every combination NNCF accepts) at the same stored bytes, in place of "
        "the int8 export and the ratio=1 rows",
    )
    ap.add_argument(
        "--table-int8",
        type=float,
        nargs="*",
        default=[],
        help="with --recipes: budgets at which each recipe also runs with all_layers=False (NNCF's default: the "
        "embedding and the head, here one tied table, in int8); --bits run all_layers=True, as precast's plans may "
        "put every weight in int4",
    )
    ap.add_argument("--fresh", action="store_true", help="redo the NNCF compressions (exports are reused)")
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="run no NNCF compression: targets not compressed before are listed as not run",
    )
    ap.add_argument(
        "--no-nncf",
        action="store_true",
        help="only optimum-cli's fp32 and int8 exports as anchors (no NNCF int4 rows)",
    )
    ap.add_argument(
        "--work", type=Path, default=Path(os.environ.get("PRECAST_BENCH_WORK", "/tmp/precast-bench"))
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON file")
    args = ap.parse_args(argv)
    recipes = allowed_recipes() if args.recipes == ["all"] else args.recipes
    for name in recipes or []:
        try:
            recipe_flags(name)
        except ValueError as e:
            ap.error(str(e))

    import openvino as ov
    import torch

    from benchmarks.harness.decode_anchor import anchor_python
    from benchmarks.llm_accuracy import cpu_line, export, load_fp32, program_runner

    python = anchor_python(args.anchor_python)
    if python is None:
        raise SystemExit("llm_weights_anchors: no anchor environment (--anchor-python)")
    started_all = time.perf_counter()
    load = os.getloadavg()[0]
    work = args.work / "anchors"
    work.mkdir(parents=True, exist_ok=True)
    model, tok = load_fp32(args.work)
    model_dir = args.work / "smollm2-fp32"
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = torch.tensor(tok(text)["input_ids"][: args.calibration + args.tokens + 1], dtype=torch.long)
    w = args.window
    calibration = [ids[s : s + w].tolist() for s in range(0, args.calibration - w + 1, w)]
    evaluation = ids[args.calibration :]
    ep = export(model, w)
    reference_run = program_runner(ep)
    references = []
    with torch.no_grad():
        for s in range(0, len(evaluation) - 1, w):
            window = evaluation[s : s + w + 1]
            references.append((window[:-1][None], window[1:], reference_run(window[:-1][None])))
    del reference_run

    # 1. optimum-intel's exports
    exports = {}
    for fmt in ("fp32",) if recipes else ("fp32", "int8"):
        out = work / f"smollm2-ov-{fmt}"
        seconds = _anchor_export(python, model_dir, out, fmt, work / f"export_{fmt}.log")
        exports[fmt] = {"xml": str(out / "openvino_model.xml"), "export_seconds": seconds}
        print(f"optimum-cli --weight-format {fmt}: {out}" + (f" ({seconds:.0f} s)" if seconds else " (reused)"),
              file=sys.stderr)  # fmt: skip

    # 2. precast's own rows, the same evaluation (llm_weights); first: NNCF is matched to their stored bytes too
    precast_result = None
    precast_rows: dict[str, dict] = {}
    if not args.no_precast and args.precast_plans:
        from benchmarks import llm_weights

        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
            llm_weights.main(
                ["--tokens", str(args.tokens), "--calibration", str(args.calibration), "--window", str(w),
                 "--bits", *map(str, args.bits), "--openvino", *([] if args.precast_eager else ["--no-eager"]), "--only", *args.precast_plans,
                 "--work", str(args.work), "--out", tmp, "--costs-cache",
                 str(work / f"precast-costs-c{args.calibration}-w{w}-p8.pkl")]
            )  # fmt: skip
            precast_result = json.loads((Path(tmp) / "llm_weights.json").read_text())
        for label, r in precast_result["rows"].items():
            where = "eager (torch)" if label.endswith("[eager]") else "precast.compile(backend='openvino')"
            precast_rows[f"precast {label}"] = {
                "kld": r["kld"],
                "top1": r["top1"],
                "ppl": r["ppl"],
                "bits_per_weight": r["bits_per_weight"],
                "stored_bytes": r["stored_bytes"],
                "stored_bits_per_weight": 8 * r["stored_bytes"] / precast_result["elements"]
                if r["stored_bytes"]
                else None,
                "how": f"policy torch bf16, cache bf16, {where}",
                "formats": r.get("formats"),
            }

    if not args.no_precast:
        import precast
        from benchmarks.llm_accuracy import openvino_runner

        for fmt in args.precast_fp32:
            res = precast.convert(ep, policy=None, weights=precast.WeightOptions(format=fmt), verify=False)
            stored = sum(r["bytes_after"] for r in res.report.weight_formats)
            run, how = openvino_runner(res.program)
            r = _evaluate(run, references)
            del run, res
            elements = weight_storage(exports["fp32"]["xml"])["elements"]
            precast_rows[f"precast {fmt}, policy None (fp32 compute) [openvino]"] = {
                **r,
                "bits_per_weight": 8 * stored / elements,
                "stored_bytes": stored,
                "how": f"precast.convert(policy=None, weights=WeightOptions(format={fmt!r})), {how.split(': ', 1)[-1]}",
            }
            print(
                f"precast {fmt} policy None [openvino]: KLD {r['kld']:.5f}, top-1 {100 * r['top1']:.1f}%",
                file=sys.stderr,
            )

    # 3. NNCF's mixed int4/int8 at precast's budgets and at its measured plans' stored bytes; its plain int4
    budgets = {b: f"precast's budget {b}" for b in args.bits}
    for label, r in precast_rows.items():
        if label.startswith("precast measured") and r["stored_bytes"]:
            budgets.setdefault(round(r["stored_bits_per_weight"], 4), f"{label.split(' [')[0]} as stored")
    targets = [
        {"name": f"nncf mixed {b} bits", "bits": b, "all_layers": True, "out": str(work / f"nncf-{b}bits")}
        for b in budgets
    ]
    if recipes:  # the selection-only recipe ('none') keeps the name (and the cache) of the rows above
        targets = [
            {
                "name": (f"nncf mixed {b} bits" if r == "none" else f"nncf {r} {b} bits") + t8,
                "bits": b,
                "all_layers": not t8,
                "out": str(work / ((f"nncf-{b}bits" if r == "none" else f"nncf-{r}-{b}bits") + t8)),
                **({} if r == "none" else {"recipe": r}),
            }
            for t8, bits in (("", budgets), ("-table8", args.table_int8))
            for b in bits
            for r in recipes
        ]
    if args.no_nncf:
        targets = []
    targets += (
        []
        if args.no_nncf or recipes
        else [
            {"name": "nncf int4 defaults", "ratio": 1.0, "all_layers": False, "out": str(work / "nncf-int4")},
            {
                "name": "nncf int4 all layers",
                "ratio": 1.0,
                "all_layers": True,
                "out": str(work / "nncf-int4-all"),
            },
        ]
    )
    spec = {
        "fp32_xml": exports["fp32"]["xml"],
        "calibration": calibration,
        "metric": args.metric,
        "group_size": args.group_size,
        "targets": targets,
    }
    shared = {k: v for k, v in spec.items() if k != "targets"}
    for t in targets:  # each target's result cached by what it depends on
        key = hashlib.sha256(json.dumps([shared, t], sort_keys=True).encode()).hexdigest()[:12]
        t["result"] = str(work / f"nncf-{key}.json")
    pending = [t for t in targets if args.fresh or not Path(t["result"]).exists()]
    if args.cached_only:
        for t in pending:
            t["skipped"] = "not run (--cached-only)"
        pending = []
    if pending:
        spec_path = work / "nncf-spec.json"
        spec_path.write_text(json.dumps({**spec, "targets": pending}))
        with (work / "nncf.log").open("w") as log:
            subprocess.run(
                [python, "-P", str(Path(__file__).resolve()), "--nncf-child", str(spec_path)],
                check=True, stderr=subprocess.STDOUT, stdout=log,
            )  # fmt: skip
    nncf_result = {
        "targets": [t if "skipped" in t else json.loads(Path(t["result"]).read_text()) for t in targets]
    }

    # 4. evaluate every OpenVINO model under each mode
    models = {
        f"OpenVINO {fmt} export (optimum-cli --weight-format {fmt})": (e["xml"], None)
        for fmt, e in exports.items()
    }
    refused = [t for t in nncf_result["targets"] if {"refused", "failed", "skipped"} & t.keys()]
    for t in refused:
        print(f"{t['name']}: NNCF {t.get('refused') or t.get('failed') or t['skipped']}", file=sys.stderr)
    for t in nncf_result["targets"]:
        if t in refused:
            continue
        if recipes:
            label = f"NNCF {_recipe_label(t)} at {t['bits']} bits (R={t['ratio']:.4f})"
        elif "bits" in t:
            label = (
                f"NNCF int4-g{args.group_size}/int8 at {t['bits']} bits ({budgets.get(t['bits'], '')}; {args.metric}, "
                f"all_layers, R={t['ratio']:.4f})"
            )
        else:
            label = f"NNCF int4-g{args.group_size}, ratio=1, " + (
                "all_layers=True (every weight int4)"
                if t["all_layers"]
                else "all_layers=False (defaults: table int8)"
            )
        models[label] = (str(Path(t["out"]) / "openvino_model.xml"), t)
    rows: dict[str, dict] = {}
    storage: dict[str, dict] = {}
    float_other = weight_storage(exports["fp32"]["xml"])["other_bytes"]
    for label, (xml, target) in models.items():
        storage[label] = weight_storage(xml)
        # an NNCF model of the fp32 export: what it holds beyond the export's other constants (LoRA adapters, AWQ's
        # activation scales) is stored for its weights too
        added = storage[label]["other_bytes"] - float_other if target else 0
        storage[label]["added_bytes"] = added
        for mode in args.int8_modes if "int8 export" in label else args.modes:
            # an NNCF model's scores are kept beside it (redone when the model is newer: --fresh)
            cached = Path(xml).with_name(f"eval-{mode}-t{args.tokens}-c{args.calibration}-w{w}.json")
            if target and cached.exists() and cached.stat().st_mtime > Path(xml).stat().st_mtime:
                r, resolved = json.loads(cached.read_text())
            else:
                run, resolved = ov_runner(xml, MODES[mode])
                r = _evaluate(run, references)
                del run
                if target:
                    cached.write_text(json.dumps([r, resolved]))
            r.update(
                bits_per_weight=8 * (storage[label]["bytes"] + added) / storage[label]["elements"],
                stored_bytes=storage[label]["bytes"] + added,
                added_bytes=added,
                compress_seconds=target.get("compress_seconds") if target else None,
                recipe=_recipe_label(target) if recipes and target else None,
                budget=target.get("bits") if target else None,
                ratio=target.get("ratio") if target else None,
                how=f"OpenVINO {ov.__version__.split('-')[0]} {mode}"
                + (f" ({', '.join(f'{k} {v}' for k, v in MODES[mode].items())})" if MODES[mode] else "")
                + f": runs {resolved.get('INFERENCE_PRECISION_HINT')}, KV cache {resolved.get('KV_CACHE_PRECISION')}, "
                f"dynamic quantization group {resolved.get('DYNAMIC_QUANTIZATION_GROUP_SIZE')}",
                resolved=resolved,
                formats=storage[label]["formats"],
            )
            rows[f"{label} [{mode}]"] = r
            print(f"{label} [{mode}]: KLD {r['kld']:.5f}, top-1 {100 * r['top1']:.1f}%, ppl {r['ppl']:.2f}, "
                  f"{r['bits_per_weight']:.3f} bits", file=sys.stderr)  # fmt: skip

    rows.update(precast_rows)
    cpu = f"{cpu_line()}; VNNI: {', '.join(vnni()) or 'none'}"
    print(
        f"CPU: {cpu}; load {load:.1f} -> {os.getloadavg()[0]:.1f}; {len(evaluation) - 1} tokens after "
        f"{args.calibration} of calibration, window {w}; {time.perf_counter() - started_all:.0f} s"
    )
    print(
        "| plan | KLD vs fp32 (nats/token) | top-1 | perplexity | bits/weight | how |\n|---|---|---|---|---|---|"
    )

    def bits(r: dict) -> str:
        stored = r.get("stored_bits_per_weight")
        if stored is None or abs(stored - r["bits_per_weight"]) < 5e-4:
            return f"{r['bits_per_weight']:.3f}"
        return f"{r['bits_per_weight']:.3f} (stored {stored:.3f})"

    for label, r in rows.items():
        print(
            f"| {label} | {r['kld']:.5f} | {100 * r['top1']:.1f}% | {r['ppl']:.2f} | {bits(r)} | {r['how']} |"
        )
    recipe_rows = [
        {"bits": r["budget"], "recipe": r["recipe"], "ratio": r["ratio"], "bits_per_weight": r["bits_per_weight"],
         "kld": r["kld"], "top1": r["top1"], "ppl": r["ppl"], "seconds": r["compress_seconds"], "row": label}
        for label, r in rows.items() if r.get("recipe")
    ] + [
        {"bits": t["bits"], "recipe": _recipe_label(t), "error": next(f"{k}: {t[k]}" for k in ("refused", "failed", "skipped") if k in t)}
        for t in refused if recipes
    ]  # fmt: skip
    if recipes:
        print(f"\nNNCF's data-aware recipes (INT4_ASYM group {args.group_size}, {args.metric}, R solved "
              f"for the stored bytes; best per budget in bold):\n{recipe_table(recipe_rows)}")  # fmt: skip
    same = [
        label
        for label in models
        if len({rows[k]["kld"] for k in rows if k.startswith(label + " [")}) == 1
        and sum(k.startswith(label + " [") for k in rows) > 1
    ]
    if same:
        print(
            f"\nBitwise the same KLD under every mode: {'; '.join(same)}. "
            + (
                ""
                if vnni()
                else "No VNNI on this CPU: OpenVINO does not quantize activations dynamically here, whatever "
                "DYNAMIC_QUANTIZATION_GROUP_SIZE says. "
            )
            + "Each window is one prefill from an empty state, which attends its own keys/values before the cache "
            "stores them: the KV cache precision does not enter (precast's static cache is written, then read: its "
            "bf16 cache does)."
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "cpu": cpu,
            "load": [load, os.getloadavg()[0]],
            "seconds": time.perf_counter() - started_all,
            "tokens": len(evaluation) - 1,
            "calibration": args.calibration,
            "window": w,
            "modes": {m: MODES[m] for m in {*args.modes, *args.int8_modes}},
            "exports": exports,
            # per-layer detail (formats, NNCF's sensitivity scores) stays in the caches under --work: one order here
            "nncf": {"targets": [_brief(t) for t in nncf_result["targets"]]},
            "sensitivity_order": next(
                (
                    [o["weight"] for o in t["sensitivity"]]
                    for t in nncf_result["targets"]
                    if "sensitivity" in t
                ),
                None,
            ),
            "storage": {
                k: {f: v for f, v in st.items() if f not in ("layers", "weights")}
                for k, st in storage.items()
            },
            "precast": precast_result,
            "rows": rows,
            "recipes": recipe_rows,
            "best": {str(b): r["row"] for b, r in best_per_budget(recipe_rows).items()},
        }
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--nncf-child":
        raise SystemExit(_nncf_child(sys.argv[2]))
    from precast.progress import quiet_libraries

    with quiet_libraries():
        raise SystemExit(main())
