"""Weights the compiled code reads through packed copies (Inductor's C++ GEMM template on CPU, ``max-autotune``):
record the copies a compile adds, find the stored weight and the packing that reproduces each bit for bit, and
pack new weights the same way, so ``CompiledModel.load_weights`` keeps them swappable (``precast/backends/aoti.py``).

Input: the constants a compile added, the program's weights. Output: per packed constant, its plan
(``{"source", "transposed", "block_n", "vnni"}``); ``gemm_pack`` applies one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


@contextlib.contextmanager
def record_new_constants() -> Iterator[dict[str, torch.Tensor]]:
    """Record the 3-d floating constants Inductor adds while lowering, by the name the package gives them.

    The C++ GEMM template (CPU, ``max_autotune``) adds one per weight it uses: the weight blocked into
    ``[n / block_n, k, block_n]`` (VNNI-interleaved for 16-bit types), computed from the weight's value at
    compile time; its code reads only that copy. Call under ``TORCH_LOCK`` (the hook is process-wide)."""
    from torch._inductor.graph import GraphLowering

    added: dict[str, torch.Tensor] = {}
    original = GraphLowering.add_tensor_constant

    def add_tensor_constant(self: Any, data: torch.Tensor, name: str | None = None) -> Any:
        box = original(self, data, name)
        # no failure is swallowed here (no silent except in the core): these reads cannot fail on a tensor, and a
        # copy not recorded is named by load_weights' refusal
        real = type(data) is torch.Tensor or type(data) is torch.nn.Parameter
        if real and data.dim() == 3 and data.is_floating_point() and not data.is_mkldnn:
            added[box.get_name()] = data
        return box

    GraphLowering.add_tensor_constant = add_tensor_constant  # type: ignore[method-assign]
    try:
        yield added
    finally:
        GraphLowering.add_tensor_constant = original  # type: ignore[method-assign]


def gemm_pack(weight: torch.Tensor, *, transposed: bool, block_n: int, vnni: int) -> torch.Tensor:
    """``weight`` laid out as Inductor's C++ GEMM template stores a constant B (``k x n``): padded to a multiple of
    ``block_n`` columns, blocked into ``[n / block_n, k, block_n]``, then with ``vnni`` > 1 consecutive rows of k
    interleaved (``CppGemmTemplate.block_weight`` / ``pack_vnni_weight``). ``transposed``: ``weight`` is a Linear's
    ``[n, k]`` (B is its transpose)."""
    b = weight.t() if transposed else weight
    k, n = b.shape
    blocks = -(-n // block_n)
    out = torch.nn.functional.pad(b, (0, blocks * block_n - n)).reshape(k, blocks, block_n).transpose(0, 1)
    if vnni > 1:
        out = out.reshape(blocks, k // vnni, vnni, block_n).transpose(-1, -2).reshape(blocks, k, block_n)
    return out.contiguous()


def match_packed(
    added: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """For each packed constant, the stored weight and the ``gemm_pack`` arguments that reproduce it bit for bit
    (``{name: {"source", "transposed", "block_n", "vnni"}}``), and the names of those no weight reproduces."""
    candidates = [(name, w) for name, w in sources.items() if w.dim() == 2 and w.is_floating_point()]
    plans: dict[str, dict[str, Any]] = {}
    unmatched: list[str] = []
    for pname, packed in added.items():
        blocks, k, block_n = packed.shape
        found = None
        for sname, w in candidates:
            if w.dtype != packed.dtype:
                continue
            for transposed in (True, False):
                kk, n = (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])
                if kk != k or not (blocks - 1) * block_n < n <= blocks * block_n:
                    continue
                head = w[:block_n] if transposed else w[:, :block_n]  # the first block: a cheap test first
                for vnni in (1, 2, 4):
                    if k % vnni:
                        continue
                    kw = {"transposed": transposed, "block_n": block_n, "vnni": vnni}
                    if torch.equal(gemm_pack(head, **kw), packed[:1]) and torch.equal(
                        gemm_pack(w, **kw), packed
                    ):
                        found = {"source": sname, **kw}
                        break
                if found:
                    break
            if found:
                break
        if found:
            plans[pname] = found
        else:
            unmatched.append(pname)
    return plans, unmatched
