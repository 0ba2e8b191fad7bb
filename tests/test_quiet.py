"""Quiet by default: what the libraries precast drives print and a user cannot act on (torchao's "Failed to load"
of its CUDA kernels, torch's notes on them, third-party warnings) is held back for a precast command, shown with
``--verbose`` or ``PRECAST_VERBOSE=1``; precast's own warnings are never held back (issue 40, polish)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from precast.progress import NOISY_LOGGERS, quiet_libraries


def emit() -> None:
    logging.getLogger("torchao").warning("Failed to load torchao/_C_mxfp8.so")
    logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
    warnings.warn_explicit("a library's note", UserWarning, "lib.py", 1, module="somelib")
    warnings.warn_explicit("precast's own", UserWarning, "precast/x.py", 1, module="precast.numerics.latency")


def test_quiet_holds_back_library_noise_but_not_precast(caplog, monkeypatch):
    monkeypatch.delenv("PRECAST_VERBOSE", raising=False)
    before = [logging.getLogger(n).level for n in NOISY_LOGGERS]
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_libraries():
            emit()
    assert not [r for r in caplog.records if r.name in NOISY_LOGGERS]
    assert [str(w.message) for w in seen] == ["precast's own"]
    assert [logging.getLogger(n).level for n in NOISY_LOGGERS] == before  # restored after the block


@pytest.mark.parametrize("how", ["env", "flag"])
def test_verbose_shows_everything(caplog, monkeypatch, how):
    monkeypatch.setenv("PRECAST_VERBOSE", "1") if how == "env" else monkeypatch.delenv(
        "PRECAST_VERBOSE", False
    )
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_libraries(show=True if how == "flag" else None):
            emit()
    assert {r.name for r in caplog.records} >= set(NOISY_LOGGERS)
    assert len(seen) == 2


def test_the_cli_takes_verbose_and_a_command_runs_quiet(monkeypatch):
    from precast.cli import build_parser, main

    assert build_parser().parse_args(["--verbose", "bench", "--llm"]).verbose
    seen: dict = {}

    def fake_run(args):
        with warnings.catch_warnings(record=True) as shown:  # records under the filters the command runs with
            emit()
        seen["warnings"] = [str(w.message) for w in shown]
        seen["levels"] = [logging.getLogger(n).getEffectiveLevel() for n in NOISY_LOGGERS]
        return 0

    monkeypatch.setattr("precast.cli.bench.run", fake_run)  # add_parser binds the module's run when main runs
    monkeypatch.delenv("PRECAST_VERBOSE", raising=False)
    assert main(["bench", "--llm"]) == 0
    assert seen == {"warnings": ["precast's own"], "levels": [logging.ERROR] * len(NOISY_LOGGERS)}
    # --verbose leaves every logger as it was (another library, torchao itself included, may have set its level)
    before = [logging.getLogger(n).getEffectiveLevel() for n in NOISY_LOGGERS]
    assert main(["--verbose", "bench", "--llm"]) == 0
    assert len(seen["warnings"]) == 2 and seen["levels"] == before


def test_importing_transformers_under_a_command_prints_nothing():
    """Where transformers brings torchao (the dev environment), its load failures stay out of a command's
    output."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    code = (
        "from precast.progress import quiet_libraries\n"
        "with quiet_libraries():\n"
        "    import transformers.integrations.executorch\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PRECAST_VERBOSE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr, proc.stderr
