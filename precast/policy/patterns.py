"""Precision-sensitive subgraphs, found by their shape in the graph and kept in fp32 by policy "rules".

Some computations lose far more in low precision than their size suggests, whatever the data; OpenVINO keeps
them in fp32 when it compresses a model to fp16 (``MarkSugraphsToKeepInMixedPrecision``). precast matches the
same four shapes on the FX graph, once, before any decision:

- ``sincos_angles``: the angles fed to ``sin``/``cos`` (rotary and sinusoidal position embeddings), back to the
  positions (``arange``, position ids, ``inv_freq`` buffers, their outer product, ``cat`` of the frequencies),
  the ``sin``/``cos`` themselves and the constant scalings of their tables. An angle of 500 rounded to fp16 is
  off by up to 0.25: its sine by as much.
- ``exp_reduce``: ``exp`` feeding a sum/mean (a softmax or logsumexp written by hand), the path between them,
  the reduction and the division or log that consumes it; fp16 exp overflows above 11 and its sum rounds.
- ``small_divisor``: a division by a constant below 1e-3, or by ``x + eps`` / ``clamp(x, min=eps)`` /
  ``sqrt(x + eps)`` with eps below 1e-3 (and ``x * rsqrt(x + eps)``): eps underflows or vanishes in the low
  dtype, and a near-zero divisor overflows it.
- ``manual_norm``: an L2 / RMS / variance normalisation written by hand (``pow(2)`` -> ``mean``/``sum`` ->
  ``+ eps`` -> ``rsqrt``/``sqrt`` -> ``mul``/``div``; ``var``; ``norm`` -> ``div``): squares overflow fp16 and
  the mean of squares loses the small ones.

``mark`` answers which nodes each pattern holds and why; the rules policy turns that into fp32 decisions named
``pattern:<name>`` in the report. Matchers only read the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.fx

from precast.policy.op_families import ATTENTION_OPS, GEMM_OPS

# name -> what it keeps in fp32 (the order is the matching order: the first pattern to claim a node names it)
PATTERNS = {
    "manual_norm": "L2/RMS/variance normalisations written by hand",
    "small_divisor": "divisions by a constant or an epsilon below 1e-3",
    "exp_reduce": "exp feeding a sum or mean (softmax / logsumexp by hand)",
    "sincos_angles": "angles fed to sin/cos (rotary and sinusoidal position embeddings)",
}
EPS_MAX = 1e-3  # an epsilon or divisor below this is "small" (fp16's smallest normal is 6.1e-5)
EXP_REACH = 6  # ops between an exp and the reduction it feeds
ANGLE_REACH = 16  # ops from sin/cos back to the positions (rotary: about 8); bounds the walk on odd graphs

SQUARES = frozenset({"pow", "square"})
SUM_MEAN = frozenset({"sum", "mean", "nansum", "nanmean"})
VARIANCE = frozenset({"var", "std", "var_mean", "std_mean"})
VECTOR_NORMS = frozenset({"norm", "linalg_vector_norm", "frobenius_norm"})
REDUCTIONS = SUM_MEAN | VARIANCE | VECTOR_NORMS
ROOTS = frozenset({"sqrt", "rsqrt", "reciprocal"})
GUARDS = frozenset({"add", "clamp", "clamp_min", "maximum"})
APPLIES = frozenset({"mul", "div"})
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
class Match:
    """A node a pattern keeps in fp32: the pattern's name and the sentence the report shows."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class Graph:
    """What the matchers read: the graph, which placeholders are learned parameters, and a constant's value."""

    graph: torch.fx.Graph
    parameters: frozenset[str]
    constant: Callable[[torch.fx.Node], torch.Tensor | None]


def mark(
    graph: torch.fx.Graph,
    patterns: Iterable[str] | None = None,
    *,
    parameters: Iterable[str] = (),
    constant: Callable[[torch.fx.Node], torch.Tensor | None] | None = None,
) -> dict[str, Match]:
    """node name -> Match for every node one of ``patterns`` (default: all of ``PATTERNS``) keeps in fp32.

    ``parameters``: names of the placeholders holding learned weights (a layer reading one computes an
    activation, where the angle search stops); ``constant(node)``: the value of a constant placeholder or None
    (a 0-d constant can be an epsilon)."""
    g = Graph(graph, frozenset(parameters), constant or (lambda node: None))
    wanted = parse_patterns(patterns)
    found: dict[str, Match] = {}
    for name in PATTERNS:
        if name in wanted:
            for node, reason in MATCHERS[name](g):
                found.setdefault(node.name, Match(name, f"pattern {name}: {reason}"))
    return found


# ---- graph helpers ------------------------------------------------------------------------------------------


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


# ---- sincos_angles ------------------------------------------------------------------------------------------


def sincos_angles(g: Graph) -> Iterator[tuple[torch.fx.Node, str]]:
    for trig in g.graph.nodes:
        if op(trig) not in ("sin", "cos"):
            continue
        yield (
            trig,
            f"{op(trig)} of angles: an angle near 500 rounds by up to 0.125 in fp16 (1 in bf16), its "
            f"{op(trig)} by as much",
        )
        why = f"computes the angles fed to {trig.name} (positions x frequencies)"
        seen: set[torch.fx.Node] = set()
        frontier = list(trig.all_input_nodes)
        for _ in range(ANGLE_REACH):  # the walk stops at placeholders, learned layers and ANGLE_REACH ops up
            nxt = []
            for node in frontier:
                if node in seen or node.op != "call_function" or learned(g, node):
                    continue
                seen.add(node)
                yield node, why
                nxt.extend(node.all_input_nodes)
            frontier = nxt
        yield from _scalings(g, trig)


def _scalings(g: Graph, trig: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, str]]:
    """Ops that rescale a sin/cos table by constants (``cos * attention_scaling``): the table stays fp32 until it
    meets an activation."""
    stack, seen = [trig], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            others = [
                a for a in user.all_input_nodes if a is not node and floating(a) and not is_constant(g, a)
            ]
            if op(user) in TRANSPARENT or (op(user) in ELEMENTWISE and not others):
                if op(user) not in TRANSPARENT:
                    yield user, f"scales the table of {trig.name} by a constant"
                stack.append(user)


# ---- exp_reduce ---------------------------------------------------------------------------------------------


def exp_reduce(g: Graph) -> Iterator[tuple[torch.fx.Node, str]]:
    for exp in g.graph.nodes:
        if op(exp) not in ("exp", "exp2"):
            continue
        parent: dict[torch.fx.Node, torch.fx.Node] = {}
        frontier, reductions = [exp], []
        for _ in range(EXP_REACH):
            nxt = []
            for node in frontier:
                for user in node.users:
                    if user in parent or user is exp:
                        continue
                    parent[user] = node
                    name = op(user)
                    if name in SUM_MEAN:
                        reductions.append(user)
                    elif name in ELEMENTWISE or name in TRANSPARENT:
                        nxt.append(user)
            frontier = nxt
        if not reductions:
            continue
        why = f"{exp.name} feeds a reduction (a softmax or logsumexp by hand)"
        yield exp, f"exp feeding {reductions[0].name}: fp16 exp overflows above 11 and its sum rounds"
        for red in reductions:
            node = red
            while node is not exp:
                yield node, why
                node = parent[node]
            for user in consumers(red):
                if op(user) in ("div", "log", "log1p", "reciprocal"):
                    yield user, f"normalizes by the sum {red.name} of {exp.name}"


# ---- small_divisor ------------------------------------------------------------------------------------------


def _guard(g: Graph, node: object) -> tuple[list[torch.fx.Node], float, object] | None:
    """For ``x + eps``, ``clamp(x, min=eps)``, ``max(x, eps)``, optionally under ``sqrt`` (through views): the
    nodes involved, eps and x; None when ``node`` is not such a guard or eps is not small."""
    node = source(node)
    chain = []
    if op(node) == "sqrt":
        chain.append(node)
        node = source(node.args[0])
    name = op(node)
    if name not in GUARDS:
        return None
    args = list(node.args) + [node.kwargs.get("min")]
    if name == "add":
        for x, eps in ((args[0], args[1]), (args[1], args[0])):
            if small(scalar(g, eps)) and isinstance(x, torch.fx.Node) and not is_constant(g, x):
                return [*chain, node], scalar(g, eps), x
        return None
    eps = scalar(g, args[1]) if len(node.args) > 1 else scalar(g, node.kwargs.get("min"))
    return ([*chain, node], eps, args[0]) if small(eps) else None


def _with_base(chain: list[torch.fx.Node], base: object) -> list[torch.fx.Node]:
    """The guard's chain plus the reduction it guards (``norm(x).clamp_min(eps)``), if any."""
    base = source(base)
    return [*chain, base] if op(base) in REDUCTIONS else chain


def small_divisor(g: Graph) -> Iterator[tuple[torch.fx.Node, str]]:
    for node in g.graph.nodes:
        name = op(node)
        if name == "div" and len(node.args) > 1:
            den = node.args[1]
            value = scalar(g, den)
            if small(value):
                yield node, f"divides by {value:g} (< {EPS_MAX:g}): the quotient overflows the low dtype"
                continue
            found = _guard(g, den) if isinstance(den, torch.fx.Node) else None
        elif name == "mul":
            found = _negative_power(g, node)
        else:
            continue
        if found is None:
            continue
        chain, eps, base = found
        why = f"divides by a value guarded by eps={eps:g} (< {EPS_MAX:g}), which the low dtype loses"
        yield node, why
        for n in _with_base(chain, base):
            yield n, why


def _negative_power(g: Graph, mul: torch.fx.Node) -> tuple[list[torch.fx.Node], float, object] | None:
    """``a * rsqrt(x + eps)``, ``a * reciprocal(x + eps)``, ``a * pow(x + eps, -z)``."""
    for arg in mul.args[:2]:
        inv = source(arg)
        name = op(inv)
        if name in ("rsqrt", "reciprocal") or (name == "pow" and _negative(inv)):
            found = _guard(g, inv.args[0])
            if found is not None:
                return [inv, *found[0]], found[1], found[2]
    return None


def _negative(pow_node: torch.fx.Node) -> bool:
    exp = pow_node.args[1] if len(pow_node.args) > 1 else None
    return isinstance(exp, (int, float)) and exp < 0


# ---- manual_norm --------------------------------------------------------------------------------------------


def manual_norm(g: Graph) -> Iterator[tuple[torch.fx.Node, str]]:
    for red in g.graph.nodes:
        name = op(red)
        if name in SUM_MEAN:
            sq = source(red.args[0])
            if not _square(sq):
                continue
            head = [sq, red, *_centering(sq)]
        elif name in VARIANCE or name in VECTOR_NORMS:
            head = [red]
        else:
            continue
        tail = _applied(g, red, root_needed=name in SUM_MEAN or name in ("var", "var_mean"))
        if tail is None:
            continue
        what = f"the {name} of squares" if name in SUM_MEAN else f"a {name}"
        why = (
            f"normalises by {what} ({red.name}) by hand: squares overflow fp16, small ones vanish in the sum"
        )
        for node in head + tail + _numerators(head, tail):
            yield node, why


def _numerators(head: list[torch.fx.Node], tail: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """In ``(x - mean) / sqrt(var + eps)`` the numerator is the centering again (export records it twice)."""
    centering = next((n for n in head if op(n) == "sub"), None)
    if centering is None:
        return []
    same = [source(a) for a in centering.args[:2]]
    return [
        s
        for n in tail
        for s in map(source, n.args[:2])
        if op(s) == "sub" and s is not centering and [source(a) for a in s.args[:2]] == same
    ]


def _square(node: object) -> bool:
    name = op(node)
    if name in SQUARES:
        return name == "square" or (len(node.args) > 1 and node.args[1] == 2)
    return name == "mul" and len(node.args) > 1 and source(node.args[0]) is source(node.args[1])


def _centering(sq: torch.fx.Node) -> list[torch.fx.Node]:
    """``x - mean(x)`` squared (a variance by hand): the subtraction and that mean."""
    x = source(sq.args[0])
    if op(x) != "sub" or not isinstance(x.args[1], torch.fx.Node):
        return []
    mean = source(x.args[1])
    return [x, mean] if op(mean) in SUM_MEAN and source(mean.args[0]) is source(x.args[0]) else [x]


def _applied(g: Graph, red: torch.fx.Node, *, root_needed: bool) -> list[torch.fx.Node] | None:
    """The ops that turn the reduction into a normaliser and apply it: an optional ``+ eps`` / clamp, then
    rsqrt/sqrt/reciprocal/``pow(-z)`` (required after a mean of squares or a variance), then the mul (by an
    inverse) or div (by a magnitude) using it. None when the reduction is not applied as a normaliser."""
    nodes, cur = [], red
    guard = next((u for u in consumers(cur) if op(u) in GUARDS and _scalar_operand(g, u)), None)
    if guard is not None:
        nodes.append(guard)
        cur = guard
    root = next((u for u in consumers(cur) if op(u) in ROOTS or (op(u) == "pow" and _negative(u))), None)
    if root is not None:
        nodes.append(root)
        cur = root
    elif root_needed:
        return None
    inverse = op(cur) in ("rsqrt", "reciprocal", "pow")
    apply = [
        u
        for u in consumers(cur)
        if (op(u) == "div" and _operand_index(u, cur) == 1)
        or (inverse and op(u) == "mul" and _operand_index(u, cur) is not None)
    ]
    return nodes + apply if apply else None


def _scalar_operand(g: Graph, node: torch.fx.Node) -> bool:
    """``x + c``, ``clamp(x, min=c)``, ``max(x, c)`` with a constant number c."""
    others = list(node.args[1:]) + [node.kwargs.get("min"), node.kwargs.get("other")]
    return any(scalar(g, a) is not None for a in others if a is not None)


def _operand_index(user: torch.fx.Node, value: torch.fx.Node) -> int | None:
    """Which operand of ``user`` is ``value`` (through views), or None."""
    for i, a in enumerate(user.args[:2]):
        if isinstance(a, torch.fx.Node) and (a is value or source(a) is value):
            return i
    return None


MATCHERS: dict[str, Callable[[Graph], Iterator[tuple[torch.fx.Node, str]]]] = {
    "manual_norm": manual_norm,
    "small_divisor": small_divisor,
    "exp_reduce": exp_reduce,
    "sincos_angles": sincos_angles,
}


def parse_patterns(patterns: object) -> frozenset[str]:
    """``None``: every pattern; ``()``: none; a name or names from ``PATTERNS``. ValueError names the unknown."""
    if patterns is None:
        return frozenset(PATTERNS)
    names = (patterns,) if isinstance(patterns, str) else patterns
    try:
        names = tuple(names)
    except TypeError:
        raise ValueError(
            f"patterns={patterns!r}: give None, () or names from {', '.join(PATTERNS)}"
        ) from None
    unknown = [n for n in names if n not in PATTERNS]
    if unknown:
        raise ValueError(
            f"patterns: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(PATTERNS)}"
        )
    return frozenset(names)
