"""The record an engine writes beside what it saved (a package cache entry, a saved form): the check that a record
was written by this precast version's format, shared by every engine that reads one back.

Input: a record (decoded JSON), the version its writer stamps, the keys it must hold. Output: why it cannot be
read ("" when it can).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

OTHER_VERSION = "its record is from another precast version"


def record_mismatch(record: Any, version: int, needed: Iterable[str]) -> str:
    """``OTHER_VERSION`` unless ``record`` is a mapping stamped ``version`` that holds every key of ``needed``;
    else "" (what the record then says about this machine is the engine's own check)."""
    if (
        not isinstance(record, dict)
        or record.get("version") != version
        or not all(k in record for k in needed)
    ):
        return OTHER_VERSION
    return ""
