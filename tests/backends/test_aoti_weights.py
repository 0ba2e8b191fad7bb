"""Packages without their weights (issue 27) and weights from safetensors shards (issue 29).

``precast.compile`` leaves the constants out of the package and hands the loader tensors it owns: a program's own
weights (held once), or, for a program converted with streamed (meta) weights, those of its shards."""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.backends.cache import MANIFEST
from precast.errors import PrecastError
from tests.conftest import small_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def meta_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` with every constant a meta tensor of the same shape and dtype (what a streamed conversion gives)."""

    def meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        t = torch.empty_like(v, device="meta")
        return torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t

    out = ep._update(
        ep.graph_module,
        ep.graph_signature,
        state_dict={k: meta(v) for k, v in ep.state_dict.items()},
        constants={k: meta(v) for k, v in ep.constants.items()},
    )
    out.example_inputs = ep.example_inputs
    return out


def write_shards(tensors: dict[str, torch.Tensor], folder, shards: int = 2) -> None:
    """transformers' layout: model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].detach().contiguous() for n in names[i::shards]}
        safetensors_torch.save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def streamed(converted_a, compiled_a, aoti_cache, tmp_path_factory):
    _, inputs, res = converted_a
    folder = tmp_path_factory.mktemp("shards")
    stored = {**res.program.state_dict, **res.program.constants}
    write_shards({k: v for k, v in stored.items() if isinstance(v, torch.Tensor)}, folder)
    ep = meta_program(res.program)
    cm = precast.compile(ep, weights=folder, cache_dir=aoti_cache, progress=False)
    return ep, folder, cm


@pytest.mark.aoti
def test_package_holds_no_weights_and_the_model_shares_the_programs(converted_a, compiled_a):
    _, _, res = converted_a
    manifest = json.loads((compiled_a.package_path.parent / MANIFEST).read_text())
    assert manifest["weights"]["external"] is True
    # no copy: each weight the code reads as stored is held once (oneDNN's blocked copies, where this CPU's form
    # reads them, are made from the weights at load: test_aoti_forms)
    held = {n: t.data_ptr() for n, t in compiled_a._constants.items() if n in res.program.state_dict}
    assert held and held == {n: res.program.state_dict[n].data_ptr() for n in held}


@pytest.mark.aoti
def test_meta_program_loaded_from_shards_equals_the_normal_compile_bitwise(streamed, converted_a, compiled_a):
    _, inputs, _ = converted_a
    ep, folder, cm = streamed
    assert cm.key != compiled_a.key  # keyed by the meta program (no weight bytes): its own entry
    assert cm.form == compiled_a.form  # streamed weights get this CPU's form too (oneDNN's blocked at load)
    assert torch.equal(cm(*inputs), compiled_a(*inputs))
    # a single .safetensors file works the same (names = the program's stored constant names)
    single = folder.parent / "one.safetensors"
    safetensors_torch.save_file(
        {k: v for s in folder.glob("*.safetensors") for k, v in _read(s).items()}, single
    )
    one = precast.compile(ep, weights=single, cache_dir=cm.package_path.parents[2], progress=False)
    assert one.from_cache and torch.equal(one(*inputs), compiled_a(*inputs))


def _read(path):
    return safetensors_torch.load_file(str(path))


@pytest.mark.aoti
def test_shards_that_do_not_match_the_program_are_refused_in_one_line(streamed, converted_a, tmp_path):
    _, _, res = converted_a
    ep, folder, cm = streamed
    tensors = {k: v for s in folder.glob("*.safetensors") for k, v in _read(s).items()}
    name = sorted(tensors)[0]
    bad = {**tensors, "extra.weight": torch.zeros(2)}
    del bad[sorted(tensors)[1]]
    bad[name] = bad[name].float()
    write_shards(bad, tmp_path / "bad")
    with pytest.raises(PrecastError) as err:
        precast.compile(ep, weights=tmp_path / "bad", cache_dir=cm.package_path.parents[2], progress=False)
    msg = str(err.value)
    assert (
        "\n" not in msg and "missing" in msg and "extra.weight" in msg and f"{name} is torch.float32" in msg
    )
    # a truncated shard: refused by its header check before any tensor is read
    shard = sorted(folder.glob("*.safetensors"))[0]
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / shard.name).write_bytes(shard.read_bytes()[:-10])
    (cut / "model.safetensors.index.json").write_text((folder / "model.safetensors.index.json").read_text())
    for other in sorted(folder.glob("*.safetensors"))[1:]:
        (cut / other.name).write_bytes(other.read_bytes())
    with pytest.raises(PrecastError, match="not a valid safetensors file"):
        precast.compile(ep, weights=cut, cache_dir=cm.package_path.parents[2], progress=False)


def test_weights_argument_is_refused_where_it_cannot_apply(converted_a, tmp_path):
    _, _, res = converted_a
    with pytest.raises(PrecastError, match="holds its weights"):
        precast.compile(res.program, weights=tmp_path, cache_dir=tmp_path)
    ep = meta_program(res.program)
    with pytest.raises(PrecastError, match="have no data"):
        precast.compile(ep, cache_dir=tmp_path)
    with pytest.raises(PrecastError, match="mode='default'"):
        precast.compile(ep, weights=tmp_path, mode="max-autotune", cache_dir=tmp_path)


@pytest.mark.aoti
def test_load_weights_from_original_shards_equals_a_state_dict(streamed, converted_a, tmp_path):
    model, inputs, _ = converted_a
    _, _, cm = streamed
    other, _ = small_model(3)
    original = model.state_dict()
    write_shards(other.state_dict(), tmp_path / "other", shards=3)
    before = cm(*inputs).clone()
    assert cm.load_weights(tmp_path / "other")["loaded"] == sorted(original)
    moved = cm(*inputs).clone()
    assert not torch.equal(moved, before)
    cm.load_weights(original)
    assert torch.equal(cm(*inputs), before)  # the originals restore it bitwise
    cm.load_weights(other.state_dict())
    assert torch.equal(cm(*inputs), moved)  # shards and a state dict load the same bits
    cm.load_weights(original)
    bad = tmp_path / "bad.safetensors"
    safetensors_torch.save_file({k: v.half() for k, v in original.items()}, str(bad))
    with pytest.raises(PrecastError, match="expected torch.float32"):
        cm.load_weights(bad)


@pytest.mark.aoti
def test_a_buffer_the_code_writes_is_copied_not_the_callers(aoti_cache):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(4))

        def forward(self, x):
            self.count.add_(1)
            return x + self.count

    ep = torch.export.export(Counter(), (torch.ones(2, 4),))
    cm = precast.compile(ep, cache_dir=aoti_cache, dynamic=False, progress=False)
    assert torch.equal(cm(torch.ones(2, 4)), torch.full((2, 4), 2.0))
    assert torch.equal(cm(torch.ones(2, 4)), torch.full((2, 4), 3.0))  # the model's own copy moves on
    assert torch.equal(ep.state_dict["count"], torch.zeros(4))  # the caller's program is unchanged


@pytest.mark.parametrize(
    "layout",
    [None, [], {"external": 1, "every": [], "unread": []}, {"external": True, "every": [3], "unread": []}],
    ids=["absent", "list", "external-int", "name-int"],
)
def test_a_malformed_weights_layout_is_a_miss_not_a_crash(layout):
    from precast.backends.cache import weights_layout_ok

    assert not weights_layout_ok(layout)
    assert weights_layout_ok({"external": True, "every": ["w"], "unread": []})


def test_cli_weights_with_o_is_refused_before_loading(tmp_path, capsys):
    from precast.cli import main

    out = tmp_path / "pkg.pt2"
    assert main(["compile", str(tmp_path / "absent.pt2"), "-o", str(out), "--weights", str(tmp_path)]) == 2
    assert "streamed" in capsys.readouterr().err and not out.exists()
    code = main(
        [
            "compile",
            str(tmp_path / "a.pt2"),
            "--backend",
            "onnx",
            "-o",
            str(tmp_path / "m.onnx"),
            "--weights",
            "d",
        ]
    )
    assert code == 2 and "--weights applies to --backend aoti only" in capsys.readouterr().err
