"""precast.compile(program, backend="openvino"): converted programs on OpenVINO's CPU plugin, running precast's plan.

Tolerance: OpenVINO's bf16 kernels accumulate in fp32 and fuse differently from torch's eager kernels (it folds
batch norm into the bf16 convolution weights, keeps fused elementwise intermediates in fp32), so outputs differ
from the converted program's by rounding: measured <= 1.7 bf16 ulps at the output's largest magnitude on the zoo
and the real-model tier. The bound is 4 ulps (``4 * eps(bf16) * max|ref|``) plus 1e-5 absolute. fp32 programs
(auto's fp32 plan): OpenVINO's fp32 kernels against torch's, 1e-4 relative to the largest magnitude.

fp16: OpenVINO runs fp16 ops in fp16 only under its f16 hint, which lowers fp32 ops too: a program mixing fp16
with bf16 or fp32 decisions (the zoo's nested regions) is compiled with the f32 hint on every CPU, and gets one
PlanOverrideWarning line for its fp16 layers (run in fp32), and only for those (and, on a CPU without native bf16,
its bf16 layers OpenVINO runs in fp32). What is expected follows from what OpenVINO
reports about this CPU (its default hint, ``FP16`` in its capabilities), never from one machine's behaviour.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import precast  # noqa: E402
from precast.backends.executorch import program_constants  # noqa: E402
from precast.backends.openvino.ir_files import weight_bytes  # noqa: E402
from precast.backends.openvino.model import AUTO_NOTE, compile_openvino  # noqa: E402
from precast.backends.openvino.plan_check import PlanOverrideWarning  # noqa: E402
from precast.backends.openvino.precision import native_bf16, native_fp16, prepare  # noqa: E402
from precast.errors import PrecastError  # noqa: E402
from precast.runtime.exported import dynamic_batch  # noqa: E402
from precast.runtime.signature import ProgramSignature  # noqa: E402
from tests import models as zoo  # noqa: E402

BF16 = torch.bfloat16
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def native(which: str) -> bool:
    """What OpenVINO reports about this CPU: its default hint is bf16 ("bf16"), it lists fp16 kernels ("fp16")."""
    import openvino as ov

    return (native_bf16 if which == "bf16" else native_fp16)(ov.Core())


def bound(ref: torch.Tensor, ulps: int = 4) -> float:
    return ulps * torch.finfo(BF16).eps * ref.detach().abs().max().item() + 1e-5


def assert_close(got, want, rel: float | None = None) -> None:
    g, w = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if not a.is_floating_point():
            assert torch.equal(a, b)
            continue
        limit = rel * b.abs().max().item() + 1e-6 if rel is not None else bound(b)
        assert (a.double() - b.double()).abs().max().item() <= limit, (
            (a.double() - b.double()).abs().max().item()
        )


def compile_quiet(program, **options):
    """Compile, returning the model and the PlanOverrideWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = precast.compile(program, backend="openvino", **options)
    return model, [w for w in caught if issubclass(w.category, PlanOverrideWarning)]


def emulated_only(plan) -> bool:
    """Every override is a layer OpenVINO runs in fp32 under the f32 hint because it has no kernels here for the
    layer's low dtype: fp16 where it lists no FP16 (or the plan mixes dtypes), bf16 where it reports no native
    bf16 (plain AVX2: what the CPU's capabilities imply, not an error of the plan)."""
    emulated = {"fp16"} | (set() if native("bf16") else {"bf16"})
    for layer in plan.overridden:
        low = set(layer.planned) - {"fp32"}
        if plan.hint != "f32" or not low or not low <= emulated or layer.runtime != ("fp32",):
            return False
    return True


# ---- the zoo ------------------------------------------------------------------------------------------------
ZOO = [name for name in zoo.ZOO if name != "lstm"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_outputs_and_plan(name):
    """Outputs within the bound of the converted program, output dtypes kept, and every executed layer runs
    the dtype precast decided (fp16 decisions excepted where the f32 hint is kept, each one warned)."""
    model, inputs = zoo.ZOO[name]()
    res = precast.convert(
        model, inputs, **({} if name in zoo.REGION_MODELS else {"policy": "torch", "dtype": BF16})
    )
    compiled, overrides = compile_quiet(res.program)
    assert_close(compiled(*inputs), res.program.module()(*inputs))
    plan = compiled.plan
    assert plan.checked > 0
    # the hint precision_hint="auto" kept: the plan's one low dtype (bf16 where OpenVINO's default is bf16, fp16
    # where it lists fp16 kernels) when that hint honours the plan layer by layer, else f32
    assert compiled.runtime_precision() == plan.hint
    planned = {d for layer in plan.layers for d in layer.planned}
    low = planned - {"fp32"}
    dtype = next(iter(low)) if len(low) == 1 else None
    tried = {"bf16": "bf16", "fp16": "f16"}[dtype] if dtype and native(dtype) else None
    assert plan.hint == (tried if tried and not plan.fallback else "f32"), plan
    if plan.fallback:
        assert tried and plan.fallback.startswith(f"the {tried} hint overrides") and plan.hint == "f32"
    # only under the f32 hint, and only layers run in fp32 instead of a low dtype OpenVINO has no kernels for here
    assert emulated_only(plan), plan.overridden
    norms = [w for w in overrides if "batch norm" in str(w.message)]
    overrides = [w for w in overrides if w not in norms]
    if name in ("cnn", "plain_cnn"):  # bf16 input, fp32 statistics: OpenVINO rounds them (fuse them first)
        assert plan.batch_norms == ["batch_norm", "batch_norm_1"] and len(norms) == 1
        assert "batch_norm, batch_norm_1" in str(norms[0].message) and "fuse_conv_bn_eval" in str(
            norms[0].message
        )
    else:
        assert plan.batch_norms == [] and norms == []
    # one line for all of them (model.plan.overridden lists each), naming the first
    assert len(overrides) == (1 if plan.overridden else 0), [str(w.message) for w in overrides]
    if plan.overridden:
        message = str(overrides[0].message)
        assert f"in {len(plan.overridden)} layer(s) under the f32 hint" in message
        assert repr(plan.overridden[0].layer) in message and "runs fp32 where precast decided" in message
    if name == "nested":  # the nested fp16 region: one Linear, on every CPU (bf16, fp16 and fp32: f32 hint)
        assert [layer.planned for layer in plan.overridden if "fp16" in layer.planned] == [("fp16",)]
    decided = {d for layer in plan.layers for d in layer.planned}
    assert decided <= {"bf16", "fp32", "fp16"} and "bf16" in decided


def test_batch_norm_fused_before_converting_is_not_rounded():
    """The route the batch-norm warning gives: fused into its convolution in fp32, then converted, there is no
    batch norm left to round, and OpenVINO's output is closer to the fp32 model's."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    from precast.metrics import flat_error

    model, inputs = zoo.plain_cnn(2)
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
            bn.running_var.uniform_(0.2, 3.0, generator=torch.Generator().manual_seed(4))
        want = model(*inputs)
    fused = copy.deepcopy(model)
    fused.conv1, fused.bn1 = fuse_conv_bn_eval(model.conv1, model.bn1), torch.nn.Identity()
    fused.conv2, fused.bn2 = fuse_conv_bn_eval(model.conv2, model.bn2), torch.nn.Identity()
    errors = {}
    for key, m in (("bn", model), ("fused", fused)):
        compiled, overrides = compile_quiet(precast.convert(m, inputs, policy="torch", dtype=BF16).program)
        norms = [w for w in overrides if "batch norm" in str(w.message)]
        assert bool(compiled.plan.batch_norms) == bool(norms) == (key == "bn") and emulated_only(
            compiled.plan
        )
        errors[key] = 1 - flat_error(compiled(*inputs), want)[1]
    assert errors["fused"] < errors["bn"], errors


def test_lstm_under_policy_torch_is_one_line_with_the_route():
    model, inputs = zoo.lstm()
    # oneDNN has no bf16 LSTM without AVX512 (a device-unsupported error at conversion): allowed, the program is
    # what OpenVINO is given on every CPU
    res = precast.convert(model, inputs, policy="torch", dtype=BF16, allow=("device-unsupported",))
    with pytest.raises(PrecastError, match=r"mkldnn_rnn_layer.*policy='rules'") as err:
        precast.compile(res.program, backend="openvino")
    assert "\n" not in str(err.value)
    rules = precast.convert(model, inputs, policy="rules", dtype=BF16)  # the route works
    compiled, overrides = compile_quiet(rules.program)
    assert_close(compiled(*inputs), rules.program.module()(*inputs))
    assert bool(overrides) == bool(compiled.plan.overridden) and emulated_only(compiled.plan)


# ---- dynamic batch, input checks --------------------------------------------------------------------------------
def test_dynamic_batch_from_a_static_program():
    model, inputs = zoo.plain_cnn(2)
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)  # static shapes
    compiled, _ = compile_quiet(res.program)
    (shape,) = [i.get_partial_shape() for i in compiled.ov_model.inputs]
    assert shape[0].is_dynamic and [shape[i].get_length() for i in (1, 2, 3)] == [3, 16, 16]
    module = dynamic_batch(res.program).module()
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2, 5):
        x = torch.randn(batch, 3, 16, 16, generator=g)
        assert_close(compiled(x), module(x))


def test_static_keeps_the_example_shape():
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)
    compiled, _ = compile_quiet(res.program, dynamic=False)
    (shape,) = [i.get_partial_shape() for i in compiled.ov_model.inputs]
    assert shape.is_static and shape.to_shape() == [4, 64]


def test_inputs_checked_as_aoti_checks_them_before_openvino_runs():
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)
    compiled, _ = compile_quiet(res.program)

    class NoRequest:
        def infer(self, *args, **kwargs):
            raise AssertionError("OpenVINO ran on inputs the program does not take")

    compiled._request = NoRequest()
    signature = ProgramSignature.from_program(dynamic_batch(res.program))
    for bad in ((torch.randn(4, 63),), (torch.randn(4, 64, dtype=torch.float64),), (torch.randn(4, 64), 1)):
        with pytest.raises(PrecastError) as err:
            compiled(*bad)
        with pytest.raises(PrecastError) as same:
            signature.check(bad, {})
        assert str(err.value) == str(same.value) and "\n" not in str(err.value)


def test_the_model_holds_only_the_weights_openvino_reads_in_place():
    """OpenVINO's frontend reads a weight in place from torch's memory where it can, and keeps nothing alive:
    the model holds exactly those tensors (each one an OpenVINO constant points into), not the program. The
    caller drops the program and refills the freed memory: the model computes the same outputs (before the
    model held them, this read freed memory: a segmentation fault on the 0.246 B decoder)."""
    import gc
    import weakref

    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)
    want = res.program.module()(*inputs)
    weights = {id(t): weakref.ref(t) for t in res.program.state_dict.values()}
    compiled, _ = compile_quiet(res.program)
    before = compiled(*inputs)
    pointers = {
        op.get_tensor_view().data.ctypes.data
        for op in compiled.ov_model.get_ordered_ops()
        if op.get_type_name() == "Constant" and op.get_byte_size()
    }
    assert compiled._weights, "OpenVINO shares no weight here: the test checks nothing"
    for t in compiled._weights:
        assert any(t.data_ptr() <= p < t.data_ptr() + t.numel() * t.element_size() for p in pointers)
    sizes = [t.shape for t in res.program.state_dict.values()]
    del res
    gc.collect()
    alive = {i for i, w in weights.items() if w() is not None}
    assert alive <= {id(t) for t in compiled._weights}
    junk = [torch.full(s, 1e30) for s in sizes for _ in range(4)]  # the freed blocks, refilled
    after = compiled(*inputs)
    del junk
    assert torch.equal(after, before)
    assert_close(after, want)


# ---- the plan: an fp32 decision that is not honoured fails ------------------------------------------------------
def test_auto_fp32_plan_runs_fp32_and_an_override_is_caught(monkeypatch, tmp_path):
    """Auto keeps every Linear fp32 here (bf16 timed slower): with the f32 hint OpenVINO runs them fp32 and the
    check finds nothing; with OpenVINO's default (bf16 on this CPU) it lowers them, and the check names each."""
    from precast.numerics import latency
    from precast.policy.auto import AutoPolicy, OpLatency

    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(latency, "measure_node", lambda *a, **k: OpLatency(10.0, 20.0, 1.0, 1.0))
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy=AutoPolicy(dtype=BF16, confirm=False))
    assert {res.report.node(n).dtype for n in ("linear", "linear_1", "linear_2", "linear_3")} == {"fp32"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = precast.compile(res.program, backend="openvino")
    assert AUTO_NOTE in [str(w.message) for w in caught]  # says whose kernels auto timed
    assert not [w for w in caught if issubclass(w.category, PlanOverrideWarning)]
    plan = compiled.plan
    assert plan.checked >= 4 and plan.overridden == [] and set(plan.by_runtime) == {"fp32"}
    assert [layer.layer_type for layer in plan.layers].count("FullyConnected") == 4
    assert_close(compiled(*inputs), res.program.module()(*inputs), rel=1e-4)

    if not native("bf16"):
        pytest.skip("OpenVINO's default is fp32 on a CPU without native bf16: nothing to override")
    with pytest.warns(
        PlanOverrideWarning, match=r"layer\(s\) under the default hint \(\d+ run bf16 for fp32"
    ):
        default = compile_openvino(res.program, precision_hint=None)
    overridden = default.plan.overridden
    assert len([layer for layer in overridden if layer.layer_type == "FullyConnected"]) == 4
    assert all(layer.planned == ("fp32",) and "bf16" in layer.runtime for layer in overridden)


# ---- IR files ------------------------------------------------------------------------------------------------------
def read_constants(ep) -> dict[str, int]:
    """program_constants, renamed to precast's dtype names."""
    return {DTYPE_NAMES[k]: v for k, v in program_constants(ep).items() if k in DTYPE_NAMES}


def test_ir_weights_once_in_their_dtype_and_reloads(tmp_path):
    import openvino as ov

    model, inputs = zoo.plain_encoder(2)
    with torch.no_grad():  # norms away from 1/0, which OpenVINO would fold away
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    res = precast.convert(model, inputs, policy="torch", dtype=BF16)
    compiled, _ = compile_quiet(res.program)
    files = compiled.save(tmp_path / "enc.xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enc.bin", "enc.xml"]
    want = read_constants(res.program)
    assert want == {"bf16": 66432, "fp32": 1024}  # the encoder's Linear weights bf16, LayerNorm's fp32
    assert files["weights"] == want == weight_bytes(compiled.ov_model)
    # the .bin holds those bytes at most once (OpenVINO's serializer also shares equal blobs), plus the graph's
    # few shape constants: nothing widened to fp32, nothing stored twice
    assert 0.98 * sum(want.values()) <= files["bin_bytes"] <= sum(want.values()) + 2048
    # the IR is the program as converted; the corrections for the hint it runs under
    # (precast.backends.openvino.precision.prepare) give back the compiled model's outputs bitwise
    hint = compiled.plan.hint
    read, _ = prepare(ov.Core().read_model(str(tmp_path / "enc.xml")), hint)
    reloaded = ov.Core().compile_model(read, "CPU", {"INFERENCE_PRECISION_HINT": hint})
    (out,) = reloaded(list(inputs)).values()
    assert torch.equal(torch.from_numpy(out), compiled(*inputs))


def test_ir_failure_leaves_no_file_and_keeps_the_old_pair(tmp_path, monkeypatch):
    import openvino as ov

    model, inputs = zoo.plain_mlp()
    compiled, _ = compile_quiet(precast.convert(model, inputs, policy="torch", dtype=BF16).program)
    compiled.save(tmp_path / "m.xml")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_written(model, path, compress_to_fp16=True):
        Path(str(path)).with_suffix(".bin").write_bytes(b"partial")
        raise RuntimeError("Exception from src/core/src/pass/serialize.cpp:1:\ndisk full")

    monkeypatch.setattr(ov, "save_model", half_written)
    with pytest.raises(PrecastError, match="could not write the IR: disk full"):
        compiled.save(tmp_path / "m.xml")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary, old pair intact
    with pytest.raises(PrecastError, match=r"OpenVINO IR is an \.xml file"):
        compiled.save(tmp_path / "m.onnx")


@pytest.mark.parametrize("fails", [".xml", ".bin"])
def test_a_failed_rename_keeps_the_old_pair(tmp_path, monkeypatch, fails):
    """The new .bin moved in, then the .xml's rename fails (or the .bin's): the old pair is put back, bitwise,
    and the error is one PrecastError line (it was a raw PermissionError with the old .xml deleted)."""
    import os

    model, inputs = zoo.plain_mlp()
    compiled, _ = compile_quiet(precast.convert(model, inputs, policy="torch", dtype=BF16).program)
    compiled.save(tmp_path / "m.xml")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.replace

    def refused(src, dst, *args, **kwargs):
        if str(dst).endswith(fails) and ".tmp-" in str(src) and "old-" not in str(src):
            raise PermissionError(13, "Permission denied", str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PrecastError, match="could not write the IR .Permission denied") as info:
        compiled.save(tmp_path / "m.xml")
    assert "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the old pair, no temporary


def test_cli_refuses_an_ir_whose_bin_is_the_input(tmp_path, capsys):
    """-o prog.xml writes prog.bin beside it: with prog.bin the input (by name, a symlink or a hard link) that is
    exit 2 before anything is written, the input untouched (it was overwritten by the IR's weights, exit 0)."""
    import os

    program = tmp_path / "prog.bin"
    model, inputs = zoo.plain_mlp()
    torch.export.save(precast.convert(model, inputs, policy="torch", dtype=BF16).program, program)
    os.symlink(program, tmp_path / "link.bin")
    os.link(program, tmp_path / "hard.bin")
    before = program.read_bytes()
    capsys.readouterr()  # torch 2.15's save logs that a program file not named .pt2 is unusual: not the CLI's
    for source, out in (("prog.bin", "prog.xml"), ("prog.bin", "link.xml"), ("hard.bin", "prog.xml")):
        code, err = run_cli(
            capsys, str(tmp_path / source), "--backend", "openvino", "-o", str(tmp_path / out)
        )
        assert code == 2, err
        assert "the IR's weights (the .bin beside it) is also the input" in one_line_error(err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.bin", "link.bin", "prog.bin"]
        assert program.read_bytes() == before


# ---- options --------------------------------------------------------------------------------------------------------
def test_options_refused_with_one_line():
    model, inputs = zoo.plain_mlp()
    program = precast.convert(model, inputs, policy="torch", dtype=BF16).program
    for options, message in (
        ({"mode": "max-autotune"}, "mode= applies to backend='aoti' only"),
        ({"cache_dir": "/tmp"}, "cache_dir= applies to backend='aoti' only"),
        ({"precision_hint": "fp8"}, "precision_hint=.fp8."),
        ({"threads": 0}, "threads=0"),
    ):
        with pytest.raises(PrecastError, match=message):
            precast.compile(program, backend="openvino", **options)
    with pytest.raises(PrecastError, match="backend='tensorrt'; choose one of aoti, openvino"):
        precast.compile(program, backend="tensorrt")
    with pytest.raises(PrecastError, match="pass an ExportedProgram"):
        precast.compile(model, backend="openvino")


def test_missing_openvino_names_the_extra(monkeypatch):
    model, inputs = zoo.plain_mlp()
    program = torch.export.export(model, inputs)
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(PrecastError, match=r"pip install 'precast\[openvino\]'"):
        precast.compile(program, backend="openvino")


# ---- the CLI --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 CNN program (OpenVINO runs it) and a policy-"torch" LSTM one (its oneDNN RNN op it cannot)."""
    root = tmp_path_factory.mktemp("programs")
    model, inputs = zoo.plain_cnn(2)
    torch.export.save(precast.convert(model, inputs, policy="torch", dtype=BF16).program, root / "cnn.pt2")
    model, inputs = zoo.lstm()
    lstm = precast.convert(
        model, inputs, policy="torch", dtype=BF16, allow=("device-unsupported",)
    )  # any CPU
    torch.export.save(lstm.program, root / "lstm.pt2")
    return root


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from precast.cli import main

    code = main(["compile", *argv])
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("precast compile: error:"), err
    return lines[0]


def test_cli_writes_the_ir_pair(saved, tmp_path, capsys):
    import openvino as ov

    code, err = run_cli(
        capsys, str(saved / "cnn.pt2"), "--backend", "openvino", "-o", str(tmp_path / "cnn.xml")
    )
    assert code == 0, err
    assert "exported for openvino" in err and "dynamic batch" in err
    # every layer as decided, but where OpenVINO has no native bf16 (its bf16 layers then run in fp32)
    assert "overridden: 0" in err or not native("bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.bin", "cnn.xml", "cnn.xml.json"]
    model = ov.Core().read_model(str(tmp_path / "cnn.xml"))
    # the bf16 convolution and head weights once; batch norm's fp32 statistics folded into them by OpenVINO.
    # Where the CPU has no native bf16 the IR is the f32 hint's form, whose splits (round_to_nearest) add two f32
    # scalars per cast, and no other f32 constant
    scalars = [
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.f32
    ]
    assert all(op.get_output_shape(0) == [] for op in scalars) and (not scalars or not native("bf16"))
    want = {"bf16": read_constants(torch.export.load(saved / "cnn.pt2"))["bf16"]}
    assert weight_bytes(model) == want | ({"fp32": 4 * len(scalars)} if scalars else {})
    assert model.inputs[0].get_partial_shape()[0].is_dynamic


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "openvino"], "--backend openvino needs -o FILE (e.g. -o model.xml)"),
        (["--backend", "openvino", "-o", "{tmp}/m.onnx"], "OpenVINO's artifact is an .xml file"),
        (
            ["--backend", "openvino", "--mode", "max-autotune", "-o", "{tmp}/m.xml"],
            "--mode applies to --backend aoti",
        ),
        (
            ["--backend", "openvino", "--cache-dir", "{tmp}", "-o", "{tmp}/m.xml"],
            "--cache-dir applies to --backend",
        ),
        (["--backend", "openvino", "-o", "{tmp}/no/such/dir/m.xml"], "does not exist"),
    ],
)
def test_cli_user_errors_exit_2(saved, tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, err = run_cli(capsys, str(saved / "cnn.pt2"), *argv)
    assert code == 2
    assert message in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_cli_conversion_failure_and_missing_openvino_leave_no_file(saved, tmp_path, capsys, monkeypatch):
    out = tmp_path / "lstm.xml"
    code, err = run_cli(capsys, str(saved / "lstm.pt2"), "--backend", "openvino", "-o", str(out))
    assert code == 2
    assert "mkldnn_rnn_layer" in one_line_error(err) and "policy='rules'" in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setitem(sys.modules, "openvino", None)
    code, err = run_cli(capsys, str(saved / "cnn.pt2"), "--backend", "openvino", "-o", str(out))
    assert code == 2
    assert "pip install 'precast[openvino]'" in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


# ---- precast bench ----------------------------------------------------------------------------------------------------
def test_bench_openvino_rows(tmp_path):
    from precast.bench import run_bench

    rows = run_bench(
        ["mlp"],
        [2],
        variants=("eager_fp32", "ov_default", "ov_precast"),
        repeats=2,
        measure_rss=False,
        workdir=tmp_path,
        progress=False,
    )
    by = {r.variant: r for r in rows}
    for variant in ("ov_default", "ov_precast"):
        r = by[variant]
        assert r.error is None and r.latency_ms > 0 and r.cosine > 0.999, r
    assert "OpenVINO's default precision hint" in by["ov_default"].note
    assert "overridden: 0" in by["ov_precast"].note or not native("bf16")  # bf16 runs fp32 without it
    assert by["ov_precast"].package_mb < by["ov_default"].package_mb  # bf16 weights against fp32 ones


def test_ir_files_get_the_umask_permissions(tmp_path):
    import os

    model, inputs = zoo.plain_mlp()
    compiled, _ = compile_quiet(precast.convert(model, inputs, policy="torch", dtype=BF16).program)
    compiled.save(tmp_path / "m.xml")
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("m.xml", "m.bin"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask


# ---- state: a KV cache carried between calls ---------------------------------------------------------------------
class TinyCache(torch.nn.Module):
    """A KV cache's pattern: a buffer written by ``index_copy_`` at positions from an input and read whole, and a
    length overwritten from the input on every call, then advanced (transformers' ``cumulative_length``)."""

    def __init__(self, start: torch.Tensor | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8, 4) if start is None else start)
        self.register_buffer("length", torch.tensor(0))

    def forward(self, x, pos):
        self.length.copy_(pos[0])
        self.length.add_(x.shape[0])
        self.cache.index_copy_(0, pos, self.proj(x))
        return self.cache.sum(0, keepdim=True) * self.length


STEPS = [(torch.randn(1, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([i])) for i in range(5)]


def eager_steps(module: torch.nn.Module) -> list[torch.Tensor]:
    m = copy.deepcopy(module)
    with torch.no_grad():
        return [m(*step) for step in STEPS]


def fresh_process_steps(xml: Path, tmp_path: Path, feeds: list[dict], hint: str = "f32") -> list:
    """Run the IR in a new Python process that never imports precast (plain OpenVINO, ``hint``): one infer
    request, ``feeds`` in order; each step's first output as numpy (bf16 as its uint16 bits, with its type)."""
    import pickle
    import subprocess

    import numpy as np

    (tmp_path / "feeds.pkl").write_bytes(
        pickle.dumps([{k: np.asarray(v) for k, v in f.items()} for f in feeds])
    )
    script = f"""
import pickle, sys
import numpy as np
import openvino as ov
request = ov.Core().compile_model({str(xml)!r}, "CPU", {{"INFERENCE_PRECISION_HINT": {hint!r}}}).create_infer_request()
outs = []
for feed in pickle.loads(open({str(tmp_path / "feeds.pkl")!r}, "rb").read()):
    request.infer(feed)
    t = request.get_output_tensor(0)
    outs.append((t.element_type.get_type_name(), t.data.copy()))
assert not any(m == "precast" or m.startswith("precast.") for m in sys.modules)
open({str(tmp_path / "outs.pkl")!r}, "wb").write(pickle.dumps(outs))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outs = pickle.loads((tmp_path / "outs.pkl").read_bytes())
    return [torch.from_numpy(a).view(BF16) if kind == "bf16" else torch.from_numpy(a) for kind, a in outs]


def test_a_cache_is_carried_as_openvino_state(tmp_path):
    """The cache is an OpenVINO variable (named after the buffer, in its dtype), the length a constant: every
    call continues from the last, as eager does; reset() starts again from the program's buffer; two compiled
    models (and the IR reloaded in a process that never imports precast) each hold their own."""
    start = torch.randn(
        8, 4, generator=torch.Generator().manual_seed(9)
    )  # not zeros: the IR must start from it
    module = TinyCache(start)
    ep = torch.export.export(module, STEPS[0])
    want = eager_steps(module)
    first, _ = compile_quiet(ep)
    assert first.state_names == ("cache",)
    assert [s.get_variable_id() for s in first.ov_model.get_sinks()] == ["cache"]
    assert [p.get_friendly_name() for p in first.ov_model.get_parameters()] == ["x", "pos"]
    assert torch.equal(first.state()["cache"], start)  # started from the program's buffer
    got = [first(*step) for step in STEPS]
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, rel=1e-6)
    assert not torch.equal(first.state()["cache"], start)
    # a second model holds its own state: the first's calls left it at the start, and its own call (another
    # value into slot 2) leaves the first's cache alone (slot 4 rewritten with the same value: the same output)
    second, _ = compile_quiet(ep)
    other = (torch.full((1, 4), 3.0), torch.tensor([2]))
    assert_close(second(*other), copy.deepcopy(module)(*other), rel=1e-6)
    assert torch.equal(first(*STEPS[4]), got[4])
    first.reset()
    assert torch.equal(first.state()["cache"], start)
    assert all(torch.equal(first(*step), g) for step, g in zip(STEPS, got, strict=True))
    assert torch.equal(dict(ep.named_buffers())["cache"], start)  # the program's own buffer never written
    first.save(tmp_path / "cache.xml")
    feeds = [{"x": x.numpy(), "pos": p.numpy()} for x, p in STEPS]
    reloaded = fresh_process_steps(tmp_path / "cache.xml", tmp_path, feeds)
    assert all(torch.equal(r, g) for r, g in zip(reloaded, got, strict=True))


def test_a_zero_cache_starts_at_openvinos_default():
    """A cache exported as zeros (transformers' recipe) is a variable with no initial value: OpenVINO starts it,
    and resets it, at zeros, and the IR carries no copy of it."""
    import openvino as ov

    module = TinyCache()
    ep = torch.export.export(module, STEPS[0])
    model, _ = compile_quiet(ep)
    reads = [op for op in model.ov_model.get_ordered_ops() if op.get_type_name() == "ReadValue"]
    assert len(reads) == 1 and reads[0].get_input_size() == 0
    assert torch.equal(model.state()["cache"], torch.zeros(8, 4))
    got = [model(*step) for step in STEPS]
    for g, w in zip(got, eager_steps(module), strict=True):
        assert_close(g, w, rel=1e-6)
    model.reset()
    assert torch.equal(model.state()["cache"], torch.zeros(8, 4))
    assert isinstance(model.ov_model, ov.Model)


def test_a_bf16_cache_is_held_in_bf16():
    """cache_dtype=bf16: the variable is bf16 (no f32 copy of the cache), and the calls match the converted
    program run step by step (under the f32 hint: the graph's own dtypes)."""
    module = TinyCache()
    res = precast.convert(module, STEPS[0], policy="torch", dtype=BF16, cache_dtype=BF16)
    model, _ = compile_quiet(res.program, precision_hint="f32")
    (read,) = [op for op in model.ov_model.get_ordered_ops() if op.get_type_name() == "ReadValue"]
    assert read.get_output_element_type(0).get_type_name() == "bf16"
    program = copy.deepcopy(res.program).module()
    for step in STEPS:
        assert_close(model(*step), program(*step))
    assert model.state()["cache"].dtype == BF16
    want = dict(program.named_buffers())["cache"]
    if native("bf16") or not model.plan.overridden:
        assert torch.equal(model.state()["cache"], want)
    else:  # no native bf16: OpenVINO runs the bf16 Linear writing the cache in fp32 (one rounding, not two)
        assert emulated_only(model.plan) and model.state()["cache"].float().sub(
            want.float()
        ).abs().max() <= bound(want)


class RunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


class Steps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.steps.add_(1)
        return x * self.steps


@pytest.mark.parametrize("module", [RunningMean(), Steps()], ids=["running-mean", "step-counter"])
def test_state_that_is_not_a_cache_is_refused(module):
    """A buffer updated from its own value (a running statistic, a step counter) is not a cache: one line."""
    ep = torch.export.export(module, (torch.ones(2, 4),))
    with pytest.raises(
        PrecastError, match=r"is state, not a cache: .* updates it from its own value"
    ) as info:
        precast.compile(ep, backend="openvino")
    assert "\n" not in str(info.value) and "AOTInductor" in str(info.value)
    assert info.value.code == "cache-not-owned"


def test_onnx_still_refuses_a_program_that_writes_state(tmp_path):
    """An ONNX Runtime session would not carry a written buffer from call to call (each call would start from
    the exported values: a decoder's next step wrong): one line, no file."""
    from precast.backends.onnx.export import export_onnx

    ep = torch.export.export(TinyCache(), STEPS[0])
    with pytest.raises(PrecastError, match="ONNX Runtime session does not carry"):
        export_onnx(ep, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_cli_refuses_state_that_is_not_a_cache(tmp_path, capsys):
    torch.export.save(torch.export.export(RunningMean(), (torch.ones(2, 4),)), tmp_path / "stat.pt2")
    out = tmp_path / "stat.xml"
    code, err = run_cli(capsys, str(tmp_path / "stat.pt2"), "--backend", "openvino", "-o", str(out))
    assert code == 2
    assert "mean is state, not a cache" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stat.pt2"]
