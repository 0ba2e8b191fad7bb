"""Shared session fixtures. AOTInductor compiles take ~10-25 s each on a small CPU: every test that needs a
compiled package gets it from here, compiled once per session into a session-wide temporary cache."""

from __future__ import annotations

import contextlib
import json
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


# the compile observer's record, one JSON line per compile, in the cache folder the compile used: written by the
# tests (in this process and in the children they start), never by precast
COMPILES = "test-compiles.jsonl"


def _append_compile(event: dict) -> None:
    with open(Path(event["cache_dir"]) / COMPILES, "a") as f:
        f.write(json.dumps(event) + "\n")


@contextlib.contextmanager
def record_compiles():
    """Record every AOTInductor compile of this process in ``<cache dir>/test-compiles.jsonl``."""
    from precast.backends.aoti.package_cache import observe_compiles

    with observe_compiles(_append_compile):
        yield


@pytest.fixture(scope="session", autouse=True)
def _form_from_flags():
    """``precast.compile``'s measured form choice (backends/aoti/forms.py) costs a few compiles per machine and varies
    with load: the suite takes the form the CPU's capabilities imply (deterministic, children inherit it); the
    measured path is tested with injected timings (tests/backends/aoti/test_forms.py)."""
    from precast.backends.aoti.forms import FORM_ENV

    before = os.environ.get(FORM_ENV)
    os.environ[FORM_ENV] = "flags"
    yield
    if before is None:
        os.environ.pop(FORM_ENV, None)
    else:
        os.environ[FORM_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def _compiles_recorded():
    with record_compiles():
        yield


def compiles(cache: Path, key: str) -> int:
    """How many compiles of ``key`` into ``cache`` the tests' observers recorded."""
    log = Path(cache) / COMPILES
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if json.loads(line)["key"] == key)


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


@pytest.fixture(scope="session")
def compiled_a_in_so(converted_a, aoti_cache):
    """The same with its weights inside the package (what ``precast compile -o`` writes): loadable by
    ``torch._inductor.aoti_load_package`` alone. precast.compile's default package holds no weights."""
    import precast

    _, _, res = converted_a
    configs = {"aot_inductor.package_constants_in_so": True}
    return precast.compile(res.program, cache_dir=aoti_cache, progress=False, inductor_configs=configs)


@pytest.fixture(scope="session")
def tiny_decoder():
    """``tests.models.TinyDecoder`` exported with a dynamic sequence length (the recipe's convention)."""
    from tests import models as zoo

    return zoo.tiny_decoder_program()


@pytest.fixture(scope="session")
def compiled_decoder(tiny_decoder, aoti_cache):
    """The tiny decoder compiled once for the session (a model that holds a cache between calls)."""
    import precast

    return precast.compile(tiny_decoder, cache_dir=aoti_cache, progress=False)


def pytest_collection_modifyitems(config, items):
    """In ``./dev.sh``'s lanes (``PRECAST_LANE``), a test listed in tests/lanes.py runs in its one lane and is
    skipped, saying where it runs, in the other."""
    from tests.lanes import ONE_LANE, lane_of, matches

    lane = os.environ.get("PRECAST_LANE")
    if lane not in ("floor", "latest"):
        return
    for item in items:
        entry = lane_of(item.nodeid)
        if entry is not None and entry[0] != lane:
            item.add_marker(pytest.mark.skip(reason=f"runs in the {entry[0]} lane only: {entry[1]}"))
    # an entry whose file was collected must name a test of it (a renamed test would silently run in both lanes)
    files = {item.nodeid.split("::", 1)[0] for item in items}
    for prefix in ONE_LANE:
        path = prefix.split("::", 1)[0]
        if any(matches(path, f) for f in files) and not any(matches(prefix, item.nodeid) for item in items):
            raise pytest.UsageError(f"tests/lanes.py: {prefix!r} names no test of {path}")
