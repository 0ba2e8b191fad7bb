"""The package precast.compile writes is a plain AOTInductor package: a process that imports only torch loads it
with ``torch._inductor.aoti_load_package`` and computes exactly what precast's loaded model computes.

Uses the session's compiled small MLP (tests/conftest.py ``compiled_a``): no compile of its own.
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


def test_package_runs_in_a_process_without_precast(converted_a, compiled_a, tmp_path):
    _, inputs, res = converted_a
    g = torch.Generator().manual_seed(3)
    batches = [inputs, (torch.randn(1, inputs[0].shape[1], generator=g),), (torch.randn(7, 64, generator=g),)]
    torch.save(batches, tmp_path / "inputs.pt")
    proc = run_python(
        CHILD, str(compiled_a.package_path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")
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
