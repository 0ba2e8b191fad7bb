"""Engines a converted program is handed to: AOTInductor (``precast.compile``'s default and its cache), OpenVINO,
ONNX Runtime, ExecuTorch; each listed once, as an ``Engine`` record, in ``backends/registry.py``.

Input: an ExportedProgram. Output: the model each engine compiles, and (``registry.save``) its artifact.
"""

from __future__ import annotations

from typing import Any


def compile(program: Any, *, backend: str = "aoti", saving: bool = False, **options: Any) -> Any:
    """``precast.compile(program, backend=...)``: the engine ``backend`` names in ``backends/registry.py``
    (``"aoti"``, default: ``backends/aoti/compiler.compile``, a cached AOTInductor package, a ``CompiledModel``;
    ``"openvino"``: ``backends/openvino/model.compile_openvino``, an ``OpenVINOModel``; ``"onnx"``: an ONNX Runtime
    session, ``"executorch"``: a ``.pte`` in ExecuTorch's runtime, both a ``runtime/signed.SignedModel``). An
    option the engine's compile does not take is refused in one line. ``threads=`` (aoti, openvino, onnx): the
    intra-op thread count (AOTInductor compiles the package for it and runs each call at it; OpenVINO's
    ``INFERENCE_NUM_THREADS``; ONNX Runtime's ``intra_op_num_threads``); ``precast.runtime.threads.default_threads()``
    is the count for a machine other processes share. ``saving=True``: compiled in the form ``precast.save`` can
    write (AOTInductor: the weights inside the package)."""
    from precast.backends.registry import engine

    compile_, options = engine(backend).prepared(options, saving)
    return compile_(program, **options)  # called here: an engine's warnings name the caller's line
