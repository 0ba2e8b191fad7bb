"""Store the weights of linears and embeddings in 8 or 4 bits, of convolutions in 8 (``weight_format=``),
dequantized in the graph.

Runs after the casts are folded and simplified, so a weight is read as the constant its op computes with (the
policy's low dtype, or fp32). For each such read the rules (``WeightRules``: a format for every weight, or glob
patterns over weight names) pick a format (``precast.quant.formats``); the weight is quantized from its
**original** value (the fp32 weight of the program the conversion started from, never the already-rounded bf16
copy), stored as its parts (int8 ``q`` + ``scale``; int8-asym ``q`` + ``scale`` + ``zero``; int4 packed ``q`` +
``scale`` + ``zero``), and the read becomes:

- linear ``linear(x, w, b)``: ``w = q.to(dt) * scale`` (int8), ``(q.to(dt) - zero.to(dt)) * scale`` (int8-asym)
  or the int4 unpack, ``(q - zero).to(dt) * scale``,
  reshaped to [out, in]: the weight-side decompression OpenVINO fuses into its compressed FullyConnected and
  the AOTInductor backend turns into torch's int8/int4 kernels (``precast.backends``);
- embedding ``embedding(w, ids)``: the rows are gathered first, then dequantized (the whole table never is);
- convolution ``conv2d(x, w, ...)`` (``aten.convolution`` / ``conv1d`` / ``conv2d`` / ``conv3d``): ``w`` [O, I, kh, kw]
  is quantized as the matrix [O, I*kh*kw], per output channel (int8 / int8-asym only: int4 goes to int8 and says
  why), dequantized as a linear's weight and viewed back to [O, I, kh, kw] (``forms.write_conv_weight``); a
  transposed convolution's weight ([in, out, ...]) stays float and is listed.

The value is ``precast.quant.formats.dequantize``, op for op: an eager run of the converted program gives it
bitwise. Each part is a persistent buffer recording where it came from (``ConstantSource.derive``), so a compiled
model's ``load_weights`` and the streamed writer recompute it from the original weight (``stored_value``).

A weight a format cannot store (an int4 group that does not divide its input size) goes one step up (int4 ->
int8) and says why; a weight another op also reads keeps its float copy for that op. Reads through matmul/mm
views are left float and listed (``QuantizeResult.skipped``).

Input: a Program after simplify_casts, the rules. Output: ``QuantizeResult`` (one ``WeightRecord`` per weight).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError
from precast.ir.fake import fake_state
from precast.ir.mutation import analyze
from precast.ir.program import ConstantSource, Program
from precast.passes.fold import cast_constant
from precast.quant.formats import (
    FLOAT,
    INT8,
    WeightFormat,
    derive_tag,
    fits,
    is_data_aware,
    quantize,
    quantized_part,
    scale_grid,
)
from precast.quant.forms import META_KEY, mark_dequant, write_conv_weight, write_rows, write_weight
from precast.quant.rounding import GPTQ, RTN
from precast.quant.rules import WeightRules

aten = torch.ops.aten
LINEAR = aten.linear.default
EMBEDDING = aten.embedding.default
MATMULS = {aten.mm.default, aten.matmul.default, aten.addmm.default, aten.bmm.default}
# convolutions whose weight (args[1]) is [out, in/groups, *kernel]: stored per output channel
CONVS = {
    aten.convolution.default,
    *(getattr(aten, f"conv{d}d").default for d in (1, 2, 3)),
    *(getattr(aten, f"conv{d}d").padding for d in (1, 2, 3)),
}
TRANSPOSED = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}


@dataclass
class WeightRecord:
    """One weight's storage: the original name, the names it is known by, its format and why, bytes (the
    original's, and its stored parts' + any float copy still read), and the reads."""

    weight: str
    names: list[str]
    shape: tuple[int, ...]
    format: str
    why: str
    bytes_before: int
    bytes_after: int
    reads: list[str] = field(default_factory=list)
    stored: list[str] = field(default_factory=list)
    rounding: str = ""  # how its 8/4-bit values were chosen: "rtn", or "gptq+search" (fitted on data)
    # a weight whose reads got different formats (a tied table, ``int4-g64+int8``): each read's own name -> its
    # format (what a plan records, so that it is applied again read by read); empty otherwise
    read_formats: dict[str, str] = field(default_factory=dict)


@dataclass
class QuantizeResult:
    weights: dict[str, WeightRecord] = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        """The report's ``weight_formats``: one record per weight, by name."""
        return [{**dataclasses.asdict(r), "shape": list(r.shape)} for _, r in sorted(self.weights.items())]

    skipped: dict[str, str] = field(
        default_factory=dict
    )  # weight -> why it stayed float (read by another op)
    dropped: list[str] = field(default_factory=list)  # float copies nothing reads any more


def stored_value(source: ConstantSource, original: torch.Tensor) -> torch.Tensor:
    """A stored constant computed from its original weight, as the conversion computed it: a quantized part by
    its tag, else the cast (``cast_constant``: fp16's clamp included)."""
    if source.derive is not None:
        return quantized_part(original, source.derive).to(source.dtype)
    if original.dtype == source.dtype:
        return original
    return cast_constant(original, source.dtype)[0]


def _names(program: Program, const: torch.fx.Node, reader: torch.fx.Node, original: str) -> list[str]:
    """The names a weight is matched by: its original FQN, its stored one, and the reading module's path +
    ``.weight`` (a tied head is ``lm_head.weight`` to its linear, ``model.embed_tokens.weight`` in the program)."""
    names = [original]
    alias = _alias(reader)
    if alias and alias not in names:
        names.append(alias)
    return names


def _alias(reader: torch.fx.Node) -> str:
    """The reading module's path + ``.weight`` (from ``nn_module_stack``), or "" for a read outside any module."""
    stack = reader.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return f"{path}.weight" if path else ""


def _own_names(
    build: _Builder, rules: WeightRules, weight: str, names: list[str], reader: torch.fx.Node
) -> list[str]:
    """The names a read is chosen by: under patterns, less the names the weight's **other** reads' modules give it.
    A tied table is one tensor that ``torch.export`` names after one of its modules (``model.embed_tokens.weight``
    strict, ``lm_head.weight`` non-strict): the embedding's read is not ``lm_head.weight``, the head's is not
    ``model.embed_tokens.weight``, whichever name the program kept. A plan (literal rules) names the weight as a
    whole (all its names), or each read apart (``WeightRules.read_names``)."""
    others = build.aliases.get(weight, set()) - {_alias(reader)}
    return rules.read_names(names, [n for n in names if n not in others] or names)


def _original(program: Program, const: torch.fx.Node) -> tuple[str, torch.Tensor]:
    """The original name and value of the weight a constant was cast from (the program the conversion started
    from holds it, also when fold dropped it here)."""
    target = program.constant_target(const)
    source = program.original_of(target)
    name = source.original if source is not None else target
    ep = program.source
    value = ep.state_dict.get(name, ep.constants.get(name))
    if not isinstance(value, torch.Tensor):
        value = program.constant_value(const)
    return name, value


def _reads(program: Program) -> tuple[list[tuple[torch.fx.Node, torch.fx.Node, str]], dict[str, str]]:
    """(reader, constant, kind) for each linear weight / embedding table read straight from a constant; and the
    2-d constants read by matmuls another way (left float)."""
    reads, other = [], {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is LINEAR and len(node.args) > 1:
            const, kind = node.args[1], "linear"
        elif node.target is EMBEDDING and node.args:
            const, kind = node.args[0], "embedding"
        elif _conv_weight(node, program, other):
            const, kind = node.args[1], "conv"
        else:
            if node.target in MATMULS:
                for arg in node.args:
                    base = arg
                    while isinstance(base, torch.fx.Node) and base.op == "call_function" and base.args:
                        base = base.args[0]
                    if isinstance(base, torch.fx.Node) and program.constant_target(base):
                        other[program.constant_target(base)] = (
                            f"read by {node.target} (only linear and embedding reads are stored in 8/4 bits)"
                        )
            continue
        if isinstance(const, torch.fx.Node) and program.constant_target(const) is not None:
            value = program.constant_value(const)
            matrix = kind == "conv" or (isinstance(value, torch.Tensor) and value.dim() == 2)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and matrix:
                reads.append((node, const, kind))
    return reads, other


def _conv_weight(node: torch.fx.Node, program: Program, other: dict[str, str]) -> bool:
    """Whether ``node`` is a convolution whose weight (``args[1]``) can be stored per output channel; a transposed
    convolution's constant weight ([in, out, ...]) is put in ``other`` (left float, and said why)."""
    transposed = node.target in TRANSPOSED or (
        node.target is aten.convolution.default and len(node.args) > 6 and bool(node.args[6])
    )
    if not transposed:
        return node.target in CONVS and len(node.args) > 1
    target = program.constant_target(node.args[1]) if isinstance(node.args[1], torch.fx.Node) else None
    if target is not None:
        other[target] = (
            "read by a transposed convolution (its weight is [in, out, ...]; not stored in 8/4 bits)"
        )
    return False


class _Builder:
    """Adds the parts of each (weight, format, compute dtype) once, and the dequantizing ops per read."""

    def __init__(self, program: Program, reads: list[tuple[torch.fx.Node, torch.fx.Node, str]]):
        self.program = program
        # each read constant's original (name, value), found once; weight -> the dtypes its reads compute in
        self.originals = {const: _original(program, const) for _, const, _ in reads}
        self.aliases: dict[str, set[str]] = {}  # weight -> its reads' module names (``_own_names``)
        for reader, const, _ in reads:
            self.aliases.setdefault(self.originals[const][0], set()).add(_alias(reader))
        self.read_dtypes: dict[str, set[torch.dtype]] = {}
        for const, (name, _) in self.originals.items():
            self.read_dtypes.setdefault(name, set()).add(program.constant_value(const).dtype)
        self.state = fake_state(program)
        # (weight, format, grid) -> its integer parts, its scales' values, its scale constant
        self.parts: dict[tuple[str, WeightFormat, torch.dtype], dict[str, torch.fx.Node]] = {}
        self.scales: dict[tuple[str, WeightFormat, torch.dtype], torch.Tensor] = {}
        self.scale_nodes: dict[tuple[str, WeightFormat, torch.dtype], torch.fx.Node] = {}
        self.stored: dict[str, list[str]] = {}  # weight -> its stored parts' names
        self.fitted = None  # int4 parts fitted on data (``precast.quant.fit.Fitted``), from the rules
        self.rounding: dict[str, str] = {}  # weight -> how its stored values were chosen

    def parts_of(
        self, const: torch.fx.Node, name: str, value: torch.Tensor, fmt: WeightFormat, dt: torch.dtype
    ) -> dict[str, torch.fx.Node]:
        grid = scale_grid(dt, self.read_dtypes.get(name, set()))
        key = (name, fmt, grid)
        if key not in self.parts:  # the integers: one copy per weight and grid, whatever dtypes read it
            fitted = self.fitted.get(name, fmt, grid) if self.fitted is not None else None
            values = fitted if fitted is not None else quantize(value, fmt, grid)
            self._rounded(name, fitted is not None)
            self.parts[key] = {
                role: self._add(const, name, part, fmt, grid, role, fitted is not None)
                for role, part in values.items()
                if role != "scale"
            }
            self.scales[key] = values["scale"]
        if key not in self.scale_nodes:  # the scales once, on their grid: a wider read casts them (exact)
            q = self.program.constant_target(self.parts[key]["q"])
            tagged = is_data_aware(self.program.sources[q].derive)
            self.scale_nodes[key] = self._add(const, name, self.scales[key], fmt, grid, "scale", tagged)
        return {**self.parts[key], "scale": self.scale_nodes[key]}

    def _rounded(self, name: str, fitted: bool) -> None:
        """Say how the weight's stored values were chosen (fitted on data, or round-to-nearest and why)."""
        said = self.fitted.rounding if self.fitted is not None else {}
        how = (
            said.get(name, GPTQ)
            if fitted
            else said.get(name, RTN)
            if said.get(name, RTN).startswith(RTN)
            else RTN
        )
        held = self.rounding.get(name)
        self.rounding[name] = how if held in (None, how) else f"{held}; {how}"

    def _add(
        self,
        const: torch.fx.Node,
        name: str,
        part: torch.Tensor,
        fmt: WeightFormat,
        grid: torch.dtype,
        role: str,
        data_aware: bool = False,
    ) -> torch.fx.Node:
        suffix = f"_{fmt.suffix}" if role == "q" else f"_{fmt.suffix}_{role}"
        with self.state.mode:
            fake = torch.empty(part.shape, dtype=part.dtype, device=const.meta["val"].device)
        node = self.program.add_constant_like(const, part, suffix, kind=InputKind.BUFFER, val=fake, base=name)
        stored = self.program.constant_target(node)
        original = self.program.source.state_dict.get(name, self.program.source.constants.get(name))
        odt = original.dtype if isinstance(original, torch.Tensor) else torch.float32
        self.program.sources[stored] = ConstantSource(
            stored, name, odt, part.dtype, derive_tag(fmt, grid, role, data_aware)
        )
        self.stored.setdefault(name, []).append(stored)
        return node

    def op(self, reader: torch.fx.Node, target: object, *args: object, **kwargs: object) -> torch.fx.Node:
        node = self.program.graph.call_function(target, args, kwargs)
        for k in ("stack_trace", "nn_module_stack", "precast_regions"):
            if k in reader.meta:
                node.meta[k] = reader.meta[k]
        if target is aten._to_copy.default:  # a weight's decompression, not an activation's cast (the report)
            mark_dequant(node)
        return node

    def weight(
        self, reader: torch.fx.Node, parts: dict, fmt: WeightFormat, dt: torch.dtype, shape
    ) -> torch.fx.Node:
        """The dequantized [out, in] weight, inserted before ``reader`` (``precast.quant.forms``)."""
        with self.program.graph.inserting_before(reader):
            return write_weight(functools.partial(self.op, reader), fmt, parts, dt, shape)

    def conv_weight(
        self, reader: torch.fx.Node, parts: dict, fmt: WeightFormat, dt: torch.dtype, shape: tuple[int, ...]
    ) -> torch.fx.Node:
        """A convolution's dequantized weight of ``shape`` ([out, in, kh, ...]), inserted before ``reader``."""
        with self.program.graph.inserting_before(reader):
            return write_conv_weight(functools.partial(self.op, reader), fmt, parts, dt, shape)

    def rows(
        self, reader: torch.fx.Node, parts: dict, fmt: WeightFormat, dt: torch.dtype, k: int
    ) -> torch.fx.Node:
        """The embedding's rows, gathered from the parts then dequantized, replacing ``reader``."""
        n = parts["q"].meta["val"].shape[0]
        with self.program.graph.inserting_before(reader):
            return write_rows(functools.partial(self.op, reader), fmt, parts, dt, reader.args[1], n, k)


def _choose(
    rules: WeightRules, names: list[str], shape: tuple[int, ...], conv: bool = False
) -> tuple[WeightFormat, str]:
    """The rules' format for a weight ([out, in]; a convolution's as its [out, in*kh*...] matrix), one step up
    (or float) where the format cannot store it, with why."""
    fmt, why = rules.choose(names)
    if conv and fmt.kind == "int4":
        return (
            INT8,
            f"{why}; int8: a convolution's weight is stored per output channel (int4 stores linears only)",
        )
    if fmt.quantized:
        no = fits(fmt, shape)
        if no and fmt.kind == "int4" and not fits(INT8, shape):
            return INT8, f"{why}; int8: {no}"
        if no:
            return FLOAT, f"{why}; float: {no}"
    return fmt, why


def quantize_weights(program: Program, rules: WeightRules) -> QuantizeResult:
    """Store the weights the rules pick in 8/4 bits (the module docstring)."""
    result = QuantizeResult()
    alias = analyze(program.graph, program.input_spec, program.output_specs)
    reads, other = _reads(program)
    build = _Builder(program, reads)
    rules = rules.for_reads(build.read_dtypes)  # a budget's choice, costed as its weights will be stored
    build.fitted = rules.fitted
    touched: set[torch.fx.Node] = set()
    for reader, const, kind in reads:
        if alias.written(const):
            continue  # a weight the program writes is state, not a weight
        if _store_read(build, result, rules, reader, const, kind):
            touched.add(const)
    for name, stored in build.stored.items():
        result.weights[name].stored.extend(stored)
    for name, how in build.rounding.items():
        result.weights[name].rounding = how
    for record in result.weights.values():
        if len(set(record.read_formats.values())) < 2 or len(record.read_formats) != len(record.reads):
            record.read_formats = {}  # one format (or reads a name cannot tell apart): the weight's record says it
    result.skipped = {k: v for k, v in other.items() if k not in result.weights}
    weights = {name: record.names for name, record in result.weights.items()}
    rules.check_used(weights, [*program.source.state_dict, *program.source.constants])
    # a plan covers the weights precast measures (linear, embedding): a conv weight it does not name stays float
    measured = {build.originals[c][0] for _, c, kind in reads if kind != "conv"}
    rules.check_covers({name: names for name, names in weights.items() if name in measured})
    _drop_unread(program, touched, result)
    _count_bytes(program, result)
    return result


def _store_read(
    build: _Builder,
    result: QuantizeResult,
    rules: WeightRules,
    reader: torch.fx.Node,
    const: torch.fx.Node,
    kind: str,
) -> bool:
    """One read of a weight (``kind``: "linear", "embedding" or "conv"): its format chosen and put on the weight's
    record; a quantized read replaced by the dequantized parts. Returns whether it was."""
    program = build.program
    name, original = build.originals[const]
    value = program.constant_value(const)
    shape = tuple(value.shape)
    names = _names(program, const, reader, name)
    conv = kind == "conv"  # its weight quantized as the matrix [out, in*kh*...]
    own = _own_names(build, rules, name, names, reader)
    fmt, why = _choose(rules, own, (shape[0], math.prod(shape[1:])) if conv else shape, conv)
    record = result.weights.get(name)
    if record is None:
        record = result.weights[name] = WeightRecord(
            name, names, shape, fmt.name, why, original.numel() * original.element_size(), 0
        )
    elif fmt.name != record.format:
        record.format, record.why = f"{record.format}+{fmt.name}", f"{record.why}; {why}"
    record.read_formats[own[0]] = fmt.name
    record.names.extend(n for n in names if n not in record.names)
    record.reads.append(reader.name)
    if not fmt.quantized:
        return False
    if original.shape != value.shape:
        raise PrecastError(
            f"internal error in pass quantize_weights: {name} is {list(original.shape)} but read as "
            f"{list(value.shape)}"
        )
    dt = value.dtype
    parts = build.parts_of(const, name, original.reshape(shape[0], -1) if conv else original, fmt, dt)
    if kind == "linear":
        reader.replace_input_with(const, build.weight(reader, parts, fmt, dt, shape))
    elif conv:
        reader.replace_input_with(const, build.conv_weight(reader, parts, fmt, dt, shape))
    else:
        rows = build.rows(reader, parts, fmt, dt, shape[1])
        reader.replace_all_uses_with(rows)
        program.graph.erase_node(reader)
    _mark(rows if kind == "embedding" else reader, name, fmt, why)
    return True


def _drop_unread(program: Program, touched: set[torch.fx.Node], result: QuantizeResult) -> None:
    """The float constants no read uses any more, removed from the program (listed in ``result.dropped``)."""
    for const in touched:
        if not const.users:
            target = program.constant_target(const)
            program.input_spec.pop(const)
            program.state_dict.pop(target, None)
            program.constants.pop(target, None)
            program.sources.pop(target, None)
            program.graph.erase_node(const)
            result.dropped.append(target)


def _count_bytes(program: Program, result: QuantizeResult) -> None:
    """Each weight's bytes after: its stored parts and any float copy of it still read."""
    stored = {}
    for node, spec in program.input_spec.items():
        value = program.constant_value(node) if spec.target else None
        if isinstance(value, torch.Tensor) and node.users:
            stored[spec.target] = value.numel() * value.element_size()
    for record in result.weights.values():
        still_float = [
            t
            for t, s in program.sources.items()
            if s.original == record.weight and s.derive is None and t in stored
        ]
        if record.weight in stored and record.weight not in still_float:
            still_float.append(record.weight)
        record.bytes_after = sum(stored.get(t, 0) for t in set(record.stored) | set(still_float))


def _mark(node: torch.fx.Node, weight: str, fmt: WeightFormat, why: str) -> None:
    """The decision on the op that reads the weight (custom meta: saved with the program)."""
    custom = node.meta.setdefault("custom", {})
    entry = custom.setdefault(META_KEY, {})
    entry["weight_format"] = {"weight": weight, "format": fmt.name, "why": why}
