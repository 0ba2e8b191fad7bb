"""Errors precast raises for bad input: one line that says what, where, and what to do."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
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


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, for one-line errors; the exception's type name
    when the message is empty (``str(AssertionError())`` is '')."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


NAMES_SHOWN = 5  # how many names an error line lists before "... (N in all)"


def name_list(names: Iterable[object], limit: int = NAMES_SHOWN) -> str:
    """``names`` for an error line, bounded: the first ``limit`` in order, then how many there are in all
    (``a, b, c, d, e ... (147 in all)``). Every error that lists names uses it, so no line grows with the model."""
    names = [str(n) for n in names]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} ... ({len(names)} in all)"


# torch's own package: frames under it are the library's, never the model's (torch.nn layers, functional)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# the same for a stack trace recorded on another machine (a program saved there and loaded here)
_TORCH_PARTS = (f"{os.sep}site-packages{os.sep}torch{os.sep}", f"{os.sep}dist-packages{os.sep}torch{os.sep}")


def _is_torch_frame(path: str) -> bool:
    return path.startswith(_TORCH_DIR) or any(part in path for part in _TORCH_PARTS)


def _frames(trace: str) -> list[tuple[str, str]]:
    """(path, line number) per ``File "...", line N`` entry of a Python stack trace, outermost first."""
    frames = []
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            frames.append((path, rest.split(",")[0]))
    return frames


def user_source_line(node: torch.fx.Node) -> str | None:
    """The innermost frame of the node's stack trace outside torch's own package, as ``file.py:LINE``.

    Frames inside torch (``torch/nn/modules/linear.py``) are skipped: the user wants the line of the model
    that called the layer. Only torch's own directory is skipped, not all of site-packages: for a library model
    (``site-packages/transformers/models/bert/modeling_bert.py``) the library's line is the model's line.
    """
    return _trace_source_line(node.meta.get("stack_trace") or "")


@functools.lru_cache(maxsize=4096)
def _trace_source_line(trace: str) -> str | None:
    # memoized: the ops of repeated layers share their trace text (measured: 0.2-0.5 s of a 0.2 B Llama's report)
    frames = _frames(trace)
    if not frames:
        return None
    model = [f for f in frames if not _is_torch_frame(f[0])]
    path, lineno = (model or frames)[-1]
    return f"{path}:{lineno}"


@functools.lru_cache(maxsize=4096)
def user_frame_trace(trace: str) -> str:
    """The part of a stack trace ``user_source_line`` and ``user_source_code`` read: the user's frame (its ``File``
    line and code line), as the trace writes it. A program saved with these in place of its full traces (the LLM
    folder's: 8 of its 16 MB of graph on SmolLM2-135M were traces through transformers' wrappers) names the same
    line in every message."""
    where = _trace_source_line(trace)
    if where is None:
        return trace
    path, _, lineno = where.rpartition(":")
    lines = trace.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(f'File "{path}", line {lineno},'):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File") else ""
            return "\n".join(x for x in (line, code) if x) + "\n"
    return trace


def short_path(location: str | None) -> str | None:
    """``file.py:LINE`` relative to the working directory when under it (else the last two path parts)."""
    if not location:
        return location
    path, sep, line = location.rpartition(":")
    if not sep:
        path, line = location, ""
    # relpath raises across Windows drives: only ask it for paths on the working directory's drive
    same_drive = os.path.splitdrive(os.path.abspath(path))[0] == os.path.splitdrive(os.getcwd())[0]
    rel = os.path.relpath(path) if path and same_drive else path
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
