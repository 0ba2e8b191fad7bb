"""Autocast regions: find the program's ``wrap_with_autocast`` higher-order ops and inline them.

``torch.export`` records ``with torch.autocast(...)`` (and ``@torch.autocast`` on a method) as
``torch.ops.higher_order.wrap_with_autocast(device_type, dtype, enabled, cache_enabled, submod, *operands)``.
Inlining copies the submodule's nodes into the parent graph and tags each with the stack of regions that
enclosed it (``node.meta["precast_regions"]``, outermost first). Classification then gives each op eager
autocast's semantics for its device type, from the innermost enclosing region of that device type.

Input: the program's GraphModule. Output: the regions inlined into it (``Region`` list; ops tagged).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from precast.errors import PrecastError, user_source_line, where
from precast.ir.regions import POLICY_OP_META, REGION_META, WRAP_AUTOCAST, WRAP_GRAD, Region


def inline_regions(gm: torch.fx.GraphModule) -> list[Region]:
    """Inline every autocast region (and grad-mode region) of ``gm`` in place; return the regions found."""
    regions: list[Region] = []
    _inline(gm, regions)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return regions


def _inline(gm: torch.fx.GraphModule, regions: list[Region]) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (WRAP_AUTOCAST, WRAP_GRAD):
            continue
        if node.target is WRAP_AUTOCAST:
            device_type, dtype, enabled, cache_enabled, submod_node, *operands = node.args
        else:
            # grad-mode regions carry no precision meaning; inline them so autocast regions inside are seen
            _, submod_node, *operands = node.args
        sub = getattr(gm, submod_node.target)
        _inline(sub, regions)  # nested regions first: their nodes get the inner tags
        region = None
        # the region policy "torch" opened around the whole forward while exporting (capture.POLICY_REGION): its
        # ops are the policy's, not a region of the program's own
        if node.target is WRAP_AUTOCAST and not node.meta.get("precast_policy_region"):
            first = next((n for n in sub.graph.nodes if n.op == "call_function"), None)
            region = Region(
                id=len(regions),
                device_type=str(device_type),
                dtype=dtype if dtype is not None else torch.get_autocast_dtype(str(device_type)),
                enabled=bool(enabled),
                cache_enabled=cache_enabled,
                source=user_source_line(first) if first is not None else None,
                module=_module_of(node, first),
            )
            regions.append(region)
        policy = node.target is WRAP_AUTOCAST and bool(node.meta.get("precast_policy_region"))
        _splice(gm, node, sub, operands, region, policy)
        gm.graph.erase_node(node)
        if not submod_node.users:
            gm.graph.erase_node(submod_node)
            gm.delete_submodule(submod_node.target)


def _module_of(node: torch.fx.Node, first: torch.fx.Node | None) -> str:
    from precast.errors import module_path

    return module_path(first) if first is not None else module_path(node)


def _splice(
    gm: torch.fx.GraphModule,
    hop: torch.fx.Node,
    sub: torch.fx.GraphModule,
    operands: list,
    region: Region | None,
    policy: bool = False,
) -> None:
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise PrecastError(
            f"autocast region {where(hop)} has {len(operands)} operands for {len(placeholders)} inputs"
        )
    env.update(zip(placeholders, operands, strict=True))
    outputs: tuple = ()
    with gm.graph.inserting_before(hop):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = tuple(env[a] if isinstance(a, torch.fx.Node) else a for a in n.args[0])
                continue
            if n.op == "get_attr":
                # a nested submodule that was not inlined (should not happen) or a constant attribute
                name = _copy_attr(gm, sub, n.target)
                new = gm.graph.get_attr(name)
                new.meta = dict(n.meta)
            else:
                new = gm.graph.node_copy(n, lambda a: env[a])
            if region is not None:
                new.meta[REGION_META] = (region, *n.meta.get(REGION_META, ()))
            if policy:
                new.meta[POLICY_OP_META] = True
            env[n] = new
    # the HOP returns a tuple; its users are getitem nodes
    for user in list(hop.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        else:
            raise PrecastError(f"unexpected use of autocast region output by {where(user)}")


def _copy_attr(gm: torch.fx.GraphModule, sub: torch.fx.GraphModule, target: str) -> str:
    value = sub
    for part in target.split("."):
        value = getattr(value, part)
    name, i = f"_precast_{target.replace('.', '_')}", 0
    while hasattr(gm, name):
        i += 1
        name = f"_precast_{target.replace('.', '_')}_{i}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        gm.register_buffer(name, value) if isinstance(value, torch.Tensor) else setattr(gm, name, value)
    return name
