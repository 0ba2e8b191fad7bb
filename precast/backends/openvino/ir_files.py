"""OpenVINO IR files: ``save_ir`` writes a model as ``.xml`` + ``.bin`` without ever leaving a partial or mixed
pair, ``weight_bytes`` counts its weights by dtype.

Input: an ``openvino.Model`` and a path. Output: the two files, their sizes and the weight bytes by dtype.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from precast.backends.openvino.convert import ov_message, require_openvino
from precast.errors import PrecastError
from precast.io import check_writable
from precast.paths import check_outputs, ir_files


def save_ir(ov_model: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Write ``ov_model`` as OpenVINO IR: ``path`` (``.xml``) and the weights beside it (same name, ``.bin``).

    Weights are written as they are (``compress_to_fp16=False``: OpenVINO's default would turn every fp32
    weight, batch norm's statistics included, into fp16), so each is stored once in its precast dtype.
    Both files are written into a temporary folder beside ``path``, then renamed into place, the ``.bin`` first;
    an old pair is kept (hard links in that folder) until both are in, and put back if either rename fails: a
    failure leaves the old pair as it was, no partial file, and one ``PrecastError`` line. Returns the paths
    and sizes, and the weight bytes by dtype.
    """
    ov = require_openvino()
    xml = check_writable(path)
    if xml.suffix != ".xml":
        raise PrecastError(
            f"{xml}: OpenVINO IR is an .xml file (with a .bin beside it); give e.g. -o model.xml"
        )
    xml, weights = ir_files(xml)
    if weights.is_dir():
        raise PrecastError(f"{weights}: is a directory; the IR's weights go there, choose another name")
    check_outputs({"the IR": xml, "the IR's weights": weights}, ())
    tmp = Path(tempfile.mkdtemp(prefix=f".{xml.stem}.tmp-", dir=xml.parent))
    try:
        # OpenVINO creates both files with the umask's permissions (only the folder is mkdtemp's 0700)
        ov.save_model(ov_model, str(tmp / xml.name), compress_to_fp16=False)
        _replace_pair(tmp, xml, weights)
    except RuntimeError as exc:
        raise PrecastError(f"{xml}: OpenVINO could not write the IR: {ov_message(exc)}") from exc
    except OSError as exc:
        raise PrecastError(
            f"{xml}: could not write the IR ({exc.strerror or exc}: {exc.filename}); the old files, if any, "
            "are unchanged"
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the temporary folder only: nothing else is in it
    return {
        "xml": str(xml),
        "bin": str(weights),
        "xml_bytes": xml.stat().st_size,
        "bin_bytes": weights.stat().st_size,
        "weights": weight_bytes(ov_model),
    }


def _replace_pair(tmp: Path, xml: Path, weights: Path) -> None:
    """Rename ``tmp``'s new ``.xml`` and ``.bin`` onto ``xml`` and ``weights``. The old files are first linked
    into ``tmp`` (``old-*``): if a rename fails, what was moved is put back, so the old pair stays a pair."""
    kept = {}
    for target in (weights, xml):
        if target.exists():
            kept[target] = tmp / f"old-{target.name}"
            try:
                os.link(target, kept[target])  # same folder, same file system: a second name, no copy
            except OSError:  # a file system without hard links: a copy keeps it just as well
                shutil.copy2(target, kept[target])
    moved: list[Path] = []
    try:
        for target in (weights, xml):
            os.replace(tmp / target.name, target)
            moved.append(target)
    except OSError:
        for target in moved:  # undo: the old file back, or no file where there was none
            if target in kept:
                os.replace(kept[target], target)
            else:
                target.unlink()
        raise


def weight_bytes(ov_model: Any) -> dict[str, int]:
    """Bytes of the model's floating constants by dtype (precast's names), each constant counted once."""
    names = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
    out: dict[str, int] = {}
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() != "Constant":
            continue
        kind = names.get(op.get_element_type().get_type_name())
        if kind is not None:
            out[kind] = out.get(kind, 0) + op.get_byte_size()
    return dict(sorted(out.items()))
