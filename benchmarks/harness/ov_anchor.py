"""OpenVINO's own export of a saved transformers model, timed: the anchor of ``precast bench --llm``.

Runs in the anchor's own environment (optimum-intel 2.2, transformers < 5.6;
``decode_anchor.anchor_env_commands``), never imports precast. Protocol on stdin / stdout, one JSON object a line:

  {"model_dir", "threads", "hint", "context", "cache_len", "vocab", "weight_format"?}
      -> {"export_s", "rss_mb", "versions"}
      exports ``model_dir`` with ``OVModelForCausalLM.from_pretrained(export=True)`` (stateful KV cache) into
      ``<model_dir>-ov`` in a child process (timed; reused when present); with ``weight_format`` ("int8",
      "int4"), with ``optimum-cli export openvino --weight-format FORMAT`` (what its users run) into
      ``<model_dir>-ov-FORMAT``; then loads that IR here with
      ``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` = ``hint`` and ``INFERENCE_NUM_THREADS`` =
      ``threads``, and runs a prefill and a step: ``rss_mb`` is what this fresh process gained.
  {"sample": steps}  -> {"prefill_ms", "decode_ms"}
      the seeded prompt (``context`` tokens) prefilled from an empty state, then ``steps`` decode steps.

OpenVINO's cache grows with the sequence (a decode step attends ``context + i`` positions), where transformers'
static cache of the torch forms reads all ``cache_len`` slots: the anchor reads less cache per step.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# optimum-cli's int4 at precast's int4 (``Int4()``: groups of 64, asymmetric); NNCF keeps the embedding and the
# head in int8-asym by its own default, which these leave as they are
INT4_ARGS = ["--group-size", "64", "--ratio", "1.0"]


def ir_dir(model_dir: str, weight_format: str | None) -> str:
    """Where the export of ``model_dir`` in ``weight_format`` goes: ``<model_dir>-ov[-FORMAT]`` (int4: ``-int4-g64``,
    ``INT4_ARGS``'s group)."""
    suffix = f"-{weight_format}" + ("-g64" if weight_format == "int4" else "") if weight_format else ""
    return model_dir.rstrip("/") + "-ov" + suffix


def export(model_dir: str, out: str, weight_format: str | None = None) -> None:
    if weight_format:  # the command optimum-intel's users run, from this environment
        cli = Path(sys.executable).parent / "optimum-cli"
        # int4: precast's group (64; optimum's default is 128), every linear in int4 (its default ratio, stated)
        extra = INT4_ARGS if weight_format == "int4" else []
        subprocess.run(
            [str(cli), "export", "openvino", "--model", model_dir, "--task", "text-generation-with-past",
             "--weight-format", weight_format, *extra, out],
            check=True,
            capture_output=True,
        )  # fmt: skip
        return
    from optimum.intel import OVModelForCausalLM

    model = OVModelForCausalLM.from_pretrained(model_dir, export=True, compile=False, stateful=True)
    model.save_pretrained(out)


def main() -> int:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--export":
        export(sys.argv[2], sys.argv[3], *sys.argv[4:])
        return 0
    from importlib.metadata import version

    import openvino
    import torch
    import transformers
    from optimum.intel import OVModelForCausalLM

    model = None
    spec: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "model_dir" in request:
                spec = request
                out, export_s = _exported(request)
                torch.set_num_threads(request["threads"])
                before = _rss_mb()
                model = OVModelForCausalLM.from_pretrained(
                    out,
                    ov_config={
                        "INFERENCE_PRECISION_HINT": request["hint"],
                        "KV_CACHE_PRECISION": request["hint"],
                        "INFERENCE_NUM_THREADS": str(request["threads"]),
                        "PERFORMANCE_HINT": "LATENCY",
                    },
                )
                _run(model, spec, 1)
                gc.collect()  # as the in-process forms' fresh processes do before their reading
                reply = {
                    "export_s": export_s,
                    "rss_mb": round(_rss_mb() - before, 1),
                    "versions": {
                        "openvino": openvino.__version__,
                        "optimum-intel": version("optimum-intel"),
                        "transformers": transformers.__version__,
                    },
                }
            else:
                reply = _run(model, spec, request["sample"])
        except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
            reply = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        print(json.dumps(reply), flush=True)
    return 0


def _exported(request: dict) -> tuple[str, float | None]:
    """The IR folder for the request (``<model_dir>-ov[-FORMAT]``), exported in a child process unless present,
    and the seconds the export took (None: reused)."""
    fmt = request.get("weight_format")
    out = ir_dir(request["model_dir"], fmt)
    export_s = None
    if not (Path(out) / "openvino_model.xml").exists():
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-P", __file__, "--export", request["model_dir"], out, *([fmt] if fmt else [])],
            check=True,
            capture_output=True,
        )
        export_s = round(time.perf_counter() - started, 1)
    return out, export_s


def _run(model, spec: dict, steps: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ctx = spec["context"]
    prompt = torch.randint(0, spec["vocab"], (1, ctx), generator=g)
    tokens = [torch.randint(0, spec["vocab"], (1, 1), generator=g) for _ in range(steps)]
    with torch.no_grad():
        t = time.perf_counter()
        out = model(input_ids=prompt, attention_mask=torch.ones(1, ctx, dtype=torch.long))
        prefill = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for i in range(steps):
            mask = torch.ones(1, ctx + i + 1, dtype=torch.long)
            out = model(input_ids=tokens[i], attention_mask=mask, past_key_values=out.past_key_values)
        decode = (time.perf_counter() - t) * 1e3 / steps
    return {"prefill_ms": round(prefill, 2), "decode_ms": round(decode, 3)}


if __name__ == "__main__":
    sys.exit(main())
