"""Classification and composite splicing reproduce eager autocast exactly, and say so when they cannot.

Each test here failed before the fix it names: nested einsum in an fp16 region was refused as a dtype mismatch
(its plain trace failed and the op was kept); a decomposition spliced from fake strides failed at run time; a
composite that could not be traced was silently kept; every fake-run failure was called ``dtype-mismatch``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import precast
import precast.passes.decompose as decompose_mod
from precast.errors import PrecastError
from precast.ir.program import Program
from precast.passes.classify import classify
from precast.passes.regions import inline_regions
from precast.policy.torch_policy import TorchPolicy
from tests.helpers import assert_bitwise


def eager_autocast(model: nn.Module, inputs: tuple, dtype: torch.dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        return model(*inputs)


class NestedEinsum(nn.Module):
    """einsum(einsum(x, x), x) in an fp16 region: the outer einsum gets an fp16 and an fp32 input, which only
    autocast (inside the decomposition's bmm) reconciles."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            a = torch.einsum("ij,jk->ik", x, x)
            return torch.einsum("ij,jk->ik", a, x)


class StridedEinsum(nn.Module):
    """batch_norm of a transposed input: fake batch_norm keeps the input's strides, the CPU kernel returns a
    contiguous tensor, so the einsum below sees different strides in the trace and at run time."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.w = nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.bn(x.transpose(1, 2)).transpose(1, 2)
            return torch.einsum("bsc,cd->bsd", h, self.w)


def _model(cls):
    torch.manual_seed(0)
    model = cls().eval()
    if isinstance(model, StridedEinsum):
        with torch.no_grad():
            model.bn.running_mean.uniform_(-1, 1)
            model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(4, 4) if cls is NestedEinsum else torch.randn(2, 3, 4)
    return model, (x,)


@pytest.mark.parametrize("cls", [NestedEinsum, StridedEinsum], ids=["nested-einsum-fp16", "strided-einsum"])
@pytest.mark.parametrize("policy", [None, "torch"])
def test_composite_splice_matches_eager(cls, policy):
    model, inputs = _model(cls)
    ep = torch.export.export(model, inputs)
    dtype = torch.float16 if cls is NestedEinsum else torch.bfloat16
    res = precast.convert(ep, policy=policy, dtype=dtype if policy else None)
    assert res.report.verification["bitwise"], res.report.verification["verdict"]
    got = res.program.module()(*inputs)
    assert_bitwise(got, ep.module()(*inputs))  # the program's own region is the whole forward
    assert_bitwise(got, eager_autocast(model, inputs, dtype))
    assert any("einsum" in d for d in res.report.decomposed)


def test_spliced_views_are_stride_independent():
    """The splice has no stride-dependent ``view``: eager's decomposition reshapes the real tensor."""
    model, inputs = _model(StridedEinsum)
    res = precast.convert(model, inputs, policy="torch", dtype=torch.bfloat16)
    targets = {n.target for n in res.program.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.view.default not in targets
    assert torch.ops.aten.reshape.default in targets


def _program(model: nn.Module, inputs: tuple) -> Program:
    program = Program(torch.export.export(model, inputs))
    inline_regions(program.gm)
    return program


def test_composite_trace_failure_is_an_error_naming_the_node(monkeypatch):
    """A composite eager decomposes under autocast that precast cannot trace is never silently kept."""

    def broken_trace(op, args, kwargs, mode, autocast):
        raise RuntimeError("tracer exploded")

    monkeypatch.setattr(decompose_mod, "_trace", broken_trace)
    model, inputs = _model(NestedEinsum)
    with pytest.raises(PrecastError) as err:
        precast.convert(model, inputs)
    assert err.value.code == "composite-not-traced"
    assert "einsum" in str(err.value) and "tracer exploded" in str(err.value)

    seen = []
    program = _program(model, inputs)
    einsums = [n.name for n in program.graph.nodes if n.target is torch.ops.aten.einsum.default]
    result = classify(program, None, on_error=lambda e, node: seen.append((e.code, node.name)))
    assert seen == [("composite-not-traced", name) for name in einsums] and len(einsums) == 2
    assert not result.decomposed  # allowed: the ops stay as written, and the driver recorded why


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_fake_run_failure_is_not_called_a_dtype_mismatch():
    program = _program(Plain().eval(), (torch.randn(2, 4),))
    relu = next(n for n in program.graph.nodes if n.target is torch.ops.aten.relu.default)

    def exploding_relu(x):
        raise RuntimeError("meta kernel exploded\nsecond line")

    relu.target = exploding_relu
    with pytest.raises(PrecastError) as err:
        classify(program, TorchPolicy("cpu", torch.bfloat16))
    assert err.value.code == "fake-run-failed"
    assert err.value.node == "relu"
    assert "exploding_relu" in str(err.value) and "meta kernel exploded" in str(err.value)
    assert "second line" not in str(err.value)


def test_mixed_float_inputs_are_a_dtype_mismatch():
    """The converse: an op that fails because its floating inputs differ keeps the dtype-mismatch code."""

    class Leak(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.a(x)
            return torch.mm(h, self.b.weight)  # bf16 @ fp32 outside the region: fails in eager too

    with pytest.raises(PrecastError) as err:
        precast.convert(Leak().eval(), (torch.randn(2, 4),))
    assert err.value.code == "dtype-mismatch"


class ElementwiseEinsum(nn.Module):
    """``einsum("bi,i->bi", low, param)``: no contracted index, so eager runs a ``mul`` (it promotes to fp32);
    found by the stateful property test (tests/test_stateful_properties.py), refused as a dtype mismatch."""

    def __init__(self, equation: str = "bi,i->bi"):
        super().__init__()
        self.equation = equation
        self.w = nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch.einsum(self.equation, x.bfloat16(), self.w)


def test_einsum_of_mixed_dtypes_without_contraction_converts():
    model, x = ElementwiseEinsum(), (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),)
    with torch.no_grad():
        want = model(*x)
    assert want.dtype == torch.float32
    res = precast.convert(torch.export.export(model, x))
    with torch.no_grad():
        assert_bitwise(res.program.module()(*x), want)


def test_einsum_of_mixed_dtypes_with_contraction_is_still_refused():
    """The converse: "bi,i->b" reaches a bmm, which eager refuses on bf16 and fp32: still a mismatch (and
    "bi,i->bi", a mul, is not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from precast.passes.classify import composite_mismatch

    with pytest.raises(RuntimeError):
        ElementwiseEinsum("bi,i->b")(torch.randn(4, 8))
    mode = FakeTensorMode()
    with mode:
        a, w = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8)
    einsum = torch.ops.aten.einsum.default
    assert composite_mismatch(einsum, ("bi,i->b", [a, w]), {}, mode) is not None
    assert composite_mismatch(einsum, ("bi,i->bi", [a, w]), {}, mode) is None
