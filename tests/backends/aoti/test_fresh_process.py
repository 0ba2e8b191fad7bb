"""The package precast.compile writes with its weights inside (``precast compile -o``, or
``inductor_configs={"aot_inductor.package_constants_in_so": True}``) is a plain AOTInductor package: a process that
imports only torch loads it with ``torch._inductor.aoti_load_package`` and computes exactly what precast's loaded
model computes, weights inside the package or not (the default, docs/compile.md).

Uses the session's compiled small MLP (tests/conftest.py ``compiled_a``, ``compiled_a_in_so``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_python

pytestmark = pytest.mark.aoti

# imports torch only; records whether anything imported precast along the way
CHILD = r"""
import json, sys
import torch, torch._inductor
package, inputs_path, out_path = sys.argv[1:4]
batches = torch.load(inputs_path)
model = torch._inductor.aoti_load_package(package)
with torch.no_grad():
    outs = [model(*x) for x in batches]
torch.save(outs, out_path)
print(json.dumps({"precast": sorted(m for m in sys.modules if m == "precast" or m.startswith("precast.")),
                  "shapes": [list(o.shape) for o in outs]}))
"""


def test_package_runs_in_a_process_without_precast(converted_a, compiled_a, compiled_a_in_so, tmp_path):
    _, inputs, res = converted_a
    g = torch.Generator().manual_seed(3)
    batches = [inputs, (torch.randn(1, inputs[0].shape[1], generator=g),), (torch.randn(7, 64, generator=g),)]
    torch.save(batches, tmp_path / "inputs.pt")
    proc = run_python(
        CHILD, str(compiled_a_in_so.package_path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["precast"] == []
    assert facts["shapes"] == [[4, 10], [1, 10], [7, 10]]  # dim 0 dynamic in the package itself
    fresh = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        for x, out in zip(batches, fresh, strict=True):
            assert torch.equal(out, compiled_a(*x))  # the same native code on the same inputs: bitwise
        assert torch.equal(fresh[0], res.program.module()(*inputs))  # and the converted program's values


def test_real_model_package_runs_without_precast(aoti_cache, tmp_path):
    """The real-model tier's BERT (transformers, from a config) under policy torch bf16, compiled once: the
    package runs in a process that imports only torch, bitwise what precast's loaded model computes, and
    within bf16 rounding of the converted program (Inductor fuses)."""
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'precast[test]')")
    import precast
    from tests.realmodels.builders import bert
    from tests.realmodels.conftest import export

    built = bert()
    inputs = built.inputs[2]
    res = precast.convert(export(built.make(False), inputs), inputs, policy="torch", dtype=torch.bfloat16)
    configs = {"aot_inductor.package_constants_in_so": True}
    cm = precast.compile(res.program, cache_dir=aoti_cache, progress=False, inductor_configs=configs)
    batches = [inputs, built.inputs[3]]
    torch.save(batches, tmp_path / "inputs.pt")
    proc = run_python(CHILD, str(cm.package_path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["precast"] == []
    fresh = torch.load(tmp_path / "out.pt")
    module = res.program.module()
    with torch.no_grad():
        for x, out in zip(batches, fresh, strict=True):
            assert torch.equal(out, cm(*x))
            ref = module(*x)
            scale = ref.abs().max().item()
            assert (out.float() - ref.float()).abs().max().item() <= 2 * torch.finfo(
                torch.bfloat16
            ).eps * scale
