"""A policy of the user's opts into the hooks the built-in policies use (``precast.policy.hooks``): calibration,
the tolerance search, the device fallback, a ``keep_io_types`` default; a subclass of a built-in policy keeps
what it overrides. None of this reached a policy of the user's while ``convert`` branched on policy classes."""

from __future__ import annotations

import torch

import precast
from precast.policy.base import Decision
from precast.policy.hooks import PolicyHooks, hook
from precast.policy.measurements import Calibration
from precast.policy.rules.taxonomy import casts_for, op_kind
from tests.pipeline.test_device_fallback import WithFp32Only, _inputs

BF16 = torch.bfloat16


class ComputeLow:
    """Every compute op low, except what the tolerance search or the device fallback keep fp32 (not a subclass
    of any precast policy; the hooks are plain attributes)."""

    name = "compute-low"
    prepare_steps = ("calibrate", "tolerance")
    after_lowering = ("device_fallback",)
    keep_io_types = True

    def __init__(self, calibration=None, tolerance=None):
        self.calibration, self.tolerance, self.bound = calibration, tolerance, []

    def autocast_state(self, device_type):
        return None

    def bind(self, program, options, calibration=None, fallback=None, device_fp32=None):
        self.bound.append({"calibration": calibration, "fallback": fallback, "device_fp32": device_fp32})
        return _Decider(self.name, dict(fallback or {}), dict(device_fp32 or {}))


class _Decider:
    def __init__(self, name, fallback, device_fp32):
        self.name, self.fp32 = name, {**fallback, **device_fp32}

    def autocast_state(self, device_type):
        return None

    def decide(self, node, args, kwargs):
        if op_kind(node, args, kwargs) != "compute":
            return None
        dtype = torch.float32 if node.name in self.fp32 else BF16
        return Decision(dtype, self.name, "compute", "mine", casts=casts_for(node, args, kwargs, dtype))


def _calibration(n=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 16, generator=g),) for _ in range(n)]


def test_user_policy_opts_into_calibration_and_the_tolerance_search():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    policy = ComputeLow(calibration=_calibration(), tolerance={"cosine": 0.99})
    res = precast.convert(model, _inputs(), policy=policy)
    # calibration: every decider (the search's tries and the final one) was bound with the three batches' stats
    assert policy.bound and all(isinstance(b["calibration"], Calibration) for b in policy.bound)
    assert all(b["calibration"].batches == 3 for b in policy.bound)
    # the tolerance search ran over the policy's own low ops, and the final decider got its choice
    tol = res.report.verification["tolerance"]
    assert tol["candidates"] >= 1 and tol["achieved"]["cosine"] >= 0.99
    assert sorted(policy.bound[-1]["fallback"]) == sorted(tol["kept_fp32"])
    # keep_io_types defaults to the policy's hook: the output stays fp32
    with torch.no_grad():
        assert res.program.module()(*_inputs()).dtype == torch.float32


def test_user_policy_opts_into_the_device_fallback():
    model, inputs = WithFp32Only().eval(), _inputs()
    policy = ComputeLow()
    res = precast.convert(model, inputs, policy=policy)
    # fp32_only has no bf16 kernel: kept fp32 through the policy's own bind, and converted again
    assert policy.bound[-1]["device_fp32"] and "fp32_only" in policy.bound[-1]["device_fp32"]
    (d,) = [d for d in res.report.diagnostics if d.code == "no-low-precision-kernel"]
    assert d.node == "fp32_only"
    assert res.report.node("fp32_only").dtype == "fp32" and res.report.node("linear").dtype == "bf16"
    with torch.no_grad():
        out = res.program.module()(*inputs)
    assert out.dtype == torch.float32  # keep_io_types from the policy's hook
    torch.testing.assert_close(out, model(*inputs), atol=0.05, rtol=0.05)


def test_user_policy_without_hooks_gets_the_defaults():
    class Plain(ComputeLow):
        after_lowering = ()
        keep_io_types = False
        prepare_steps = ()

    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    policy = Plain()
    res = precast.convert(model, _inputs(), policy=policy)
    assert policy.bound == [{"calibration": None, "fallback": None, "device_fp32": None}]
    with torch.no_grad():
        assert res.program.module()(*_inputs()).dtype == BF16  # no keep_io_types: the policy's dtype
    assert hook(object(), "reference") == PolicyHooks.reference == "measured"


ASKED: list[str] = []


class RecordingTorchPolicy(precast.TorchPolicy):
    """A subclass of a built-in policy: its override must be the one the conversion asks."""

    def autocast_state(self, device_type):
        ASKED.append(device_type)
        return super().autocast_state(device_type)


def test_subclass_of_torch_policy_keeps_its_override():
    ASKED.clear()
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    res = precast.convert(model, _inputs(), policy=RecordingTorchPolicy())
    assert ASKED and set(ASKED) == {"cpu"}
    assert res.report.policy == "torch"
    assert [n.dtype for n in res.report.nodes if n.op == "aten.linear.default"] == ["bf16"]


def test_rules_options_are_defined_once():
    """RulesPolicy's fields are the rules keywords, defined once: convert's signature repeats none of them (each is
    a shortcut of the release before that warns, tests/pipeline/test_records.py), the CLI's flags are derived."""
    import dataclasses
    import inspect

    from precast.cli.common import FLAGS
    from precast.pipeline.records import SHORTCUTS
    from precast.policy.resolve import RULE_OPTIONS

    assert set(RULE_OPTIONS) <= {f.name for f in dataclasses.fields(precast.RulesPolicy)}
    assert not set(RULE_OPTIONS) & set(inspect.signature(precast.convert).parameters)
    assert not set(RULE_OPTIONS) & set(SHORTCUTS)  # read from RULE_OPTIONS itself, not listed again
    assert set(FLAGS) == set(RULE_OPTIONS) - {"calibration", "tolerance", "custom_rules"}
