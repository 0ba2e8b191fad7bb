"""Trust (issue 20): no lost input, no stale or poisoned cache, no garbage from a wrong shape, safe in threads.

One test (or a few) per finding of the review; each failed on the code before the fix. AOTInductor compiles
come from the session fixtures (``compiled_a``) or hit their cache entries.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

import precast
import precast.version
from benchmarks.cli_bad_inputs import FACTORIES
from precast.backends.aoti.compiler import compile_configs
from precast.backends.aoti.package_cache import cache_key, resolve_cache_dir
from precast.cli import main
from precast.errors import PrecastError
from tests import models as zoo
from tests.conftest import ROOT, small_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    model, inputs = zoo.seed_model()
    good = d / "good.pt2"
    torch.export.save(precast.convert(model, inputs).program, str(good))
    return d, good


def one_line_exit_2(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ---- 1. the input is destroyed --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{p}", "-o", "{p}"],
        ["report", "{p}", "-o", "{p}", "--format", "json"],
        ["compile", "{p}", "-o", "{p}"],
        ["compile", "{p}", "--backend", "onnx", "-o", "{p}"],
        ["convert", "{p}", "-o", "{link}"],  # another name for the same file
    ],
    ids=["convert", "report", "compile", "compile-onnx", "convert-symlink"],
)
def test_output_that_is_the_input_is_refused(saved, tmp_path, capsys, argv):
    _, good = saved
    src = tmp_path / "model.pt2"
    src.write_bytes(good.read_bytes())
    (tmp_path / "link.pt2").symlink_to(src)
    before = src.read_bytes()
    err = one_line_exit_2(capsys, [a.format(p=src, link=tmp_path / "link.pt2") for a in argv])
    assert "is also the input" in err
    assert src.read_bytes() == before


# ---- 2. a compiled model runs inputs of the wrong shape -------------------------------------------------------------
@pytest.mark.parametrize(
    "x",
    [torch.randn(4, 16), torch.randn(2, 1), torch.randn(4, 64, 3), torch.randn(4, 64, dtype=torch.float64)],
    ids=["4x16", "2x1", "4x64x3", "float64"],
)
def test_compiled_model_refuses_wrong_inputs(compiled_a, x):
    with pytest.raises(PrecastError) as err:
        compiled_a(x)
    message = str(err.value)
    assert "\n" not in message and "'x'" in message and str(tuple(x.shape)) in message and ", 64)" in message


def test_compiled_model_refuses_wrong_count(compiled_a):
    with pytest.raises(PrecastError, match="takes x"):
        compiled_a(torch.randn(4, 64), torch.randn(4, 64))


def test_input_check_costs_little(compiled_a):
    """The check is a few attribute reads: microseconds (the MLP benchmark's ratio is in docs/compile.md)."""
    x = torch.randn(4, 64)
    sig = compiled_a.signature
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        sig.check((x,), {})
    per_call = (time.perf_counter() - started) / n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per check"


# ---- 3. the cache key misses what changes the package; the cache folder is anyone's ---------------------------------
def test_cache_key_covers_the_toolchain(converted_a, monkeypatch):
    import torch._inductor.config as inductor_config

    ep = converted_a[2].program
    base = cache_key(ep, {}, True)
    with inductor_config.patch(freezing=True):
        assert cache_key(ep, {}, True) != base  # in-process inductor config
    assert cache_key(ep, {}, True) == base
    for var, value in [
        ("TORCHINDUCTOR_FREEZING", "1"),
        ("TORCHINDUCTOR_MAX_AUTOTUNE", "1"),
        ("TORCHINDUCTOR_CPP_MARCH", "x86-64"),
        ("CXX", "clang++"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert cache_key(ep, {}, True) != base, var
    with monkeypatch.context() as m:
        m.setattr(precast.version, "__version__", "99.0")  # where the cache key reads it
        assert cache_key(ep, {}, True) != base
    with monkeypatch.context() as m:
        m.setattr(torch.version, "git_version", "0" * 40)
        assert cache_key(ep, {}, True) != base


def test_cache_key_ignores_the_machine_info_a_compile_writes_into_the_config(converted_a):
    """AOTInductor fills ``aot_inductor.metadata`` in place during a compile (AOTI_DEVICE_KEY, AOTI_CPU_ISA...),
    without invalidating inductor's cached config hash: the key is computed from the values, ignores what the
    compile writes (the machine is keyed on its own) and keeps what the user puts there."""
    import torch._inductor.config as inductor_config

    ep = converted_a[2].program
    base = cache_key(ep, {}, True)
    with inductor_config.patch(
        {"aot_inductor.metadata": {"AOTI_CPU_ISA": "AVX512", "AOTI_PLATFORM": "linux"}}
    ):
        assert cache_key(ep, {}, True) == base
    with inductor_config.patch({"aot_inductor.metadata": {"model_version": "7"}}):
        assert cache_key(ep, {}, True) != base
    metadata = inductor_config.aot_inductor.metadata
    metadata["mine"] = "1"  # mutated in place, as a compile does: no dirty flag, still seen
    try:
        assert cache_key(ep, {}, True) != base
    finally:
        metadata.pop("mine")


def test_frozen_compile_in_a_subprocess_gets_its_own_key(converted_a):
    """TORCHINDUCTOR_FREEZING=1 in the environment (read by inductor at import) changes the key."""
    code = (
        "import sys, torch, precast; from tests.conftest import small_model;"
        "from precast.backends.aoti.package_cache import cache_key;"
        "print(cache_key(precast.convert(*small_model(0)).program, {}, True))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        )
        for env in ({}, {"TORCHINDUCTOR_FREEZING": "1"})
    ]
    keys = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)  # generous: the machine may be shared
        assert proc.returncode == 0, err[-1500:]
        keys.append(out.split()[-1])
    assert keys[0] != keys[1]


def test_cache_dir_is_private_and_a_shared_one_is_refused(tmp_path):
    root = resolve_cache_dir(tmp_path / "new")
    for d in (root, root / "aoti", root / "tmp", root / "locks"):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, d
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PrecastError, match="writable by group or others"):
        resolve_cache_dir(shared)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.getuid() == 0:  # root can hand it to someone else; others cannot make the case
        os.chown(theirs, 12345, 12345)
        with pytest.raises(PrecastError, match="owned by uid 12345"):
            resolve_cache_dir(theirs)


# ---- 4. opening a .pt2 can run code -----------------------------------------------------------------------------
class _Touch:
    """Unpickling this creates a file: what a malicious sample input would do (harmlessly here)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # touches the marker, then gives back sample inputs of the right shape
        code = f"(__import__('pathlib').Path({str(self.path)!r}).touch(), ((__import__('torch').zeros(4, 128),), {{}}))[1]"
        return (eval, (code,))


def evil_copy(good: Path, out: Path, marker: Path) -> Path:
    payload = io.BytesIO()
    torch.save(_Touch(marker), payload, pickle_module=pickle)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if "/data/sample_inputs/" in info.filename:
                data = payload.getvalue()
            dst.writestr(info, data)
    return out


def test_pt2_with_a_pickle_is_refused_and_runs_nothing(saved, tmp_path, capsys):
    _, good = saved
    marker = tmp_path / "pwned"
    evil = evil_copy(good, tmp_path / "evil.pt2", marker)
    err = one_line_exit_2(capsys, ["report", str(evil)])
    assert "--trust-pickle" in err and "sample_inputs" in err
    assert not marker.exists()
    with pytest.raises(PrecastError, match="trust_pickle=True"):
        from precast.pipeline.load import load_program

        load_program(evil)
    assert not marker.exists()
    # the user's explicit trust: loaded as torch would (this payload merely touches a file)
    from precast.pipeline.load import load_program

    load_program(evil, trust_pickle=True)
    assert marker.exists()


def test_plain_program_loads_without_trust(saved):
    from precast.pipeline.load import load_program

    _, good = saved
    ep = load_program(good)
    assert isinstance(ep, torch.export.ExportedProgram) and ep.example_inputs is not None


# ---- 5. the umask is never changed -----------------------------------------------------------------------------
def test_atomic_write_never_touches_the_umask(tmp_path, monkeypatch):
    from precast import io as pio

    def forbidden(mask):
        raise AssertionError("os.umask called: another thread's files would get the wrong mode")

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", forbidden)
        pio.write_bytes(tmp_path / "out.bin", b"data")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.bin").stat().st_mode) == 0o640


# ---- 6. a full disk, a read-only destination, SIGTERM / SIGINT during a write ---------------------------------------
def test_full_disk_is_one_line_and_leaves_nothing(saved, tmp_path, capsys, monkeypatch):
    from precast import io as pio

    _, good = saved
    monkeypatch.setattr(pio.shutil, "disk_usage", lambda p: _Usage(1 << 20))
    err = one_line_exit_2(capsys, ["convert", str(good), "-o", str(tmp_path / "out.pt2")])
    assert "MiB free" in err
    monkeypatch.undo()

    def enospc(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pio.os, "fsync", enospc)
    err = one_line_exit_2(capsys, ["report", str(good), "--format", "json", "-o", str(tmp_path / "r.json")])
    assert "disk full" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


class _Usage:
    def __init__(self, free):
        self.free = free


def test_read_only_destination_is_one_line(saved, capsys):
    _, good = saved
    err = one_line_exit_2(
        capsys, ["report", str(good), "--format", "json", "-o", "/proc/precast-report.json"]
    )
    assert "/proc" in err


SLOW_WRITE = r"""
import os, signal, sys, time
# a test runner started as a background job (`cmd &` in a non-interactive shell) has SIGINT ignored, and so has
# this child, which then never sees the KeyboardInterrupt under test: restore Python's handler here (the CLI
# itself leaves an ignored SIGINT ignored, as nohup-style callers intend)
signal.signal(signal.SIGINT, signal.default_int_handler)
import precast.io as pio
if sys.argv[3] == "named":  # the fallback where O_TMPFILE is unavailable: a named temporary file
    pio._write_unnamed = lambda folder, p, data: False
def slow_fsync(fd):
    print("writing", flush=True)
    time.sleep(60)
pio.os.fsync = slow_fsync
from precast.cli import main
sys.exit(main(["report", sys.argv[1], "--format", "json", "-o", sys.argv[2]]))
"""


@pytest.mark.parametrize("how", ["unnamed", "named"])
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_signal_during_a_write_leaves_no_file(saved, tmp_path, sig, status, how):
    _, good = saved
    out = tmp_path / "out" / "report.json"
    out.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, str(good), str(out), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.stdout.readline().strip() == "writing"
    if how == "named":
        assert list(out.parent.iterdir()), "the temporary file exists while writing"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert len(err.strip().splitlines()) == 1 and "nothing was written" in err
    assert list(out.parent.iterdir()) == [], "a partial or temporary file was left"


# ---- 7. threads -------------------------------------------------------------------------------------------------------
def test_convert_and_load_from_threads(saved, tmp_path):
    from precast.pipeline.load import load_program

    _, good = saved
    models = [small_model(seed) for seed in range(4)]
    want = [precast.convert(m, x).program.module()(*x) for m, x in models]
    level = logging.getLogger("torch.export").level
    got: dict[int, torch.Tensor] = {}
    loaded: list = []
    errors: list[BaseException] = []

    def convert(i):
        try:
            m, x = models[i % 4]
            got[i] = precast.convert(m, x).program.module()(*x)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    def load():
        try:
            loaded.append(load_program(good))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=convert, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(torch.equal(got[i], want[i % 4]) for i in range(8))
    assert len(loaded) == 4
    assert logging.getLogger("torch.export").level == level  # silenced by filters, never by levels
    assert logging.getLogger("torch.export").filters == []


# ---- 8. smaller ----------------------------------------------------------------------------------------------------
def test_lock_says_what_it_waits_for_and_gives_up(tmp_path, capsys, monkeypatch):
    from filelock import FileLock

    from precast import io as pio

    monkeypatch.setattr(pio, "LOCK_NOTICE_S", 0.2)
    path = tmp_path / "k.lock"
    holder = FileLock(str(path))
    holder.acquire()
    try:
        with pytest.raises(PrecastError) as err, pio.file_lock(path, "compiling cache entry k", timeout=1.0):
            pass
    finally:
        holder.release()
    assert "still locked after 1 s" in str(err.value) and str(path) in str(err.value)
    assert f"waiting for {path}" in capsys.readouterr().err
    monkeypatch.setenv("PRECAST_LOCK_TIMEOUT", "soon")
    with pytest.raises(PrecastError, match="PRECAST_LOCK_TIMEOUT=soon"):
        pio.lock_timeout()


def test_compile_gives_up_on_a_stuck_lock(converted_a, tmp_path):
    """A holder that never finishes: precast.compile fails in one line after lock_timeout (no compile runs)."""
    from filelock import FileLock

    cache = resolve_cache_dir(tmp_path / "cache")
    # the key precast.compile uses for mode="default" (its configs and the form's name)
    key = cache_key(converted_a[2].program, {**compile_configs(), "precast.form": "default"}, True)
    holder = FileLock(str(cache / "locks" / f"{key}.lock"))
    holder.acquire()
    try:
        with pytest.raises(PrecastError, match="still locked"):
            precast.compile(
                converted_a[2].program, cache_dir=cache, progress=False, lock_timeout=1.0, mode="default"
            )
    finally:
        holder.release()


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"format": 2, "key": "K", "files": [1]}',
        '{"format": 2, "key": "K", "files": {"model.pt2": 3}}',
        "[" * 100000,
        "{",
    ],
    ids=["list", "files-list", "hash-int", "deep", "truncated"],
)
def test_malformed_manifest_is_a_miss_not_a_crash(tmp_path, text):
    from precast.backends.aoti.package_cache import read_entry

    entry = tmp_path / "K"
    entry.mkdir()
    (entry / "manifest.json").write_text(text)
    manifest, why = read_entry(entry, "K")
    assert manifest is None and why != "absent"


@pytest.mark.parametrize(
    "text",
    ["[]", '{"version": 1, "entries": []}', '{"version": 1, "entries": {"k": 3}}', "[" * 100000, "nope"],
)
def test_malformed_latency_cache_is_a_miss_with_a_warning(tmp_path, text):
    from precast.numerics import latency

    path = tmp_path / "latency.json"
    path.write_text(text.replace('"version": 1', f'"version": {latency.CACHE_VERSION}'))
    with pytest.warns(UserWarning, match="latency cache") if text not in ("[]",) else _nothing():
        assert latency._load(path) == {}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_memo_is_keyed_by_content(converted_a, compiled_a, aoti_cache):
    """The same program object, its weights changed in place: compile must not return the old package."""
    import copy

    _, inputs, res = converted_a
    clone = copy.deepcopy(res.program)
    first = precast.compile(clone, cache_dir=aoti_cache, progress=False)
    assert first.key == compiled_a.key
    with torch.no_grad():
        for value in clone.state_dict.values():
            if value.is_floating_point():
                value.mul_(-2)  # the key test_compile_of_a_modified_copy_uses_the_copys_weights compiles
    again = precast.compile(clone, cache_dir=aoti_cache, progress=False)
    assert again is not first and again.key != first.key
    assert torch.equal(again(*inputs), clone.module()(*inputs))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["convert", "trust_factories:raises", "-o", "{d}/o.pt2"], ["ValueError: no weights here"]),
        (["convert", "trust_factories:exits", "-o", "{d}/o.pt2"], ["sys.exit(7)"]),
        (["convert", "trust_factories:wrong", "-o", "{d}/o.pt2"], ["must return (model, example_inputs)"]),
        (["report", "{good}", "--width", "-5"], ["--width -5"]),
        (["bench", "--model", "mlp", "--out", "{d}/afile"], ["is a file"]),
    ],
    ids=["factory-raises", "factory-exits", "factory-wrong", "width", "bench-out-file"],
)
def test_every_cli_path_ends_in_one_line(saved, tmp_path, capsys, monkeypatch, argv, words):
    _, good = saved
    (tmp_path / "trust_factories.py").write_text(FACTORIES)  # the bad-input table's factories
    (tmp_path / "afile").write_text("keep me")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = one_line_exit_2(capsys, [a.format(d=tmp_path, good=good) for a in argv])
    for w in words:
        assert w in err, err
    assert not (tmp_path / "o.pt2").exists() and (tmp_path / "afile").read_text() == "keep me"


def test_bench_work_dir_is_private_and_removed(monkeypatch):
    from precast.bench import variants

    seen = {}

    def fake_run_all(models, batches, work, *rest):
        seen["work"] = work
        seen["mode"] = stat.S_IMODE(work.stat().st_mode)
        return []

    monkeypatch.setattr(variants, "_run_all", fake_run_all)
    variants.run_bench(["mlp"], [1], variants=("eager_fp32",), measure_rss=False)
    assert str(os.getpid()) not in seen["work"].name and seen["mode"] == 0o700
    assert not seen["work"].exists()


def test_load_names_an_output_type_not_registered_with_pytree(tmp_path):
    """torch.export.load logs the real cause (an output type pytree does not know in this process) and raises
    "We ran into an error when deserializing"; precast names the type and the fix, not "save it with
    torch.export.save" (docs/streaming.md's first export returned transformers' CausalLMOutputWithPast)."""
    import dataclasses

    from torch.utils import _pytree as pytree

    from precast.pipeline.load import load_program

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    class Model(torch.nn.Module):
        def forward(self, x):
            return Out(x * 2)

    pytree.register_dataclass(Out, serialized_type_name="tests.backends.aoti.test_package_cache_trust.Out")
    try:
        ep = torch.export.export(Model(), (torch.ones(2),))
        torch.export.save(ep, tmp_path / "out.pt2")
    finally:
        pytree._deregister_pytree_node(Out)
    with pytest.raises(PrecastError) as err:
        load_program(tmp_path / "out.pt2")
    text = str(err.value)
    assert (
        "tests.backends.aoti.test_package_cache_trust.Out, a type not registered with torch's pytree" in text
    )
    assert "precast.LogitsOnly" in text and "save it with torch.export.save" not in text and "\n" not in text
