"""``precast.sensitivity`` ranks ops (issue 51 item 4): every option is honoured or refused in one line, before
anything is captured. Weight sensitivity's own options (``evaluate``, ``measure_bits``, ``probes``) given to the op
ranking, a process group without the data it would sum, a policy whose tolerance the ranking would drop, and
values of the wrong type were ignored, or failed inside Python, before."""

from __future__ import annotations

import pytest
import torch

import precast
from precast.errors import PrecastError

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)).eval()


@pytest.mark.parametrize(
    "given, message",
    [
        ({"probes": 4}, "probes=: weight sensitivity's options, and this call ranks ops"),
        ({"measure_bits": (4.5,)}, "measure_bits=: weight sensitivity's options"),
        ({"evaluate": [(X,)], "probes": 2}, "evaluate=, probes=: weight sensitivity's options"),
        ({"group": object()}, "group= sums the energies each rank measures on its data=: give data="),
        ({"repro": 3}, "repro=3: give the folder"),
        ({"ablation": "yes"}, "ablation='yes': give True"),
        ({"measure_points": True}, "measure_points=True: give 0, 1, 2 or 3"),
        ({"metric": "kld"}, "metric='kld': choose rel, cosine, max_abs"),
        ({"device_type": "tpu"}, "device_type='tpu'"),
        (
            {"policy": precast.RulesPolicy(tolerance={"rel": 1e-3})},
            r"RulesPolicy\(tolerance=...\): sensitivity ranks every op the policy runs low",
        ),
    ],
)
def test_an_option_the_op_ranking_cannot_honour_is_refused_before_capture(given, message, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the options were checked")

    monkeypatch.setattr("precast.pipeline.conversion.capture", no_capture)
    pattern = message if "\\(" in message else message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(PrecastError, match=pattern) as e:
        precast.sensitivity(model(), (X,), **given)
    assert "\n" not in str(e.value)


def test_the_options_it_takes_are_honoured():
    """The same ranking with the defaults spelled out; ``measure_points`` decides how many curve points run."""
    m = model()
    plain = precast.sensitivity(m, (X,), measure_points=0)
    spelled = precast.sensitivity(
        m, (X,), measure_points=0, probes=8, measure_bits=(), evaluate=None, group=False
    )
    assert [o.name for o in plain.ops] == [o.name for o in spelled.ops]
    assert [p.estimate for p in plain.estimate.curve] == [p.estimate for p in spelled.estimate.curve]
    assert [p.k for p in plain.estimate.curve if p.measured is not None] == [0]
    two = precast.sensitivity(m, (X,), measure_points=2)
    assert len([p for p in two.estimate.curve if p.measured is not None]) > 1
