"""Policy "rules": each rule fires where it should and only there; casts, I/O dtypes, odd ops."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.ir.graph import cast_dtype, is_cast

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
OFF = math.inf  # turns a range rule off


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc(x))


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.encoder = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.encoder:
            x = b(x)
        return self.head(x).softmax(-1)


def net():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 8),)


def dtypes(res) -> dict[str, str]:
    return {n.name: n.dtype for n in res.report.nodes}


def convert(model_inputs, **kw):
    model, inputs = model_inputs
    kw.setdefault("dtype", FP16)
    kw.setdefault("data_max", OFF)
    return precast.convert(model, inputs, policy="rules", **kw)


def test_default_everything_low_outputs_keep_dtype():
    res = convert(net())
    d = dtypes(res)
    assert d["linear"] == d["layer_norm"] == d["softmax"] == "fp16"
    out = res.module()(*net()[1])
    assert out.dtype == FP32  # keep_io_types=True by default
    assert torch.allclose(out, net()[0](*net()[1]), atol=2e-3)


def test_keep_io_types_false_lets_outputs_follow():
    res = convert(net(), keep_io_types=False)
    assert res.module()(*net()[1]).dtype == FP16


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"exclude_nodes": ["encoder[.1"]}, "not a valid regular expression"),
        ({"include_nodes": ["(unclosed"]}, "not a valid regular expression"),
        ({"exclude_ops": ["aten.softmaxx"]}, "no op named 'aten.softmaxx'"),
        ({"exclude_ops": ["LayerNorm"]}, "did you mean 'layernorm'"),
        ({"include_ops": [42]}, "not an op"),
        ({"max_reduction_depth": 0}, "positive integer"),
        ({"data_max": -1}, "positive number"),
        (
            {"data_max": math.nan},
            "positive number",
        ),  # NaN compares false with every limit: the rule never fired
        ({"init_max": True}, "positive number"),
    ],
)
def test_bad_options_are_clear_errors(kw, needle):
    with pytest.raises(PrecastError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        convert(net(), **kw)


def test_disabled_region_stays_fp32():
    class R(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                h = self.a(x)
            return self.b(h)

    torch.manual_seed(0)
    res = convert((R().eval(), (torch.randn(2, 8),)), include_ops=["linear"])
    region = [n for n in res.report.nodes if n.source == "region"]
    assert [(n.op, n.dtype, n.rule) for n in region] == [("aten.linear.default", "fp32", "disabled")]
    rest = [n for n in res.report.nodes if n.op == "aten.linear.default" and n.source != "region"]
    assert [n.dtype for n in rest] == ["fp16"]


class Odd(nn.Module):
    """Integer/bool/float64 tensors, an in-place op, multi-output ops."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, ids, extra):
        h = self.emb(ids)  # int64 indices
        h = self.fc(h)
        a, b = h.split(4, dim=-1)
        m, idx = a.max(dim=-1)
        parts = torch.unbind(b, dim=1)
        y = parts[0].clone()
        y.add_(1.0)  # in place on a low value
        mask = ids > 3  # bool
        z = torch.where(mask, h.sum(-1), 0.0)
        w = extra * 2  # float64 stays float64
        return m + y.sum(-1)[:, None] + z, idx, w


def test_ints_bools_fp64_inplace_and_multi_output():
    torch.manual_seed(0)
    model = Odd().eval()
    inputs = (torch.randint(0, 10, (2, 3)), torch.randn(2, dtype=torch.float64))
    res = convert((model, inputs))
    casts = [n for n in res.program.graph.nodes if is_cast(n)]
    for c in casts:
        src = c.args[0].meta["val"]
        assert src.is_floating_point() and src.dtype != torch.float64, c
    out, idx, w = res.module()(*inputs)
    want = model(*inputs)
    assert idx.dtype == torch.int64 and torch.equal(idx, want[1])
    assert w.dtype == torch.float64 and torch.equal(w, want[2])
    assert out.dtype == FP32 and torch.allclose(out, want[0], atol=5e-2, rtol=1e-2)
    inplace = [n for n in res.program.graph.nodes if n.target is torch.ops.aten.add_.Tensor]
    assert inplace and not is_cast(inplace[0].args[0])  # mutated argument is the real tensor


def test_one_cast_per_producer_and_dtype():
    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            h = self.norm(x)  # kept fp32 below, then feeds four low linears and two fp32 ops
            return sum(f(h) for f in self.fcs) + h.exp() + h.sin()

    torch.manual_seed(0)
    res = convert((Fan().eval(), (torch.randn(2, 8),)), exclude_ops=["layer_norm", "exp", "sin"])
    casts = [(n.args[0], cast_dtype(n)) for n in res.program.graph.nodes if is_cast(n)]
    assert casts, "expected run-time casts"
    counts = Counter(casts)
    assert max(counts.values()) == 1, counts
    ln = next(n for n in res.program.graph.nodes if n.name == "layer_norm")
    assert sum(1 for n in ln.users if is_cast(n)) == 1  # one fp16 copy shared by the four linears
