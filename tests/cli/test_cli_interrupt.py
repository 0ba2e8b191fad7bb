"""Ctrl-C anywhere in a ``precast`` command (issue 50 item 3): exit status 130, one line on stderr, no traceback,
nothing written. The first seconds are the package import (torch, transformers: ~5 s on a loaded 2-core machine),
before ``precast.cli.main`` runs: ``precast/interrupts.py`` answers there. A real process is sent SIGINT at fixed
delays (0.2 s and 1 s land in the import) and once while export-llm writes its staged folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precast.interrupts import INTERRUPTED, is_command

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process: POSIX")


def test_is_command_reads_the_interpreter_command_line():
    assert is_command(["/v/bin/python", "/v/bin/precast", "export-llm", "x"])
    assert is_command(["python3", "-m", "precast", "convert"])
    assert is_command(["python3", "-X", "dev", "-mprecast"])
    assert is_command(["python3", "-u", "-m", "precast"])
    assert not is_command(["python3", "-m", "pytest", "tests"])
    assert not is_command(["python3", "script.py", "precast"])
    assert not is_command(["python3", "-c", "import precast"])
    assert not is_command(["python3"])


def _commands() -> list[list[str]]:
    """``python -m precast`` and, where the environment installed it, the console script."""
    found = [[sys.executable, "-m", "precast"]]
    script = Path(sys.executable).parent / "precast"
    if script.exists():
        found.append([str(script)])
    return found


def _interrupt(cmd: list[str], when, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # SIGINT's default action in the child, whatever the runner left it: a non-interactive shell starts its
    # background jobs with SIGINT ignored (POSIX), and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - a signal disposition only
    )
    when(proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _check(code: int, err: str, out: Path) -> None:
    assert code == 130, (code, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "interrupted" in lines[-1], err
    assert not [line for line in lines if "interrupted" in line][1:], err  # the line once
    assert not out.exists(), sorted(out.parent.iterdir())
    assert not list(out.parent.glob(f".{out.name}*")), sorted(out.parent.iterdir())  # no staged folder left


@pytest.mark.parametrize("delay", [0.2, 1.0])
@pytest.mark.parametrize("command", ["export-llm", "convert", "generate"])
def test_ctrl_c_during_start_up(tmp_path, delay, command):
    out = tmp_path / "out"
    argv = {
        "export-llm": ["export-llm", str(tmp_path / "model"), "--out", str(out)],
        "convert": ["convert", "tests.models:mlp", "--out", str(out)],
        "generate": ["generate", str(tmp_path / "model"), "hello"],
    }[command]
    for cmd in _commands():
        code, err = _interrupt(cmd + argv, lambda proc: time.sleep(delay), Path.cwd())
        assert err.strip() == INTERRUPTED or code == 130, err
        _check(code, err, out)


def test_ctrl_c_while_export_llm_writes(tmp_path):
    """SIGINT once the staged output folder exists (the conversion is done, the weights are being written)."""
    pytest.importorskip("transformers")
    from tests.cli.test_cli_llm_export import save_checkpoint

    save_checkpoint(tmp_path / "model")
    out = tmp_path / "artifact"

    def staged(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(f".{out.name}*")):
            assert proc.poll() is None, "export-llm ended before it staged its folder"
            assert time.monotonic() < deadline, "no staged folder in 300 s"
            time.sleep(0.02)

    argv = ["export-llm", str(tmp_path / "model"), "--weight-format", "int8", "--out", str(out)]
    code, err = _interrupt(_commands()[0] + argv, staged, Path.cwd())
    _check(code, err, out)
    assert "precast export-llm: interrupted" in err, err
