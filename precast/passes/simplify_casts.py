"""Exact-only cast cleanup. Every rewrite here leaves every value bitwise the same:

- a cast to the dtype its input already has is removed;
- a cast whose input is a *widening* cast (bf16/fp16 -> fp32 -> ...) skips it: bf16 -> fp32 -> fp16 equals
  bf16 -> fp16, and low -> fp32 -> low is the identity;
- casts of the same value to the same dtype are merged.

A narrowing cast is never removed: fp32 -> bf16 -> fp32 is not the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from precast.passes.insert_casts import TO_COPY, cast_dtype, is_cast

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


def _mutated(node: torch.fx.Node) -> bool:
    """Some user writes into this value in place: it must stay a separate copy."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, user.args, strict=False):
            if value is node and arg.alias_info is not None and arg.alias_info.is_write:
                return True
    return False


def simplify_casts(graph: torch.fx.Graph) -> SimplifyResult:
    result = SimplifyResult()
    output = graph.output_node()
    changed = True
    while changed:
        changed = False
        seen: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        for node in list(graph.nodes):
            if not is_cast(node) or _mutated(node):
                continue
            src, dtype = node.args[0], cast_dtype(node)
            src_dtype = _dtype(src)
            if src_dtype == dtype and not (src.op == "placeholder" and output in node.users):
                node.replace_all_uses_with(src)
                graph.erase_node(node)
                result.same_dtype += 1
                changed = True
                continue
            if (
                isinstance(src, torch.fx.Node)
                and is_cast(src)
                and (_dtype(src.args[0]), cast_dtype(src)) in LOSSLESS
            ):
                origin = src.args[0]
                node.args = (origin,)
                node.kwargs = {"dtype": dtype}
                node.target = TO_COPY
                result.round_trips += 1
                changed = True
                if not src.users:
                    graph.erase_node(src)
                continue
            key = (src, dtype)
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
                result.duplicates += 1
                changed = True
                continue
            seen[key] = node
    graph.eliminate_dead_code()
    graph.lint()
    return result
