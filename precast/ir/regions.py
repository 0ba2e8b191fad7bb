"""Autocast regions as data: the region records ``inline_regions`` tags ops with (``node.meta``), and the
innermost region in force for an op on a device.

Input: a node. Output: its enclosing ``Region`` records, or the autocast state they put it in
(``region_autocast``: what a forward of the inlined program enters to run the node as the program wrote it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from precast.dtypes import dtype_name
from precast.errors import short_path

WRAP_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


WRAP_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


REGION_META = "precast_regions"
# on ops spliced out of the autocast region policy "torch" opened around a module's forward while capturing it
# (capture.POLICY_REGION): their recorded dtypes are the policy's doing, not the program's
POLICY_OP_META = "precast_policy_op"


@dataclass(frozen=True)
class Region:
    """One ``torch.autocast`` region of the program."""

    id: int
    device_type: str
    dtype: torch.dtype
    enabled: bool
    cache_enabled: bool | None
    source: str | None  # user's source line of the region's first op
    module: str  # module path of the region's first op

    def describe(self) -> str:
        state = f"{dtype_name(self.dtype)}" if self.enabled else "enabled=False"
        loc = f" at {short_path(self.source)}" if self.source else ""
        return f"autocast({self.device_type}, {state}){loc}"


def regions_of(node: torch.fx.Node) -> tuple[Region, ...]:
    """Enclosing regions, outermost first."""
    return node.meta.get(REGION_META, ())


def innermost_region(node: torch.fx.Node, device_type: str) -> Region | None:
    for region in reversed(regions_of(node)):
        if region.device_type == device_type:
            return region
    return None


def region_autocast(node: torch.fx.Node) -> contextlib.AbstractContextManager:
    """The node's regions entered outermost first, as eager runs the op inside them: a forward of the program with
    its regions inlined (calibration, the tolerance search's reference) computes what the program computes. A
    region for a device type this process has no backend for changes nothing for the op and is not entered."""
    regions = [r for r in regions_of(node) if _has_backend(r.device_type)]
    if not regions:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for r in regions:
        stack.enter_context(
            torch.autocast(r.device_type, dtype=r.dtype, enabled=r.enabled, cache_enabled=False)
        )
    return stack


def _has_backend(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    backend = getattr(torch, device_type, None)
    return bool(getattr(backend, "is_available", lambda: False)())
