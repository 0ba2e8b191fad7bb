"""Store the weights of linears and embeddings in 8 or 4 bits (``weight_format=``), dequantized in the graph.

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
- embedding ``embedding(w, ids)``: the rows are gathered first, then dequantized (the whole table never is).

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
    quantize,
    quantized_part,
    scale_grid,
)
from precast.quant.forms import META_KEY, mark_dequant, write_rows, write_weight
from precast.quant.rules import WeightRules

aten = torch.ops.aten
LINEAR = aten.linear.default
EMBEDDING = aten.embedding.default
MATMULS = {aten.mm.default, aten.matmul.default, aten.addmm.default, aten.bmm.default}


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
    stack = reader.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        alias = f"{path}.weight" if path else ""
        if alias and alias not in names:
            names.append(alias)
    return names


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
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2:
                reads.append((node, const, kind))
    return reads, other


class _Builder:
    """Adds the parts of each (weight, format, compute dtype) once, and the dequantizing ops per read."""

    def __init__(self, program: Program, reads: list[tuple[torch.fx.Node, torch.fx.Node, str]]):
        self.program = program
        # each read constant's original (name, value), found once; weight -> the dtypes its reads compute in
        self.originals = {const: _original(program, const) for _, const, _ in reads}
        self.read_dtypes: dict[str, set[torch.dtype]] = {}
        for const, (name, _) in self.originals.items():
            self.read_dtypes.setdefault(name, set()).add(program.constant_value(const).dtype)
        self.state = fake_state(program)
        # (weight, format, grid) -> its parts; (weight, format, dtype) -> a scale read in another dtype
        self.parts: dict[tuple[str, WeightFormat, torch.dtype], dict[str, torch.fx.Node]] = {}
        self.scales: dict[tuple[str, WeightFormat, torch.dtype], torch.Tensor] = {}
        self.scale_nodes: dict[tuple[str, WeightFormat, torch.dtype], torch.fx.Node] = {}
        self.stored: dict[str, list[str]] = {}  # weight -> its stored parts' names

    def parts_of(
        self, const: torch.fx.Node, name: str, value: torch.Tensor, fmt: WeightFormat, dt: torch.dtype
    ) -> dict[str, torch.fx.Node]:
        grid = scale_grid(dt, self.read_dtypes.get(name, set()))
        key = (name, fmt, grid)
        if key not in self.parts:  # the integers: one copy per weight and grid, whatever dtypes read it
            values = quantize(value, fmt, grid)
            self.parts[key] = {
                role: self._add(const, name, part, fmt, grid, role)
                for role, part in values.items()
                if role != "scale"
            }
            self.scales[key] = values["scale"]
        skey = (name, fmt, dt)
        if (
            skey not in self.scale_nodes
        ):  # the scales in the dtype of this read (exact: the grid's values are its)
            self.scale_nodes[skey] = self._add(const, name, self.scales[key].to(dt), fmt, grid, "scale")
        return {**self.parts[key], "scale": self.scale_nodes[skey]}

    def _add(
        self,
        const: torch.fx.Node,
        name: str,
        part: torch.Tensor,
        fmt: WeightFormat,
        grid: torch.dtype,
        role: str,
    ) -> torch.fx.Node:
        suffix = f"_{fmt.suffix}" if role == "q" else f"_{fmt.suffix}_{role}"
        with self.state.mode:
            fake = torch.empty(part.shape, dtype=part.dtype, device=const.meta["val"].device)
        node = self.program.add_constant_like(const, part, suffix, kind=InputKind.BUFFER, val=fake, base=name)
        stored = self.program.constant_target(node)
        original = self.program.source.state_dict.get(name, self.program.source.constants.get(name))
        odt = original.dtype if isinstance(original, torch.Tensor) else torch.float32
        self.program.sources[stored] = ConstantSource(
            stored, name, odt, part.dtype, derive_tag(fmt, grid, role)
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

    def rows(
        self, reader: torch.fx.Node, parts: dict, fmt: WeightFormat, dt: torch.dtype, k: int
    ) -> torch.fx.Node:
        """The embedding's rows, gathered from the parts then dequantized, replacing ``reader``."""
        n = parts["q"].meta["val"].shape[0]
        with self.program.graph.inserting_before(reader):
            return write_rows(functools.partial(self.op, reader), fmt, parts, dt, reader.args[1], n, k)


def _choose(rules: WeightRules, names: list[str], shape: tuple[int, ...]) -> tuple[WeightFormat, str]:
    fmt, why = rules.choose(names)
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
    touched: set[torch.fx.Node] = set()
    for reader, const, kind in reads:
        if alias.written(const):
            continue  # a weight the program writes is state, not a weight
        if _store_read(build, result, rules, reader, const, kind):
            touched.add(const)
    for name, stored in build.stored.items():
        result.weights[name].stored.extend(stored)
    result.skipped = {k: v for k, v in other.items() if k not in result.weights}
    weights = {name: record.names for name, record in result.weights.items()}
    rules.check_used(weights, [*program.source.state_dict, *program.source.constants])
    rules.check_covers(weights)
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
    """One read of a weight (``kind``: "linear" or "embedding"): its format chosen and put on the weight's
    record; a quantized read replaced by the dequantized parts. Returns whether it was."""
    program = build.program
    name, original = build.originals[const]
    value = program.constant_value(const)
    shape = tuple(value.shape)
    names = _names(program, const, reader, name)
    fmt, why = _choose(rules, names, shape)
    record = result.weights.get(name)
    if record is None:
        record = result.weights[name] = WeightRecord(
            name, names, shape, fmt.name, why, original.numel() * original.element_size(), 0
        )
    elif fmt.name != record.format:
        record.format, record.why = f"{record.format}+{fmt.name}", f"{record.why}; {why}"
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
    parts = build.parts_of(const, name, original, fmt, dt)
    if kind == "linear":
        reader.replace_input_with(const, build.weight(reader, parts, fmt, dt, shape))
    else:
        rows = build.rows(reader, parts, fmt, dt, shape[1])
        reader.replace_all_uses_with(rows)
        program.graph.erase_node(reader)
    _mark(reader if kind == "linear" else rows, name, fmt, why)
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
