"""precast bench [--model NAME ...] [--batch N ...] [--dtype bf16|fp16] [--device cpu|cuda] [--repeats N] [--out DIR]
precast bench --convert [--model chain NAME ...] [--sizes N ...] [--policy none torch] [--no-memory] [--out DIR]"""

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
        default=None,
        metavar="NAME",
        help="seed, mlp, cnn, encoder (minilm when available); default: mlp. With --convert: chain (the "
        "synthetic chain at --sizes) and real architectures gpt2, llama, bert, convnext_atto, efficientvit_m0, "
        "fastvit_t8 (skipped when transformers/timm is missing); default: all",
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
    conv = p.add_argument_group("conversion cost (--convert)")
    conv.add_argument(
        "--convert",
        action="store_true",
        help="measure the conversion itself instead: ms and peak Python memory per node of every stage of "
        "precast.convert (from an exported program), verification timed apart",
    )
    conv.add_argument(
        "--sizes", nargs="+", type=int, default=None, metavar="N", help="chain sizes (default 250 ... 8000)"
    )
    conv.add_argument("--policy", nargs="+", choices=["none", "torch"], default=["none", "torch"])
    conv.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run (halves the time)")
    conv.add_argument("--no-verify", action="store_true", help="skip timing verification")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from precast import bench
    from precast.errors import PrecastError
    from precast.io import check_writable

    if args.convert:
        return run_convert(args)
    args.model = args.model or ["mlp"]
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


def run_convert(args: argparse.Namespace) -> int:
    from rich.console import Console

    from precast import bench
    from precast.errors import PrecastError
    from precast.io import check_writable

    models = args.model or ["chain", *bench.CONVERT_MODELS]
    sizes = tuple(args.sizes or bench.CHAIN_SIZES) if "chain" in models else ()
    if any(n < 1 for n in sizes):
        raise PrecastError(f"bench --convert: --sizes {list(sizes)}; chain sizes must be at least 1")
    if args.out:
        from pathlib import Path

        Path(args.out).mkdir(parents=True, exist_ok=True)
        check_writable(Path(args.out) / "convert_cost.json")
    results = bench.run_convert_bench(
        sizes,
        tuple(m for m in models if m != "chain"),
        tuple(None if p == "none" else p for p in args.policy),
        memory=not args.no_memory,
        verify=not args.no_verify,
    )
    console = Console()
    wide = Console(width=None if console.is_terminal else 250)
    for table in bench.convert_cost_rich(results):
        wide.print(table)
    for key, ratio in bench.linearity(results).items():
        print(f"linearity (ms/node, {key}): {ratio}")
    if args.out:
        for path in bench.write_convert_outputs(results, args.out, bench.machine_info()):
            print(f"wrote {path}", file=sys.stderr)
    return 0
