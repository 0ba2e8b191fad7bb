"""precast.backends.onnx.export: converted programs exported to ONNX and run by ONNX Runtime's CPU provider.

Tolerance: ONNX Runtime's CPU provider computes most float16 ops in float32 (it inserts Casts around ops without a
float16 kernel, and folds the Casts of float16 weights once at session creation), where torch's float16 kernels
round each op's result: outputs differ by a few float16 ulps. Measured on these models: <= 2 ulps at the
output's largest magnitude; the bound is 4 ulps (``4 * eps(fp16) * max|ref|``) plus 1e-5 absolute.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.export import Dim

pytest.importorskip("onnx", reason="onnx not installed (pip install 'precast[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install 'precast[onnx]')")
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install 'precast[onnx]')")

import onnx  # noqa: E402

import precast  # noqa: E402
from precast.backends.onnx.export import export_onnx, inspect_onnx
from precast.backends.onnx.runtime import ort_can_run, ort_session, run_onnx
from precast.errors import PrecastError  # noqa: E402
from precast.runtime.exported import dynamic_batch  # noqa: E402
from tests import models as zoo  # noqa: E402

FP16 = torch.float16
ONNX_TYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float"}


def bound(ref: torch.Tensor, dtype: torch.dtype = FP16, ulps: int = 4) -> float:
    return ulps * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-5


def low_precision_constants(ep) -> dict[str, torch.dtype]:
    """Stored name -> dtype of every fp16/bf16 constant the program reads (the folded weights)."""
    read = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    out = {}
    for spec in ep.graph_signature.input_specs:
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target)) if spec.target else None
        if (
            isinstance(value, torch.Tensor)
            and value.dtype in (FP16, torch.bfloat16)
            and spec.arg.name in read
        ):
            out[spec.target] = value.dtype
    return out


def initializers(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (element type, number of elements)."""
    model = onnx.load(str(path))
    return {
        i.name: (onnx.TensorProto.DataType.Name(i.data_type).lower(), int(torch.tensor(i.dims).prod()))
        for i in model.graph.initializer
    }


def check_export(res, inputs: tuple, path: Path, other_batch: tuple | None = None):
    """Export, then: fp16 weights arrive as fp16 initializers under their stored names, no Cast reads an
    initializer, ORT CPU runs it, and outputs match the converted program within the stated bound."""
    info = export_onnx(res.program, path)
    assert path.exists() and info.size_bytes == path.stat().st_size
    onnx.checker.check_model(str(path), full_check=True)
    inits = initializers(path)
    low = low_precision_constants(res.program)
    assert low, "the converted program should store low-precision weights"
    # each folded weight is an initializer of its dtype: under its own name, or (when the exporter's optimizer
    # folded a transpose into it, e.g. attention's in_proj_weight, or merged equal initializers) one of its size
    for name, dtype in low.items():
        value = res.program.state_dict.get(name, res.program.constants.get(name))
        want = (ONNX_TYPE[dtype], value.numel())
        if not value.any():
            continue  # an all-zero bias (attention's out_proj): the exporter's optimizer drops Gemm's zero C
        if name in inits:
            assert inits[name] == want, (name, inits[name], want)
        else:
            assert want in inits.values(), (name, want)  # (shared when deduplicated: BERT's LayerNorm ones)
    assert info.initializer_casts == []
    assert info.dynamic_batch, info.inputs
    assert all(shape[0] == "batch" for _, _, shape in info.inputs if shape)
    session = ort_session(path)
    # what was exported: the program, re-exported with a dynamic batch where it was static
    module = dynamic_batch(res.program).module()
    for x in (inputs, other_batch) if other_batch else (inputs,):
        ref = module(*x).detach()
        (out,) = run_onnx(session, x)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert (out - ref).abs().max().item() <= bound(ref), (out - ref).abs().max().item()
    return info


def batch_of(inputs: tuple, batch: int) -> tuple:
    g = torch.Generator().manual_seed(batch)
    return tuple(torch.randn((batch, *x.shape[1:]), generator=g) for x in inputs)


# ---- zoo models ---------------------------------------------------------------------------------------------
def test_mlp_fp16(tmp_path):
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="torch", dtype=FP16)
    info = check_export(res, inputs, tmp_path / "mlp.onnx", batch_of(inputs, 3))
    assert info.initializers == {"float16": 8}  # 4 Linear layers: weights and biases, nothing in fp32
    assert info.casts == 1  # the input's cast to fp16; the head stays fp16 under autocast's table


def test_cnn_fp16_keeps_batchnorm(tmp_path):
    """Batch norm's statistics stay fp32 beside fp16 convolutions. The exporter's own BatchNormalization
    fusion would fold them into a float32 Conv weight beside a float16 activation (an invalid model);
    export_onnx skips that rewrite, so both BatchNormalization nodes remain (ORT fuses them at load)."""
    model, inputs = zoo.plain_cnn()
    res = precast.convert(model, inputs, policy="torch", dtype=FP16)
    info = check_export(res, inputs, tmp_path / "cnn.onnx", batch_of(inputs, 3))
    assert info.ops["BatchNormalization"] == 2
    assert info.ops["Conv"] == 2


def test_encoder_fp16_dynamic_batch(tmp_path):
    model, inputs = zoo.plain_encoder()
    res = precast.convert(
        model, inputs, policy="torch", dtype=FP16, dynamic_shapes=({0: Dim("batch", min=1)},)
    )
    check_export(res, inputs, tmp_path / "encoder.onnx", batch_of(inputs, 5))


def test_static_program_warns_and_stays_static(tmp_path):
    """An attention layer traced at batch 2 bakes the batch into its reshapes: no re-export can make it
    dynamic. The export says so (with the fix) and the model keeps batch 2."""
    model, inputs = zoo.plain_encoder()
    res = precast.convert(model, inputs, policy="torch", dtype=FP16)
    with pytest.warns(UserWarning, match=r"batch dimension stays static.*dynamic_shapes"):
        info = export_onnx(res.program, tmp_path / "static.onnx")
    assert not info.dynamic_batch
    assert info.inputs[0][2] == [2, 8, 64]
    (out,) = run_onnx(tmp_path / "static.onnx", inputs)
    ref = res.program.module()(*inputs).detach()
    assert (out - ref).abs().max().item() <= bound(ref)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batch dimension stays static")
        export_onnx(res.program, tmp_path / "static2.onnx", dynamic_batch=False)  # asked for: no warning


# ---- bf16: what ONNX and ORT CPU cannot run -------------------------------------------------------------------
def test_bf16_program_exports_but_ort_cpu_has_no_kernel(tmp_path):
    model, inputs = zoo.small_mlp()  # the zoo's bf16 autocast region, policy None
    res = precast.convert(model, inputs)
    path = tmp_path / "mlp_bf16.onnx"
    info = export_onnx(res.program, path)
    assert info.initializers == {"bfloat16": 8} and info.initializer_casts == []
    assert not ort_can_run(path)
    with pytest.raises(PrecastError) as err:
        ort_session(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "no bfloat16 kernel for Gemm" in msg and "dtype=torch.float16" in msg


def test_bf16_conv_is_not_onnx_and_leaves_no_file(tmp_path):
    model, inputs = zoo.cnn()
    res = precast.convert(model, inputs)
    path = tmp_path / "cnn_bf16.onnx"
    with pytest.raises(PrecastError, match=r"has no bfloat16 Conv; convert with dtype=torch.float16") as err:
        export_onnx(res.program, path)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # no partial file, no temporary left behind


def test_bad_arguments(tmp_path):
    model, inputs = zoo.plain_mlp()
    with pytest.raises(PrecastError, match="pass an ExportedProgram"):
        export_onnx(model, tmp_path / "x.onnx")
    res = precast.convert(model, inputs, policy="torch", dtype=FP16)
    with pytest.raises(PrecastError, match="does not exist"):
        export_onnx(res, tmp_path / "missing" / "x.onnx")  # a ConvertResult is accepted
    export_onnx(res, tmp_path / "x.onnx")
    with pytest.raises(PrecastError, match=r"1 tensor input\(s\) given, the model takes 1|takes 1"):
        run_onnx(tmp_path / "x.onnx", (*inputs, inputs[0]))
    with pytest.raises(PrecastError, match="ONNX Runtime failed"):
        run_onnx(tmp_path / "x.onnx", (torch.randn(4, 63),))
    assert inspect_onnx(tmp_path / "x.onnx").initializers == {"float16": 8}


# ---- a real model -------------------------------------------------------------------------------------------
def test_bert_rules_fp16(tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'precast[test]')")
    from tests.realmodels.builders import bert
    from tests.realmodels.conftest import export

    built = bert()
    program = export(built.make(False), built.inputs[2])
    res = precast.convert(program, built.inputs[2], policy="rules", dtype=FP16)
    info = check_export(res, built.inputs[2], tmp_path / "bert.onnx", built.inputs[3])
    assert set(info.initializers) >= {"float16"} and "float" not in info.initializers  # every weight fp16


def test_bench_ort(tmp_path):
    from precast.bench.ort import bench_ort

    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy="torch", dtype=FP16)
    export_onnx(res.program, tmp_path / "mlp.onnx")
    stats = bench_ort(tmp_path / "mlp.onnx", inputs, repeats=3, workdir=tmp_path)
    assert stats["latency_ms"] > 0 and len(stats["samples_ms"]) == 3
    assert stats["file_mb"] == round((tmp_path / "mlp.onnx").stat().st_size / 2**20, 3)
    assert stats["rss_mb"] is None or stats["rss_mb"] > 0
