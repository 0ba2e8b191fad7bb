"""The autocast tables must match the live dispatcher and eager autocast's behaviour."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from precast.policy.torch_tables import (
    APPEND_DTYPE_OVERLOAD,
    BANNED_MESSAGES,
    DISPATCH_KEYS,
    TABLES,
    Category,
    category,
    registration_name,
    table_drift,
)

aten = torch.ops.aten
C = Category


def resolve(name: str) -> torch._ops.OpOverload:
    """'aten::conv1d.padding' -> torch.ops.aten.conv1d.padding; 'aten::linear' -> .default."""
    ns, rest = name.split("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


@pytest.mark.parametrize("device", sorted(DISPATCH_KEYS))
def test_no_drift_from_dispatcher(device: str) -> None:
    missing, stale = table_drift(device)
    assert (missing, stale) == (set(), set()), (
        f"torch {torch.__version__} {DISPATCH_KEYS[device]} drifted from TABLES[{device!r}].\n"
        f"  registered but not in table (add, with the category from autocast_mode.cpp/h): {sorted(missing)}\n"
        f"  in table but not registered (remove): {sorted(stale)}"
    )


def test_category_counts() -> None:
    counts = {dev: Counter(t.values()) for dev, t in TABLES.items()}
    assert counts["cpu"] == {C.LOWER_PRECISION_FP: 24, C.FP32: 100, C.PROMOTE: 3}
    assert counts["cuda"] == {
        C.LOWER_PRECISION_FP: 35,
        C.FP32: 59,
        C.FP32_SET_OPT_DTYPE: 11,
        C.FP32_APPEND_DTYPE: 2,
        C.PROMOTE: 11,
        C.BANNED: 1,
    }


def _names(device: str, cat: Category) -> set[str]:
    return {n for n, c in TABLES[device].items() if c is cat}


def test_cpu_lower_precision_and_promote_lists() -> None:
    reference = [
        "conv1d",
        "conv1d.padding",
        "conv2d",
        "conv2d.padding",
        "conv3d",
        "conv3d.padding",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "_addmm_activation",
        "addbmm",
        "linear",
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
    ]
    # KERNEL_CPU(_convolution, deprecated, lower_precision_fp) is in autocast_mode.cpp as well.
    expected = {f"aten::{n}" for n in reference} | {"aten::_convolution.deprecated"}
    assert _names("cpu", C.LOWER_PRECISION_FP) == expected
    assert _names("cpu", C.PROMOTE) == {"aten::stack", "aten::cat", "aten::index_copy"}


def test_lookups() -> None:
    assert registration_name(aten.linear.default) == "aten::linear"
    assert registration_name(aten.conv1d.padding) == "aten::conv1d.padding"
    assert category("cpu", aten.linear.default) is C.LOWER_PRECISION_FP
    assert category("cpu", aten.relu.default) is None
    assert category("cpu", aten.binary_cross_entropy.default) is C.FP32  # banned only on CUDA
    assert category("cuda", aten.softmax.int) is C.FP32_SET_OPT_DTYPE
    assert category("cuda", aten.norm.Scalar) is C.FP32_APPEND_DTYPE
    assert category("cuda", aten.binary_cross_entropy.default) is C.BANNED
    target = APPEND_DTYPE_OVERLOAD["cuda"]["aten::norm.Scalar"]
    assert target == "aten::norm.ScalarOpt_dtype"
    assert isinstance(resolve(target), torch._ops.OpOverload)
    with pytest.raises(ValueError):
        category("tpu", aten.linear.default)


@pytest.mark.parametrize("device", sorted(TABLES))
def test_every_key_is_a_real_op(device: str) -> None:
    unresolved = []
    for name in TABLES[device]:
        try:
            op = resolve(name)
        except (AttributeError, RuntimeError):
            unresolved.append(name)
            continue
        assert registration_name(op) == name
    assert not unresolved, f"no torch.ops overload for {unresolved}"


@pytest.mark.parametrize("device", sorted(TABLES))
def test_append_dtype_and_banned_are_consistent(device: str) -> None:
    assert set(APPEND_DTYPE_OVERLOAD[device]) == _names(device, C.FP32_APPEND_DTYPE)
    for src, dst in APPEND_DTYPE_OVERLOAD[device].items():
        src_args = [a.name for a in resolve(src)._schema.arguments]
        dst_args = [a.name for a in resolve(dst)._schema.arguments]
        # Eager calls dst with src's args plus one ScalarType appended.
        assert dst_args == [*src_args, "dtype"], (src, dst)
    assert _names(device, C.BANNED) <= set(BANNED_MESSAGES)
    assert not _names(device, C.FALLTHROUGH)  # no fallthrough registrations exist in torch 2.13


class _Record(TorchDispatchMode):
    """Sees ops below the Autocast keys, i.e. after eager autocast has cast the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype], torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.calls.append((func.name(), dtypes, kwargs.get("dtype")))
        return func(*args, **kwargs)

    def last(self, name: str) -> tuple[list[torch.dtype], torch.dtype | None]:
        return next((d, k) for n, d, k in reversed(self.calls) if n == name)


def test_cpu_eager_matches_table() -> None:
    f32 = torch.randn(2, 3, 5)
    w = torch.randn(4, 3, 3)
    bf16 = f32.bfloat16()
    rec = _Record()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        aten._convolution.deprecated(f32, w, None, [1], [0], [1], False, [0], 1, False, False, True)
        aten.prod.default(bf16)
        aten.cat.default([f32, bf16])
        aten.relu.default(bf16)
    # Each observed eager cast must agree with the table's category for that op.
    assert [category("cpu", op) for op in (aten._convolution.deprecated, aten.prod.default)] == [
        C.LOWER_PRECISION_FP,
        C.FP32,
    ]
    assert [category("cpu", op) for op in (aten.cat.default, aten.relu.default)] == [C.PROMOTE, None]
    assert rec.last("aten::_convolution")[0] == [torch.bfloat16] * 2
    assert rec.last("aten::prod")[0] == [torch.float32]
    assert rec.last("aten::cat")[0] == [torch.float32] * 2
    assert rec.last("aten::relu")[0] == [torch.bfloat16]


def test_cuda_eager_matches_table() -> None:
    # The AutocastCUDA kernels live in libtorch_cpu; fake CUDA tensors reach them without a GPU.
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    with fake:
        f32 = torch.empty(4, 8, device="cuda")
        f16 = torch.empty(4, 8, device="cuda", dtype=torch.half)
        prob = torch.empty(4, device="cuda", dtype=torch.half)
    rec = _Record()
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.half)
    try:
        with fake, rec:
            aten.linear.default(f32, f32)
            aten.exp.default(f16)
            aten.norm.Scalar(f16, 2)
            aten.addcmul.default(f32, f16, f16)
            with pytest.raises(RuntimeError) as banned:
                aten.binary_cross_entropy.default(prob, prob)
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
    ops = (aten.linear.default, aten.exp.default, aten.norm.Scalar, aten.addcmul.default)
    assert [category("cuda", op) for op in ops] == [
        C.LOWER_PRECISION_FP,
        C.FP32,
        C.FP32_APPEND_DTYPE,
        C.PROMOTE,
    ]
    assert rec.last("aten::mm")[0] == [torch.half] * 2
    assert rec.last("aten::exp")[0] == [torch.float32]
    assert rec.last(APPEND_DTYPE_OVERLOAD["cuda"]["aten::norm.Scalar"]) == ([torch.half], torch.float32)
    assert rec.last("aten::addcmul")[0] == [torch.float32] * 3
    assert BANNED_MESSAGES["aten::binary_cross_entropy"] in str(banned.value)
