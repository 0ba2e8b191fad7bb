"""precast compile IN.pt2 [--backend NAME] [-o FILE] [--mode auto|default|max-autotune] [--cache-dir DIR] [--static]
                   [--weights DIR] [--threads N]

Input: a saved program. Output: the artifact the engine loads (``precast.load`` reads it back: an AOTInductor package
with its weights inside, OpenVINO IR .xml + .bin, .onnx, .pte) and its record beside it (``FILE.json``), each
written whole. The engines, their options and artifacts are ``precast.backends.registry``'s: no engine is named
here.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from precast.backends.registry import ENGINES, NAMES, Engine, engine
from precast.cli.flags import CACHE_DIR, THREADS, TRUST_PICKLE, add_command, flag
from precast.errors import PrecastError

_CACHED = [e.name for e in ENGINES if e.cached]


ARGUMENTS = (
    flag("source", help="a program saved with torch.export.save (.pt2)"),
    flag(
        "-o",
        "--output",
        default=None,
        help="write the artifact here, its record beside it (FILE.json; precast.load FILE reads both): "
        + "; ".join(f"{e.name}: {e.summary}" for e in ENGINES)
        + f"; without -o ({', '.join(_CACHED)} only) the cached package's path is printed, whose weights "
        "precast.compile loads; with --weights too, the weights are read into the package",
    ),
    flag("--backend", choices=NAMES, default="aoti", help="default: aoti (AOTInductor)"),
    flag(
        "--mode",
        choices=["auto", "default", "max-autotune"],
        default="auto",
        help="aoti only; auto (default): the form measured fastest on this machine and thread count for the "
        "program's 16-bit matmul weights (cached; PRECAST_FORM=NAME|flags overrides; docs/compile.md)",
    ),
    THREADS,
    CACHE_DIR,
    flag("--static", action="store_true", help="keep the program's static shapes (no dynamic batch)"),
    flag(
        "--weights",
        default=None,
        metavar="DIR",
        help="aoti only: the weights of a program converted with streamed weights (its constants meta): a "
        "directory of safetensors shards with model.safetensors.index.json, or one .safetensors file; with -o "
        "they are written into the package",
    ),
    TRUST_PICKLE,
)


def add_parser(sub: Any) -> None:
    """``precast compile``: the flags of ``ARGUMENTS``, run by ``run``."""
    add_command(
        sub,
        "compile",
        ARGUMENTS,
        run=run,
        help="compile a saved (converted) program with AOTInductor (cached), or for "
        + " / ".join(e.title for e in ENGINES if not e.cached),
        description="Compile a program saved with torch.export.save (e.g. by 'precast convert') into an "
        "AOTInductor package, with a dynamic batch dimension; compiled packages are cached by content. "
        + " ".join(f"--backend {e.name}: {e.summary}." for e in ENGINES if not e.cached),
    )


def run(args: argparse.Namespace) -> int:
    """Every flag checked against the engine and every output against the input, the engine's packages found,
    before the program loads; then compiled, and saved with -o (else the cached package's path printed)."""
    from precast.pipeline.load import load_program

    e = engine(args.backend, where="--backend")
    options = _options(args, e)
    files = _check_files(args, e)
    e.require(where=f"--backend {e.name}")
    compile_, options = e.prepared(
        options, saving=bool(args.output)
    )  # imported now: one line if it cannot be
    started = time.perf_counter()
    program = load_program(args.source, trust_pickle=args.trust_pickle)
    if args.output and files is not None:
        # -o: a self-contained artifact; the weights go inside it, so the program takes them in now (read once,
        # names, shapes and dtypes checked by with_weights) and compiles as a program holding its weights
        program = _filled(args, program, files)
        options.pop("weights")
    model = compile_(program, **options)
    if not args.output:
        print(model.package_path)
        print(f"{e.describe(model)} ({time.perf_counter() - started:.1f}s total)", file=sys.stderr)
        return 0
    from precast.backends.registry import save

    record = save(model, args.output, inputs=(args.source,))
    summary = (record.get("facts") or {}).get("summary", "")
    print(
        f"{args.output}: exported for {e.name} in {time.perf_counter() - started:.1f}s ({summary})",
        file=sys.stderr,
    )
    return 0


# each flag -> the engine option it sets, and its value when given (None: not given)
_FLAGS = {
    "--mode": ("mode", lambda a: a.mode if a.mode != "auto" else None),
    "--cache-dir": ("cache_dir", lambda a: a.cache_dir),
    "--weights": ("weights", lambda a: getattr(a, "weights", None)),
    "--static": ("dynamic", lambda a: False if a.static else None),
    "--threads": ("threads", lambda a: a.threads),
}


def _options(args: argparse.Namespace, e: Engine) -> dict[str, Any]:
    """The engine's compile options from the flags; a flag its engine takes no option for is one line."""
    from precast.runtime.threads import resolve_threads

    options: dict[str, Any] = {}
    for name, (option, given) in _FLAGS.items():
        value = given(args)
        if value is not None and option not in e.options:
            takers = " / ".join(x.name for x in ENGINES if option in x.options)
            raise PrecastError(f"{name} applies to --backend {takers} only; drop it for --backend {e.name}")
        if value is not None:
            options[option] = value
    if "mode" in e.options:
        options["mode"] = args.mode
    if "threads" in e.options:  # default: runtime/threads.default_threads, the count a shared machine allows
        options["threads"] = resolve_threads(args.threads, "--threads")
    return options


def _check_files(args: argparse.Namespace, e: Engine) -> Any:
    """-o (required where the engine keeps no cache) and every file saving writes, checked against the input;
    --weights' files read (headers, regular files). Returns those files, or None."""
    from precast.paths import check_outputs

    if not args.output and not e.cached:
        raise PrecastError(f"--backend {e.name} needs -o FILE (e.g. -o model{e.suffix})")
    files = None
    if getattr(args, "weights", None):
        from precast.weights.files import WeightFiles

        files = WeightFiles(
            args.weights, "--weights"
        )  # checked (headers, regular files) before the program loads
    if args.output:
        if files is not None:  # before check_writable, whose probe file would land in the input folder
            from precast.weights.streamed import check_file_outside

            check_file_outside(args.output, files)
        e.check_path(args.output)
        check_outputs(e.outputs(args.output), (args.source,))
        _check_writable(e, args.output, args.source)
    return files


def _check_writable(e: Engine, output: str, source: str) -> None:
    from pathlib import Path

    from precast.io import check_writable

    for what, path in e.outputs(output).items():
        if Path(path).is_dir():
            raise PrecastError(f"{path}: is a directory; {what} goes there")
        check_writable(path, (source,))


def _filled(args: argparse.Namespace, program: Any, files: Any) -> Any:
    """The program with --weights' tensors in it (for an artifact that holds its weights)."""
    from precast.weights.files import streamed_targets
    from precast.weights.filled import with_weights

    if not streamed_targets(program):
        raise PrecastError(
            f"--weights {args.weights}: {args.source} holds its weights (none of its constants is fake or meta); "
            "drop --weights"
        )
    return with_weights(program, args.weights)
