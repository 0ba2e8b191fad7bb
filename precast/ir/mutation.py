"""Mutation and aliasing in a program graph: which values share storage, and where each storage is written.

The rewrite passes (insert casts, fold constants, simplify casts) share one rule, documented in
``docs/architecture.md`` ("Mutation and aliasing"):

- A value's *storage root* is the node that allocated it: views (ops whose schema returns an alias of an
  input, ``Tensor(a)``) and in-place ops (``Tensor(a!)``) return the storage of their input.
- An op that writes an argument in place (schema ``alias_info.is_write``: ``mul_``, ``copy_``, ``out=``...)
  writes that argument's storage root, and starts a new *version* of it.
- After ``run_decompositions()`` the program is functional and a write is an output of kind
  BUFFER_MUTATION / PARAMETER_MUTATION: the constant it targets changes between calls.
- A cast made for one reader may be shared with another reader only if both see the same version of the
  producer's storage. A constant whose storage the program writes is never folded: its cast stays at run time.

``AliasInfo`` is computed once per pass from the graph as it is then; passes that only erase nodes or
redirect arguments of casts keep it valid (casts neither write nor alias their input).

Input: an FX graph (and the program's signature). Output: ``AliasInfo``: storage roots, writes, versions.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputSpec, OutputKind, OutputSpec

MUTATION_OUTPUTS = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def _schema(node: torch.fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments ``node`` writes in place (by its schema's alias annotations)."""
    schema = _schema(node)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        if value is None and arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.fx.Node):
                out.append(v)
    return out


def aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """For a view or an in-place op: the input whose storage its output shares (None for fresh values)."""
    if node.op == "call_function" and node.target is torch.ops.aten.alias.default:
        return node.args[0]
    schema = _schema(node)
    if schema is None or not schema.returns:
        # getitem of a multi-output view op (split, unbind): the tuple's source
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and aliased_input(src) is not None:
                return aliased_input(src)
        return None
    ret = schema.returns[0].alias_info
    if ret is None:
        return None
    for i, arg in enumerate(schema.arguments):
        # `Tensor(a)[]` (split, unbind): the binding shows no alias set on the list; its input is `Tensor(a -> *)`
        if arg.alias_info is not None and (arg.alias_info.before_set & ret.before_set or not ret.before_set):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, torch.fx.Node) else None
    return None


@dataclass
class AliasInfo:
    """Storage roots and write positions of a graph (see the module docstring)."""

    order: dict[torch.fx.Node, int] = field(default_factory=dict)
    root: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    writes: dict[torch.fx.Node, list[int]] = field(default_factory=dict)  # root -> positions of writes
    mutated_constants: set[torch.fx.Node] = field(default_factory=set)  # placeholders changed between calls

    def root_of(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.root.get(node, node)

    def version(self, node: torch.fx.Node, at: torch.fx.Node) -> int:
        """How many writes to ``node``'s storage happen before ``at`` runs."""
        positions = self.writes.get(self.root_of(node))
        if not positions:
            return 0
        return bisect.bisect_left(positions, self.order[at])

    def written(self, node: torch.fx.Node) -> bool:
        """Is ``node``'s storage ever written (in the graph, or between calls as a mutation output)?"""
        root = self.root_of(node)
        return bool(self.writes.get(root)) or root in self.mutated_constants

    def written_between(self, node: torch.fx.Node, start: torch.fx.Node, end: torch.fx.Node) -> bool:
        return self.version(node, start) != self.version(node, end)

    def written_after(self, node: torch.fx.Node, start: torch.fx.Node) -> bool:
        positions = self.writes.get(self.root_of(node))
        return bool(positions) and positions[-1] >= self.order[start]


def analyze(
    graph: torch.fx.Graph,
    input_specs: dict[torch.fx.Node, InputSpec] | None = None,
    output_specs: list[OutputSpec] | None = None,
) -> AliasInfo:
    """Storage roots, write positions and mutated constants of ``graph``.

    ``input_specs`` / ``output_specs`` (from the program's graph signature) mark the constants that a
    functional program updates through mutation outputs.
    """
    info = AliasInfo()
    for i, node in enumerate(graph.nodes):
        info.order[node] = i
        src = aliased_input(node)
        if src is not None:
            info.root[node] = info.root_of(src)
        for arg in written_args(node) + _written_operands(node, graph.owning_module):
            info.writes.setdefault(info.root_of(arg), []).append(i)
    if input_specs and output_specs:
        by_target = {spec.target: node for node, spec in input_specs.items() if spec.target is not None}
        for spec in output_specs:
            if spec.kind in MUTATION_OUTPUTS and spec.target in by_target:
                info.mutated_constants.add(by_target[spec.target])
    return info


def _written_operands(node: torch.fx.Node, owner: torch.nn.Module | None) -> list[torch.fx.Node]:
    """Operands of a higher-order op (an autocast or grad-mode region) that its subgraph writes.

    Region HOPs take ``(..., submodule, *operands)``; a write to a subgraph placeholder is a write to the
    operand. Other HOPs with subgraphs (control flow) count every tensor operand as written: precast does not
    look inside them, so nothing they read may be folded.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    subs = [
        (i, a)
        for i, a in enumerate(node.args)
        if isinstance(a, torch.fx.Node)
        and a.op == "get_attr"
        and owner is not None
        and isinstance(getattr(owner, a.target, None), torch.fx.GraphModule)
    ]
    operands = [
        a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)
    ]
    if node.target.name() not in ("wrap_with_autocast", "wrap_with_set_grad_enabled") or len(subs) != 1:
        return [a for a in operands if a.op != "get_attr"]
    i, sub_node = subs[0]
    sub = getattr(owner, sub_node.target)
    inner = analyze(sub.graph)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    args = list(node.args[i + 1 :])
    return [
        a
        for p, a in zip(placeholders, args, strict=False)
        if isinstance(a, torch.fx.Node) and inner.written(p)
    ]


def written_constant_targets(
    graph: torch.fx.Graph, input_specs: dict[torch.fx.Node, InputSpec], output_specs: list[OutputSpec]
) -> set[str]:
    """FQNs of the constants (parameters, buffers, lifted tensors) a program writes, inside regions too."""
    info = analyze(graph, input_specs, output_specs)
    return {
        spec.target for node, spec in input_specs.items() if spec.target is not None and info.written(node)
    }
