"""Inputs keyed by the forward's own argument names (``forward(self, X, Mask)`` -> ``{"X": t, "Mask": m}``), as
ModelOpt keys its calibration files: accepted by ``calibration=`` and ``precast check --inputs``, besides
export's lowercased placeholder names; a wrong name is one error listing the names the program takes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import precast
from precast.cli import main
from precast.errors import PrecastError
from precast.ir.inputs import bind_inputs, input_names

FP16 = torch.float16


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, X, Mask, Scale_2=None):
        out = self.fc(X) * Mask
        return out if Scale_2 is None else out * Scale_2


def batch(seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"X": torch.randn(4, 8, generator=g) * scale, "Mask": torch.ones(4, 8)}


def exported():
    torch.manual_seed(0)
    b = batch(0)
    return Masked().eval(), torch.export.export(Masked().eval(), (b["X"], b["Mask"]))


def test_input_names_are_the_forwards_own():
    _, ep = exported()
    assert input_names(ep) == (["X", "Mask"], [])
    assert [s.arg.name for s in ep.graph_signature.input_specs][-2:] == ["x", "mask"]  # export lowercases
    kw = torch.export.export(
        Masked(), (torch.randn(4, 8),), {"Mask": torch.ones(4, 8), "Scale_2": torch.ones(())}
    )
    assert input_names(kw) == (["X"], ["Mask", "Scale_2"])


@pytest.mark.parametrize(
    "keys",
    [("X", "Mask"), ("x", "mask"), ("Mask", "X"), ("x", "Mask")],
    ids=["forward-names", "export-names", "other-order", "mixed"],
)
def test_calibration_dicts_keyed_by_argument_names(keys):
    model, ep = exported()
    by_name = {k.lower(): k for k in keys}
    cal = [{by_name["x"]: b["X"], by_name["mask"]: b["Mask"]} for b in (batch(1, 1e3), batch(2))]
    res = precast.convert(ep, policy="rules", dtype=FP16, calibration=cal)
    rec = res.report.node("linear")
    assert rec.dtype == "fp32" and rec.rule == "data_max"  # the 1e3-scaled batch was seen
    assert any(d.code == "calibrated" and "2 batches" in d.message for d in res.report.diagnostics)


def test_keyword_exported_program_takes_named_batches():
    torch.manual_seed(0)
    x, m, s = torch.randn(4, 8), torch.ones(4, 8), torch.tensor(2.0)
    ep = torch.export.export(Masked().eval(), (x,), {"Mask": m, "Scale_2": s})
    args, kwargs = bind_inputs(ep, {"scale_2": s, "X": x, "mask": m}, "here")
    assert args == (x,) and list(kwargs) == ["Mask", "Scale_2"]
    res = precast.convert(
        ep, policy="rules", dtype=FP16, calibration=[{"X": x * 1e3, "Mask": m, "Scale_2": s}]
    )
    assert res.report.node("linear").rule == "data_max"


@pytest.mark.parametrize(
    "given,needle",
    [
        ({"X": 1, "Maks": 2}, "no input named 'Maks'; the program's inputs are (X, Mask)"),
        ({"X": 1}, "no value for input(s) Mask; the program's inputs are (X, Mask)"),
        ({"X": 1, "x": 2, "Mask": 3}, "input 'X' is given twice"),
    ],
)
def test_wrong_names_are_one_clear_error(given, needle):
    _, ep = exported()
    with pytest.raises(PrecastError) as err:
        bind_inputs(ep, given, "calibration batch 0")
    assert str(err.value).startswith("calibration batch 0: ") and needle in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(PrecastError, match=r"calibration batch 1: no input named 'Y'.*\(X, Mask\)"):
        precast.convert(ep, policy="rules", dtype=FP16, calibration=[batch(1), {"Y": torch.ones(4, 8)}])


@pytest.mark.parametrize("keys", [("X", "Mask"), ("x", "mask")])
def test_check_inputs_keyed_by_argument_names(tmp_path, capsys, keys):
    model, ep = exported()
    res = precast.convert(ep, policy="rules", dtype=torch.bfloat16)
    prog = tmp_path / "p.pt2"
    torch.export.save(res.program, str(prog))
    b = batch(3)
    torch.save(dict(zip(keys, (b["X"], b["Mask"]), strict=True)), tmp_path / "named.pt")
    assert main(["check", str(prog), "--inputs", str(tmp_path / "named.pt"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert row["shape"] == [4, 8] and row["cosine"] > 0.99
    torch.save({"X": b["X"], "Y": b["Mask"]}, tmp_path / "bad.pt")
    assert main(["check", str(prog), "--inputs", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err
    assert "bad.pt: no input named 'Y'; the program's inputs are (X, Mask)" in err and err.count("\n") == 1


def test_check_inputs_of_the_wrong_structure_are_one_clear_error(tmp_path, capsys):
    _, ep = exported()
    prog = tmp_path / "p.pt2"
    torch.export.save(ep, str(prog))
    torch.save((torch.randn(4, 8),), tmp_path / "one.pt")
    assert main(["check", str(prog), "--inputs", str(tmp_path / "one.pt")]) == 2
    err = capsys.readouterr().err
    assert (
        "one.pt: its structure (1 positional input(s)) does not match the program's inputs (X, Mask)" in err
    )
    assert err.count("\n") == 1


def test_dataloader_of_named_samples():
    """A DataLoader over samples keyed by argument name: collated into {"X": [4, 8], "Mask": [4, 8]} batches."""
    from torch.utils.data import DataLoader

    _, ep = exported()
    g = torch.Generator().manual_seed(5)
    samples = [
        {"X": torch.randn(8, generator=g) * (1e3 if i == 5 else 1.0), "Mask": torch.ones(8)}
        for i in range(12)
    ]
    res = precast.convert(ep, policy="rules", dtype=FP16, calibration=DataLoader(samples, batch_size=4))
    assert res.report.node("linear").rule == "data_max"  # the large sample sits in the second batch
    assert any(d.code == "calibrated" and "3 batches" in d.message for d in res.report.diagnostics)
