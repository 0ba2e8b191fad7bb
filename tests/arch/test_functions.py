"""No function in ``precast/`` over 60 lines (issue 42): a long function becomes named phases.

Counted as a reader meets it: from the ``def`` line to the function's last line, docstring and comments
included (``end_lineno - lineno + 1``); a nested function counts in its outer function's span and on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "precast"
MAX_FUNCTION_LINES = 60


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_function_over_60_lines():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split into named phases):\n" + "\n".join(
        found
    )


def test_the_count_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f: 61 lines"]
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", "m.py") == []
