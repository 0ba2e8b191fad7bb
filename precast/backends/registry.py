"""The engines precast compiles for, one ``Engine`` record each: the one module that lists them.

An engine is its name, the pip extra that installs it (and the packages ``precast.optional.require`` checks), the
suffix of its saved artifact (and the files written beside it), its compile / save / load functions, the options
its compile takes (any other refused in one line), and whether it runs a program that writes state between calls
(a KV cache: what ``precast.generate`` needs). The functions are named as ``"module:function"`` and imported only
when called: engines never import each other (``tests/arch``), and an engine whose extra is missing costs nothing
until it is asked for, then is one line naming ``pip install 'precast[extra]'``.

    precast.compile(program, backend="onnx")          # compile(): engine(backend).compile(program, **options)
    precast.save(model, "m.onnx")                     # the artifact, and its record beside it (m.onnx.json)
    precast.load("m.onnx")                            # the record names the engine; calls checked as compiled

Other modules iterate over it rather than naming engines: the CLI's ``--backend`` choices are ``NAMES`` (or
``stateful_names()`` for ``precast generate``); export-llm (``precast.llm``) takes ``engine(name)`` for a folder's
engine, ``.compile(program, saving=True, threads=...)``, ``.save`` / ``.load`` with the record; a benchmark builds
one variant per ``Engine`` it can ``.require()``, compiled with ``saving=False``.

Input: a program and options; a compiled model and a path; a saved artifact's path. Output: compiled models,
artifacts with their records.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precast.errors import PrecastError, first_line

RECORD_SUFFIX = ".json"  # the record beside an artifact: m.onnx -> m.onnx.json


@dataclass(frozen=True)
class Engine:
    """One engine: what it is called and installed by, its artifact, its functions and options."""

    name: str
    title: str  # in words: "AOTInductor"
    extra: str | None  # the pip extra that installs it; None: torch brings it
    modules: tuple[str, ...]  # the packages the extra installs, checked by ``require``
    suffix: str  # the saved artifact's
    options: tuple[str, ...]  # the keywords its compile takes
    stateful: bool  # runs a program that writes state between calls (a KV cache), with reset()
    cached: bool  # compiles into precast's cache: the model's ``package_path`` is an artifact without saving
    functions: Mapping[str, str]  # compile / save / load (/ saving: the compile options a save needs)
    model_type: str  # "module:Class" of what compile returns
    beside: tuple[tuple[str, str], ...] = ()  # (suffix, what it is) of each file written beside the artifact
    summary: str = field(default="", compare=False)

    def install(self) -> str:
        return f"pip install 'precast[{self.extra}]'" if self.extra else "pip install precast"

    def require(self, where: str = "precast.compile") -> None:
        """The extra's packages importable, or one line naming the missing one and the ``pip install``."""
        from precast.optional import require

        message = f"{where}: {{module}} is not installed; {self.install()} ({self.title}; {{cause}})"
        require(*self.modules, message=message)

    def check_options(self, options: Mapping[str, Any], where: str = "precast.compile") -> None:
        """One line for the first option this engine's compile does not take, naming the engines that do."""
        for name in options:
            if name in self.options:
                continue
            others = [e.name for e in ENGINES if name in e.options]
            if others:
                raise PrecastError(
                    f"{where}: {name}= applies to backend={' or '.join(map(repr, others))} only; drop it for "
                    f"backend={self.name!r}"
                )
            raise PrecastError(
                f"{where}: {name}= is not an option of backend={self.name!r}; its options: {', '.join(self.options)}"
            )

    def function(self, role: str) -> Any:
        """The engine's ``role`` function, imported now; a module that cannot be imported is one line naming
        the extra."""
        module_name, name = self.functions[role].split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PrecastError(
                f"backend {self.name}: cannot import {module_name} ({first_line(exc)}); {self.install()}"
            ) from exc
        return getattr(module, name)

    def compile(self, program: Any, *, saving: bool = False, **options: Any) -> Any:
        """``program`` compiled with ``options`` (checked first); ``saving``: in the form ``save`` can write."""
        compile_, options = self.prepared(options, saving)
        return compile_(program, **options)

    def prepared(self, options: dict[str, Any], saving: bool) -> tuple[Any, dict[str, Any]]:
        """The compile function and its options, checked (``saving``: with what ``save`` needs): for a caller
        that calls it itself, so that an engine's warnings name that caller's line."""
        self.check_options(options)
        if saving and "saving" in self.functions:
            options = self.function("saving")(options)
        return self.function("compile"), options

    def owns(self, model: Any) -> bool:
        """Whether ``model`` is one this engine's compile or load returned (its class, if imported at all)."""
        module_name, name = self.model_type.split(":")
        module = sys.modules.get(module_name)
        return (
            module is not None
            and isinstance(model, getattr(module, name))
            and getattr(model, "engine", self.name) == self.name
        )

    def check_path(self, path: str | os.PathLike) -> None:
        """One line where ``path`` cannot name this engine's artifact (its suffix decides the files beside it)."""
        if self.beside and Path(path).suffix != self.suffix:
            raise PrecastError(
                f"{path}: {self.title}'s artifact is an {self.suffix} file with {'/'.join(s for s, _ in self.beside)} "
                f"beside it; "
                f"give e.g. model{self.suffix}"
            )

    def describe(self, model: Any) -> str:
        """What the compile did, in words (the engine's ``describe``, else the facts it reported)."""
        if "describe" in self.functions:
            return self.function("describe")(model)
        return str(getattr(model, "facts", {}).get("summary", ""))

    def outputs(self, path: str | os.PathLike) -> dict[str, Path]:
        """Every file ``save`` writes for ``path``, by what it is (for the checks against the inputs)."""
        p = Path(path)
        files = {"the output": p, "its record": record_path(p)}
        files.update({f"{what} (the {s} beside it)": p.with_suffix(s) for s, what in self.beside})
        return files


ENGINES: tuple[Engine, ...] = (
    Engine(
        name="aoti",
        title="AOTInductor",
        extra=None,
        modules=(),
        suffix=".pt2",
        options=(
            "mode",
            "cache_dir",
            "dynamic",
            "inductor_configs",
            "progress",
            "lock_timeout",
            "weights",
            "threads",
        ),
        stateful=True,
        cached=True,
        functions={
            "compile": "precast.backends.aoti.compiler:compile",
            "save": "precast.backends.aoti.saved:save",
            "load": "precast.backends.aoti.saved:load",
            "saving": "precast.backends.aoti.saved:saving_options",
            "describe": "precast.backends.aoti.saved:describe",
        },
        model_type="precast.backends.aoti.model:CompiledModel",
        summary="a cached AOTInductor package (CompiledModel); saved: one package with its weights inside",
    ),
    Engine(
        name="openvino",
        title="OpenVINO",
        extra="openvino",
        modules=("openvino",),
        suffix=".xml",
        options=("dynamic", "threads", "precision_hint", "warn", "dynamic_quantization"),
        stateful=True,
        cached=False,
        functions={
            "compile": "precast.backends.openvino.model:compile_openvino",
            "save": "precast.backends.openvino.saved:save",
            "load": "precast.backends.openvino.saved:load",
        },
        model_type="precast.backends.openvino.compiled:OpenVINOModel",
        beside=((".bin", "the IR's weights"),),
        summary="OpenVINO's CPU plugin (OpenVINOModel); saved: the compiled form's IR (.xml + .bin)",
    ),
    Engine(
        name="onnx",
        title="ONNX Runtime",
        extra="onnx",
        modules=("onnx", "onnxscript", "onnxruntime"),
        suffix=".onnx",
        options=("dynamic", "threads", "opset", "optimize"),
        stateful=False,  # refused: an ONNX Runtime session does not carry written buffers between calls
        cached=False,
        functions={
            "compile": "precast.backends.onnx.model:compile_onnx",
            "save": "precast.backends.onnx.model:save_onnx",
            "load": "precast.backends.onnx.model:load_onnx",
        },
        model_type="precast.runtime.signed:SignedModel",
        summary="an ONNX Runtime CPU session (SignedModel); saved: the .onnx file",
    ),
    Engine(
        name="executorch",
        title="ExecuTorch",
        extra="executorch",
        modules=("executorch.exir", "executorch.runtime"),
        suffix=".pte",
        options=("verify", "check_ir_validity"),
        stateful=False,  # the runtime carries written buffers, but there is no reset() for a new sequence
        cached=False,
        functions={
            "compile": "precast.backends.executorch:compile_executorch",
            "save": "precast.runtime.signed:save_signed",
            "load": "precast.backends.executorch:load_executorch",
        },
        model_type="precast.runtime.signed:SignedModel",
        summary="ExecuTorch's portable runtime (SignedModel); saved: the .pte file",
    ),
)
NAMES = tuple(e.name for e in ENGINES)


def stateful_names() -> tuple[str, ...]:
    """The engines that run a decoder's KV cache (``precast.generate``, ``precast export-llm``)."""
    return tuple(e.name for e in ENGINES if e.stateful)


def engine(name: str, where: str = "precast.compile") -> Engine:
    """The engine called ``name``, or one line naming the choices."""
    for e in ENGINES:
        if e.name == name:
            return e
    raise PrecastError(f"{where}: backend={name!r}; choose one of {', '.join(NAMES)}")


def record_path(path: str | os.PathLike) -> Path:
    """Where the record of the artifact at ``path`` lives: beside it, ``<name>.json``."""
    p = Path(path)
    return p.with_name(p.name + RECORD_SUFFIX)


def owner(model: Any, where: str = "precast.save") -> Engine:
    """The engine ``model`` was compiled (or loaded) by, or one line saying what can be saved."""
    for e in ENGINES:
        if e.owns(model):
            return e
    raise PrecastError(
        f"{where}: got {type(model).__name__}; pass a model precast.compile or precast.load returned "
        f"(backend {', '.join(NAMES)})"
    )


def save(model: Any, path: str | os.PathLike, *, inputs: tuple[Any, ...] = ()) -> dict[str, Any]:
    """``precast.save(model, path)``: the engine's artifact at ``path`` (its suffix: ``.pt2``, ``.xml`` with its
    ``.bin``, ``.onnx``, ``.pte``), then its record at ``path + ".json"`` (the engine, the signature calls are
    checked against, what loading needs); each written whole. ``inputs``: files it must not overwrite. Returns
    the record."""
    from precast.io import check_writable, write_bytes
    from precast.paths import check_outputs
    from precast.version import __version__

    e = owner(model)
    p = Path(path)
    e.check_path(p)
    outputs = e.outputs(p)
    check_outputs(outputs, inputs)
    for target in outputs.values():
        check_writable(target, inputs)
    record = {"engine": e.name, "precast": __version__, **e.function("save")(model, p)}
    write_bytes(record_path(p), json.dumps(record, indent=1).encode(), inputs)
    return record


def load(path: str | os.PathLike, *, backend: str | None = None, threads: int | None = None) -> Any:
    """``precast.load(FILE)``: the artifact ``save`` wrote, by the engine its record names; ``threads``: the
    thread count to run at, where the engine takes one. One line for a file without a record, a record of
    another engine than ``backend``, or an engine not installed."""
    from precast.io import loads_bounded

    p = Path(path)
    if not p.is_file():
        raise PrecastError(f"{p}: no such file; give an artifact precast.save wrote, or an LLM folder")
    rec = record_path(p)
    try:
        record = loads_bounded(rec.read_bytes())
    except FileNotFoundError as exc:
        raise PrecastError(
            f"{p}: no record beside it ({rec.name}); precast.load reads what precast.save (or precast compile "
            "-o) wrote"
        ) from exc
    except (OSError, ValueError) as exc:
        raise PrecastError(
            f"{rec}: cannot read it as precast's record ({first_line(exc)}); save it again"
        ) from exc
    e = engine(str(record.get("engine")) if isinstance(record, dict) else "?", where=str(rec))
    if backend is not None and backend != e.name:
        raise PrecastError(
            f"precast.load: {p} is a {e.name} artifact, not {backend}; drop backend= or give {e.name}'s"
        )
    e.require(where=f"precast.load {p}")
    options = {} if threads is None else {"threads": threads}
    return e.function("load")(p, record, **options)
