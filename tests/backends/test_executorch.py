"""ExecuTorch export (precast.backends.executorch): the converted program lowered with to_edge/to_executorch,
run in ExecuTorch's Python runtime (portable kernels, no delegate).

Tolerance against the converted program (``res.program.module()(*inputs)``), normwise per output:
``max|pte - program| <= TOL[dtype] * max|program|`` with TOL = 2**-5 for bfloat16 (8 ulps at the output's
scale), 2**-8 for float16. Not bitwise: ExecuTorch's portable kernels round some intermediates where torch's CPU
kernels do not (addmm rounds the product to bf16 before adding the bias; Scalar ops round the scalar first).
Measured: small_mlp 0.014, encoder 0.0053, cnn (bn folded) 0.0072, BERT 0.0002, plain_mlp fp16 0.0026.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree

pytest.importorskip(
    "executorch",
    reason="executorch is not installed (pip install 'precast[executorch]'); the latest lane leaves it out: "
    "executorch 1.5.1 is built against torch 2.13 and runs in the floor lane",
)

import precast  # noqa: E402
from precast.backends import executorch as et  # noqa: E402
from precast.errors import PrecastError  # noqa: E402
from tests import models as zoo  # noqa: E402

TOL = {torch.bfloat16: 2**-5, torch.float16: 2**-8}
FLOATING = ("bfloat16", "float16", "float32", "float64")


def fp32_weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * 4 for t in model.state_dict().values() if t.is_floating_point())


def check_close(path, program, inputs, dtype) -> float:
    got = et.run_executorch(path, *inputs)
    want = pytree.tree_leaves(program.module()(*inputs))
    assert len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = w.double().abs().max().item()
        diff = (g.double() - w.double()).abs().max().item()
        assert torch.isfinite(g).all()
        assert diff <= TOL[dtype] * scale, (diff, scale)
        worst = max(worst, diff)
    return worst


def check_weights_once_low(info: dict, model: torch.nn.Module, low: str) -> None:
    """The .pte (read back with ExecuTorch's own deserializer) stores no more constant bytes of any dtype than
    the converted program holds, all of the program's low-precision weight bytes are there, and nothing else
    in the file could hold an fp32 copy of them."""
    prog, pte = info["program_constants"], info["constants"]
    assert pte[low] == prog[low] > 0
    for dtype in FLOATING:  # (ExecuTorch may add a scalar int64 constant of its own)
        assert pte.get(dtype, 0) <= prog.get(dtype, 0), (dtype, pte, prog)
    assert info["delegates"] == 0
    # alignment padding only between stored constants
    assert (
        info["constant_bytes"]
        <= info["constant_buffer_bytes"]
        < info["constant_bytes"] + 64 * info["constant_tensors"]
    )
    # an fp32 copy hidden anywhere else in the file (named data, a delegate blob) would add 2 bytes per bf16 byte
    assert info["pte_bytes"] - info["constant_buffer_bytes"] < 2 * prog[low]


@pytest.mark.parametrize("name", ["mlp", "encoder"])
def test_region_models_run_in_executorch(name, tmp_path):
    model, inputs = zoo.REGION_MODELS[name]()
    res = precast.convert(model, inputs)
    path = tmp_path / f"{name}.pte"
    info = et.export_executorch(res.program, path)
    assert path.is_file() and path.stat().st_size == info["pte_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    diff = check_close(path, res.program, inputs, torch.bfloat16)
    assert info["max_abs_diff"] == diff  # the export's own trial run saw the same outputs
    check_weights_once_low(info, model, "bfloat16")
    assert info["pte_bytes"] < fp32_weight_bytes(model)  # smaller than the fp32 weights alone: no fp32 copy
    assert sum(info["ops"].values()) > 0 and all("::" in op for op in info["ops"])


def test_float16_program(tmp_path):
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="rules", dtype=torch.float16)
    info = et.export_executorch(res.program, tmp_path / "m.pte")
    check_close(tmp_path / "m.pte", res.program, inputs, torch.float16)
    check_weights_once_low(info, model, "float16")
    assert set(info["constants"]) == {"float16"}


def test_mixed_batch_norm_names_op_and_route(tmp_path):
    """Autocast leaves batch norm with a bf16 input and fp32 statistics; the portable kernel rejects that."""
    model, inputs = zoo.cnn()
    res = precast.convert(model, inputs)
    path = tmp_path / "cnn.pte"
    with pytest.raises(PrecastError) as err:
        et.export_executorch(res.program, path)
    msg = str(err.value)
    assert "\n" not in msg and "_native_batch_norm_legit_no_training" in msg and "fuse_conv_bn_eval" in msg
    assert "policy='rules'" in msg
    assert not path.exists() and list(tmp_path.iterdir()) == []

    # the first route: batch norm folded into the convolutions before converting
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    model.conv1, model.bn1 = fuse_conv_bn_eval(model.conv1, model.bn1), torch.nn.Identity()
    model.conv2, model.bn2 = fuse_conv_bn_eval(model.conv2, model.bn2), torch.nn.Identity()
    res = precast.convert(model, inputs)
    info = et.export_executorch(res.program, path)
    check_close(path, res.program, inputs, torch.bfloat16)
    check_weights_once_low(info, model, "bfloat16")

    # the second route: the model without regions under policy 'rules'
    plain, inputs = zoo.plain_cnn()
    res = precast.convert(plain, inputs, policy="rules")
    et.export_executorch(res.program, path)
    check_close(path, res.program, inputs, torch.bfloat16)


def test_runtime_failure_is_named_from_the_native_log(tmp_path, monkeypatch):
    """With the static check off, the trial run in the runtime fails; the op comes from ExecuTorch's own log."""
    monkeypatch.setattr(et, "_check_mixed_dtypes", lambda program: None)
    model, inputs = zoo.cnn()
    res = precast.convert(model, inputs)
    with pytest.raises(
        PrecastError, match=r"op aten::_native_batch_norm_legit_no_training\.out fails"
    ) as err:
        et.export_executorch(res.program, tmp_path / "cnn.pte")
    assert "fuse_conv_bn_eval" in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_missing_kernel_names_op_and_route(tmp_path):
    """Policy 'torch' takes autocast's oneDNN RNN kernel, which ExecuTorch has no kernel for; 'rules' runs. (Where
    oneDNN has no bf16 LSTM, e.g. plain AVX2, the conversion itself refuses that kernel: device-unsupported.)"""
    model, inputs = zoo.lstm()
    try:
        res = precast.convert(model, inputs, policy="torch")
    except PrecastError as exc:
        assert exc.code == "device-unsupported" and "mkldnn_rnn_layer" in str(exc), exc
    else:
        with pytest.raises(
            PrecastError, match=r"op aten::mkldnn_rnn_layer\.out has no kernel.*policy='rules'"
        ):
            et.export_executorch(res.program, tmp_path / "lstm.pte")
    res = precast.convert(model, inputs, policy="rules")
    et.export_executorch(res.program, tmp_path / "lstm.pte")
    check_close(tmp_path / "lstm.pte", res.program, inputs, torch.bfloat16)


def test_edge_verifier_rejects_promoting_cat(tmp_path):
    """to_edge's verifier rejects cat of bf16 and fp32; the portable kernel promotes as torch does (the float64
    output agrees to summation order)."""
    model, inputs = zoo.cat_mixed()
    res = precast.convert(model, inputs, policy="rules")
    with pytest.raises(PrecastError, match=r"to_edge rejects aten\.cat\.default.*check_ir_validity=False"):
        et.export_executorch(res.program, tmp_path / "cat.pte")
    info = et.export_executorch(res.program, tmp_path / "cat.pte", check_ir_validity=False)
    want = res.program.module()(*inputs)
    assert want.dtype == torch.float64 and info["max_abs_diff"] <= 1e-12 * want.abs().item()
    assert et.run_executorch(tmp_path / "cat.pte", *inputs)[0].dtype == torch.float64


def test_not_a_program(tmp_path):
    model, _ = zoo.small_mlp()
    with pytest.raises(PrecastError, match="ExportedProgram"):
        et.export_executorch(model, tmp_path / "m.pte")
    with pytest.raises(PrecastError, match="does not exist"):
        et.export_executorch(torch.export.export(model, (torch.randn(2, 64),)), tmp_path / "no" / "m.pte")
    with pytest.raises(PrecastError, match="cannot read the .pte file"):
        et.run_executorch(tmp_path / "missing.pte", torch.randn(2, 64))


def test_failing_op_parser():
    assert et._failing_op(
        ["[method.cpp:1483] KernelCall failed at instruction 0:2 in operator aten::x.out: 0x12"]
    ) == ("aten::x.out")
    assert et._failing_op(["[method.cpp:822] Missing operator: [5] aten::y.out"]) == "aten::y.out"
    assert et._failing_op(["nothing here"]) is None


def test_bert_real_model(tmp_path):
    """transformers' BertModel (one layer, seeded random weights) with its forward in one bf16 region."""
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")
    from tests.realmodels.builders import bert

    built = bert()
    model, inputs = built.make(True), built.inputs[2]
    res = precast.convert(model, inputs)
    info = et.export_executorch(res.program, tmp_path / "bert.pte")
    check_close(tmp_path / "bert.pte", res.program, inputs, torch.bfloat16)
    prog, pte = info["program_constants"], info["constants"]
    for dtype in FLOATING:  # no floating dtype gained bytes
        assert pte.get(dtype, 0) <= prog.get(dtype, 0), (dtype, pte, prog)
    assert pte["bfloat16"] >= 0.95 * prog["bfloat16"]  # the linear weights are there, in bf16
    assert math.isfinite(info["max_abs_diff"])
