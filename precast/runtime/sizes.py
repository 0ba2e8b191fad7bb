"""Compound size expressions of a program's signature (``2*s0``, ``s0 + s1``), as ``str(sympy expr)`` writes them
into a cache manifest: parsed only when they hold nothing but size symbols, integers and arithmetic (so evaluating
one read from a file cannot run anything else), and evaluated once the symbols are bound by a call's inputs.

Input: the text of an expression; the sizes bound so far. Output: its value, or None.
"""

from __future__ import annotations

import re
from typing import Any

# a compound size expression as ``str(sympy expr)`` writes it (``2*s0``, ``s0 + s1``): only size symbols, integers
# and arithmetic, so evaluating one read from a manifest cannot run anything else
_EXPR = re.compile(r"^(?:[su]\d+|\d+|\s|[-+*/()]|Mod|FloorDiv|,)+$")


def parse_expr(text: str) -> Any:
    """A compound size expression (``2*s0``) as sympy; None when it is not one precast can evaluate safely."""
    if not _EXPR.fullmatch(text):
        return None
    import sympy

    try:
        return sympy.sympify(text, locals={n: sympy.Symbol(n) for n in re.findall(r"[su]\d+", text)})
    except (sympy.SympifyError, TypeError, SyntaxError):
        return None


def evaluate(expr: Any, bound: dict[str, int]) -> int | None:
    if expr is None:
        return None
    names = {str(s) for s in expr.free_symbols}
    if not names <= bound.keys():
        return None  # a symbol no input binds: nothing to compare against
    value = expr.subs({s: bound[str(s)] for s in expr.free_symbols})
    return int(value) if value.is_number else None
