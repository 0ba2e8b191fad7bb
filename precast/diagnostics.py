"""Diagnostics at conversion: problems precast finds in a program, each with a node, a source line and a fix.

Every check adds :class:`precast.report.Diagnostic` records to the report. Errors stop the conversion (one
``PrecastError`` naming the node, the user's line and the fix) unless their code is listed in
``convert(..., allow=(code, ...))``; an allowed error is kept in the report as a warning.

The codes, their default severities, meanings and fixes are registered in :mod:`precast.codes`; build a
diagnostic by code with :func:`make_diagnostic` (or :func:`record`), which takes the severity from there.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from precast import codes
from precast.errors import PrecastError, first_line, module_path, user_source_line, where
from precast.report import Diagnostic, Report

# every registered code (kept under this name for callers that list them)
CODES = tuple(codes.CODES)
# higher-order ops that carry autocast meaning and are inlined by precast.regions; every other HOP with
# subgraph arguments is control flow that precast does not look inside
REGION_HOPS = {"wrap_with_autocast", "wrap_with_set_grad_enabled"}


def parse_allow(allow) -> list[str]:
    """Validate ``convert(allow=...)``: a registered code or an iterable of them."""
    names = [allow] if isinstance(allow, str) else list(allow or ())
    choices = codes.allowable()
    unknown = [c for c in names if c not in choices]
    if unknown:
        raise PrecastError(f"allow={unknown!r}: unknown diagnostic code; choose from {', '.join(choices)}")
    return sorted(set(names))


def make_diagnostic(
    code: str,
    message: str,
    node: torch.fx.Node | str | None = None,
    *,
    severity: str | None = None,
    fix: str | None = None,
    location: str | None = None,
    module: str | None = None,
    region: int | None = None,
) -> Diagnostic:
    """A Diagnostic for a registered ``code``, its severity the registry's unless given; a node fills in its
    name, the user's source line and the module path (explicit ``location``/``module`` win)."""
    registered = codes.get(code)
    if isinstance(node, torch.fx.Node):
        location = location or user_source_line(node)
        module = module if module is not None else module_path(node)
        node = node.name
    return Diagnostic(
        severity=severity or registered.severity,
        code=registered.name,
        message=message,
        node=node,
        location=location,
        fix=fix,
        module=module,
        region=region,
    )


def record(
    rep: Report, code: str, message: str, node: torch.fx.Node | str | None = None, **fields
) -> Diagnostic:
    """``add(rep, make_diagnostic(code, message, node, **fields))``: build and record in one call."""
    return add(rep, make_diagnostic(code, message, node, **fields))


def diagnostic(
    severity: str,
    code: str,
    message: str,
    node: torch.fx.Node | None = None,
    fix: str | None = None,
    region: int | None = None,
) -> Diagnostic:
    """The older spelling of :func:`make_diagnostic`, with the severity given first."""
    return make_diagnostic(code, message, node, severity=severity, fix=fix, region=region)


def add(rep: Report, diag: Diagnostic) -> Diagnostic:
    """Record ``diag``; an error whose code the user allowed becomes a warning."""
    if diag.severity == "error" and diag.code in rep.allowed:
        diag.severity = "warning"
        diag.allowed = True
    rep.diagnostics.append(diag)
    return diag


def raise_errors(rep: Report) -> None:
    """Stop the conversion at the first error diagnostic, as one line with the fix and how to allow it."""
    for d in rep.diagnostics:
        if d.severity == "error":
            err = PrecastError(error_text(d), code=d.code, node=d.node, source=d.location)
            err.report = rep  # type: ignore[attr-defined]
            err.diagnostic = d  # type: ignore[attr-defined]
            raise err


def error_text(d: Diagnostic) -> str:
    text = d.message
    if d.fix and d.fix not in text:
        text += f"; fix: {d.fix}"
    return f"{text} [{d.code}; pass allow=('{d.code}',) / --allow {d.code} to convert anyway]"


# ---- checks before classification ------------------------------------------------------------------------


def check_program(ep: ExportedProgram, gm: torch.fx.GraphModule, regions: list, rep: Report) -> None:
    """Checks on the exported program and its inlined regions; raises on an error that is not allowed."""
    check_unused_enabled_inputs(ep, regions, rep)
    check_noop_regions(ep, regions, rep)
    check_control_flow(gm, rep)
    raise_errors(rep)


def check_unused_enabled_inputs(ep: ExportedProgram, regions: list, rep: Report) -> None:
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


def program_device_types(ep: ExportedProgram) -> set[str]:
    out = set()
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            out.add(val.device.type)
    for v in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(v, torch.Tensor):
            out.add(v.device.type)
    return out or {"cpu"}


def check_noop_regions(ep: ExportedProgram, regions: list, rep: Report) -> None:
    devices = program_device_types(ep)
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


def check_control_flow(gm: torch.fx.GraphModule, rep: Report) -> None:
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


# ---- errors raised while classifying ------------------------------------------------------------------


def classify_error_handler(rep: Report) -> Callable[[PrecastError], None]:
    """For ``classify(on_error=...)``: records the error as a diagnostic; re-raises unless allowed."""

    def handle(err: PrecastError, node: torch.fx.Node | None = None) -> None:
        d = add(rep, from_error(err, node))
        if d.severity == "error":
            raise_errors(rep)

    return handle


def from_error(err: PrecastError, node: torch.fx.Node | None = None) -> Diagnostic:
    message = str(err)
    fix = None
    if "; cast" in message:
        message, _, fix = message.partition("; ")
    elif ". This op would fail" in message:
        message, _, rest = message.partition(". ")
        fix = rest.partition(": ")[2] or rest
    return Diagnostic(
        "error",
        err.code,
        message,
        node=err.node or (node.name if node is not None else None),
        location=err.source or (user_source_line(node) if node is not None else None),
        fix=fix,
        module=module_path(node) if node is not None else None,
    )


# ---- checks on the converted program ------------------------------------------------------------------


def check_runs(ep: ExportedProgram | torch.nn.Module, args: tuple, kwargs: dict, rep: Report) -> bool:
    """Run the converted program once, node by node; a failing op becomes a ``device-unsupported`` diagnostic
    naming it, and the result is False. When the run cannot be made or fails before any op (inputs that do not
    fit the signature), a ``device-check-skipped`` warning says why: never a silent success."""
    return run_checked(ep, args, kwargs, rep)[0]


def run_checked(
    program: ExportedProgram | torch.nn.Module, args: tuple, kwargs: dict, rep: Report
) -> tuple[bool, Any]:
    """``check_runs`` that also returns the outputs of its run (None when it could not run), so verification
    compares them instead of running the converted program a second time. ``program``: a program, or the
    module ``program.module()`` built (unlifting is costly: build it once)."""
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
        return True, None
    interp = _NodeInterpreter(module)
    try:
        with torch.no_grad():
            out = interp.run(*flat)
    except Exception as exc:
        node = interp.current
        if node is None or node.op != "call_function":
            _record_skipped_run(rep, node, exc)
            return True, None
        _record_unsupported(rep, node, exc)
        return False, None
    spec = getattr(module, "_out_spec", None)
    if spec is None:
        return True, out
    return True, torch.utils._pytree.tree_unflatten(torch.utils._pytree.tree_leaves(out), spec)


def _record_skipped_run(rep: Report, node: torch.fx.Node | None, exc: Exception) -> None:
    at = where(node) if node is not None else "the converted program"
    record(
        rep,
        "device-check-skipped",
        f"the device check did not finish: {at} failed before any op could be checked: {first_line(exc)}",
        node,
    )


def _record_unsupported(rep: Report, node: torch.fx.Node, exc: Exception) -> None:
    device = rep.device_type or "cpu"
    dtypes = sorted(
        {
            str(v.meta["val"].dtype).removeprefix("torch.")
            for v in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
        }
    )
    record(
        rep,
        "device-unsupported",
        f"{where(node)}: {_op(node)} fails on {device} with inputs {', '.join(dtypes) or '-'}: {first_line(exc)}",
        node,
        fix="keep this op in float32 (policy='rules' with exclude_nodes/exclude_ops, or take it out of the "
        "autocast region)",
    )


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


# ---- ambient autocast at call time ----------------------------------------------------------------------


class AmbientAutocastWarning(UserWarning):
    """The converted module was called under ``torch.autocast``."""


AMBIENT_MESSAGE = (
    "precast: a converted program was called under torch.autocast({devices}); eager autocast re-casts on top of "
    "precast's decisions (ops precast kept in float32 run in low precision, weights are cast again on every "
    "call). Call it outside the autocast block [ambient-autocast]"
)


def _warn_if_ambient(module: torch.nn.Module, args: Any) -> None:
    if getattr(module, "_precast_warned_ambient", False):
        return
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if on:
        module._precast_warned_ambient = True
        warnings.warn(AMBIENT_MESSAGE.format(devices=", ".join(on)), AmbientAutocastWarning, stacklevel=3)


def guard_module(module: torch.nn.Module) -> torch.nn.Module:
    """Register the ambient-autocast warning on a module built from a converted program."""
    if not getattr(module, "_precast_guarded", False):
        module.register_forward_pre_hook(_warn_if_ambient)
        module._precast_guarded = True
    return module


def install_autocast_guard(ep: ExportedProgram) -> ExportedProgram:
    """Make ``ep.module()`` return modules that warn once when called under an ambient ``torch.autocast``.

    The hook lives on this ExportedProgram object only: a program saved with ``torch.export.save`` and loaded
    again, or copied by ``run_decompositions``, builds plain modules (use ``precast.diagnostics.guard_module``).
    """
    if getattr(ep, "_precast_guarded", False):
        return ep
    original = ep.module

    @functools.wraps(original)
    def module(*a, **k):
        return guard_module(original(*a, **k))

    ep.module = module  # type: ignore[method-assign]
    ep._precast_guarded = True  # type: ignore[attr-defined]
    return ep
