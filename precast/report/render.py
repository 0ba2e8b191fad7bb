"""Renderings of a precast.Report: a terminal table grouped by module (rich), JSON, Model Explorer node data.

Input: a Report. Output: a rich table, JSON text, or Model Explorer node data.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from precast.errors import short_path
from precast.report.model import Report

DTYPE_STYLE = {"bf16": "cyan", "fp16": "magenta", "fp32": "default", "fp64": "yellow"}
# Model Explorer colours, one per dtype (the node's value is its bit width)
DTYPE_COLOR = {"bf16": "#7ec8e3", "fp16": "#d291bc", "fp32": "#eeeeee", "fp64": "#f6d55c"}
DTYPE_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "fp64": 64}
# the graph id Model Explorer's built-in PyTorch ExportedProgram adapter gives the program's graph; its node ids
# are the fx node names (model_explorer/pytorch_exported_program_adapter_impl.py)
MODEL_EXPLORER_GRAPH = "graph"


def reason_text(rec) -> str:
    # reasons often end with the rule name already ("autocast(cpu, bf16): lower_precision_fp")
    reason = rec.reason.removesuffix(f": {rec.rule}")
    text = f"{rec.source}/{rec.rule}: {reason}"
    if rec.measured is not None:
        text += f" (measured {rec.measured:.4g}" + (
            f", limit {rec.limit:.4g})" if rec.limit is not None else ")"
        )
    return text


def table(rep: Report) -> Table:
    """One row per op, grouped by module path (in graph order), with its dtype and why."""
    t = Table(title="precast report", show_lines=False, expand=False)
    t.add_column("node", no_wrap=True)
    t.add_column("op", no_wrap=True)
    t.add_column("dtype", no_wrap=True)
    t.add_column("reason", ratio=1)
    t.add_column("source", no_wrap=True)
    groups: dict[str, list] = {}
    for rec in rep.nodes:
        groups.setdefault(rec.module or "(top level)", []).append(rec)
    for i, (module, recs) in enumerate(groups.items()):
        if i:
            t.add_section()
        t.add_row(f"[bold]{module}[/bold]", "", "", "", "")
        for rec in recs:
            dtype = rec.dtype or "-"
            style = DTYPE_STYLE.get(dtype, "default")
            t.add_row(
                f"  {rec.name}",
                rec.op.removeprefix("aten.").removesuffix(".default"),
                f"[{style}]{dtype}[/{style}]",
                reason_text(rec),
                short_path(rec.location) or "",
            )
    return t


def render_table(rep: Report, console: Console | None = None) -> Console:
    # off a terminal rich assumes 80 columns, which folds every reason: use a width a file or pager can hold
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(table(rep))
    for line in rep.summary().splitlines():
        console.print(line, markup=False, highlight=False)
    return console


def table_text(rep: Report, width: int = 160) -> str:
    console = Console(width=width, record=True, file=_Null(), color_system=None)
    render_table(rep, console)
    return console.export_text()


class _Null:
    def write(self, _):
        return 0

    def flush(self):
        pass


def model_explorer_data(rep: Report) -> dict:
    """Node data for Google's Model Explorer (``ModelNodeData`` JSON: graph id -> ``GraphNodeData``).

    Each op is coloured by the dtype it computes in; its value is the dtype's bit width. Run-time casts are
    included (value = bit width of the cast's output). Load it beside the program in Model Explorer
    (``model_explorer.visualize_pytorch(name, ep, node_data={"node_data_path": path})``).
    """
    results: dict[str, dict] = {}
    for rec in rep.nodes:
        if rec.dtype in DTYPE_BITS:
            results[rec.name] = {"value": DTYPE_BITS[rec.dtype], "bgColor": DTYPE_COLOR[rec.dtype]}
    for cast in rep.casts:
        if cast.dtype in DTYPE_BITS:
            results[cast.name] = {"value": DTYPE_BITS[cast.dtype], "bgColor": "#f08a5d"}
    graph = {
        "name": "precast dtype",
        "results": results,
        "thresholds": [
            {"value": 16, "bgColor": DTYPE_COLOR["bf16"]},
            {"value": 32, "bgColor": DTYPE_COLOR["fp32"]},
            {"value": 64, "bgColor": DTYPE_COLOR["fp64"]},
        ],
    }
    return {MODEL_EXPLORER_GRAPH: graph}


def render(rep: Report, fmt: str, width: int | None = None) -> str:
    if fmt == "json":
        return rep.to_json()
    if fmt == "model-explorer":
        return json.dumps(model_explorer_data(rep), indent=2, sort_keys=True)
    if fmt == "table":
        return table_text(rep, width or 160)
    raise ValueError(f"unknown format {fmt!r}")
