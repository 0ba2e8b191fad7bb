"""The CLI bad-input table (benchmarks/cli_bad_inputs.py, docs/cli_bad_inputs.md) as a test: every case exits 2
with one line on stderr, writes no output or temporary file, and leaves its inputs byte for byte unchanged."""

from __future__ import annotations

import sys

import pytest

from benchmarks.cli_bad_inputs import API_CASES, CASES, make_fixtures, run_api_case, run_case


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-inputs")
    make_fixtures(d)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def test_the_table_has_at_least_50_cases():
    assert len(CASES) >= 50 and len({name for name, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("name, argv", CASES, ids=[name for name, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(fixture_dir, name, argv):
    outcome = run_case(fixture_dir, name, argv)
    lines = [ln for ln in outcome.stderr.splitlines() if ln.strip()]
    assert outcome.status == 2, outcome
    assert len(lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert lines[0].startswith("precast"), lines[0]
    assert outcome.changed == [], f"files changed: {outcome.changed}"


@pytest.mark.parametrize("name, code", API_CASES, ids=[name for name, _ in API_CASES])
def test_bad_input_through_the_api_is_one_line_and_changes_nothing(fixture_dir, name, code):
    outcome = run_api_case(fixture_dir, name, code)
    assert outcome.status == 2, outcome  # a PrecastError, not another exception, not accepted
    assert "\n" not in outcome.stderr and len(outcome.stderr) < 600, outcome.stderr
    assert outcome.changed == [], f"files changed: {outcome.changed}"
