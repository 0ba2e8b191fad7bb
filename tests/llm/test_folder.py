"""``precast.load(DIR)`` and the folder format (issue 49 items 1, 3 and 6): the folder export-llm wrote runs as it
is, with nothing converted or compiled, on OpenVINO (its compiled form), AOTInductor (its package) and eager torch,
bitwise as the in-memory conversion compiled fresh; each weight is stored once; what is not valid on this machine
(another OpenVINO, another form) is rebuilt outside the folder and said; a newer format is one line.

The tiny Llama checkpoint and its export are test_cli_llm_export's (one real export per session)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import precast
from precast.cli import main
from precast.errors import PrecastError
from precast.llm.generate import ProgramModel
from tests.cli.test_cli_llm_export import CACHE, _has_openvino, checkpoint, exports  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not _has_openvino(), reason="the folder's OpenVINO form needs openvino")

IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def folder(checkpoint, exports, tmp_path_factory, aoti_cache) -> Path:  # noqa: F811
    """export-llm --weight-format int8 --backend openvino aoti, the AOTInductor compile into the session's cache."""
    out = tmp_path_factory.mktemp("folder") / "smol"
    patch = pytest.MonkeyPatch()
    patch.setenv("PRECAST_CACHE_DIR", str(aoti_cache))
    argv = ["export-llm", checkpoint, "-o", out, "--weight-format", "int8", "--max-cache-len", CACHE]
    argv += ["--backend", "openvino", "aoti"]
    try:
        assert main([*map(str, argv), "--threads", "1"]) == 0
    finally:
        patch.undo()
    return out


@pytest.fixture(scope="module")
def converted(checkpoint, exports):  # noqa: F811
    ep = exports[(str(checkpoint), CACHE)]
    return precast.convert(ep, policy="torch", dtype=torch.bfloat16, cache_dtype="bf16", weight_format="int8")


def _logits(model, ids=IDS) -> torch.Tensor:
    model.reset()
    return model(input_ids=torch.tensor([ids]), cache_position=torch.arange(len(ids)))


def _no_conversion(monkeypatch) -> tuple[list, object]:
    """Every way to convert or compile made to fail, and AOTInductor's compiles counted."""
    from precast.backends.aoti.package_cache import observe_compiles
    from precast.backends.openvino import model as ov_model

    def refuse(*_a, **_k):
        raise AssertionError("converted at load time")

    monkeypatch.setattr(ov_model, "convert", refuse)
    monkeypatch.setattr("precast.api.convert_with", refuse)
    monkeypatch.setattr("precast.llm.folder_engines.folder_program", refuse)  # nor read the program
    compiles: list = []
    return compiles, observe_compiles(compiles.append)


@pytest.mark.parametrize("backend", ["openvino", "aoti", "eager"])
def test_the_folder_runs_as_it_is_bitwise(folder, converted, backend, monkeypatch, aoti_cache):
    compiles, observing = _no_conversion(monkeypatch)
    if backend == "eager":  # the program is what eager runs
        monkeypatch.undo()
    with observing:
        llm = precast.load(folder, backend=backend, threads=1)
        got = _logits(llm.model if backend != "eager" else ProgramModel(llm.model))
        res = llm.generate("the quick brown fox", max_new_tokens=6)
    assert compiles == [] and len(llm.notes) == 1 and "again" not in llm.notes[0], llm.notes
    monkeypatch.undo()
    if backend == "openvino":
        fresh = precast.compile(converted.program, backend="openvino", threads=1)
    elif backend == "aoti":
        fresh = precast.compile(converted.program, cache_dir=aoti_cache, threads=1)
    else:
        fresh = ProgramModel(converted.program)
    assert torch.equal(got, _logits(fresh))
    want = precast.generate(fresh, llm.encode("the quick brown fox"), max_new_tokens=6, stop_tokens=[2])
    assert res.new_tokens == want.new_tokens and llm.threads == (None if backend == "eager" else 1)


def test_the_default_engine_is_the_folders_openvino(folder):
    llm = precast.load(folder, threads=1)
    assert (
        llm.backend == "openvino"
        and llm.model.precision_hint == llm.folder.manifest["openvino"]["plan"]["hint"]
    )
    manifest = llm.folder.manifest  # export-llm --threads 1: both engines made for 1 thread
    assert manifest["version"] == 2 and manifest["openvino"]["threads"] == manifest["aoti"]["threads"] == 1


def test_each_weight_is_stored_once(folder, converted):
    tensors = {**converted.program.state_dict, **converted.program.constants}
    weights = sum(t.numel() * t.element_size() for t in tensors.values() if bool(torch.any(t != 0)))
    program = torch.export.load(folder / "program.pt2")
    assert all(t.device.type == "meta" for t in program.state_dict.values())  # the graph only
    held = sum(
        (folder / name).stat().st_size for name in ("model.bin", "weights.bin") if (folder / name).exists()
    )
    assert held <= 1.05 * weights, (held, weights)
    (entry,) = (folder / "aoti" / "aoti").iterdir()
    assert json.loads((entry / "manifest.json").read_text())["weights"]["external"]  # the package holds none
    from precast.llm.folder import folder_program, open_folder

    filled = folder_program(open_folder(folder))
    for name, t in {**filled.state_dict, **filled.constants}.items():
        assert torch.equal(t, tensors[name]) and t.dtype == tensors[name].dtype, name


def test_the_folders_graph_keeps_only_the_frames_messages_name(folder, converted):
    """program.pt2's stack traces are cut to the user's frame (8 of SmolLM2-135M's 16 MB of graph were traces
    through transformers' wrappers): every node names the same source line and code as in memory."""
    from precast.errors import user_source_code, user_source_line

    saved = {n.name: n for n in torch.export.load(folder / "program.pt2").graph.nodes}
    full = [n for n in converted.program.graph.nodes if n.meta.get("stack_trace")]
    assert len(full) > 50 and max(len(n.meta["stack_trace"].splitlines()) for n in full) > 10
    for node in full:
        kept = saved[node.name]
        assert len(kept.meta["stack_trace"].splitlines()) <= 2, node.name
        assert user_source_line(kept) == user_source_line(node), node.name
        assert user_source_code(kept) == user_source_code(node), node.name


def _copy(folder: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "export.json").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = manifest
        for part in path:
            node = node[part]
        node[last] = value
    (copy / "export.json").write_text(json.dumps(manifest))
    return copy


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_a_form_made_for_another_openvino_is_rebuilt_outside_and_said(folder, converted, tmp_path):
    copy = _copy(folder, tmp_path, openvino__made_on__openvino="2020.1.0")
    before = _listing(copy)
    llm = precast.load(copy, backend="openvino", threads=1)
    assert "made with OpenVINO 2020.1.0" in llm.notes[0] and "converted program.pt2 again" in llm.notes[0]
    assert _listing(copy) == before  # the folder is only read
    fresh = precast.compile(converted.program, backend="openvino", threads=1)
    assert torch.equal(_logits(llm.model), _logits(fresh))


def test_an_aoti_package_that_does_not_fit_is_compiled_into_the_users_cache(folder, tmp_path, aoti_cache):
    copy = _copy(folder, tmp_path, aoti__toolchain__isa="a CPU from the future")
    before = _listing(copy)
    llm = precast.load(copy, backend="aoti", threads=1, cache_dir=aoti_cache)
    assert "built for another CPU" in llm.notes[0] and "your cache" in llm.notes[0], llm.notes
    assert _listing(copy) == before
    # told before the compile (or the cache's load) starts, and why
    from precast.llm.folder import open_folder
    from precast.llm.folder_engines import load_engine

    said: list[str] = []
    load_engine(open_folder(copy), "aoti", 1, aoti_cache, False, notify=said.append)
    assert (
        len(said) == 1 and "built for another CPU" in said[0] and "at 1 thread(s) from your cache" in said[0]
    )


def test_formats_old_and_new(folder, tmp_path):
    newer = _copy(folder, tmp_path, version=99)
    with pytest.raises(PrecastError, match="folder format version 99; this precast reads versions 1 to 2"):
        precast.load(newer)
    # format 1: the program held its weights and the IR was the converted one: read, its engines built and said
    old = tmp_path / "v1"
    old.mkdir()
    manifest = json.loads((folder / "export.json").read_text())
    for key in ("openvino", "aoti", "weight_index"):
        manifest.pop(key)
    manifest["version"], manifest["files"] = 1, {"program": "program.pt2", "tokenizer": "tokenizer.json"}
    (old / "export.json").write_text(json.dumps(manifest))
    from precast.llm.folder import folder_program, open_folder

    torch.export.save(folder_program(open_folder(folder)), old / "program.pt2")
    shutil.copy(folder / "tokenizer.json", old / "tokenizer.json")
    llm = precast.load(old, backend="openvino", threads=1)
    assert "no OpenVINO IR" in llm.notes[0] and llm.backend == "openvino"
    assert precast.load(old, backend="eager").generate([5, 6], max_new_tokens=3).new_tokens


def test_cli_generate_from_the_folder_names_its_engine_and_threads(folder, monkeypatch, capsys):
    compiles, observing = _no_conversion(monkeypatch)
    with observing:
        code = main(
            ["generate", str(folder), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--threads", "1"]
        )
    out, err = capsys.readouterr()
    assert code == 0 and compiles == []
    assert "model.xml: OpenVINO's compiled form opened" in err and "(openvino, 1 thread)" in err, err


def test_a_package_others_can_write_is_not_run(folder, tmp_path, aoti_cache):
    """Native code is loaded from a folder only as from precast's own cache: yours, and no one else's to write."""
    copy = _copy(folder, tmp_path)
    (copy / "aoti").chmod(0o777)
    llm = precast.load(copy, backend="aoti", threads=1, cache_dir=aoti_cache)
    assert "others can write" in llm.notes[0] and "your cache" in llm.notes[0], llm.notes


def test_cli_generate_says_a_rebuild_before_it_starts(folder, tmp_path, monkeypatch, capsys):
    """A folder made for another OpenVINO is converted again: `precast generate` says so, and why, before the
    conversion starts (a log shows it while the wait runs), then how long it took."""
    copy = _copy(folder, tmp_path, openvino__made_on__openvino="2020.1.0")
    said_before: list[str] = []
    real_compile = precast.compile

    def compile_(*args, **kwargs):
        said_before.append(capsys.readouterr().err)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(precast, "compile", compile_)
    code = main(["generate", str(copy), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0 and len(said_before) == 1
    assert (
        "made with OpenVINO 2020.1.0" in said_before[0] and "converting program.pt2 again" in said_before[0]
    )
    assert "converted program.pt2 again for this machine (" in err
