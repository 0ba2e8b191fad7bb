"""LLM decode on a CPU, measured: the harness of ``precast bench --llm`` (and of the source checkout's decode script).

- The model (``model.py``): ``Shape``, ``llama``, ``wrapped``, ``export_decoder``, ``decode_inputs``,
  ``read_bytes``. The anchor (OpenVINO's own export in its own environment) is the source checkout's: its
  harness registers the anchor forms with ``forms.register``.
- ``InProcess``: one form run in this process, sampled as (prefill ms, ms per decoded token); the anchor's
  process is sampled the same way.
- ``interleaved``: every repeat samples each form once, in turn: load on the machine hits all alike.
- ``bandwidth_gbs``, ``load_average``: the machine's memory read rate, the load before and after.
- ``run_decode_bench``: the forms ``precast bench --llm`` compares (eager fp32, eager hand-cast bf16, precast
  through ``precast.compile`` with no options and with ``mode="default"``, precast on OpenVINO);
  ``decode_markdown``: its table.

Input: a shape, thread counts, repeats. Output: rows of ms/token, tokens/s, prefill ms, resident MiB of a fresh
process, bytes read per token against the measured bandwidth, compile/export seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import precast.bench.decode.forms as decode_forms
from precast.bench.decode.model import Shape, decode_inputs

MIN_REPEATS = 2  # a median of one sample hides a load spike


# ---- the machine --------------------------------------------------------------------------------------------
def bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 7, best: bool = False) -> float:
    """Memory read bandwidth (GB/s) at ``threads``: the median (``best``: the shortest; load only ever adds time)
    time of summing a ``mib`` MiB fp32 tensor."""
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / (min(times) if best else statistics.median(times)) / 1e9


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none)."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(v, 2) for v in os.getloadavg()]
    return []


# ---- forms, sampled -------------------------------------------------------------------------------------------
class InProcess:
    """A form run in this process: ``run(input_ids=, cache_position=)``; one sample is the prompt's prefill then
    ``steps`` decode steps from position ``context``."""

    def __init__(self, run: Callable[..., Any], shape: Shape):
        self.run = run
        self.prompt, tokens = decode_inputs(shape)
        self.tokens = tokens
        self.ctx = shape.context

    def warm(self) -> None:
        self.run(input_ids=self.prompt, cache_position=torch.arange(self.ctx))
        for i in range(3):
            self.run(input_ids=self.tokens[i], cache_position=torch.tensor([self.ctx + i]))

    def sample(self, steps: int, threads: int) -> tuple[float, float]:
        torch.set_num_threads(threads)
        positions = [torch.tensor([self.ctx + i]) for i in range(steps)]
        t = time.perf_counter()
        self.run(input_ids=self.prompt, cache_position=torch.arange(self.ctx))
        prefill = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for i in range(steps):
            self.run(input_ids=self.tokens[i], cache_position=positions[i])
        return prefill, (time.perf_counter() - t) * 1e3 / steps


def interleaved(
    forms: dict[str, Any],
    threads: int,
    repeats: int,
    steps: int,
    log: Callable[[str], None],
    deadline: float | None = None,
    warm_reversed: bool = False,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every repeat samples each form once, in turn (``forms``: name -> an object with ``warm()`` and
    ``sample(steps, threads)``); medians per form, and the forms that failed with why. ``deadline`` (a
    ``time.perf_counter()`` value): no repeat begins that would end past it (judged by the last one), though
    ``MIN_REPEATS`` always run.

    The forms take their first calls (``warm``) in the order given, ``warm_reversed``: in reverse. The order can move
    a comparison of in-process models: an OpenVINO model packs its weights and sizes its buffers at its first call,
    and in a two-model script (the 0.246 B decoder, blocks of 8 steps in random order, 1 thread, a 2-core
    AVX512-BF16 Zen 4 KVM guest, OpenVINO 2026.4.1) the model that did so first decoded 3-6% slower, whichever of
    precast's form and OpenVINO's own export's IR it was (not moved by malloc's mmap threshold, CPU pinning, or a
    small model run first). In this harness's runs the two orders gave like figures; a same-process figure is
    stated over runs of both orders."""
    torch.set_num_threads(threads)
    failed: dict[str, str] = {}
    live = dict(forms)
    with torch.no_grad():
        for name, form in list(live.items())[:: -1 if warm_reversed else 1]:
            try:
                form.warm()
            except Exception as exc:  # noqa: BLE001 - a form failing is a row of the table, not the end of the run
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                log(f"  {name} failed at run time: {failed[name]}")
                del live[name]
        prefill: dict[str, list[float]] = {n: [] for n in live}
        decode: dict[str, list[float]] = {n: [] for n in live}
        for r in range(repeats):
            started = time.perf_counter()
            for name, form in live.items():
                p, d = form.sample(steps, threads)
                prefill[name].append(p)
                decode[name].append(d)
            log(f"  threads={threads} repeat {r + 1}/{repeats}")
            took = time.perf_counter() - started
            if deadline is not None and r + 1 >= MIN_REPEATS and time.perf_counter() + took > deadline:
                log(f"  threads={threads}: {r + 1} repeats fit the time budget")
                break
    out = {
        name: {
            "prefill_ms": round(statistics.median(prefill[name]), 2),
            "decode_ms": round(statistics.median(decode[name]), 3),
            "decode_samples_ms": [round(s, 3) for s in decode[name]],
        }
        for name in live
    }
    return out, failed


# ---- precast bench --llm -------------------------------------------------------------------------------------
# the forms `precast bench --llm` compares by default: the eager references, the hand-cast compiled forms (the
# fastest hand-cast one, max-autotune included, is the speed reference), precast through precast.compile with no
# options and with Inductor's defaults, and precast on OpenVINO (OpenVINO's own export, the anchor, is the source
# checkout's: its harness registers the anchor forms, and the tables then rate each row against it too)
FORMS = (
    "eager_fp32",
    "eager_bf16",
    "aoti_bf16",
    "aoti_bf16_frozen",
    "aoti_bf16_autotune",
    "precast_torch",
    "precast_torch_default",
    "precast_openvino",
)
BUDGET_S = 300.0  # the default run's time budget: builds, memory, then as many repeats as fit (at least 2)
MAX_REPEATS = 10  # the most repeats a budgeted run takes


def measure(
    variants: dict[str, Any],
    shape: Shape,
    threads: int,
    repeats: int,
    steps: int,
    log: Callable[[str], None],
    deadline: float | None = None,
    warm_reversed: bool = False,
) -> dict[str, dict[str, Any]]:
    """Interleaved (``interleaved``): every repeat samples each form's prefill and ``steps`` decode steps once,
    in turn; the anchor's process takes its turn in the same loop; medians. A form failing at run time gets
    its error."""
    forms: dict[str, Any] = {}
    for name, v in variants.items():
        if v.anchors is not None:
            forms[name] = v.anchors[threads]
        elif v.run is not None:
            forms[name] = InProcess(v.run, shape)
    out, failed = interleaved(forms, threads, repeats, steps, log, deadline, warm_reversed)
    for name, why in failed.items():
        variants[name].error, variants[name].run, variants[name].anchors = why, None, None
    return out


def ratios(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row's speed (tokens/s) as a ratio to the fastest hand-cast bf16 form's (named) and to the anchor's,
    at one thread count (``table``: form -> its medians); absent where the reference did not run."""
    hand = [(table[n]["decode_ms"], n) for n in decode_forms.BF16_HAND_FORMS if n in table]
    fastest = min(hand) if hand else None
    anchor = table.get(decode_forms.ANCHOR)
    out: dict[str, dict[str, Any]] = {}
    for name, r in table.items():
        row: dict[str, Any] = {}
        if fastest:
            row["vs_fastest_hand_cast"] = {"form": fastest[1], "ratio": round(fastest[0] / r["decode_ms"], 3)}
        if anchor:
            row["vs_anchor"] = round(anchor["decode_ms"] / r["decode_ms"], 3)
        out[name] = row
    return out


def run_decode_bench(
    shape: Shape,
    threads: list[int],
    repeats: int | None,
    steps: int,
    forms: tuple[str, ...] = FORMS,
    cache_dir: str | None = None,
    anchor: str | None = None,
    log: Callable[[str], None] = lambda m: None,
    work: Path | None = None,
    memory: bool = True,
    budget_s: float = BUDGET_S,
    warm_reversed: bool = False,
) -> dict[str, Any]:
    """The decode forms ``precast bench --llm`` compares: built (compiled packages reused from ``work``), their
    resident memory in fresh processes, then measured interleaved at each thread count; ``repeats`` None: as
    many (``MIN_REPEATS`` .. ``MAX_REPEATS``) as fit the time left of ``budget_s``; ``warm_reversed``: the forms'
    first calls in reverse order (see ``interleaved``). A JSON-able payload."""
    from precast.bench.decode.rss import fresh_rss_mb
    from precast.bench.measure import machine_info

    started, load_start = time.perf_counter(), load_average()
    work = work or Path(tempfile.gettempdir()) / "precast-llm-decode"
    work.mkdir(parents=True, exist_ok=True)
    variants, _ = decode_forms.build_variants(forms, shape, work, cache_dir, log, tuple(threads), anchor)
    rss = fresh_rss_mb(variants, shape, log) if memory else {n: v.rss_mb for n, v in variants.items()}
    runs: dict[int, dict[str, Any]] = {}
    bandwidth: dict[int, float] = {}
    for i, t in enumerate(threads):
        bandwidth[t] = round(bandwidth_gbs(t), 2)
        left = started + budget_s - time.perf_counter()
        deadline = None if repeats else time.perf_counter() + max(left, 0) / (len(threads) - i)
        runs[t] = measure(variants, shape, t, repeats or MAX_REPEATS, steps, log, deadline, warm_reversed)
    for v in variants.values():
        for proc in (v.anchors or {}).values():
            proc.close()
    return {
        "machine": machine_info(),
        "load_start": load_start,
        "load_end": load_average(),
        "shape": dataclasses.asdict(shape),
        "repeats": repeats or f"as many as fit {budget_s:.0f} s (at most {MAX_REPEATS})",
        "steps": steps,
        # the forms that took a first call (a form whose build failed never did), in the order they took it
        "first_calls": [n for n in variants if any(n in r for r in runs.values())][
            :: -1 if warm_reversed else 1
        ],
        "seconds": round(time.perf_counter() - started, 1),
        "bandwidth_gbs": bandwidth,
        "forms": {n: _form_row(v, rss.get(n)) for n, v in variants.items()},
        "runs": runs,
        "ratios": {t: ratios(table) for t, table in runs.items()},
        "errors": {n: v.error for n, v in variants.items() if v.error},
    }


def _form_row(v: Any, rss_mb: float | None) -> dict[str, Any]:
    return {
        "rss_mb": rss_mb,
        "stored_bytes": v.stored_bytes,
        "read_bytes": v.read_bytes,
        "compile_s": None if v.compile_s is None else round(v.compile_s, 1),
        "reloadable": v.reloadable,
        "note": v.note,
    }


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def decode_markdown(payload: dict[str, Any]) -> str:
    """The payload of ``run_decode_bench`` as a markdown table: one row per thread count and form, with its
    speed against the fastest hand-cast form and against the anchor, and its resident memory (and against the
    anchor's)."""
    m = payload["machine"]
    anchor_mb = payload["forms"].get(decode_forms.ANCHOR, {}).get("rss_mb")
    lines = [
        "# LLM decode (precast bench --llm)",
        "",
        f"CPU: {m.get('cpu')} (torch capability {m.get('cpu_capability')}), torch {m.get('torch')}. Load average "
        f"(1, 5, 15 min) {payload['load_start']} before, {payload['load_end']} after. Shape {payload['shape']}; "
        f"median of {payload['repeats']} interleaved repeats of {payload['steps']} decode steps; "
        f"{payload.get('seconds', '-')} s in all.",
        "",
        "| threads | form | prefill ms | decode ms/token | tokens/s | x fastest hand-cast | x anchor | resident MiB "
        "(fresh process) | memory x anchor | read/token MB | share of bandwidth | compile/export s | load_weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, table in payload["runs"].items():
        bw = payload["bandwidth_gbs"][t]
        rat = payload["ratios"][t]
        for name, r in table.items():
            f = payload["forms"].get(name, {})
            gbs = f.get("read_bytes", 0) / (r["decode_ms"] / 1e3) / 1e9
            hand = rat[name].get("vs_fastest_hand_cast")
            vs_hand = f"{hand['ratio']} ({hand['form']})" if hand else "-"
            mb = f.get("rss_mb")
            lines.append(
                f"| {t} | {name} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {1e3 / r['decode_ms']:.1f} | "
                f"{vs_hand} | {_cell(rat[name].get('vs_anchor'))} | "
                f"{_cell(mb)} | {_cell(round(mb / anchor_mb, 3) if mb and anchor_mb else None)} | "
                f"{f.get('read_bytes', 0) / 1e6:.0f} | {gbs / bw:.0%} of {bw} GB/s | {_cell(f.get('compile_s'))} | "
                f"{f.get('reloadable') or '-'} |"
            )
    notes = [(n, f["note"]) for n, f in payload["forms"].items() if f.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- `{n}`: {e}" for n, e in notes]
    if payload["errors"]:
        lines += ["", "Forms that did not run:", ""] + [f"- `{n}`: {e}" for n, e in payload["errors"].items()]
    return "\n".join(lines) + "\n"
