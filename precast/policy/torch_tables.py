"""Eager autocast's per-device op tables, as data, for every torch precast supports (2.13 to 2.15).

Source: ATen ``aten/src/ATen/autocast_mode.cpp`` (the ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``
block of ``KERNEL_CPU`` lines, and the ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` block, which is the
CUDA one) and the ``AT_FORALL_*`` op lists in ``aten/src/ATen/autocast_mode.h``. The lists below are torch
2.13's registrations (``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")``: 127 names,
``"AutocastCUDA"``: 119); ``CHANGES`` holds what later releases register or no longer register, by release, and
``CUDNN_ONLY`` what only a build with cuDNN registers (``cudnn/AutocastRNN.cpp``). None of them is a fallthrough
kernel, so FALLTHROUGH has no entries; the ``_`` catch-all fallthrough is a backend fallback, not a per-op
registration, and is what "not in the table" means.

At run time the table is the installed torch's: every name this file knows, kept where the live dispatcher
registers it (``table(device)``); an op autocast has a kernel for and this file does not know (an ATen op of a
newer torch, or another library's: torchvision registers ``torchvision::nms`` and ``roi_align`` once imported;
``unknown_registrations``) has no category, and a conversion whose program uses one says so
(``autocast-category-unknown``) instead of guessing.

Differences from the C++ text worth knowing:

* The macro lists still name Dimname overloads (``prod.dim_Dimname``, ``softmax.Dimname``,
  ``log_softmax.Dimname``, ``cumprod.dimname``, ``cumsum.dimname``, ``sum.dim_DimnameList``,
  ``norm.names_ScalarOpt_dim``, CPU ``index_copy.dimname``). Those schemas do not exist, nothing is
  registered for them, so they are left out.
* The AutocastCUDA table is compiled into the CPU build too, so a CPU-only torch can check it.

Updating on a torch upgrade: run ``pytest tests/policy/test_torch_tables.py`` under the new torch (a CI lane).
The drift test lists every registration name the dispatcher has and the expected table for that release lacks
(and the reverse). Read the new ``autocast_mode.cpp``/``autocast_mode.h`` (or probe the op under autocast, as
``test_every_category_matches_eager`` does) to put each one in its category, add it to ``CHANGES`` under the
release, and fill in APPEND_DTYPE_OVERLOAD / BANNED_MESSAGES for new entries of those kinds.

Input: an op. Output: its autocast category (lower_precision_fp, fp32, promote, banned, ...).
"""

from __future__ import annotations

import enum
import functools

import torch

from precast.policy.autocast_lists import (
    BANNED_MESSAGES,
    CPU_FP32,
    CPU_LOWER_PRECISION_FP,
    CPU_PROMOTE,
    CUDA_FP32,
    CUDA_FP32_APPEND_DTYPE,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOWER_PRECISION_FP,
    CUDA_PROMOTE,
)


class Category(str, enum.Enum):
    LOWER_PRECISION_FP = "lower_precision_fp"  # cast eligible float args to the autocast low dtype
    FP32 = "fp32"  # cast eligible float args to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 when the optional dtype arg is None
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload that takes a dtype, with float32
    PROMOTE = "promote"  # cast eligible float args to the widest float type among them
    BANNED = "banned"  # raise, as eager does
    FALLTHROUGH = "fallthrough"  # registered but no cast (none exist in torch 2.13)


DISPATCH_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _build(groups: dict[Category, list[str]]) -> dict[str, Category]:
    table: dict[str, Category] = {}
    for cat, names in groups.items():
        for name in names:
            # A name in two lists would silently take the last category; eager has exactly one kernel.
            if name in table:
                raise ValueError(f"{name} listed as both {table[name].value} and {cat.value}")
            table[name] = cat
    return table


# torch 2.13's registrations, per device.
BASE: dict[str, dict[str, Category]] = {
    "cpu": _build(
        {
            Category.LOWER_PRECISION_FP: CPU_LOWER_PRECISION_FP,
            Category.FP32: CPU_FP32,
            Category.PROMOTE: CPU_PROMOTE,
        }
    ),
    "cuda": _build(
        {
            Category.LOWER_PRECISION_FP: CUDA_LOWER_PRECISION_FP,
            Category.FP32: CUDA_FP32,
            Category.FP32_SET_OPT_DTYPE: CUDA_FP32_SET_OPT_DTYPE,
            Category.FP32_APPEND_DTYPE: list(CUDA_FP32_APPEND_DTYPE),
            Category.PROMOTE: CUDA_PROMOTE,
            Category.BANNED: list(BANNED_MESSAGES),
        }
    ),
}

# What later releases changed, by the first release with the change: names they register (with the category,
# read from autocast_mode.cpp and checked by probing the op under autocast) and names they no longer register.
# Measured with the dispatcher of torch 2.13.0, 2.14.1 and 2.15.0.
CHANGES: dict[tuple[int, int], dict[str, tuple[dict[str, Category], tuple[str, ...]]]] = {
    (2, 14): {
        "cpu": ({"aten::linalg_matrix_sqrth": Category.FP32}, ("aten::cholesky", "aten::qr")),
        "cuda": ({"aten::linalg_matrix_sqrth": Category.FP32}, ()),
    },
}

# Registered only by builds with cuDNN (ATen/cudnn/AutocastRNN.cpp, under AT_CUDNN_ENABLED): the weights and
# inputs are cast to the low dtype and the weight buffer re-flattened, so lower_precision_fp in effect. The CPU
# build of torch has no cuDNN and does not register it.
CUDNN_ONLY: dict[str, dict[str, Category]] = {
    "cpu": {},
    "cuda": {"aten::_cudnn_rnn": Category.LOWER_PRECISION_FP},
}

APPEND_DTYPE_OVERLOAD: dict[str, dict[str, str]] = {"cpu": {}, "cuda": dict(CUDA_FP32_APPEND_DTYPE)}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.15.0+cu132" -> (2, 15)); the installed torch by default."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


@functools.cache
def known(device_type: str) -> dict[str, Category]:
    """Every registration name any supported release has on ``device_type``, with its category (computed once;
    do not mutate)."""
    table = dict(BASE[device_type])
    for release in sorted(CHANGES):
        table.update(CHANGES[release][device_type][0])
    table.update(CUDNN_ONLY[device_type])
    return table


def expected_table(device_type: str, release: tuple[int, int], cudnn: bool) -> dict[str, Category]:
    """The registrations a release (built with or without cuDNN) has, with their categories."""
    table = dict(BASE[device_type])
    for changed in sorted(CHANGES):
        if changed <= release:
            added, removed = CHANGES[changed][device_type]
            table.update(added)
            for name in removed:
                table.pop(name, None)
    if cudnn:
        table.update(CUDNN_ONLY[device_type])
    return table


def live_registrations(device_type: str) -> frozenset[str]:
    """Names the installed torch registers under the device's autocast dispatch key."""
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"no autocast table for device {device_type!r}; known: {sorted(DISPATCH_KEYS)}")
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(DISPATCH_KEYS[device_type]))


@functools.cache
def table(device_type: str) -> dict[str, Category]:
    """The installed torch's table: every known name the live dispatcher registers (a name this file knows but
    the dispatcher does not is not cast by eager autocast either). Computed once per process; do not mutate."""
    live = live_registrations(device_type)
    return {name: cat for name, cat in known(device_type).items() if name in live}


def unknown_registrations(device_type: str) -> frozenset[str]:
    """Names registered for autocast right now that no table here has a category for: ATen ops of a torch newer
    than these tables, and other libraries' ops (torchvision registers ``torchvision::nms``, ``roi_align`` once
    imported). Read live, not cached: importing a library adds registrations."""
    return live_registrations(device_type) - set(known(device_type))


def is_unknown_registration(device_type: str, name: str) -> bool:
    """Whether autocast has a kernel of its own for the op ``name`` on this device (now) that precast has no
    category for: ~2 µs a lookup, exact after any import."""
    if name in known(device_type):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, DISPATCH_KEYS[device_type])


def registration_name(op: torch._ops.OpOverload) -> str:
    """Name as the dispatcher prints it: "aten::linear" (default overload), "aten::conv1d.padding"."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"expected an OpOverload, got {type(op).__name__}: {op!r}")
    return op.name()


def category(device_type: str, op: torch._ops.OpOverload) -> Category | None:
    """Eager autocast's category for op on device_type under the installed torch; None: autocast falls through
    (or, for a name in ``unknown_registrations``, precast does not know what it does)."""
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"no autocast table for device {device_type!r}; known: {sorted(DISPATCH_KEYS)}")
    # Graph targets can be HOPs or Python callables; autocast has no kernel for those.
    if not isinstance(op, torch._ops.OpOverload):
        return None
    return table(device_type).get(registration_name(op))


def table_drift(device_type: str) -> tuple[set[str], set[str]]:
    """(registered by the installed torch but not in its expected table, expected but not registered), for ATen:
    other libraries' registrations (torchvision's) are theirs, reported as unknown when a program uses them."""
    live = {name for name in live_registrations(device_type) if name.startswith("aten::")}
    expected = set(expected_table(device_type, torch_release(), bool(torch._C._has_cudnn)))
    return live - expected, expected - live
