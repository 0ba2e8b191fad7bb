"""Every path a command reads is a regular file, checked before anything opens it (issue 40): a FIFO would block
the reader until a writer comes (``precast generate fifo.pt2`` hung forever), and ``/dev/zero`` would be read until
memory runs out. Each is one line, exit 2, at once -- the check the weights reader already makes for shards."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from precast.cli import main
from tests import models as zoo

# what each command reads, "{bad}" standing for the FIFO or device, "{good}" for a saved program
CASES = [
    (
        "generate program",
        ["generate", "{bad}", "--prompt-ids", "1", "--max-new-tokens", "2", "--backend", "eager"],
    ),
    (
        "generate --tokenizer",
        ["generate", "{good}", "--prompt", "w1", "--tokenizer", "{bad}", "--max-new-tokens", "2"],
    ),
    ("convert program", ["convert", "{bad}", "-o", "{out}"]),
    (
        "convert --calibration",
        ["convert", "{good}", "-o", "{out}", "--policy", "rules", "--calibration", "{bad}"],
    ),
    (
        "convert --calibration-stats",
        ["convert", "{good}", "-o", "{out}", "--policy", "rules", "--calibration-stats", "{bad}"],
    ),
    ("convert --plan", ["convert", "{good}", "-o", "{out}", "--plan", "{bad}"]),
    ("report program", ["report", "{bad}"]),
    ("check program", ["check", "{bad}"]),
    ("check --inputs", ["check", "{good}", "--inputs", "{bad}"]),
    ("compile program", ["compile", "{bad}", "-o", "{out}"]),
    ("sensitivity --inputs", ["sensitivity", "{good}", "--inputs", "{bad}"]),
]
NO_HANG_S = (
    30.0  # a reader still blocked on the FIFO then gets a writer (and EOF): the test fails, never hangs
)


@contextlib.contextmanager
def _address_space_bounded(headroom: int = 4 << 30):
    """The process's address space bounded to what it maps now plus ``headroom`` while the block runs (Linux)."""
    try:
        import resource

        pages = int(Path("/proc/self/statm").read_text().split()[0])
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError):
        yield
        return
    bound = pages * os.sysconf("SC_PAGE_SIZE") + headroom
    resource.setrlimit(
        resource.RLIMIT_AS, (bound if hard == resource.RLIM_INFINITY else min(bound, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "decoder.pt2"
    torch.export.save(zoo.tiny_decoder_program(), path)
    return path


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("name, argv", CASES, ids=[name for name, _ in CASES])
def test_a_fifo_or_device_is_one_line_at_once(good, tmp_path, capsys, kind, name, argv):
    if kind == "fifo":
        bad = tmp_path / "input.pt2"
        os.mkfifo(bad)
    else:
        bad = "/dev/zero"
        if not os.path.exists(bad):
            pytest.skip("no /dev/zero")
    release = threading.Timer(NO_HANG_S, lambda: open(bad, "wb").close()) if kind == "fifo" else None
    if release is not None:
        release.daemon = True
        release.start()
    argv = [a.format(bad=bad, good=good, out=tmp_path / "out.pt2") for a in argv]
    began = time.monotonic()
    try:
        with (
            _address_space_bounded()
        ):  # a reader of /dev/zero fails with MemoryError, not the machine's OOM killer
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        if release is not None:
            release.cancel()
    out, err = capsys.readouterr()
    assert time.monotonic() - began < NO_HANG_S
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert ("is a FIFO" if kind == "fifo" else "is a character device") in err, err  # says what is there
    assert not (tmp_path / "out.pt2").exists()
