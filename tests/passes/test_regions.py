"""policy=None: the program's own autocast regions, lowered to explicit casts (issue: foundation)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.export import Dim

import precast
from precast.ir.regions import WRAP_AUTOCAST
from tests import models
from tests.helpers import assert_bitwise, casts_per_producer, constant_casts

REGION_FACTORIES = {
    **models.REGION_MODELS,
    "decorated": models.decorated,
    "other_device": models.other_device,
    "views_of_weights": models.views_of_weights,
}


@pytest.fixture(scope="module", params=sorted(REGION_FACTORIES))
def converted(request):
    model, inputs = REGION_FACTORIES[request.param]()
    ep = torch.export.export(model, inputs)
    res = precast.convert(ep)
    return request.param, model, inputs, ep, res


def test_bitwise_equal_to_unconverted_program(converted):
    name, _, inputs, ep, res = converted
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), ep.module()(*inputs))
    assert res.report.verification["bitwise"], res.report.verification


def test_no_regions_left_and_no_constant_casts_after_decompositions(converted):
    name, _, inputs, ep, res = converted
    assert not any(n.target is WRAP_AUTOCAST for n in res.program.graph.nodes)
    before = constant_casts(ep.run_decompositions())
    after_ep = res.program.run_decompositions()
    assert constant_casts(after_ep) == []
    if name not in ("other_device",):  # a CUDA region on CPU casts nothing to begin with
        assert before, (
            "the unconverted program should cast weights at run time (else this test proves nothing)"
        )
    # decompositions change numerics on their own (layer_norm, sdpa): compare like with like
    with torch.no_grad():
        assert_bitwise(after_ep.module()(*inputs), ep.run_decompositions().module()(*inputs))


def test_io_dtypes_unchanged(converted):
    _, _, inputs, ep, res = converted

    def io_dtypes(p):
        ins = [
            n.meta["val"].dtype
            for n in p.graph.nodes
            if n.op == "placeholder" and n.name in p.graph_signature.user_inputs
        ]
        outs = [a.meta["val"].dtype for a in p.graph.output_node().args[0]]
        return ins, outs

    assert io_dtypes(res.program) == io_dtypes(ep)


def test_one_cast_per_producer_and_dtype(converted):
    _, _, _, _, res = converted
    assert all(c == 1 for c in casts_per_producer(res.program).values()), casts_per_producer(res.program)


def test_save_load_round_trip(converted):
    _, _, inputs, ep, res = converted
    buf = io.BytesIO()
    torch.export.save(res.program, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    with torch.no_grad():
        assert_bitwise(loaded.module()(*inputs), ep.module()(*inputs))
    assert precast.constant_sources(loaded) == precast.constant_sources(res.program)
    rebuilt = precast.report(loaded)
    assert {n.name: n.dtype for n in rebuilt.nodes} == {n.name: n.dtype for n in res.report.nodes}


def test_weights_stored_once_per_dtype_with_recognizable_names():
    model, inputs = models.shared_weight()
    res = precast.convert(model, inputs)
    sd = res.program.state_dict
    # proj.weight is read in fp32 (outside the region) and in bf16 (twice inside): one copy of each
    assert sd["proj.weight"].dtype == torch.float32
    low = [k for k, v in sd.items() if v.dtype == torch.bfloat16]
    assert sorted(low) == ["proj.bias_bf16", "proj.weight_bf16"]
    src = precast.constant_sources(res.program)
    assert src["proj.weight_bf16"].original == "proj.weight"
    assert src["proj.weight_bf16"].original_dtype == torch.float32
    assert src["proj.weight_bf16"].dtype == torch.bfloat16
    assert res.report.constants_dropped == []


def test_fully_cast_weights_keep_their_names_and_halve_memory():
    model, inputs = models.mlp(batch=1)
    res = precast.convert(model, inputs)
    sd = res.program.state_dict
    assert sorted(sd) == sorted(model.state_dict())
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    before = sum(res.report.weight_bytes_before.values())
    after = sum(res.report.weight_bytes_after.values())
    assert after * 2 == before
    assert all(s.original == s.stored for s in precast.constant_sources(res.program).values())


def test_tied_weights_cast_once():
    model, inputs = models.tied()
    res = precast.convert(model, inputs)
    sd = res.program.state_dict
    # export keeps one name for the tied parameter; the embedding reads it in fp32 outside the region and the
    # tied head reads it in bf16: one fp32 and one bf16 copy
    ep = torch.export.export(model, inputs)
    read = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    specs = ep.graph_signature.input_specs
    (tied_name,) = [
        s.target for s in specs if s.target in ("emb.weight", "out.weight") and s.arg.name in read
    ]
    assert set(sd) >= {"emb.weight", "out.weight"}  # both names of the tied parameter stay
    assert sd[tied_name].dtype == torch.float32
    copies = [s for s in precast.constant_sources(res.program).values() if s.original == tied_name]
    assert sorted(str(c.dtype) for c in copies) == ["torch.bfloat16", "torch.float32"]
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), model(*inputs))


def test_buffers_fold_into_buffers_and_constants():
    model, inputs = models.buffer_model()
    ep = torch.export.export(model, inputs)
    res = precast.convert(ep)
    kinds = {s.target: s.kind.name for s in res.program.graph_signature.input_specs if s.target}
    assert kinds["basis"] == "BUFFER" and res.program.state_dict["basis"].dtype == torch.bfloat16
    assert kinds["mix"] == "BUFFER" and res.program.constants["mix"].dtype == torch.bfloat16
    assert res.program.constants["scale"].dtype == torch.float32  # read by mul (no autocast): never cast
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), ep.module()(*inputs))


def test_views_of_weights_are_cast_at_the_source():
    model, inputs = models.views_of_weights()
    res = precast.convert(model, inputs)
    assert constant_casts(res.program) == []
    sd = res.program.state_dict
    assert sd["w"].dtype == torch.bfloat16 and sd["k"].dtype == torch.bfloat16
    t_nodes = [n for n in res.program.graph.nodes if n.target is torch.ops.aten.t.default]
    assert len(t_nodes) == 1, "w.t() and its cast are shared between the two uses"


def test_dynamic_batch_dimension():
    model, inputs = models.small_mlp(batch=4)
    ep = torch.export.export(model, inputs, dynamic_shapes=({0: Dim("batch", min=1, max=64)},))
    res = precast.convert(ep)
    assert res.program.range_constraints.keys() == ep.range_constraints.keys()
    for batch in (1, 7, 33):
        x = torch.randn(batch, 64)
        with torch.no_grad():
            assert_bitwise(res.program.module()(x), ep.module()(x))


def test_module_input_is_exported_non_strict_with_dynamic_shapes():
    model, inputs = models.small_mlp(batch=4)
    res = precast.convert(model, inputs, dynamic_shapes=({0: Dim.AUTO},))
    with torch.no_grad():
        x = torch.randn(9, 64)
        assert_bitwise(res.program.module()(x), model(x))


def test_nested_and_disabled_regions_dtypes():
    model, inputs = models.nested()
    res = precast.convert(model, inputs)
    linears = [n for n in res.report.nodes if n.op == "aten.linear.default"]
    # a (bf16 region), b (disabled: fp32), c inside nested fp16 region, c again in the bf16 region
    assert [n.dtype for n in linears] == ["bf16", "fp32", "fp16", "bf16"]
    assert linears[1].rule == "disabled"
    assert {r["dtype"] for r in res.report.regions} == {"bf16", "fp16"}


def test_program_without_regions_is_returned_unchanged():
    model, inputs = models.plain_mlp()
    ep = torch.export.export(model, inputs)
    res = precast.convert(ep)
    assert res.program is ep
    assert any(d.code == "no-regions" for d in res.report.diagnostics)


def test_converted_program_compiles_with_inductor_aot_compatible_graph():
    # the converted graph holds only standard aten ops and placeholders: run_decompositions() to core ATen works
    model, inputs = models.cnn()
    res = precast.convert(model, inputs)
    core = res.program.run_decompositions()
    targets = {str(n.target) for n in core.graph.nodes if n.op == "call_function"}
    assert "higher_order.wrap_with_autocast" not in " ".join(targets)
    with torch.no_grad():
        assert_bitwise(
            core.module()(*inputs), torch.export.export(model, inputs).run_decompositions().module()(*inputs)
        )


def test_unsupported_dtype_and_policy_are_one_line_errors():
    model, inputs = models.small_mlp()
    with pytest.raises(precast.PrecastError, match="bfloat16 or torch.float16"):
        precast.convert(model, inputs, dtype=torch.float64)
    with pytest.raises(precast.PrecastError, match="policy='fast'"):
        precast.convert(model, inputs, policy="fast")
    with pytest.raises(precast.PrecastError, match="needs example_inputs"):
        precast.convert(model)
