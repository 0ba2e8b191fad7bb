"""``precast export-llm --bits`` shows its measurement on the progress bar (issue 49 item 7): every backward pass of
the weight budget counted, with the time left, between the step's own description and the next step's (before,
the bar said only "measuring the weights and converting" for the whole of it).

The checkpoint is test_cli_llm_export.py's tiny seeded Llama (its fixtures, imported)."""

from __future__ import annotations

import re

from precast.cli import main
from precast.progress import ProgressBar
from tests.cli.test_cli_llm_export import CACHE, checkpoint, exports  # noqa: F401 - the fixtures


def test_each_backward_pass_reaches_the_bar_with_the_time_left(checkpoint, exports, tmp_path, monkeypatch):  # noqa: F811
    shown: list[str] = []
    monkeypatch.setattr(ProgressBar, "describe", lambda self, text: shown.append(text))
    argv = [checkpoint, "-o", tmp_path / "out", "--bits", "6", "--calibration-text"]
    argv += [
        checkpoint.parent / "calibration.txt",
        "--calibration-window",
        "16",
        "--calibration-tokens",
        "48",
    ]
    argv += ["--probes", "2", "--max-cache-len", CACHE]
    assert main(["export-llm", *map(str, argv)]) == 0
    passes = [t for t in shown if t.startswith("measuring the weights: ")]
    assert [re.match(r"measuring the weights: (\d+)/6 backward passes", t).group(1) for t in passes] == list(
        map(str, range(7))
    )  # 3 windows x 2 probes, counted from 0
    assert all(re.search(r", about \d+ (s|min \d+ s) left$", t) for t in passes[1:-1])
    # shown while the convert step runs: after its description, the int4 fit's count first (one line per weight,
    # counted from 0), then the backward passes, one line each
    first = shown.index("measuring the weights and converting")
    fits = [t for t in shown if t.startswith("fitting the int4 weights on the calibration text: ")]
    assert [re.match(r"fitting .*: (\d+)/(\d+) weights", t).group(1) for t in fits] == list(
        map(str, range(len(fits)))
    )
    assert first < shown.index(fits[0]) < shown.index(fits[-1]) < shown.index(passes[0])
    assert shown.index(passes[-1]) == shown.index(passes[0]) + 6
