"""PyTorch's own CPU autocast test cases (torch.testing._internal.autocast_test_lists), as one-op modules.

Entry formats in that module: ``(op, args[, kwargs])`` for the lower-precision and fp32 lists,
``(op, args_bf16, args_fp16)`` for ``torch_need_autocast_promote`` and ``(op, args_bf16, args_fp16, out_type)``
for the builtin-promote lists. The fp32 lists give bf16 inputs; for an fp16 run they are converted to fp16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

LISTS = {
    "torch_16": "torch",
    "nn_16": "nn",
    "torch_fp32": "torch",
    "nn_fp32": "nn",
    "torch_need_autocast_promote": "torch",
    "torch_expect_builtin_promote": "torch",
    "methods_expect_builtin_promote": "method",
}


@dataclass
class Case:
    list_name: str
    op: str
    args: tuple
    kwargs: dict
    fn: Callable
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{self.list_name}:{self.op}:{str(self.dtype).removeprefix('torch.')}"


class OneOp(torch.nn.Module):
    """Every tensor (also inside list arguments) becomes an input; other values are closed over."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        super().__init__()
        self.fn, self.kwargs = fn, kwargs
        self.flat, self.spec = pytree.tree_flatten(args)
        self.slots = [i for i, a in enumerate(self.flat) if isinstance(a, torch.Tensor)]

    def inputs(self) -> tuple:
        return tuple(self.flat[i] for i in self.slots)

    def forward(self, *tensors):
        flat = list(self.flat)
        for i, t in zip(self.slots, tensors, strict=True):
            flat[i] = t
        return self.fn(*pytree.tree_unflatten(flat, self.spec), **self.kwargs)


def _method(name: str) -> Callable:
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _to(args: tuple, dtype: torch.dtype) -> tuple:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t, args
    )


def cpu_cases(dtype: torch.dtype) -> list[Case]:
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

    lists = AutocastCPUTestLists(torch.device("cpu"))
    cases = []
    for list_name, kind in LISTS.items():
        for entry in getattr(lists, list_name):
            op = entry[0]
            if list_name in (
                "torch_need_autocast_promote",
                "torch_expect_builtin_promote",
                "methods_expect_builtin_promote",
            ):
                args, kwargs = (entry[1] if dtype == torch.bfloat16 else entry[2]), {}
            else:
                args = entry[1] if dtype == torch.bfloat16 else _to(entry[1], dtype)
                kwargs = entry[2] if len(entry) > 2 else {}
            fn = _method(op) if kind == "method" else getattr(torch._C._nn if kind == "nn" else torch, op)
            cases.append(Case(list_name, op, tuple(args), dict(kwargs), fn, dtype))
    return cases
