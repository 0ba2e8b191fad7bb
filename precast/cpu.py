"""What this CPU is and what it can do, read in one place: its model name, its flags (/proc/cpuinfo on Linux),
torch's capability level, and what they imply for low precision.

Every reader goes through here: the latency cache's device key and auto's "native bf16" note
(``numerics/latency.py``), the compile cache's ISA key (``backends/aoti/package_cache.py``: inductor builds with
``-march=native``), ``precast bench``'s machine record (``bench/measure.py``), and any choice that depends on the
CPU (the compile form, ``backends/aoti/forms.py``; a test's expectation): ask ``has_native(dtype)``, ``flags()``,
``capability()``, ``capabilities()`` (torch's own report, AMX usable or not).

Input: nothing (the machine). Output: strings and sets; None where the platform does not say.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path
from typing import Any

import torch

# the flags that decide bf16/fp16 speed on x86 (a VM's model name may not say); native per low dtype
LOW_PRECISION_FLAGS = frozenset(
    {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "avx_vnni", "avx512_vnni"}
)
NATIVE = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_info(field: str) -> str | None:
    """The first ``field`` line of /proc/cpuinfo (Linux), None where there is none."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return None


def model_name() -> str:
    """The CPU's model name (the platform's processor or machine where /proc/cpuinfo is missing)."""
    return cpu_info("model name") or platform.processor() or platform.machine()


def flags() -> frozenset[str] | None:
    """The CPU's feature flags, None where the platform does not list them."""
    text = cpu_info("flags")
    return frozenset(text.split()) if text is not None else None


def capability() -> str:
    """torch's CPU capability level (``AVX512``, ``AVX2``, ...): the kernels torch dispatches to."""
    return torch.backends.cpu.get_cpu_capability()


def has_native(low: torch.dtype) -> bool | None:
    """Whether the CPU has native instructions for ``low`` (bf16: avx512_bf16 or AMX; fp16: avx512_fp16 or AMX);
    None where the flags are unknown."""
    known = flags()
    if known is None:
        return None
    return any(f in known for f in NATIVE.get(low, ()))


def low_precision_flags() -> str:
    """The low-precision flags this CPU has, sorted and space-separated ("none"; "unknown" without flags)."""
    known = flags()
    if known is None:
        return "unknown"
    return " ".join(sorted(LOW_PRECISION_FLAGS & known)) or "none"


@functools.lru_cache(maxsize=1)
def identity() -> str:
    """The CPU model and its flags (what -march=native reads), hashed."""
    text = f"{model_name()}|{cpu_info('flags') or ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def capabilities() -> dict[str, Any]:
    """The CPU's reported capabilities (``torch.cpu.get_capabilities()``), with ``amx_tile`` false when the OS
    does not let this process use AMX tiles (``torch.cpu._init_amx()``)."""
    caps = dict(torch.cpu.get_capabilities())
    if caps.get("amx_tile") and not torch.cpu._init_amx():
        caps["amx_tile"] = False
    return caps
