"""Every weight format's graph form, as the conversion writes it, recognised by each engine that reads the stored
integers: AOTInductor's plan (``backends/aoti/int_weights.plan_int_weights``: the kernel it hands each linear to)
and OpenVINO's (``backends/openvino/compressed.stored_weights`` over the program OpenVINO converts: decomposed with
its table, put in its compressible forms). Both take the form from ``precast.quant.forms``; a format an engine
stops recognising (a change to the form in ``quant/`` that an engine does not follow) fails here, by name.

Also the rule that keeps the form in one place: no module outside ``precast/quant/`` spells the int4 unpacking.

The programs: an embedding then a linear (in 128: every int4 group divides it; out 16: AOTInductor's int4 kernel
takes N a multiple of 16), converted with policy None (fp32 compute) and ``weight_format=fmt``.
"""

from __future__ import annotations

import ast
import functools
import warnings
from pathlib import Path

import pytest
import torch

import precast
from precast.backends.aoti.int_weights import plan_int_weights
from precast.quant import formats
from precast.quant.formats import INT4_GROUPS, INT8, INT8_ASYM, Float, Int4, WeightFormat
from precast.quant.forms import recognise

aten = torch.ops.aten
FORMATS = [INT8, INT8_ASYM, *(Int4(g) for g in INT4_GROUPS)]
V, K, N = 40, 128, 16
ROOT = Path(precast.__file__).parent


class EmbedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, K)
        self.proj = torch.nn.Linear(K, N)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids))


@functools.cache
def written(fmt: WeightFormat) -> torch.export.ExportedProgram:
    ids = torch.arange(6).reshape(2, 3)
    ep = torch.export.export(EmbedLinear(), (ids,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precast.convert(ep, (ids,), policy=None, weights=precast.WeightOptions(format=fmt)).program


def test_the_formats_listed_are_every_quantized_format_class() -> None:
    """A new format class in ``quant/formats.py`` must be added to ``FORMATS`` (and so to both engines' checks)."""
    classes = {
        c
        for c in vars(formats).values()
        if isinstance(c, type) and issubclass(c, WeightFormat) and c not in (WeightFormat, Float)
    }
    assert classes == {type(f) for f in FORMATS}
    assert {f.kind for f in FORMATS} == {"int8", "int8-asym", "int4"}


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_recogniser_names_the_format_the_writer_wrote(fmt: WeightFormat) -> None:
    linear = next(n for n in written(fmt).graph.nodes if n.target is aten.linear.default)
    found = recognise(linear.args[1])
    assert found is not None and found.format == fmt and found.chain[-1] is linear.args[1]
    assert found.q.op == "placeholder" and found.dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_aotinductor_hands_each_format_to_its_kernel(fmt: WeightFormat) -> None:
    plan = plan_int_weights(written(fmt))
    assert [(r.kind, r.group) for r in plan.rewrites] == [(fmt.kind, fmt.group)]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_openvino_reads_each_format_stored(fmt: WeightFormat) -> None:
    pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")
    from precast.backends.openvino.compressed import stored_weights
    from precast.backends.openvino.convert import _decomposed
    from precast.backends.openvino.weight_forms import compressible_weights

    gm = _decomposed(written(fmt)).module()
    compressible_weights(gm)
    found = {(r.kind, r.form, r.shape) for r in stored_weights(gm)}
    assert found == {("embedding", fmt.kind, (V, K)), ("linear", fmt.kind, (N, K))}


# ---- the rule: the form is spelled in precast/quant/ only ----------------------------------------------------------
# Outside precast/quant/, in code (docstrings and comments are prose, and not read): no reference to the ops of
# int4's unpacking (an attribute ``bitwise_and`` / ``bitwise_right_shift`` / ``__rshift__``, or a string naming one
# of their overloads, as a recipe does: ``"bitwise_and.Scalar"``), and no ``x & 15`` / ``x & 0x0F`` / ``x >> 4``.
# The one exception: the ONNX exporter's translation table, which registers how ONNX computes the op itself
# (``backends/onnx/export.py``: it reads no form, any program's ``>>`` goes through it).
UNPACK_NAMES = ("bitwise_and", "bitwise_right_shift", "__rshift__")
TRANSLATES_THE_OP = {"backends/onnx/export.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            out.add(id(first.value))
    return out


def _spelled(node: ast.AST, prose: set[int]) -> str | None:
    """What ``node`` spells of int4's unpacking (the rule above), or None."""
    if isinstance(node, ast.Attribute) and node.attr in UNPACK_NAMES:
        return f".{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
        return repr(node.value) if any(f"{name}." in node.value for name in UNPACK_NAMES) else None
    if isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant):
        nibble = (isinstance(node.op, ast.BitAnd) and node.right.value == 15) or (
            isinstance(node.op, ast.RShift) and node.right.value == 4
        )
        return ast.unparse(node) if nibble else None
    return None


def spellings(source: str) -> list[str]:
    """Where ``source`` spells int4's unpacking (the rule above): one ``line: what`` each."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    spelled = [(node.lineno, _spelled(node, prose)) for node in ast.walk(tree) if hasattr(node, "lineno")]
    return [f"{line}: {what}" for line, what in sorted(spelled, key=lambda s: s[0]) if what is not None]


def test_the_rule_sees_each_spelling() -> None:
    assert spellings("lo = aten.bitwise_and.Scalar\n") == ["1: .bitwise_and"]
    assert spellings("r = {'op': 'aten::bitwise_right_shift.Tensor_Scalar'}\n")
    assert spellings("lo = p & 0x0F\nhi = p >> 4\n") == ["1: p & 15", "2: p >> 4"]
    assert spellings('"""unpacked by ``bitwise_and``."""\nx = a & 3\n') == []


def test_no_module_outside_the_weight_formats_home_spells_the_form() -> None:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("quant/") or rel in TRANSLATES_THE_OP:
            continue
        hits = spellings(path.read_text())
        if hits:
            found[rel] = hits
    assert not found, f"the int4 unpacking spelled outside precast/quant/ (use precast.quant.forms): {found}"
