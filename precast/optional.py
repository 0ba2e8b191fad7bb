"""Optional dependencies: the one check that the packages an extra installs are there, failing as one line.

Each engine and reader that needs an extra (``precast[openvino]``, ``precast[onnx]``, ``precast[executorch]``,
``precast[llm]``) calls ``require`` with its own wording: the line names the missing package and the ``pip
install`` that brings it.

Input: module names and the message to raise. Output: nothing (each module importable, or imported), or a
one-line PrecastError.
"""

from __future__ import annotations

import importlib
import importlib.util

from precast.errors import PrecastError, first_line


def require(*modules: str, message: str, load: bool = True) -> None:
    """Import each of ``modules`` in turn (``load=False``: only find it, for a package slow to import); the
    first one missing raises ``message`` as one PrecastError line, formatted with ``{module}`` (its name) and
    ``{cause}`` (the ImportError's first line: ``No module named 'x'``)."""
    for name in modules:
        if not load:
            if importlib.util.find_spec(name) is None:
                raise PrecastError(message.format(module=name, cause=f"No module named {name!r}"))
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise PrecastError(message.format(module=name, cause=first_line(exc))) from exc
