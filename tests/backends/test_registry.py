"""The engine registry (``precast.backends.registry``): every engine listed once, each option refused in one line,
and for every installed engine ``precast.compile`` -> ``precast.save`` -> ``precast.load`` round trips: the
loaded model's outputs equal the compiled model's bitwise (the same artifact, the same runtime), and both are
within a stated tolerance of the program run by torch.

Tolerance against the program: an fp16 MLP (64 -> 32 -> 10) compiled by another engine sums its products in
another order and may keep fp32 accumulators where torch rounds to fp16 between ops; the difference is a few fp16
ulps of the outputs (|y| < 4 here): atol 2e-3 + rtol 1e-2 (measured: 8e-5 ONNX Runtime and OpenVINO, 4e-4
ExecuTorch's portable kernels).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

import precast
from precast.backends import registry
from precast.errors import PrecastError
from tests import models as zoo

ATOL, RTOL = 2e-3, 1e-2


def installed(name: str) -> bool:
    return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in registry.engine(name).modules)


@pytest.fixture(scope="module")
def fp16():
    """An fp16 MLP program every engine runs (ONNX Runtime's CPU provider has no bf16 MatMul), its inputs and its
    outputs under torch."""
    model, inputs = zoo.plain_mlp()
    program = precast.convert(model, inputs, policy="torch", dtype=torch.float16).program
    return program, inputs, program.module()(*inputs)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ---- the list ------------------------------------------------------------------------------------------------
def test_every_engine_is_listed_once():
    """One record per engine folder or module under backends/ (tests/arch's ENGINES), each name, suffix and
    compile/save/load given; the stateful ones are what precast generate offers."""
    from precast.cli.generate import BACKENDS as GENERATE
    from tests.arch.test_layers import ENGINES as FOLDERS

    assert registry.NAMES == ("aoti", "openvino", "onnx", "executorch")
    assert set(registry.NAMES) == set(FOLDERS)
    assert len({e.suffix for e in registry.ENGINES}) == len(registry.ENGINES)
    for e in registry.ENGINES:
        assert {"compile", "save", "load"} <= set(e.functions), e.name
        assert e.options and e.title and e.summary, e.name
    assert registry.stateful_names() == ("aoti", "openvino")
    assert GENERATE == ("aoti", "openvino", "eager")


def test_cli_compile_offers_every_engine():
    from precast.cli import build_parser

    parser = build_parser()
    compile_ = parser._subparsers._group_actions[0].choices["compile"]
    (backend,) = [a for a in compile_._actions if "--backend" in a.option_strings]
    assert tuple(backend.choices) == registry.NAMES


@pytest.mark.parametrize(
    "backend, options, message",
    [
        ("onnx", {"mode": "default"}, "mode= applies to backend='aoti' only; drop it for backend='onnx'"),
        ("openvino", {"cache_dir": "/tmp"}, "cache_dir= applies to backend='aoti' only"),
        ("executorch", {"threads": 2}, "threads= applies to backend='aoti' or 'openvino' or 'onnx' only"),
        ("aoti", {"precision_hint": "f32"}, "precision_hint= applies to backend='openvino' only"),
        ("onnx", {"colour": 1}, "colour= is not an option of backend='onnx'; its options: dynamic, threads"),
        ("tensorrt", {}, "backend='tensorrt'; choose one of aoti, openvino, onnx, executorch"),
    ],
)
def test_options_are_refused_in_one_line(fp16, backend, options, message):
    """Refused before anything compiles or imports the engine: one line naming the engines that take it."""
    program, _, _ = fp16
    with pytest.raises(PrecastError) as exc:
        precast.compile(program, backend=backend, **options)
    assert message in one_line(exc)


def test_a_missing_extra_is_one_line_naming_it(fp16, monkeypatch):
    program, _, _ = fp16
    for name, package in (
        ("onnx", "onnxruntime"),
        ("executorch", "executorch.runtime"),
        ("openvino", "openvino"),
    ):
        monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
        with pytest.raises(PrecastError) as exc:
            registry.engine(name).require()
        # the first of the extra's packages that is missing is named: ``package``, or an earlier one where the
        # lane lacks the extra altogether (the latest lane has no executorch)
        missing = one_line(exc).split(": ", 1)[1].split(" is not installed", 1)[0]
        assert missing in registry.engine(name).modules, one_line(exc)
        assert f"{missing} is not installed; pip install 'precast[{name}]'" in one_line(exc)
    with pytest.raises(PrecastError) as exc:
        precast.compile(program, backend="onnx")
    assert "pip install 'precast[onnx]'" in one_line(exc)


# ---- compile -> save -> load -------------------------------------------------------------------------------
def _round_trip(model, program_out, inputs, path):
    got = model(*inputs)
    torch.testing.assert_close(got, program_out, atol=ATOL, rtol=RTOL)
    record = precast.save(model, path)
    assert json.loads(registry.record_path(path).read_text()) == json.loads(json.dumps(record))
    loaded = precast.load(path)
    assert torch.equal(loaded(*inputs), got)  # the same artifact in the same runtime: bitwise
    return loaded


@pytest.mark.parametrize("name", ["onnx", "executorch", "openvino"])
def test_round_trip(fp16, tmp_path, name):
    """precast.compile(backend=name) (fails on the code before the registry for onnx and executorch: not
    targets), saved, loaded by its record; a call that does not fit the signature is one line before the runtime."""
    if not installed(name):
        pytest.skip(f"{name} not installed ({registry.engine(name).install()})")
    program, inputs, want = fp16
    model = precast.compile(program, backend=name, saving=True)
    assert registry.owner(model).name == name
    path = tmp_path / f"m{registry.engine(name).suffix}"
    loaded = _round_trip(model, want, inputs, path)
    assert registry.owner(loaded).name == name
    for m in (model, loaded):
        with pytest.raises(PrecastError) as exc:
            m(torch.randn(4, 63))
        assert "63" in one_line(exc)


def test_onnx_runs_a_dynamic_batch(fp16):
    """The ONNX target re-exports with a dynamic batch (as precast.compile's AOTInductor does): batch 3 runs and
    matches the program's outputs on the same rows."""
    if not installed("onnx"):
        pytest.skip("onnx not installed")
    program, inputs, want = fp16  # the program itself is static (batch 4); an MLP's rows are independent
    model = precast.compile(program, backend="onnx")
    torch.testing.assert_close(model(inputs[0][:3]), want[:3], atol=ATOL, rtol=RTOL)


@pytest.mark.aoti
def test_aoti_round_trip(converted_a, compiled_a, compiled_a_in_so, tmp_path):
    """The package with its weights inside saves and loads (the same package: bitwise); one whose weights live
    outside it is refused in one line; a record from another torch is refused on load."""
    _, inputs, res = converted_a
    path = tmp_path / "m.pt2"
    loaded = _round_trip(compiled_a_in_so, compiled_a(*inputs), inputs, path)
    assert loaded.threads == compiled_a_in_so.threads
    with pytest.raises(PrecastError) as exc:
        precast.save(compiled_a, tmp_path / "outside.pt2")
    assert "precast.compile(program, saving=True)" in one_line(exc)
    assert not (tmp_path / "outside.pt2").exists()
    record = json.loads(registry.record_path(path).read_text())
    record["built_with"]["torch"] = "0.0"
    registry.record_path(path).write_text(json.dumps(record))
    with pytest.raises(PrecastError) as exc:
        precast.load(path)
    assert "built with another torch" in one_line(exc)


def test_load_needs_the_record(fp16, tmp_path):
    if not installed("onnx"):
        pytest.skip("onnx not installed")
    program, inputs, _ = fp16
    path = tmp_path / "m.onnx"
    precast.save(precast.compile(program, backend="onnx"), path)
    with pytest.raises(PrecastError) as exc:
        precast.load(path, backend="openvino")
    assert "is a onnx artifact, not openvino" in one_line(exc)
    with pytest.raises(PrecastError) as exc:
        precast.load(path, cache_dir=tmp_path)
    assert "cache_dir= is for an LLM folder" in one_line(exc)
    registry.record_path(path).unlink()
    with pytest.raises(PrecastError) as exc:
        precast.load(path)
    assert "no record beside it (m.onnx.json)" in one_line(exc)
    with pytest.raises(PrecastError) as exc:
        precast.save(object(), tmp_path / "x.onnx")
    assert "pass a model precast.compile or precast.load returned" in one_line(exc)
