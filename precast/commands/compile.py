"""precast compile IN.pt2 [-o PKG.pt2] [--mode default|max-autotune] [--cache-dir DIR]"""

from __future__ import annotations

import argparse
import shutil
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="compile a saved (converted) program with AOTInductor, cached",
        description="Compile a program saved with torch.export.save (e.g. by 'precast convert') into an "
        "AOTInductor package, with a dynamic batch dimension. Compiled packages are cached by content.",
    )
    p.add_argument("source", help="a program saved with torch.export.save (.pt2)")
    p.add_argument(
        "-o", "--output", default=None, help="copy the package here (default: print its cache path)"
    )
    p.add_argument("--mode", choices=["default", "max-autotune"], default="default")
    p.add_argument("--cache-dir", default=None, help="default: $PRECAST_CACHE_DIR or the user cache dir")
    p.add_argument(
        "--static", action="store_true", help="keep the program's static shapes (no dynamic batch)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    from precast.capture import load_program
    from precast.io import atomic_path, check_writable

    compile_mod = importlib.import_module("precast.aoti")
    if args.output:
        check_writable(args.output)
    started = time.perf_counter()
    program = load_program(args.source)
    cm = compile_mod.compile(program, mode=args.mode, cache_dir=args.cache_dir, dynamic=not args.static)
    how = "loaded from cache" if cm.from_cache else f"compiled in {cm.compile_seconds:.1f}s"
    if args.output:
        with atomic_path(args.output) as tmp:
            shutil.copyfile(cm.package_path, tmp)
        print(f"{args.output}: {how} ({time.perf_counter() - started:.1f}s total)", file=sys.stderr)
    else:
        print(cm.package_path)
        print(f"{how} ({time.perf_counter() - started:.1f}s total)", file=sys.stderr)
    return 0
