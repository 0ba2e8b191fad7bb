"""Calibration: streaming per-node ranges, odd outputs, and clear errors for bad batches."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.ir.program import Program
from precast.numerics.calibration.checks import TOLERANCE_BATCHES
from precast.numerics.calibration.stage import calibrate
from precast.passes.regions import inline_regions
from precast.policy.measurements import NodeStats


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
        (
            {"y": torch.randn(2, 4), "scale": torch.tensor(1.0)},
            "no input named 'y'; the program's inputs are (x, scale)",
        ),
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


def test_node_stats_counts_subnormal_and_flushed_values():
    s = NodeStats()
    s.update(torch.tensor([1e-9, 1e-6, -2e-8, 1.0, 0.0]), torch.float16)
    # fp16: smallest normal 6.1e-5, smallest subnormal 5.96e-8 (half of it rounds to 0)
    assert (s.count, s.nonzero, s.subnormal, s.flushed) == (5, 4, 3, 2)
    assert torch.tensor([1e-9, -2e-8]).half().eq(0).all() and torch.tensor(1e-6).half() != 0
    s.update(torch.tensor([1e-9, 1e-6]), torch.bfloat16)  # bf16 has fp32's range: nothing subnormal
    assert (s.count, s.nonzero, s.subnormal, s.flushed) == (7, 6, 3, 2)


class Counted:
    """Calibration data that counts how often it is iterated, how many batches were pulled, and how many of the
    batches it made are still alive whenever it makes the next one. It has a length, so it looks re-iterable."""

    def __init__(self, n: int):
        self.n, self.iterations, self.pulled, self.alive_max = n, 0, 0, 0
        self._made: list[weakref.ref] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.iterations += 1
        g = torch.Generator().manual_seed(self.iterations)
        for _ in range(self.n):
            self._made = [r for r in self._made if r() is not None]
            self.alive_max = max(self.alive_max, len(self._made))
            x = torch.randn(4, 8, generator=g)
            self._made.append(weakref.ref(x))
            self.pulled += 1
            yield (x,)
            del x


def sensitive():
    from tests.numerics.test_tolerance_search import model_inputs

    return model_inputs()


@pytest.mark.parametrize("tolerance", [None, {"max_abs": 0.05}], ids=["ranges", "tolerance"])
@pytest.mark.parametrize("one_shot", [False, True], ids=["sized-iterable", "generator"])
def test_calibration_read_once_lazily_with_bounded_memory(tolerance, one_shot):
    """One pass over the data whatever it is; batches are not accumulated (the tolerance search keeps the first
    TOLERANCE_BATCHES); the report says how many batches each step used."""
    model, inputs = sensitive()
    data = Counted(40)
    res = precast.convert(
        model,
        inputs,
        policy="rules",
        dtype=torch.float16,
        calibration=iter(data) if one_shot else data,
        tolerance=tolerance,
    )
    assert data.iterations == 1 and data.pulled == 40
    kept = TOLERANCE_BATCHES if tolerance else 0
    assert data.alive_max <= kept + 2, data.alive_max  # + the batch in flight and the interpreter's last args
    msg = next(d.message for d in res.report.diagnostics if d.code == "calibrated")
    assert "40 batches" in msg
    assert (f"first {TOLERANCE_BATCHES}" in msg) == bool(tolerance)
    if tolerance:
        assert res.report.verification["tolerance"]["achieved"]["max_abs"] <= 0.05
