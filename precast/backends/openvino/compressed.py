"""Which weights a program stores as int8 / int4 (issue 41) OpenVINO's CPU plugin runs compressed, read from the
compiled model.

What OpenVINO 2026.4.1's CPU plugin runs for each form (compute dtype ``dt``; ``weight_forms`` puts the
int4 forms in the shape its frontend compresses):

- **int8 linear** ``linear(x, _to_copy(q, dt) * scale, b)``: ``Constant(i8) -> Convert -> Multiply(scale)`` becomes
  one ``FullyConnected`` (``ConvertFullyConnectedToFullyConnectedCompressed``) whose weight input is the i8 constant
  and whose ``runtimePrecision`` is ``i8``, its scale a decompression input: the weight stays 8-bit in memory.
- **int8-asym linear** ``linear(x, (_to_copy(q, dt) - _to_copy(zero, dt)) * scale, b)``: the same with a ``u8``
  weight and its ``u8`` zero point as a decompression input (``runtimePrecision`` u8), as OpenVINO's own int8
  export (NNCF's INT8_ASYM) stores it.
- **int4 linear**: the same with a ``u4`` weight, its scale and ``u8`` zero point as inputs (``runtimePrecision`` u4).
- **int8 / int8-asym embedding** (rows gathered from ``q``, then converted, less the gathered zero points, and
  scaled): a ``Gather`` of the i8 / u8 constant, then a Convert, a Subtract and a Multiply on the rows only.
- **int4 embedding**: one compressed ``Gather`` of the u4 table, its scale and zero point as inputs.

Where the plugin does not compress (``FullyConnected::isSupportedCompressedOperation``, x86: AVX2 at least; at least 4
input channels per group, ``IC / groups >= 4``, so per-channel int8 with fewer than 4 inputs and int4 groups of 2 or
fewer; more than one output channel; with AMX under the bf16 hint, small shapes too), it computes the weight's
decompression once, at compile time, into an f32 copy (its Convert / Subtract / Multiply then run as layers of their
own, on constants) that the FullyConnected reads: ``check_weights`` names each such weight and ``warn_uncompressed``
says so in one line (a never-silent f32 fallback). Dynamic quantization of the activations
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``) needs AVX2-VNNI or AVX512-VNNI; ``openvino.compile_openvino`` leaves it on
where the program stores int4 weights (as OpenVINO's own int4 export runs) and turns it off otherwise, unless asked
(``model.dynamic_quantization_for``).

Input: the decomposed GraphModule OpenVINO converted (``stored_weights``, ``decompression_nodes``) and the compiled
model (``compressed_layers``, ``check_weights``). Output: the weights stored as int8/int4, which run compressed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.backends.openvino.weight_forms import call, val
from precast.quant.formats import INT8, INT8_ASYM, WeightFormat
from precast.quant.forms import Q_DTYPE, recognise

aten = torch.ops.aten

# the element types of a weight a compressed FullyConnected / Gather reads (OpenVINO's names); a Gather of a u8
# constant counts too (int8-asym's table and its zero points), though OpenVINO's CPU plugin also holds boolean
# tensors (a mask table) as u8: such a Gather can only raise the count of compressed layers, never name a weight
FC_COMPRESSED = frozenset({"i8", "u8", "i4", "u4", "nf4", "f4e2m1"})
GATHER_COMPRESSED = frozenset({"i8", "u8", "i4", "u4"})
# reader op -> the argument that is its weight
_READERS = {aten.linear.default: (1, "linear"), aten.embedding.default: (0, "embedding")}
# a format -> the element type OpenVINO holds it in; an embedding's table dtype -> the format of its rows
_PRECISION = {"int8": "i8", "int8-asym": "u8", "int4": "u4"}
_ROWS = {Q_DTYPE[f.kind]: f for f in (INT8, INT8_ASYM)}


class CompressedWeightWarning(UserWarning):
    """A weight the program stores as int8/int4 that OpenVINO runs decompressed (an f32 copy made at compile)."""


# ---- the program: which weights it stores as int8 / int4 ---------------------------------------------------------
@dataclass(frozen=True)
class StoredWeight:
    """One read of a weight the program stores as an integer: by a linear or an embedding."""

    weight: str  # the weight's name before conversion (``lm_head.weight``), else the constant's
    constant: str  # the stored constant's name in the program (``lm_head.weight_int8``)
    reader: str  # the FX node reading it (linear / embedding), in the decomposed program OpenVINO converted
    kind: str  # "linear" | "embedding"
    form: str  # "int8" | "int8-asym" | "int4"
    precision: str  # the element type OpenVINO holds it in: "i8", "u4", "u8"
    shape: tuple[int, ...]  # the dequantized weight's shape
    path: tuple[str, ...]  # the FX nodes between the constant and the reader (unpacking, dequantizing)


def stored_weights(gm: torch.fx.GraphModule) -> list[StoredWeight]:
    """Every linear / embedding of ``gm`` whose weight is an int8 (or nibble-packed uint8) constant, dequantized on
    the way: the weight formats' graph form, recognised by ``precast.quant.forms.recognise`` (OpenVINO's
    decomposed program keeps it, ``weight_forms`` puts int4's stack back), or an embedding's int8 / int8-asym rows
    (``q`` gathered as it is stored, dequantized after)."""
    out = []
    originals = original_names(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _READERS:
            continue
        index, kind = _READERS[node.target]
        w = node.args[index] if len(node.args) > index else None
        found = _stored(w, node if kind == "embedding" else None)
        if found is None:
            continue
        leaf, path, fmt = found
        shape = val(w).shape if path else val(leaf).shape
        out.append(
            StoredWeight(
                weight=_recorded(node) or originals.get(str(leaf.target), str(leaf.target)),
                constant=str(leaf.target),
                reader=node.name,
                kind=kind,
                form=fmt.kind,
                precision=_PRECISION[fmt.kind],
                shape=tuple(int(s) for s in shape),
                path=tuple(n.name for n in path),
            )
        )
    return out


def original_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Stored constant -> the weight it was made from, as a conversion records it (custom meta ``constants``: the
    original name first)."""
    out = {}
    for node in gm.graph.nodes:
        record = ((node.meta.get("custom") or {}).get("precast") or {}).get("constants") or {}
        for stored, entry in record.items():
            if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], str):
                out.setdefault(stored, entry[0])
    return out


def _recorded(reader: torch.fx.Node) -> str | None:
    """The weight a conversion's ``weight_format=`` recorded on the op reading it (custom meta)."""
    record = ((reader.meta.get("custom") or {}).get("precast") or {}).get("weight_format") or {}
    return record.get("weight") if isinstance(record.get("weight"), str) else None


def _dequantized_rows(gather: torch.fx.Node) -> bool:
    """Whether an embedding's gathered rows of a uint8 table are int8-asym's integers: converted to a float, and
    the first operand of a subtract (of the zero points; a gathered zero point is the second)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return any(
        call(cast, aten._to_copy.default)
        and cast.kwargs.get("dtype") in floats
        and any(call(u, aten.sub.Tensor) and u.args[0] is cast for u in cast.users)
        for cast in gather.users
    )


def _stored(
    w: Any, gather: torch.fx.Node | None = None
) -> tuple[torch.fx.Node, list[torch.fx.Node], WeightFormat] | None:
    """The integer constant behind a reader's weight ``w``: (the constant, the nodes from it to ``w`` that unpack
    and dequantize it, its format), or None (a float weight, or another computation). ``gather``: the embedding
    reading ``w`` as its table, where an int8 table counts as int8's rows and a uint8 one as int8-asym's only when
    its rows are dequantized (``_dequantized_rows``; otherwise a mask)."""
    found = recognise(w)
    if found is not None:
        if not isinstance(found.q, torch.fx.Node) or found.q.op != "get_attr":
            return None
        path: list[torch.fx.Node] = []  # the chain's nodes computed from q (not the zero point's cast)
        for node in found.chain:
            if found.q in node.all_input_nodes or set(path) & set(node.all_input_nodes):
                path.append(node)
        return found.q, path, found.format
    if gather is None or not isinstance(w, torch.fx.Node) or w.op != "get_attr":
        return None
    value = val(w) if val(w) is not None else _attr(w)  # an unlifted module's constant: its tensor
    fmt = _ROWS.get(value.dtype) if value is not None else None
    if fmt is None or (fmt == INT8_ASYM and not _dequantized_rows(gather)):
        return None
    return w, [], fmt


def _attr(node: torch.fx.Node) -> torch.Tensor | None:
    obj: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def decompression_nodes(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The FX nodes that only unpack and dequantize a stored int8/int4 weight (its casts, the zero point's and the
    scale's, the subtract and multiply, the reshapes): everything computed from constants alone that a linear's or
    embedding's weight is made of. ``plan_check.check_plan`` leaves them out of the plan check: OpenVINO runs them
    inside the compressed layer, or once at compile time, whatever dtype a policy decided for them."""
    constant: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (
            node.op == "call_function"
            and node.all_input_nodes
            and all(a in constant for a in node.all_input_nodes)
        ):
            constant.add(node)
    names: set[str] = set()
    nodes = {n.name: n for n in gm.graph.nodes}
    for read in stored_weights(gm):
        reader = nodes[read.reader]
        index, _ = _READERS[reader.target]
        todo = [reader.args[index]]
        while todo:
            node = todo.pop()
            if node in constant and node.op == "call_function" and node.name not in names:
                names.add(node.name)
                todo += node.all_input_nodes
    return frozenset(names)


# ---- the compiled model: which weights OpenVINO runs compressed --------------------------------------------------
def _type(op: Any, port: int) -> str:
    return str(op.get_input_element_type(port).get_type_name())


def _reads_constant(op: Any, port: int) -> bool:
    source = op.input_value(port).get_node()
    info = source.get_rt_info()
    return "layerType" in info and info["layerType"].astype(str) == "Const"


def compressed_layers(compiled: Any) -> dict[str, str]:
    """Runtime layer name -> the element type of the weight it reads compressed, for every layer of the compiled
    model (``compiled.get_runtime_model()``) that reads an integer weight constant: a FullyConnected whose weight
    input (port 1) is i8/u8/i4/u4/nf4 (its ``runtimePrecision`` is then that type, its activation input float), a
    Gather whose data (port 0) is an i8/i4/u4 constant (OpenVINO's compressed Gather, or the rows of an int8
    embedding gathered before they are converted)."""
    found = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer = info["layerType"].astype(str) if "layerType" in info else ""
        port, kinds = {"FullyConnected": (1, FC_COMPRESSED), "Gather": (0, GATHER_COMPRESSED)}.get(
            layer, (None, ())
        )
        if port is None or op.get_input_size() <= port:
            continue
        if _type(op, port) in kinds and _reads_constant(op, port):
            found[op.get_friendly_name()] = _type(op, port)
    return found


@dataclass
class WeightCheck:
    """The weights the program stores as int8/int4 against what OpenVINO's compiled model runs."""

    stored: list[StoredWeight] = field(default_factory=list)  # every read of a stored int8/int4 weight
    layers: dict[str, str] = field(default_factory=dict)  # runtime layer -> compressed weight type it reads
    uncompressed: list[StoredWeight] = field(default_factory=list)  # reads OpenVINO runs on an f32 copy
    unaccounted: int = 0  # reads not seen decompressed by name, but missing from the compressed layers' count
    # whether OpenVINO quantizes these layers' activations to 8 bits on the fly, and why
    # (``model.dynamic_quantization_for``)
    activations: str = ""

    @property
    def compressed(self) -> dict[str, str]:
        """Weight name -> the element type OpenVINO reads it in (i8, u4), for each weight run compressed."""
        missing = {id(read) for read in self.uncompressed}
        return {r.weight: r.precision for r in self.stored if id(r) not in missing}

    @property
    def complete(self) -> bool:
        return not self.uncompressed and not self.unaccounted

    def summary(self) -> str:
        if not self.stored:
            return "no int8/int4 weights"
        kinds = sorted({f"{r.form} ({r.precision})" for r in self.stored})
        off = len(self.uncompressed) + self.unaccounted
        return (
            f"{len(self.stored)} int8/int4 weight read(s) ({', '.join(kinds)}): {len(self.stored) - off} run "
            f"compressed by OpenVINO, {off} on an f32 copy"
            + (f"; 8-bit activations on the fly: {self.activations}" if self.activations else "")
        )


def check_weights(compiled: Any, gm: torch.fx.GraphModule) -> WeightCheck:
    """Which of ``gm``'s stored int8/int4 weights (``stored_weights``) the compiled model runs compressed.

    A read is **decompressed** where a node between the constant and its reader (a cast of the weight, the nibble
    unpack, the dequantizing multiply) runs as a runtime layer of its own (OpenVINO then computes the float weight
    once, at compile time, and the reader takes it). Otherwise it is compressed: the FullyConnected / Gather reads
    the integer constant (``compressed_layers``). The count is checked as well: fewer compressed layers than reads
    the names leave compressed (a decompression OpenVINO folded away without a trace) counts as ``unaccounted``."""
    check = WeightCheck(stored=stored_weights(gm), layers=compressed_layers(compiled))
    if not check.stored:
        return check
    executed: set[str] = set()
    for op in compiled.get_runtime_model().get_ordered_ops():
        if op.get_friendly_name() in check.layers:  # what a compressed layer fuses is not run on its own
            continue
        info = op.get_rt_info()
        names = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
        executed |= {n.split("/", 1)[0] for n in names.split(",") if "/" in n}
    check.uncompressed = [r for r in check.stored if executed & set(r.path)]
    deemed = len(check.stored) - len(check.uncompressed)
    check.unaccounted = max(0, deemed - len(check.layers))
    return check


def warn_uncompressed(check: WeightCheck, stacklevel: int = 3) -> None:
    """One ``CompressedWeightWarning`` line when a weight the program stores as int8/int4 does not run compressed."""
    if check.complete:
        return
    if check.uncompressed:
        first = check.uncompressed[0]
        named = ", ".join(r.weight for r in check.uncompressed[:4]) + (
            " ..." if len(check.uncompressed) > 4 else ""
        )
        what = (
            f"{len(check.uncompressed)} of {len(check.stored)} int8/int4 weight read(s) run on an f32 copy ({named}; "
            f"e.g. {first.form} {list(first.shape)} read by {first.kind} {first.reader!r})"
        )
    else:
        what = f"{check.unaccounted} of {len(check.stored)} int8/int4 weight read(s) found in no compressed layer"
    warnings.warn(
        f"precast.compile(backend='openvino'): {what}: OpenVINO's CPU plugin keeps a weight compressed only in a "
        "FullyConnected with more than one output channel and at least 4 input channels per group (x86 with AVX2), "
        "or a Gather; model.weights.uncompressed lists them",
        CompressedWeightWarning,
        stacklevel=stacklevel,
    )
