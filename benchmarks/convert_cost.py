"""Conversion cost per node: wall time and peak Python memory of every stage of ``precast.convert``.

    .venv/bin/python -m benchmarks.convert_cost                      # chain N=250..8000 + real models
    .venv/bin/python -m benchmarks.convert_cost --sizes 250 1000 --models gpt2 --no-memory
    .venv/bin/python -m benchmarks.convert_cost --sizes 4000 --models --profile torch
    .venv/bin/python -m benchmarks.convert_cost --llama 0.2b 1.1b --out docs/benchmarks   # s/GB, peak RSS

The same measurement as ``precast bench --convert`` (``precast.bench.run_convert_bench``): the real
``precast.convert`` observed stage by stage through ``precast.passes.runner.observe`` (see
``precast/bench/convert/cost.py``), on a synthetic chain of N ops in one bf16 region and on the small-config
transformers / timm models of ``precast.bench.convert.models`` (skipped when the library is missing), for policy
None and "torch". Results are printed as each row finishes and written to ``--out``
(convert_cost.json / convert_cost.md). ``--profile POLICY`` adds a cProfile of ``precast.convert`` on the chain
at the largest N. Target (issue 15): <= 1 ms per node for all stages together, verification excluded, linear
in N. Timings on a shared machine are noisy: compare rows measured in the same run.

``--llama SIZE ...`` measures instead the cost per GB of weights (issue 29 item 3; ``precast.bench.convert.gb``):
a Llama-shaped transformers model with random weights at 0.2 B or 1.1 B parameters, exported (plain forward,
1 x 16 tokens), converted with policy None, "torch" and "rules" (``--policies``) and default options, one fresh
process per (size, policy): wall and CPU seconds per GB, peak RSS above the input weights over their bytes, and
both per stage. Targets (printed, never asserted): rules <= 4 s/GB and peak extra <= 0.6x at every size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from precast import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", type=int, default=list(bench.CHAIN_SIZES), metavar="N")
    p.add_argument("--models", nargs="*", default=list(bench.real_models()), metavar="NAME")
    p.add_argument("--policies", nargs="+", default=None, choices=["none", "torch", "rules"])
    p.add_argument("--llama", nargs="+", default=None, metavar="SIZE", help="s/GB of a Llama: 0.2b 1.1b")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    p.add_argument("--no-verify", action="store_true", help="skip timing verification")
    p.add_argument(
        "--no-end-to-end",
        action="store_true",
        help="no effect (kept for old commands): convert() is timed whole in the observed run itself",
    )
    p.add_argument("--static", action="store_true", help="export the chain with static shapes")
    p.add_argument("--profile", choices=["none", "torch"], default=None, help="cProfile at the largest N")
    p.add_argument("--out", default="convert_cost_out", metavar="DIR")
    args = p.parse_args(argv)
    if args.llama:
        from precast.bench.convert import gb_markdown, run_gb_bench, write_gb_outputs

        policies = tuple(None if x == "none" else x for x in (args.policies or ["none", "torch", "rules"]))
        rows = run_gb_bench(tuple(args.llama), policies)
        print(gb_markdown(rows, bench.machine_info()))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for path in write_gb_outputs(rows, args.out, bench.machine_info()):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    policies = tuple(None if x == "none" else x for x in (args.policies or ["none", "torch"]))
    console = Console(width=None if Console().is_terminal else 250)
    results: list[bench.ConvertCost] = []
    jobs = [((n,), ()) for n in args.sizes] + [((), (m,)) for m in args.models]
    for sizes, models in jobs:
        done = len(results)
        results += bench.run_convert_bench(
            sizes,
            models,
            policies,
            memory=not args.no_memory,
            verify=not args.no_verify,
            dynamic=not args.static,
            progress=False,
        )
        for row in bench.convert_cost_rows(results)[1][done:]:
            print("| " + " | ".join(row) + " |", file=sys.stderr, flush=True)
        bench.write_convert_outputs(results, args.out, bench.machine_info())
    for table in bench.convert_cost_rich(results):
        console.print(table)
    for key, ratio in bench.linearity(results).items():
        print(f"linearity {key}: {ratio}")
    if args.profile and args.sizes:
        policy = None if args.profile == "none" else args.profile
        ep = bench.chain_program(max(args.sizes), dynamic=not args.static)
        text = bench.profile_convert(ep, policy)
        Path(args.out, "profile.txt").write_text(text)
        print(text)
    print(f"wrote {args.out}/convert_cost.json, convert_cost.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
