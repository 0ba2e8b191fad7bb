"""Dtype reads the fp32 export fixed: what policy "torch" given a program cannot honor as eager autocast would,
said in one ``dtype-read-at-export`` info per kind (``precast.pipeline.checks`` runs it before classify).

- ``dtype_reads_at_export``: ``x.to(input_dtype)`` traced in fp32 records float32 as the dtype it read.
- ``shared_noop_conversions``: ``v.float()`` of a float32 ``v`` returns ``v`` itself, so a later read of ``v``
  is traced as a read of the conversion; under autocast ``v`` is low precision and the conversion is not.

Input: the program's graph. Output: the nodes (and readers) concerned; diagnostics in the log.
"""

from __future__ import annotations

import ast
import re

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast.dtypes import long_name
from precast.errors import user_source_code, user_source_line, where
from precast.ir.diagnostics import DiagnosticLog, record
from precast.ir.program import program_devices
from precast.policy.torch_tables import Category, category

# conversions whose target dtype is written into the graph (``x.to(input_dtype)`` records the dtype it read);
# ``type_as`` reads its other tensor when it runs and is not one of them
DTYPE_CONVERSIONS = (
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.to.device,
    torch.ops.aten._to_copy.default,
)
# a source line that names float32 itself (``h.to(torch.float32)``, ``x.float()``) asked for float32: not a read
_SPELLS_FLOAT32 = re.compile(r"float32|\.float\(|torch\.float\b")


def dtype_reads_at_export(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Top-level dtype conversions to float32 of a value the export recorded as float32, whose source line
    (when recorded) does not name float32 itself: in an fp32 export, the trace of a dtype read
    (``weight * h.to(input_dtype)`` in Qwen3's RMSNorm), a no-op there that eager autocast would not make one
    (``input_dtype`` is bf16 there when ``h`` comes out of a linear)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in DTYPE_CONVERSIONS or not node.args:
            continue
        src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        target = node.kwargs.get("dtype") or next(
            (a for a in node.args[1:] if isinstance(a, torch.dtype)), None
        )
        if not isinstance(src, torch.Tensor) or src.dtype != torch.float32 or target != torch.float32:
            continue
        if _SPELLS_FLOAT32.search(user_source_code(node) or ""):
            continue
        found.append(node)
    return found


def check_dtype_reads(ep: ExportedProgram, rep: DiagnosticLog) -> None:
    """Policy torch given a program: dtype reads the export fixed and no-op conversions whose value other readers
    share (``dtype-read-at-export``, info, once per kind), naming the first and pointing to the module route,
    which traces the forward under autocast as eager runs it."""
    found = dtype_reads_at_export(ep.graph)
    if found:
        first = found[0]
        code = user_source_code(first)
        record(
            rep,
            "dtype-read-at-export",
            f"{where(first)}: converts a float32 value to float32{f' (`{code}`)' if code else ''}; {len(found)} "
            "such conversion(s) in the program: code that reads a tensor's dtype while tracing "
            "(`x.to(input_dtype)`) fixed float32 there when the program was exported, where eager torch.autocast "
            f"would read the low dtype; {_FOLLOWS_PROGRAM}",
            first,
            fix=_MODULE_ROUTE,
        )
    shared = shared_noop_conversions(ep.graph, _autocast_device(ep))
    if shared:
        conv, reader = shared[0]
        code, at = user_source_code(conv), user_source_code(reader)
        record(
            rep,
            "dtype-read-at-export",
            f"{where(conv)}: a conversion to {long_name(_target_dtype(conv))} the export recorded as a no-op"
            f"{f' (`{code}`)' if code else ''} returns the value itself, so the program cannot tell whether "
            f"{where(reader)}{f' (`{at}`)' if at else ''} read the conversion or the value before it, which "
            f"eager torch.autocast holds in the low dtype; {len(shared)} such read(s) in the program; "
            f"{_FOLLOWS_PROGRAM}",
            conv,
            fix=_MODULE_ROUTE,
        )


_FOLLOWS_PROGRAM = (
    "this program converts (and verifies) as the program run under torch.autocast, which can differ from eager "
    "autocast of the model"
)
_MODULE_ROUTE = (
    "convert the module instead: precast.convert(model, example_inputs, policy='torch') traces its forward "
    "under autocast, as eager runs it"
)
# the tensor methods that convert a dtype (each recorded as one of DTYPE_CONVERSIONS)
_CONVERSION_METHODS = {"float", "half", "bfloat16", "double", "to", "type"}
# dtypes eager autocast computes in (the low ones) or casts to (float32); it never changes a float64 value
_AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _target_dtype(node: torch.fx.Node) -> torch.dtype | None:
    return node.kwargs.get("dtype") or next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None)


def _autocast_device(ep: ExportedProgram) -> str:
    constants, inputs = program_devices(ep)
    devices = set(constants) | set(inputs)
    return "cuda" if "cuda" in devices else "cpu"


def shared_noop_conversions(
    graph: torch.fx.Graph, device_type: str
) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(conversion, reader) pairs where the export recorded a dtype conversion as a no-op (``v.float()`` of a
    float32 ``v`` returns ``v`` itself, so every later read of ``v`` is traced as a read of the conversion) and
    the reader may have read the value before it, which eager autocast computes in the low dtype (it comes out
    of a lower-precision op, such as a linear) where the conversion's output is not. A reader on the conversion's
    own line reads the conversion; one on another line may have read the value before it when its code names
    the converted value (``v2`` of ``einsum(..., v2.float())``) or it runs in another function; a line that
    rebinds the name (``x = x.float()``) leaves no other name to read."""
    low = _low_under_autocast(graph, device_type)
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in DTYPE_CONVERSIONS or not node.args:
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        target = _target_dtype(node)
        if not isinstance(val, torch.Tensor) or val.dtype != target or target not in _AUTOCAST_DTYPES:
            continue
        if _root(src) not in low:
            continue
        found += [(node, r) for r in _ambiguous_readers(node)]
    return found


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The value a chain of no-op conversions converts (``h.float()`` then ``h.to(torch.float32)``: ``h``)."""
    while (
        node.op == "call_function"
        and node.target in DTYPE_CONVERSIONS
        and isinstance(node.args[0], torch.fx.Node)
    ):
        val, src = node.meta.get("val"), node.args[0].meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.dtype == src.dtype):
            break
        node = node.args[0]
    return node


def _low_under_autocast(graph: torch.fx.Graph, device_type: str) -> set[torch.fx.Node]:
    """The nodes whose value eager autocast computes in its low dtype: outputs of lower-precision ops with
    autocast-eligible inputs, and of ops outside autocast's tables (views, activations) whose floating inputs
    are all such values; never a placeholder, a weight, or a dtype conversion."""
    low: set[torch.fx.Node] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if (
            node.op != "call_function"
            or not isinstance(val, torch.Tensor)
            or val.dtype not in _AUTOCAST_DTYPES
        ):
            continue
        if node.target in DTYPE_CONVERSIONS or not isinstance(node.target, torch._ops.OpOverload):
            continue
        cat = category(device_type, node.target)
        if cat == Category.LOWER_PRECISION_FP:
            low.add(node)
            continue
        floats = [
            a
            for a in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, torch.fx.Node)
            and isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].is_floating_point()
        ]
        if cat is None and floats and all(a in low for a in floats):
            low.add(node)
    return low


def _ambiguous_readers(conv: torch.fx.Node) -> list[torch.fx.Node]:
    readers = [u for u in conv.users if u.target is not torch.ops.aten._assert_tensor_metadata.default]
    home = _user_frame(conv)
    if home is None:  # no source: the program cannot tell which value any reader beyond the first read
        return readers[1:]
    names = _converted_names(home[3])
    out = []
    for reader in readers:
        frame = next(
            (f for f in reversed(_parse_frames(reader)) if f[0] == home[0] and f[2] == home[2]), None
        )
        if frame is None:
            out.append(reader)  # read in another function: through a name bound to the value, or not
        elif frame[1] != home[1] and (names is None or any(_names(code=frame[3], name=n) for n in names)):
            out.append(reader)
    return out


def _parse_frames(node: torch.fx.Node) -> list[tuple[str, str, str, str]]:
    """(path, line, function, code) per frame of the node's stack trace, outermost first."""
    frames: list[tuple[str, str, str, str]] = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        text = line.strip()
        if text.startswith('File "'):
            path, _, rest = text[6:].partition('", line ')
            lineno, _, func = rest.partition(", in ")
            frames.append((path, lineno, func, ""))
        elif frames and not frames[-1][3] and text:
            frames[-1] = (*frames[-1][:3], text)
    return frames


def _user_frame(node: torch.fx.Node) -> tuple[str, str, str, str] | None:
    """The frame of the node's user source line (``precast.errors.user_source_line``), when recorded."""
    at = user_source_line(node)
    if at is None:
        return None
    path, _, lineno = at.rpartition(":")
    return next((f for f in reversed(_parse_frames(node)) if f[0] == path and f[1] == lineno), None)


def _converted_names(code: str) -> set[str] | None:
    """The names whose value the line's dtype conversions convert and the line does not rebind (``v2`` in
    ``einsum(..., v2.float())``; none in ``x = x.float()`` or ``self.lin(x).float()``); None when the line does
    not parse alone (a line of a longer statement)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    converted = {
        ast.unparse(n.func.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in _CONVERSION_METHODS
        and isinstance(n.func.value, (ast.Name, ast.Attribute))
    }
    bound = {
        ast.unparse(e)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        for e in ast.walk(t)
        if isinstance(e, (ast.Name, ast.Attribute))
    }
    return converted - bound


def _names(code: str, name: str) -> bool:
    """Whether ``code`` reads ``name`` (a name or a dotted attribute) as a whole."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", code) is not None
