"""Write a converted program as an ExecuTorch ``.pte`` file and run it in ExecuTorch's Python runtime.

``export_executorch(program, path)`` lowers the program precast returns (``ConvertResult.program``) with
``to_edge(...).to_executorch()`` and writes the file atomically. The weights precast cast once go into the
``.pte`` as they are in the program: one copy each, in its low precision (``info["constants"]`` lists the
file's constant bytes by dtype, read back from the written file). No delegate: every op runs on ExecuTorch's
portable CPU kernels, which exist for bfloat16 and float16.

Before the file is committed, the program is run once in the runtime on its example inputs and compared with
the converted program (``verify=True``); an op that the portable kernels cannot run becomes a one-line
:class:`~precast.errors.PrecastError` naming the op and a route that works. Needs ``pip install
precast[executorch]`` (``executorch==1.5.1``, which installs beside torch 2.13).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast.errors import PrecastError, first_line
from precast.io import atomic_path, check_writable
from precast.optional import require

INSTALL = "pip install 'precast[executorch]' (executorch==1.5.1, which installs beside torch 2.13)"

# ExecuTorch's portable kernels check that these ops' floating tensors share one dtype (normalization_ops_util,
# op_convolution, op_addmm, ...); autocast leaves batch norm with a low-precision input and fp32 statistics.
_SAME_DTYPE_OPS = ("batch_norm", "layer_norm", "group_norm", "convolution", "addmm", "linear", "mm", "bmm")

# The routes that were found to work for the ops that fail (tests/backends/test_executorch.py checks them).
_ROUTES = {
    "batch_norm": (
        "fold the batch norm into its convolution before converting (torch.nn.utils.fusion.fuse_conv_bn_eval), "
        "or convert a model without autocast regions with policy='rules' (batch norm wholly in low precision)"
    ),
    "mkldnn_rnn_layer": (
        "convert with policy='rules', which keeps the recurrent layer as aten.lstm in float32 "
        "(policy 'torch' takes autocast's oneDNN-only RNN kernel)"
    ),
}
_DEFAULT_ROUTE = (
    "keep the op out of the low-precision region, or run the program with precast.compile (AOTInductor)"
)


def require_modules() -> None:
    """ExecuTorch's exporter and runtime importable, or a one-line PrecastError naming the extra."""
    require(
        "executorch.exir", "executorch.runtime", message=f"ExecuTorch is not installed ({{cause}}); {INSTALL}"
    )


def _route(op: str) -> str:
    return next((route for key, route in _ROUTES.items() if key in op), _DEFAULT_ROUTE)


def _tensor_dtype(arg: Any) -> torch.dtype | None:
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else None


def _check_mixed_dtypes(edge_program: ExportedProgram) -> None:
    """Ops whose portable kernel insists on one dtype for all its floating tensors, given mixed ones."""
    for node in edge_program.graph.nodes:
        if node.op != "call_function":
            continue
        op = str(getattr(node.target, "_name", node.target))
        if not any(key in op for key in _SAME_DTYPE_OPS):
            continue
        dtypes = [
            d for d in map(_tensor_dtype, pytree.tree_leaves((node.args, node.kwargs))) if d is not None
        ]
        if len(set(dtypes)) > 1:
            names = "/".join(str(d).removeprefix("torch.") for d in dict.fromkeys(dtypes))
            raise PrecastError(
                f"executorch: node {node.name!r} ({op}) mixes {names} tensors, which ExecuTorch's portable "
                f"kernel rejects; {_route(op)}",
                node=node.name,
            )


def _operator_names(plan: Any) -> list[str]:
    return [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]


def _check_kernels(plan: Any) -> None:
    """Every operator the plan calls must have a kernel registered in the runtime."""
    from executorch.extension.pybindings import portable_lib

    registered = set(portable_lib._get_operator_names())
    for name in _operator_names(plan):
        if name not in registered:
            raise PrecastError(
                f"executorch: op {name} has no kernel in ExecuTorch's portable runtime; {_route(name)}",
            )


def _lower(program: ExportedProgram, check_ir_validity: bool) -> Any:
    from executorch.exir import EdgeCompileConfig, to_edge
    from executorch.exir.verification.verifier import SpecViolationError

    try:
        edge = to_edge(program, compile_config=EdgeCompileConfig(_check_ir_validity=check_ir_validity))
    except SpecViolationError as e:
        op = re.search(r"Operator: <EdgeOpOverload: ([\w.]+)>", str(e))
        raise PrecastError(
            f"executorch: to_edge rejects {op.group(1) if op else 'an op'} ({first_line(e)}); "
            "pass check_ir_validity=False (the portable kernel promotes its inputs as torch does) "
            "or convert with policy='torch'",
        ) from e
    _check_mixed_dtypes(edge.exported_program())
    return edge.to_executorch()


def _flat_inputs(program: ExportedProgram | None, args: tuple, kwargs: dict) -> list[Any]:
    if kwargs and program is not None:
        from torch.export._tree_utils import reorder_kwargs

        kwargs = reorder_kwargs(kwargs, program.call_spec.in_spec)
    return pytree.tree_leaves((args, kwargs))


@contextlib.contextmanager
def _native_log() -> Iterator[list[str]]:
    """Collects what ExecuTorch's runtime logs inside the block (its error messages name the failing operator;
    the Python exception only carries an error code). The runtime writes to fd 2, or to ``sys.stderr`` when
    that is not the process's stderr (under pytest): both are collected, then echoed to ``sys.stderr``, so
    nothing is hidden."""
    lines: list[str] = []
    sys.stderr.flush()
    saved_fd, saved_stream = os.dup(2), sys.stderr
    stream = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        sys.stderr = stream
        try:
            yield lines
        finally:
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace") + stream.getvalue()
            lines.extend(text.splitlines())
            if text:
                sys.stderr.write(text)


def _failing_op(log: Sequence[str]) -> str | None:
    for pattern in (r"in operator (\S+):\s", r"Missing operator: \[\d+\] (\S+)", r"kernel '(\S+)' not found"):
        for line in log:
            m = re.search(pattern, line)
            if m:
                return m.group(1)
    return None


class ExecuTorchProgram:
    """A ``.pte`` loaded in ExecuTorch's Python runtime (``executorch.runtime``); call it with the program's
    inputs, get its flat list of output tensors."""

    def __init__(self, pte: str | Path | bytes, method: str = "forward"):
        require_modules()
        from executorch.runtime import Runtime, Verification

        data = pte if isinstance(pte, bytes) else _read(pte)
        error = None
        with _native_log() as log:
            try:
                self._program = Runtime.get().load_program(data, verification=Verification.Minimal)
                self._method = self._program.load_method(method)
            except RuntimeError as e:
                error = e
        if error is not None:
            raise _runtime_error("load", error, log) from error
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        flat = _flat_inputs(None, args, kwargs)
        error = None
        with _native_log() as log:
            try:
                outputs = self._method.execute(flat)
            except RuntimeError as e:
                error = e
        if error is not None:
            raise _runtime_error("run", error, log) from error
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise PrecastError(
            f"{path}: cannot read the .pte file ({e.strerror}); give the path export_executorch wrote"
        ) from e


def _runtime_error(what: str, e: RuntimeError, log: Sequence[str]) -> PrecastError:
    op = _failing_op(log)
    if op is None:
        return PrecastError(f"executorch: the runtime failed to {what} the program ({first_line(e)})")
    return PrecastError(
        f"executorch: op {op} fails in ExecuTorch's portable runtime ({first_line(e)}); {_route(op)}",
    )


def run_executorch(pte: str | Path | bytes, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Run a ``.pte`` once in ExecuTorch's Python runtime; its outputs, flattened."""
    return ExecuTorchProgram(pte)(*args, **kwargs)


# ---- what the file holds ----------------------------------------------------------------------------------
def _element_size(scalar_type: Any) -> tuple[str, int]:
    from executorch.exir.tensor import get_scalar_type

    dtype = get_scalar_type(scalar_type)
    return str(dtype).removeprefix("torch."), torch.empty((), dtype=dtype).element_size()


def pte_contents(pte: str | Path | bytes) -> dict[str, Any]:
    """Reads a ``.pte`` back with ExecuTorch's own deserializer: the constant tensors stored in it (bytes by
    dtype, each stored buffer counted once), the size of its constant segment and its operator calls."""
    require_modules()
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import KernelCall, Tensor

    data = pte if isinstance(pte, bytes) else _read(pte)
    program = deserialize_pte_binary(data).program
    plan = program.execution_plan[0]
    by_dtype: Counter[str] = Counter()
    buffers: set[int] = set()
    count = 0
    for value in plan.values:
        t = value.val
        # constants: data_buffer_idx > 0 (index 0 is the reserved empty buffer) and no memory-plan allocation
        if isinstance(t, Tensor) and t.data_buffer_idx > 0 and t.allocation_info is None:
            if t.data_buffer_idx in buffers:
                continue
            buffers.add(t.data_buffer_idx)
            name, size = _element_size(t.scalar_type)
            by_dtype[name] += math.prod(t.sizes) * size
            count += 1
    names = _operator_names(plan)
    calls: Counter[str] = Counter()
    for chain in plan.chains:
        for ins in chain.instructions:
            if isinstance(ins.instr_args, KernelCall):
                calls[names[ins.instr_args.op_index]] += 1
    return {
        "pte_bytes": len(data),
        "constants": dict(sorted(by_dtype.items())),
        "constant_bytes": sum(by_dtype.values()),
        "constant_tensors": count,
        "constant_buffer_bytes": sum(
            len(b.storage) for b in program.constant_buffer
        ),  # with alignment padding
        "delegates": len(plan.delegates),
        "ops": dict(sorted(calls.items())),
    }


def program_constants(program: ExportedProgram) -> dict[str, int]:
    """The program's parameters, buffers and constants: bytes by dtype, each storage counted once."""
    seen: set[tuple[int, int]] = set()
    by_dtype: Counter[str] = Counter()
    for t in [*program.state_dict.values(), *program.constants.values()]:
        if not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return dict(sorted(by_dtype.items()))


# ---- export -----------------------------------------------------------------------------------------------
def export_executorch(
    program: ExportedProgram,
    path: str | Path,
    *,
    verify: bool = True,
    check_ir_validity: bool = True,
) -> dict[str, Any]:
    """Lower ``program`` (precast's converted program) to ExecuTorch and write it to ``path`` (a ``.pte``).

    ``verify``: run the file once in ExecuTorch's runtime on the program's example inputs before writing it,
    and record the largest difference from the program itself (``info["max_abs_diff"]``; skipped when the
    program has no example inputs). Raises
    :class:`PrecastError` (one line, naming the op and a route that works) when the portable kernels cannot run
    an op, and never leaves a partial file. Returns the file's contents (:func:`pte_contents`) with the
    program's own constant bytes by dtype (``info["program_constants"]``) for comparison.
    """
    require_modules()  # the extra named before the path is checked, as before the split
    out = check_writable(path)
    data, info = lower_executorch(program, verify=verify, check_ir_validity=check_ir_validity)
    with atomic_path(out) as tmp:
        tmp.write_bytes(data)
    return {"path": str(out), **info}


def lower_executorch(
    program: ExportedProgram, *, verify: bool = True, check_ir_validity: bool = True
) -> tuple[bytes, dict[str, Any]]:
    """``export_executorch`` without the file: the ``.pte``'s bytes and what they hold (see there)."""
    require_modules()
    if not isinstance(program, ExportedProgram):
        raise PrecastError(
            f"export_executorch: got {type(program).__name__}; pass the ExportedProgram that precast.convert "
            "returns (ConvertResult.program)"
        )
    et = _lower(program, check_ir_validity)
    _check_kernels(et.executorch_program.execution_plan[0])
    data = bytes(et.buffer)
    info: dict[str, Any] = {**pte_contents(data), "program_constants": program_constants(program)}
    if verify and program.example_inputs is not None:
        args, kwargs = program.example_inputs
        got = ExecuTorchProgram(data)(*_flat_inputs(program, args, kwargs))
        want = [t for t in pytree.tree_leaves(program.module()(*args, **kwargs))]
        info["max_abs_diff"] = max_abs_diff(got, want)
    return data, info


def max_abs_diff(got: Sequence[Any], want: Sequence[Any]) -> float:
    """Largest elementwise difference over paired outputs (in float64); raises if they do not pair up."""
    if len(got) != len(want):
        raise PrecastError(f"executorch: the runtime returned {len(got)} outputs, the program {len(want)}")
    diff = 0.0
    for g, w in zip(got, want, strict=True):
        if isinstance(w, torch.Tensor):
            if g.shape != w.shape or g.dtype != w.dtype:
                raise PrecastError(
                    f"executorch: output {tuple(g.shape)} {g.dtype} where the program gives "
                    f"{tuple(w.shape)} {w.dtype}"
                )
            if w.numel():
                diff = max(diff, (g.double() - w.double()).abs().max().item())
    return diff


# ---- precast.compile(backend="executorch") -----------------------------------------------------------------
def compile_executorch(program: Any, *, verify: bool = True, check_ir_validity: bool = True) -> Any:
    """``precast.compile(program, backend="executorch")``: the ``.pte`` lowered and verified as
    ``export_executorch`` does, loaded in ExecuTorch's runtime behind the program's signature
    (``runtime/signed.SignedModel``; ``precast.save`` writes the ``.pte``)."""
    from precast.runtime.exported import exported_program
    from precast.runtime.signed import from_record, program_record

    where = "precast.compile(backend='executorch')"
    require_modules()
    ep = exported_program(program, where)
    data, info = lower_executorch(ep, verify=verify, check_ir_validity=check_ir_validity)
    summary = ", ".join(f"{k}: {v}" for k, v in info.items() if isinstance(v, (int, float, str)))
    return from_record(
        ExecuTorchProgram(data),
        program_record(ep),
        data,
        engine="executorch",
        where=where,
        facts={"summary": summary},
    )


def load_executorch(path: str | Path, record: dict[str, Any], *, threads: int | None = None) -> Any:
    """A saved ``.pte`` loaded in ExecuTorch's runtime, its calls checked against the record's signature."""
    from precast.runtime.signed import from_record

    if threads is not None:
        raise PrecastError(f"{path}: ExecuTorch's portable runtime takes no thread count here; drop threads=")
    data = _read(path)
    return from_record(
        ExecuTorchProgram(data),
        record,
        data,
        engine="executorch",
        where=str(path),
        facts=dict(record.get("facts") or {}),
    )
