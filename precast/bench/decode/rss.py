"""Resident memory of a decode form, measured as a user would see it: in a fresh process that builds or loads
the form and runs a prefill and one decode step (``python -m precast.bench.decode.rss SPEC``), the gain in RSS.

- ``rss_spec``: what the fresh process needs to rebuild a ``decode_forms.Variant``.
- ``fresh_rss_mb``: the measurement of every form, a few fresh processes at a time (memory, not time, is
  measured: running them side by side changes nothing but the wall clock).

Input: forms and a shape. Output: MiB per form (None where it could not be measured, with why on the log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _rss() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _load(spec: dict[str, Any]) -> Any:
    """The form the spec names, built or loaded in this process."""
    import precast
    from precast.bench.decode.model import Shape, llama, wrapped

    c = spec.get("compile")
    if c and c.get("backend") == "openvino":  # converted to OpenVINO and compiled in this fresh process
        return precast.compile(
            torch.export.load(c["program"]), backend="openvino", precision_hint="bf16", threads=1
        )
    if c:
        # the program is not kept: under max-autotune the model holds only the packed copies its code reads
        model = precast.compile(
            torch.export.load(c["program"]),
            cache_dir=c["cache_dir"],
            dynamic=False,
            mode=c["mode"],
            inductor_configs=c["inductor_configs"],
            threads=c.get("threads"),
        )
        if not model.from_cache:
            raise RuntimeError("the fresh process compiled: the cache key differs from the parent's")
        return model
    if spec["package"]:
        return torch._inductor.aoti_load_package(spec["package"])
    dtype = torch.bfloat16 if spec["name"] == "eager_bf16" else torch.float32
    shape = Shape(**spec["shape"])
    return wrapped(llama(shape, dtype), shape).model


def rss_child(spec: dict[str, Any]) -> None:
    """(In a fresh process.) Build or load one form, run the prompt and a decode step; print the RSS before and
    after as one JSON line."""
    import torch._inductor  # noqa: F401 - imported before the first reading, as the loader needs it
    import transformers  # noqa: F401

    from precast.bench.decode.model import Shape, decode_inputs

    shape = Shape(**spec["shape"])
    torch.set_num_threads(1)
    prompt, tokens = decode_inputs(shape)
    if (spec.get("compile") or {}).get("backend") == "openvino":
        # imported before the first reading, as the anchor's process imports openvino before its own
        import openvino  # noqa: F401
    before = _rss()
    model = _load(spec)
    with torch.no_grad():
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if spec["name"] == "eager_autocast" else None
        with ctx or contextlib.nullcontext():
            model(input_ids=prompt, cache_position=torch.arange(shape.context))
            model(input_ids=tokens[0], cache_position=torch.tensor([shape.context]))
    # what the process holds once Python's cycle collector has run: a dropped ExportedProgram is a reference
    # cycle (graph <-> module) that lingers until a full collection, which a decode loop seldom triggers
    gc.collect()
    print(json.dumps({"before": before, "after": _rss()}))


def rss_spec(v: Any, shape: Any) -> dict[str, Any]:
    """The fresh process's spec of a ``decode_forms.Variant``."""
    return {
        "name": v.name,
        "package": str(v.package) if v.package else None,
        "compile": v.compile_spec,
        "shape": dataclasses.asdict(shape),
    }


def fresh_rss_mb(
    variants: dict[str, Any], shape: Any, log: Callable[[str], None] = lambda m: None, jobs: int = 2
) -> dict[str, float | None]:
    """Resident memory (MiB) a fresh process gains building/loading each form that ran and running prefill + one
    step; ``jobs`` processes at a time. A form measured by its own process (the anchor) keeps its figure."""
    out: dict[str, float | None] = {n: v.rss_mb for n, v in variants.items()}
    todo = [
        n
        for n, v in variants.items()
        if v.rss_mb is None and v.run is not None and v.anchors is None and n != "openvino_anchor_inprocess"
    ]
    if not Path("/proc/self/status").exists():
        return out
    while todo:
        batch, todo = todo[:jobs], todo[jobs:]
        procs = {n: _start(rss_spec(variants[n], shape)) for n in batch}
        for name, proc in procs.items():
            out[name] = _finish(name, proc, log)
    return out


def _start(spec: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "precast.bench.decode.rss", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(name: str, proc: subprocess.Popen, log: Callable[[str], None]) -> float | None:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        log(f"  fresh-process memory of {name}: no answer in 600 s")
        return None
    if proc.returncode != 0:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        log(f"  fresh-process memory of {name} failed: {lines[-1] if lines else proc.returncode}")
        return None
    data = json.loads(stdout.strip().splitlines()[-1])
    return round(data["after"] - data["before"], 1)


if __name__ == "__main__":
    from precast.progress import quiet_libraries

    with quiet_libraries():
        rss_child(json.loads(sys.argv[1]))
