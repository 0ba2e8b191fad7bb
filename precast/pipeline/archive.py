"""A .pt2 file checked before ``torch.export.load`` opens it: nothing in it is unpickled unless the user says so.

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

import io
import json
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
    if trust_pickle:
        return data
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            problem = _needs_pickle(z)
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise PrecastError(
            f"{p}: a malformed program archive ({first_line(exc)}); save it with torch.export.save"
        ) from exc
    if problem is not None:
        raise PrecastError(f"{p}: {problem}; {TRUST_HINT}")
    return data


def _needs_pickle(z: zipfile.ZipFile) -> str | None:
    """Why loading ``z`` would unpickle something beyond tensors (or load native code); None if it would not."""
    from torch.export.pt2_archive import constants as c

    for name in z.namelist():
        rel = name.split("/", 1)[1] if "/" in name else name  # members live under the archive's root folder
        if rel.startswith(c.AOTINDUCTOR_DIR) and not name.endswith("/"):
            return f"holds AOTInductor native code ({name})"
        if rel.startswith(c.SAMPLE_INPUTS_DIR) and name.endswith(".pt"):
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
