"""``convert``'s options as typed records (issue 51 item 4): at most 16 parameters; the weights, cache, I/O and
verification records exported from ``precast``; the rules' options on ``RulesPolicy`` only. Each keyword of the
release before still works for one release: it warns (a ``FutureWarning`` naming its new place) and converts to
the bitwise same program as the record form; and to a program other than the one without it (the keyword is
honoured, not dropped). A record of the wrong type, or a concern given twice, is refused in one line."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import precast
from precast.errors import PrecastError
from precast.pipeline.records import SHORTCUTS
from precast.policy.resolve import RULE_OPTIONS
from tests.helpers import assert_bitwise


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return torch.softmax(self.b(torch.relu(self.norm(self.a(x)))), -1)


X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))


def keep_linear_a(node, context):
    return "mine" if node.name == "linear" else None


# old keyword -> (its value, the record form's arguments); the rules' options under policy "rules"
RULES = {
    "exclude_nodes": ["linear_1"],
    "exclude_ops": [torch.ops.aten.linear],
    "include_nodes": ["softmax"],
    "include_ops": [torch.ops.aten.softmax],
    "data_max": 1.0,
    "init_max": 0.5,
    "max_reduction_depth": 4,
    "calibration": [(X * 10,)],  # activations over data_max=20 (not on X): those ops stay fp32
    "tolerance": {"rel": 1.7e-3},  # all low measures 1.8e-3 here: some ops go back to fp32
    "custom_rules": [keep_linear_a],
    "patterns": (),
}
OTHERS = {
    "keep_io_types": (False, {"io": precast.IOOptions(keep_types=False)}),
    "weight_format": ("int8", {"weights": precast.WeightOptions(format="int8")}),
}
SAME_AS_DEFAULT = {"patterns"}  # the small model has none of the patterns: the same program either way
# every op runs low by default here: an inclusion shows over an exclusion (inclusions win), given in both forms
UNDER = {"include_nodes": {"exclude_ops": [torch.ops.aten.softmax]}}
UNDER["include_ops"] = UNDER["include_nodes"]
UNDER["calibration"] = {"data_max": 20.0}


def same_program(a: torch.export.ExportedProgram, b: torch.export.ExportedProgram) -> None:
    """Bitwise the same program: graph, every state tensor (dtype and values), outputs on the input."""
    assert a.graph_module.code == b.graph_module.code
    sa, sb = {**a.state_dict, **a.constants}, {**b.state_dict, **b.constants}
    assert sa.keys() == sb.keys()
    for k in sa:
        assert_bitwise(sa[k], sb[k])
    with torch.no_grad():
        assert_bitwise(a.module()(X), b.module()(X))


def differs(a: torch.export.ExportedProgram, b: torch.export.ExportedProgram) -> bool:
    try:
        same_program(a, b)
    except AssertionError:
        return True
    return False


def test_convert_takes_at_most_16_parameters():
    params = inspect.signature(precast.convert).parameters
    assert len(params) <= 16, list(params)
    assert not set(params) & set(RULE_OPTIONS)  # the rules' options are the policy's fields
    for name in ("WeightOptions", "CacheOptions", "IOOptions", "VerifyOptions"):
        record = getattr(precast, name)
        assert name in precast.__all__ and record.__doc__
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen


@pytest.fixture(scope="module")
def reference():
    model = Small().eval()
    return model, precast.convert(model, (X,), policy="rules", dtype="bf16", verify=False).program


@pytest.mark.parametrize("name", list(RULES))
def test_each_rules_keyword_warns_and_converts_as_the_policy_field(reference, name):
    model, default = reference
    under = UNDER.get(name, {})
    given = {**under, name: RULES[name]}
    with pytest.warns(FutureWarning, match=rf"convert\({name}=\).*precast\.RulesPolicy\({name}=\.\.\.\)"):
        old = precast.convert(model, (X,), policy="rules", dtype="bf16", verify=False, **given)
    new = precast.convert(model, (X,), policy=precast.RulesPolicy(**given), dtype="bf16", verify=False)
    same_program(old.program, new.program)
    if under:
        default = precast.convert(
            model, (X,), policy=precast.RulesPolicy(**under), dtype="bf16", verify=False
        ).program
    assert differs(old.program, default) != (name in SAME_AS_DEFAULT)


@pytest.mark.parametrize("name", list(OTHERS))
def test_each_other_keyword_warns_and_converts_as_its_record(reference, name):
    model, default = reference
    value, record = OTHERS[name]
    new_name, field = SHORTCUTS[name]
    with pytest.warns(FutureWarning, match=rf"convert\({name}=\).*{new_name}=precast\.\w+\({field}=\.\.\.\)"):
        old = precast.convert(model, (X,), policy="rules", dtype="bf16", verify=False, **{name: value})
    new = precast.convert(model, (X,), policy="rules", dtype="bf16", verify=False, **record)
    same_program(old.program, new.program)
    assert differs(old.program, default)


def test_dynamic_shapes_warns_and_exports_as_the_io_record():
    model = Small().eval()
    dims = {"x": {0: torch.export.Dim("batch", max=64)}}
    with pytest.warns(
        FutureWarning, match=r"convert\(dynamic_shapes=\).*io=precast\.IOOptions\(dynamic_shapes"
    ):
        old = precast.convert(model, (X,), policy="torch", dynamic_shapes=dims).program
    new = precast.convert(model, (X,), policy="torch", io=precast.IOOptions(dynamic_shapes=dims)).program
    same_program(old, new)
    assert old.range_constraints and old.range_constraints == new.range_constraints
    assert not precast.convert(model, (X,), policy="torch").program.range_constraints  # static without
    with torch.no_grad():
        assert new.module()(X[:5]).shape == (5, 4)


def test_cache_dtype_warns_and_holds_the_cache_as_the_cache_record():
    from tests.passes.test_cache_writes import TinyDecoder, steps

    ids, pos = steps(1)[0]
    with pytest.warns(
        FutureWarning, match=r"convert\(cache_dtype=\).*cache=precast\.CacheOptions\(dtype=\.\.\.\)"
    ):
        old = precast.convert(TinyDecoder(), (ids, pos), policy="torch", cache_dtype="bf16", verify=False)
    new = precast.convert(
        TinyDecoder(), (ids, pos), policy="torch", cache=precast.CacheOptions(dtype="bf16"), verify=False
    )
    assert old.program.graph_module.code == new.program.graph_module.code
    held = {
        k: v.dtype for k, v in {**old.program.state_dict, **old.program.constants}.items() if "cache" in k
    }
    assert held == {
        k: v.dtype for k, v in {**new.program.state_dict, **new.program.constants}.items() if "cache" in k
    }
    assert set(held.values()) == {torch.bfloat16}  # honoured: the caches are fp32 in the module
    with torch.no_grad():
        assert_bitwise(old.program.module()(ids, pos), new.program.module()(ids, pos))


def test_streamed_weights_path_warns_and_writes_as_the_weights_record(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = Small().eval()
    safetensors_torch.save_file(
        {k: v.detach() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors"
    )
    ep = precast.export_weightless(Small(), (X,))
    with pytest.warns(FutureWarning) as caught:
        old = precast.convert(
            ep, policy="torch", weights=tmp_path / "w.safetensors", weights_out=tmp_path / "old"
        )
    said = [str(w.message) for w in caught if w.category is FutureWarning]
    assert any("weights=precast.WeightOptions(files=PATH" in s for s in said)
    assert any("convert(weights_out=)" in s and "WeightOptions(out=...)" in s for s in said)
    record = precast.WeightOptions(files=tmp_path / "w.safetensors", out=tmp_path / "new")
    new = precast.convert(ep, policy="torch", weights=record)
    assert old.program.graph_module.code == new.program.graph_module.code
    files = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "new").iterdir()) and files
    for name in files:
        assert (tmp_path / "old" / name).read_bytes() == (tmp_path / "new" / name).read_bytes()
    ran = precast.with_weights(new.program, tmp_path / "new").module()(X)
    assert_bitwise(ran, precast.convert(model, (X,), policy="torch", verify=False).program.module()(X))


def test_verify_false_is_the_verify_record():
    model = Small().eval()
    off = precast.convert(model, (X,), policy="torch", verify=precast.VerifyOptions(enabled=False))
    assert not off.report.verification
    assert not precast.convert(model, (X,), policy="torch", verify=False).report.verification
    assert precast.convert(model, (X,), policy="torch").report.verification["bitwise"] is True


@pytest.mark.parametrize(
    "given, message",
    [
        ({"cache": "bf16"}, "cache='bf16': give a precast.CacheOptions(...) or None"),
        ({"io": {"keep_types": False}}, "io={'keep_types': False}: give a precast.IOOptions(...) or None"),
        ({"weights": 3}, "weights=3: give a precast.WeightOptions(...)"),
        ({"verify": "no"}, "verify='no': give True, False or a precast.VerifyOptions(...)"),
        ({"verify": None}, "verify=None: give True, False or a precast.VerifyOptions(...)"),
        (
            {"io": precast.IOOptions(), "keep_io_types": True},
            "keep_io_types= and io=IOOptions(keep_types=None, dynamic_shapes=None) both given",
        ),
        (
            {"weights": precast.WeightOptions(format="int8"), "weight_format": "int4"},
            "weight_format= and weights=WeightOptions(",
        ),
        ({"cache": precast.CacheOptions(), "cache_dtype": "bf16"}, "cache_dtype= and cache=CacheOptions("),
    ],
)
def test_a_wrong_record_or_a_concern_given_twice_is_one_line(given, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    with pytest.raises(PrecastError, match=pattern) as e:  # refused before any keyword warns
        precast.convert(Small().eval(), (X,), **given)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "record, message",
    [
        (
            lambda: precast.CacheOptions(dtype="int8"),
            "CacheOptions(dtype='int8'): give 'bf16', 'fp16', 'fp32'",
        ),
        (lambda: precast.IOOptions(keep_types=1), "IOOptions(keep_types=1): give True, False or None"),
        (lambda: precast.VerifyOptions(enabled="yes"), "VerifyOptions(enabled='yes'): give True or False"),
        (lambda: precast.WeightOptions(files=3), "WeightOptions(files=3): give a path"),
    ],
)
def test_a_bad_record_field_is_refused_where_it_is_made(record, message):
    with pytest.raises(PrecastError, match=message.replace("(", r"\(").replace(")", r"\)")):
        record()


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'fallback'"):
        precast.convert(Small().eval(), (X,), fallback=1)
