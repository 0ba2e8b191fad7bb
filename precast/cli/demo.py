"""``precast demo``: the forum question's model (shared/seeds/000, ``precast.examples``), converted and
compared before/after.

Input: ``--repeats`` (timed forwards per variant). Output: printed steps (the model as posted stopped at
conversion, the corrected one converted, bitwise comparison, weight casts per forward, latency); exit status 0
when the converted program's outputs equal the original's bitwise.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from precast.cli.flags import add_command, flag
from precast.errors import PrecastError


def add_parser(sub: Any) -> None:
    """``precast demo``: ``--repeats``, run by ``run``."""
    add_command(
        sub,
        "demo",
        (flag("--repeats", type=int, default=200, help="timed forwards per variant"),),
        run=run,
        help="convert the built-in example (the seed's model) and compare before/after",
    )


def _weight_casts(ep: torch.export.ExportedProgram) -> int:
    """Casts whose input is a parameter/buffer in the decomposed graph: work done on every forward."""
    ep = ep.run_decompositions()
    consts = {
        s.arg.name
        for s in ep.graph_signature.input_specs
        if s.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
    }
    return sum(
        1
        for n in ep.graph.nodes
        if n.op == "call_function"
        and n.target is torch.ops.aten._to_copy.default
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].name in consts
    )


def _median_ms(fn, x, repeats: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(10):
            fn(x)
        for _ in range(repeats):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def run(args: argparse.Namespace) -> int:
    import precast
    from precast import examples

    print("1. The model as posted: `output` receives bf16 activations with fp32 weights.")
    broken, inputs = examples.SeedModel(fixed=False).eval(), (torch.randn(4, 128),)
    try:
        precast.convert(broken, inputs)
        print("   (converted: unexpected)")
    except PrecastError as err:
        print(f"   precast stops at conversion, before anything runs:\n   {err}")

    print("\n2. Corrected (x.float() after the region), exported, converted:")
    model, inputs = examples.seed_model()
    ep = torch.export.export(model, inputs)
    res = precast.convert(ep)
    for line in res.report.summary().splitlines():
        print(f"   {line}")

    before, after = ep.module(), res.program.module()
    x = inputs[0]
    with torch.no_grad():
        same = torch.equal(before(x), after(x))
    print("\n3. Before vs after:")
    print(f"   outputs bitwise equal: {same}")
    print(
        f"   weight casts per forward (decomposed graph): {_weight_casts(ep)} -> {_weight_casts(res.program)}"
    )
    t0, t1 = _median_ms(before, x, args.repeats), _median_ms(after, x, args.repeats)
    from precast.numerics.latency import native_note

    note = native_note("cpu", torch.bfloat16) or "CPU"
    print(f"   eager ep.module() median latency: {t0:.3f} ms -> {t1:.3f} ms ({note})")
    print("\nNext: `precast convert model.pt2 -o fast.pt2`, then compile fast.pt2 with AOTInductor.")
    return 0 if same else 1
