"""A hypothesis generator of small *stateful* ``nn.Module`` programs: state written from low-precision values.

Each example is a list of steps over a ``(batch, dim)`` activation ``h`` (a ``StatefulSpec``), rendered as the
source of one ``nn.Module`` so a failure prints as a file one can paste. The steps reach the patterns that a
program run under eager ``torch.autocast`` writes into its own state:

- ``copy_`` of the mean of a (low-precision) linear output, or of a linear output's first row, into a buffer;
- running statistics updated in place (``mul_`` then ``add_`` of a low-precision mean), into a buffer or into a
  Parameter (written under ``no_grad``, as inference runs it);
- ``index_copy_`` of a row into a 2-d buffer (eager refuses a dtype mismatch there; such examples are filtered);
- ``F.batch_norm`` in inference mode reading those buffers as running mean / running var, with a Parameter as
  running var;
- nested ``einsum``, ``linear`` and ``bmm``, so the autocast low dtype reaches the writes.

Weights come from the spec's ``seed`` only (a private generator), never from the global RNG, so a failing spec
rebuilds the same module in any process: the repro a failure prints is the one that failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

STEPS = (
    "linear",
    "bmm",
    "einsum_nested",
    "copy_mean",
    "copy_mean_h",
    "linear_table",
    "einsum_table",
    "einsum_param",
    "copy_row",
    "running_buffer",
    "running_param",
    "index_copy",
    "batch_norm",
    "batch_norm_buffers",
    "read_state",
    "region_linear",
    "ema_buffer",
    "ema_buffer_inplace",
    "einsum_buffer",
)


@dataclass(frozen=True)
class StatefulSpec:
    """A generated stateful module: its steps, sizes and weight seed. ``source()`` renders it."""

    steps: tuple[str, ...]
    dim: int = 8
    batch: int = 4
    seed: int = 0

    def source(self) -> str:
        d, h = self.dim, self.dim // 2
        body: list[str] = []
        for i, step in enumerate(self.steps):
            body += _STEP_SOURCE[step].format(i=i, d=d, half=h, s=f"{d**-0.5:.4g}").splitlines()
        init = [
            f"g = torch.Generator().manual_seed({self.seed})",
            f"self.w = nn.Parameter(torch.randn({d}, {d}, generator=g) * {d**-0.5:.4g})",
            f"self.sq = nn.Parameter(torch.randn({h}, {h}, generator=g) * {h**-0.5:.4g})",
            f"self.bn_w = nn.Parameter(torch.rand({d}, generator=g) + 0.5)",
            f"self.bn_b = nn.Parameter(torch.randn({d}, generator=g) * 0.1)",
            f'self.register_buffer("running_mean", torch.randn({d}, generator=g) * 0.1)',
            f'self.register_buffer("running_var", torch.rand({d}, generator=g) + 0.5)',
            f"self.var_param = nn.Parameter(torch.rand({d}, generator=g) + 0.5)",
            f'self.register_buffer("table", torch.randn({d}, {d}, generator=g) * 0.1)',
        ]
        return (
            "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n"
            "class Stateful(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + "".join(f"        {line}\n" for line in init)
            + "\n    def forward(self, x):\n        h = x\n        y = x\n"
            + "".join(f"        {line}\n" for line in body)
            + "        return h\n"
        )

    def module(self) -> torch.nn.Module:
        scope: dict = {}
        exec(compile(self.source(), "<stateful>", "exec"), scope)  # noqa: S102 - our own generated source
        return scope["Stateful"]()

    def inputs(self, call: int = 0) -> tuple[torch.Tensor]:
        """The input of the ``call``-th call (successive calls see different inputs)."""
        g = torch.Generator().manual_seed(self.seed * 7 + call)
        return (torch.randn(self.batch, self.dim, generator=g),)

    def __repr__(self) -> str:
        return (
            f"StatefulSpec(steps={self.steps!r}, dim={self.dim}, batch={self.batch}, seed={self.seed})\n"
            f"# inputs: spec.inputs(call) for call in 0, 1, 2\n{self.source()}"
        )


_STEP_SOURCE = {
    "linear": "h = F.linear(h, self.w)",
    "bmm": "a{i} = h.reshape(-1, 2, {half})\nh = torch.bmm(a{i}, self.sq.expand(a{i}.shape[0], -1, -1)).reshape(-1, {d})",
    "einsum_nested": 'h = torch.einsum("bij,bj->bi", torch.einsum("bi,bj->bij", h, h), h) * {s}',
    "copy_mean": "self.running_mean.copy_(F.linear(h, self.w).mean(0))",
    "copy_mean_h": "self.running_mean.copy_(h.mean(0))",
    "einsum_param": 'h = torch.einsum("bi,i->bi", h, self.var_param)',
    "linear_table": "h = F.linear(h, self.table)",
    "einsum_table": 'h = torch.einsum("bi,ij->bj", h, self.table)',
    "copy_row": "self.table[:1].copy_(F.linear(h, self.w)[:1])",
    "running_buffer": "self.running_mean.mul_(0.9).add_(h.mean(0) * 0.1)\n"
    "self.running_var.mul_(0.9).add_(h.var(0) * 0.1 + 0.05)",
    "running_param": "self.var_param.mul_(0.9).add_(h.var(0) * 0.1 + 0.05)",
    "index_copy": "self.table.index_copy_(0, torch.tensor([{i} % {d}]), F.linear(h, self.w)[:1])",
    "batch_norm": "h = F.batch_norm(h, self.running_mean, self.var_param, self.bn_w, self.bn_b, training=False)",
    "batch_norm_buffers": "h = F.batch_norm(h, self.running_mean, self.running_var, training=False)",
    "read_state": "h = h + self.running_mean + self.table[0] * self.running_var",
    # a Linear in the program's own fp16 region (nested in the ambient autocast), read on as its .float() copy
    "region_linear": 'with torch.autocast("cpu", dtype=torch.float16):\n    y = F.linear(h, self.w)\nh = y.float()',
    # a running mean from the last region linear's output (its mean, detached): read by the next call's reads
    "ema_buffer": "self.running_mean.copy_(self.running_mean * 0.75 + y.mean().detach())",
    "ema_buffer_inplace": "self.running_mean.mul_(0.75).add_(y.mean().detach())",
    # the written buffer read by a low-precision op (cast to the autocast dtype at each read, before and after
    # its writes)
    "einsum_buffer": 'h = torch.einsum("bi,i->bi", h, self.running_mean)',
}


@st.composite
def stateful_specs(draw, min_steps: int = 2, max_steps: int = 9) -> StatefulSpec:
    """A random stateful module of 2-9 steps (writes, batch norms and low-precision ops in any order)."""
    steps = draw(st.lists(st.sampled_from(STEPS), min_size=min_steps, max_size=max_steps))
    return StatefulSpec(
        steps=tuple(steps),
        dim=draw(st.sampled_from([8, 16])),
        batch=draw(st.integers(2, 6)),
        seed=draw(st.integers(0, 2**16)),
    )
