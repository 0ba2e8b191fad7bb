"""Checks: problems precast finds in a program, each a diagnostic with a node, a source line and a fix.

Before classify: control flow precast does not look inside (``control-flow``), regions whose enabled input is
unused, regions that change nothing, and (policy torch given a program) dtype reads the export fixed
(``dtype-read-at-export``, in ``pipeline/dtype_reads.py``). After conversion: the device check runs the converted program node by
node and names the op that fails on the device (``device-unsupported``), or says why it could not run.
Errors stop the conversion unless the user allowed their code (``precast.ir.diagnostics``).

Input: the program and its inlined regions (before classify), or the converted program and example inputs
(the device check). Output: diagnostics in the log; the device check also returns its run: the outputs, or
the op that failed as data (``DeviceFailure``), which the device fallback (``pipeline/device_fallback.py``) reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.utils._pytree import PyTree

from precast import codes
from precast.dtypes import long_name
from precast.errors import first_line, where
from precast.ir.diagnostics import DiagnosticLog, raise_errors, record
from precast.ir.inputs import normalize_inputs
from precast.ir.program import program_devices
from precast.pipeline.dtype_reads import (  # noqa: F401 - the checks' callers import them from here
    check_dtype_reads,
    dtype_reads_at_export,
    shared_noop_conversions,
)

# every registered code (kept under this name for callers that list them)
CODES = tuple(codes.CODES)
# higher-order ops that carry autocast meaning and are inlined by precast.passes.regions; every other HOP with
# subgraph arguments is control flow that precast does not look inside
REGION_HOPS = {"wrap_with_autocast", "wrap_with_set_grad_enabled"}


# ---- checks before classification ------------------------------------------------------------------------


def check_program(ep: ExportedProgram, gm: torch.fx.GraphModule, regions: list, rep: DiagnosticLog) -> None:
    """Checks on the exported program and its inlined regions; raises on an error that is not allowed."""
    check_unused_enabled_inputs(ep, regions, rep)
    check_noop_regions(ep, regions, rep)
    check_control_flow(gm, rep)
    raise_errors(rep)


def check_unused_enabled_inputs(ep: ExportedProgram, regions: list, rep: DiagnosticLog) -> None:
    """A bool input with no users in a program with regions: export specialized ``enabled=flag`` to the traced
    value, so the flag no longer does anything."""
    if not regions:
        return
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name != "USER_INPUT":
            continue
        value = getattr(spec.arg, "value", None)
        node = placeholders.get(spec.arg.name)
        if not isinstance(value, bool) or (node is not None and node.users):
            continue
        suspects = [r for r in regions if r.enabled == value] or list(regions)
        names = "; ".join(r.describe() for r in suspects)
        plural = len(suspects) > 1
        record(
            rep,
            "unused-enabled-input",
            f"input '{spec.arg.name}' is not used by the program: export fixed it to {value}, so the autocast "
            f"region{'s' if plural else ''} {names} {'are' if plural else 'is'} always {'on' if value else 'off'}",
            spec.arg.name,
            location=suspects[0].source,
            fix=f"export one program per value of '{spec.arg.name}' (or make enabled= a constant); "
            "passing another value at run time changes nothing",
            module=suspects[0].module,
            region=suspects[0].id,
        )


def check_noop_regions(ep: ExportedProgram, regions: list, rep: DiagnosticLog) -> None:
    constants, inputs = program_devices(ep)  # every constant at its device, streamed ones at meta
    devices = set(constants + inputs) or {"cpu"}
    for r in regions:
        if r.device_type in devices:
            continue
        record(
            rep,
            "noop-region",
            f"autocast region {r.describe()} does nothing: the program's tensors are on "
            f"{', '.join(sorted(devices))}, not {r.device_type}",
            location=r.source,
            fix=f"use torch.autocast('{sorted(devices)[0]}', ...) for this program, or move the model to "
            f"{r.device_type} before exporting",
            module=r.module,
            region=r.id,
        )


def control_flow_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        if node.target.name() in REGION_HOPS:
            continue
        flat = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        if any(
            isinstance(a, torch.fx.Node)
            and a.op == "get_attr"
            and isinstance(_attr(gm, a.target), torch.fx.GraphModule)
            for a in flat
        ):
            found.append(node)
    return found


def _attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def check_control_flow(gm: torch.fx.GraphModule, rep: DiagnosticLog) -> None:
    """precast does not convert inside control-flow subgraphs: say so, naming each one."""
    for node in control_flow_nodes(gm):
        kind = node.target.name()
        record(
            rep,
            "control-flow",
            f"{where(node)}: torch.{kind} subgraphs are not converted by precast (their ops and any autocast "
            "region inside would run as written, casting weights on every call)",
            node,
            fix=f"move the autocast region out of the {kind} branches, or allow 'control-flow' to convert the "
            "rest of the program and leave the subgraphs as written",
        )


# ---- checks on the converted program ------------------------------------------------------------------


def check_runs(ep: ExportedProgram | torch.nn.Module, args: tuple, kwargs: dict, rep: DiagnosticLog) -> bool:
    """Run the converted program once, node by node; a failing op becomes a ``device-unsupported`` diagnostic
    naming it, and the result is False. When the run cannot be made or fails before any op (inputs that do not
    fit the signature), a ``device-check-skipped`` warning says why: never a silent success."""
    return run_checked(ep, args, kwargs, rep)[0]


@dataclass(frozen=True)
class DeviceFailure:
    """An op of the converted program that failed on the device: the node, what it raised, the device it ran
    on and its inputs' dtypes (data for the device fallback, not a message to parse)."""

    node: torch.fx.Node
    error: Exception
    device: str
    dtypes: tuple[str, ...]

    @property
    def what(self) -> str:
        """``aten.x.default fails on cpu with inputs float16: <the error's first line>``"""
        return f"{_op(self.node)} fails on {self.device} with inputs {', '.join(self.dtypes) or '-'}: {first_line(self.error)}"


@dataclass
class DeviceRun:
    """One run of the converted program on the device: its outputs (None when it did not run through), and the
    op that failed, if one did."""

    ok: bool
    outputs: PyTree = None
    failure: DeviceFailure | None = None


def run_checked(
    program: ExportedProgram | torch.nn.Module, args: tuple, kwargs: dict, rep: DiagnosticLog
) -> tuple[bool, PyTree]:
    """``check_runs`` that also returns the outputs of its run (None when it could not run), so verification
    compares them instead of running the converted program a second time. ``program``: a program, or the
    module ``program.module()`` built (unlifting is costly: build it once)."""
    run = run_on_device(program, args, kwargs, rep)
    return run.ok, run.outputs


def run_on_device(
    program: ExportedProgram | torch.nn.Module, args: tuple, kwargs: dict, rep: DiagnosticLog
) -> DeviceRun:
    """Run the converted program once, node by node: the outputs, or the op that failed (recorded as a
    ``device-unsupported`` diagnostic too); ``device-check-skipped`` when it could not run at all."""
    module = program.module() if isinstance(program, ExportedProgram) else program
    try:
        flat = _flat_inputs(module, args, kwargs)
    except Exception as exc:
        record(
            rep,
            "device-check-skipped",
            f"the device check did not run: the example inputs do not fit the program's signature "
            f"({first_line(exc)})",
            fix="pass example inputs shaped as the program's forward takes them",
        )
        return DeviceRun(True)
    interp = _NodeInterpreter(module)
    try:
        with torch.no_grad():
            out = interp.run(*flat)
    except Exception as exc:
        node = interp.current
        if node is None or node.op != "call_function":
            _record_skipped_run(rep, node, exc)
            return DeviceRun(True)
        failure = _failure(node, exc)
        record(
            rep,
            "device-unsupported",
            f"{where(node)}: {failure.what}",
            node,
            fix="keep this op in float32 (policy='rules' with exclude_nodes/exclude_ops, or take it out of the "
            "autocast region)",
        )
        return DeviceRun(False, failure=failure)
    spec = getattr(module, "_out_spec", None)
    if spec is None:
        return DeviceRun(True, out)
    return DeviceRun(True, torch.utils._pytree.tree_unflatten(torch.utils._pytree.tree_leaves(out), spec))


def _record_skipped_run(rep: DiagnosticLog, node: torch.fx.Node | None, exc: Exception) -> None:
    at = where(node) if node is not None else "the converted program"
    record(
        rep,
        "device-check-skipped",
        f"the device check did not finish: {at} failed before any op could be checked: {first_line(exc)}",
        node,
    )


def _failure(node: torch.fx.Node, exc: Exception) -> DeviceFailure:
    values = [
        v.meta["val"]
        for v in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
    ]
    device = values[0].device.type if values else "cpu"  # the device the failing op ran on
    return DeviceFailure(node, exc, device, tuple(sorted({long_name(v.dtype) for v in values})))


def _op(node: torch.fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def _flat_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    """Flatten (args, kwargs) as the unlifted module's graph placeholders expect them (raises when they do not
    fit its input spec)."""
    return list(torch.fx._pytree.tree_flatten_spec((args, kwargs), module._in_spec))


class _NodeInterpreter(torch.fx.Interpreter):
    def __init__(self, module):
        super().__init__(module)
        self.current: torch.fx.Node | None = None

    def run_node(self, n):
        self.current = n
        return super().run_node(n)


def example_batch(ep: ExportedProgram, inputs: tuple[tuple, dict] | None) -> tuple[tuple, dict] | None:
    """The inputs to run the program on here: the given ones, else the program's example inputs; None when
    there are none or they are on a device this machine lacks."""
    if inputs is None:
        if ep.example_inputs is None:
            return None
        inputs = normalize_inputs(ep.example_inputs)
    for t in pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda" and not torch.cuda.is_available():
            return None
    return inputs
