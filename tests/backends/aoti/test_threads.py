"""``precast.compile(threads=)`` on AOTInductor (issue 49 item 3): a package is compiled for one thread count
(Inductor writes it into its C++ kernels), so the count is in the cache key and in the form's measurement; each call
runs at the model's count and leaves the caller's ``torch.get_num_threads()`` as it was.

Today's code took no ``threads=`` and keyed neither the package nor (through ``precast.compile``) the form by the
count its code was generated for: a process at 2 threads loaded the package compiled at 1, whose form record said
"measured at 1 thread". The form's timing is stubbed here (never real speed); two small compiles.
"""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

import precast
from precast.backends.aoti import forms
from precast.backends.aoti.compiler import THREADS, compile_configs
from precast.backends.aoti.package_cache import MANIFEST, cache_key
from precast.errors import PrecastError

pytestmark = pytest.mark.aoti

# seconds per call by form: the stubbed timing (Inductor's defaults fastest: the cheapest compile)
TIMES = {"default": 0.001, "onednn-packed": 0.002, "gemm-template": 0.003}


class Wide(torch.nn.Module):
    """A bf16 linear (so ``mode="auto"`` measures a form) and an elementwise op wide enough for Inductor to split
    among threads."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x.to(torch.bfloat16)).float(), torch.relu(y) * 2.0 + 1.0


@pytest.fixture(scope="module")
def at_counts(tmp_path_factory):
    """The program compiled at 1 and at 2 threads, the form measured (stubbed) at each: (program, inputs,
    {count: model}, the counts the timing was asked for)."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 64), torch.randn(2, 1 << 16))
    ep = torch.export.export(Wide().eval(), inputs)
    asked = []

    def timed(dtype, shapes, configs, root, compile_fn, threads, formats=None):
        asked.append(threads)
        return dict(TIMES)

    cache = tmp_path_factory.mktemp("aoti-threads")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(forms.FORM_ENV, raising=False)
        mp.setattr(forms, "measure_forms", timed)
        mp.setattr(forms, "others_busy", lambda before, after, wall: 0.0)
        models = {n: precast.compile(ep, cache_dir=cache, progress=False, threads=n) for n in (1, 2)}
    return ep, inputs, models, asked


def test_each_count_is_its_own_package_and_its_own_form(at_counts):
    _, _, models, asked = at_counts
    assert asked == [1, 2]  # the form measured at each count, not at this process's
    assert models[1].key != models[2].key
    for n, cm in models.items():
        assert cm.threads == n and f"{n} thread(s)" in repr(cm)
        assert cm.form["name"] == "default" and cm.form["threads"] == n
        assert f"measured on this CPU at {n} thread(s)" in cm.form["why"]
        manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
        assert manifest["threads"] == n and manifest["inductor_configs"][THREADS] == n
        assert manifest["form"]["threads"] == n


def kernel_source(cm) -> str:
    with zipfile.ZipFile(cm.package_path) as z:
        return "\n".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith("kernel.cpp"))


def test_the_package_runs_its_kernels_at_the_count_it_was_compiled_for(at_counts):
    """Why the count is in the key: Inductor writes it into the generated code."""
    _, _, models, _ = at_counts
    assert "#pragma omp parallel num_threads(2)" in kernel_source(models[2])
    assert "omp parallel" not in kernel_source(models[1])  # serial code


def test_each_call_runs_at_the_models_count_and_restores_the_callers(at_counts, monkeypatch):
    ep, inputs, models, _ = at_counts
    before = torch.get_num_threads()
    with torch.no_grad():
        out = {n: cm(*inputs) for n, cm in models.items()}
        assert torch.get_num_threads() == before
        # the same numbers at either count (the linear splits its outputs, not its sums)
        assert all(torch.equal(a, b) for a, b in zip(out[1], out[2], strict=True))
        want = ep.module()(*inputs)
        torch.testing.assert_close(out[1], want, atol=0, rtol=0)
    for n, cm in models.items():
        seen = []
        run = cm._boxed_run

        def spy(tensors, run=run, seen=seen):
            seen.append(torch.get_num_threads())
            return run(tensors)

        monkeypatch.setattr(cm, "_boxed_run", spy)
        cm(*inputs)
        assert seen == [n] and torch.get_num_threads() == before

        def fails(tensors, seen=seen):
            seen.append(torch.get_num_threads())
            raise RuntimeError("the native call failed")

        monkeypatch.setattr(cm, "_boxed_run", fails)
        with pytest.raises(RuntimeError, match="native call failed"):
            cm(*inputs)
        assert seen == [n, n] and torch.get_num_threads() == before


def test_the_count_is_in_the_cache_key_whatever_set_it(at_counts, monkeypatch):
    ep = at_counts[0]
    configs = {n: compile_configs("default", None, None, n) for n in (1, 2)}
    assert configs[1][THREADS] == 1 and configs[2][THREADS] == 2
    key = cache_key(ep, configs[1], True)
    assert key != cache_key(ep, configs[2], True)
    # $OMP_NUM_THREADS is no longer part of the key: the count is, however it was chosen
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert cache_key(ep, configs[1], True) == key
    assert compile_configs()[THREADS] == torch.get_num_threads()  # the default: this process's count


def test_a_bad_count_is_one_line(at_counts):
    ep = at_counts[0]
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(PrecastError, match=r"precast.compile: threads=.*give a positive int") as err:
            precast.compile(ep, threads=bad, progress=False)
        assert "\n" not in str(err.value)
    with pytest.raises(
        PrecastError, match=r"cpp.threads=3 but the compile runs at 2 thread\(s\); pass threads=3"
    ):
        precast.compile(ep, threads=2, inductor_configs={THREADS: 3}, progress=False)
