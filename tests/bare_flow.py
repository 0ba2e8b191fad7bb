"""The README's "Use it" flow in a bare install: run by ``tests/test_bare_install.py`` with the python of a fresh
venv holding only torch and the wheel's declared dependencies, from an empty folder outside the source tree.

Each step prints ``ok <step>``; any failure raises (a traceback, exit status 1). Steps that need an extra check
that it says which one, in one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

MODEL = '''
import torch


class Net(torch.nn.Module):
    """A Linear and a tied Linear in a bf16 region, then an fp32 Linear(64, 8) (an 8-element bias)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.a(x))
        return self.b(h.float())


def factory(batch=4):
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(batch, 64),)
'''


def ok(step: str) -> None:
    print(f"ok {step}", flush=True)


def cli(*args: str, status: int = 0) -> subprocess.CompletedProcess:
    """``precast ARGS`` through the venv's console script; asserts the exit status."""
    exe = Path(sys.executable).with_name("precast")
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == status, (args, proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def one_line_naming(proc: subprocess.CompletedProcess, extra: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'precast[{extra}]'" in lines[0], proc.stderr


def main() -> None:
    here = Path.cwd()
    import precast

    # the installed wheel, not a source tree; and nothing but torch and the declared dependencies
    assert Path(precast.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), precast.__file__
    assert not (here / "precast").exists() and "PYTHONPATH" not in os.environ
    for absent in ("numpy", "openvino", "onnx", "onnxruntime", "executorch", "matplotlib"):
        assert importlib.util.find_spec(absent) is None, f"{absent} is installed in the bare venv"
    ok("bare")

    (here / "mymodel.py").write_text(MODEL)
    sys.path.insert(0, str(here))
    from mymodel import factory

    model, (x,) = factory()
    ep = torch.export.export(model, (x,))
    torch.export.save(ep, "m.pt2")
    torch.save((x,), "x.pt")

    # ---- the command line ----
    assert "precast" in cli("demo").stdout
    ok("cli demo")
    cli("convert", "m.pt2", "-o", "out.pt2")
    ok("cli convert")
    cli("convert", "mymodel:factory", "-o", "out2.pt2", "--policy", "torch")
    ok("cli convert factory")
    assert "fp32" in cli("report", "out.pt2").stdout
    cli("report", "out.pt2", "--format", "json", "-o", "r.json")
    json.loads(Path("r.json").read_text())
    ok("cli report")
    cli("check", "out.pt2", "--inputs", "x.pt")
    ok("cli check")
    cli(
        "sensitivity", "m.pt2", "--inputs", "x.pt", "--dtype", "fp16", "--write-plan", "p.json", "--keep", "1"
    )
    cli("convert", "m.pt2", "-o", "out3.pt2", "--plan", "p.json")
    ok("cli sensitivity")
    built = cli("compile", "out.pt2")  # into the cache, the weights outside the package (as the API compiles)
    assert "compiled in" in built.stderr, built.stderr  # compiled here, in an empty cache
    cli("compile", "out.pt2", "-o", "pkg.pt2")  # a self-contained package: its weights inside
    assert Path("pkg.pt2").stat().st_size > 0
    ok("cli compile")

    # ---- the Python API ----
    res = precast.convert(ep)
    assert "wrap_with_autocast" not in str(res.program.graph)
    res.report.summary()
    s = precast.sensitivity(model, (x,), dtype="fp16")
    res_plan = precast.convert(model, (x,), plan=s.plan(1))
    assert res_plan.program is not None
    ok("api convert, report, sensitivity")
    compiled = precast.compile(res.program)  # the package `precast compile` built: from the cache
    assert compiled.from_cache, "the CLI's compile was not reused"
    assert torch.equal(compiled(x), compiled(x))
    new, _ = factory()
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(-0.5).add_(0.25)
    loaded = compiled.load_weights(new.state_dict())
    assert sorted(loaded["loaded"]) == ["a.bias", "a.weight", "b.bias", "b.weight"], loaded
    want = precast.convert(torch.export.export(new, (x,))).program.module()(x)
    assert (compiled(x) - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    ok("api compile, load_weights")

    # ---- bench: AOTInductor rows measured, the extras' rows name their extra ----
    proc = cli(
        "bench",
        "--model",
        "mymodel:factory",
        "--variant",
        "eager_fp32",
        "precast_aoti",
        "ort_precast",
        "ov_precast",
        "--repeats",
        "3",
        "--no-rss",
        "--out",
        "bench",
    )
    rows = {r["variant"]: r for r in json.loads(Path("bench/bench.json").read_text())["results"]}
    assert rows["precast_aoti"].get("latency_ms") and not rows["precast_aoti"].get("error"), rows[
        "precast_aoti"
    ]
    for variant, extra in (("ort_precast", "onnx"), ("ov_precast", "openvino")):
        assert f"pip install 'precast[{extra}]'" in rows[variant].get("error", ""), (
            rows[variant],
            proc.stdout,
        )
    assert "bench.png not drawn: matplotlib is missing; pip install 'precast[bench]'" in proc.stderr, (
        proc.stderr
    )
    assert sorted(p.name for p in Path("bench").iterdir()) == ["bench.json", "bench.md"]
    ok("cli bench")

    # ---- every extra-backed path says which extra, in one line ----
    one_line_naming(cli("compile", "out.pt2", "--backend", "openvino", "-o", "m.xml", status=2), "openvino")
    one_line_naming(cli("compile", "out.pt2", "--backend", "onnx", "-o", "m.onnx", status=2), "onnx")
    one_line_naming(
        cli("compile", "out.pt2", "--backend", "executorch", "-o", "m.pte", status=2), "executorch"
    )
    cli("report", "out.pt2", "--format", "model-explorer", "-o", "me.json")  # JSON node data: no extra needed
    one_line_naming(
        cli("sensitivity", "m.pt2", "--inputs", "x.pt", "--plot", "s.png", status=2),
        "bench",
    )
    from precast.backends.executorch import export_executorch
    from precast.backends.onnx.export import export_onnx

    for call, extra in (
        (lambda: precast.compile(res.program, backend="openvino"), "openvino"),
        (lambda: export_onnx(res.program, "m.onnx"), "onnx"),
        (lambda: export_executorch(res.program, "m.pte"), "executorch"),
    ):
        try:
            call()
        except precast.PrecastError as exc:
            assert f"pip install 'precast[{extra}]'" in str(exc) and "\n" not in str(exc), exc
        else:
            raise AssertionError(f"the {extra} route ran without its extra")
    ok("extras named")
    assert not [p for p in here.iterdir() if p.name.endswith((".xml", ".onnx", ".pte", ".png"))]
    ok("done")


if __name__ == "__main__":
    main()
