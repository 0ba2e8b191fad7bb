"""Weights stored as int8 / int4 (``weight_format=``) on OpenVINO: run compressed by its CPU plugin, asserted from the
compiled model's runtime graph (``precast/backends/openvino/compressed.py``, ``weight_forms.py``).

The programs are small (an embedding and two linears; the KV-cache decoder of ``test_openvino_kv``), converted with
``weight_format=`` and policy None (fp32 compute, so OpenVINO's kernels are compared with torch's alone), compiled
with the f32 hint. Reference: the converted program run eagerly (the dequantized weights, computed in the graph).
Tolerance: 1e-5 relative to the output's largest magnitude, as the other fp32 OpenVINO tests (measured: <= 6e-7).

OpenVINO's CPU plugin compresses a FullyConnected only on x86 with AVX2 (``isSupportedCompressedOperation``): the
tests that assert compression skip elsewhere.
"""

from __future__ import annotations

import copy
import functools
import platform
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import precast  # noqa: E402
from precast.backends.openvino.compressed import (  # noqa: E402
    CompressedWeightWarning,
    compressed_layers,
    decompression_nodes,
    stored_weights,
)
from precast.backends.openvino.convert import _decomposed  # noqa: E402
from precast.backends.openvino.plan_check import PlanOverrideWarning  # noqa: E402
from precast.backends.openvino.weight_forms import int4_rows_from_table, restack_nibbles  # noqa: E402
from precast.cpu import flags  # noqa: E402
from tests.backends.openvino.test_growing_cache import CachedAttention, export, steps  # noqa: E402
from tests.backends.openvino.test_growing_cache import E as KV_E  # noqa: E402

aten = torch.ops.aten
AVX2 = platform.machine().lower() in ("x86_64", "amd64") and "avx2" in (flags() or ())
needs_avx2 = pytest.mark.skipif(not AVX2, reason="OpenVINO's CPU plugin compresses weights on x86 with AVX2")
V, E, H = 64, 32, 64
PRECISION = {"int8": "i8", "int8-asym": "u8", "int4-g32": "u4"}


class Tiny(torch.nn.Module):
    """An embedding, then two linears."""

    def __init__(self, n_in: int = E, hidden: int = H, n_out: int = E):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, n_in)
        self.up = torch.nn.Linear(n_in, hidden)
        self.down = torch.nn.Linear(hidden, n_out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(ids))))


def ids(batch: int = 2, seq: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def converted(
    module: torch.nn.Module, fmt: str, policy: str | None = None, **options
) -> torch.export.ExportedProgram:
    ep = torch.export.export(module, (ids(),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precast.convert(ep, (ids(),), policy=policy, weight_format=fmt, **options).program


@functools.cache
def tiny(fmt: str) -> tuple[torch.export.ExportedProgram, Any, list]:
    """``Tiny`` converted with ``fmt`` and compiled (shared by the tests that only read it)."""
    program = converted(Tiny(), fmt)
    return (program, *compiled(program))


def compiled(program: torch.export.ExportedProgram, **options):
    """Compiled with the f32 hint and the program's own activations (``dynamic_quantization=False``, unless given:
    the default quantizes int4 layers' activations, ``test_dynamic_quantization_follows_openvinos_own_exports``),
    the warnings it gave (other than torch's deprecations) recorded."""
    options.setdefault("dynamic_quantization", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = precast.compile(program, backend="openvino", precision_hint="f32", **options)
    return model, [
        w for w in caught if issubclass(w.category, (CompressedWeightWarning, PlanOverrideWarning))
    ]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6)


def runtime(model) -> dict[str, tuple[str, str, list[str]]]:
    """Runtime layer -> (layer type, runtimePrecision, its input element types)."""
    out = {}
    for op in model.compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        types = [op.get_input_element_type(i).get_type_name() for i in range(op.get_input_size())]
        out[op.get_friendly_name()] = (
            info["layerType"].astype(str),
            info["runtimePrecision"].astype(str),
            types,
        )
    return out


@needs_avx2
@pytest.mark.parametrize("fmt", ["int8", "int8-asym", "int4-g32"])
def test_linears_and_embedding_run_compressed(fmt):
    """Every stored weight is read compressed: two FullyConnected layers reading the i8 / u8 / u4 constant (their
    runtimePrecision the weight's type, their activations f32), one Gather of the i8 / u4 table; outputs as the
    program computes them in torch; no warning; the compressed layers are checked against the plan in f32."""
    program, model, caught = tiny(fmt)
    assert caught == []
    want = PRECISION[fmt]
    assert model.compressed == {"emb.weight": want, "up.weight": want, "down.weight": want}
    assert model.weights.uncompressed == [] and model.weights.complete
    layers = runtime(model)
    kinds = sorted(layers[name][0] for name in compressed_layers(model.compiled))
    # int8-asym's embedding gathers its u8 zero points as well as its u8 rows
    assert kinds == ["FullyConnected", "FullyConnected", "Gather"] + ["Gather"] * (fmt == "int8-asym")
    for name, precision in compressed_layers(model.compiled).items():
        layer, runs, inputs = layers[name]
        assert precision == want
        if layer == "FullyConnected":
            assert runs == want and inputs[0] == "f32" and inputs[1] == want
    checked = {layer.layer for layer in model.plan.layers}
    assert {n for n, (kind, _, _) in layers.items() if kind == "FullyConnected"} <= checked
    assert model.plan.overridden == []
    for x in (ids(), ids(seed=2)):
        assert close(model(x), program.module()(x))


@needs_avx2
def test_a_bf16_plan_keeps_its_decompression_out_of_the_plan_check():
    """policy torch in bf16 with int8 weights: the weights run compressed, and no layer the plan check holds to a
    dtype runs a node of a weight's decompression (its casts, its multiply). Without native bf16 the bf16
    linears run in f32 under the f32 hint and are reported so; the decompression never is."""
    program = converted(Tiny(), "int8", policy="torch", dtype=torch.bfloat16)
    model, caught = compiled(program)
    assert not [w for w in caught if w.category is CompressedWeightWarning]
    assert set(model.compressed.values()) == {"i8"} and len(model.compressed) == 3
    gm = _decomposed(program).module()
    skip = decompression_nodes(gm)
    assert skip  # the weights' casts and multiplies
    decided = {name for layer in model.plan.layers for name in layer.nodes}
    assert not decided & skip
    for layer in model.plan.overridden:
        assert layer.layer_type == "FullyConnected" and layer.planned == ("bf16",)
    got, want = model(ids()), program.module()(ids())
    assert (got.float() - want.float()).abs().max() <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max()


def constant_ops(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The ops of ``program`` computed from its constants alone (a stored weight's decompression)."""
    users = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    constant: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if (node.op == "placeholder" and node.name not in users) or (
            node.op == "call_function"
            and node.all_input_nodes
            and all(a in constant for a in node.all_input_nodes)
        ):
            constant.add(node)
    return [n for n in program.graph.nodes if n in constant and n.op == "call_function"]


@needs_avx2
def test_weights_openvino_does_not_compress_are_one_warning_line_and_not_overrides():
    """A FullyConnected with fewer than 4 input channels (``up``: 2) or one output channel (``down``): OpenVINO's CPU
    plugin decompresses the weight once into an f32 copy, its casts and multiply run as layers of their own on
    constants. One CompressedWeightWarning line names them, ``model.weights.uncompressed`` lists them, the table
    still runs compressed, and the outputs are the program's. The decompression's nodes, here decided bf16 (which
    OpenVINO computes in f32), are no plan override: the plan check leaves them out."""
    program = converted(Tiny(n_in=2, n_out=1), "int8")
    decided = [node.name for node in constant_ops(program) if node.target is aten.mul.Tensor]
    assert len(decided) == 2  # each linear's decompression
    for node in constant_ops(program):
        node.meta.setdefault("custom", {})["precast"] = {"decision": {"dtype": "bf16", "name": node.name}}
    gm = _decomposed(program).module()  # what OpenVINO converts: the decisions on the decompression's nodes
    skip = decompression_nodes(gm)
    marked = [n for n in gm.graph.nodes if n.name in skip and (n.meta.get("custom") or {}).get("precast")]
    assert sum(n.target is aten.mul.Tensor for n in marked) == 2
    model, caught = compiled(program)
    lines = [str(w.message) for w in caught if w.category is CompressedWeightWarning]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "2 of 3" in lines[0] and "up.weight" in lines[0] and "down.weight" in lines[0]
    assert sorted(r.weight for r in model.weights.uncompressed) == ["down.weight", "up.weight"]
    assert model.compressed == {"emb.weight": "i8"}
    layers = runtime(model)
    assert any(kind == "Eltwise" for kind, _, _ in layers.values())  # a decompression's multiply, on its own
    assert not [w for w in caught if w.category is PlanOverrideWarning] and model.plan.overridden == []
    for x in (ids(), ids(seed=3)):
        assert close(model(x), program.module()(x))


@needs_avx2
def test_the_kv_cache_decoder_runs_compressed():
    """The decoder of test_openvino_kv with its projections stored in 8 and 4 bits (``q`` int8, ``o`` int8-asym,
    ``kv`` int4): its cache becomes OpenVINO's growing state fused with attention, its three projections run compressed,
    and each decode step is what the converted program computes run eagerly step by step."""
    formats = {"q.*": "int8", "kv.*": "int4-g32", "o.*": "int8-asym"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = precast.convert(
            export(CachedAttention()),
            (torch.randn(1, 3, KV_E), torch.arange(3)),
            policy=None,
            weight_format=formats,
        ).program
    model, caught = compiled(program)
    assert caught == []
    assert model.growing is not None
    assert model.compressed == {"q.weight": "i8", "kv.weight": "u4", "o.weight": "u8"}
    eager = copy.deepcopy(program).module()
    model.reset()
    with torch.no_grad():
        for x, pos in steps():
            assert close(model(x, pos), eager(x, pos))


@needs_avx2
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_dynamic_quantization_follows_openvinos_own_exports(fmt):
    """By default (``dynamic_quantization=None``) OpenVINO quantizes a compressed layer's activations to 8 bits on
    the fly where the program stores int4 weights (as OpenVINO's own int4 export runs them: its fast int4 kernels)
    and not with int8 only (precast compiles with DYNAMIC_QUANTIZATION_GROUP_SIZE 0, carried by the saved IR too);
    the report says which. ``True`` / ``False`` force it. Before: off for every format."""
    import openvino as ov

    default = ov.Core().get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
    program = converted(Tiny(), fmt)
    auto = precast.compile(program, backend="openvino", precision_hint="f32", warn=False)
    on = precast.compile(
        program, backend="openvino", precision_hint="f32", dynamic_quantization=True, warn=False
    )
    off = precast.compile(
        program, backend="openvino", precision_hint="f32", dynamic_quantization=False, warn=False
    )
    int4 = fmt.startswith("int4")
    assert auto.dynamic_quantization is int4 and on.dynamic_quantization and not off.dynamic_quantization
    assert auto.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == (default if int4 else 0)
    assert on.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == default
    assert off.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
    assert off.ov_model.get_rt_info(["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"]).astype(str) == "0"
    assert auto.weights.activations.startswith("on: 3 int4" if int4 else "off: int8 weights only")
    assert "8-bit activations on the fly: " in auto.weights.summary()
    want = program.module()(ids())
    assert close(off(ids()), want)  # the program's own activations
    # 8-bit activations in groups of 32: within 3% of the output's range here (measured 0.3-1%; exact where the
    # CPU has no VNNI, which OpenVINO needs for it)
    assert float((auto(ids()) - want).abs().max()) <= 0.03 * float(want.abs().max())
    with pytest.raises(precast.PrecastError, match="dynamic_quantization="):
        precast.compile(program, backend="openvino", dynamic_quantization=32)


def test_the_rewrites_compute_the_same_values_bitwise():
    """Before OpenVINO converts it: the int4 linear's unpack, decomposed to unsqueeze + cat, is a stack again, and the
    int4 embedding gathers from the dequantized table instead of dequantizing gathered rows; the program computes
    the same values bitwise, and the stored weights are found through either form."""
    program, _, _ = tiny("int4-g32")
    before = _decomposed(program).module()
    after = copy.deepcopy(before)
    assert int4_rows_from_table(after) == 1 and restack_nibbles(after) == 2
    targets = [n.target for n in after.graph.nodes]
    assert targets.count(aten.stack.default) == 3 and aten.cat.default not in targets
    assert [r.kind for r in stored_weights(after)] == ["embedding", "linear", "linear"]
    assert {r.precision for r in stored_weights(after)} == {"u4"}
    for x in (ids(), ids(seed=4)):
        assert torch.equal(after(x), before(x))
