"""``precast bench``: the command line of ``precast.bench`` (options in, tables on stdout, files in ``--out``).

precast bench [--model NAME|module:factory ...] [--batch N ...] [--dtype bf16|fp16] [--device cpu|cuda]
              [--repeats N] [--variant V ...] [--out DIR]
precast bench --convert [--model chain NAME ...] [--sizes N ...] [--policy none torch] [--no-memory] [--out DIR]
precast bench --convert --llama 0.2b 1.1b [--policy none torch rules] [--out DIR]
precast bench --llm [--quick] [--threads 1 2] [--steps N] [--repeats N] [--no-rss] [--out DIR]

Input: argv. Output: tables on stdout, files in ``--out``, an exit status.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from precast.cli.flags import Group, add_command, flag

CONVERT = Group("conversion cost (--convert)")
LLM = Group("LLM decode (--llm)")

ARGUMENTS = (
    flag(
        "--model",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="package.module:factory (as precast convert takes; called with batch=N when it has a batch "
        "parameter), or a short name of precast.bench.models: "
        "seed, mlp, cnn, encoder. Default: mlp. "
        "eager_fp32 turns the model's autocast regions off through the modules' autocast/device_type/dtype "
        "attributes (see precast/bench/models.py); a model without them keeps its regions as written and gets "
        "its fp32 reference from its exported program with the regions inlined. With --convert: chain (the "
        "synthetic chain at --sizes) and the real architectures of precast.bench.convert.models (gpt2, llama, "
        "bert, convnext_atto, efficientvit_m0, fastvit_t8; skipped when transformers/timm is missing); "
        "default: all",
    ),
    flag("--batch", nargs="+", type=int, default=[1], metavar="N", help="default: 1"),
    flag("--dtype", choices=["bf16", "fp16"], default="bf16"),
    flag("--device", choices=["cpu", "cuda"], default="cpu"),
    flag(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help="interleaved repeats (default 20; with --llm: as many as fit its 5-minute budget, 2 to 10)",
    ),
    flag(
        "--variant",
        nargs="+",
        default=None,
        metavar="V",
        help="subset of: eager_fp32 eager_autocast aoti_default aoti_freezing aoti_runtime_folding precast_aoti "
        "aoti_fp32 auto_aoti ov_default ov_precast ort_fp32 ort_precast, and precast_<engine> for each other engine "
        "of precast.backends.registry: precast_executorch (default: all)",
    ),
    flag("--out", default=None, metavar="DIR", help="write bench.json, bench.md, bench.png here"),
    flag(
        "--cache-dir",
        default=None,
        help="AOTInductor package cache (default: $PRECAST_CACHE_DIR or the user cache dir)",
    ),
    flag("--no-rss", action="store_true", help="skip the fresh-process memory measurement"),
    flag(
        "--convert",
        group=CONVERT,
        action="store_true",
        help="measure the conversion itself instead: ms and peak Python memory per node of every stage of "
        "precast.convert (observed through precast.passes.runner.observe), verification timed apart",
    ),
    flag(
        "--sizes",
        group=CONVERT,
        nargs="+",
        type=int,
        default=None,
        metavar="N",
        help="chain sizes (default 250 ... 8000)",
    ),
    flag(
        "--policy",
        group=CONVERT,
        nargs="+",
        choices=["none", "torch", "rules"],
        default=None,
        help="policies to measure (default: none torch; with --llama: none torch rules)",
    ),
    flag(
        "--llama",
        group=CONVERT,
        nargs="+",
        default=None,
        metavar="SIZE",
        help="instead: seconds per GB of weights and peak RSS above them, per stage, converting a Llama-shaped "
        "transformers model with random weights (0.2b, 1.1b: TinyLlama's shapes), one fresh process per "
        "(size, policy); a large one waits for /tmp/precast-bigmem.lock (flock)",
    ),
    flag(
        "--llm",
        group=LLM,
        action="store_true",
        help="instead: decode speed of a Llama-shaped decoder with random weights (0.246 B; --quick: 2 tiny "
        "layers), interleaved at each --threads: eager fp32, eager hand-cast bf16, the hand-cast bf16 program "
        "through AOTInductor (as compiled, frozen, max-autotune), precast.compile with no options (the form this "
        "CPU implies) and with mode='default', and precast on OpenVINO. Each row: tokens/s against the fastest "
        "hand-cast form's, resident memory of a fresh process (--no-rss skips it); the load average before and "
        "after (OpenVINO's own export through optimum-intel, the anchor, is the source checkout's decode "
        "script's). The run budgets 5 minutes: "
        "builds (compiled packages are cached; only a first run compiles), memory, then as many repeats as fit "
        "(2 to 10; --repeats N for a fixed number); needs precast[llm]",
    ),
    flag("--quick", group=LLM, action="store_true", help="with --llm: the tiny decoder (a smoke run)"),
    flag("--threads", group=LLM, nargs="+", type=int, default=[1, 2], metavar="N", help="with --llm"),
    flag("--steps", group=LLM, type=int, default=8, metavar="N", help="with --llm: decode steps per sample"),
    # after the LLM group's flags: the usage line lists them last
    flag(
        "--no-memory", group=CONVERT, action="store_true", help="skip the tracemalloc run (halves the time)"
    ),
    flag("--no-verify", group=CONVERT, action="store_true", help="skip timing verification"),
)


def add_parser(sub: Any) -> None:
    """``precast bench``: the flags of ``ARGUMENTS``, run by ``run``."""
    add_command(
        sub,
        "bench",
        ARGUMENTS,
        run=run,
        help="compare eager, AOTInductor, ONNX Runtime, OpenVINO and precast variants on a model",
        description="Latency (median of interleaved repeats), package size, resident memory after load (fresh "
        "process), error vs fp32 and run-time casts per forward, for eager fp32, eager autocast, AOTI default, "
        "AOTI freezing, AOTI run-time constant folding, precast + AOTI, fp32 AOTI, policy auto + AOTI, and ONNX "
        "Runtime on the fp32 program and on precast's (ort_fp32, ort_precast; needs precast[onnx]; bf16 has no "
        "ONNX Runtime CPU kernels: use --dtype fp16 there), and OpenVINO's own default on the fp32 program against "
        "precast's program run in the dtypes it states (ov_default, ov_precast; needs precast[openvino]).",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from precast import bench
    from precast.bench.factories import check_specs
    from precast.bench.variants import check_options
    from precast.errors import PrecastError

    if args.llama and not args.convert:
        raise PrecastError("bench: --llama measures the conversion; add --convert")
    if args.convert:
        return run_convert(args)
    if args.llm:
        return run_llm(args)
    args.repeats = 20 if args.repeats is None else args.repeats
    if args.repeats < 1:
        raise PrecastError(f"bench: --repeats {args.repeats}; give at least 1")
    if any(b < 1 for b in args.batch):
        raise PrecastError(f"bench: --batch {args.batch}; batch sizes must be at least 1")
    variants = tuple(args.variant or bench.VARIANTS)
    check_options(variants, args.dtype, args.device)
    args.model = args.model or bench.default_models()
    check_specs(args.model)
    for spec in args.model:
        bench.resolve(spec)  # a bad spec fails before anything is built
    if args.out:
        out_dir(args.out, "bench.json")
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
    for note in dict.fromkeys(f"{r.model}: {r.note}" for r in results if r.note):
        print(f"note: {note}", file=sys.stderr)
    if args.out:
        written = bench.write_outputs(results, args.out, bench.machine_info(args.device))
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
        if not any(path.suffix == ".png" for path in written):
            print(
                "note: bench.png not drawn: matplotlib is missing; pip install 'precast[bench]'",
                file=sys.stderr,
            )
    return 0


def run_llm(args: argparse.Namespace) -> int:
    """``precast bench --llm``: the package's decode harness (``precast.bench.decode``)."""
    import json
    from pathlib import Path

    from precast.bench import decode
    from precast.errors import PrecastError

    if (args.repeats is not None and args.repeats < 1) or args.steps < 1 or any(t < 1 for t in args.threads):
        raise PrecastError("bench --llm: --repeats, --steps and --threads must be at least 1")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise PrecastError("bench --llm: needs transformers; pip install 'precast[llm]'") from None
    if args.out:
        out_dir(args.out, "llm_decode.json")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"load average (1, 5, 15 min) before: {decode.load_average()}")
    payload = decode.run_decode_bench(
        decode.QUICK if args.quick else decode.Shape(),
        list(args.threads),
        args.repeats,
        args.steps,
        cache_dir=args.cache_dir,
        log=log,
        memory=not args.no_rss,
    )
    log(f"load average (1, 5, 15 min) after: {payload['load_end']}")
    text = decode.decode_markdown(payload)
    print(text)
    if args.out:
        from precast.io import write_bytes

        out = Path(args.out)
        write_bytes(out / "llm_decode.json", (json.dumps(payload, indent=1, default=str) + "\n").encode())
        write_bytes(out / "llm_decode.md", text.encode())
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from rich.console import Console

    from precast import bench
    from precast.errors import PrecastError

    if args.llama:
        return run_convert_gb(args)
    args.policy = args.policy or ["none", "torch"]
    models = args.model or ["chain", *bench.real_models()]
    sizes = tuple(args.sizes or bench.CHAIN_SIZES) if "chain" in models else ()
    if any(n < 1 for n in sizes):
        raise PrecastError(f"bench --convert: --sizes {list(sizes)}; chain sizes must be at least 1")
    unknown = [m for m in models if m != "chain" and m not in bench.real_models()]
    if unknown:
        raise PrecastError(
            f"bench --convert: unknown model(s) {unknown}; choose from chain, "
            f"{', '.join(bench.real_models())}"
        )
    if args.out:
        out_dir(args.out, "convert_cost.json")
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


def run_convert_gb(args: argparse.Namespace) -> int:
    from precast import bench
    from precast.bench.convert import LLAMA_SHAPES, gb_markdown, run_gb_bench, write_gb_outputs
    from precast.errors import PrecastError

    ignored = [
        f
        for f, on in (
            ("--model", args.model),
            ("--sizes", args.sizes),
            ("--no-memory", args.no_memory),
            ("--no-verify", args.no_verify),
        )
        if on
    ]
    if ignored:
        raise PrecastError(
            f"bench --convert --llama: {', '.join(ignored)} do(es) not apply (a Llama is converted with default "
            "options, verify included, its RSS sampled); drop them or drop --llama"
        )
    unknown = [s for s in args.llama if s not in LLAMA_SHAPES]
    if unknown:
        raise PrecastError(f"bench --convert --llama {unknown}: choose from {', '.join(LLAMA_SHAPES)}")
    if args.out:
        out_dir(args.out, "convert_gb.json")
    policies = tuple(None if p == "none" else p for p in (args.policy or ["none", "torch", "rules"]))
    rows = run_gb_bench(tuple(args.llama), policies)
    machine = bench.machine_info()
    print(gb_markdown(rows, machine))
    if args.out:
        for path in write_gb_outputs(rows, args.out, machine):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def out_dir(out: str, first: str) -> None:
    """``--out DIR``: created if absent; a file of that name, or a folder that cannot be made, is one line."""
    from pathlib import Path

    from precast.errors import PrecastError
    from precast.io import check_writable

    p = Path(out)
    if p.exists() and not p.is_dir():
        raise PrecastError(f"--out {out}: is a file; --out names a folder for the result files")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrecastError(f"--out {out}: cannot create it ({exc.strerror})") from exc
    check_writable(p / first)
