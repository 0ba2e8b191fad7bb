"""precast bench [--model NAME ...] [--batch N ...] [--dtype bf16|fp16] [--device cpu|cuda] [--repeats N] [--out DIR]"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="compare eager, AOTInductor variants and precast + AOTInductor on the built-in models",
        description="Latency (median of interleaved repeats), package size, resident memory after load (fresh "
        "process), error vs fp32 and run-time casts per forward, for eager fp32, eager autocast, AOTI default, "
        "AOTI freezing, AOTI run-time constant folding and precast + AOTI.",
    )
    p.add_argument(
        "--model",
        nargs="+",
        default=["mlp"],
        metavar="NAME",
        help="seed, mlp, cnn, encoder (minilm when available); default: mlp",
    )
    p.add_argument("--batch", nargs="+", type=int, default=[1], metavar="N", help="default: 1")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=20, metavar="N", help="interleaved repeats (default 20)")
    p.add_argument(
        "--variant", nargs="+", default=None, metavar="V", help="subset of variants (default: all)"
    )
    p.add_argument("--out", default=None, metavar="DIR", help="write bench.json, bench.md, bench.png here")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="AOTInductor package cache (default: $PRECAST_CACHE_DIR or the user cache dir)",
    )
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory measurement")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from precast import bench
    from precast.errors import PrecastError
    from precast.io import check_writable

    if args.repeats < 1:
        raise PrecastError(f"bench: --repeats {args.repeats}; give at least 1")
    if any(b < 1 for b in args.batch):
        raise PrecastError(f"bench: --batch {args.batch}; batch sizes must be at least 1")
    variants = tuple(args.variant or bench.VARIANTS)
    bad = [v for v in variants if v not in bench.VARIANTS]
    if bad:
        raise PrecastError(f"bench: unknown variant(s) {bad}; choose from {', '.join(bench.VARIANTS)}")
    if args.out:
        from pathlib import Path

        Path(args.out).mkdir(parents=True, exist_ok=True)
        check_writable(Path(args.out) / "bench.json")
    results = bench.run_bench(
        args.model,
        args.batch,
        dtype=args.dtype,
        device=args.device,
        repeats=args.repeats,
        variants=variants,
        cache_dir=args.cache_dir,
        measure_rss=not args.no_rss,
    )
    # off a terminal rich assumes 80 columns and folds every cell: give files and pipes a wide table
    console = Console()
    Console(width=None if console.is_terminal else 170).print(bench.to_rich_table(results))
    if args.out:
        for path in bench.write_outputs(results, args.out, bench.machine_info(args.device)):
            print(f"wrote {path}", file=sys.stderr)
    return 0
