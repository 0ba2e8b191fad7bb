"""Calibration: streaming per-node ranges, odd outputs, and clear errors for bad batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.policy.calibrate import NodeStats, calibrate
from precast.program import Program
from precast.regions import inline_regions


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale):
        h = self.fc(x) * scale  # scale: 0-d tensor
        m, i = h.max(dim=-1)  # tuple output op
        return h.sum(), m, i


def program():
    torch.manual_seed(0)
    ep = torch.export.export(TupleOut().eval(), (torch.randn(2, 4), torch.tensor(2.0)))
    p = Program(ep)
    inline_regions(p.gm)
    return p, ep


def test_node_stats_streaming_zero_dim_and_tuples():
    s = NodeStats()
    s.update(torch.tensor(-3.0))
    s.update((torch.tensor([1.0, float("inf"), float("nan")]), torch.tensor([7])))  # ints ignored
    assert (s.absmax, s.min, s.max, s.nonfinite, s.batches) == (3.0, -3.0, 1.0, 2, 2)


def test_calibrate_many_batches_bounded_state():
    p, ep = program()

    def gen(n):
        for k in range(n):
            yield (torch.full((2, 4), float(k)), torch.tensor(float(k)))

    few = calibrate(p, ep, gen(2), progress=False)
    many = calibrate(p, ep, gen(40), progress=False)
    assert many.batches == 40 and set(many.stats) == set(few.stats)  # one record per node, not per batch
    assert all(isinstance(v, NodeStats) for v in many.stats.values())
    assert many.stats["scale"].absmax == 39.0 and many.stats["scale"].batches == 40
    assert many.stats["sum_1"].absmax > few.stats["sum_1"].absmax
    dicts = calibrate(p, ep, [{"x": torch.randn(2, 4), "scale": torch.tensor(1.0)}], progress=False)
    assert dicts.batches == 1 and math.isfinite(
        dicts.stats["max_1"].absmax if "max_1" in dicts.stats else 0.0
    )


@pytest.mark.parametrize(
    "batch,needle",
    [
        ((torch.randn(2, 4),), "structure"),
        ((torch.randn(2, 4), torch.tensor(1.0), torch.randn(1)), "structure"),
        ({"y": torch.randn(2, 4), "scale": torch.tensor(1.0)}, "structure"),
        ((torch.randn(3, 4), torch.tensor(1.0)), "static size 2 in dim 0"),
        ((torch.randn(2, 4).double(), torch.tensor(1.0)), "float64"),
        ((torch.tensor([[1.0, float("nan"), 0, 0]] * 2), torch.tensor(1.0)), "NaN/inf"),
        ((torch.randn(2, 4), torch.tensor(float("inf"))), "NaN/inf"),
    ],
)
def test_bad_calibration_batches(batch, needle):
    torch.manual_seed(0)
    model, inputs = TupleOut().eval(), (torch.randn(2, 4), torch.tensor(2.0))
    good = (torch.randn(2, 4), torch.tensor(1.0))
    with pytest.raises(PrecastError, match="calibration batch 1") as err:
        precast.convert(model, inputs, policy="rules", dtype=torch.float16, calibration=[good, batch])
    assert needle in str(err.value)


def test_calibration_not_iterable_or_empty():
    model, inputs = TupleOut().eval(), (torch.randn(2, 4), torch.tensor(2.0))
    with pytest.raises(PrecastError, match="iterable of batches"):
        precast.convert(model, inputs, policy="rules", dtype=torch.float16, calibration=torch.randn(2, 4))
    with pytest.raises(PrecastError, match="empty"):
        precast.convert(model, inputs, policy="rules", dtype=torch.float16, calibration=[])
