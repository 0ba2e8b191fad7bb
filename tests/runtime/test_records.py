"""``precast/runtime/records.py``: the one check that a saved record is this precast version's format, shared by
AOTInductor's cache entries (``opened.mismatch``), OpenVINO's saved forms (``saved.stale_reason``) and
``SignedModel.from_record``."""

from __future__ import annotations

import pytest

from precast.runtime.records import OTHER_VERSION, record_mismatch

NEEDED = ("key", "stored")


@pytest.mark.parametrize(
    "record",
    [
        None,
        ["version", 3],
        {"key": 1, "stored": 2},  # no version
        {"version": 2, "key": 1, "stored": 2},  # another version
        {"version": 3, "key": 1},  # a key missing
    ],
)
def test_a_record_of_another_version_or_shape_is_named_so(record) -> None:
    assert record_mismatch(record, 3, NEEDED) == OTHER_VERSION


def test_a_record_of_this_version_with_every_key_passes() -> None:
    assert record_mismatch({"version": 3, "key": None, "stored": [], "more": 1}, 3, NEEDED) == ""


def test_each_engine_names_it_in_the_same_words() -> None:
    from precast.backends.aoti.opened import mismatch

    assert mismatch({"version": -1}, threads=1) == OTHER_VERSION
    pytest.importorskip("openvino")
    from precast.backends.openvino.saved import stale_reason

    assert stale_reason({"version": -1}, core=None) == OTHER_VERSION
