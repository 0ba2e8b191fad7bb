"""Rendering a sensitivity estimate: JSON-ready dict, a ranked table, a PNG (bar chart + cumulative curve), and
a Model Explorer node-data overlay.

Input: ``precast.numerics.sensitivity.results.Estimate``. Output: text, a dict, a PNG file, Model Explorer ``ModelNodeData``.
matplotlib (the ``bench`` extra) is imported only when a picture is asked for; without it, one clear line.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from precast.errors import PrecastError, short_path
from precast.numerics.sensitivity.results import Estimate
from precast.report.render import MODEL_EXPLORER_GRAPH

STATUS_STYLE = {"overflow": "bold red", "underflow": "yellow", "fine": ""}


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def sensitivity_dict(est: Estimate) -> dict:
    nf = est.nonfinite
    return {
        "dtype": est.dtype,
        "metric": est.metric,
        "ranked_by": est.ranked_by,
        "all_low": {k: _num(v) for k, v in est.all_low.items()},
        "ops": [{**dataclasses.asdict(o), "estimate": _num(o.estimate)} for o in est.ops],
        "order": est.order,
        "curve": [{"k": p.k, "estimate": _num(p.estimate), "measured": _num(p.measured)} for p in est.curve],
        "first_nonfinite": dataclasses.asdict(nf) if nf is not None else None,
        "cost": {
            "forwards": est.forwards,
            "backward_probes": est.backwards,
            "conversions": est.conversions,
            "seconds": round(est.seconds, 3),
        },
    }


def sensitivity_text(est: Estimate, top: int = 20, width: int = 160) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    lines = []
    nf = est.nonfinite
    if nf is not None:
        where = f" at {short_path(nf.location)}" if nf.location else ""
        mod = f" (module {nf.module})" if nf.module else ""
        lines.append(f"first non-finite op in {est.dtype}: {nf.name} {nf.op}{mod}{where}: {nf.reason}")
        for i in nf.inputs:
            lines.append(f"  input {i['name']}: {i['dtype']} in [{i['min']:.4g}, {i['max']:.4g}]")
    t = Table(
        title=f"sensitivity to {est.dtype} ({est.metric} error of the outputs, each op alone in {est.dtype})"
    )
    for col in ("#", "node", "op", "module", "estimate", "share", "|max|", "range", "source"):
        t.add_column(col, overflow="fold")
    truth = any(o.truth is not None for o in est.ops)
    if truth:
        t.add_column("measured")
    for i, o in enumerate(est.ops[:top]):
        row = [
            str(i + 1),
            o.name,
            o.op.removeprefix("aten."),
            o.module,
            f"{o.estimate:.3g}",
            f"{o.share:.1%}",
            f"{o.absmax:.3g}" if o.absmax is not None else "-",
            f"[{STATUS_STYLE[o.status]}]{o.status}[/]" if STATUS_STYLE[o.status] else o.status,
            short_path(o.location) or "",
        ]
        if truth:
            row.append(f"{o.truth:.3g}" if o.truth is not None else "-")
        t.add_row(*row)
    console.print(t)
    measured = [p for p in est.curve if p.measured is not None]
    curve = ", ".join(f"k={p.k}: est {p.estimate:.3g} measured {p.measured:.3g}" for p in measured)
    lines.append(console.export_text().rstrip())
    lines.append(f"cumulative ({est.metric} left with the top k of the greedy order in fp32): {curve}")
    lines.append(
        f"cost: {est.forwards} forwards, {est.backwards} backward probes, {est.conversions} conversions, "
        f"{est.seconds:.1f} s; ranked by {est.ranked_by}"
    )
    return "\n".join(lines)


def model_explorer_sensitivity(est: Estimate) -> dict:
    """Model Explorer ``ModelNodeData``: each ranked op's value is log10 of its estimated error; red is worst."""
    results = {}
    for o in est.ops:
        value = math.log10(o.estimate) if o.estimate > 0 else -12.0
        results[o.name] = {"value": round(value, 3)}
    vals = sorted(r["value"] for r in results.values())
    hi = vals[-1] if vals else 0.0
    graph = {
        "name": f"precast sensitivity ({est.metric}, {est.dtype})",
        "results": results,
        "thresholds": [
            {"value": hi - 3, "bgColor": "#d9f0d3"},
            {"value": hi - 2, "bgColor": "#ffffbf"},
            {"value": hi - 1, "bgColor": "#fdae61"},
            {"value": hi + 1, "bgColor": "#d7191c"},
        ],
    }
    return {MODEL_EXPLORER_GRAPH: graph}


def plot_sensitivity(est: Estimate, path: str | Path, top: int = 20) -> None:
    """PNG: the top ops' estimates (bars; measured single-op truth as dots when known) and the cumulative
    curve (estimated line, measured points)."""
    try:
        import matplotlib  # noqa: PLC0415 - a picture is optional: the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise PrecastError("--plot needs matplotlib: pip install 'precast[bench]'") from exc
    ops = est.ops[:top]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{o.name}" for o in ops]
    colors = ["#d7191c" if o.status == "overflow" else "#2c7bb6" for o in ops]
    ax1.barh(range(len(ops)), [max(o.estimate, 1e-30) for o in ops], color=colors, label="estimate")
    if any(o.truth is not None for o in ops):
        ax1.scatter(
            [o.truth or float("nan") for o in ops], range(len(ops)), color="k", s=12, label="measured"
        )
    ax1.set_yticks(range(len(ops)), labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xscale("log")
    ax1.set_xlabel(f"{est.metric} error with the op alone in {est.dtype}")
    ax1.set_title(f"most sensitive ops ({est.dtype})")
    ax1.legend(loc="lower right")
    ks = [p.k for p in est.curve]
    ax2.plot(ks, [max(p.estimate, 1e-30) for p in est.curve], label="estimated")
    m = [p for p in est.curve if p.measured is not None and math.isfinite(p.measured)]
    ax2.scatter(
        [p.k for p in m], [max(p.measured, 1e-30) for p in m], color="#d7191c", zorder=3, label="measured"
    )
    ax2.set_yscale("log")
    ax2.set_xlabel("k: top ops of the greedy order kept in fp32")
    ax2.set_ylabel(f"{est.metric} error left")
    ax2.set_title("cumulative curve")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
