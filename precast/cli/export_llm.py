"""precast export-llm MODEL -o DIR [--gguf FILE] [--max-cache-len N] [--dtype bf16|fp16] [--cache-dtype DTYPE]
                     [--weight-format FORMAT... | --bits B | --kld K | --plan PLAN.json]
                     [--calibration-text FILE [--calibration-window W] [--calibration-tokens T]
                      [--budget-formats FORMAT...] [--probes N]] [--eval-tokens N] [--backend openvino aoti]
                     [--allow CODE]

The flow of ``optimum-cli export openvino --weight-format int8`` / ``llama-quantize`` in one command: a transformers
checkpoint (a ``save_pretrained`` folder, or a GGUF file) read in fp32, exported with transformers' static-cache
recipe (``precast.llm.checkpoint``), converted (policy torch, bf16, the KV cache in bf16, the weights in the format
asked for, or chosen by measurement on calibration text under a budget, or as a plan says), and written as one
folder: program.pt2, tokenizer.json, plan.json, report.json, export.json, and OpenVINO IR / an AOTInductor package
on request (written whole or not at all). Before the fp32 weights are freed, the result is measured against them on
``--eval-tokens`` of held-out text: KLD, top-1 agreement, perplexity, in the summary, report.json and export.json.
The flow is the library's (``precast.llm.export``, ``precast.llm.exporter``): this command parses the flags into its
options record (``precast.cli.export_llm_flags``) and prints the result.

Input: a checkpoint, options. Output: the artifact folder; the report's summary on stdout, one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from precast.cli.export_llm_flags import ARGUMENTS, check_flags
from precast.cli.flags import add_command
from precast.llm.exporter import ExportedFolder, export_with
from precast.llm.folder import MANIFEST, REPORT


def add_parser(sub: Any) -> None:
    """``precast export-llm``: the flags of ``ARGUMENTS`` (``precast.cli.export_llm_flags``), run by ``run``."""
    add_command(
        sub,
        "export-llm",
        ARGUMENTS,
        run=run,
        help="a transformers checkpoint (folder or GGUF) to a deployable folder: exported, converted, int8/int4",
        description="Read a transformers checkpoint (a folder save_pretrained wrote, or a GGUF file) in fp32, "
        "export it with transformers' static-cache recipe, convert it (policy torch, --dtype, the KV cache in "
        "--cache-dtype, the linear/embedding weights in --weight-format or chosen under a --bits/--kld budget "
        "measured on --calibration-text, or as --plan says) and write one folder: program.pt2, tokenizer.json, "
        "plan.json, report.json, export.json (and model.xml/.bin, an aoti/ cache entry with --backend). "
        "Then: precast generate DIR --prompt TEXT --max-new-tokens N. docs/llm_export.md",
    )


def run(args: argparse.Namespace) -> int:
    """The flags checked into the export's options, the export run (``precast.llm.exporter.export_with``), its
    result printed; ``precast --verbose`` shows the libraries' own warnings meanwhile."""
    from precast.llm.checkpoint import SHOW_LIBRARIES

    token = SHOW_LIBRARIES.set(bool(getattr(args, "verbose", False)))
    try:
        folder = export_with(check_flags(args))
    finally:
        SHOW_LIBRARIES.reset(token)
    _print(folder)
    return 0


def _print(folder: ExportedFolder) -> None:
    """The report's summary on stdout (its info lines counted), the files written and the folder's size on stderr."""
    out, files = folder.path, folder.files
    lines = folder.summary().splitlines()
    infos = [line for line in lines if line.startswith("info: ")]
    print("\n".join(line for line in lines if not line.startswith("info: ")))
    if infos:
        print(f"{len(infos)} info diagnostic(s): {out / REPORT}")
    if "tokenizer" not in files:
        print(
            f"warning: no tokenizer written ({folder.tokenizer_note or 'none found'}); generate with --prompt-ids (and no "
            "accuracy against fp32 was measured: it reads text)",
            file=sys.stderr,
        )
    took = ", ".join(f"{k} {v:.1f}s" for k, v in folder.seconds.items())
    print(f"wrote {out}: {', '.join(files.values())}, {MANIFEST} ({took})", file=sys.stderr)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    weights = sum(folder.report.weight_bytes_after.values())
    print(
        f"folder {size / 2**20:.1f} MiB for {weights / 2**20:.1f} MiB of weights as stored "
        f"({size / max(weights, 1):.2f}x: each weight once)",
        file=sys.stderr,
    )
