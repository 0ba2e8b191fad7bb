"""Errors precast raises for bad input: one line that says what, where, and what to do."""

from __future__ import annotations

import torch.fx


class PrecastError(Exception):
    """A user error: bad input, an annotation that cannot be honored, a tolerance that cannot be met.

    The CLI prints ``str(err)`` and exits with status 2; no traceback.
    """

    def __init__(
        self, message: str, *, code: str = "error", node: str | None = None, source: str | None = None
    ):
        self.code = code
        self.node = node
        self.source = source
        super().__init__(message)


def user_source_line(node: torch.fx.Node) -> str | None:
    """The innermost frame of the node's stack trace that is the user's code, as ``file.py:LINE``.

    Frames inside torch itself (``torch/nn/modules/linear.py``) are skipped: the user wants the line of
    their model that called the layer, which export records as the outermost frames of the trace.
    """
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = []
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            lineno = rest.split(",")[0]
            frames.append((path, lineno))
    user = [(p, n) for p, n in frames if "/torch/" not in p and "/site-packages/" not in p]
    chosen = (user or frames)[-1] if (user or frames) else None
    return f"{chosen[0]}:{chosen[1]}" if chosen else None


def short_path(location: str | None) -> str | None:
    """``file.py:LINE`` relative to the working directory when under it (else the last two path parts)."""
    if not location:
        return location
    import os

    path, sep, line = location.rpartition(":")
    if not sep:
        path, line = location, ""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    if rel.startswith(".."):
        rel = "/".join(path.split("/")[-2:])
    return f"{rel}:{line}" if line else rel


def user_source_code(node: torch.fx.Node) -> str | None:
    """The code text of the user's source line, when the stack trace recorded it."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip()]
    where = user_source_line(node)
    if where is None:
        return None
    path, _, lineno = where.rpartition(":")
    for i, ln in enumerate(lines):
        if (
            ln.startswith(f'File "{path}", line {lineno},')
            and i + 1 < len(lines)
            and not lines[i + 1].startswith("File")
        ):
            return lines[i + 1]
    return None


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path of a node (``sub.linear1``), '' at the top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    # export records paths like "L['self'].sub.linear1" (strict) or "sub.linear1" (non-strict)
    return path.replace("L['self'].", "").replace("L['self']", "")


def where(node: torch.fx.Node) -> str:
    """``node 'linear_2' (module output) at model.py:24`` — for one-line messages."""
    parts = [f"node '{node.name}'"]
    mod = module_path(node)
    if mod:
        parts.append(f"(module {mod})")
    src = user_source_line(node)
    if src:
        parts.append(f"at {src}")
    return " ".join(parts)
