"""CLI: bad input gives one line on stderr, exit status 2, no traceback and no output file; good input works.

Bad-input commands run as real subprocesses (``sys.executable -m precast``), started together to keep it fast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import torch

import precast
from precast.cli import main
from tests import models as zoo

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model, inputs = zoo.seed_model()
    res = precast.convert(model, inputs)
    good = d / "good.pt2"
    torch.export.save(res.program, str(good))
    raw = d / "raw.pt2"
    torch.export.save(torch.export.export(model, inputs), str(raw))
    (d / "text.pt2").write_text("not a program\n")
    other = d / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("hello.txt", "a zip, but not a saved program")
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as z:  # flip bytes inside the largest stored member: its CRC no longer matches
        big = max(z.infolist(), key=lambda i: i.compress_size)
        start = big.header_offset + 30 + len(big.filename.encode()) + len(big.extra)
    for i in range(start + 10, start + 60):
        data[i] ^= 0xFF
    (d / "corrupt.pt2").write_bytes(bytes(data))
    torch.save((torch.randn(4, 128),), d / "inputs.pt")
    return d


# run as subprocesses: name -> (argv, output file that must not exist afterwards)
BAD = {
    "convert-missing": (["convert", "{d}/nope.pt2", "-o", "{d}/out1.pt2"], "out1.pt2"),
    "convert-corrupt": (["convert", "{d}/corrupt.pt2", "-o", "{d}/out4.pt2"], "out4.pt2"),
    "convert-bad-factory": (["convert", "no_such_pkg.models:make", "-o", "{d}/out5.pt2"], "out5.pt2"),
    "convert-dtype-mismatch": (
        ["convert", "tests.cli.test_cli:broken_seed", "-o", "{d}/out7.pt2"],
        "out7.pt2",
    ),
}
# run in-process through precast.cli.main (same code path, no interpreter start-up)
BAD_INPROCESS = {
    "convert-unwritable": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/no/such/dir/out.pt2"],
        "no/such/dir/out.pt2",
    ),
    "convert-not-program": (["convert", "{d}/other.pt2", "-o", "{d}/out3.pt2"], "out3.pt2"),
    "convert-text": (["convert", "{d}/text.pt2", "-o", "{d}/out2.pt2"], "out2.pt2"),
    "convert-output-is-dir": (["convert", "{d}/raw.pt2", "-o", "{d}"], None),
    "convert-bad-attr": (["convert", "precast.examples:no_such_factory", "-o", "{d}/out6.pt2"], "out6.pt2"),
    "report-missing": (["report", "{d}/nope.pt2"], None),
    "report-not-program": (["report", "{d}/other.pt2"], None),
    "report-corrupt": (["report", "{d}/corrupt.pt2", "--format", "json", "-o", "{d}/r1.json"], "r1.json"),
    "report-unwritable": (["report", "{d}/good.pt2", "-o", "{d}/no/such/r.json"], "no/such/r.json"),
    "check-not-program": (["check", "{d}/text.pt2"], None),
    "check-missing-inputs": (["check", "{d}/good.pt2", "--inputs", "{d}/nope.pt"], None),
    "check-bad-inputs": (["check", "{d}/good.pt2", "--inputs", "{d}/text.pt2"], None),
}


def broken_seed():
    torch.manual_seed(0)
    return zoo.SeedModel(fixed=False).eval(), (torch.randn(4, 128),)


@pytest.fixture(scope="module")
def bad_runs(files):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for name, (argv, _) in BAD.items():
        cmd = [sys.executable, "-m", "precast", *[a.format(d=files) for a in argv]]
        procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return {name: (p.wait(timeout=120), *p.communicate()) for name, p in procs.items()}


def _check_bad(table, name, rc, out, err, files):
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"precast {table[name][0][0]}: error: ")
    leftover = table[name][1]
    if leftover:
        assert not (files / leftover).exists()
    assert not [p for p in files.rglob(".*.tmp")]  # no temporary file left either


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_subprocess(name, bad_runs, files):
    _check_bad(BAD, name, *bad_runs[name], files)


@pytest.mark.parametrize("name", list(BAD_INPROCESS))
def test_bad_input_in_process(name, files, capfd):
    rc = main([a.format(d=files) for a in BAD_INPROCESS[name][0]])
    out, err = capfd.readouterr()
    _check_bad(BAD_INPROCESS, name, rc, out, err, files)


def test_dtype_mismatch_line_names_node_and_fix(bad_runs):
    err = bad_runs["convert-dtype-mismatch"][2]
    assert "module output" in err and ".float()" in err and "--allow dtype-mismatch" in err


def test_convert_allow_flag(files, capsys):
    out = files / "allowed.pt2"
    rc = main(
        [
            "convert",
            "tests.cli.test_cli:broken_seed",
            "-o",
            str(out),
            "--allow",
            "dtype-mismatch",
            "--no-verify",
        ]
    )
    assert rc == 0 and out.exists()
    assert "warning" in capsys.readouterr().out


def test_report_json_validates(files, capsys):
    assert main(["report", str(files / "good.pt2"), "--format", "json"]) == 0
    schema = json.loads((ROOT / "docs" / "report.schema.json").read_text())
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, schema)
    assert data["casts_runtime"] == 2


def test_report_table_and_model_explorer_file(files, capsys):
    assert main(["report", str(files / "good.pt2"), "--width", "160"]) == 0
    text = capsys.readouterr().out
    assert "sub.linear1" in text and "linear_2" in text and "bf16" in text
    target = files / "me.json"
    assert main(["report", str(files / "good.pt2"), "--format", "model-explorer", "-o", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["graph"]["results"]["linear"]["value"] == 16


def test_check_reports_metrics_per_output(files, capsys):
    assert main(["check", str(files / "good.pt2"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert not row["bitwise"] and 0 < row["max_abs"] < 0.05 and row["cosine"] > 0.999
    assert main(["check", str(files / "good.pt2"), "--inputs", str(files / "inputs.pt")]) == 0
    assert "max rel" in capsys.readouterr().out


def test_check_unconverted_program_is_bitwise(files, capsys):
    assert main(["check", str(files / "raw.pt2"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    # the unconverted program keeps its autocast region: fp32 reference drops it -> not bitwise either;
    # a program without regions is its own reference
    assert row["cosine"] > 0.999


def test_check_fp32_reference_restores_weights(files):
    from precast.cli.check import fp32_reference

    ep = torch.export.load(str(files / "good.pt2"))
    ref = fp32_reference(ep)
    assert all(p.dtype == torch.float32 for p in ref.parameters())
    model, (x,) = zoo.seed_model()
    with torch.no_grad():
        # same graph in fp32 with bf16-rounded weights: close to the original fp32 model
        assert torch.allclose(
            ref(x),
            model.sub.linear2(torch.relu(model.sub.linear1(x))) @ model.output.weight.T + model.output.bias,
            atol=0.05,
        )


def test_convert_rules_flags_with_calibration_file(tmp_path, capsys):
    """--policy rules with --data-max and a torch.save'd calibration list: the op that overflows stays fp32."""
    from precast.cli import main

    model, inputs = zoo.plain_mlp()  # no regions of its own: the rules decide every op
    ep = torch.export.export(model, inputs)
    src, out, cal = tmp_path / "in.pt2", tmp_path / "out.pt2", tmp_path / "cal.pt"
    torch.export.save(ep, str(src))
    torch.save([inputs, (torch.randn(4, 64),)], cal)
    code = main(
        [
            "convert",
            str(src),
            "-o",
            str(out),
            "--policy",
            "rules",
            "--dtype",
            "fp16",
            "--data-max",
            "1e-3",
            "--calibration",
            str(cal),
            "--json",
        ]
    )
    assert code == 0 and out.exists()
    rep = precast.report(torch.export.load(str(out)))
    linears = [n for n in rep.nodes if n.op == "aten.linear.default"]
    assert linears and all(n.dtype == "fp32" and n.rule == "data_max" for n in linears)

    bad = tmp_path / "bad.pt"
    torch.save({"not": "a list"}, bad)
    out2 = tmp_path / "out2.pt2"
    code = main(["convert", str(src), "-o", str(out2), "--policy", "rules", "--calibration", str(bad)])
    assert code == 2 and not out2.exists()
    assert "expected a non-empty list of input tuples" in capsys.readouterr().err


# ---- options checked before anything is loaded -----------------------------------------------------------------

EARLY = {
    "dtype": (["convert", "{d}/raw.pt2", "-o", "{d}/e1.pt2", "--dtype", "int8"], "--dtype int8"),
    "policy": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e2.pt2", "--policy", "fastest"],
        "invalid choice: 'fastest'",
    ),
    "data-max-negative": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e3.pt2", "--policy", "rules", "--data-max", "-1"],
        "--data-max=-1.0",
    ),
    "data-max-nan": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e4.pt2", "--policy", "rules", "--data-max", "nan"],
        "--data-max=nan",
    ),
    "data-max-not-number": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e5.pt2", "--policy", "rules", "--data-max", "big"],
        "invalid float value",
    ),
    "depth": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e6.pt2", "--policy", "rules", "--max-reduction-depth", "0"],
        "--max-reduction-depth=0",
    ),
    "regex": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e7.pt2", "--policy", "rules", "--exclude-nodes", "("],
        "--exclude-nodes: '(' is not a valid regular expression",
    ),
    "op": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e8.pt2", "--policy", "rules", "--include-ops", "no_such_op"],
        "--include-ops: no op named 'no_such_op'",
    ),
    "pattern": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e9.pt2", "--policy", "rules", "--patterns", "angles"],
        "--patterns: unknown 'angles'",
    ),
    "rules-only": (["convert", "{d}/raw.pt2", "-o", "{d}/e10.pt2", "--data-max", "5"], "need --policy rules"),
    "calibration-missing": (
        ["convert", "{d}/raw.pt2", "-o", "{d}/e11.pt2", "--policy", "rules", "--calibration", "{d}/no.pt"],
        "--calibration",
    ),
    "allow": (["convert", "{d}/raw.pt2", "-o", "{d}/e12.pt2", "--allow", "nope"], "--allow nope: unknown"),
    "factory-spec": (["convert", "bad-spec:x.y", "-o", "{d}/e13.pt2"], "package.module:factory"),
    "zip-not-program": (["convert", "{d}/other.pt2", "-o", "{d}/e14.pt2"], "not one torch.export.save wrote"),
    "check-zip-not-program": (["check", "{d}/other.pt2"], "not one torch.export.save wrote"),
    "check-inputs-missing": (["check", "{d}/good.pt2", "--inputs", "{d}/no.pt"], "--inputs"),
}


@pytest.mark.parametrize("name", list(EARLY))
def test_options_rejected_before_loading(name, files, capfd, monkeypatch):
    """A bad option is one line and status 2 before any program is loaded or factory imported (loading a
    real model takes seconds); no message points at warnings the CLI hides."""
    import precast.pipeline.load

    def no_load(*args, **kwargs):
        raise AssertionError("loaded before the options were checked")

    for fn in ("load_program", "load_factory", "load_saved"):
        monkeypatch.setattr(precast.pipeline.load, fn, no_load)
    argv, needle = EARLY[name]
    with (
        pytest.raises(SystemExit)
        if name in ("policy", "data-max-not-number")
        else contextlib.nullcontext() as ex
    ):
        rc = main([a.format(d=files) for a in argv])
    rc = ex.value.code if ex is not None else rc
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"precast {argv[0]}: error: ") and needle in lines[0], lines[0]
    assert "warnings above" not in err and "Traceback" not in err
    assert not list(files.glob("e*.pt2"))


# ---- check: the fp32 reference of a program with regions ------------------------------------------------------


class MadeLowInRegion(torch.nn.Module):
    """Inside its region the forward creates bf16 tensors itself (a constant matrix, an integer mask cast to
    bf16): the fp32 reference must create them in fp32, or its fp32 matmul meets a bf16 operand."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc(x) * mask.to(torch.bfloat16)
            h = h @ torch.eye(8, dtype=torch.bfloat16)
        return h.float()


def test_check_reference_of_tensors_made_low_in_a_region(tmp_path, capsys):
    from precast.cli.check import fp32_reference

    torch.manual_seed(0)
    model = MadeLowInRegion().eval()
    inputs = (torch.randn(2, 8), torch.randint(0, 2, (2, 8)))
    path = tmp_path / "made_low.pt2"
    torch.export.save(precast.convert(model, inputs).program, str(path))
    assert main(["check", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert row["cosine"] > 0.999 and not row["bitwise"]
    with torch.no_grad():  # the model with precision taken out: fp32 throughout, on the stored weights
        ref = fp32_reference(torch.export.load(str(path)))(*inputs)
        w, b = (t.to(torch.bfloat16).float() for t in (model.fc.weight, model.fc.bias))  # as stored
        want = (torch.nn.functional.linear(inputs[0], w, b) * inputs[1]) @ torch.eye(8)
    assert torch.allclose(ref, want, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_check_t5_with_region(tmp_path, capsys):
    """transformers' T5 run in a bf16 region (policy None): its position bias and mask are made in bf16 inside
    the region; `precast check` used to fail running its fp32 reference."""
    import transformers

    from tests.realmodels.builders import t5

    transformers.logging.set_verbosity_error()
    built = t5()
    model, inputs = built.make(True), built.inputs[2]
    path = tmp_path / "t5.pt2"
    torch.export.save(precast.convert(torch.export.export(model, inputs)).program, str(path))
    assert main(["check", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert row["cosine"] > 0.999


def test_demo_catches_the_bug_then_converts_the_fix_bitwise(capsys):
    """README's first command: the seed's model fails at conversion with the one-line error, the corrected model
    converts, and the converted program is bitwise the unconverted one with no weight casts left per forward."""
    assert main(["demo", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "precast stops at conversion" in out and "[dtype-mismatch;" in out and "node 'linear_2'" in out
    assert "outputs bitwise equal: True" in out
    assert "verified against the unconverted program: bitwise equal" in out
    assert "weight casts per forward (decomposed graph): 4 -> 0" in out
