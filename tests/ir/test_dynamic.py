"""Dynamic dimensions survive conversion, the caller's shape environment is untouched, and fake values are kept
up to date incrementally (``precast.verify.update_vals`` / ``check_pass``).

Before the fix, re-propagating fake values ran C++ composites (``aten.pad``) that read concrete sizes on the
input program's own ShapeEnv: the batch symbol was replaced by the example size, the converted program failed
at any other batch ("Guard failed: x.size()[0] == 2") and the caller's program was narrowed as well.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import precast
import precast.ir.fake_run as fake_run_mod
from precast.errors import PrecastError
from precast.ir.fake import fake_state
from precast.ir.fake_update import changed_nodes, check_pass, refresh_vals, update_vals
from precast.ir.program import Program
from precast.passes.classify import classify
from precast.passes.regions import inline_regions
from precast.passes.rewrite import insert_casts
from precast.policy.torch_policy import TorchPolicy
from tests.helpers import assert_bitwise

BATCHES = (1, 3, 5)


class Windows(nn.Module):
    """pad / roll / unfold on a bf16 activation that leaves an autocast region, then back to fp32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):  # (b, 6, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        h = F.pad(h, (0, 0, 1, 1))  # (b, 8, 8)
        h = torch.roll(h, shifts=1, dims=1)
        w = h.unfold(1, 4, 2)  # (b, 3, 8, 4)
        w = w.reshape(w.shape[0], -1, 8)
        return self.out(w.float())


def _windows_program():
    torch.manual_seed(0)
    model = Windows().eval()
    ep = torch.export.export(
        model, (torch.randn(2, 6, 8),), dynamic_shapes=({0: Dim("b", min=1, max=64)},), strict=False
    )
    return model, ep


def _shape_env(ep):
    val = next(n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder")
    return val.fake_mode.shape_env


def _env_state(env) -> tuple:
    return (dict(env.replacements), dict(env.var_to_range), len(env.guards), dict(env.backed_var_to_val))


def eager_autocast(model, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        return model(x)


@pytest.mark.parametrize("policy", [None, "torch"])
def test_dynamic_batch_survives_conversion(policy):
    model, ep = _windows_program()
    constraints = dict(ep.range_constraints)
    env_before = _env_state(_shape_env(ep))
    res = precast.convert(ep, policy=policy, dtype=torch.bfloat16 if policy else None)
    for b in BATCHES:
        x = torch.randn(b, 6, 8)
        got = res.program.module()(x)
        assert_bitwise(got, ep.module()(x) if policy is None else eager_autocast(model, x))
    assert dict(ep.range_constraints) == constraints
    assert dict(res.program.range_constraints) == constraints
    assert _env_state(_shape_env(ep)) == env_before  # the caller's shape environment is untouched
    x = torch.randn(3, 6, 8)
    assert ep.module()(x).shape == (3, 12, 8)
    # the result is an ordinary dynamic program: decomposes and round-trips through save/load
    want = res.program.module()(x)
    assert_bitwise(res.program.run_decompositions().module()(x), want)
    buf = io.BytesIO()
    torch.export.save(res.program, buf)
    buf.seek(0)
    assert_bitwise(torch.export.load(buf).module()(x), want)


def test_specialization_is_detected_naming_the_node(monkeypatch):
    """Without the Python dispatcher, fake ``aten.pad`` reads concrete sizes and fixes the batch to 2: that
    must stop the conversion at the node, not return a narrowed program."""
    monkeypatch.setattr(fake_run_mod, "enable_python_dispatcher", contextlib.nullcontext)
    model, ep = _windows_program()
    env_before = _env_state(_shape_env(ep))
    # the conversion either stops at the node or returns a program that still runs at every batch size
    try:
        res = precast.convert(ep, policy="torch")
    except PrecastError as err:
        assert err.code == "dynamic-dim-specialized" and err.node == "pad"
    else:
        for b in BATCHES:
            x = torch.randn(b, 6, 8)
            assert_bitwise(res.program.module()(x), eager_autocast(model, x))
    assert _env_state(_shape_env(ep)) == env_before
    program = _classified(ep)
    insert_casts(program)
    with pytest.raises(PrecastError) as err:
        refresh_vals(program)  # the full re-check runs pad again (the incremental one need not: same dtypes)
    assert err.value.code == "dynamic-dim-specialized" and err.value.node == "pad"


def _classified(ep) -> Program:
    program = Program(ep)
    inline_regions(program.gm)
    classify(program, TorchPolicy("cpu", torch.bfloat16))
    return program


def test_update_vals_is_incremental():
    _, ep = _windows_program()
    program = _classified(ep)
    insert_casts(program)
    changed = changed_nodes(program)
    assert changed and len(changed) < len(program.graph.nodes)
    check_pass(program, "insert_casts")
    assert changed_nodes(program) == []
    assert update_vals(program, []) == 0
    # nothing changed since: a full refresh computes the same values
    before = {n: n.meta.get("val") for n in program.graph.nodes}
    refresh_vals(program)
    assert all(n.meta.get("val") is before[n] for n in program.graph.nodes)
    # every value lives on the conversion's own fake mode
    mode = fake_state(program).mode
    vals = [n.meta["val"] for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert all(v.fake_mode is mode for v in vals)
    assert mode.shape_env is not _shape_env(ep)


class Chain(nn.Module):
    def forward(self, x):
        return torch.roll(F.pad(x, (1, 1)), 1, 1).sum(1)


def test_update_vals_follows_dtype_changes_downstream():
    ep = torch.export.export(Chain(), (torch.randn(2, 6),), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    program = Program(ep)
    pad = next(n for n in program.graph.nodes if n.target is torch.ops.aten.pad.default)
    with program.graph.inserting_before(pad):
        cast = program.graph.call_function(
            torch.ops.aten._to_copy.default, (pad.args[0],), {"dtype": torch.float16}
        )
    pad.replace_input_with(pad.args[0], cast)
    check_pass(program, "test")
    roll = next(iter(pad.users))
    total = next(iter(roll.users))
    # pad's arguments changed; roll and sum were not touched, but their inputs changed dtype
    assert [n.meta["val"].dtype for n in (cast, pad, roll, total)] == [torch.float16] * 4
    assert isinstance(total.meta["val"].shape[0], torch.SymInt)


def test_check_pass_names_the_pass_and_the_node():
    _, ep = _windows_program()
    program = _classified(ep)
    insert_casts(program)
    check_pass(program, "insert_casts")
    roll = next(n for n in program.graph.nodes if n.target is torch.ops.aten.roll.default)
    roll.args = (roll.args[0], [1], [7])  # dim 7 of a 3-d tensor: a broken rewrite
    with pytest.raises(PrecastError) as err:
        check_pass(program, "my_pass")
    assert str(err.value).startswith("internal error in pass my_pass:")
    assert f"'{roll.name}'" in str(err.value)
    # and a graph that no longer lints: an op reading a value defined after it
    roll.args = (roll.args[0], [1], [1])
    pad = next(n for n in program.graph.nodes if n.target is torch.ops.aten.pad.default)
    pad.args = (roll, *pad.args[1:])
    with pytest.raises(PrecastError, match="internal error in pass lint_breaker: the graph does not lint"):
        check_pass(program, "lint_breaker")


# ---- real models -----------------------------------------------------------------------------------------


class GPT2Region(nn.Module):
    """transformers' GPT-2 with its forward inside one bf16 region, as a user wraps it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(ids).logits


@pytest.mark.parametrize("policy", [None, "torch"])
def test_gpt2_dynamic_batch(policy):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    wrapper = GPT2Region(gpt2).eval()
    ids = torch.randint(0, 100, (2, 16))
    ep = torch.export.export(wrapper, (ids,), dynamic_shapes=({0: Dim("b", min=1, max=64)},), strict=False)
    constraints = dict(ep.range_constraints)
    res = precast.convert(ep, policy=policy, dtype=torch.bfloat16 if policy else None)
    for b in BATCHES:
        x = torch.randint(0, 100, (b, 16))
        with torch.no_grad():
            want = ep.module()(x) if policy is None else eager_autocast(gpt2, x).logits
            assert_bitwise(res.program.module()(x), want)
    assert dict(ep.range_constraints) == constraints


def test_efficientvit_dynamic_batch():
    """timm's efficientvit_m0 (1.5k nodes, windowed attention with pad), converted at batch 2, runs at 3."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("efficientvit_m0", pretrained=False).eval()
    x = torch.randn(2, 3, 224, 224)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("b", min=1, max=64)},), strict=False)
    res = precast.convert(ep, policy="torch", dtype=torch.bfloat16, verify=False)
    x3 = torch.randn(3, 3, 224, 224)
    with torch.no_grad():
        assert_bitwise(res.program.module()(x3), eager_autocast(model, x3))
