"""precast compile --backend onnx|executorch: user errors exit 2 with one line, never a partial output file."""

from __future__ import annotations

import sys

import pytest
import torch

import precast
from precast.cli import main
from tests import models as zoo


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """A float16 MLP program (ONNX Runtime CPU runs it) and a bfloat16 CNN one (ONNX has no bf16 Conv)."""
    root = tmp_path_factory.mktemp("programs")
    model, inputs = zoo.plain_mlp()
    torch.export.save(
        precast.convert(model, inputs, policy="torch", dtype=torch.float16).program, root / "mlp.pt2"
    )
    model, inputs = zoo.cnn()
    torch.export.save(precast.convert(model, inputs).program, root / "cnn_bf16.pt2")
    return root


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["compile", *argv])
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("precast compile: error:"), err
    assert "Traceback" not in err
    return lines[0]


def test_onnx_backend_writes_a_runnable_file(programs, tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install 'precast[onnx]')")
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install 'precast[onnx]')")
    from precast.backends.onnx.export import inspect_onnx
    from precast.backends.onnx.runtime import run_onnx

    out = tmp_path / "mlp.onnx"
    code, err = run(capsys, str(programs / "mlp.pt2"), "--backend", "onnx", "-o", str(out))
    assert code == 0, err
    assert "exported for onnx" in err and "dynamic batch" in err
    info = inspect_onnx(out)
    assert info.initializers == {"float16": 8} and info.dynamic_batch
    x = torch.randn(3, 64)
    (y,) = run_onnx(out, (x,))
    assert y.shape == (3, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "mlp.onnx.json"]  # the file, its record


def test_onnx_static(programs, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install 'precast[onnx]')")
    from precast.backends.onnx.export import inspect_onnx

    out = tmp_path / "mlp.onnx"
    code, err = run(capsys, str(programs / "mlp.pt2"), "--backend", "onnx", "--static", "-o", str(out))
    assert code == 0, err
    assert "static shapes" in err and inspect_onnx(out).inputs[0][2] == [4, 64]


def test_onnx_export_failure_leaves_no_file(programs, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install 'precast[onnx]')")
    out = tmp_path / "cnn.onnx"
    code, err = run(capsys, str(programs / "cnn_bf16.pt2"), "--backend", "onnx", "-o", str(out))
    assert code == 2
    assert "no bfloat16 Conv" in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "onnx"], "--backend onnx needs -o FILE"),
        (["--backend", "executorch"], "--backend executorch needs -o FILE"),
        (
            ["--backend", "onnx", "--mode", "max-autotune", "-o", "{tmp}/m.onnx"],
            "--mode applies to --backend aoti",
        ),
        (
            ["--backend", "onnx", "--cache-dir", "{tmp}", "-o", "{tmp}/m.onnx"],
            "--cache-dir applies to --backend",
        ),
        (["--backend", "onnx", "-o", "{tmp}/no/such/dir/m.onnx"], "does not exist"),
        (["--backend", "onnx", "-o", "{tmp}"], "is a directory"),
    ],
)
def test_user_errors_exit_2(programs, tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, err = run(capsys, str(programs / "mlp.pt2"), *argv)
    assert code == 2
    assert message in one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_bad_backend_and_missing_source(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "x.pt2", "--backend", "tensorrt"])
    assert exit_.value.code == 2
    capsys.readouterr()
    code, err = run(
        capsys, str(tmp_path / "missing.pt2"), "--backend", "onnx", "-o", str(tmp_path / "m.onnx")
    )
    assert code == 2
    one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_missing_backend_package_names_the_extra(programs, tmp_path, capsys, monkeypatch):
    """A backend module that cannot be imported (its engine not installed) is one line naming the pip extra."""
    for module, backend, extra in (
        ("precast.backends.executorch", "executorch", "executorch"),
        ("precast.backends.onnx.model", "onnx", "onnx"),  # the module of the registry's compile function
    ):
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
        out = tmp_path / f"m.{'pte' if backend == 'executorch' else 'onnx'}"
        code, err = run(capsys, str(programs / "mlp.pt2"), "--backend", backend, "-o", str(out))
        assert code == 2
        assert f"pip install 'precast[{extra}]'" in one_line_error(err)
        assert not out.exists()


def test_onnx_extra_missing_is_caught_before_loading(programs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    code, err = run(capsys, str(programs / "mlp.pt2"), "--backend", "onnx", "-o", str(tmp_path / "m.onnx"))
    assert code == 2
    assert "onnxscript is not installed; pip install 'precast[onnx]'" in one_line_error(err)


def test_every_output_is_checked_against_every_input(tmp_path, monkeypatch):
    """``precast.paths.check_outputs``, which every command runs before writing: an output that is an input by name,
    by another spelling, through a symlink or a hard link is refused (one line naming both), so are two outputs
    naming one file; distinct new files pass."""
    import os

    from precast.errors import PrecastError
    from precast.paths import check_outputs, ir_files

    src = tmp_path / "prog.bin"
    src.write_bytes(b"program")
    os.symlink(src, tmp_path / "sym.bin")
    os.link(src, tmp_path / "hard.bin")
    monkeypatch.chdir(tmp_path)
    for out in ("prog.xml", "sym.xml", "hard.xml", str(tmp_path / "sub" / ".." / "prog.xml")):
        weights = ir_files(out)[1]
        with pytest.raises(PrecastError, match=r"the IR's weights is also the input .*prog.bin") as err:
            check_outputs({"the output": out, "the IR's weights": weights}, (str(src),))
        assert "\n" not in str(err.value)
    with pytest.raises(PrecastError, match="-o and --write-plan name the same file"):
        check_outputs({"-o": "a.pt2", "--write-plan": str(tmp_path / "a.pt2")}, (str(src),))
    check_outputs({"-o": "new.xml", "weights": "new.bin", "--write-plan": None}, (str(src), None))
    assert src.read_bytes() == b"program"
