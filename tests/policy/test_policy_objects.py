"""Policies are objects: ``convert(ep, policy=None | "torch" | "rules" | Policy)``. The string forms are
shorthands for ``TorchPolicy(...)`` / ``RulesPolicy(...)``; a policy object of the user's own plugs into the
same composition (regions, then user rules, then the policy: first decision wins)."""

from __future__ import annotations

import copy
import importlib
import pkgutil

import pytest
import torch

import precast
from precast.errors import PrecastError
from precast.policy.base import Decision
from tests import models as zoo
from tests.helpers import assert_bitwise

FP16 = torch.float16


def _decisions(res) -> dict[str, tuple]:
    return {r.name: (r.dtype, r.source, r.rule) for r in res.report.nodes}


def test_rules_object_equals_the_keyword_shorthand():
    model, inputs = zoo.plain_mlp()
    ep = torch.export.export(model, inputs)
    calib = [(torch.randn_like(inputs[0]),) for _ in range(3)]
    by_kw = precast.convert(
        ep, policy="rules", dtype=FP16, data_max=4.0, exclude_nodes=["linear_1"], calibration=calib
    )
    pol = precast.RulesPolicy(dtype=FP16, data_max=4.0, exclude_nodes=("linear_1",), calibration=calib)
    before = copy.copy(pol)
    by_obj = precast.convert(ep, policy=pol)
    assert _decisions(by_obj) == _decisions(by_kw)
    assert_bitwise(by_obj.program.module()(*inputs), by_kw.program.module()(*inputs))
    assert by_obj.report.policy == "rules"
    assert pol == before  # the policy object is a value: a conversion never changes it
    # one object serves several conversions alike
    again = precast.convert(ep, policy=pol)
    assert _decisions(again) == _decisions(by_obj)


def test_torch_object_equals_policy_torch():
    model, inputs = zoo.plain_mlp()
    a = precast.convert(model, inputs, policy="torch", dtype=torch.bfloat16)
    b = precast.convert(model, inputs, policy=precast.TorchPolicy("cpu", torch.bfloat16))
    assert _decisions(a) == _decisions(b)
    assert_bitwise(a.program.module()(*inputs), b.program.module()(*inputs))
    assert b.report.verification["bitwise"]


class LinearOnly:
    """A user's policy: linear layers in fp16, everything else left alone."""

    name = "linear-only"

    def autocast_state(self, device_type):
        return None

    def decide(self, node, args, kwargs):
        if node.target is not torch.ops.aten.linear.default:
            return None
        casts = {
            ("args", i): FP16
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
        }
        return Decision(FP16, "linear-only", "linear", "linear layers run in fp16", casts=casts)


def test_a_policy_of_the_users_own():
    model, inputs = zoo.plain_mlp()
    res = precast.convert(model, inputs, policy=LinearOnly())
    linear = [r for r in res.report.nodes if r.op.endswith("linear.default")]
    assert linear and all(r.dtype == "fp16" and r.source == "linear-only" for r in linear)
    others = [r for r in res.report.nodes if not r.op.endswith("linear.default") and r.dtype == "fp16"]
    assert all(r.source == "none" for r in others)  # followers only
    assert res.report.policy == "linear-only"
    # nobody promised bitwise: the measured difference vs the unconverted program is information
    codes = {d.code: d.severity for d in res.report.diagnostics}
    assert codes.get("measured-error") == "info" and "not-bitwise" not in codes
    want = model(*inputs)
    got = res.program.module()(*inputs)
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"policy": precast.RulesPolicy(), "data_max": 4.0}, "inside the policy object"),
        ({"policy": precast.RulesPolicy(dtype=FP16), "dtype": torch.bfloat16}, "give one"),
        ({"policy": precast.TorchPolicy("cpu", FP16), "dtype": torch.bfloat16}, "give one"),
        ({"policy": object()}, "not a policy (missing name, autocast_state, decide)"),
        ({"policy": "fast"}, "policy='fast'"),
        ({"policy": "torch", "exclude_nodes": ["x"]}, "belong to policy='rules'"),
    ],
)
def test_bad_policy_arguments_are_one_line(kwargs, needle):
    model, inputs = zoo.plain_mlp()
    with pytest.raises(PrecastError) as err:
        precast.convert(model, inputs, **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_precast_report_stays_the_function():
    """``precast/report/`` is a package and ``precast.report`` a public function: importing every submodule
    must not rebind the name."""
    for info in pkgutil.walk_packages(precast.__path__, "precast."):
        if info.name != "precast.__main__":
            importlib.import_module(info.name)
    assert callable(precast.report) and precast.report.__module__ == "precast.report.build"
    assert callable(precast.convert)
