"""Constant casts: ``cast_constant``'s one-reduction range check keeps the full count's answer (values beyond
the low range clamped and counted, inf and NaN cast as they are), and a ``CastCache`` shared by several lowerings
of one program gives bitwise the lowering without it (stored constants, graph, clamp counts, the ``fp16-clamped``
diagnostic on every lowering) while casting each weight once, and never serves a cast of a tensor written since,
of another tensor or of another dtype."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from precast.ir.diagnostics import DiagnosticLog
from precast.ir.program import Program
from precast.passes import lower
from precast.passes.fold import CastCache, cast_constant
from precast.passes.regions import inline_regions
from tests.helpers import assert_bitwise

FP16, BF16 = torch.float16, torch.bfloat16


def full_count(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The rule, element by element: a finite value beyond the range is the largest finite value of its sign
    (counted); inf, -inf and NaN stay as they are; everything else is the plain cast."""
    limit = torch.finfo(dtype).max
    over = torch.isfinite(value) & (value.abs() > limit)
    plain = value.to(dtype)
    clamped = torch.where(value > 0, limit, -limit).to(dtype)
    return torch.where(over, clamped, plain), int(over.sum().item())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_cast_constant_range_check_keeps_the_full_count():
    inf, nan = float("inf"), float("nan")
    cases = {
        "in range": torch.tensor([1.0, -65504.0, 65504.0, 3e-8]),
        "beyond": torch.tensor([1e6, -7e4, 65505.0, 0.5]),
        "inf": torch.tensor([inf, -inf, 2.0]),
        "inf and beyond": torch.tensor([inf, 1e5, -1e9, 1.0]),
        "nan": torch.tensor([nan, 1.0]),
        "nan and beyond": torch.tensor([nan, 7e4, -inf]),  # the reduction's NaN must not hide the 7e4
        "empty": torch.empty(0, 3),
    }
    for name, value in cases.items():
        for dtype in (FP16, BF16):
            got, count = cast_constant(value, dtype)
            want, want_count = full_count(value, dtype)
            assert same(got, want) and count == want_count, (name, dtype, got, want, count, want_count)
    assert cast_constant(cases["beyond"], FP16)[1] == 3
    assert cast_constant(cases["inf"], FP16)[0].tolist() == [inf, -inf, 2.0]
    # one rule whatever else the tensor holds (issue 33 item 6): inf stays inf beside a finite value that needs
    # the clamp, as it does alone, and the count is the values stored clamped
    got, count = cast_constant(cases["inf and beyond"], FP16)
    assert got.tolist() == [inf, 65504.0, -65504.0, 1.0] and count == 2
    got, count = cast_constant(cases["nan and beyond"], FP16)
    assert count == 1 and got[0].isnan() and got[1:].tolist() == [65504.0, -inf]
    # 65504 < |x| < 65520 rounds to 65504 in a plain cast too: counted as clamped, stored the same
    got, count = cast_constant(torch.tensor([65510.0, -65519.0]), FP16)
    assert got.tolist() == [65504.0, -65504.0] and count == 2


class BigWeights(nn.Module):
    """fp16 regions reading weights beyond fp16's range (clamped when folded), through views, twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.v = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("basis", torch.randn(8, 8))
        with torch.no_grad():
            self.w[0, 0], self.w[1, 1] = 1e6, -7e4

    def forward(self, x):
        with torch.autocast("cpu", dtype=FP16):
            h = F.linear(x, self.w) + x @ self.w.t()
            h = F.linear(h, self.v) @ self.basis
        return h.float()


def lowered(ep, casts: CastCache | None) -> tuple[Program, DiagnosticLog]:
    program = Program(ep)
    inline_regions(program.gm)
    log = DiagnosticLog()
    lower(program, None, log, casts=casts)
    program.gm.recompile()
    return program, log


def assert_same_lowering(a: tuple[Program, DiagnosticLog], b: tuple[Program, DiagnosticLog]) -> None:
    (pa, la), (pb, lb) = a, b
    assert pa.gm.code == pb.gm.code
    assert sorted(pa.state_dict) == sorted(pb.state_dict) and sorted(pa.constants) == sorted(pb.constants)
    for store_a, store_b in ((pa.state_dict, pb.state_dict), (pa.constants, pb.constants)):
        for k in store_a:
            assert_bitwise(store_a[k], store_b[k])
    assert pa.sources == pb.sources
    assert [(d.code, d.message) for d in la.diagnostics] == [(d.code, d.message) for d in lb.diagnostics]


def test_lowerings_with_a_shared_cast_cache_are_bitwise_the_same():
    model = BigWeights().eval()
    ep = torch.export.export(model, (torch.randn(2, 8),))
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    plain = lowered(ep, None)
    cache = CastCache()
    first = lowered(ep, cache)
    assert cache.hits == 0
    second = lowered(ep, cache)
    assert cache.hits == 3  # w, v and basis: each cast once for both lowerings
    assert_same_lowering(first, plain)
    assert_same_lowering(second, plain)
    for program, log in (plain, first, second):
        assert program.state_dict["w"].dtype == FP16 and program.state_dict["w"][0, 0].item() == 65504
        clamped = [d.message for d in log.diagnostics if d.code == "fp16-clamped"]
        assert len(clamped) == 1 and "constant w: 2 value(s)" in clamped[0]
    # the programs share the cast tensors, never the caller's: its weights are untouched
    assert all(torch.equal(before[k], v) for k, v in ep.state_dict.items())


def test_cast_cache_never_serves_a_stale_cast():
    cache = CastCache()
    w = torch.tensor([1.0, 7e4, -2.0])
    a, count = cache.cast(w, FP16)
    assert count == 1 and a[1].item() == 65504
    assert cache.cast(w, FP16)[0] is a and cache.hits == 1
    # another dtype: its own cast
    b, count = cache.cast(w, BF16)
    assert b.dtype == BF16 and count == 0 and cache.hits == 1
    # written in place since: cast again (the version counter moved)
    with torch.no_grad():
        w[1] = 3.0
    c, count = cache.cast(w, FP16)
    assert count == 0 and c.tolist() == [1.0, 3.0, -2.0] and cache.hits == 1
    # another tensor with the same values is another key; the cache holds its sources, so ids stay unique
    other = w.clone()
    d, _ = cache.cast(other, FP16)
    assert d is not c and cache.hits == 1
    # its storage swapped under the same object (``.data =`` keeps the version counter): cast again
    w.data = torch.tensor([5.0, 1e6, 0.0])
    e, count = cache.cast(w, FP16)
    assert count == 1 and e.tolist() == [5.0, 65504.0, 0.0] and cache.hits == 1
