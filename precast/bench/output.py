"""Tables and files for ``precast bench``: rich tables for the terminal, markdown, JSON and a PNG chart.

Input: the ``Result`` rows of ``variants.run_bench`` or the ``ConvertCost`` rows of
``convert_cost.run_convert_bench``, and ``measure.machine_info()``. Output: ``to_rich_table`` /
``convert_cost_rich`` (rich tables), ``to_markdown`` / ``convert_cost_markdown`` (text), ``write_outputs`` ->
bench.json, bench.md and bench.png (when matplotlib is installed), ``write_convert_outputs`` ->
convert_cost.json and convert_cost.md, each written whole or not at all (``precast.io.atomic_path``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from precast.bench.convert.cost import ConvertCost, linearity
from precast.bench.variants import VARIANTS, Result

# ---- precast bench ---------------------------------------------------------------------------------------
COLUMNS = (
    ("model", "model"),
    ("batch", "batch"),
    ("variant", "variant"),
    ("latency_ms", "latency ms"),
    ("speedup", "vs default"),
    ("package_mb", "package MB"),
    ("rss_mb", "RSS MB"),
    ("max_abs_err", "max abs err"),
    ("cosine", "cosine"),
    ("casts_per_forward", "casts/fwd"),
)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e-2 and value else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def rows(results: list[Result]) -> list[list[str]]:
    out = []
    for r in results:
        d = asdict(r)
        cells = [cell(d[k]) for k, _ in COLUMNS]
        if r.error:
            cells[3] = f"error: {r.error[:60]}"
        out.append(cells)
    return out


def to_markdown(results: list[Result], machine: dict[str, Any]) -> str:
    head = [h for _, h in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    desc = ", ".join(f"{k}: {v}" for k, v in machine.items())
    return (
        f"# precast bench\n\nMachine: {desc}\n\nLatency: median of interleaved repeats; RSS: resident memory a "
        "fresh process gains by loading the package and running one forward; errors vs eager fp32; casts/fwd: "
        "`aten::_to_copy` calls (eager, counted at dispatch) or calls to generated cast kernels (AOTI wrapper).\n\n"
        + "\n".join(lines)
        + "\n"
        + "".join(f"\n- {n}" for n in _notes(results))
    )


def _notes(results: list[Result]) -> list[str]:
    """One line per distinct (model, note)."""
    return list(dict.fromkeys(f"{r.model}: {r.note}" for r in results if r.note))


def to_rich_table(results: list[Result]) -> Any:
    from rich.table import Table

    table = Table(title="precast bench")
    for key, head in COLUMNS:
        table.add_column(head, justify="left" if key in ("model", "variant") else "right")
    for row in rows(results):
        table.add_row(*row)
    return table


def write_outputs(results: list[Result], out_dir: str | os.PathLike, machine: dict[str, Any]) -> list[Path]:
    """bench.json, bench.md and (when matplotlib is installed) bench.png in ``out_dir``; returns the paths."""
    from precast.io import atomic_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    payload = {"machine": machine, "results": [asdict(r) for r in results]}
    with atomic_path(out / "bench.json") as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
    written.append(out / "bench.json")
    with atomic_path(out / "bench.md") as tmp:
        tmp.write_text(to_markdown(results, machine))
    written.append(out / "bench.md")
    png = plot(results, out / "bench.png")
    if png:
        written.append(png)
    return written


def plot(results: list[Result], path: Path) -> Path | None:
    """Latency per variant, one group per (model, batch). None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from precast.io import atomic_path

    groups = sorted({(r.model, r.batch) for r in results}, key=lambda g: (g[0], g[1]))
    variants = [v for v in VARIANTS if any(r.variant == v for r in results)]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        ys = []
        for g in groups:
            r = next((r for r in results if (r.model, r.batch) == g and r.variant == variant), None)
            ys.append(r.latency_ms if r and r.latency_ms else 0.0)
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("median latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path


# ---- precast bench --convert ------------------------------------------------------------------------------
def _stages_present(results: list[ConvertCost]) -> list[str]:
    """The stage names of all rows, in order of first appearance (as the conversion reported them)."""
    return list(dict.fromkeys(s for r in results for s in r.stage_ms))


def convert_cost_rows(results: list[ConvertCost]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the time table: totals, then ms per node of each stage."""
    stages = _stages_present(results)
    head = ["model", "policy", "N", "nodes", "total ms", "ms/node", "cpu ms/node", *stages, "verify ms/node"]
    head.append("% of convert()")
    rows_ = []
    for r in results:
        n = r.nodes or 1
        if r.error:
            rows_.append(
                [r.model, r.policy, cell(r.ops), "-", f"error: {r.error[:80]}", *["-"] * (len(head) - 5)]
            )
            continue
        per_stage = [cell(round(r.stage_ms[s] / n, 4)) if s in r.stage_ms else "-" for s in stages]
        rows_.append(
            [
                r.model + (" *" if r.note else ""),
                r.policy,
                cell(r.ops),
                str(r.nodes),
                f"{r.total_ms:.0f}",
                f"{r.ms_per_node:.3f}",
                f"{r.cpu_ms_per_node:.3f}",
                *per_stage,
                cell(round(r.verify_ms / n, 4)) if r.verify_ms is not None else "-",
                f"{100 * r.in_stages:.0f}" if r.in_stages is not None else "-",
            ]
        )
    return head, rows_


def convert_memory_rows(results: list[ConvertCost]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the memory table: peak traced Python memory, then KiB per node of each stage."""
    stages = _stages_present(results)
    head = ["model", "policy", "N", "nodes", "peak MiB", "peak KiB/node", *stages]
    rows_ = []
    for r in results:
        if r.error or r.peak_kib is None:
            continue
        n = r.nodes or 1
        rows_.append(
            [
                r.model,
                r.policy,
                cell(r.ops),
                str(r.nodes),
                f"{r.peak_kib / 1024:.1f}",
                f"{r.peak_kib / n:.1f}",
                *[f"{r.stage_kib[s] / n:.2f}" if s in r.stage_kib else "-" for s in stages],
            ]
        )
    return head, rows_


def _md_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def convert_cost_markdown(results: list[ConvertCost], machine: dict[str, Any] | None = None) -> str:
    parts = []
    if machine:
        parts.append("Machine: " + ", ".join(f"{k}: {v}" for k, v in machine.items()))
    parts.append(
        "Time (total and per stage: wall ms per node; cpu ms/node: this process's CPU time, all stages, robust "
        "to other load; verification kept apart; % of convert(): the share of the whole precast.convert() call "
        "spent in observed stages, verification included):\n\n" + _md_table(*convert_cost_rows(results))
    )
    mem = convert_memory_rows(results)
    if mem[1]:
        parts.append("Peak traced Python memory (KiB per node of each stage):\n\n" + _md_table(*mem))
    lin = linearity(results)
    if lin:
        parts.append(
            "Linearity (CPU ms/node at the largest N over the smallest; 1.0 = linear): "
            + ", ".join(f"{k}: {v}" for k, v in lin.items())
        )
    notes = [f"{r.model} ({r.policy}): {r.note}" for r in results if r.note]
    if notes:
        parts.append("\\* " + "; ".join(notes))
    return "\n\n".join(parts) + "\n"


def convert_cost_rich(results: list[ConvertCost]) -> list[Any]:
    from rich.table import Table

    tables = []
    for title, (head, body) in (
        ("conversion cost: ms per node", convert_cost_rows(results)),
        ("conversion cost: peak Python memory, KiB per node", convert_memory_rows(results)),
    ):
        if not body:
            continue
        table = Table(title=title)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 else "right")
        for row in body:
            table.add_row(*row)
        tables.append(table)
    return tables


def write_convert_outputs(
    results: list[ConvertCost], out_dir: str | os.PathLike, machine: dict[str, Any]
) -> list[Path]:
    """convert_cost.json and convert_cost.md in ``out_dir``."""
    from precast.io import atomic_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine,
        "linearity": linearity(results),
        "results": [asdict(r) | {"total_ms": r.total_ms} for r in results],
    }
    with atomic_path(out / "convert_cost.json") as tmp:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
    with atomic_path(out / "convert_cost.md") as tmp:
        tmp.write_text("# precast conversion cost per node\n\n" + convert_cost_markdown(results, machine))
    return [out / "convert_cost.json", out / "convert_cost.md"]
