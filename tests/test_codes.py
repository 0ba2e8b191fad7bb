"""The registry of diagnostic codes: every emitted code registered; docs, schema and allow= agree with it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import precast
from precast import codes
from precast.codes import CODES
from precast.ir import diagnostics

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "precast"

# calls that take a diagnostic code: name -> (position of the code argument, position of the severity or None)
CODE_ARG = {
    "Diagnostic": (1, 0),
    "diagnostic": (1, 0),
    "make_diagnostic": (0, None),
    "record": (1, None),
    "PrecastError": (None, None),  # code= only
}
LOOKUPS = {"code", "get"}  # precast.codes.code("x") / codes.get("x"): a registry lookup, checked at run time
# functions that pass along a code they were given (already checked where it was written)
PASS_THROUGH = {
    ("ir/diagnostics.py", "make_diagnostic"),  # Diagnostic(code=registered.name)
    ("ir/diagnostics.py", "record"),
    ("ir/diagnostics.py", "diagnostic"),
    ("ir/diagnostics.py", "raise_errors"),  # PrecastError(code=d.code)
    ("ir/diagnostics.py", "from_error"),  # Diagnostic("error", err.code)
    ("report/build.py", "report"),  # Diagnostic(**saved): a saved report's own records
}


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_diagnostics_record(call: ast.Call, imported: set[str]) -> bool:
    """``record`` is a common word: count only precast.diagnostics.record."""
    f = call.func
    if isinstance(f, ast.Attribute):
        return isinstance(f.value, ast.Name) and f.value.id == "diagnostics"
    return isinstance(f, ast.Name) and f.id in imported


def _arg(call: ast.Call, position: int | None, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    if position is not None and len(call.args) > position:
        arg = call.args[position]
        return None if isinstance(arg, ast.Starred) else arg
    return None


def _lookup_literal(expr: ast.expr) -> str | None:
    """The literal of ``codes.code("x")`` / ``codes.get("x")`` / ``codes.get("x").name`` / ``CODES["x"]``."""
    if isinstance(expr, ast.Attribute) and expr.attr == "name":
        expr = expr.value
    if isinstance(expr, ast.Call) and _call_name(expr.func) in LOOKUPS and expr.args:
        arg = expr.args[0]
    elif isinstance(expr, ast.Subscript) and _call_name(expr.value) == "CODES":
        arg = expr.slice
    else:
        return None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


class _Emissions(ast.NodeVisitor):
    """(code, severity literal or None, where) per emission; problems for codes that are not literals."""

    def __init__(self, filename: str, source: str):
        self.filename = filename
        self.found: list[tuple[str, str | None, str]] = []
        self.problems: list[str] = []
        self.function: list[str] = []
        self.assigned: list[dict[str, list[ast.expr]]] = []  # per enclosing function: name -> assigned values
        self.imported = {
            alias.asname or alias.name
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module == "precast.ir.diagnostics"
            for alias in node.names
            if alias.name == "record"
        } | ({"record"} if filename == "ir/diagnostics.py" else set())

    def visit_FunctionDef(self, node):
        self.function.append(node.name)
        assigned: dict[str, list[ast.expr]] = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(n.value)
        self.assigned.append(assigned)
        self.generic_visit(node)
        self.assigned.pop()
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, call: ast.Call):
        self.generic_visit(call)
        name = _call_name(call.func)
        if name not in CODE_ARG or (name == "record" and not _is_diagnostics_record(call, self.imported)):
            return
        code_pos, sev_pos = CODE_ARG[name]
        where = f"{self.filename}:{call.lineno} ({name})"
        expr = _arg(call, code_pos, "code")
        severity = _arg(call, sev_pos, "severity")
        sev = severity.value if isinstance(severity, ast.Constant) else None
        if expr is None:
            if name == "PrecastError":
                self.found.append(("error", None, where))  # the default code
            elif not self._passes_through():
                self.problems.append(f"{where}: no code argument")
        elif (literals := self._codes(expr)) is not None:
            self.found += [(c, sev, where) for c in literals]
        elif not self._passes_through():
            self.problems.append(
                f"{where}: code {ast.unparse(expr)} is neither a literal nor a registry lookup"
            )

    def _codes(self, expr: ast.expr, depth: int = 0) -> list[str] | None:
        """The literal codes an expression can take; None when it is not made of literals, registry lookups,
        another error's or diagnostic's own ``.code`` (re-raised as it is), or local names assigned those."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return [expr.value]
        if _lookup_literal(expr) is not None:
            return [_lookup_literal(expr)]
        if isinstance(expr, ast.Attribute) and expr.attr == "code":
            return []
        parts = None
        if isinstance(expr, ast.IfExp):
            parts = [expr.body, expr.orelse]
        elif isinstance(expr, ast.BoolOp):
            parts = expr.values
        elif isinstance(expr, ast.Name) and self.assigned and depth < 5:
            parts = self.assigned[-1].get(expr.id)
        if not parts:
            return None
        found = [self._codes(p, depth + 1) for p in parts]
        return None if any(f is None for f in found) else [c for f in found for c in f]

    def _passes_through(self) -> bool:
        return any((self.filename, f) in PASS_THROUGH for f in self.function)


def scan(filename: str, source: str) -> _Emissions:
    visitor = _Emissions(filename, source)
    visitor.visit(ast.parse(source))
    return visitor


def package_emissions() -> tuple[list[tuple[str, str | None, str]], list[str]]:
    found, problems = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        v = scan(str(path.relative_to(PACKAGE)), path.read_text())
        found += v.found
        problems += v.problems
    return found, problems


def test_every_emitted_code_is_registered():
    found, problems = package_emissions()
    assert not problems, "\n".join(problems)
    unregistered = sorted({f"{where}: {code!r}" for code, _, where in found if code not in CODES})
    assert not unregistered, "register these in precast/codes.py:\n" + "\n".join(unregistered)
    # the scan sees the emitters it is meant to see
    emitted = {code for code, _, _ in found}
    assert {"dtype-mismatch", "control-flow", "device-unsupported", "device-check-skipped"} <= emitted


def test_literal_severities_are_the_registry_defaults():
    """A severity written at an emission site is the one the docs table states (emit by code to inherit it)."""
    found, _ = package_emissions()
    wrong = sorted(
        f"{where}: {code} as {sev}, registered as {CODES[code].severity}"
        for code, sev, where in found
        if sev is not None and code in CODES and sev != CODES[code].severity
    )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "source, problem",
    [
        ("def f(c):\n    Diagnostic('info', c, 'm')\n", "neither a literal nor a registry lookup"),
        ("def f(c):\n    raise PrecastError('m', code=c)\n", "neither a literal nor a registry lookup"),
        ("def f(rep, c):\n    diagnostics.record(rep, c + 'x', 'm')\n", "neither a literal"),
        ("def f(e):\n    c = e.name\n    raise PrecastError('m', code=c)\n", "neither a literal"),
    ],
)
def test_scan_rejects_a_non_literal_code(source, problem):
    v = scan("example.py", source)
    assert v.problems and problem in v.problems[0]


def test_scan_accepts_literals_and_lookups():
    source = (
        "def f(rep, node):\n"
        "    Diagnostic('warning', 'noop-region', 'm')\n"
        "    raise PrecastError('m', code=codes.code('control-flow'))\n"
        "    make_diagnostic(code='tolerance', message='m')\n"
        "    diagnostics.record(rep, 'kept-fp32', 'm', node)\n"
        "    record_decisions(graph)\n"
        "    code = exc.code if exc.code == 'fake-run-failed' else 'internal-error'\n"
        "    raise PrecastError('m', code=code)\n"
    )
    v = scan("example.py", source)
    assert not v.problems
    assert [(c, s) for c, s, _ in v.found] == [
        ("noop-region", "warning"),
        ("control-flow", None),
        ("tolerance", None),
        ("kept-fp32", None),
        ("internal-error", None),  # exc.code passes along a code checked where it was written
    ]


def test_codes_named_in_the_issues_are_registered():
    named = {
        "dtype-mismatch", "unused-enabled-input", "noop-region", "control-flow", "device-unsupported",
        "ambient-autocast", "not-bitwise", "no-regions", "tolerance", "tolerance-not-met", "tolerance-unmet",
        "kept-fp32", "calibrated", "ranges-from-example-inputs", "data-max-inactive", "autocast-promote",
        "autocast-banned", "composite-not-traced", "fake-run-failed", "written-constant-not-folded",
        "fp16-clamped", "flush-to-zero", "verification-skipped", "device-check-skipped", "measured-error",
    }  # fmt: skip
    assert named <= set(CODES)


def test_registry_entries_are_complete():
    for c in CODES.values():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", c.name), c.name
        assert c.severity in codes.SEVERITIES, c
        assert c.meaning and "|" not in c.name
        # an error must say what to do about it
        assert c.fix or c.severity != "error", c.name
    assert CODES["not-bitwise"].severity == "warning"
    assert CODES["measured-error"].severity == "info"


# ---- what the registry drives ---------------------------------------------------------------------------
def test_docs_table_equals_the_registry():
    text = (ROOT / "docs" / "report.md").read_text()
    assert codes.doc_table(text) == codes.markdown_table(), (
        "docs/report.md is out of date: run python -c 'import precast.codes as c; c.write_docs()'"
    )
    listed = re.findall(r"^\| `([^`]+)` \|", codes.doc_table(text), re.M)
    assert listed == list(CODES)


def test_schema_enum_equals_the_registry():
    schema = json.loads((ROOT / "docs" / "report.schema.json").read_text())
    enum = schema["$defs"]["diagnostic"]["properties"]["code"]["enum"]
    assert enum == list(CODES)


def test_allow_accepts_every_allowable_registered_code():
    allowable = [c.name for c in CODES.values() if c.allowable]
    assert diagnostics.parse_allow(allowable) == sorted(allowable)
    for name in ("not-bitwise", "device-check-skipped", "tolerance-unmet", "autocast-promote"):
        assert diagnostics.parse_allow(name) == [name]


@pytest.mark.parametrize("name", ["nope", "error", "internal-error"])
def test_allow_rejects_unregistered_and_generic_codes(name):
    with pytest.raises(precast.PrecastError, match="unknown diagnostic code"):
        diagnostics.parse_allow((name,))


def test_make_diagnostic_takes_the_registry_severity():
    for c in CODES.values():
        assert diagnostics.make_diagnostic(c.name, "m").severity == c.severity
    assert diagnostics.make_diagnostic("not-bitwise", "m", severity="info").severity == "info"
    with pytest.raises(KeyError, match="not registered"):
        diagnostics.make_diagnostic("nope", "m")


def test_record_applies_allow():
    from precast.report.model import Report

    rep = Report(allowed=["control-flow"])
    d = diagnostics.record(rep, "control-flow", "m", "cond")
    assert (d.severity, d.allowed, d.node) == ("warning", True, "cond")
    assert rep.diagnostics == [d]
