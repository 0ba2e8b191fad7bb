"""``precast.weight_sensitivity``: every option honoured or refused in one line; the README's call of the
``precast.sensitivity(..., weight_formats=...)`` shortcut on the LLM recipe's program (keyword inputs) runs."""

from __future__ import annotations

import pytest
import torch

import precast
import precast.quant.sensitivity as ws
from precast.errors import PrecastError


def _batch(start: int, n: int = 6) -> dict:
    ids = (torch.arange(start, start + n) * 7 % 96)[None]
    return {"input_ids": ids, "cache_position": torch.arange(n)}


def test_the_readmes_call_on_the_recipes_program(recipe_program):
    """Batches are dicts of the program's keyword inputs (``input_ids``, ``cache_position``): before, the measured
    conversions ran them positionally and died with torch's raw "kwarg keyword mismatch"."""
    with pytest.warns(FutureWarning, match=r"precast\.weight_sensitivity"):
        s = precast.sensitivity(
            recipe_program,
            _batch(0),
            policy="torch",
            weight_formats=("int4", "int8"),
            data=[_batch(1), _batch(2)],
            evaluate=[_batch(3)],
            measure_bits=(6.0,),
            probes=2,
        )
    cheapest, six, everything = s.curve
    assert cheapest.formats == {"int4-g64": 8} and everything.formats == {"float": 8}
    assert cheapest.bytes < six.bytes <= 6.0 * s.elements / 8 < everything.bytes
    # the one CurvePoint: measured is the estimate's metric (kld), metrics every measured one
    assert cheapest.measured == cheapest.metrics["kld"] > everything.measured >= 0
    assert {"kld", "top1", "weight_bytes"} <= set(cheapest.metrics)
    assert s.to_dict()["curve"][0]["measured"] == cheapest.measured


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"metric": "rel"}, r"metric='rel': choose 'kld' or 'mse'"),  # before: silently "kld"
        ({"metric": "cosine"}, r"metric='cosine': choose 'kld' or 'mse'"),
        ({"repro": "/tmp/x"}, r"repro=: the op ranking's options; weight sensitivity takes none"),
        ({"group": object()}, r"group=: the op ranking's options"),
        ({"energies": object()}, r"energies=: the op ranking's options"),
        ({"device_type": "tpu"}, r"device_type='tpu'"),  # before: ignored
    ],
)
def test_options_weight_sensitivity_cannot_honour_are_one_line(recipe_program, kwargs, message):
    with pytest.raises(PrecastError, match=message) as err:
        precast.sensitivity(recipe_program, _batch(0), weight_formats=("int4",), data=[_batch(1)], **kwargs)
    assert "\n" not in str(err.value)


def test_an_ablation_format_not_measured_is_one_line(recipe_program):
    with pytest.raises(PrecastError, match=r"ablation_format='int8-asym': give one of the formats measured"):
        precast.weight_sensitivity(
            recipe_program,
            _batch(0),
            data=[_batch(1)],
            formats=("int4",),
            ablation=True,
            ablation_format="int8-asym",
        )


def test_device_type_and_dynamic_shapes_are_honoured(monkeypatch):
    """``dynamic_shapes`` reaches the capture of a module (evaluation batches of another length run: before, the
    module was captured static and they failed) and every measured conversion, with ``device_type``."""
    seen = []
    real = ws.convert_with

    def spy(source, inputs, options):
        seen.append((options.device_type, options.dynamic_shapes))
        return real(source, inputs, options)

    monkeypatch.setattr(ws, "convert_with", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    x = torch.randn(4, 64)
    batch = torch.export.Dim("batch", min=2, max=16)
    shapes = ({0: batch},)
    s = precast.weight_sensitivity(
        model,
        (x,),
        data=[(torch.randn(4, 64),)],
        formats=("int8",),
        policy="torch",
        device_type="cpu",
        dynamic_shapes=shapes,
        metric="mse",
        probes=1,
        evaluate=[(torch.randn(8, 64),)],  # another batch size than the capture's
    )
    assert len(s.curve) == 2 and seen == [("cpu", shapes)] * 2
    assert s.curve[0].measured is None  # mse is the estimate's metric; the curve measures next-token metrics
