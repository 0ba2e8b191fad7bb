"""Where precast -> OpenVINO's decode step spends its time next to OpenVINO's own export (issue 34).

Compiles precast's converted program (``precast.compile(backend="openvino", precision_hint="bf16")``) and the
anchor's IR (optimum-intel's export, ``<model_dir>-ov/openvino_model.xml`` as ``benchmarks/llm_decode.py`` leaves
it) in this process with ``PERF_COUNT``, at ``--threads`` (default 1), the bf16 hint and a bf16 KV cache; with
``--hint default``, precast's default call against the IR under OpenVINO's own defaults (what the decode benchmark
runs, both in one process here). Prefills the seeded prompt, then times ``steps`` decode steps of each,
alternating ``repeats`` times (medians, load average printed), and prints each model's last decode step by
OpenVINO layer type and implementation (``profiling_info``), the runtime graph's attention ops and its executed
conversion layers between floating types (``conversions``). Each sample is
timed twice: wall clock, and the process's CPU time (``time.process_time``, all threads): at one thread on a
shared machine the CPU time leaves out the time other processes held the core, so its ratio stays readable where
the wall clock's does not (a decode step that waits on memory still counts as CPU time).

    PYTHONPATH=. python benchmarks/ov_decode_profile.py PROGRAM.pt2 ANCHOR_IR_DIR [--steps 16] [--repeats 3]
        [--threads N] [--hint bf16|default]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import openvino as ov
import torch

import precast
import precast.backends.openvino.model as ov_backend


def _perf_compile(core: Any, *args: Any) -> Any:
    """precast's own compile (``openvino._compile``), with OpenVINO's per-layer counters switched on."""
    core.set_property("CPU", {"PERF_COUNT": "YES"})
    return _COMPILE(core, *args)


_COMPILE = ov_backend._compile


def by_layer_type(request: Any) -> dict[tuple[str, str], tuple[float, int]]:
    """The last inference's executed layers: (layer type, implementation) -> (ms, count)."""
    out: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for p in request.profiling_info:
        if p.status == p.Status.EXECUTED:
            out[(p.node_type, p.exec_type)][0] += p.real_time.total_seconds() * 1e3
            out[(p.node_type, p.exec_type)][1] += 1
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def attention_ops(compiled: Any, limit: int = 8) -> list[str]:
    """The runtime graph's ops of layer 0's attention and cache (type, implementation, input shapes)."""
    lines = []
    wanted = ("ScaledDotProductAttention", "ScatterElementsUpdate", "Broadcast", "Subgraph", "Transpose")
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = str(info["layerType"].astype(str))
        if kind.startswith(wanted) and "[" in str(op.output(0).get_partial_shape()):
            shapes = [str(op.input(i).get_partial_shape()) for i in range(min(op.get_input_size(), 4))]
            lines.append(
                f"{kind} {info['primitiveType'].astype(str)} {shapes} -> {op.output(0).get_partial_shape()}"
            )
        if len(lines) >= limit:
            break
    return lines


def conversions(compiled: Any) -> collections.Counter:
    """The runtime graph's executed conversion layers between floating types, by (layer type, from, to, the layer
    type it feeds): what the plan's dtypes cost beyond OpenVINO's own export (issue 49: the fp32 residual stream's
    casts were 65 of the 66 layers precast's decode step ran more than the export's)."""
    found: collections.Counter = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        source = op.input_value(0).get_node() if op.get_input_size() else None
        if kind not in ("Reorder", "Convert") or source is None:
            continue
        if source.get_rt_info()["layerType"].astype(str) == "Const":
            continue  # computed once, when the model compiles
        types = (op.get_input_element_type(0).get_type_name(), op.get_output_element_type(0).get_type_name())
        if set(types) <= {"f32", "bf16", "f16"} and types[0] != types[1]:
            readers = sorted(
                {
                    t.get_node().get_rt_info()["layerType"].astype(str)
                    for t in op.output(0).get_target_inputs()
                }
            )
            found[(kind, *types, "/".join(readers))] += 1
    return found


def per_step(started: float, cpu: float, steps: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per step since ``started`` / ``cpu``."""
    return (time.perf_counter() - started) * 1e3 / steps, (time.process_time() - cpu) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program")
    parser.add_argument("anchor_dir")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=1, help="OpenVINO's INFERENCE_NUM_THREADS for both")
    parser.add_argument(
        "--hint",
        choices=("bf16", "default"),
        default="bf16",
        help="bf16: both compiled with the bf16 hint and a bf16 KV cache; default: precast's default call "
        "(precast.compile(program, backend='openvino', threads=N)) against the IR with OpenVINO's own defaults "
        "(what OVModelForCausalLM and the decode benchmark run)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx, steps = args.context, args.steps
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, ctx), generator=g)
    tokens = [torch.randint(0, args.vocab, (1, 1), generator=g) for _ in range(steps)]

    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": str(args.threads)}
    if args.hint == "bf16":
        config.update({"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"})
    anchor = core.compile_model(
        core.read_model(os.path.join(args.anchor_dir, "openvino_model.xml")),
        "CPU",
        {**config, "PERF_COUNT": "YES"},
    )
    anchor_request = anchor.create_infer_request()
    ov_backend._compile = _perf_compile  # this benchmark only: the same compile, with per-layer counters
    hint = {"precision_hint": "bf16"} if args.hint == "bf16" else {}
    ours = precast.compile(torch.export.load(args.program), backend="openvino", threads=args.threads, **hint)

    def run_anchor() -> tuple[float, float]:
        anchor_request.reset_state()
        beam = np.zeros(1, np.int32)
        anchor_request.infer(
            {
                "input_ids": prompt.numpy(),
                "attention_mask": np.ones((1, ctx), np.int64),
                "position_ids": np.arange(ctx)[None],
                "beam_idx": beam,
            }
        )
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            anchor_request.infer(
                {
                    "input_ids": tokens[i].numpy(),
                    "attention_mask": np.ones((1, ctx + i + 1), np.int64),
                    "position_ids": np.array([[ctx + i]]),
                    "beam_idx": beam,
                }
            )
        return per_step(started, cpu, steps)

    def run_ours() -> tuple[float, float]:
        ours.reset()
        ours(input_ids=prompt, cache_position=torch.arange(ctx))
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            ours(input_ids=tokens[i], cache_position=torch.tensor([ctx + i]))
        return per_step(started, cpu, steps)

    forms: dict[str, Callable[[], tuple[float, float]]] = {
        "openvino_anchor": run_anchor,
        "precast_openvino": run_ours,
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}
    for r in range(args.repeats):
        for name, run in forms.items():
            samples[name].append(run())
        print(
            f"repeat {r}: "
            + ", ".join(f"{n} {s[-1][0]:.2f} ms (cpu {s[-1][1]:.2f})" for n, s in samples.items())
            + f"; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    for i, clock in enumerate(("wall", "cpu")):
        med = {n: statistics.median(x[i] for x in s) for n, s in samples.items()}
        print(
            f"median ms/token, {clock} ({args.threads} thread(s)): {med}; precast/anchor tokens/s "
            f"{med['openvino_anchor'] / med['precast_openvino']:.3f}"
        )
    for name, request, compiled in (
        ("openvino_anchor", anchor_request, anchor),
        ("precast_openvino", ours._request, ours.compiled),
    ):
        table = by_layer_type(request)
        total = sum(t for t, _ in table.values())
        print(
            f"== {name}: last decode step, {sum(n for _, n in table.values())} layers executed, "
            f"profiled total {total:.2f}"
        )
        for (kind, impl), (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:12]:
            print(f"  {kind:38s} {impl:22s} n={n:4d} {t:8.3f} ({100 * t / total:4.1f}%)")
        for line in attention_ops(compiled):
            print("  runtime:", line)
        for (kind, src, dst, readers), n in sorted(conversions(compiled).items()):
            print(f"  conversion: {kind} {src} -> {dst} into {readers}: {n}")


if __name__ == "__main__":
    main()
