"""tests/lanes.py: every entry names a test file that exists and a lane that exists; the longest prefix decides."""

from __future__ import annotations

from pathlib import Path

from tests import lanes

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_names_an_existing_file_and_a_lane():
    for prefix, (lane, why) in lanes.ONE_LANE.items():
        path = prefix.split("::", 1)[0]
        assert (ROOT / path).is_file() or (ROOT / path).is_dir(), prefix
        assert lane in (lanes.FLOOR, lanes.LATEST), prefix
        assert len(why) > 20, prefix  # a reason a reader can check


def test_the_longest_prefix_decides(monkeypatch):
    table = {
        "tests/a.py": ("floor", "the file"),
        "tests/a.py::test_x": ("latest", "the test"),
        "tests/a.py::test_x[p]": ("floor", "one parametrization"),
    }
    monkeypatch.setattr(lanes, "ONE_LANE", table)
    assert lanes.lane_of("tests/a.py::test_y") == ("floor", "the file")
    assert lanes.lane_of("tests/a.py::test_x[q]") == ("latest", "the test")
    assert lanes.lane_of("tests/a.py::test_x[p]") == ("floor", "one parametrization")
    assert lanes.lane_of("tests/a.py::test_xy") == ("floor", "the file")  # a name prefix is not a match
    assert lanes.lane_of("tests/ab.py::test_x") is None
    monkeypatch.setattr(lanes, "ONE_LANE", {"tests/bench": ("floor", "a folder")})
    assert lanes.lane_of("tests/bench/test_x.py::test_y") == ("floor", "a folder")
    assert lanes.lane_of("tests/benchmarks/test_x.py::test_y") is None


def test_realmodel_policy_split_names_real_policies_and_both_lanes():
    """Every policy the transformers models run in one lane exists, and each lane gets a policy torch and a policy
    rules (so each lane converts every family under both), policy None staying in both."""
    from tests.realmodels.conftest import POLICIES

    split = lanes.REALMODEL_POLICY_LANE
    assert set(split) <= set(POLICIES) and "none" not in split
    for lane in (lanes.FLOOR, lanes.LATEST):
        mine = [p for p, owner in split.items() if owner == lane]
        assert any(p.startswith("torch") for p in mine) and any(p.startswith("rules") for p in mine), (
            lane,
            mine,
        )
