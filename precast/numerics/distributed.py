"""Calibration statistics and sensitivity energies reduced over a ``torch.distributed`` process group, the way a
data-parallel job reduces its gradients: each rank measures its shard of the data, one collective per kind of
value makes every rank hold the merged value.

- ``calibration``: ranges by all_reduce MAX (absmax, max, -min) on float64, counts by SUM on int64 (exact, so
  bitwise ``Calibration.merge`` of the shards, and bitwise one process over the same batches); the kept sample,
  the globally first ``keep`` batches, is broadcast tensor by tensor from the rank that holds each batch, so
  every rank can run the tolerance search and convert (nothing is pickled).
- ``energies``: sums by SUM on float64 (to float rounding), ranges by MAX / MIN / SUM.

Tensors go on the device the backend needs (CUDA for nccl, CPU otherwise): float64 and int64 reductions and
broadcasts of the inputs' own dtypes, which both gloo and nccl support. Every rank must pass the same program:
its graph key is compared first (one line on every rank otherwise).

Input: a process group (or None: the default group when one is initialised), the rank's value. Output: the
merged value, on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.utils._pytree as pytree

from precast.errors import PrecastError
from precast.ir.inputs import user_input_nodes
from precast.ir.program import Program
from precast.numerics.calibration.checks import measured_nodes
from precast.numerics.energies import Energies
from precast.policy.measurements import COUNTS, Calibration, NodeStats


def process_group(group: Any = None) -> Any:
    """``group``; None: the default group when torch.distributed is initialised, else None (one process);
    False: None (this process alone, even in a job). Every rank of the group must make the same call."""
    dist = torch.distributed
    if group is False:
        return None
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PrecastError(
                "group=: torch.distributed is not initialised; call torch.distributed.init_process_group first "
                "(torchrun sets the environment it reads)"
            )
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def rank_and_size(group: Any) -> tuple[int, int]:
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _device(group: Any) -> torch.device:
    backend = str(torch.distributed.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    t = t.to(_device(group))
    torch.distributed.all_reduce(t, op=op, group=group)
    return t.cpu()


def check_same_key(key: str, group: Any, what: str) -> None:
    """One line on every rank when the ranks measured different programs (keys differ)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)
    t = _all_reduce(torch.tensor([h, -h], dtype=torch.int64), torch.distributed.ReduceOp.MAX, group)
    if int(t[0]) != h or -int(t[1]) != h:
        rank = torch.distributed.get_rank(group)
        raise PrecastError(
            f"{what} on rank {rank}: the ranks measured different programs (graph key {key} here); every rank "
            "must export the same model the same way and pass the same options"
        )


def reduce_calibration(cal: Calibration, program: Program, ep: Any, group: Any) -> Calibration:
    """The calibration of every rank's batches, on every rank (``cal``: this rank's, its sample tagged with
    global batch indices)."""
    check_same_key(f"{cal.key}{cal.dtype}", group, "calibration")
    ReduceOp = torch.distributed.ReduceOp
    names = measured_nodes(program.graph)  # what one process records (export's dtype asserts are not run)
    stats = [cal.stats.get(k, NodeStats()) for k in names]
    ranges = _all_reduce(
        torch.tensor([[s.absmax, s.max, -s.min] for s in stats], dtype=torch.float64), ReduceOp.MAX, group
    ).tolist()
    counts = _all_reduce(
        torch.tensor([[getattr(s, c) for c in COUNTS] for s in stats] + [[cal.batches] * len(COUNTS)]),
        ReduceOp.SUM,
        group,
    ).tolist()
    out = Calibration(
        source=cal.source,
        keep=cal.keep,
        key=cal.key,
        dtype=cal.dtype,
        batches=int(counts[-1][0]),
        parts=(_shared_id(cal, group),),
    )
    if out.batches:  # one pass over any batch records every placeholder and op
        for k, (absmax, hi, neg_lo), c in zip(names, ranges, counts, strict=False):
            out.stats[k] = NodeStats(
                absmax, -neg_lo + 0.0, hi + 0.0, **dict(zip(COUNTS, map(int, c), strict=True))
            )
    out.sample_index, out.sample = _share_sample(cal, program, ep, group)
    return out


def _shared_id(cal: Calibration, group: Any) -> str:
    """One measurement id for the reduced statistics, the same on every rank (rank 0's id, broadcast): files two
    ranks save of the one reduction share it, so merging them (counting every batch twice) is refused."""
    mine = bytes.fromhex(cal.parts[0]) if cal.parts else bytes(16)
    t = torch.tensor(list(mine[:16].ljust(16, b"\0")), dtype=torch.int64).to(_device(group))
    src = torch.distributed.get_global_rank(group, 0) if group is not torch.distributed.group.WORLD else 0
    torch.distributed.broadcast(t, src, group=group)
    return bytes(t.cpu().tolist()).hex()


def _share_sample(cal: Calibration, program: Program, ep: Any, group: Any) -> tuple[list[int], list]:
    """The globally first ``keep`` kept batches, on every rank: indices all-gathered, then each batch broadcast
    from the rank that holds it (shapes first, then the tensors; non-tensor inputs are the program's constants)."""
    dist = torch.distributed
    rank, world = rank_and_size(group)
    keep = int(_all_reduce(torch.tensor([cal.keep]), dist.ReduceOp.MAX, group)[0])
    if keep == 0:
        return [], []
    mine = torch.full((keep,), -1, dtype=torch.int64)
    mine[: len(cal.sample_index)] = torch.tensor(cal.sample_index[:keep], dtype=torch.int64)
    device = _device(group)
    gathered = [torch.empty_like(mine, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    owner = {int(i): r for r, t in enumerate(gathered) for i in t.cpu().tolist() if i >= 0}
    chosen = sorted(owner)[:keep]
    nodes = user_input_nodes(program)
    spec = ep.call_spec.in_spec
    local = dict(zip(cal.sample_index, cal.sample, strict=True))
    out = []
    for index in chosen:
        src = owner[index]
        src_global = dist.get_global_rank(group, src) if group is not dist.group.WORLD else src
        leaves = pytree.tree_leaves(local[index]) if src == rank else [None] * len(nodes)
        got = []
        for node, leaf in zip(nodes, leaves, strict=True):
            want = node.meta.get("val")
            if not isinstance(want, torch.Tensor):
                if not isinstance(want, (bool, int, float)) and rank != src:
                    raise PrecastError(
                        f"calibration: input {node.name} is not a tensor nor a constant of the program; a batch "
                        "with such an input cannot travel between ranks (give tensors)"
                    )
                got.append(leaf if rank == src else want)
                continue
            shape = torch.tensor(list(leaf.shape) if rank == src else [0] * want.dim(), dtype=torch.int64)
            shape = shape.to(device)
            dist.broadcast(shape, src_global, group=group)
            buf = (
                leaf.contiguous().to(device)
                if rank == src
                else torch.empty(shape.tolist(), dtype=want.dtype, device=device)
            )
            dist.broadcast(buf, src_global, group=group)
            # the owner keeps its own tensor (its strides too); the others a copy on the program's device
            got.append(leaf if rank == src else buf.to(want.device))
        out.append(local[index] if rank == src else pytree.tree_unflatten(got, spec))
    return chosen, out


def reduce_energies(e: Energies, group: Any) -> Energies:
    """Every rank's energies summed (float64: equal to rounding to the sums one process makes), ranges merged."""
    least = _all_reduce(torch.tensor([e.batches]), torch.distributed.ReduceOp.MIN, group)
    if int(least[0]) == 0:  # said on every rank (a rank that stopped alone would leave the others waiting)
        raise PrecastError("sensitivity: a rank has no batch in data=; give every rank at least one batch")
    reads = sorted(e.energy)
    check_same_key(f"{e.key}|{len(reads)}|{len(e.ranges)}", group, "sensitivity")
    ReduceOp = torch.distributed.ReduceOp
    ops = sorted(e.ranges)
    sums = _all_reduce(
        torch.tensor([e.energy[k] for k in reads] + [float(e.batches)], dtype=torch.float64),
        ReduceOp.SUM,
        group,
    ).tolist()
    inf = float("inf")
    hi = _all_reduce(
        torch.tensor(
            [[e.ranges[k][0], -(e.ranges[k][1] if e.ranges[k][1] is not None else inf)] for k in ops],
            dtype=torch.float64,
        ).reshape(-1, 2),
        ReduceOp.MAX,
        group,
    ).tolist()
    counts = _all_reduce(
        torch.tensor([[e.ranges[k][2], e.ranges[k][3]] for k in ops], dtype=torch.int64).reshape(-1, 2),
        ReduceOp.SUM,
        group,
    ).tolist()
    ranges = {
        k: (a + 0.0, None if m == -inf else -m + 0.0, int(s), int(z))
        for k, (a, m), (s, z) in zip(ops, hi, counts, strict=True)
    }
    return Energies(
        e.key, e.dtype, e.metric, int(sums[-1]), dict(zip(reads, sums[:-1], strict=True)), ranges, e.ranked_by
    )
