"""Graph queries the precision-sensitive patterns share: op names, scalars, constants, learned inputs.

Input: an FX graph (``Graph``: the graph with its parameters and constants). Output: facts about nodes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from precast.ir.op_families import ATTENTION_OPS, GEMM_OPS

EPS_MAX = 1e-3  # an epsilon or divisor below this is "small" (fp16's smallest normal is 6.1e-5)


# elementwise math an exp's values may pass through on their way to a reduction
ELEMENTWISE = frozenset(
    {"mul", "div", "add", "sub", "where", "masked_fill", "neg", "clamp", "clamp_min", "clamp_max", "pow"}
)


# ops whose output is a value moved or viewed, not computed: matchers look through them
TRANSPARENT = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "transpose",
        "permute",
        "t",
        "contiguous",
        "clone",
        "_to_copy",
        "to",
        "type_as",
        "slice",
        "select",
        "flatten",
        "unflatten",
        "alias",
        "detach",
        "lift_fresh_copy",
    }
)


LEARNED = GEMM_OPS | {"embedding", "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "batch_norm"}


@dataclass(frozen=True)
class Graph:
    """What the matchers read: the graph, which placeholders are learned parameters, and a constant's value."""

    graph: torch.fx.Graph
    parameters: frozenset[str]
    constant: Callable[[torch.fx.Node], torch.Tensor | None]


def op(node: object) -> str:
    """``pow`` for ``aten.pow.Tensor_Scalar``, ``getitem`` for ``operator.getitem``; '' for other nodes."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::", 1)[-1] if schema is not None else ""


def source(node: object) -> object:
    """The value behind views, casts and copies of ``node``."""
    while op(node) in TRANSPARENT and node.args:
        node = node.args[0]
    return node


def consumers(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """Users of ``node``, looking through views, casts and tuple items (yielding those as well)."""
    for user in node.users:
        yield user
        if op(user) in TRANSPARENT | {"getitem"}:
            yield from consumers(user)


def scalar(g: Graph, value: object) -> float | None:
    """A Python number, or the value of a one-element constant tensor (through views); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    value = source(value)
    if isinstance(value, torch.fx.Node) and value.op == "placeholder":
        t = g.constant(value)
        if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
            return float(t.item())
    return None


def small(x: float | None) -> bool:
    return x is not None and 0 < abs(x) < EPS_MAX


def floating(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def is_constant(g: Graph, node: torch.fx.Node) -> bool:
    node = source(node)
    return isinstance(node, torch.fx.Node) and (
        node.op == "get_attr"
        or (node.op == "placeholder" and (node.name in g.parameters or g.constant(node) is not None))
    )


def learned(g: Graph, node: torch.fx.Node) -> bool:
    """A layer with learned weights (or attention): its output is an activation, not a position or angle."""
    name = op(node)
    if name in ATTENTION_OPS:
        return True
    return name in LEARNED and any(source(a).name in g.parameters for a in node.all_input_nodes)


def scalar_operand(g: Graph, node: torch.fx.Node) -> bool:
    """``x + c``, ``clamp(x, min=c)``, ``max(x, c)`` with a constant number c."""
    others = list(node.args[1:]) + [node.kwargs.get("min"), node.kwargs.get("other")]
    return any(scalar(g, a) is not None for a in others if a is not None)


def operand_index(user: torch.fx.Node, value: torch.fx.Node) -> int | None:
    """Which operand of ``user`` is ``value`` (through views), or None."""
    for i, a in enumerate(user.args[:2]):
        if isinstance(a, torch.fx.Node) and (a is value or source(a) is value):
            return i
    return None
