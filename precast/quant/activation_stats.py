"""Input statistics of a model's linear layers on calibration data: what data-aware int4 rounding
(``precast.quant.rounding``) fits against.

For each ``nn.Linear`` the sum of ``x x^T`` over every input row it saw (``hessian``, [in, in]: each batch's
product in fp32, summed in fp64 so that long calibration runs do not lose the small channels) and the row count; ``importance`` is its diagonal per row
(``E[x_j^2]``: llama.cpp's importance matrix). Collected with forward pre-hooks in one pass over the batches, the
hooks removed afterwards (also on error).

Input: a module and its calibration batches (each a dict of keyword arguments or a tuple of positional ones).
Output: ``{weight name: InputStats}``, keyed by the state-dict name of each linear's weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from precast.errors import PrecastError


@dataclass
class InputStats:
    """``hessian``: the sum of ``x x^T`` over ``rows`` input rows of one linear (fp64, [in, in])."""

    hessian: torch.Tensor
    rows: int = 0

    def add(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        self.hessian += (flat.T @ flat).to(torch.float64)  # one batch in fp32 (fp64 matmul is slow on CPUs)
        self.rows += flat.shape[0]

    @property
    def importance(self) -> torch.Tensor:
        """``E[x_j^2]`` per input channel (fp32, [in])."""
        return (torch.diagonal(self.hessian) / max(self.rows, 1)).to(torch.float32)

    def mean_hessian(self) -> torch.Tensor:
        """``E[x x^T]`` (fp32, [in, in])."""
        return (self.hessian / max(self.rows, 1)).to(torch.float32)


def collect_input_stats(
    module: torch.nn.Module, batches: Iterable[dict | tuple], names: Iterable[str] | None = None
) -> dict[str, InputStats]:
    """Run ``module`` (no grad) on each batch and return the input statistics of its linears, by weight name; with
    ``names``, only those weights (one line for a name that is no linear's weight)."""
    linears = {
        f"{n}.weight" if n else "weight": m
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    wanted = list(linears) if names is None else list(names)
    missing = [n for n in wanted if n not in linears]
    if missing:
        raise PrecastError(
            f"input statistics: {missing[0]!r} is no linear's weight in this module "
            f"(its linears: {', '.join(list(linears)[:3])}, ...)"
        )
    stats: dict[str, InputStats] = {}
    handles = []
    for name in wanted:
        lin = linears[name]
        stats[name] = InputStats(torch.zeros(lin.in_features, lin.in_features, dtype=torch.float64))
        handles.append(lin.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.add(args[0])))
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    module(**batch)
                else:
                    module(*batch)
    finally:
        for h in handles:
            h.remove()
    return stats
