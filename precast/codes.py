"""The registry of diagnostic codes: every code precast can report, its default severity, meaning and fix.

One table drives ``convert(allow=...)`` validation, the table of codes in docs/report.md and the JSON schema's
enum (tests check all three agree, and that every code the package emits is registered). Emit a diagnostic by
code with ``precast.ir.diagnostics.make_diagnostic`` / ``record``: its severity comes from here by default.

``python -c "import precast.codes as c; c.write_docs()"`` rewrites the table in docs/report.md and the enum in
the schema from the registry.

Input: a code name. Output: its ``Code`` record; ``write_docs`` regenerates the table in docs/report.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Code:
    name: str
    severity: str  # the default severity: "error" stops the conversion unless allowed
    meaning: str  # when precast reports it
    fix: str  # what the user does about it ("" when there is nothing to do)
    allowable: bool = True  # whether convert(allow=...) accepts it


_CODES = (
    # ---- the program as given -----------------------------------------------------------------------
    Code(
        "dtype-mismatch",
        "error",
        "an op would fail at run time: its inputs have different dtypes (the seed's `output` Linear receiving "
        "bf16 activations with fp32 weights)",
        "cast the activation back with `.float()` where it leaves the autocast region, or move the op inside it",
    ),
    Code(
        "autocast-category-unknown",
        "warning",
        "the installed torch registers an autocast kernel for an op of the program that precast has no category "
        "for (a torch newer than precast's tables, or another library's op: torchvision's `nms`, `roi_align`): the "
        "op is left as written, where eager autocast may cast it",
        "upgrade precast, or keep the op out of autocast (exclude it, or run it in an fp32 region); "
        "`precast.policy.torch_tables.unknown_registrations(device)` lists every such op",
    ),
    Code(
        "unused-enabled-input",
        "warning",
        "a bool input has no users in a program with regions: export specialized `autocast(enabled=flag)` to "
        "the traced value",
        "export one program per value of the flag, or make `enabled=` a constant",
    ),
    Code(
        "noop-region",
        "warning",
        "an autocast region for a device type none of the program's tensors are on (`autocast('cuda')` in a "
        "CPU program)",
        "use the device type the program runs on, or move the model before exporting",
    ),
    Code(
        "control-flow",
        "error",
        "`torch.cond` / `while_loop` / `map` (a higher-order op with subgraphs other than autocast/grad "
        "regions): precast does not convert inside them",
        "move the autocast region out of the branches, or allow it: the rest is converted and the subgraphs "
        "run as written",
    ),
    Code(
        "autocast-promote",
        "error",
        "policy 'torch': eager autocast would fail on this promote op (a low-precision tensor of another dtype "
        "than the autocast dtype)",
        "cast the tensor to float32 or to the autocast dtype first",
    ),
    Code(
        "autocast-banned",
        "error",
        "policy 'torch': the op is banned under eager autocast (CUDA `binary_cross_entropy`)",
        "use the op's `_with_logits` form, or keep it out of autocast",
    ),
    Code(
        "fake-run-failed",
        "error",
        "re-running the program on fake tensors failed at this node for a reason other than a dtype mismatch",
        "the error names the node and torch's message; report it with the program if the program itself runs",
    ),
    Code(
        "dynamic-dim-specialized",
        "error",
        "running an op on the program's fake values fixed or narrowed a dynamic dimension of its inputs: the "
        "converted program would reject other sizes",
        "report it with the program; convert with static shapes meanwhile",
        allowable=False,
    ),
    Code(
        "composite-not-traced",
        "warning",
        "policy 'torch': a composite op that eager autocast decomposes could not be traced, so it is kept as "
        "one op; the result may differ from eager autocast at this node",
        "keep the op in float32 (exclude_nodes under policy 'rules'), or report the op",
    ),
    Code(
        "dtype-read-at-export",
        "info",
        "policy 'torch' given a program: a dtype conversion to float32 of a value the export recorded as float32 "
        "(Qwen3's RMSNorm `weight * h.to(input_dtype)` exported in fp32): the dtype the model's code read while "
        "tracing is fixed in the graph, where eager autocast would read the low dtype; or a conversion the export "
        "recorded as a no-op (`v.float()` of a float32 `v` returns `v`) whose value a later line reads by its "
        "own name (`v.mean()`): the program records that read as one of the conversion, where eager autocast "
        "reads the low-dtype `v`; the conversion follows the program, and verifies against the program run "
        "under autocast, not eager autocast of the model",
        "convert the module with its example inputs (`precast.convert(model, example_inputs, policy='torch')`): "
        "precast traces its forward under autocast, as eager runs it",
    ),
    # ---- decisions and constants -----------------------------------------------------------------------
    Code(
        "no-regions",
        "info",
        "policy None on a program without autocast regions: returned unchanged",
        "use policy 'torch' or 'rules' to add mixed precision",
    ),
    Code(
        "written-constant-not-folded",
        "info",
        "a constant the program writes (in-place update, buffer mutation) keeps its cast at run time: a folded "
        "copy would go stale after the first call",
        "",
    ),
    Code(
        "weight-not-quantized",
        "info",
        "weight_format= stores the weights of linears and embeddings in 8/4 bits; a 2-d constant another op reads "
        "as a weight (a matmul through a transpose) stays in the float its op computes in",
        "express the layer as a linear (`nn.Linear`, `F.linear`) to store its weight in 8/4 bits",
    ),
    Code(
        "write-cast",
        "info",
        "a value written in place into a tensor of another dtype (a KV cache's `index_copy_`, `index_put_`, a "
        "scatter) arrives in a dtype the conversion changed: it is cast to the destination's dtype at the write, "
        "as `copy_` does (under policy torch, a stated extension of eager autocast, which raises there)",
        "",
    ),
    Code(
        "cache-not-owned",
        "error",
        "cache_dtype= asks for the program's caches in a low dtype, and a floating buffer the program writes is not "
        "a cache it only stores into: it is updated from its own value (a running statistic, an accumulator)",
        "leave cache_dtype unset for this program, or keep that state in a separate fp32 buffer",
        allowable=False,
    ),
    Code(
        "fp16-clamped",
        "warning",
        "a constant stored in fp16 had values beyond ±65504; they were clamped to ±65504 (never inf)",
        "keep the op reading it in fp32 (the default `init_max` rule does), or use bf16",
    ),
    Code(
        "kept-fp32",
        "info",
        "policy 'rules': ops the rules or the user kept in fp32, with each one's reason",
        "",
    ),
    Code(
        "flush-to-zero",
        "warning",
        "calibration measured values that flush to zero in the low dtype (below its smallest subnormal)",
        "keep the ops in fp32 (the rules do so by default), or use bf16, whose range is float32's",
    ),
    Code(
        "data-max-inactive",
        "warning",
        "`data_max` is not applied: no calibration data and the program has no example inputs",
        "pass calibration=[inputs, ...]",
    ),
    Code(
        "ranges-from-example-inputs",
        "info",
        "value ranges (data_max) and errors were measured on the example inputs only",
        "pass calibration=[inputs, ...] for representative ranges",
    ),
    Code("calibrated", "info", "value ranges were measured on the calibration data", ""),
    Code(
        "tolerance",
        "info",
        "policy 'rules' with `tolerance=`: the ops moved back to fp32 to meet it and the error reached",
        "",
    ),
    Code(
        "tolerance-not-met",
        "warning",
        "the final converted program measures outside `tolerance=` on the calibration data",
        "loosen the tolerance, or exclude more ops with exclude_nodes / exclude_ops",
    ),
    Code(
        "tolerance-unmet",
        "error",
        "`tolerance=` cannot be met even with every op but the matmul/convolution family in fp32",
        "loosen the tolerance, or exclude matmuls/convolutions explicitly",
    ),
    # ---- checks on the converted program -----------------------------------------------------------------
    Code(
        "device-unsupported",
        "error",
        "run once on its example inputs node by node, an op of the converted program fails on the device "
        "(bf16 `mkldnn_rnn_layer` from `nn.LSTM` on CPUs without oneDNN bf16 support)",
        "keep the op in float32 (policy 'rules' with exclude_nodes / exclude_ops, or out of the region)",
    ),
    Code(
        "no-low-precision-kernel",
        "warning",
        "policy 'rules' / 'auto': run once on the example inputs, an op failed in the low dtype on this device "
        "(no low-precision kernel: fp16 `mkldnn_rnn_layer` on CPUs without oneDNN fp16), so it was kept in "
        "float32 and the program converted again",
        "nothing to do; exclude_ops the op to skip the retry, or use a device with the kernel",
    ),
    Code(
        "auto-latency",
        "info",
        "policy 'auto': per-op fp32 vs low-precision latencies measured on this device (or read from the "
        "cache), what was chosen, the estimated and the measured end-to-end speedup",
        "",
    ),
    Code(
        "latency-not-measured",
        "warning",
        "policy 'auto': an op could not be timed on this device (its kernel failed on inputs of its shapes), so "
        "it stays float32",
        "nothing to do; exclude_ops it to skip the attempt",
    ),
    Code(
        "device-check-skipped",
        "warning",
        "the run of the converted program on its example inputs could not be made (the reason is given), so "
        "ops failing on the device would not be found",
        "run the converted program yourself, or `precast check` it with --inputs",
    ),
    Code(
        "verification-skipped",
        "warning",
        "`verify=True`, but the converted program was not compared with its reference (the reason is given: "
        "no example inputs, inputs on a device this machine lacks)",
        "pass example inputs, or run `precast check` where the device is",
    ),
    Code(
        "not-bitwise",
        "warning",
        "a promise of bitwise equality is broken: policy None differs from the unconverted program, or policy "
        "'torch' from its autocast reference (eager `torch.autocast` of the module, or the program run under "
        "`torch.autocast`)",
        "report it with the program; `precast check` shows per-output errors",
    ),
    Code(
        "export-differs-from-eager",
        "info",
        "policy 'torch': the converted program is bitwise the exported program (the forward as torch.export "
        "recorded it, under autocast), and that record itself differs from eager autocast (a Linear on a 3-D "
        "transposed input recorded as `bmm` where eager runs `mm`): the difference is the export's, not precast's",
        "nothing for precast; the size is in `report.verification['export_baseline']`",
    ),
    Code(
        "measured-error",
        "info",
        "policy 'rules' (and 'auto', a policy of the user's): the converted program's difference from the "
        "unconverted program on the example inputs (expected: rules trade precision for speed)",
        "",
    ),
    Code(
        "ambient-autocast",
        "warning",
        "at call time: the converted module runs under `torch.autocast`, which re-casts on top of precast's "
        "decisions; warned once per module",
        "call the converted module outside the autocast block",
    ),
    Code(
        "internal-error",
        "error",
        "a precast pass left a graph that does not lint or fake-propagate, or raised: a bug in precast, named "
        "with the pass",
        "report it with the program that triggers it",
        allowable=False,
    ),
    Code(
        "error",
        "error",
        "a bad input or option with no more specific code (the message says what, where and what to do)",
        "as the message says",
        allowable=False,
    ),
)

CODES: dict[str, Code] = {c.name: c for c in _CODES}


def get(name: str) -> Code:
    """The registered code ``name``; a KeyError naming the registry for an unregistered one."""
    try:
        return CODES[name]
    except KeyError:
        raise KeyError(f"diagnostic code {name!r} is not registered in precast/codes.py") from None


def code(name: str) -> str:
    """``name`` after checking it is registered: use it where a code is not a string literal."""
    return get(name).name


def allowable() -> list[str]:
    """Codes ``convert(allow=...)`` accepts."""
    return [c.name for c in _CODES if c.allowable]


# ---- generated documentation --------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "report.md"
SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "report.schema.json"
TABLE_BEGIN = "<!-- codes: generated from precast/codes.py by precast.codes.write_docs(); do not edit -->"
TABLE_END = "<!-- end of codes -->"


def markdown_table() -> str:
    """The table of codes for docs/report.md."""
    rows = ["| code | severity | when | fix |", "|---|---|---|---|"]
    for c in _CODES:
        rows.append(f"| `{c.name}` | {c.severity} | {_cell(c.meaning)} | {_cell(c.fix) or '-'} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def doc_table(text: str) -> str | None:
    """The generated table as it stands in a document's text (None without the markers)."""
    match = re.search(re.escape(TABLE_BEGIN) + r"\n(.*?)" + re.escape(TABLE_END), text, re.S)
    return match.group(1).strip("\n") if match else None


def write_docs() -> None:
    """Rewrite the table in docs/report.md and the code enum in docs/report.schema.json from the registry."""
    text = DOC.read_text()
    if doc_table(text) is None:
        raise SystemExit(f"{DOC}: no table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    new = re.sub(
        re.escape(TABLE_BEGIN) + r"\n.*?" + re.escape(TABLE_END),
        lambda _: f"{TABLE_BEGIN}\n{markdown_table()}\n{TABLE_END}",
        text,
        flags=re.S,
    )
    DOC.write_text(new)
    schema = SCHEMA.read_text()
    enum = ", ".join(f'"{c.name}"' for c in _CODES)
    new_schema, n = re.subn(
        r'("code": \{"enum": \[)[^\]]*(\])', lambda m: m.group(1) + enum + m.group(2), schema
    )
    if n != 1:
        raise SystemExit(f'{SCHEMA}: expected one line `"code": {{"enum": [...]`')
    SCHEMA.write_text(new_schema)
