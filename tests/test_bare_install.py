"""The bare install: the wheel, installed with only its declared dependencies beside the lane's torch, runs the
README's "Use it" flow (``tests/bare_flow.py``) from a folder outside the source tree, and carries its license.

How it stays honest and cheap (about 4 minutes on 2 cores beside the other lane; the wheel and its license check, 3 s, run in both lanes):
- the wheel is built (``pip wheel --no-deps --no-build-isolation``) from a copy of what the wheel is made of
  (``precast/``, ``pyproject.toml``, ``README.md``, ``LICENSE``), so nothing is written into the checkout;
- a fresh venv (no ``--system-site-packages``) gets ``torch==<this lane's torch>`` from the lane's own pip source
  (the floor lane's CPU wheel on local disk), ``--no-compile``, then the wheel with its declared dependencies
  from the package index: no numpy, no extra;
- the flow runs with that venv's python, no ``PYTHONPATH``, in an empty temporary folder, with precast's and
  inductor's caches in fresh temporary folders, so a compile there reuses nothing from this test session.

Floor lane only (``PRECAST_LANE=floor``, set by ``./dev.sh``; or ``PRECAST_BARE_INSTALL=1`` to run it by hand):
the latest lane's torch comes from PyPI with its CUDA libraries (about 4 GB, 3.5 minutes) and would be installed
again for this venv on every run; precast's own code paths are the same in both lanes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
RUN = os.environ.get("PRECAST_LANE") == "floor" or os.environ.get("PRECAST_BARE_INSTALL") == "1"

needs_floor_lane = pytest.mark.skipif(
    not RUN,
    reason="the bare install runs in the floor lane (PRECAST_LANE=floor, as ./dev.sh sets it) or with "
    "PRECAST_BARE_INSTALL=1: it installs torch into a fresh venv",
)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, timeout: float = 900) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-6000:])
    return proc.stdout


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would point a child at the source tree or this session's caches."""
    drop = ("PYTHONPATH", "PRECAST_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VIRTUAL_ENV", "PYTHONHOME")
    # and bytecode is written: the venv is installed --no-compile, so without it each of the flow's ~20 commands
    # compiled torch's Python source again (~12 s a start; 340 s of the flow, measured)
    drop += ("PYTHONDONTWRITEBYTECODE",)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    shutil.copytree(ROOT / "precast", src / "precast", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], env=clean_env()
    )
    (wheel,) = dist.glob("precast-*.whl")
    return wheel


def check_wheel(wheel: Path) -> None:
    """The license text the metadata declares is in the wheel; the wheel requires what pyproject declares."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(meta).decode()
        licenses = [n for n in names if "/licenses/" in n]
        assert [n.rsplit("/", 1)[1] for n in licenses] == ["LICENSE"], licenses
        text = zf.read(licenses[0]).decode()
    assert text == (ROOT / "LICENSE").read_text() and text.startswith("BSD 3-Clause License")
    assert "License-Expression: BSD-3-Clause" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requires = [ln.split(": ", 1)[1] for ln in metadata.splitlines() if ln.startswith("Requires-Dist: ")]
    assert [r for r in requires if "extra ==" not in r] == project["dependencies"]
    assert not [r for r in requires if "extra ==" not in r and r.split(">")[0].split("=")[0] == "numpy"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_carries_the_license_and_only_the_declared_dependencies(wheel):
    check_wheel(wheel)


def test_license_file_in_the_repository():
    text = (ROOT / "LICENSE").read_text()
    assert (
        text.startswith("BSD 3-Clause License")
        and "Redistribution and use in source and binary forms" in text
    )
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "BSD-3-Clause"


@needs_floor_lane
@pytest.mark.timeout(1800)
def test_bare_install_runs_the_readme_flow(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], env=clean_env())
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    run(
        [*pip, f"torch=={torch.__version__}"], env=clean_env()
    )  # the lane's own torch, from the lane's source
    run([*pip, str(wheel)], env=clean_env())  # and the declared dependencies, nothing else
    installed = run([python, "-m", "pip", "list", "--format=freeze"], env=clean_env()).lower()
    assert "numpy" not in installed and "precast==0.1.0" in installed, installed
    work = tmp_path / "work"
    work.mkdir()
    env = clean_env(
        PRECAST_CACHE_DIR=str(tmp_path / "precast-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
    )
    shutil.copy(ROOT / "tests" / "bare_flow.py", tmp_path / "bare_flow.py")  # not run from the source tree
    out = run([python, str(tmp_path / "bare_flow.py")], cwd=work, env=env, timeout=1500)
    steps = [ln[3:] for ln in out.splitlines() if ln.startswith("ok ")]
    assert steps[0] == "bare" and steps[-1] == "done" and "cli bench" in steps, out
