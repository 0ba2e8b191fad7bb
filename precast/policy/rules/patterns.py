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

Input: the graph before any decision. Output: ``Match`` records per node kept fp32, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.fx

from precast.policy.rules.pattern_graph import (
    ELEMENTWISE,
    EPS_MAX,
    TRANSPARENT,
    Graph,
    consumers,
    floating,
    is_constant,
    learned,
    op,
    operand_index,
    scalar,
    scalar_operand,
    small,
    source,
)

# name -> what it keeps in fp32 (the order is the matching order: the first pattern to claim a node names it)
PATTERNS = {
    "manual_norm": "L2/RMS/variance normalisations written by hand",
    "small_divisor": "divisions by a constant or an epsilon below 1e-3",
    "exp_reduce": "exp feeding a sum or mean (softmax / logsumexp by hand)",
    "sincos_angles": "angles fed to sin/cos (rotary and sinusoidal position embeddings)",
}
EXP_REACH = 6  # ops between an exp and the reduction it feeds
ANGLE_REACH = 16  # ops from sin/cos back to the positions (rotary: about 8); bounds the walk on odd graphs

SQUARES = frozenset({"pow", "square"})
SUM_MEAN = frozenset({"sum", "mean", "nansum", "nanmean"})
VARIANCE = frozenset({"var", "std", "var_mean", "std_mean"})
VECTOR_NORMS = frozenset({"norm", "linalg_vector_norm", "frobenius_norm"})
REDUCTIONS = SUM_MEAN | VARIANCE | VECTOR_NORMS
ROOTS = frozenset({"sqrt", "rsqrt", "reciprocal"})
GUARDS = frozenset({"add", "clamp", "clamp_min", "maximum"})


@dataclass(frozen=True)
class Match:
    """A node a pattern keeps in fp32: the pattern's name and the sentence the report shows."""

    pattern: str
    reason: str


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
    guard = next((u for u in consumers(cur) if op(u) in GUARDS and scalar_operand(g, u)), None)
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
        if (op(u) == "div" and operand_index(u, cur) == 1)
        or (inverse and op(u) == "mul" and operand_index(u, cur) is not None)
    ]
    return nodes + apply if apply else None


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
