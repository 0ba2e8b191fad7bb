"""A .pt2 file checked before ``torch.export.load`` opens it: nothing in it is unpickled unless the user says so;
and, when torch.export.load fails, the cause it logged (``load_failure``).

``torch.export.load`` unpickles with ``weights_only=False`` in several places: the sample inputs (after a
``weights_only=True`` attempt fails), weights and constants stored with ``use_pickle``, custom and opaque objects,
legacy weight files. A pickle runs code, so a crafted ``data/sample_inputs/model.pt`` would run during
``precast report evil.pt2``. precast reads the file once into memory, loads every pickled member of it with
``weights_only=True`` (the restricted unpickler: tensors and plain containers only) and refuses the file if any
member needs more, naming the option that trusts it (``trust_pickle=True`` / ``--trust-pickle``). torch then
loads the same bytes, in which every pickle is now known to be one the restricted unpickler accepts. A file that
holds AOTInductor native code (``data/aotinductor/``) is refused the same way.

Input: the path of a .pt2 file. Output: its bytes, checked; or a one-line PrecastError.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import zipfile
from pathlib import Path

import torch

from precast.errors import PrecastError, first_line

TRUST_HINT = (
    "a .pt2 file can run code when loaded: pass --trust-pickle (trust_pickle=True) only for a file you trust"
)


def read_checked(path: str | Path, *, trust_pickle: bool = False) -> bytes:
    """The bytes of ``path``, after checking that loading them unpickles nothing beyond tensors (unless
    ``trust_pickle``)."""
    p = Path(path)
    data = p.read_bytes()
    try:
        data = fake_weights_as_meta(data)
        if trust_pickle:
            return data
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            problem = _needs_pickle(z)
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise PrecastError(
            f"{p}: a malformed program archive ({first_line(exc)}); save it with torch.export.save"
        ) from exc
    if problem is not None:
        raise PrecastError(f"{p}: {problem}; {TRUST_HINT}")
    return data


def fake_weights_as_meta(data: bytes) -> bytes:
    """A program saved with fake weights (exported under ``FakeTensorMode``) stores each as an empty record, which
    ``torch.export.load`` would fill with zeros of the full size. Here such records load as meta tensors (no
    memory), and the fake sample inputs, which no restricted unpickler reads, become None: the archive rewritten
    in memory. Any other archive is returned as it is."""
    from torch.export.pt2_archive import constants as c

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = {i.filename: i for i in z.infolist()}
        changed: dict[str, bytes] = {}
        for name in infos:
            rel = name.split("/", 1)[1] if "/" in name else name
            if not (name.endswith("_config.json") and rel.startswith((c.WEIGHTS_DIR, c.CONSTANTS_DIR))):
                continue
            folder = name.rsplit("/", 1)[0] + "/"
            config = json.loads(z.read(name))
            hit = False
            for meta in config.get("config", {}).values():
                tm = meta.get("tensor_meta") or {}
                record = infos.get(folder + str(meta.get("path_name", "")))
                numel = 1
                for size in tm.get("sizes") or []:
                    numel *= int(size.get("as_int", 0)) if isinstance(size, dict) else 0
                if record is not None and record.file_size == 0 and numel > 0 and not meta.get("use_pickle"):
                    tm["device"] = {"type": "meta", "index": None}
                    hit = True
            if hit:
                changed[name] = json.dumps(config).encode()
        if not changed:
            return data
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
            for info in z.infolist():
                rel = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
                if rel.startswith(c.SAMPLE_INPUTS_DIR):
                    # fake tensors: nothing to run on, and not loadable without a full unpickle
                    changed[info.filename] = b""  # what torch.export.save writes for no example inputs
                w.writestr(info, changed.get(info.filename, z.read(info.filename)))
        return out.getvalue()


def _needs_pickle(z: zipfile.ZipFile) -> str | None:
    """Why loading ``z`` would unpickle something beyond tensors (or load native code); None if it would not."""
    from torch.export.pt2_archive import constants as c

    for name in z.namelist():
        rel = name.split("/", 1)[1] if "/" in name else name  # members live under the archive's root folder
        if rel.startswith(c.AOTINDUCTOR_DIR) and not name.endswith("/"):
            return f"holds AOTInductor native code ({name})"
        # (an empty record is how torch.export.save writes "no example inputs": nothing to unpickle)
        if rel.startswith(c.SAMPLE_INPUTS_DIR) and name.endswith(".pt") and z.getinfo(name).file_size:
            problem = _restricted_load(z.read(name), name)
            if problem:
                return problem
        # legacy formats: the whole state dict / constants table as one torch.save pickle
        if (rel.startswith(c.WEIGHTS_DIR) or rel.startswith(c.CONSTANTS_DIR)) and name.endswith(".pt"):
            problem = _restricted_load(z.read(name), name)
            if problem:
                return problem
        if name.endswith("_config.json") and (
            rel.startswith(c.WEIGHTS_DIR) or rel.startswith(c.CONSTANTS_DIR)
        ):
            folder = name.rsplit("/", 1)[0] + "/"
            config = json.loads(z.read(name)).get("config", {})
            for fqn, meta in config.items():
                path_name = str(meta.get("path_name", ""))
                if path_name.startswith((c.CUSTOM_OBJ_FILENAME_PREFIX, c.OPAQUE_OBJ_FILENAME_PREFIX)):
                    return f"constant {fqn!r} is a pickled Python object ({folder}{path_name})"
                if meta.get("use_pickle"):
                    problem = _restricted_load(z.read(folder + path_name), f"{folder}{path_name} ({fqn})")
                    if problem:
                        return problem
    return None


def _restricted_load(blob: bytes, what: str) -> str | None:
    try:
        torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the restricted unpickler rejects is refused, and said why
        # torch's message is a page of advice; its "WeightsUnpickler error:" line says what was found
        lines = [ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error" in ln]
        why = lines[0].split("error:", 1)[1].strip().split(". ")[0] if lines else first_line(exc)
        return f"{what} needs a full unpickle to load ({why[:160]})"
    return None


# torch 2.13: "Deserializing X in pytree is not registered."; torch 2.15: "Deserializing X in pytree failed
# because the serialized type is not registered in this process. ..."
_UNREGISTERED = re.compile(
    r"Deserializing (\S+) in pytree (?:is not registered|failed because the serialized type is not registered)"
)


def load_failure(p: Path, exc: BaseException, logged: list[BaseException]) -> str:
    """Why ``torch.export.load`` failed: it logs the deserializer's exception and raises a generic one ("We ran
    into an error when deserializing"), so the logged cause is named first."""
    chain = [*logged, exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:  # the cause torch raised from, if it kept it
        chain.append(chain[-1].__cause__)
    for cause in chain:
        found = _UNREGISTERED.search(str(cause))
        if found:
            kind = found.group(1).rstrip(".")
            return (
                f"{p}: the program's inputs or outputs hold a {kind}, a type not registered with torch's "
                "pytree in this process, which torch.export.load needs; export a wrapper that returns tensors "
                "(precast.LogitsOnly(model) for a causal LM's logits), or load it in Python after importing the "
                "library that registers the type"
            )
    why = first_line(logged[-1]) if logged else first_line(exc)
    return (
        f"{p}: cannot be loaded as a torch.export program ({why}); save it with torch.export.save from "
        f"torch {torch.__version__.split('+')[0]}"
    )


class _Recorder(logging.Filter):
    """Keeps the exceptions a logger's records carry (and lets every record through to the next filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[BaseException] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])
        return True


@contextlib.contextmanager
def logged_errors(name: str, into: list[BaseException]):
    """Append to ``into`` the exceptions logged on ``name`` while inside (a filter on the logger: its level and
    handlers untouched; installed before ``quiet_loggers`` so it sees the records they drop)."""
    logger = logging.getLogger(name)
    recorder = _Recorder()
    recorder.errors = into
    logger.addFilter(recorder)
    try:
        yield
    finally:
        logger.removeFilter(recorder)
