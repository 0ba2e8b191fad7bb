"""Calibration statistics checked against the program they are for: the nodes calibration measures
(``measured_nodes``), and one line when statistics were measured on another program, for another low dtype, or
cover other nodes (``check_calibration``, ``check_coverage``). The values themselves (``NodeStats``, a mergeable
``Calibration`` and its files) are ``precast.policy.measurements``; reading files back as
untrusted input is ``precast.numerics.calibration.files``.

Input: a calibration and a program's graph. Output: node names, one-line PrecastErrors.
"""

from __future__ import annotations

import torch
import torch.fx

from precast.dtypes import dtype_name
from precast.errors import PrecastError
from precast.policy.measurements import (
    Calibration,
)

# batches kept from the single pass over the calibration data for the tolerance search (several forwards each)
TOLERANCE_BATCHES = 8


def measured_nodes(graph: torch.fx.Graph) -> list[str]:
    """The nodes calibration measures, in graph order: every placeholder and op but export's dtype asserts."""
    return [
        n.name
        for n in graph.nodes
        if n.op in ("placeholder", "call_function")
        and n.target is not torch.ops.aten._assert_tensor_metadata.default
    ]


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_coverage(cal: Calibration, names: list[str], where: str) -> None:
    """One line unless ``cal`` has statistics of exactly ``names`` (``measured_nodes``): a node the program lacks
    would be ignored, a missing one decided without data; a calibration of no batch (a shard with no data) may
    hold none."""
    want = set(names)
    extra = sorted(set(cal.stats) - want)
    if extra:
        raise PrecastError(
            f"{where}: statistics of {len(extra)} node(s) the program does not have ({_few(extra)}); "
            "calibrate this program (precast.calibrate on the same program or module and inputs)"
        )
    missing = [n for n in names if n not in cal.stats]
    if missing and cal.batches:
        raise PrecastError(
            f"{where}: no statistics for {len(missing)} of the program's {len(names)} measured node(s) "
            f"({_few(missing)}); calibrate this program again (a calibration measures every node)"
        )


def check_calibration(
    cal: Calibration, key: str, low: torch.dtype | None, where: str, names: list[str] | None = None
) -> None:
    """One line if ``cal`` was measured on another program or for another low dtype, or (``names``: the
    program's ``measured_nodes``) holds statistics of nodes the program does not have."""
    if cal.key != key:
        raise PrecastError(
            f"{where}: measured on another program (graph key {cal.key or 'none'}, this program's is {key}); "
            "calibrate this export of the model (precast.calibrate on the same program or module and inputs)"
        )
    want = dtype_name(low)
    if cal.dtype is not None and want is not None and cal.dtype != want:
        raise PrecastError(
            f"{where}: measured for {cal.dtype}, this conversion lowers to {want}; calibrate with dtype={want!r}"
        )
    if names is not None:
        extra = sorted(set(cal.stats) - set(names))
        if extra:
            check_coverage(cal, names, where)
