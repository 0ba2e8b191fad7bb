"""precast check's metrics on outputs far below 1 (a rules fp16 conversion kept faint ops in fp32)."""

from __future__ import annotations

import pytest
import torch

from precast.metrics import compare_outputs


def test_cosine_of_faint_outputs_measures_direction():
    want = torch.tensor([1e-9, -2e-9, 3e-10])
    (row,) = compare_outputs([want * 1.001], [want])
    assert row["cosine"] == pytest.approx(1.0)
    (row,) = compare_outputs([-want], [want])
    assert row["cosine"] == pytest.approx(-1.0)
    (row,) = compare_outputs([torch.zeros(3)], [want])  # all flushed to zero: no similarity
    assert row["cosine"] == 0.0 and not row["bitwise"]
    (row,) = compare_outputs([torch.zeros(3)], [torch.zeros(3)])
    assert row["cosine"] == 1.0 and row["bitwise"]
