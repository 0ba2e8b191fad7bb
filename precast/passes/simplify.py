"""Exact-only cast cleanup: small rewrite rules applied to a fixed point. Each leaves every value bitwise the same:

- ``same_dtype``: a cast to the dtype its input already has is replaced by its input;
- ``round_trip``: a cast whose input is a *widening* cast (bf16/fp16 -> fp32 -> ...) reads the widening cast's
  input instead: bf16 -> fp32 -> fp16 equals bf16 -> fp16, and low -> fp32 -> low is the identity;
- ``duplicate``: a cast of the same value, to the same dtype, at the same version of its storage, as an
  earlier cast is replaced by that earlier cast.

A narrowing cast is never removed: fp32 -> bf16 -> fp32 is not the identity. A cast is a copy, so a rule never
replaces it by its input when the copy is written in place, or when the input is written while the copy is
still read (``precast/ir/mutation.py``). Each rule reads the graph as it is (use lists are recomputed, nothing is
cached across an erase), so bookkeeping cannot point at a deleted node.

Input: the graph (and signature specs). Output: ``SimplifyResult`` (casts removed, per rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from precast.ir.graph import TO_COPY, cast_dtype, is_cast
from precast.ir.mutation import AliasInfo, analyze

LOSSLESS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


@dataclass
class SimplifyResult:
    same_dtype: int = 0
    round_trips: int = 0
    duplicates: int = 0

    @property
    def removed(self) -> int:
        return self.same_dtype + self.round_trips + self.duplicates


def _dtype(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _last_reader(node: torch.fx.Node, alias: AliasInfo) -> torch.fx.Node:
    """The last node that reads ``node``'s value, directly or through views of it."""
    last, stack = node, [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                continue
            if alias.order.get(user, -1) > alias.order.get(last, -1):
                last = user
            if alias.root_of(user) is alias.root_of(node):
                stack.append(user)
    return last


def _replaceable_by_input(node: torch.fx.Node, src: torch.fx.Node, alias: AliasInfo) -> bool:
    """Can the copy ``node`` of ``src`` be replaced by ``src`` itself? Not if either is written while the
    copy's readers run, and not if the copy is a program output of a placeholder (an output must not alias an
    input)."""
    if alias.written(node):
        return False
    if alias.written(src) and alias.written_between(src, node, _last_reader(node, alias)):
        return False
    return not (alias.root_of(src).op == "placeholder" and any(u.op == "output" for u in node.users))


def _same_dtype(node: torch.fx.Node, graph: torch.fx.Graph, alias: AliasInfo) -> bool:
    src = node.args[0]
    if _dtype(src) != cast_dtype(node) or not _replaceable_by_input(node, src, alias):
        return False
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return True


def _round_trip(node: torch.fx.Node, graph: torch.fx.Graph, alias: AliasInfo) -> bool:
    src = node.args[0]
    if not (isinstance(src, torch.fx.Node) and is_cast(src)):
        return False
    origin = src.args[0]
    if (_dtype(origin), cast_dtype(src)) not in LOSSLESS:
        return False
    if alias.written(origin) and alias.written_between(origin, src, node):
        return False  # the origin changed between the widening cast and this one
    node.args, node.kwargs, node.target = (origin,), {"dtype": cast_dtype(node)}, TO_COPY
    if not src.users:
        graph.erase_node(src)
    return True


def _duplicate(node: torch.fx.Node, graph: torch.fx.Graph, alias: AliasInfo) -> bool:
    src, dtype = node.args[0], cast_dtype(node)
    if alias.written(node):
        return False
    version = alias.version(src, node) if node in alias.order else None
    for other in src.users:
        if other is node or not is_cast(other) or cast_dtype(other) != dtype or alias.written(other):
            continue
        if other not in alias.order or node not in alias.order or alias.order[other] > alias.order[node]:
            continue
        if alias.version(src, other) != version:
            continue
        node.replace_all_uses_with(other)
        graph.erase_node(node)
        return True
    return False


RULES = (("same_dtype", _same_dtype), ("round_trips", _round_trip), ("duplicates", _duplicate))


def simplify_casts(graph: torch.fx.Graph, input_specs=None, output_specs=None) -> SimplifyResult:
    """Apply the rules until none applies. ``input_specs``/``output_specs`` (the program's signature) let the
    alias analysis see constants written through mutation outputs."""
    result = SimplifyResult()
    changed = True
    while changed:
        changed = False
        alias = analyze(graph, input_specs, output_specs)  # positions and writes of the graph as it is now
        for node in list(graph.nodes):
            if node._erased or node not in alias.order or not is_cast(node):
                continue  # erased by an earlier rewrite in this sweep
            for field_name, rule in RULES:
                if rule(node, graph, alias):
                    setattr(result, field_name, getattr(result, field_name) + 1)
                    changed = True
                    break
    graph.eliminate_dead_code()
    graph.lint()
    return result
