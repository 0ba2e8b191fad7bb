"""The tolerance search on all-MiniLM-L6-v2 (real weights, ``benchmarks.harness.minilm``): forwards, wall time and ops
kept in fp32 for ``policy="rules", tolerance={"cosine": 0.99996}`` on the first 8 sample sentences (one
calibration batch), as ``tests/realmodels/test_minilm.py`` runs it.

    .venv/bin/python -m benchmarks.tolerance_search [--dtype bfloat16|float16] [--before]

Before (the search as it was before the overrides/fast-search rework: a ``MixedInterpreter`` applying the
decisions op by op, each candidate ranked by one forward with it alone in low precision, then doubling and
bisection), measured before the change with this model, data and target on the same 2-core CPU machine, bf16,
by a script that wrapped ``MixedInterpreter.run`` and ``check_program`` in ``precast.numerics.tolerance.search`` /
``precast.numerics.tolerance.stage`` with call counters and ran ``run()``'s conversion under ``time``::

    forwards 49 (reference 1, all-low 1, every candidate in fp32 1, 37 rankings, 8 tries, check 1)
    convert 56.6 s wall (26 s CPU; the machine was shared), kept 15 of 37 candidates in fp32:
    layer_norm_2 to layer_norm_12 (11), add_7, add_8, add_9, add_11 -> cosine 0.999961

(On ``tests/realmodels/test_minilm.py``'s transformers BertModel: 52 forwards, 28.7 s, 18 of 38 kept, cosine 0.999966.)

``--before`` runs that old search again (kept here only, ``_old_search``: the interpreter and the ranking as
they were; its one change: the old ``RulesDecider.force`` / ``.fallback`` mutation is done by a wrapper around
a decider, since deciders no longer take it), so both can be timed on the machine as it is now.

After: printed by this script (see docs/benchmarks/tolerance_search.md). ``forwards`` counts every forward of
a program over the search's batches: the instrumented reference, the all-low program, each try, and the
check ``convert`` runs on the converted program (its gradient probes are backward passes of the reference
forward, not counted as forwards).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

import precast
from benchmarks.harness.minilm import SENTENCES, load_minilm, tokenize

TARGET = 0.99996


def run(dtype: torch.dtype = torch.bfloat16, target: float = TARGET) -> dict:
    model = load_minilm()
    ids, mask = tokenize(SENTENCES[:8])
    cal = [(ids, mask)]
    start = time.perf_counter()
    res = precast.convert(
        model,
        cal[0],
        policy=precast.RulesPolicy(dtype=dtype, calibration=cal, tolerance={"cosine": target}),
        verify=False,
    )
    wall = time.perf_counter() - start
    info = res.report.verification["tolerance"]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "forwards": info["forwards"],
        "search_seconds": info["seconds"],
        "convert_seconds": round(wall, 2),
        "kept": len(info["kept_fp32"]),
        "candidates": info["candidates"],
        "kept_fp32": info["kept_fp32"],
        "cosine": info["achieved"]["cosine"],
        "searched_cosine": info["searched"]["cosine"],
        "message": next(d.message for d in res.report.diagnostics if d.code == "tolerance"),
    }


# ---- the search before the rework, for --before only ----------------------------------------------------


class _Forced:
    """A rules decider with the old search's knobs: ``force`` (node -> dtype) and ``fallback`` (node -> score)
    replace a default low decision, and every decision is recorded in ``decided``."""

    name = "rules"

    def __init__(self, decider: Any):
        self.decider, self.force, self.fallback, self.decided = decider, {}, {}, {}

    def autocast_state(self, device_type: str) -> None:
        return None

    def decide(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        from precast.policy.base import Decision
        from precast.policy.rules.taxonomy import casts_for

        d = self.decider.decide(node, args, kwargs)
        if d is not None and d.rule == "default":
            dtype = self.force.get(node.name, torch.float32 if node.name in self.fallback else None)
            if dtype is not None:
                d = Decision(
                    dtype, "rules", "search", "accuracy search", casts=casts_for(node, args, kwargs, dtype)
                )
        if d is not None:
            self.decided[node.name] = d
        return d


def _old_search(program: Any, ep: Any, policy: Any, opts: Any, cal: Any, tol: Any, log: Any, **_: Any) -> Any:
    """The tolerance search as it was: a MixedInterpreter, one forward per candidate, doubling + bisection."""
    from precast.errors import PrecastError
    from precast.ir import diagnostics
    from precast.ir.graph import ASSERT_METADATA
    from precast.ir.inputs import placeholder_values, user_values
    from precast.ir.op_families import GEMM_OPS
    from precast.metrics import WorstError
    from precast.numerics.tolerance.stage import user_outputs
    from precast.policy.base import apply_decision
    from precast.policy.compose import decide
    from precast.policy.measurements import ToleranceResult
    from precast.policy.rules.taxonomy import op_name

    class MixedInterpreter(torch.fx.Interpreter):
        def __init__(self, gm: torch.fx.GraphModule, pol: Any):
            super().__init__(gm, garbage_collect_values=True)
            self.pol = pol

        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            if n.target is ASSERT_METADATA:
                return None
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            decision = decide(n, args, kwargs, self.pol, ())
            target, args, kwargs = apply_decision(n.target, args, kwargs, decision, lambda v, d: v.to(d))
            return target(*args, **kwargs)

    start = time.perf_counter()
    batches = cal.sample
    users = [user_values(program, ep, b, i) for i, b in enumerate(batches)]
    forwards = [0]

    def run(pol: Any, which: list | None = None) -> list:
        interp = MixedInterpreter(program.gm, pol)
        out = []
        with torch.no_grad():
            for i in which or range(len(users)):
                out.append(user_outputs(program, interp.run(*placeholder_values(program, users[i]))))
        forwards[0] += 1
        return out

    refs = run(None)
    pol = _Forced(policy.bind(program, opts, cal))

    def measure(which: list | None = None) -> dict:
        errs = WorstError()
        for got, want in zip(run(pol, which), [refs[i] for i in (which or range(len(refs)))], strict=True):
            errs.update(got, want)
        return errs.m

    base = measure()
    result = ToleranceResult(
        tol, all_low=base, refs=refs, achieved=base, ranked_by="one forward per candidate"
    )
    if not tol.met(base):
        nodes = {n.name: n for n in program.graph.nodes}
        all_low = [k for k, d in pol.decided.items() if d.rule == "default" and d.dtype == opts.low]
        candidates = [k for k in all_low if op_name(nodes[k].target) not in GEMM_OPS]
        result.candidates = len(candidates)
        pol.fallback = dict.fromkeys(candidates, 0.0)
        result.floor = measure()
        if not tol.met(result.floor):
            raise PrecastError(f"tolerance {tol.spec} cannot be met (old search)", code="tolerance-unmet")
        pol.fallback = {}
        score = {}
        for c in candidates:
            pol.force = {k: torch.float32 for k in all_low if k != c}
            score[c] = tol.score(measure([0]))
        pol.force = {}
        ranked = sorted(candidates, key=lambda c: -score[c])
        cache: dict[int, dict] = {len(ranked): result.floor}

        def errors_with(k: int) -> dict:
            if k not in cache:
                pol.fallback = {c: score[c] for c in ranked[:k]}
                cache[k] = measure()
                result.tries += 1
            return cache[k]

        lo, hi, n = 0, 1, len(ranked)
        while hi < n and not tol.met(errors_with(hi)):
            lo, hi = hi, hi * 2
        hi = min(hi, n)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tol.met(errors_with(mid)):
                hi = mid
            else:
                lo = mid
        result.kept = {c: score[c] for c in ranked[:hi]}
        result.achieved = errors_with(hi)
    result.forwards = forwards[0]
    result.seconds = time.perf_counter() - start
    diagnostics.record(log, "tolerance", result.summary())
    return result


@contextlib.contextmanager
def old_search() -> Iterator[None]:
    """Within the block, ``precast.convert`` runs the old tolerance search."""
    import precast.pipeline.prepare as prepare

    saved = prepare.tolerance_stage
    prepare.tolerance_stage = _old_search
    try:
        yield
    finally:
        prepare.tolerance_stage = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--before", action="store_true", help="run the search as it was before the rework")
    args = ap.parse_args()
    with old_search() if args.before else contextlib.nullcontext():
        r = run(getattr(torch, args.dtype), args.target)
    print(
        f"MiniLM tolerance search ({'before' if args.before else 'after'}), cosine >= {args.target}, {r['dtype']}:"
    )
    print(
        f"  forwards {r['forwards']} (incl. the check), search {r['search_seconds']:.1f} s, "
        f"convert {r['convert_seconds']:.1f} s"
    )
    print(f"  kept {r['kept']} of {r['candidates']} candidates in fp32: {', '.join(r['kept_fp32'])}")
    print(f"  cosine {r['cosine']:.7f} (the search measured {r['searched_cosine']:.7f})")
    print(f"  {r['message']}")


if __name__ == "__main__":
    main()
