"""Memory freed by a long step given back to the system, in one place: the LLM export after freeing the fp32
model, the weight budget after measuring.

glibc keeps freed blocks below its mmap threshold in the process's heap, so memory a step freed stays resident and
every later step's allocations come on top of it (~0.9 GB after exporting SmolLM2-135M; ~1 GB after the weight
budget's measuring). ``give_back`` collects garbage and asks glibc's ``malloc_trim`` to return what is free;
elsewhere (another libc, another OS) it only collects.

Input: nothing. Output: nothing; the process's resident memory shrinks by what was free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def give_back() -> None:
    """``gc.collect()``, then glibc's ``malloc_trim(0)`` where there is one (Linux with glibc; not musl)."""
    gc.collect()
    if sys.platform != "linux" or not (name := ctypes.util.find_library("c")):
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)
