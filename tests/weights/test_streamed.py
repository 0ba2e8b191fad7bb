"""Streamed weights (issue 29 item 1): a program exported without its weights, converted with them read from
safetensors shards one tensor at a time, is bitwise the in-memory conversion of the same program (graph, every
weight, its outputs), under policy None, "torch" and "rules"; the files are checked, the caller's module and
files untouched, and every option it cannot serve refused with one line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import precast
from precast.errors import PrecastError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


class Logits(torch.nn.Module):
    """The model held as ``self.m``: the program's names get a prefix the files do not have."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(weights folder, weightless program, the same program with the real weights, input ids)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CFG)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, :3] = torch.tensor([1e6, -7e4, 3.0])  # beyond fp16
    folder = tmp_path_factory.mktemp("llama") / "in"
    model.save_pretrained(folder, max_shard_size="60KB")  # several shards and the index
    with precast.empty_parameters():
        empty = transformers.LlamaForCausalLM(cfg).eval()
    assert empty.lm_head.weight.device.type == "meta" and empty.model.rotary_emb.inv_freq.device.type == "cpu"
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    wrapper = Logits(empty)
    ep = precast.export_weightless(wrapper, (ids,))
    assert empty.lm_head.weight.device.type == "meta"  # the caller's module keeps its own parameters
    assert all(v.device.type == "meta" for v in ep.state_dict.values())
    real = copy.copy(ep)
    state = model.state_dict()
    real._state_dict = {
        k: torch.nn.Parameter(state[k.removeprefix("m.")], requires_grad=False) for k in ep.state_dict
    }
    real._example_inputs = None  # as the weightless program: no data ranges, no device run, in both
    return folder, ep, real, ids


def _read(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(safetensors_torch.load_file(folder / f))
    assert set(out) == set(index["weight_map"])
    return out


@pytest.mark.parametrize(
    ("policy", "dtype", "weight_format"),
    [
        (None, "bf16", None),
        ("torch", "bf16", None),
        ("rules", "bf16", None),
        ("rules", "fp16", None),
        ("torch", "bf16", "int8"),  # weight formats: each part quantized from the original read from its file
        (None, "bf16", "int4-g32"),
        ("rules", "bf16", "int8-asym"),
    ],
)
def test_streamed_is_bitwise_the_in_memory_conversion(llama, tmp_path, policy, dtype, weight_format):
    folder, ep, real, ids = llama
    files_before = {p.name: p.read_bytes() for p in folder.iterdir()}
    given = dict(policy=policy, dtype=dtype, weight_format=weight_format)
    ref = precast.convert(real, verify=False, **given)
    out = precast.convert(ep, weights=folder, weights_out=tmp_path / "out", **given)
    if weight_format is not None:
        formats = {r["format"] for r in out.report.weight_formats}
        assert formats == {weight_format} and out.report.weight_formats == ref.report.weight_formats
    assert out.program.graph_module.code == ref.program.graph_module.code
    written = _read(tmp_path / "out")
    ref_state = {**ref.program.state_dict, **ref.program.constants}
    streamed = {
        k for k, v in {**out.program.state_dict, **out.program.constants}.items() if v.device.type == "meta"
    }
    assert set(written) == streamed and streamed  # every weight the program holds no value for, nothing else
    for name, value in written.items():
        assert value.dtype == ref_state[name].dtype and torch.equal(value, ref_state[name]), name
    # values the program keeps (the rotary table made at construction) are the in-memory conversion's
    for name, value in out.program.constants.items():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            assert torch.equal(value, ref.program.constants[name])
    ran = precast.with_weights(out.program, tmp_path / "out").module()(ids)
    assert torch.equal(ran, ref.program.module()(ids))
    w = out.report.weights
    assert w["tensors"] == len(written) and w["bytes_written"] == sum(t.nbytes for t in written.values())
    down = "m.model.layers.0.mlp.down_proj.weight"
    if dtype == "fp16" and policy == "torch":  # cast, and clamped to fp16's range as in memory
        assert w["clamped"] == {down: 2} and float(written[down][0, 0]) == 65504.0
    if dtype == "fp16" and policy == "rules":  # init_max, its absmax read from the file: kept fp32
        assert w["clamped"] == {} and written[down].dtype == torch.float32
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files_before  # the input files untouched
    assert policy is None or "verification-skipped" in {d.code for d in out.report.diagnostics}


def test_streamed_program_saves_small_and_reloads(llama, tmp_path):
    folder, ep, _real, ids = llama
    out = precast.convert(ep, policy="torch", weights=folder, weights_out=tmp_path / "w")
    path = tmp_path / "p.pt2"
    torch.export.save(out.program, path)
    assert path.stat().st_size < 2 * 1024 * 1024  # the graph, not the weights
    back = precast.report(torch.export.load(path))
    assert back.weights["tensors"] == out.report.weights["tensors"]
    # converting again into the same folder replaces precast's own output; another folder is refused
    again = precast.convert(ep, policy="torch", weights=folder, weights_out=tmp_path / "w")
    assert again.report.weights["bytes_written"] == out.report.weights["bytes_written"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(PrecastError, match="not a folder of weights precast wrote"):
        precast.convert(ep, policy="torch", weights=folder, weights_out=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_program_saved_with_fake_weights_loads_them_as_meta(llama, tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from precast.pipeline.load import load_program

    big = torch.nn.Linear(4096, 4096)  # 64 MiB if torch.export.load made its zeros
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.nn.Linear(4096, 4096)
        x = mode.from_tensor(torch.randn(2, 4096))
    ep = torch.export.export(fake, (x,))
    torch.export.save(ep, tmp_path / "fake.pt2")
    loaded = load_program(tmp_path / "fake.pt2")
    assert {v.device.type for v in loaded.state_dict.values()} == {"meta"} and loaded.example_inputs is None
    safetensors_torch.save_file(
        {k: v.detach() for k, v in big.state_dict().items()}, tmp_path / "w.safetensors"
    )
    res = precast.convert(
        loaded, policy="torch", weights=tmp_path / "w.safetensors", weights_out=tmp_path / "o"
    )
    got = _read(tmp_path / "o")
    assert torch.equal(got["weight"], big.weight.detach().to(torch.bfloat16))
    assert res.report.weights["files"] == 1


def test_refusals_are_one_line(llama, tmp_path):
    folder, ep, _real, _ids = llama
    cases = [
        (dict(weights=folder), "needs weights_out="),
        (dict(weights_out=tmp_path / "o"), "give weights="),
        (dict(weights=folder, weights_out=folder / "sub"), "overwrite the input weights"),
        (dict(weights=folder, weights_out=tmp_path / "o", policy="auto"), "policy='auto'"),
        # an instance, as a policy of the user's that times ops would be: asked through its hooks, not its class
        (dict(weights=folder, weights_out=tmp_path / "o", policy=precast.AutoPolicy()), "policy='auto'"),
        (
            dict(
                weights=folder,
                weights_out=tmp_path / "o",
                policy="rules",
                tolerance=0.01,
            ),
            "tolerance=",
        ),
        (dict(weights=tmp_path / "nothing", weights_out=tmp_path / "o"), "no such file or folder"),
    ]
    for kwargs, message in cases:
        with pytest.raises(PrecastError, match=message) as info:
            precast.convert(ep, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(PrecastError, match="a module holds its weights"):
        precast.convert(
            Logits(torch.nn.Linear(2, 2)), (torch.zeros(1, 2),), weights=folder, weights_out=tmp_path / "o"
        )
    # files that lack a weight, or disagree on its shape
    part = tmp_path / "part"
    part.mkdir()
    state = _read_input(folder)
    state.pop("model.norm.weight")
    state["lm_head.weight"] = state["lm_head.weight"][:10].contiguous()
    safetensors_torch.save_file(state, part / "model.safetensors")
    with pytest.raises(
        PrecastError, match=r"m\.model\.norm\.weight.*lm_head\.weight is torch.float32 \[10, 64\]"
    ) as info:
        precast.convert(ep, policy="torch", weights=part, weights_out=tmp_path / "o")
    assert "\n" not in str(info.value) and not (tmp_path / "o").exists()
    (part / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PrecastError, match="not a valid safetensors file"):
        precast.convert(ep, policy="torch", weights=part, weights_out=tmp_path / "o")


def _read_input(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


def test_cli_convert_with_weights(llama, tmp_path):
    folder, ep, _real, ids = llama
    torch.export.save(ep, tmp_path / "in.pt2")
    run = [sys.executable, "-m", "precast", "convert", str(tmp_path / "in.pt2"), "--weights", str(folder)]
    r = subprocess.run(
        [*run, "-o", str(tmp_path / "o.pt2"), "--policy", "torch"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert (
        "weights streamed:" in r.stdout
        and (tmp_path / "o.weights" / "model.safetensors.index.json").is_file()
    )
    prog = precast.with_weights(torch.export.load(tmp_path / "o.pt2"), tmp_path / "o.weights")
    ref = precast.convert(
        precast.with_weights(ep, folder), policy="torch", verify=False
    )  # the input folder too
    assert torch.equal(prog.module()(ids), ref.program.module()(ids))
    bad = subprocess.run(
        [*run, "-o", str(tmp_path / "b.pt2"), "--weights-out", str(folder)], capture_output=True, text=True
    )
    assert (
        bad.returncode == 2 and "Traceback" not in bad.stderr and "overwrite the input weights" in bad.stderr
    )
    assert not (tmp_path / "b.pt2").exists()


def test_verification_leaves_the_callers_region_subgraphs_alone(llama):
    """ExportedProgram.module() shares region subgraphs with the program: stripping export's dtype checks there
    changed what the next conversion of the same program produced (found by this feature's bitwise check)."""
    _folder, _ep, real, _ids = llama
    fresh = precast.convert(real, policy="rules").program.graph_module.code
    precast.convert(real, policy="torch")  # verifies against the program run under autocast
    assert precast.convert(real, policy="rules").program.graph_module.code == fresh


def test_device_check_runs_on_stand_in_weights(llama, tmp_path, monkeypatch):
    """With example inputs the device check runs the converted program; streamed, each weight is a broadcast
    zero (no memory): the same ops run, so the same program comes out."""
    from precast.pipeline import after_lowering

    folder, ep, real, ids = llama
    runs = []
    original = after_lowering.run_on_device
    monkeypatch.setattr(after_lowering, "run_on_device", lambda *a, **k: runs.append(1) or original(*a, **k))
    ref = precast.convert(real, (ids,), policy="rules", verify=False)
    out = precast.convert(ep, (ids,), policy="rules", weights=folder, weights_out=tmp_path / "o")
    assert len(runs) == 2
    assert out.program.graph_module.code == ref.program.graph_module.code
    ran = precast.with_weights(out.program, tmp_path / "o").module()(ids)
    assert torch.equal(ran, ref.program.module()(ids))


def test_statistics_measured_beforehand_serve_a_streamed_conversion(llama, tmp_path):
    """Ranges measured with precast.calibrate (on a machine that holds the weights, or over ranks) apply to the
    streamed conversion as to the in-memory one; only batches, which would run the program, are refused."""
    folder, ep, real, ids = llama
    batches = [(torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    cal = precast.calibrate(real, batches, dtype="fp16", keep=0)
    cal.save(tmp_path / "stats.json")
    ref = precast.convert(real, policy="rules", dtype="fp16", calibration=cal, verify=False)
    out = precast.convert(
        ep,
        policy="rules",
        dtype="fp16",
        calibration=tmp_path / "stats.json",
        weights=folder,
        weights_out=tmp_path / "o",
    )
    assert out.program.graph_module.code == ref.program.graph_module.code
    assert "data-max-inactive" not in {d.code for d in out.report.diagnostics}
    assert torch.equal(
        precast.with_weights(out.program, tmp_path / "o").module()(ids), ref.program.module()(ids)
    )
    with pytest.raises(PrecastError, match="calibration= batches run the program"):
        precast.convert(ep, policy="rules", calibration=batches, weights=folder, weights_out=tmp_path / "x")


def test_compiled_from_the_output_shards(llama, tmp_path, aoti_cache):
    """precast.compile of the streamed program, its weights loaded from the shards it wrote: the same tokens as
    the in-memory conversion run eagerly (AOTInductor's kernels are not bitwise eager's)."""
    folder, ep, real, ids = llama
    out = precast.convert(ep, policy="torch", weights=folder, weights_out=tmp_path / "o")
    loaded = torch.export.load(_saved(out.program, tmp_path / "p.pt2"))
    loaded._example_inputs = None  # as a program saved without them: precast.compile makes its own
    compiled = precast.compile(loaded, weights=tmp_path / "o", cache_dir=aoti_cache)
    want = precast.convert(real, policy="torch", verify=False).program.module()(ids)
    got = compiled(ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (
        torch.nn.functional.cosine_similarity(got.flatten().float(), want.flatten().float(), dim=0) > 0.9999
    )


def _saved(program, path):
    torch.export.save(program, path)
    return path
