"""Engines a converted program is handed to: AOTInductor (``precast.compile`` and its cache), OpenVINO
(``precast.compile(program, backend="openvino")``), ONNX and ONNX Runtime, ExecuTorch.

Input: an ExportedProgram. Output: the artifact each engine loads, and ways to run it.
"""

from __future__ import annotations

from typing import Any

BACKENDS = ("aoti", "openvino")
_AOTI_ONLY = ("mode", "cache_dir", "inductor_configs", "progress", "weights")


def compile(program: Any, *, backend: str = "aoti", **options: Any) -> Any:
    """``precast.compile``: ``backend="aoti"`` (default) is ``precast.backends.aoti.compiler.compile`` (a cached
    AOTInductor package, a ``CompiledModel``); ``backend="openvino"`` is
    ``precast.backends.openvino.model.compile_openvino`` (an ``OpenVINOModel``). Options another backend has no use
    for are refused with one line. ``threads=`` applies to both: AOTInductor compiles the package for that count and
    runs each call at it (``precast.runtime.threads``; default ``torch.get_num_threads()``), OpenVINO takes it as
    ``INFERENCE_NUM_THREADS`` (default: OpenVINO's). ``precast.runtime.threads.default_threads()`` is the count for
    a machine other processes share."""
    from precast.errors import PrecastError

    if backend == "aoti":
        from precast.backends.aoti import compiler

        return compiler.compile(program, **options)
    if backend == "openvino":
        given = [name for name in _AOTI_ONLY if name in options]
        if given:
            raise PrecastError(
                f"precast.compile: {given[0]}= applies to backend='aoti' only; drop it for backend='openvino'"
            )
        from precast.backends.openvino import model

        return model.compile_openvino(program, **options)
    raise PrecastError(f"precast.compile: backend={backend!r}; choose one of {', '.join(BACKENDS)}")
