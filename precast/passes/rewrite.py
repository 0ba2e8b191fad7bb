"""Rewrite: make every decision explicit in the graph, one cast node per (producer, dtype, version).

A cast is shared by the readers of a producer only while they see the same version of its storage: an
in-place write to the producer or to any view of it between two readers gives the second reader a cast of its
own, made after the write (``precast/ir/mutation.py``).

Input: a classified Program. Output: the number of cast nodes inserted.
"""

from __future__ import annotations

import torch
import torch.fx

from precast.ir.fake import fake_cast, fake_state
from precast.ir.fake_run import remember_run
from precast.ir.graph import CAST_META, TO_COPY
from precast.ir.mutation import analyze
from precast.ir.program import Program
from precast.policy.base import apply_decision


def insert_casts(program: Program) -> int:
    """Apply each node's Decision (casts, dtype kwargs, redispatch). Returns the number of cast nodes added."""
    graph = program.graph
    alias = analyze(graph, program.input_spec, program.output_specs)
    state = fake_state(program)
    made: dict[tuple[torch.fx.Node, torch.dtype, int], torch.fx.Node] = {}
    added = 0
    for node in list(graph.nodes):
        decision = node.meta.get("precast")
        if node.op != "call_function" or decision is None:
            continue
        if not (decision.casts or decision.kwarg_updates or decision.new_target is not None):
            continue

        def cast(
            producer: torch.fx.Node, dtype: torch.dtype, consumer: torch.fx.Node = node
        ) -> torch.fx.Node:
            nonlocal added
            key = (producer, dtype, alias.version(producer, at=consumer))
            if key not in made:
                with graph.inserting_before(consumer):
                    c = graph.call_function(TO_COPY, (producer,), {"dtype": dtype})
                for k in ("stack_trace", "nn_module_stack", "precast_regions"):
                    if k in consumer.meta:
                        c.meta[k] = consumer.meta[k]
                val = producer.meta.get("val")
                if isinstance(val, torch.Tensor):
                    c.meta["val"] = fake_cast(state, val, dtype)
                    remember_run(state, c, TO_COPY, (val,), {"dtype": dtype}, c.meta["val"])
                c.meta[CAST_META] = dtype
                made[key] = c
                added += 1
            return made[key]

        target, args, kwargs = apply_decision(node.target, node.args, node.kwargs, decision, cast)
        node.target, node.args, node.kwargs = target, args, kwargs
    graph.lint()
    return added
