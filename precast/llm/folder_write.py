"""Writing the folder ``precast.llm.export`` (and ``precast export-llm``) writes (its format, reader and engines: ``precast.llm.folder``).

- ``check_output_dir(out, inputs)``: before anything loads: ``-o`` is a new folder or an empty one, in a writable
  folder, and none of the files written there is an input.
- ``staged(out)``: a hidden folder beside ``out`` that the block writes into, renamed onto ``out`` only when the
  block succeeds, removed otherwise (an exception, Ctrl-C, SIGTERM): never a partial artifact.
- ``write_converted`` / ``write_tokenizer`` / ``write_program`` / ``write_manifest``: the files (the engines'
  artifacts: ``precast.llm.folder_engines``).

Input: paths. Output: the folder, written whole or not at all; one-line PrecastErrors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from precast.errors import PrecastError
from precast.llm.folder import (  # noqa: F401 - the folder's names, one home: precast.llm.folder
    AOTI,
    FORMAT,
    MANIFEST,
    OPENVINO,
    PLAN,
    PROGRAM,
    REPORT,
    TOKENIZER,
    VERSION,
)
from precast.paths import PathArg, check_input_file, check_outputs


def check_output_dir(
    out: str | os.PathLike, inputs: list[PathArg], names: list[str], said: str = "-o"
) -> Path:
    """``out`` as a Path when the artifact can be written there: absent or an empty folder, its parent a
    writable folder, none of ``names`` (the files written into it) an input; else one line naming the option as
    ``said`` (``-o`` on the command line, ``out_dir=`` in Python)."""
    p = Path(out)
    for source in inputs:
        if source is not None and _inside(Path(source), p):
            raise PrecastError(f"{said} {p}: holds the input {source}; give another folder")
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise PrecastError(f"{said} {p}: is a file; give a new or empty folder for the artifact")
        if any(p.iterdir()):
            raise PrecastError(
                f"{said} {p}: exists and is not empty; give a new or empty folder (nothing is ever overwritten)"
            )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise PrecastError(f"{said} {p}: folder {parent} does not exist; create it first")
    check_outputs({f"{said}'s {n}": p / n for n in names}, inputs)
    try:  # a real probe: a read-only file system passes os.access for root
        with _interrupts_held():  # a Ctrl-C between the probe's mkdir and rmdir would leave it behind
            _new_dir(p, said).rmdir()
    except OSError as exc:
        raise PrecastError(
            f"{said} {p}: cannot write in {parent} ({exc.strerror}); choose another folder"
        ) from exc
    return p


def _inside(path: Path, folder: Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        path.resolve().relative_to(folder.resolve())
        return True
    return False


def _new_dir(p: Path, said: str = "-o") -> Path:
    """A new empty folder beside ``p``, hidden; mode 0777 minus the umask (the kernel applies it)."""
    parent = p.parent if str(p.parent) else Path(".")
    for _ in range(100):
        tmp = parent / f".{p.name}.tmp-{secrets.token_hex(6)}"
        try:
            tmp.mkdir(0o777)
        except FileExistsError:
            continue
        return tmp
    raise PrecastError(f"{said} {p}: cannot create a temporary folder beside it")


def _hold_interrupts() -> object:
    """SIGINT blocked in this (main) thread, delivered when released (``_release_interrupts``); the mask before,
    or None where signals cannot be blocked (another thread, no ``pthread_sigmask``)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _release_interrupts(held: object) -> None:
    if held is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    held = _hold_interrupts()
    try:
        yield
    finally:
        _release_interrupts(held)


@contextlib.contextmanager
def staged(out: Path, said: str = "-o") -> Iterator[Path]:
    """Yields an empty temporary folder beside ``out``; renamed onto ``out`` (absent, or still empty) only when
    the block succeeds, removed with everything in it otherwise."""
    held = _hold_interrupts()  # a Ctrl-C between the mkdir and the try below would leave the folder behind
    try:
        tmp = _new_dir(out, said)
    except BaseException:
        _release_interrupts(held)
        raise
    try:
        _release_interrupts(held)  # a Ctrl-C held back is raised here, inside the try: the folder is removed
        yield tmp
        try:  # onto an empty folder too (rename(2)); one that is no longer empty is refused by the system
            os.rename(tmp, out)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise PrecastError(
                    f"{said} {out}: something was written into it meanwhile; nothing was written"
                ) from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_program(stage: Path, program: Any, output: str) -> None:
    """program.pt2 (serialized in memory first: a full disk is one line), each node's stack trace cut to the frame
    precast's messages name (``precast.errors.user_frame_trace``): SmolLM2-135M's 4.6-bit folder 116 -> 108 MiB
    for 96 MiB of weights. The program in memory keeps its full traces."""
    from precast.io import program_bytes, write_bytes

    with _user_frames_only(program):
        data = program_bytes(program, output)
    write_bytes(stage / PROGRAM, data)


@contextlib.contextmanager
def _user_frames_only(program: Any) -> Iterator[None]:
    """Every node of ``program`` (its submodules' too) with ``stack_trace`` cut to the user's frame while inside;
    the full traces back after, whatever happens."""
    import torch.fx

    from precast.errors import user_frame_trace

    held = []
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                trace = node.meta.get("stack_trace")
                if trace:
                    held.append((node, trace))
    try:
        for node, trace in held:
            node.meta["stack_trace"] = user_frame_trace(trace)
        yield
    finally:
        for node, trace in held:
            node.meta["stack_trace"] = trace


def write_converted(stage: Path, res: Any, model: Any, source: str) -> dict[str, str]:
    """report.json, plan.json and the tokenizer (program.pt2 is written last: ``write_program``)."""
    from precast.io import write_bytes
    from precast.policy.plan import Plan

    files = {"program": PROGRAM, "report": REPORT}
    write_bytes(stage / REPORT, (res.report.to_json() + "\n").encode())
    if res.report.weight_formats:
        plan = Plan.from_result(res, source=f"precast export-llm {source}")
        write_bytes(stage / PLAN, plan.to_json(res.program).encode())
        files["plan"] = PLAN
    if model.tokenizer is not None:
        write_tokenizer(stage, model)
        if (stage / TOKENIZER).is_file():
            files["tokenizer"] = TOKENIZER
    return files


def write_tokenizer(stage: Path, model: Any) -> None:
    """The checkpoint folder's own tokenizer files, copied as they are; else (a GGUF) transformers' save of the
    tokenizer it read."""
    from precast.io import write_bytes
    from precast.llm.checkpoint import TOKENIZER_FILES, quiet_transformers

    folder = model.source.folder
    if model.source.gguf is None and (folder / TOKENIZER).is_file():
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                write_bytes(
                    stage / name, check_input_file(folder / name, "the tokenizer's file").read_bytes()
                )
        return
    with quiet_transformers():
        model.tokenizer.save_pretrained(stage)


def write_manifest(folder: Path, record: dict[str, Any]) -> dict[str, Any]:
    """export.json: the format's name and version, then ``record``; returns what was written."""
    from precast.io import write_bytes

    body = {"format": FORMAT, "version": VERSION, **record}
    write_bytes(folder / MANIFEST, (json.dumps(body, indent=2) + "\n").encode())
    return body
