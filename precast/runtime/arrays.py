"""Torch tensors as numpy arrays and back, for the engines whose Python API speaks numpy (OpenVINO, ONNX
Runtime).

numpy has no bfloat16: a bfloat16 tensor crosses as its 16-bit patterns, an int16 array one way; the other
way, an array the engine marks bfloat16 (or ml_dtypes' ``bfloat16`` array) is read back through uint16.
numpy comes with those engines (their extras); precast's core imports it nowhere.

Input: a torch tensor (``to_numpy``) or a numpy array (``to_torch``). Output: the other one.
"""

from __future__ import annotations

from typing import Any

import torch


def to_numpy(t: torch.Tensor, *, copy: bool = False) -> Any:
    """``t`` (detached, contiguous) as a numpy array over its memory (``copy``: a copy of it); a bfloat16
    tensor as an int16 array of its bits (the caller tells the engine the type)."""
    t = t.detach().contiguous()
    array = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return array.copy() if copy else array


def to_torch(array: Any, *, bfloat16: bool = False, copy: bool = True) -> torch.Tensor:
    """``array`` as a torch tensor, a copy (``copy=False``: over the array's memory). ``bfloat16`` (or an
    ml_dtypes ``bfloat16`` array): its 2-byte values are bfloat16 bits, reinterpreted."""
    if bfloat16 or array.dtype.name == "bfloat16":
        bits = array.view("uint16")
        return torch.from_numpy(bits.copy() if copy else bits).view(torch.bfloat16)
    return torch.from_numpy(array.copy() if copy else array)
