"""Streamed weights as an attacker and a careless user would try them (issue 33 items 1, 2, 3, 6, 9): the input
weights never written whatever the output's spelling, only regular files read, a killed conversion's work folder
removed by the next one, one fp16 rule for inf/NaN/out-of-range values in memory and streamed, bounded error
lines with the hint first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import precast
from precast.errors import PrecastError

safetensors_torch = pytest.importorskip("safetensors.torch")

INF, NAN = float("inf"), float("nan")

MODEL = textwrap.dedent(
    """
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 8)
            with torch.no_grad():  # beyond fp16, inf, -inf and NaN, in one tensor and alone
                self.a.weight[0, :5] = torch.tensor([1e6, -7e4, float("inf"), 65510.0, 1.0])
                self.b.weight[0, :2] = torch.tensor([float("-inf"), float("nan")])
                self.b.bias[:2] = torch.tensor([float("inf"), 2.0])

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.float16):
                return self.b(torch.relu(self.a(x))).float()
    """
)


def _tiny():
    scope: dict = {}
    exec(MODEL, scope)  # noqa: S102 - the model's source is also what the SIGKILL subprocess runs
    return scope["Tiny"]().eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(input folder, weightless program, the program with its weights)."""
    model = _tiny()
    folder = tmp_path_factory.mktemp("tiny") / "in"
    folder.mkdir()
    safetensors_torch.save_file(
        {k: v.detach() for k, v in model.state_dict().items()}, folder / "model.safetensors"
    )
    x = torch.randn(2, 16)
    ep = precast.export_weightless(model, (x,))
    real = torch.export.export(model, (x,))
    return folder, ep, real


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- item 1: the input weights are never written --------------------------------------------------------------
def test_weights_out_spelled_through_a_missing_folder_and_dotdot_is_the_input_and_refused(tiny, monkeypatch):
    folder, ep, _ = tiny
    before = _bytes(folder)
    monkeypatch.chdir(folder.parent)
    for spelling in ("new/../in", "in/../in", "./in/", f"{folder}/sub/.."):
        with pytest.raises(PrecastError, match="overwrite the input weights") as info:
            precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=spelling)
        assert "\n" not in str(info.value)
        assert not (folder.parent / "new").exists()
    assert _bytes(folder) == before


def test_weights_out_through_a_link_into_the_input_is_refused(tiny, tmp_path):
    folder, ep, _ = tiny
    before = _bytes(folder)
    (tmp_path / "link").symlink_to(folder)
    (tmp_path / "deep").symlink_to(folder / "model.safetensors")
    for out in (tmp_path / "link", tmp_path / "link" / "sub", tmp_path / "link" / "new" / ".." / "x"):
        with pytest.raises(PrecastError, match="overwrite the input weights"):
            precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=out)
    # a shard linked from another folder (Hugging Face's cache: snapshots/ -> blobs/): that folder is an input too
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    (blobs / "abc123").write_bytes((folder / "model.safetensors").read_bytes())
    (snap / "model.safetensors").symlink_to(blobs / "abc123")
    with pytest.raises(PrecastError, match="overwrite the input weights"):
        precast.convert(ep, policy="torch", dtype="fp16", weights=snap, weights_out=blobs)
    assert _bytes(folder) == before and sorted(p.name for p in blobs.iterdir()) == ["abc123"]


def test_a_link_swapped_into_the_input_while_writing_is_refused_before_the_rename(
    tiny, tmp_path, monkeypatch
):
    from precast.weights import streamed

    folder, ep, _ = tiny
    before = _bytes(folder)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "elsewhere" / "w")
    real_bytes = streamed.tensor_bytes

    def swap(t):
        if link.is_symlink() and link.readlink() != folder:
            link.unlink()
            link.symlink_to(folder)  # the output now names the input
        return real_bytes(t)

    monkeypatch.setattr(streamed, "tensor_bytes", swap)
    with pytest.raises(PrecastError, match="overwrite the input weights|now resolves"):
        precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=link)
    assert _bytes(folder) == before
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == []  # the work folder went with the refusal


# ---- item 2: only regular files ---------------------------------------------------------------------------------
READER = """
import os, sys
sys.path.insert(0, {root!r})
from precast.errors import PrecastError
from precast.weights.files import WeightFiles
try:
    files = WeightFiles({folder!r})
    if {swap!r}:  # the shard replaced by a FIFO after the headers were read
        os.unlink({swap!r})
        os.mkfifo({swap!r})
        files.read("a.weight")
    print("READ")
except PrecastError as exc:
    print("REFUSED", exc)
"""


def _read_in_a_process(folder: Path, swap: Path | None = None) -> str:
    """What reading ``folder`` does, in a subprocess: a reader blocked on a FIFO holds the GIL (safetensors opens
    files in Rust), so only another process can be given up on."""
    root = str(Path(__file__).resolve().parents[2])
    script = READER.format(root=root, folder=str(folder), swap=str(swap) if swap else "")
    try:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {folder} blocked on a FIFO")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _shard_copy(folder: Path, d: Path) -> Path:
    d.mkdir()
    (d / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    return d


def test_a_fifo_named_like_a_shard_is_one_line_not_a_hang(tiny, tmp_path):
    folder, ep, _ = tiny
    d = _shard_copy(folder, tmp_path / "w")
    os.mkfifo(d / "zz.safetensors")
    out = _read_in_a_process(d)
    assert out.startswith("REFUSED") and "zz.safetensors: a FIFO, not a regular file" in out, out
    with pytest.raises(PrecastError, match="not a regular file"):  # the conversion, in this process
        precast.convert(ep, policy="torch", weights=d, weights_out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    os.unlink(d / "zz.safetensors")
    os.mkfifo(d / "model.safetensors.index.json")  # the index itself
    out = _read_in_a_process(d)
    assert out.startswith("REFUSED") and "index.json: a FIFO, not a regular file" in out, out


def test_a_shard_swapped_for_a_fifo_after_the_check_is_refused_on_the_open_file(tiny, tmp_path):
    folder, _, _ = tiny
    d = _shard_copy(folder, tmp_path / "w")
    out = _read_in_a_process(d, swap=d / "model.safetensors")
    assert out.startswith("REFUSED") and "not a regular file" in out, out


# ---- item 3: a conversion killed with SIGKILL ------------------------------------------------------------------
KILLED = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
import precast
from precast.weights import streamed
{model}
calls = []
real = streamed.tensor_bytes
def killing(t):
    calls.append(1)
    if len(calls) == 3:  # two tensors written, the process killed before the third
        os.kill(os.getpid(), signal.SIGKILL)
    return real(t)
streamed.tensor_bytes = killing
ep = precast.export_weightless(Tiny().eval(), (torch.randn(2, 16),))
precast.convert(ep, policy="torch", dtype="fp16", weights={folder!r}, weights_out={out!r})
"""


def test_a_work_folder_left_by_sigkill_is_removed_by_the_next_run(tiny, tmp_path):
    folder, ep, real = tiny
    out = tmp_path / "out"
    root = str(Path(__file__).resolve().parents[2])
    script = KILLED.format(root=root, model=MODEL, folder=str(folder), out=str(out))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file() and not out.exists(), left
    (
        tmp_path / ".mine.0123456789ab.tmp"
    ).mkdir()  # a user's folder of the same shape, without precast's marker
    (tmp_path / ".mine.0123456789ab.tmp" / "notes.txt").write_text("keep")
    res = precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mine.0123456789ab.tmp", "out"]
    assert res.report.weights["stale_removed"] == [left[0].name]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model.safetensors.index.json"]
    ref = precast.convert(real, policy="torch", dtype="fp16", verify=False)
    got = safetensors_torch.load_file(out / "model.safetensors")
    for name, value in got.items():
        assert torch.equal(_bits(value), _bits(ref.program.state_dict[name])), name


def test_a_work_folder_being_written_is_left_alone(tiny, tmp_path):
    from precast.weights.streamed import MARK, _work_folder, remove_stale

    folder, ep, _ = tiny
    with _work_folder(tmp_path, "out") as live:  # another conversion, still writing: its lock held
        assert (live / MARK).is_file()
        res = precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=tmp_path / "out")
        assert live.is_dir() and res.report.weights["stale_removed"] == []
    assert remove_stale(tmp_path) == [live.name]  # its writer gone (the lock released): stale now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- item 6: one fp16 rule, in memory and streamed --------------------------------------------------------------
def test_fp16_inf_nan_and_out_of_range_one_rule_in_memory_and_streamed(tiny, tmp_path):
    folder, ep, real = tiny
    ref = precast.convert(real, policy="torch", dtype="fp16", verify=False)
    out = precast.convert(ep, policy="torch", dtype="fp16", weights=folder, weights_out=tmp_path / "o")
    written = safetensors_torch.load_file(tmp_path / "o" / "model.safetensors")
    state = ref.program.state_dict
    assert set(written) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    for name, value in written.items():
        assert value.dtype == torch.float16 and torch.equal(_bits(value), _bits(state[name])), name
    a, b, bias = state["a.weight"][0, :5].tolist(), state["b.weight"][0, :2], state["b.bias"][:2].tolist()
    assert a == [65504.0, -65504.0, INF, 65504.0, 1.0]  # inf stays inf beside values that need the clamp
    assert b[0].item() == -INF and b[1].isnan() and bias == [INF, 2.0]
    # the count is the values stored clamped (1e6, -7e4, 65510), never inf or NaN, in both reports
    assert out.report.weights["clamped"] == {"a.weight": 3}
    clamped = [d.message for d in ref.report.diagnostics if d.code == "fp16-clamped"]
    assert len(clamped) == 1 and "3 value" in clamped[0]


# ---- item 9: error lines bounded, the hint first ----------------------------------------------------------------
def test_name_list_is_bounded():
    from precast.errors import name_list

    names = [f"layers.{i}.weight" for i in range(147)]
    line = name_list(names)
    assert line.startswith("layers.0.weight, layers.1.weight") and line.endswith("(147 in all)")
    assert len(line) < 120 and name_list(["a", "b"]) == "a, b"


def test_another_models_files_say_so_first_in_a_short_line(tmp_path):
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(60))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    ep = precast.export_weightless(Wide(), (torch.randn(1, 8),))
    other = {f"blocks.{i}.weight": torch.zeros(8, 8) for i in range(60)}
    other["layers.0.weight"] = torch.zeros(8, 8)  # one name in common: still another model
    safetensors_torch.save_file(other, tmp_path / "model.safetensors")
    with pytest.raises(PrecastError) as info:
        precast.convert(ep, policy="torch", weights=tmp_path, weights_out=tmp_path.parent / "o")
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 600, msg
    head = msg.split(": ", 1)[1]
    assert head.startswith("these files belong to another model"), msg
    assert "(119 in all)" in msg and "rotary" not in msg
    # a few names missing (a non-persistent buffer made at construction): the other hint, still first
    mine = {
        f"layers.{i}.{k}": torch.zeros(8, 8) if k == "weight" else torch.zeros(8)
        for i in range(60)
        for k in ("weight", "bias")
    }
    del mine["layers.3.bias"]
    (tmp_path / "model.safetensors").unlink()
    safetensors_torch.save_file(mine, tmp_path / "model.safetensors")
    with pytest.raises(PrecastError) as info:
        precast.convert(ep, policy="torch", weights=tmp_path, weights_out=tmp_path.parent / "o")
    msg = str(info.value)
    assert "1 constant(s) the program reads hold no value" in msg and "give them real values" in msg
    assert msg.index("give them real values") < msg.index("layers.3.bias")
