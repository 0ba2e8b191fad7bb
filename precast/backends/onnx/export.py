"""ONNX export of (converted) programs, and ONNX Runtime (CPU) runs, checks and benchmarks.

    info = export_onnx(res.program, "model.onnx")        # dynamic batch; weights stay fp16/bf16 initializers
    outs = run_onnx("model.onnx", inputs)               # ONNX Runtime, CPU provider
    stats = bench_ort("model.onnx", inputs)             # median latency, file size, RSS of a fresh process

Input: a program (converted or not). Output: an .onnx file (``OnnxInfo``); runs: ``precast.backends.onnx.runtime``.

Needs ``pip install 'precast[onnx]'`` (onnx, onnxscript, onnxruntime). What was measured, and what ONNX Runtime's
CPU provider can and cannot run: docs/backends.md.

Export path: ``torch.onnx.export(program, dynamo=True)`` takes the ExportedProgram as it is (after an optional
re-export with a dynamic batch dimension, as ``precast.compile`` does), so every cast precast wrote becomes an ONNX
``Cast`` on an activation and every folded weight an initializer in its stored dtype. The exporter's own
optimizer (onnxscript) runs afterwards, with one rewrite left out: its BatchNormalization fusion folds fp32
batch-norm statistics into a low-precision Conv weight and writes the product as a *float32* initializer
beside a float16 activation, which is an invalid model (``Conv`` binds ``T`` to two types). precast programs
keep batch norm's statistics in fp32 by design (autocast's tables do), so that rewrite is skipped; ONNX
Runtime fuses Conv+BatchNormalization itself where the types allow.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError, first_line
from precast.io import atomic_path
from precast.optional import require
from precast.progress import verbose
from precast.runtime.exported import batch_symbols, exported_program, refuse_written_state
from precast.threads import quiet_logger

EXTRA = "pip install 'precast[onnx]'"


def require_modules(*modules: str) -> None:
    """Each of ``modules`` importable, or a one-line PrecastError naming the missing one and the extra."""
    message = (
        f"precast.backends.onnx.export: {{module}} is not installed; {EXTRA} (onnx, onnxscript, onnxruntime)"
    )
    require(*modules, message=message)


@dataclass
class OnnxInfo:
    """Facts about an exported ``.onnx`` file."""

    path: str
    size_bytes: int
    opset: int
    inputs: list[tuple[str, str, list[int | str]]]  # (name, element type, shape: int or symbolic name)
    outputs: list[tuple[str, str, list[int | str]]]
    initializers: dict[str, int]  # element type -> count
    initializer_bytes: dict[str, int]  # element type -> bytes
    ops: dict[str, int]  # op type -> count
    casts: int  # Cast nodes (each on an activation in a precast program)
    initializer_casts: list[str] = field(default_factory=list)  # Casts fed by an initializer: cast per call
    dynamic_batch: bool = False  # dim 0 of every batched input is symbolic
    export_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- export -------------------------------------------------------------------------------------------------
def export_onnx(
    program: ExportedProgram | Any,
    path: str | os.PathLike,
    *,
    dynamic_batch: bool = True,
    opset: int | None = None,
    optimize: bool = True,
) -> OnnxInfo:
    """Export ``program`` (an ExportedProgram or a ConvertResult) to ONNX at ``path``, atomically.

    ``dynamic_batch``: re-export with dim 0 of every tensor input dynamic (``Dim("batch")``, as
    ``precast.compile`` does); a program whose batch cannot be dynamic stays static, with a warning.
    ``optimize``: run the exporter's onnxscript optimizer (constant folding, redundancy elimination) without its
    BatchNormalization fusion (see the module docstring). Raises PrecastError if the exporter fails or the result
    is not a valid ONNX model.
    """
    require_modules("onnx", "onnxscript")
    import onnx

    ep = exported_program(program, "export_onnx")
    refuse_written_state(ep, "an ONNX Runtime session", "export_onnx")
    started = time.perf_counter()
    if dynamic_batch:
        ep = dynamic_if_possible(ep)
    proto = _exported(ep, opset, optimize)
    if dynamic_batch and len(batch_symbols(ep)) == 1:
        _rename_dims(proto, batch_symbols(ep))
    _check_valid(proto)
    with atomic_path(path) as tmp:
        onnx.save_model(proto, str(tmp))
    info = inspect_onnx(path)
    info.export_seconds = round(time.perf_counter() - started, 3)
    return info


def _exported(ep: ExportedProgram, opset: int | None, optimize: bool) -> Any:
    """``torch.onnx.export`` of ``ep`` on its example inputs, quiet, then (``optimize``) onnxscript's
    optimizer: the ModelProto, or one PrecastError line naming why the exporter failed."""
    if not ep.example_inputs:
        raise PrecastError(
            "export_onnx: the program carries no example inputs (torch.onnx.export needs them); export it with "
            "torch.export.export(model, example_inputs) or precast.convert(model, example_inputs)"
        )
    args, kwargs = ep.example_inputs
    with torch.no_grad(), _quiet():
        try:
            onnx_program = torch.onnx.export(
                ep,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                optimize=False,
                opset_version=opset,
                custom_translation_table=_translations(),
            )
        except Exception as exc:
            raise PrecastError(
                f"export_onnx: torch.onnx.export failed: {type(exc).__name__}: {_summary(exc)[:300]}; "
                "the program uses an op the ONNX exporter cannot translate (try torch.onnx.export(..., "
                "report=True) for details)"
            ) from exc
        if optimize:
            _optimize(onnx_program.model)
    return onnx_program.model_proto


def _translations() -> dict[Any, Any]:
    """Ops whose translation by onnxscript's torch library is wrong for precast's programs, translated here.

    ``bitwise_right_shift`` on uint8 (how an int4 weight's high nibble is read: ``packed >> 4``): onnxscript
    emulates an arithmetic shift and casts the result to the *signed* type (int8 for uint8), an invalid model
    (``Where`` yields int8 where the graph declares uint8). An unsigned right shift is ONNX's logical
    ``BitShift`` itself; signed types keep onnxscript's translation."""
    from onnxscript import ir
    from onnxscript.function_libs.torch_lib.ops import core
    from onnxscript.onnx_opset import opset18 as op

    unsigned = {ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64}

    def right_shift(self: Any, other: Any) -> Any:
        if self.dtype in unsigned:
            return op.BitShift(self, op.CastLike(other, self), direction="RIGHT")
        return core.aten_bitwise_right_shift(self, other)

    def right_shift_scalar(self: Any, other: int) -> Any:
        if self.dtype in unsigned:
            return op.BitShift(self, op.Constant(value=ir.tensor(other, dtype=self.dtype)), direction="RIGHT")
        return core.aten_bitwise_right_shift_tensor_scalar(self, other)

    # ``>>`` is ``__rshift__`` (its Tensor overload onnxscript does not register at all)
    aten = torch.ops.aten
    return {
        aten.bitwise_right_shift.Tensor: right_shift,
        aten.bitwise_right_shift.Tensor_Scalar: right_shift_scalar,
        aten.__rshift__.Tensor: right_shift,
        aten.__rshift__.Scalar: right_shift_scalar,
    }


def _check_valid(proto: Any) -> None:
    """ONNX's full model check; a failure is one PrecastError line: the op its opset has no fp16/bf16 kernel
    type for and the route that works, else the checker's own first line."""
    import onnx

    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # onnx raises ValidationError / InferenceError
        bad = re.search(r"op_type:(\w+).*unsupported type: tensor\((b?float16)\)", str(exc))
        if bad:
            op, dtype = bad.groups()
            route = (
                "convert with dtype=torch.float16 for ONNX"
                if dtype == "bfloat16"
                else "keep that op in float32 (precast.convert(..., policy=precast.RulesPolicy(exclude_ops=[...])))"
            )
            raise PrecastError(
                f"export_onnx: ONNX opset {_opset(proto)} has no {dtype} {op}; {route}"
            ) from exc
        raise PrecastError(
            f"export_onnx: the exported model is invalid: {first_line(exc)[:300]}; "
            "report it with the program (torch.export.save) attached"
        ) from exc


def _summary(exc: BaseException) -> str:
    """The exporter's own one-line cause (its message opens with a multi-line 'next steps' block)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if "## Exception summary" in lines:
        rest = lines[lines.index("## Exception summary") + 1 :]
        if rest:
            return rest[0]
    return lines[0] if lines else type(exc).__name__


def _opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def dynamic_if_possible(ep: ExportedProgram) -> ExportedProgram:
    """The program with a dynamic dim 0: itself when it has one, else ``precast.runtime.exported.dynamic_batch``'s re-export.

    A program converted with static shapes may have the batch size baked into its graph (an attention layer's
    ``view(16, 64)``): re-exporting it cannot make the batch dynamic. That is warned about, with the fix."""
    from precast.runtime.exported import dynamic_batch

    if batch_symbols(ep):
        return ep
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dynamic_batch(ep)
    if not batch_symbols(out) and any(
        isinstance(a, torch.Tensor) and a.dim() for a in torch.utils._pytree.tree_leaves(ep.example_inputs)
    ):
        warnings.warn(
            "export_onnx: the batch dimension stays static (the program's graph fixes it); convert with "
            "dynamic_shapes=({0: torch.export.Dim('batch')},) to export a dynamic batch, or pass "
            "dynamic_batch=False",
            stacklevel=3,
        )
        out = ep
    # torch's own warnings from the re-export pass through; precast.compile's wording does not
    for w in caught:
        if not str(w.message).startswith("precast.compile:"):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def _rename_dims(proto: Any, names: set[str], to: str = "batch") -> None:
    """Rename the batch symbol (the exporter's ``s77``) to ``batch`` everywhere it appears."""
    graph = proto.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in names:
                dim.dim_param = to


@contextmanager
def _quiet() -> Iterator[None]:
    """The exporter prints progress lines ('[torch.onnx] Run decompositions...') to stdout: drop them."""
    import contextlib
    import io

    if verbose():
        yield
        return
    # and its op registry logs one warning per torchvision op when torchvision is absent (it is, here): noise
    with (
        quiet_logger("torch.onnx._internal.exporter._registration"),  # a filter: no global level change
        contextlib.redirect_stdout(io.StringIO()),
    ):
        yield


def _optimize(model: Any) -> None:
    """onnxscript's optimizer (what ``torch.onnx.export(optimize=True)`` runs), minus BatchNormalization fusion.

    The rewrite rule list is a module attribute onnxscript reads on each call; it is swapped for the call only.
    """
    import onnxscript.optimizer
    import onnxscript.rewriter as rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    try:
        from onnxscript.rewriter.rules.common import _fuse_batchnorm

        skip = {id(rule) for rule in _fuse_batchnorm.rules}
    except ImportError:  # another onnxscript layout: nothing to skip by name, the validity check still runs
        skip = set()
    if rules is None or not skip:
        onnxscript.optimizer.optimize_ir(model)
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if id(r) not in skip)
    try:
        onnxscript.optimizer.optimize_ir(model)
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


# ---- inspection ---------------------------------------------------------------------------------------------
def _type_name(elem: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(elem).lower()


def _shape(value_info: Any) -> list[int | str]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in dims]


def inspect_onnx(path: str | os.PathLike) -> OnnxInfo:
    """Element types of the initializers, op counts, Casts (and those fed by an initializer), I/O shapes."""
    require_modules("onnx")
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for init in graph.initializer:
        name = _type_name(init.data_type)
        counts[name] += 1
        sizes[name] += _nbytes(init)
    casts = [n for n in graph.node if n.op_type == "Cast"]
    io = [
        (i.name, _type_name(i.type.tensor_type.elem_type), _shape(i))
        for i in graph.input
        if i.name not in inits
    ]
    outs = [(o.name, _type_name(o.type.tensor_type.elem_type), _shape(o)) for o in graph.output]
    batched = [shape for _, _, shape in io if shape]
    opset = _opset(model)
    return OnnxInfo(
        path=str(path),
        size_bytes=os.path.getsize(path),
        opset=opset,
        inputs=io,
        outputs=outs,
        initializers=dict(counts),
        initializer_bytes=dict(sizes),
        ops=dict(Counter(n.op_type for n in graph.node)),
        casts=len(casts),
        initializer_casts=[f"{n.name or n.op_type}({n.input[0]})" for n in casts if n.input[0] in inits],
        dynamic_batch=bool(batched) and all(isinstance(s[0], str) and not s[0].isdigit() for s in batched),
    )


def _nbytes(init: Any) -> int:
    from onnx import numpy_helper

    if init.raw_data:
        return len(init.raw_data)
    return int(numpy_helper.to_array(init).nbytes)
