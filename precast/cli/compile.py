"""precast compile IN.pt2 [--backend aoti|openvino|onnx|executorch] [-o FILE] [--mode auto|default|max-autotune]
                   [--cache-dir DIR] [--static] [--weights DIR]

Input: a saved program. Output: the artifact the engine loads (AOTInductor package, OpenVINO IR .xml + .bin, .onnx,
.pte), written atomically.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from precast.cli.flags import CACHE_DIR, THREADS, TRUST_PICKLE, add_command, flag
from precast.errors import PrecastError

BACKENDS = ("aoti", "openvino", "onnx", "executorch")
# what `pip install` needs for each optional backend (the package extras)
EXTRAS = {
    "onnx": "pip install 'precast[onnx]'",
    "executorch": "pip install 'precast[executorch]'",
    "openvino": "pip install 'precast[openvino]'",
}
SUFFIXES = {"onnx": ".onnx", "executorch": ".pte", "openvino": ".xml"}


ARGUMENTS = (
    flag("source", help="a program saved with torch.export.save (.pt2)"),
    flag(
        "-o",
        "--output",
        default=None,
        help="write the artifact here (aoti: a package with its weights inside, for torch._inductor."
        "aoti_load_package, with --weights too: the weights are read into it; default prints the cached package's "
        "path, whose weights precast.compile loads; openvino (.xml), onnx, executorch: required)",
    ),
    flag("--backend", choices=BACKENDS, default="aoti", help="default: aoti (AOTInductor)"),
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
        help="compile a saved (converted) program with AOTInductor (cached), or for OpenVINO / ONNX / ExecuTorch",
        description="Compile a program saved with torch.export.save (e.g. by 'precast convert') into an "
        "AOTInductor package, with a dynamic batch dimension; compiled packages are cached by content. "
        "--backend openvino writes OpenVINO IR (model.xml + model.bin, the program's own dtypes), --backend onnx an "
        ".onnx file (ONNX Runtime), --backend executorch a .pte file.",
    )


def run(args: argparse.Namespace) -> int:
    from precast.io import check_writable

    backend = getattr(args, "backend", "aoti")
    if backend != "aoti":
        return _run_export(args, backend)
    from precast.io import write_bytes
    from precast.pipeline.load import load_program

    weights = getattr(args, "weights", None)
    files = None
    if weights:
        from precast.weights.files import WeightFiles

        files = WeightFiles(weights, "--weights")  # checked (headers, regular files) before the program loads
    if args.output:
        if files is not None:  # before check_writable, whose probe file would land in the input folder
            from precast.weights.streamed import check_file_outside

            check_file_outside(args.output, files)
        check_writable(args.output, (args.source,))
    started = time.perf_counter()
    program = load_program(args.source, trust_pickle=args.trust_pickle)
    if args.output and files is not None:
        # -o: a self-contained package; the weights go inside it, so the program takes them in now (read once,
        # names, shapes and dtypes checked by with_weights) and compiles as a program holding its weights
        from precast.weights.files import streamed_targets
        from precast.weights.filled import with_weights

        if not streamed_targets(program):
            raise PrecastError(
                f"--weights {weights}: {args.source} holds its weights (none of its constants is fake or meta); "
                "drop --weights"
            )
        program, weights = with_weights(program, weights), None
    cm = _compile(args, program, weights)
    how = "loaded from cache" if cm.from_cache else f"compiled in {cm.compile_seconds:.1f}s"
    how += f", form {cm.form['name']}, {cm.threads} thread(s)"
    if args.output:
        write_bytes(args.output, cm.package_path.read_bytes(), (args.source,))
        print(f"{args.output}: {how} ({time.perf_counter() - started:.1f}s total)", file=sys.stderr)
    else:
        print(cm.package_path)
        print(f"{how} ({time.perf_counter() - started:.1f}s total)", file=sys.stderr)
    return 0


def _compile(args: argparse.Namespace, program: Any, weights: Any) -> Any:
    """``precast.compile`` with the flags: -o makes a self-contained package (constants inside the .so, loadable
    without precast); --threads (default: ``runtime/threads.default_threads``) the count it is compiled for."""
    from precast.backends.aoti import compiler
    from precast.runtime.threads import resolve_threads

    return compiler.compile(
        program,
        mode=args.mode,
        cache_dir=args.cache_dir,
        dynamic=not args.static,
        inductor_configs={compiler.IN_SO: True} if args.output else None,
        weights=weights,
        threads=resolve_threads(args.threads, "--threads"),
    )


def _run_export(args: argparse.Namespace, backend: str) -> int:
    """--backend openvino|onnx|executorch: every option checked and the backend imported before the program loads."""
    from precast.io import check_writable
    from precast.paths import check_outputs, ir_files
    from precast.pipeline.load import load_program

    if not args.output:
        raise PrecastError(f"--backend {backend} needs -o FILE (e.g. -o model{SUFFIXES[backend]})")
    aoti_only = {"--mode": args.mode != "auto", "--cache-dir": args.cache_dir is not None}
    aoti_only.update(
        {"--weights": bool(getattr(args, "weights", None)), "--threads": args.threads is not None}
    )
    if any(aoti_only.values()):
        option = next(k for k, given in aoti_only.items() if given)
        raise PrecastError(f"{option} applies to --backend aoti only; drop it for --backend {backend}")
    outputs = {"the output": args.output}
    if backend == "openvino":
        _check_ir_path(args.output)
        outputs["the IR's weights (the .bin beside -o)"] = ir_files(args.output)[1]
    check_outputs(outputs, (args.source,))  # every file written, siblings included, against the input
    check_writable(args.output, (args.source,))
    export = _exporter(backend)
    started = time.perf_counter()
    program = load_program(args.source, trust_pickle=args.trust_pickle)
    if backend == "openvino":
        model = export(program, dynamic=not args.static)
        files = model.save(args.output)
        weights = ", ".join(f"{k} {v / 2**20:.2f} MB" for k, v in files["weights"].items())
        batch = "dynamic batch" if _dynamic(model) else "static shapes"
        if model.state_names:  # a KV cache held as OpenVINO variables
            batch += f", {len(model.state_names)} cache(s) held as state between calls ({model.cache_form})"
        detail = f"{files['bin']} beside it, weights {weights}, {batch}; plan: {model.plan.summary()}"
    elif backend == "onnx":
        info = export(program, args.output, dynamic_batch=not args.static)
        low = {k: v for k, v in info.initializers.items() if k in ("float16", "bfloat16")}
        batch = "dynamic batch" if info.dynamic_batch else "static shapes"
        detail = (
            f"{info.size_bytes / 2**20:.2f} MB, opset {info.opset}, {batch}, low-precision initializers {low}"
        )
    else:
        from precast.io import atomic_path

        with atomic_path(
            args.output, (args.source,)
        ) as tmp:  # no partial .pte, whatever the exporter does on failure
            facts = export(program, tmp)
        detail = ", ".join(f"{k}: {v}" for k, v in (facts or {}).items() if isinstance(v, (int, float, str)))
    print(
        f"{args.output}: exported for {backend} in {time.perf_counter() - started:.1f}s ({detail})",
        file=sys.stderr,
    )
    return 0


def _exporter(backend: str):
    """The backend's export function, imported now: a missing package is a one-line error naming the extra."""
    import importlib

    module_name, function = {
        "onnx": ("precast.backends.onnx.export", "export_onnx"),
        "executorch": ("precast.backends.executorch", "export_executorch"),
        "openvino": ("precast.backends.openvino.model", "compile_openvino"),
    }[backend]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PrecastError(
            f"--backend {backend}: cannot import {module_name} ({exc}); {EXTRAS[backend]}"
        ) from exc
    if backend == "onnx":
        module.require_modules("onnx", "onnxscript")  # fail before loading the program, not after
    if backend == "openvino":
        module.require_openvino()
    return getattr(module, function)


def _check_ir_path(output: str) -> None:
    from pathlib import Path

    xml = Path(output)
    if xml.suffix != ".xml":
        raise PrecastError(
            f"{xml}: OpenVINO IR is an .xml file (with a .bin beside it); give e.g. -o model.xml"
        )
    if xml.with_suffix(".bin").is_dir():
        raise PrecastError(f"{xml.with_suffix('.bin')}: is a directory; the IR's weights go there")


def _dynamic(model) -> bool:
    """Whether dim 0 of every batched input of the OpenVINO model is dynamic."""
    shapes = [i.get_partial_shape() for i in model.ov_model.inputs]
    return all(s.rank.get_length() == 0 or s[0].is_dynamic for s in shapes)
