"""ONNX Runtime (CPU) for exported .onnx files: sessions with one-line errors naming the op ONNX Runtime lacks a
low-precision kernel for (and the route that works), and runs. (Measuring them is ``precast.bench.ort``'s.)

Input: an .onnx path (``precast.backends.onnx.export.export_onnx``) and inputs. Output: sessions, torch tensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from precast.backends.onnx.export import require_modules
from precast.errors import PrecastError, first_line
from precast.runtime.arrays import to_numpy, to_torch

_ORT_FAILURE = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")


_LOW = {10: "float16", 16: "bfloat16"}  # onnx.TensorProto element types


# ---- ONNX Runtime -------------------------------------------------------------------------------------------
def ort_session(path: str | os.PathLike, *, threads: int | None = None) -> Any:
    """An ``onnxruntime.InferenceSession`` on the CPU provider.

    A missing CPU kernel (``NOT_IMPLEMENTED``: ONNX Runtime has few bfloat16 kernels on CPU) becomes a one-line
    PrecastError naming the op(s) and what works instead.
    """
    require_modules("onnxruntime")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the session's warnings are not ours to show
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise PrecastError(_ort_message(path, exc)) from exc


def _ort_message(path: str | os.PathLike, exc: Exception) -> str:
    text = first_line(exc)
    m = _ORT_FAILURE.search(str(exc))
    if m is None:
        return f"{path}: ONNX Runtime cannot load it: {text[:300]}"
    op, version, node = m.groups()
    low = _low_precision_consumers(path)
    dtypes = sorted({d for d, _ in low})
    if not dtypes:
        return f"{path}: ONNX Runtime's CPU provider has no kernel for {op}({version}) (node '{node}'): {text[:200]}"
    others = sorted({o for _, o in low} - {op})
    also = f"; {'/'.join(dtypes)} also feeds {', '.join(others)}" if others else ""
    if "bfloat16" in dtypes:
        route = (
            "convert with dtype=torch.float16 for ONNX Runtime CPU (it runs float16 models, computing ops that "
            "lack a float16 kernel in float32), or serve the bfloat16 program with torch.compile or "
            "precast.compile (AOTInductor)"
        )
    else:
        route = (
            "keep that op in float32 (precast.convert(..., policy=precast.RulesPolicy(exclude_ops=[...]))), "
            "or serve the program with torch.compile or precast.compile (AOTInductor)"
        )
    return (
        f"{path}: ONNX Runtime's CPU provider has no {'/'.join(dtypes)} kernel for {op}({version}) "
        f"(node '{node}'{also}); {route}"
    )


def _low_precision_consumers(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(element type, op type) for every non-Cast node reading a float16/bfloat16 value."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    types.update({i.name: i.data_type for i in g.initializer})
    out = set()
    for node in g.node:
        if node.op_type == "Cast":
            continue
        for name in node.input:
            if types.get(name) in _LOW:
                out.add((_LOW[types[name]], node.op_type))
    return sorted(out)


def ort_can_run(path: str | os.PathLike) -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for every node (the session can be created)."""
    try:
        ort_session(path)
    except PrecastError:
        return False
    return True


def ort_feed(session: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    """The session's input feed: numpy arrays by input name (one clear error for a wrong count or bf16)."""
    leaves = [x for x in torch.utils._pytree.tree_leaves(tuple(inputs)) if isinstance(x, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    if len(leaves) != len(names):
        raise PrecastError(
            f"run_onnx: {len(leaves)} tensor input(s) given, the model takes {len(names)} ({', '.join(names)})"
        )
    feed = {}
    for name, x in zip(names, leaves, strict=True):
        if x.dtype == torch.bfloat16:
            raise PrecastError(f"run_onnx: input {name} is bfloat16, which numpy cannot hold; pass float32")
        feed[name] = to_numpy(x.cpu())
    return feed


def run_onnx(model: str | os.PathLike | Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run an ``.onnx`` file (or an ``ort_session``) on ONNX Runtime's CPU provider; outputs as torch tensors."""
    session = model if hasattr(model, "get_inputs") else ort_session(model)
    feed = ort_feed(session, inputs)
    try:
        outs = session.run(None, feed)
    except Exception as exc:  # onnxruntime's InvalidArgument / Fail: wrong shapes or dtypes for this model
        raise PrecastError(f"run_onnx: ONNX Runtime failed: {first_line(exc)[:300]}") from exc
    return [to_torch(a, copy=False) for a in outs]  # ml_dtypes' bfloat16 read back through its bits


def ort_runner(model: str | os.PathLike | Any, inputs: Sequence[Any]) -> Callable[[], list[Any]]:
    """A zero-argument callable running one forward (inputs converted once), for latency timing."""
    session = model if hasattr(model, "get_inputs") else ort_session(model)
    feed = ort_feed(session, inputs)
    return lambda: session.run(None, feed)
