"""simplify_casts: exact-only cleanup on tiny graphs; every rewrite keeps values bitwise."""

from __future__ import annotations

import torch
import torch.fx

from precast.passes.simplify import simplify_casts

TO = torch.ops.aten._to_copy.default
BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def _graph(build, in_dtype):
    """A graph from build(graph, x) -> outputs, with meta['val'] filled by running it on a real tensor."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    out = build(graph, x)
    graph.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    sample = torch.randn(64).to(in_dtype) * 1000
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = sample
        elif node.op == "call_function":
            env[node] = node.target(*torch.fx.node.map_arg(node.args, env.get), **node.kwargs)
        if node.op != "output":
            node.meta["val"] = env[node]
    return gm, sample


def _casts(gm):
    return [n.kwargs["dtype"] for n in gm.graph.nodes if n.target is TO]


def _check(build, in_dtype):
    gm, sample = _graph(build, in_dtype)
    before = gm(sample)
    result = simplify_casts(gm.graph)
    gm.recompile()
    after = gm(sample)
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return gm, result


def test_same_dtype_cast_is_removed():
    gm, res = _check(
        lambda g, x: (g.call_function(torch.relu, (g.call_function(TO, (x,), {"dtype": BF}),)),), BF
    )
    assert _casts(gm) == [] and res.same_dtype == 1


def test_lossless_round_trip_is_removed():
    def build(g, x):
        up = g.call_function(TO, (x,), {"dtype": F32})
        down = g.call_function(TO, (up,), {"dtype": BF})
        return (g.call_function(torch.relu, (down,)),)

    gm, res = _check(build, BF)
    assert _casts(gm) == [] and res.round_trips == 1


def test_widening_first_cast_is_skipped_for_a_different_target():
    def build(g, x):
        up = g.call_function(TO, (x,), {"dtype": F32})
        return (g.call_function(TO, (up,), {"dtype": F16}),)

    gm, res = _check(build, BF)
    assert _casts(gm) == [F16]  # bf16 -> fp16 directly


def test_lossy_round_trip_is_kept():
    def build(g, x):
        down = g.call_function(TO, (x,), {"dtype": BF})
        return (g.call_function(TO, (down,), {"dtype": F32}),)

    gm, res = _check(build, F32)
    assert _casts(gm) == [BF, F32] and res.removed == 0


def test_duplicate_casts_are_merged():
    def build(g, x):
        a = g.call_function(TO, (x,), {"dtype": BF})
        b = g.call_function(TO, (x,), {"dtype": BF})
        return (g.call_function(torch.add, (a, b)),)

    gm, res = _check(build, F32)
    assert _casts(gm) == [BF] and res.duplicates == 1


def test_cast_that_is_mutated_in_place_is_kept():
    def build(g, x):
        a = g.call_function(TO, (x,), {"dtype": F32})
        g.call_function(torch.ops.aten.relu_.default, (a,))
        return (a, x)

    gm, res = _check(build, F32)
    assert _casts(gm) == [F32], "the copy is written in place: removing it would mutate the input"
