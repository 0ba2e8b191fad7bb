"""8- and 4-bit weights exported to ONNX (issue 50 item 3). An int4 program's ``packed >> 4`` (the high nibble of
its uint8 weight) was translated by onnxscript as an arithmetic shift cast to int8: an invalid model. Each program
here is exported, checked by ONNX's full checker, run in ONNX Runtime (CPU) and compared with the program's eager
run bitwise: the dequantization is integer ops and exact float ops (a float32 ``(q - z) * s``), and ONNX Runtime's
MatMul/Gather on those weights match torch's here; the signed shift keeps onnxscript's arithmetic translation."""

from __future__ import annotations

import pytest
import torch

import precast

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from precast.backends.onnx.export import export_onnx  # noqa: E402
from precast.backends.onnx.runtime import run_onnx  # noqa: E402


class Lm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 128)
        self.lin = torch.nn.Linear(128, 128)
        self.head = torch.nn.Linear(128, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(self.emb(ids))))


IDS = torch.tensor([[1, 5, 9, 200, 255, 0]])


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_int_weights_export_to_a_valid_model_that_ort_runs_bitwise(fmt, tmp_path):
    torch.manual_seed(0)
    model = Lm().eval()
    res = precast.convert(model, (IDS,), weights=precast.WeightOptions(format=fmt))
    stored = {v.dtype for v in res.program.state_dict.values()}
    assert (torch.uint8 if fmt == "int4" else torch.int8) in stored  # the weights are stored in 4 / 8 bits
    info = export_onnx(res.program, tmp_path / "m.onnx")  # the full checker runs inside
    want = res.program.module()(IDS)
    (got,) = run_onnx(tmp_path / "m.onnx", (IDS,))
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(got, model(IDS))  # quantized, not the float model: the comparison can fail
    assert info.initializers.get("uint8" if fmt == "int4" else "int8")  # stored as such in the file
    if fmt == "int4":
        assert info.ops.get("BitShift")  # the nibble read by a logical shift
    again = torch.randint(0, 256, (3, IDS.shape[1]))  # a dynamic batch
    (got3,) = run_onnx(tmp_path / "m.onnx", (again,))
    assert torch.equal(got3, torch.cat([res.program.module()(row[None]) for row in again]))


class Shifts(torch.nn.Module):
    def forward(self, u: torch.Tensor, s: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return u >> 4, s >> 2, u >> k, s >> k.to(torch.int8)


def test_right_shifts_keep_their_semantics_signed_and_unsigned(tmp_path):
    u = torch.tensor([[0, 1, 15, 16, 127, 128, 200, 255]], dtype=torch.uint8)
    s = torch.tensor([[0, 1, -1, -2, 127, -128, 64, -100]], dtype=torch.int8)
    k = torch.tensor([3], dtype=torch.uint8)
    ep = torch.export.export(Shifts(), (u, s, k))
    export_onnx(ep, tmp_path / "s.onnx", dynamic_batch=False)
    for got, want in zip(run_onnx(tmp_path / "s.onnx", (u, s, k)), ep.module()(u, s, k), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
