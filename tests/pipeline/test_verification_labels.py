"""Verification names the reference it actually ran, and a program whose graph fixed a dtype read at export gets
one info diagnostic pointing to the module route (issue 27 item 4)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import precast
from precast.pipeline.checks import dtype_reads_at_export

BF16 = torch.bfloat16


class RMSNormed(nn.Module):
    """Qwen3's RMSNorm after a Linear: ``h.to(torch.float32)`` ... ``weight * h.to(input_dtype)``. Exported in
    fp32, ``input_dtype`` is recorded as float32; under eager autocast it is bf16 (``h`` leaves the Linear)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.ones(8) * 1.5)

    def forward(self, x):
        h = self.lin(x)
        input_dtype = h.dtype
        v = h.to(torch.float32)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * v.to(input_dtype)  # the dtype read


class Upcast(nn.Module):
    """Only literal float32 conversions (``.float()``, ``.to(torch.float32)``) and ``type_as``, which reads its
    other tensor when it runs: nothing fixed at export. ``type_as`` reads a view of ``h`` taken before the
    conversions: ``v.type_as(h)`` after them would be traced as reading ``h.to(torch.float32)`` (a no-op in the
    fp32 export that returns ``h`` itself), which ``tests/pipeline/test_shared_conversions.py`` covers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        like = h[:1]
        v = h.float() * 0.5 + h.to(torch.float32)
        return v.type_as(like) + 1


class Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            return self.lin(x)


def read_line() -> int:
    lines, start = inspect.getsourcelines(RMSNormed.forward)
    return start + next(i for i, ln in enumerate(lines) if "v.to(input_dtype)" in ln)


X = torch.randn(4, 8)


@pytest.mark.parametrize(
    "route, policy, want",
    [
        ("module", "torch", "eager torch.autocast of the module (cpu, bf16)"),
        ("program", "torch", "the program run under torch.autocast (cpu, bf16)"),
        ("program", "rules", "the unconverted program"),
        ("module", "rules", "the unconverted program"),
    ],
)
def test_verification_names_the_reference_it_ran(route, policy, want):
    torch.manual_seed(0)
    model = Upcast().eval()
    source = model if route == "module" else torch.export.export(model, (X,))
    res = precast.convert(source, (X,), policy=policy, dtype=BF16)
    assert res.report.verification["reference"] == want
    assert f"verified against {want}:" in res.report.summary()


def test_policy_none_names_the_unconverted_program():
    torch.manual_seed(0)
    res = precast.convert(torch.export.export(Region().eval(), (X,)))
    assert res.report.verification["reference"] == "the unconverted program"
    assert res.report.verification["bitwise"]


def test_a_dtype_read_fixed_at_export_is_named_once():
    """Policy torch given the fp32 program: one info diagnostic naming the ``.to(input_dtype)`` node and its
    line (not the literal ``.to(torch.float32)`` before it), pointing to the module route; the module route
    itself reads the dtype as eager does and says nothing."""
    torch.manual_seed(0)
    model = RMSNormed().eval()
    ep = torch.export.export(model, (X,))
    res = precast.convert(ep, policy="torch", dtype=BF16)
    found = [d for d in res.report.diagnostics if d.code == "dtype-read-at-export"]
    assert len(found) == 1, res.report.diagnostics
    d = found[0]
    assert d.severity == "info" and d.location.endswith(f":{read_line()}"), d
    assert "v.to(input_dtype)" in d.message and "\n" not in d.message
    assert "precast.convert(model, example_inputs, policy='torch')" in d.fix
    assert res.report.verification["reference"].startswith("the program run under torch.autocast")

    # the module route traces under autocast: the read is bf16 there, as eager reads it
    from_module = precast.convert(model, (X,), policy="torch", dtype=BF16)
    assert not [d for d in from_module.report.diagnostics if d.code == "dtype-read-at-export"]
    assert from_module.report.verification["bitwise"]
    # and the two differ exactly where the read was fixed
    with torch.no_grad():
        assert not torch.equal(res.program.module()(X), from_module.program.module()(X))


@pytest.mark.parametrize("policy", ["torch", None, "rules"])
def test_no_dtype_read_no_diagnostic(policy):
    torch.manual_seed(0)
    ep = torch.export.export(Upcast().eval(), (X,))
    assert dtype_reads_at_export(ep.graph) == []
    res = precast.convert(ep, policy=policy, dtype=BF16 if policy else None)
    assert not [d for d in res.report.diagnostics if d.code == "dtype-read-at-export"]
    # other policies do not look: the diagnostic is about policy torch's reference
    ep_read = torch.export.export(RMSNormed().eval(), (X,))
    if policy != "torch":
        res = precast.convert(ep_read, policy=policy, dtype=BF16 if policy else None)
        assert not [d for d in res.report.diagnostics if d.code == "dtype-read-at-export"]
