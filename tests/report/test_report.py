"""Report: per-node records, cast bytes, save/load round trip, JSON schema, Model Explorer data, the table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from rich.console import Console

import precast
from precast.report.render import model_explorer_data, render_table
from tests import models as zoo

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "report.schema.json").read_text())


@pytest.fixture(scope="module")
def seed():
    model, inputs = zoo.seed_model()
    return precast.convert(model, inputs)


def test_records_dtype_reason_module_and_source(seed):
    rep = seed.report
    lin1 = rep.node("linear")
    assert (lin1.dtype, lin1.source, lin1.rule, lin1.module) == (
        "bf16",
        "region",
        "lower_precision_fp",
        "sub.linear1",
    )
    assert lin1.location.endswith("examples.py:29")
    out = rep.node("linear_2")
    assert (out.dtype, out.module) == ("fp32", "output")


def test_cast_bytes_from_meta_shapes(seed):
    rep = seed.report
    # input cast fp32->bf16 of (4, 128) and the .float() back: 512 * (4 + 2) bytes each
    assert rep.casts_runtime == len(rep.casts) == 2
    assert [c.bytes for c in rep.casts] == [4 * 128 * 6] * 2
    assert rep.cast_bytes == 2 * 4 * 128 * 6
    assert (
        rep.weight_bytes_after["bf16"] * 2 == rep.weight_bytes_before["fp32"] - rep.weight_bytes_after["fp32"]
    )


def test_cast_bytes_symbolic_dims_use_the_hint():
    model, (x,) = zoo.seed_model()
    ep = torch.export.export(
        model, (torch.randn(6, 128),), dynamic_shapes=({0: torch.export.Dim("b", min=2)},)
    )
    rep = precast.convert(ep).report
    assert all(c.symbolic for c in rep.casts)
    assert [c.shape for c in rep.casts] == [[6, 128]] * 2


def test_report_survives_save_and_load(seed, tmp_path):
    path = tmp_path / "seed.pt2"
    torch.export.save(seed.program, str(path))
    rep = precast.report(torch.export.load(str(path)))
    assert [n.name for n in rep.nodes] == [n.name for n in seed.report.nodes]
    assert rep.node("linear").reason == seed.report.node("linear").reason
    assert rep.cast_bytes == seed.report.cast_bytes
    assert rep.weight_bytes_before == seed.report.weight_bytes_before
    assert rep.verification["bitwise"]


def test_saved_report_keeps_diagnostics(tmp_path):
    from tests.ir.test_diagnostics import CudaRegion

    res = precast.convert(CudaRegion().eval(), (torch.randn(2, 8),))
    path = tmp_path / "cuda.pt2"
    torch.export.save(res.program, str(path))
    rep = precast.report(torch.export.load(str(path)))
    assert [d.code for d in rep.diagnostics] == ["noop-region"]


def test_json_validates_against_schema(seed):
    data = json.loads(seed.report.to_json())
    jsonschema.validate(data, SCHEMA)
    assert data["schema_version"] == 1
    assert data["cast_bytes"] == seed.report.cast_bytes


def test_json_with_diagnostics_validates():
    from tests.ir.test_diagnostics import Flag

    res = precast.convert(Flag().eval(), (torch.randn(2, 8), True))
    data = json.loads(res.report.to_json())
    jsonschema.validate(data, SCHEMA)
    assert data["diagnostics"][0]["code"] == "unused-enabled-input"


def test_schema_rejects_a_broken_report(seed):
    data = json.loads(seed.report.to_json())
    del data["nodes"][0]["dtype"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


def test_model_explorer_node_data(seed):
    data = model_explorer_data(seed.report)
    graph_ids = {n.name for n in seed.program.graph.nodes}
    # validated with the real ai-edge-model-explorer package (its data classes, its adapter's node ids, a
    # rendered page) in tests/report/test_model_explorer.py
    # the documented format: {graph id: {"results": {node id: {"value": number, "bgColor"?: str}}, ...}}
    assert list(data) == ["graph"]  # the id the PyTorch ExportedProgram adapter gives the graph
    results = data["graph"]["results"]
    assert set(results) <= graph_ids  # node ids: the adapter uses fx node names
    assert results["linear"]["value"] == 16 and results["linear_2"]["value"] == 32
    assert {c.name for c in seed.report.casts} <= set(results)
    for r in results.values():
        assert isinstance(r["value"], (int, float)) and set(r) <= {"value", "bgColor", "textColor"}
    for t in data["graph"]["thresholds"]:
        assert set(t) <= {"value", "bgColor", "textColor"}


def test_table_has_every_node_with_dtype_and_reason(seed):
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    render_table(seed.report, console)
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 4}
    for rec in seed.report.nodes:
        row = rows[rec.name]
        cells = [c.strip() for c in row.split("│")]
        assert cells[3] == (rec.dtype or "-")
        assert f"{rec.source}/{rec.rule}" in cells[4]
    # grouped by module: the module header precedes its nodes
    order = [line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 4]
    assert (
        order.index("sub.linear1") < order.index("linear") < order.index("output") < order.index("linear_2")
    )
    assert "6.0 KiB moved per forward" in text


# ---- source lines: the model's own frame -----------------------------------------------------------------
class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.conv(x)  # line: conv
        y = torch.nn.functional.gelu(y)  # line: gelu
        return self.lin(y.mean((2, 3)))  # line: linear


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ln.rstrip().endswith(f"# line: {marker}"))


def test_source_lines_of_nn_layers_name_the_forward_line():
    res = precast.convert(Layers().eval(), (torch.randn(1, 3, 8, 8),), policy="torch", verify=False)
    for op, marker in (("conv2d", "conv"), ("gelu", "gelu"), ("linear", "linear")):
        (rec,) = [r for r in res.report.nodes if r.op == f"aten.{op}.default"]
        assert rec.location == f"{__file__}:{_line_of(marker)}", rec


LAYERS_SOURCE = """
import torch

class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)
"""


def test_source_lines_of_a_model_in_a_folder_named_torch(tmp_path):
    """Only torch's own package is skipped: a project folder that happens to be called torch is the model's."""
    import importlib.util

    path = tmp_path / "torch" / "usermodel.py"
    path.parent.mkdir()
    path.write_text(LAYERS_SOURCE)
    spec = importlib.util.spec_from_file_location("precast_test_usermodel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    res = precast.convert(module.Layers().eval(), (torch.randn(2, 4),), policy="torch", verify=False)
    (linear,) = [n for n in res.report.nodes if n.op.startswith("aten.linear")]
    assert linear.location == f"{path}:10"


def _node_with_trace(frames: list[tuple[str, int]]) -> torch.fx.Node:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = "".join(f'  File "{p}", line {n}, in forward\n    code()\n' for p, n in frames)
    return node


def test_source_line_of_a_library_model_is_the_librarys_line():
    import os

    from precast.errors import user_source_line

    torch_linear = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py")
    library = "/env/lib/python3.11/site-packages/transformers/models/bert/modeling_bert.py"
    node = _node_with_trace([("/home/u/run.py", 3), (library, 250), (torch_linear, 134)])
    assert user_source_line(node) == f"{library}:250"
    # a trace recorded where torch lives elsewhere (a program saved on another machine)
    other = "/opt/conda/lib/python3.10/site-packages/torch/nn/modules/linear.py"
    assert user_source_line(_node_with_trace([(library, 250), (other, 125)])) == f"{library}:250"
    # nothing outside torch: torch's innermost line is better than nothing
    assert user_source_line(_node_with_trace([(torch_linear, 134)])) == f"{torch_linear}:134"


def test_source_lines_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ep = torch.export.export(model, (torch.randint(0, 64, (1, 8)),))
    rep = precast.convert(ep, policy="torch", verify=False).report
    layers = [r for r in rep.nodes if r.op in ("aten.linear.default", "aten.layer_norm.default")]
    assert len(layers) >= 8
    for rec in layers:
        assert "transformers/models/bert/modeling_bert.py:" in rec.location, rec


# ---- one row per node after save/load ---------------------------------------------------------------------
class MultiOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
            a, b = y.unbind(0)
            c, d = y.split(4, dim=1)
            e, f = y.chunk(2, dim=1)
            v, m = torch.var_mean(y, dim=1)
            top, _ = y.max(dim=1)
            z = a + b + (c * d).sum() + (e - f).sum() + v.sum() + m.sum() + top.sum()
        return z.float()


def test_report_lists_multi_output_ops_once_after_save_and_load(tmp_path):
    res = precast.convert(MultiOutput().eval(), (torch.randn(2, 8),))
    path = tmp_path / "multi.pt2"
    torch.export.save(res.program, str(path))
    loaded = precast.report(torch.export.load(str(path)))
    names = [n.name for n in res.report.nodes]
    assert len(names) == len(set(names))
    ops = {n.op for n in res.report.nodes}
    assert {"aten.unbind.int", "aten.split.Tensor", "aten.chunk.default", "aten.var_mean.dim"} <= ops
    assert "aten.max.dim" in ops
    assert [n.name for n in loaded.nodes] == names
    assert loaded.nodes_by_dtype() == res.report.nodes_by_dtype()
    assert loaded.to_dict()["nodes"] == res.report.to_dict()["nodes"]
    # the in-memory program rebuilds the same rows
    assert [n.name for n in precast.report(res.program).nodes] == names
