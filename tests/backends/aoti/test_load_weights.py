"""Packages without their weights (issue 27) and weights from safetensors shards (issue 29).

``precast.compile`` leaves the constants out of the package and hands the loader tensors it owns: a program's own
weights (held once), or, for a program converted with streamed (meta) weights, those of its shards."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import precast
from precast.backends.aoti.package_cache import MANIFEST
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
    from precast.backends.aoti.package_cache import weights_layout_ok

    assert not weights_layout_ok(layout)
    assert weights_layout_ok({"external": True, "every": ["w"], "unread": []})


def test_cli_weights_with_o_checks_the_weights_before_loading(tmp_path, capsys):
    from precast.cli import main

    out = tmp_path / "pkg.pt2"
    assert main(["compile", str(tmp_path / "absent.pt2"), "-o", str(out), "--weights", str(tmp_path)]) == 2
    assert "no .safetensors files" in capsys.readouterr().err and not out.exists()
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


# ---- issue 33 item 11: a streamed conversion becomes a self-contained package ----------------------------------
LOAD_PACKAGE = """
import sys, torch
inputs = torch.load(sys.argv[2])
torch.save(torch._inductor.aoti_load_package(sys.argv[1])(*inputs), sys.argv[3])
"""


@pytest.mark.aoti
def test_cli_compile_weights_and_o_writes_a_package_that_runs_alone(streamed, converted_a, tmp_path, capsys):
    from precast.cli import main
    from tests.conftest import run_python

    _, inputs, _ = converted_a
    ep, folder, cm = streamed
    src = tmp_path / "converted.pt2"
    torch.export.save(ep, src)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    pkg = tmp_path / "pkg.pt2"
    cache = str(cm.package_path.parents[2])
    argv = ["compile", str(src), "--weights", str(folder), "-o", str(pkg), "--cache-dir", cache]
    assert main(argv) == 0, capsys.readouterr().err
    torch.save(inputs, tmp_path / "inputs.pt")
    r = run_python(LOAD_PACKAGE, str(pkg), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"))
    assert r.returncode == 0, r.stderr
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got, cm(*inputs))  # a fresh process, the package alone: precast.compile's outputs
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # -o inside the weights folder, or naming one of its files: refused, nothing written
    for bad in (folder / "pkg.pt2", next(folder.glob("*.safetensors"))):
        assert (
            main(["compile", str(src), "--weights", str(folder), "-o", str(bad), "--cache-dir", cache]) == 2
        )
        assert "input weights" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# ---- issue 33 item 4: load_weights refuses tensors without data -------------------------------------------------
LOAD_FAKE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import precast
from torch._subclasses.fake_tensor import FakeTensorMode
from tests.conftest import small_model
model, inputs = small_model(0)
res = precast.convert(model, inputs)
cm = precast.compile(res.program, cache_dir=sys.argv[2], progress=False)
before = cm(*inputs)
sd = dict(model.state_dict())
with FakeTensorMode() as mode:
    sd["layers.0.weight"] = mode.from_tensor(sd["layers.0.weight"])
try:
    cm.load_weights(sd)
    print("ACCEPTED")
except precast.PrecastError as exc:
    print("REFUSED", exc)
print("SAME" if torch.equal(cm(*inputs), before) else "CHANGED")
"""


@pytest.mark.aoti
def test_load_weights_refuses_a_fake_tensor_in_one_line_not_a_crash(compiled_a, aoti_cache):
    from tests.conftest import ROOT, run_python

    r = run_python(LOAD_FAKE, str(ROOT), str(aoti_cache))  # before: SIGSEGV on the next call
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("REFUSED") and "a FakeTensor (layers.0.weight)" in lines[0], lines
    assert lines[-1] == "SAME"


@pytest.mark.aoti
def test_load_weights_refuses_meta_and_sparse_tensors_and_keeps_its_weights(
    converted_a, compiled_a, aoti_cache
):
    import copy

    model, inputs, res = converted_a
    cm = precast.compile(copy.deepcopy(res.program), cache_dir=aoti_cache, progress=False)
    before = cm(*inputs)
    good = dict(model.state_dict())
    for name, value, why in (
        ("layers.0.weight", torch.empty(64, 64, device="meta"), "a meta tensor"),
        ("layers.1.bias", good["layers.1.bias"].to_sparse(), "a sparse_coo tensor"),
    ):
        with pytest.raises(PrecastError) as info:
            cm.load_weights({**good, name: value})
        msg = str(info.value)
        assert (
            "\n" not in msg and f"{why} ({name})" in msg and msg.index("pass the original") < msg.index(why)
        )
        assert torch.equal(cm(*inputs), before)
    # a non-contiguous tensor (a transposed view) is copied contiguous, not refused: the same outputs
    strided = {**good, "layers.0.weight": good["layers.0.weight"].t().contiguous().t()}
    assert not strided["layers.0.weight"].is_contiguous()
    cm.load_weights(strided)
    assert torch.equal(cm(*inputs), before)


@pytest.mark.aoti
def test_load_weights_casts_as_the_conversion_does(converted_a, compiled_a, aoti_cache):
    """A value beyond the stored dtype's range is clamped as fold and the streamed writer clamp it (bf16: the
    largest finite bf16, not inf); inf stays inf. mode="default": the form that holds the stored weight itself
    (this CPU's form may hold only a packed copy made from it, test_aoti_forms checks those bitwise)."""
    import copy

    from precast.passes.fold import cast_constant

    model, inputs, res = converted_a
    cm = precast.compile(copy.deepcopy(res.program), cache_dir=aoti_cache, progress=False, mode="default")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["layers.0.weight"][0, :2] = torch.tensor([3.4e38, float("inf")])
    cm.load_weights(sd)
    (stored,) = [
        st.source.stored
        for st in cm._stored.values()
        if st.source.original == "layers.0.weight" and st.source.dtype == torch.bfloat16
    ]
    held = cm._constants[stored]
    assert torch.equal(held, cast_constant(sd["layers.0.weight"], torch.bfloat16)[0])
    assert held[0, :2].tolist() == [torch.finfo(torch.bfloat16).max, float("inf")]


# ---- issue 33 item 9: bounded, hint-first lines -----------------------------------------------------------------
@pytest.mark.aoti
def test_another_models_weights_are_said_so_first_and_the_line_is_bounded(streamed, tmp_path):
    ep, _folder, cm = streamed
    other = {f"blocks.{i}.weight": torch.zeros(2) for i in range(150)}
    write_shards(other, tmp_path / "other")
    with pytest.raises(PrecastError) as info:
        precast.compile(ep, weights=tmp_path / "other", cache_dir=cm.package_path.parents[2], progress=False)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 700, msg
    assert msg.index("belong to another model") < msg.index("missing") and "(150 in all)" in msg
    with pytest.raises(PrecastError) as info:
        cm.load_weights(other)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 700 and msg.index("another model") < msg.index("unexpected"), msg


# ---- freezing with the constants in the .so (what `precast compile -o` builds; issue 40 item 5) -----------------
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="freezing's blocked weights need oneDNN")
def test_frozen_package_in_so_swaps_blocked_weights_right(aoti_cache):
    """Freezing folds each linear's weight into oneDNN's blocked layout (an opaque tensor). In a package holding
    its constants in the .so, the loader's copying load_constants read the opaque tensor as dense data: the
    model's own unchanged weights moved the outputs by ~2.6. They are handed over by pointer now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()
    inputs = (torch.randn(4, 64),)
    configs = {"freezing": True, "aot_inductor.package_constants_in_so": True}
    ep = torch.export.export(model, inputs)
    cm = precast.compile(ep, cache_dir=aoti_cache, mode="default", inductor_configs=configs, progress=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = cm(x).clone()
        cm.load_weights(model.state_dict())
        assert torch.equal(cm(x), before)
        assert any(t.is_mkldnn for t in cm._held.values())  # the case this tests: opaque constants in the .so
        other = copy.deepcopy(model)
        for p in other.parameters():
            p.add_(0.1)
        cm.load_weights(other.state_dict())
        torch.testing.assert_close(cm(x), other(x), rtol=1e-4, atol=1e-4)
        cm.load_weights(model.state_dict())
        assert torch.equal(cm(x), before)
    assert cm.form["name"] == "onednn-packed"  # what the configs compile (issue 40 item 9)
