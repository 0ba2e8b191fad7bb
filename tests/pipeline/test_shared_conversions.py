"""A dtype conversion the fp32 export recorded as a no-op returns the value itself, so every later read of that
value is traced as a read of the conversion: policy torch given the program then reads the converted value where
eager autocast reads the low-precision one (issue 40 item 10). ``dtype-read-at-export`` names the conversion, its
line and the reader the program cannot place; the module route and policy None stay bitwise."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precast
from precast.errors import user_source_line
from precast.pipeline.checks import shared_noop_conversions

BF16, FP16 = torch.bfloat16, torch.float16
CODE = "dtype-read-at-export"


class SharedMean(nn.Module):
    """The report's model: ``v2.float()`` feeds an einsum, and a later line takes the mean of ``v2`` itself."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.register_buffer("buf", torch.zeros(()))

    def forward(self, x):
        v2 = F.linear(x, self.w)
        y = torch.einsum("bi,bj->bij", x, v2.float())
        self.buf.copy_(self.buf * 0.75 + v2.mean())
        return y.sum(-1) + self.buf


def line_of(cls: type, text: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def found(res) -> list:
    return [d for d in res.report.diagnostics if d.code == CODE]


def eager_autocast(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, calls: int = 2) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        for _ in range(calls):
            out = model(x)
    return out


def test_a_shared_noop_conversion_is_named_with_its_reader():
    torch.manual_seed(0)
    model, x = SharedMean().eval(), torch.randn(4, 8)
    res = precast.convert(torch.export.export(copy.deepcopy(model), (x,)), policy="torch", dtype=BF16)
    [d] = found(res)
    assert d.severity == "info" and "\n" not in d.message
    assert d.location.endswith(f":{line_of(SharedMean, 'v2.float()')}"), d
    assert "node 'to'" in d.message and "`y = torch.einsum" in d.message
    assert "node 'mean'" in d.message and f":{line_of(SharedMean, 'v2.mean()')}" in d.message
    assert "precast.convert(model, example_inputs, policy='torch')" in d.fix
    # what it warns about: the program takes the mean of the float32 conversion, eager of bf16 v2
    with torch.no_grad():
        conv = res.program.module()
        conv(x)
        conv(x)
    assert not torch.equal(conv.buf, eager_buf(model, x, BF16))


def eager_buf(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = copy.deepcopy(model)
    eager_autocast(m, x, dtype)
    return m.buf


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_the_module_route_is_bitwise_and_silent(dtype):
    torch.manual_seed(0)
    model, x = SharedMean().eval(), torch.randn(4, 8)
    res = precast.convert(copy.deepcopy(model), (x,), policy="torch", dtype=dtype)
    assert not found(res)
    assert res.report.verification["bitwise"]
    want = eager_autocast(copy.deepcopy(model), x, dtype)
    with torch.no_grad():
        conv = res.program.module()
        conv(x)
        got = conv(x)
    assert torch.equal(got, want)


def test_policy_none_is_bitwise_and_silent():
    torch.manual_seed(0)
    model, x = SharedMean().eval(), torch.randn(4, 8)
    ep = torch.export.export(copy.deepcopy(model), (x,))
    res = precast.convert(ep, (x,))
    assert not found(res)
    with torch.no_grad():
        a, b = res.program.module(), ep.module()
        for _ in range(2):
            assert torch.equal(a(x), b(x))


class Spelled(nn.Module):
    """``v`` out of a linear in ``dtype`` (float32 unless given), converted by ``how`` to the dtype it already
    has, then read again by name on a later line."""

    def __init__(self, how: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.how, self.dtype = how, dtype
        self.lin = nn.Linear(8, 8).to(dtype)

    def forward(self, x):
        v = self.lin(x.to(self.dtype))
        if self.how == "float":
            y = v.float() * 2
        elif self.how == "half":
            y = v.half() * 2
        elif self.how == "bfloat16":
            y = v.bfloat16() * 2
        elif self.how == "double":
            y = v.double() * 2
        elif self.how == "to":
            y = v.to(torch.float32) * 2
        elif self.how == "to_kw":
            y = v.to(dtype=torch.float32) * 2
        elif self.how == "type":
            y = v.type(torch.float32) * 2
        elif self.how == "rebind":
            v = v.float()
            y = v * 2
        else:
            y = self.lin(x).float() * 2
        return y.float() + v.float().sum()


@pytest.mark.parametrize(
    "how, dtype, shared",
    [
        ("float", torch.float32, True),
        ("to", torch.float32, True),
        ("to_kw", torch.float32, True),
        ("type", torch.float32, True),
        # an fp16 value eager bf16 autocast computes in bf16 (the linear's inputs are eligible): a real conversion
        ("half", torch.float16, True),
        ("bfloat16", torch.bfloat16, True),
        # autocast never changes a float64 value: the no-op stays one under autocast
        ("double", torch.float64, False),
        # the line rebinds the name: no other name reads the value before the conversion
        ("rebind", torch.float32, False),
        # the converted value has no name another line could read
        ("unnamed", torch.float32, False),
    ],
)
def test_each_spelling_of_a_noop_conversion(how, dtype, shared):
    ep = torch.export.export(Spelled(how, dtype).eval(), (torch.randn(2, 8),))
    pairs = shared_noop_conversions(ep.graph, "cpu")
    assert bool(pairs) == shared, (how, [(c.name, r.name) for c, r in pairs])
    if shared:  # the reader the program cannot place: the later line's `v.float()`
        line = line_of(Spelled, "v.float().sum()")
        assert {user_source_line(r).rpartition(":")[2] for _, r in pairs} == {str(line)}


class Residual(nn.Module):
    """A value outside any lower-precision op (the fp32 residual stream, as a Llama's RMSNorm input): eager
    autocast keeps it float32 too, so a later read of it is the same either way."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.lin(x)
        n = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return h + n


class Helper(nn.Module):
    """The value read in another function, after the conversion: the program cannot tell which it read."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        v = self.lin(x)
        y = v.float() * 2
        return y + self.stat(v)

    def stat(self, t):
        return t.mean()


def test_an_fp32_value_is_not_flagged_and_a_read_elsewhere_is():
    x = torch.randn(2, 8)
    assert shared_noop_conversions(torch.export.export(Residual().eval(), (x,)).graph, "cpu") == []
    pairs = shared_noop_conversions(torch.export.export(Helper().eval(), (x,)).graph, "cpu")
    assert [r.target for _, r in pairs] == [torch.ops.aten.mean.default]
