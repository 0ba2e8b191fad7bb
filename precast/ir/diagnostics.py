"""Diagnostics as data: what a stage found, with a node, the user's source line and a fix.

Every stage records ``Diagnostic`` records into a ``DiagnosticLog`` (the ``Report`` the conversion returns is
one). Errors stop the conversion (``raise_errors``: one ``PrecastError`` naming the node, the user's line and
the fix) unless their code is listed in ``convert(..., allow=(code, ...))``; an allowed error is kept as a
warning. Codes, their severities, meanings and fixes are registered in :mod:`precast.codes`; build a
diagnostic by code with :func:`make_diagnostic` (or :func:`record`), which takes the severity from there.

Input: a code, a message, optionally the node. Output: records in the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from precast import codes
from precast.errors import PrecastError, module_path, user_source_line

# every registered code (kept under this name for callers that list them)
CODES = tuple(codes.CODES)


@dataclass
class Diagnostic:
    severity: str  # "error" | "warning" | "info"
    code: str
    message: str
    node: str | None = None
    location: str | None = None  # user's source line, file.py:LINE
    fix: str | None = None  # what to do
    module: str | None = None
    region: int | None = None
    allowed: bool = False  # an error downgraded by convert(allow=...)


@dataclass
class DiagnosticLog:
    """Where stages record what they find; ``allowed``: codes whose errors are downgraded to warnings."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)  # diagnostic codes downgraded from error to warning

    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]


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
    rep: DiagnosticLog, code: str, message: str, node: torch.fx.Node | str | None = None, **fields
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


def add(rep: DiagnosticLog, diag: Diagnostic) -> Diagnostic:
    """Record ``diag``; an error whose code the user allowed becomes a warning."""
    if diag.severity == "error" and diag.code in rep.allowed:
        diag.severity = "warning"
        diag.allowed = True
    rep.diagnostics.append(diag)
    return diag


def raise_errors(rep: DiagnosticLog) -> None:
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
