"""One rank of ``torchrun --nproc-per-node N tests/numerics/dist_worker.py OUT`` (gloo, CPU), for
tests/numerics/test_distributed.py: calibrates its shard ``batches[rank::world]`` of the case's batches (reduced
over the default group by itself), converts with the merged statistics, estimates sensitivity energies on its
shard (summed over the group), and writes what it holds to ``OUT/rank<r>.*``. ``case()`` is the model and data
the test compares against one process."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

BATCHES = 8
CONVERT = {"policy": "rules", "dtype": "fp16", "tolerance": {"rel": 4e-3}}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = self.inp(x)
        h = h + torch.nn.functional.gelu(self.norm(h)) * 3.0
        return self.out(torch.softmax(h, dim=-1) * h)


def case() -> tuple[torch.export.ExportedProgram, list[tuple[torch.Tensor]]]:
    """The program and its 8 batches; batch 5 alone takes activations past fp16's data_max (512), so the merged
    statistics decide an op that no shard but one sees."""
    torch.manual_seed(0)
    model = Block().eval()
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 16, generator=g) * (300.0 if i == 5 else 1.0 + i / 4),) for i in range(BATCHES)
    ]
    return torch.export.export(model, batches[0]), batches


def program_hash(ep: torch.export.ExportedProgram) -> str:
    """sha256 of the converted graph's code and of every state tensor's name, dtype, shape and bytes (the saved
    archive also holds the report's timings, which differ from run to run)."""
    h = hashlib.sha256(ep.graph_module.code.encode())
    state = {**ep.state_dict, **ep.constants}
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(bytes(t.view(torch.uint8).reshape(-1).tolist()))
    return h.hexdigest()


def decisions(report) -> list:
    return [[r.name, r.dtype, r.rule] for r in report.nodes]


def main(out: Path) -> None:
    import precast

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ep, batches = case()
    shard = batches[rank::world]
    cal = precast.calibrate(ep, shard, dtype="fp16")  # reduced over the default group: every rank holds all
    res = precast.convert(ep, calibration=cal, **CONVERT)
    sens = precast.sensitivity(ep, batches[0], dtype="fp16", data=shard)
    cal.save(out / f"rank{rank}.cal.json")
    sens.energies.save(out / f"rank{rank}.energies.json")
    facts = {
        "hash": program_hash(res.program),
        "decisions": decisions(res.report),
        "order": sens.estimate.order,
    }
    # a rank without batches: calibration still merges (rank 0 measured all 8); sensitivity refuses on every rank
    precast.calibrate(ep, batches if rank == 0 else [], dtype="fp16").save(out / f"rank{rank}.uneven.json")
    try:
        precast.sensitivity(ep, batches[0], dtype="fp16", data=shard if rank == 0 else [])
    except precast.PrecastError as exc:
        facts["empty_rank"] = str(exc)
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    if rank == 0:  # convert measuring its own data reduces nothing: rank 0 alone must not wait for rank 1
        precast.convert(ep, calibration=batches[:2], policy="rules", dtype="fp16", verify=False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
