"""The module route for modules that write their own tensors (a KV cache): capture lifts them (registered buffers,
and the plain tensors non-strict export lifts as constants), and verification runs the eager reference on
private clones of each, found in the module by identity (``precast/ir/module_state.py``). The caller's module
is never changed and no forward runs on its state; the returned program owns its written constants.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import precast
from precast.errors import PrecastError
from precast.ir.module_state import private_call, tensor_slots, written_paths
from precast.ir.program import written_targets

BF16 = torch.bfloat16
SEQ = torch.export.Dim("seq", max=8)  # the cache holds 8 positions
DYNAMIC = ({1: SEQ}, {0: SEQ})


class Layer:
    """A cache layer as transformers' StaticLayer holds it: a plain object, not a module."""

    def __init__(self):
        self.keys = torch.zeros(1, 8, 4)


class Cached(nn.Module):
    """Writes two tensors in place with ``index_copy_`` of fp32 values: one held by a plain object in a list
    (lifted as ``lifted_tensor_0``), one a plain tensor attribute (lifted under its name); the Linear reads
    both."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = [Layer()]
        self.state = torch.zeros(1, 8, 4)

    def forward(self, x, pos):
        self.layers[0].keys.index_copy_(1, pos, x * 2)
        self.state.index_copy_(1, pos, x + 1)
        return self.lin(self.layers[0].keys + self.state)


class RegionCached(Cached):
    """The same, with the Linear in the model's own bf16 region (policy None has something to convert)."""

    def forward(self, x, pos):
        self.layers[0].keys.index_copy_(1, pos, x * 2)
        self.state.index_copy_(1, pos, x + 1)
        with torch.autocast("cpu", dtype=BF16):
            return self.lin(self.layers[0].keys + self.state)


class Aliased(nn.Module):
    """A registered buffer that is also held by a plain object (transformers' recipe registers each
    ``static_cache.layers[i].keys`` as ``key_cache_i``); the forward writes it through the object."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = Layer()
        self.register_buffer("key_cache_0", self.cache.keys, persistent=False)

    def forward(self, x, pos):
        self.cache.keys.index_copy_(1, pos, x * 2)
        return self.lin(self.cache.keys)


def example(n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(1, n, 4), torch.arange(n)


def snapshot(model: Cached) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The caller's cache tensors (the objects) and their values."""
    tensors = [model.layers[0].keys, model.state]
    return [(t, t.clone()) for t in tensors]


def assert_untouched(model: Cached, before: list) -> None:
    now = [model.layers[0].keys, model.state]
    for (obj, value), cur in zip(before, now, strict=True):
        assert cur is obj, "the caller's tensor object was replaced"
        assert torch.equal(cur, value), "the caller's cache tensor was written"


@pytest.mark.parametrize("model_cls, policy", [(Cached, "torch"), (RegionCached, None)])
def test_module_writing_lifted_tensors_converts_and_verifies(model_cls, policy):
    """Policy torch verifies against eager autocast of the module (private clones of both written tensors);
    policy None against the unconverted program. Dynamic sequence dim; bitwise; the caller's cache untouched."""
    torch.manual_seed(0)
    model = model_cls().eval()
    before = snapshot(model)
    x, pos = example()
    res = precast.convert(model, (x, pos), policy=policy, dynamic_shapes=DYNAMIC)
    v = res.report.verification
    assert v and v["bitwise"], v
    want = "eager torch.autocast of the module" if policy == "torch" else "the unconverted program"
    assert want in v["reference"]
    assert_untouched(model, before)

    # the program owns its written constants: not the caller's objects, and running it leaves the caller alone
    written = written_targets(res.program)
    assert written, "the program should write the cache tensors"
    caller = {id(t) for t, _ in before}
    assert all(id(res.program.constants[name]) not in caller for name in written)
    run = res.program.module()
    for n in (3, 5):  # another sequence length: the dynamic dim survived
        xs, ps = example(n)
        run(xs, ps)
    assert_untouched(model, before)
    # the lifted tensors it writes are buffers (non-persistent, their lifted names): torch refuses to decompose
    # a program that mutates a constant, and AOTInductor / ExecuTorch with it
    kinds = {s.target: s.kind.name for s in res.program.graph_signature.input_specs}
    assert {kinds[name] for name in written} == {"BUFFER"}, kinds
    decomposed = res.program.run_decompositions()
    assert {s.kind.name for s in decomposed.graph_signature.output_specs} == {
        "BUFFER_MUTATION",
        "USER_OUTPUT",
    }


def test_rules_on_a_module_writing_lifted_tensors():
    """Policy rules (the producers of the written values kept fp32: what reaches index_copy_ is fp32) converts,
    measures against the unconverted program on private state, and leaves the caller's cache alone; a cast of a
    written constant is never folded."""
    torch.manual_seed(0)
    model = Cached().eval()
    before = snapshot(model)
    x, pos = example()
    res = precast.convert(
        model,
        (x, pos),
        policy="rules",
        dtype=BF16,
        exclude_ops=(torch.ops.aten.mul, torch.ops.aten.add),
        dynamic_shapes=DYNAMIC,
    )
    assert res.report.verification["reference"] == "the unconverted program"
    assert_untouched(model, before)
    for name in written_targets(res.program):
        assert res.program.constants[name].dtype == torch.float32  # the cache itself is not folded to bf16


def test_written_tensors_are_found_at_every_place_holding_them():
    """By identity: a registered buffer that is also an object's attribute is found at both places, and the
    reference run swaps one clone into both (the forward writes through either)."""
    torch.manual_seed(0)
    model = Aliased().eval()
    x, pos = example()
    ep = torch.export.export(model, (x, pos), strict=False)
    written = {t: ep.constants.get(t, ep.state_dict.get(t)) for t in written_targets(ep)}
    paths = written_paths(model, written)
    assert any({"key_cache_0", "cache.keys"} <= set(p) for p in paths.values()), paths

    original = model.cache.keys
    call = private_call(model, written)
    with torch.no_grad():
        got = call(x, pos)
        again = call(x, pos)
    assert torch.equal(got, again)
    assert model.cache.keys is original and model.key_cache_0 is original
    assert not original.any(), "the reference run wrote the caller's cache"
    # the same forward on a clone of the caller's state gives the same output: the swap is complete
    fresh = Aliased().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x, pos), got)


def test_caller_state_restored_when_the_forward_raises():
    class Raises(Cached):
        def forward(self, x, pos):
            self.state.index_copy_(1, pos, x + 1)
            raise RuntimeError("boom")

    model = Raises().eval()
    state = model.state
    call = private_call(model, {"state": state})
    with pytest.raises(RuntimeError, match="boom"):
        call(*example())
    assert model.state is state and not state.any()


def test_a_written_tensor_out_of_reach_is_one_line():
    model = Cached().eval()
    stranger = torch.zeros(2)
    with pytest.raises(PrecastError, match="cannot find in the module") as err:
        private_call(model, {"lifted_tensor_9": stranger})
    assert "\n" not in str(err.value)

    class InTuple(nn.Module):
        def __init__(self):
            super().__init__()
            self.held = (torch.zeros(3),)

        def forward(self, x):
            self.held[0].add_(x)
            return self.held[0] * 2

    model = InTuple()
    with pytest.raises(PrecastError, match="held\\[0\\].*tuple") as err:
        private_call(model, {"lifted_tensor_0": model.held[0]})
    assert "\n" not in str(err.value)


def test_tensor_slots_walks_lists_dicts_and_objects():
    model = Cached()
    model.extra = {"k": [model.state]}
    slots = tensor_slots(model)
    assert sorted(s.path for s in slots[id(model.state)]) == ["extra['k'][0]", "state"]
    assert [s.path for s in slots[id(model.layers[0].keys)]] == ["layers[0].keys"]
    assert [s.path for s in slots[id(model.lin.weight)]] == ["lin.weight"]


def test_export_failure_says_how_the_inputs_bound():
    """forward(input_ids, inputs_embeds, cache_position) given (ids, pos) positionally binds pos to
    inputs_embeds (transformers' recipe): the one-line error says so, and under policy torch does not blame
    autocast for a forward that fails without it too."""

    class Recipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 4)

        def forward(self, input_ids=None, inputs_embeds=None, cache_position=None):
            start = cache_position[0]
            return self.emb(input_ids) + start

    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)
    for policy in (None, "torch"):
        with pytest.raises(PrecastError) as err:
            precast.convert(Recipe(), (ids, pos), policy=policy)
        msg = str(err.value)
        assert "\n" not in msg and "autocast" not in msg, msg
        assert "fill input_ids, inputs_embeds of forward; cache_position=None by default" in msg, msg
    res = precast.convert(Recipe(), {"input_ids": ids, "cache_position": pos}, policy="torch")
    assert res.report.verification["bitwise"]


class Counted(nn.Module):
    """A cache layer with a length counter, written as transformers' StaticLayer writes it: ``copy_`` of the
    start position and ``add_`` of the (static) number of new positions, then ``index_copy_`` of a Linear's
    output (cast back to fp32, so eager autocast runs it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = [Layer()]
        self.layers[0].length = torch.tensor(0)

    def forward(self, x, pos):
        layer = self.layers[0]
        layer.length.copy_(pos[0])
        layer.length.add_(x.shape[1])
        layer.keys.index_copy_(1, pos, self.lin(x).float())
        return layer.keys * 2 + layer.length


def test_capture_never_writes_the_callers_tensors():
    """Non-strict torch.export itself writes the tensors it lifts (torch 2.13: the counter ends at the traced
    length, the keys come out with requires_grad=True); precast exports private clones, so a static-shape
    conversion leaves the caller's module exactly as it was."""
    torch.manual_seed(0)
    x, pos = example()
    exported = Counted()
    torch.export.export(exported, (x, pos), strict=False)
    wrote = int(exported.layers[0].length) != 0 or exported.layers[0].keys.requires_grad
    model = Counted()
    layer = model.layers[0]
    keys, length = layer.keys, layer.length
    res = precast.convert(model, (x, pos), policy="torch")
    assert res.report.verification["bitwise"], res.report.verification
    assert layer.keys is keys and layer.length is length
    assert not keys.any() and int(length) == 0 and not keys.requires_grad and keys._version == 0
    if not wrote:
        pytest.skip(
            "this torch's export no longer writes lifted constants (the capture guard is still checked)"
        )


def test_capture_leaves_views_and_parameters_shared():
    """What capture swaps: plain tensors the module holds alone; a buffer that views another tensor's storage
    (separate clones would lose the aliasing) and the parameters (read-only weights) stay the caller's."""
    from precast.ir.module_state import private_tensors

    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("whole", torch.zeros(8))
            self.register_buffer("head", self.whole[:4])
            self.alone = torch.ones(3)

    model = Viewed()
    with private_tensors(model) as origins:
        assert model.lin.weight is not None and id(model.lin.weight) not in origins
        assert origins[id(model.alone)] is not model.alone  # a clone in place of the caller's tensor
        assert id(model.whole) not in origins and id(model.head) not in origins
        swapped = model.alone
    assert model.alone is not swapped and torch.equal(model.alone, torch.ones(3))


class LinearCached(nn.Module):
    """A Linear's output written into an fp32 cache held by a plain object (transformers' value cache): under
    autocast the value arrives bf16."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = [Layer()]

    def forward(self, x, pos):
        self.layers[0].keys.index_copy_(1, pos, self.lin(x))
        return self.layers[0].keys.sum(-1)


def test_policy_torch_module_route_casts_the_value_at_the_write():
    """Captured under autocast, the program records a bf16 value written into the fp32 cache: that mismatch
    is the policy's (the autocast region capture opened), cast at the write as on the program route; the
    reference (eager autocast of the module, the same rule at the write) agrees bitwise."""
    torch.manual_seed(0)
    model = LinearCached().eval()
    keys = model.layers[0].keys
    x, pos = example()
    res = precast.convert(model, (x, pos), policy="torch", dynamic_shapes=DYNAMIC)
    assert [d.code for d in res.report.diagnostics] == ["write-cast"], res.report.diagnostics
    v = res.report.verification
    assert v["bitwise"] and v["reference"] == "eager torch.autocast of the module (cpu, bf16)", v
    assert model.layers[0].keys is keys and not keys.any()
