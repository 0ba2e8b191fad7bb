"""LLM decode on a CPU, measured: the harness of ``precast bench --llm`` (and of the source checkout's decode script).

- The model (``decode_model.py``): ``Shape``, ``llama``, ``wrapped``, ``export_decoder``, ``decode_inputs``,
  ``read_bytes``. The anchor (``decode_anchor.py``): OpenVINO's own export in its own environment.
- ``InProcess``: one form run in this process, sampled as (prefill ms, ms per decoded token); ``AnchorProcess``
  (``decode_anchor.py``) samples the anchor the same way.
- ``interleaved``: every repeat samples each form once, in turn: load on the machine hits all alike.
- ``bandwidth_gbs``, ``load_average``: the machine's memory read rate, the load before and after.
- ``run_decode_bench``: the forms ``precast bench --llm`` compares (eager fp32, eager hand-cast bf16, precast
  through ``precast.compile`` with no options and with ``mode="default"``, precast on OpenVINO, the anchor);
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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from precast.bench import decode_anchor
from precast.bench.decode_model import Shape, decode_inputs, export_decoder, llama, read_bytes, wrapped


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
    forms: dict[str, Any], threads: int, repeats: int, steps: int, log: Callable[[str], None]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every repeat samples each form once, in turn (``forms``: name -> an object with ``warm()`` and
    ``sample(steps, threads)``); medians per form, and the forms that failed with why."""
    torch.set_num_threads(threads)
    failed: dict[str, str] = {}
    live = dict(forms)
    with torch.no_grad():
        for name, form in list(live.items()):
            try:
                form.warm()
            except Exception as exc:  # noqa: BLE001 - a form failing is a row of the table, not the end of the run
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                log(f"  {name} failed at run time: {failed[name]}")
                del live[name]
        prefill: dict[str, list[float]] = {n: [] for n in live}
        decode: dict[str, list[float]] = {n: [] for n in live}
        for r in range(repeats):
            for name, form in live.items():
                p, d = form.sample(steps, threads)
                prefill[name].append(p)
                decode[name].append(d)
            log(f"  threads={threads} repeat {r + 1}/{repeats}")
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
FORMS = ("eager_fp32", "eager_bf16", "precast", "precast_default", "precast_openvino", "openvino_anchor")


def run_decode_bench(
    shape: Shape,
    threads: list[int],
    repeats: int,
    steps: int,
    forms: tuple[str, ...] = FORMS,
    cache_dir: str | None = None,
    anchor: str | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    """The decode forms ``precast bench --llm`` compares, measured interleaved at each thread count; a JSON-able
    payload (rows per thread count, errors, machine, load before / after, bandwidth)."""
    import precast
    from precast.bench.measure import machine_info

    load_start = load_average()
    fp32 = llama(shape)
    built: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    ep = export_decoder(fp32, shape) if any(f.startswith("precast") for f in forms) else None
    res = None
    if ep is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = precast.convert(ep, policy="torch", dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    for name in forms:
        started = time.perf_counter()
        try:
            if name == "eager_fp32":
                m = wrapped(fp32, shape).model
                built[name] = m
                info[name] = {"state": {**dict(m.named_parameters()), **dict(m.named_buffers())}}
            elif name == "eager_bf16":
                m = wrapped(llama(shape, torch.bfloat16), shape).model
                built[name] = m
                info[name] = {"state": {**dict(m.named_parameters()), **dict(m.named_buffers())}}
            elif name in ("precast", "precast_default"):
                assert res is not None
                kw = {} if name == "precast" else {"mode": "default"}
                cm = precast.compile(res.program, cache_dir=cache_dir, dynamic=False, progress=False, **kw)
                built[name] = cm
                info[name] = {"state": {**res.program.state_dict, **res.program.constants}, "form": cm.form}
            elif name == "precast_openvino":
                assert res is not None
                models = {
                    t: precast.compile(res.program, backend="openvino", precision_hint="bf16", threads=t)
                    for t in threads
                }
                built[name] = models
                info[name] = {"state": {**res.program.state_dict, **res.program.constants}}
            elif name == "openvino_anchor":
                python = decode_anchor.anchor_python(anchor)
                if python is None:
                    raise RuntimeError(
                        f"no anchor environment ({decode_anchor.ANCHOR_ENV}; build it with precast bench --llm "
                        "--build-anchor-env, or give --anchor-python)"
                    )
                folder = decode_anchor.save_for_anchor(
                    fp32, Path(tempfile.gettempdir()) / f"precast-anchor-{shape.tag()}"
                )
                built[name] = {t: decode_anchor.AnchorProcess(python, folder, shape, t) for t in threads}
                bf16 = llama(shape, torch.bfloat16)
                state = {**dict(bf16.named_parameters())}
                state.update(
                    {
                        f"cache.{i}.keys": torch.empty(
                            1, shape.kv_heads, shape.cache_len, shape.head_dim, dtype=torch.bfloat16
                        )
                        for i in range(2 * shape.layers)
                    }
                )
                first = built[name][threads[0]].info
                info[name] = {
                    "state": state,
                    "export_s": first.get("export_s"),
                    "rss_mb": first.get("rss_mb"),
                    "versions": first.get("versions"),
                }
            info.setdefault(name, {})["compile_s"] = round(time.perf_counter() - started, 1)
        except Exception as exc:  # noqa: BLE001 - a form failing is a row, not the end of the run
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            log(f"  {name} failed: {errors[name]}")
    runs: dict[int, dict[str, Any]] = {}
    bandwidth: dict[int, float] = {}
    for t in threads:
        bandwidth[t] = round(bandwidth_gbs(t), 2)
        forms_t: dict[str, Any] = {}
        for name, obj in built.items():
            if name == "openvino_anchor":
                forms_t[name] = obj[t]
            elif name == "precast_openvino":
                forms_t[name] = InProcess(obj[t], shape)
            else:
                forms_t[name] = InProcess(obj, shape)
        runs[t], failed = interleaved(forms_t, t, repeats, steps, log)
        errors.update(failed)
    for obj in built.get("openvino_anchor", {}).values():
        obj.close()
    rows = {}
    for name, i in info.items():
        held, read = read_bytes(i.pop("state", {}))
        rows[name] = {**i, "stored_bytes": held, "read_bytes": read}
    return {
        "machine": machine_info(),
        "load_start": load_start,
        "load_end": load_average(),
        "shape": dataclasses.asdict(shape),
        "repeats": repeats,
        "steps": steps,
        "bandwidth_gbs": bandwidth,
        "forms": rows,
        "runs": runs,
        "errors": errors,
    }


def decode_markdown(payload: dict[str, Any]) -> str:
    """The payload of ``run_decode_bench`` as a markdown table (one row per thread count and form)."""
    m = payload["machine"]
    lines = [
        "# LLM decode (precast bench --llm)",
        "",
        f"CPU: {m.get('cpu')} (torch capability {m.get('cpu_capability')}), torch {m.get('torch')}. Load average "
        f"{payload['load_start']} before, {payload['load_end']} after. Shape {payload['shape']}; median of "
        f"{payload['repeats']} interleaved repeats of {payload['steps']} decode steps.",
        "",
        "| threads | form | prefill ms | decode ms/token | tokens/s | read/token MB | share of bandwidth | "
        "compile/export s | form chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, table in payload["runs"].items():
        bw = payload["bandwidth_gbs"][t]
        for name, r in table.items():
            f = payload["forms"].get(name, {})
            gbs = f.get("read_bytes", 0) / (r["decode_ms"] / 1e3) / 1e9
            chosen = f.get("form", {}).get("name", "") if isinstance(f.get("form"), dict) else ""
            lines.append(
                f"| {t} | {name} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {1e3 / r['decode_ms']:.1f} | "
                f"{f.get('read_bytes', 0) / 1e6:.0f} | {gbs / bw:.0%} of {bw} GB/s | "
                f"{f.get('export_s') or f.get('compile_s') or '-'} | {chosen} |"
            )
    if payload["errors"]:
        lines += ["", "Forms that did not run:", ""]
        lines += [f"- `{n}`: {e}" for n, e in payload["errors"].items()]
    return "\n".join(lines) + "\n"
