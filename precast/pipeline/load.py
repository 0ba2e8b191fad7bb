"""Loading what the user names on disk: a program saved with ``torch.export.save`` (checked before torch opens it,
nothing unpickled beyond tensors unless trusted: ``pipeline/archive.py``), a file of tensors, a
``package.module:factory`` spec; each failure one line.

Input: a path or a factory spec. Output: an ExportedProgram, the file's tensors, or (model, example_inputs).
"""

from __future__ import annotations

import importlib
import io
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError, first_line
from precast.paths import check_input_file
from precast.pipeline.archive import load_failure, logged_errors, read_checked
from precast.threads import TORCH_LOCK, quiet_loggers

# records torch.export.save writes (archive_format since torch 2.8, version before)
PROGRAM_MARKERS = ("archive_format", "version")


def check_program_file(path: str | Path) -> Path:
    """Before loading: ``path`` is a file torch.export.save wrote (a zip with its archive marker). torch's own
    failure on other zips points at warnings the CLI hides; this says what the file is instead."""
    p = Path(path)
    if not p.exists():
        raise PrecastError(f"{p}: no such file; pass a program saved with torch.export.save(ep, '{p.name}')")
    if p.is_dir():
        raise PrecastError(f"{p}: is a directory, not a program saved with torch.export.save")
    check_input_file(p, "pass a program saved with torch.export.save")  # a FIFO or device: never opened
    if not zipfile.is_zipfile(p):
        raise PrecastError(
            f"{p}: not a saved torch.export program (not a zip archive); save it with torch.export.save"
        )
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
    if not any(n == m or n.endswith("/" + m) for n in names for m in PROGRAM_MARKERS):
        raise PrecastError(
            f"{p}: a zip archive, but not one torch.export.save wrote (no archive_format or version record); "
            "save the program with torch.export.save"
        )
    return p


def load_program(path: str | Path, *, trust_pickle: bool = False) -> ExportedProgram:
    """Load a program saved with ``torch.export.save``, with one-line errors for the usual mistakes.

    Nothing in the file is unpickled beyond tensors unless ``trust_pickle`` (``pipeline/archive.py``): a .pt2
    is code. Safe from several threads (torch's deserializer is process-global: loads are serialized).
    """
    p = check_program_file(path)
    logged: list[BaseException] = []
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
        if bad is not None:
            raise PrecastError(
                f"{p}: corrupted archive (member {bad} fails its checksum); save the program again"
            )
        data = read_checked(p, trust_pickle=trust_pickle)
        # torch.export.load logs a traceback at WARNING before failing on a file that is not a program;
        # precast turns the failure into one line instead (a filter on its logger: no global level change)
        # (and with trust_pickle, torch's own "Fallback to weights_only=False" warning has a format bug that
        # prints a logging traceback: the trust was explicit, the line adds nothing)
        with (
            TORCH_LOCK,
            logged_errors("torch.export", logged),
            quiet_loggers(("torch.export", "torch._export.serde.serialize")),
        ):
            return torch.export.load(io.BytesIO(data))
    except PrecastError:
        raise
    except Exception as exc:
        raise PrecastError(load_failure(p, exc, logged)) from exc


def load_saved(path: str | Path, what: str, hint: str) -> Any:
    """A user's file of tensors (``torch.save``), read with ``weights_only=True``; one-line errors saying
    ``what`` it was for and ``hint`` on how to make one."""
    p = check_input_file(path, hint, what)  # missing, a folder, a FIFO or a device: one line, nothing opened
    try:
        return torch.load(p, weights_only=True)
    except Exception as exc:
        first = first_line(exc)
        raise PrecastError(f"{what} {p}: cannot be read with torch.load ({first}); {hint}") from exc


def load_factory(spec: str) -> tuple[torch.nn.Module, Any]:
    """``pkg.module:factory`` -> (model, example_inputs) from calling the factory with no arguments."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise PrecastError(f"'{spec}': expected a saved program path or 'package.module:factory'")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like python -m: the current directory is importable
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise PrecastError(
            f"'{spec}': cannot import module '{mod_name}' ({exc}); check the name and PYTHONPATH"
        ) from exc
    except (Exception, SystemExit) as exc:  # the user's module failed while importing: say so in one line
        raise PrecastError(f"'{spec}': importing '{mod_name}' failed: {_failure(exc)}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise PrecastError(f"'{spec}': module '{mod_name}' has no callable '{attr}'")
    try:
        made = factory()
    except (
        Exception,
        SystemExit,
    ) as exc:  # a factory that raises or calls sys.exit: one line, not its traceback
        raise PrecastError(
            f"'{spec}': the factory failed: {_failure(exc)}; run it in Python to debug"
        ) from exc
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise PrecastError(
            f"'{spec}': the factory must return (model, example_inputs), got {type(made).__name__}"
        )
    return made


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {first_line(exc)[:200]}"
