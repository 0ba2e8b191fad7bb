"""The docs kept true to the code: docs/architecture.md names every module of ``precast/`` (and only modules
that exist), and every import a doc's Python example makes from precast resolves.

The examples are import-checked rather than run: most need a model, a file or a minute of compiling; the
imports are what drift when code moves (the ONNX example of docs/backends.md imported three names from modules
that no longer held them).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "precast"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# "### precast/backends/aoti/" headings, then table rows "| `compiler.py` | ... |"
_HEADING = re.compile(r"^###\s+`?precast/([\w/]*?)/?`?\s*$")
_ROW = re.compile(r"^\|\s*`([\w]+\.py)`\s*\|")
# a path anywhere in the text: backends/aoti/compiler.py, precast/ir/program.py
_PATH = re.compile(r"(?<![\w./-])(precast/(?:[a-z_]+/)*[a-z_0-9]+\.py|(?:[a-z_]+/)+[a-z_0-9]+\.py)\b")


def package_modules() -> set[str]:
    return {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and p.name != "__init__.py"
    } | {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in p.parts and p.parent == PACKAGE
    }


def tabled_modules(text: str) -> list[str]:
    """Every module the per-folder tables name, as a path relative to ``precast/``."""
    folder, found = None, []
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            folder = heading.group(1)
            continue
        if line.startswith("## "):
            folder = None
        row = _ROW.match(line)
        if row and folder is not None:
            found.append(f"{folder}/{row.group(1)}" if folder else row.group(1))
    return found


def named_paths(text: str) -> set[str]:
    """Module paths named in the prose and diagrams (``backends/aoti/compiler.py``), relative to ``precast/``;
    paths of the repository's other folders (tests/, benchmarks/, docs/) are not modules."""
    paths = {m.group(1).removeprefix("precast/") for m in _PATH.finditer(text)}
    return {p for p in paths if p.split("/")[0] not in ("tests", "benchmarks", "docs", "examples", "shared")}


def test_architecture_names_every_module_once():
    text = ARCHITECTURE.read_text()
    tabled = tabled_modules(text)
    assert tabled, (
        "docs/architecture.md: no module tables found (### precast/<folder>/ then | `name.py` | rows)"
    )
    twice = sorted({m for m in tabled if tabled.count(m) > 1})
    assert not twice, f"docs/architecture.md names these modules twice: {twice}"
    missing = sorted(package_modules() - set(tabled))
    assert not missing, f"modules docs/architecture.md does not name (add a row each): {missing}"
    gone = sorted(set(tabled) - package_modules())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_architecture_names_only_modules_that_exist():
    text = ARCHITECTURE.read_text()
    gone = sorted(p for p in named_paths(text) if not (PACKAGE / p).exists())
    assert not gone, f"docs/architecture.md names paths that are not modules of precast/: {gone}"


def test_the_checks_can_fail():
    text = "### precast/ir/\n| `program.py` | x |\n| `nope.py` | y |\n## next\n| `a.py` | not in a folder table |\n"
    assert tabled_modules(text) == ["ir/program.py", "ir/nope.py"]
    assert named_paths("see backends/aoti/compiler.py, `precast/codes.py` and tests/arch/x.py") == {
        "backends/aoti/compiler.py",
        "codes.py",
    }


# ---- every doc's Python examples import what exists -------------------------------------------------------------
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_BLOCK = re.compile(r"```(?:python|py)\n(.*?)```", re.S)


def example_imports(text: str) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line in the block's file) for each precast import in the Python code blocks.
    A block that does not parse whole (an elided ``...`` argument, a shell prompt) is read line by line."""
    found = []
    for block in _BLOCK.finditer(text):
        start = text[: block.start()].count("\n") + 2
        try:
            statements = [(node, 0) for node in ast.walk(ast.parse(block.group(1)))]
        except SyntaxError:
            statements = []
            for i, line in enumerate(block.group(1).splitlines()):
                if re.match(r"\s*(from|import)\s+precast", line):
                    try:
                        statements += [(node, i) for node in ast.walk(ast.parse(line.strip()))]
                    except SyntaxError:  # a parenthesised import split over lines: read from there
                        rest = "\n".join(block.group(1).splitlines()[i:])
                        head = rest[: rest.index(")") + 1] if "(" in line else line
                        statements += [(node, i) for node in ast.walk(ast.parse(head.strip()))]
        for node, offset in statements:
            line = start + offset + getattr(node, "lineno", 1) - 1
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "precast":
                found += [(node.module, a.name, line) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, None, line) for a in node.names if a.name.split(".")[0] == "precast"]
    return found


def unresolved(module: str, name: str | None) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] == "precast":
            return f"no module {module}"
        pytest.skip(f"{module} needs {exc.name}, not installed here")
    if name is None or name == "*" or hasattr(mod, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")
        return None
    except ImportError:
        return f"{module} has no {name}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_doc_examples_import_what_exists(doc):
    problems = []
    for module, name, line in example_imports(doc.read_text()):
        why = unresolved(module, name)
        if why:
            problems.append(f"{doc.relative_to(ROOT)}:{line}: {why}")
    assert not problems, "doc examples import names that moved:\n" + "\n".join(problems)


def test_example_imports_are_read_from_partial_blocks():
    text = "```python\nfrom precast.ir.program import Program\nres = convert(m, ...,)\n   bad indent\n```\n"
    assert example_imports(text) == [("precast.ir.program", "Program", 2)]
    assert unresolved("precast.ir.program", "NoSuchName") == "precast.ir.program has no NoSuchName"
