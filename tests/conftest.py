"""Shared session fixtures. AOTInductor compiles take ~10-25 s each on a small CPU: every test that needs a
compiled package gets it from here, compiled once per session into a session-wide temporary cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def small_model(seed: int = 0):
    """The small MLP (3x Linear(64, 64) + head under one bf16 region); ``seed`` perturbs the weights."""
    from tests import models as zoo

    model, inputs = zoo.small_mlp(4)
    if seed:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model, inputs


def run_python(
    code: str, *args: str, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


@pytest.fixture(scope="session")
def aoti_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("aoti-cache")


@pytest.fixture(scope="session")
def converted_a():
    import precast

    model, inputs = small_model(0)
    return model, inputs, precast.convert(model, inputs)


@pytest.fixture(scope="session")
def compiled_a(converted_a, aoti_cache):
    """The small MLP, converted and compiled once for the session."""
    import precast

    _, _, res = converted_a
    return precast.compile(res.program, cache_dir=aoti_cache, progress=False)
