"""The programs the conversion-cost benchmark converts (``cost.py``).

- ``chain_program(N)``: a synthetic chain of N ops in one bf16 autocast region (``OpChain``), exported with a
  dynamic batch: the graph grows with N while export and forwards stay cheap (the linearity check).
- ``real_models()``: name -> (library, builder) of ``precast.bench.convert.models`` (small-config transformers/timm
  models, random weights). ``model_programs(library, builder, policies)``
  exports one: policy None gets the model inside one bf16 region, "torch" the plain fp32 model.
- ``export_for_bench``: ``torch.export`` with a dynamic batch, falling back to static shapes (with a note).

Input: a model name and policies. Output: exported programs ready to convert (dynamic batch where possible).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from precast.errors import first_line


class OpChain(torch.nn.Module):
    """``n_ops`` ops inside one bf16 autocast region, cycling linear -> add -> relu -> layer_norm on a small
    width, so export and forwards stay cheap while the graph grows: every linear has its own weights (so the
    fold creates one low-precision constant per linear, as in a real model)."""

    def __init__(self, n_ops: int, width: int = 8):
        super().__init__()
        blocks = -(-n_ops // 4)
        self.n_ops = n_ops
        self.linears = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            done, h = 0, x
            for linear, norm in zip(self.linears, self.norms, strict=True):
                for op in range(4):
                    if done == self.n_ops:
                        return h
                    if op == 0:
                        h = linear(x)
                    elif op == 1:
                        h = h + x
                    elif op == 2:
                        h = torch.relu(h)
                    else:
                        x = h = norm(h)
                    done += 1
            return h


def _dynamic_batch(inputs: tuple, varargs: bool) -> tuple:
    b = torch.export.Dim("b", min=1, max=64)
    specs = tuple({0: b} if isinstance(x, torch.Tensor) and x.dim() else None for x in inputs)
    return (specs,) if varargs else specs  # ``forward(self, *xs)``: one spec, a tuple, for ``xs``


def export_for_bench(
    model: torch.nn.Module, inputs: tuple, dynamic: bool = True, varargs: bool = False
) -> tuple[Any, str]:
    """``torch.export`` with a dynamic batch ``Dim("b", min=1, max=64)``; falls back to static shapes (and
    says so in the returned note) when the model cannot be exported with one."""
    if dynamic:
        try:
            shapes = _dynamic_batch(inputs, varargs)
            return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False), ""
        except Exception as exc:  # noqa: BLE001 - reported in the table's note, then exported static
            note = f"static batch (dynamic export failed: {type(exc).__name__}: {first_line(exc)[:80]})"
    else:
        note = "static shapes"
    return torch.export.export(model, inputs, strict=False), note


def chain_program(n_ops: int, width: int = 8, dynamic: bool = True) -> Any:
    torch.manual_seed(0)
    model = OpChain(n_ops, width).eval()
    return export_for_bench(model, (torch.randn(2, width),), dynamic)[0]


def real_models() -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (library, builder) of ``precast.bench.convert.models`` (a library that is missing is skipped when
    its model is built)."""
    from precast.bench.convert.models import CONVERT_MODELS

    return CONVERT_MODELS


class _Calls(torch.nn.Module):
    """Tensors in, tensors out (what export needs from a library model), with the forward inside one bf16
    autocast region when ``region`` (the program policy None converts)."""

    def __init__(self, model: torch.nn.Module, call: Callable[..., torch.Tensor], region: bool):
        super().__init__()
        self.model, self.call, self.region = model, call, region

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if not self.region:
            return self.call(self.model, *xs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.call(self.model, *xs)


def model_programs(
    library: str,
    build: Callable[[], tuple[torch.nn.Module, Callable, tuple]],
    policies: tuple[str | None, ...],
) -> tuple[dict[str | None, Any], str]:
    """policy -> program for a real architecture (``build()`` -> (model, call, inputs)): policy None converts
    the export of the model inside one bf16 region, "torch" the plain fp32 export. Raises ImportError when its
    library is missing."""
    importlib.import_module(library)
    torch.manual_seed(0)
    model, call, inputs = build()
    model.eval()
    programs, notes = {}, set()
    for region in sorted({p is None for p in policies}):
        ep, note = export_for_bench(_Calls(model, call, region).eval(), inputs, varargs=True)
        notes.add(note)
        for policy in policies:
            if (policy is None) == region:
                programs[policy] = ep
    return programs, "; ".join(n for n in notes if n)
