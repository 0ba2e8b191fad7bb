"""The autocast tables must match the live dispatcher and eager autocast's behaviour."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import precast
from precast.policy import autocast as autocast_policy
from precast.policy.torch_tables import (
    APPEND_DTYPE_OVERLOAD,
    BANNED_MESSAGES,
    BASE,
    CHANGES,
    DISPATCH_KEYS,
    Category,
    category,
    expected_table,
    is_unknown_registration,
    known,
    registration_name,
    table,
    table_drift,
    torch_release,
    unknown_registrations,
)

TABLES = BASE  # torch 2.13's registrations: the counts and lists below are those of autocast_mode.cpp in 2.13

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


@pytest.mark.parametrize("device", sorted(DISPATCH_KEYS))
def test_every_registration_has_a_category(device: str) -> None:
    """On every lane's torch: no autocast registration precast lacks a category for, and the table in use is
    exactly what the dispatcher registers."""
    aten = {n for n in unknown_registrations(device) if n.startswith("aten::")}
    assert aten == set(), sorted(aten)
    live = set(torch._C._dispatch_get_registrations_for_dispatch_key(DISPATCH_KEYS[device]))
    assert set(table(device)) == {n for n in live if n.startswith("aten::")}


def test_another_librarys_autocast_kernels_are_unknown_not_guessed() -> None:
    """torchvision registers autocast kernels for its own ops once imported (latest lane): they are read live
    (not from a list cached before the import) and reported as unknown; ATen ops are not."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision runs in the latest lane")
    assert torchvision.ops.nms is not None  # imported: its registrations are in place
    assert "torchvision::nms" in unknown_registrations("cpu")
    assert is_unknown_registration("cpu", "torchvision::nms")
    assert not is_unknown_registration("cpu", "aten::relu")  # no autocast kernel: falls through
    assert not is_unknown_registration("cpu", "aten::linear")  # known


def test_release_changes() -> None:
    """The data of later releases, as measured on their dispatchers: 2.14 made the changes 2.15 keeps."""
    for device in DISPATCH_KEYS:
        assert expected_table(device, (2, 13), cudnn=False) == BASE[device]
        assert expected_table(device, (2, 14), cudnn=True) == expected_table(device, (2, 15), cudnn=True)
    t215 = expected_table("cpu", (2, 15), cudnn=True)
    assert "aten::cholesky" not in t215 and "aten::qr" not in t215
    assert t215["aten::linalg_matrix_sqrth"] is C.FP32
    cuda215 = expected_table("cuda", (2, 15), cudnn=True)
    assert cuda215["aten::_cudnn_rnn"] is C.LOWER_PRECISION_FP
    assert "aten::_cudnn_rnn" not in expected_table("cuda", (2, 15), cudnn=False)
    assert set(known("cpu")) >= set(BASE["cpu"]) | {"aten::linalg_matrix_sqrth"}
    assert torch_release("2.15.0+cu132") == (2, 15) and torch_release("2.13.0+cpu") == (2, 13)
    assert all(release > (2, 13) for release in CHANGES)


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
    if torch_release() >= (2, 14):  # autocast no longer registers it: eager leaves it alone
        assert category("cpu", aten.cholesky_solve.default) is C.FP32
        assert "aten::cholesky" not in table("cpu") and "aten::cholesky" in known("cpu")
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
    """Every name of the installed torch's table resolves to an overload of that name (a name a later release
    dropped, such as aten::qr on 2.15, is out of that release's table)."""
    unresolved = []
    for name in table(device):
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


# ---- every category against eager ------------------------------------------------------------------------
_FILL = {
    "int": 1,
    "SymInt": 1,
    "int[]": [1],
    "SymInt[]": [1],
    "int[1]": [1],
    "float": 1.0,
    "Scalar": 1,
    "bool": False,
}


def _drop(record: logging.LogRecord) -> bool:
    return False  # fake tensor logs every meta that fails on a shape the probe then moves past


def _call_args(op: torch._ops.OpOverload, x: torch.Tensor) -> list | None:
    """Positional arguments for ``op``: ``x`` for every Tensor, a plain value for every other required one."""
    args = []
    for a in op._schema.arguments:
        if a.kwarg_only and a.has_default_value():
            continue
        kind = str(a.type)
        if kind == "Tensor":
            args.append(x)
        elif a.has_default_value():
            break  # keep the defaults from here on
        elif kind in _FILL:
            args.append(_FILL[kind])
        else:
            return None
    return args if any(v is x for v in args) else None


def _probe(device: str, op: torch._ops.OpOverload, low: torch.dtype) -> Category | None:
    """What eager autocast does to ``op`` called on float32 tensors and on ``low`` tensors (a matrix, or a 3-D or
    4-D tensor for ops that need one), seen below the Autocast key: cast fp32 inputs to ``low``
    (lower_precision_fp), cast ``low`` inputs to fp32 (fp32), pass dtype=float32 (set_opt), redispatch with a
    dtype (append). None when the op runs on none of those shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    for shape in ((4, 4), (2, 4, 4), (1, 2, 4, 4)):
        with fake:
            f32 = torch.empty(*shape, device=device)
            lowt = torch.empty(*shape, device=device, dtype=low)
        seen = []
        for x in (f32, lowt):
            args = _call_args(op, x)
            if args is None:
                return None
            rec = _Record()
            prev = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, low)
            quiet.addFilter(_drop)
            try:
                with fake, rec:
                    op(*args)
            except Exception:  # not this shape (or not a plain call at all): the next shape, else not probed
                break
            finally:
                quiet.removeFilter(_drop)
                torch.set_autocast_enabled(device, prev[0])
                torch.set_autocast_dtype(device, prev[1])
            seen.append(rec.calls)
        if len(seen) == 2:
            break
    else:
        return None
    name = op.name()
    for calls in seen:
        for called, _, dtype_kw in calls:
            if called != name and called in APPEND_DTYPE_OVERLOAD[device].values():
                return C.FP32_APPEND_DTYPE
            if called == name and dtype_kw is torch.float32:
                return C.FP32_SET_OPT_DTYPE
    first = [d for n, d, _ in seen[0] if n == name]
    second = [d for n, d, _ in seen[1] if n == name]
    if first and first[-1] and set(first[-1]) == {low}:
        return C.LOWER_PRECISION_FP
    if second and second[-1] and set(second[-1]) == {torch.float32}:
        return C.FP32
    return None


@pytest.mark.parametrize("device", sorted(DISPATCH_KEYS))
def test_every_category_matches_eager(device: str) -> None:
    """Each op of the installed torch's table that runs on one plain matrix is called under eager autocast on
    fake tensors, and what eager does must be what the table says (the other ops are checked by PyTorch's own
    autocast test lists in tests/policy/test_torch_policy.py)."""
    low = torch.bfloat16 if device == "cpu" else torch.float16
    probed, wrong = 0, []
    for name, cat in table(device).items():
        if cat not in (C.LOWER_PRECISION_FP, C.FP32, C.FP32_SET_OPT_DTYPE, C.FP32_APPEND_DTYPE):
            continue
        try:
            op = resolve(name)
        except (AttributeError, RuntimeError):
            continue
        got = _probe(device, op, low)
        if got is None:
            continue
        probed += 1
        if got is not cat:
            wrong.append(f"{name}: table {cat.value}, eager {got.value}")
    print(f"{device}: {probed} of {len(table(device))} ops probed against eager")
    assert not wrong, wrong
    assert probed >= (25 if device == "cpu" else 34), probed  # what the probe reached on 2.13 and 2.15


def test_unknown_registration_is_reported_and_left_as_written(monkeypatch) -> None:
    """A torch newer than the tables: an op its autocast registers and precast cannot place is named once in a
    warning, left as written (not guessed), and the rest is still eager-exact."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x)) + torch.relu(x)

    real = autocast_policy.is_unknown_registration
    monkeypatch.setattr(
        autocast_policy,
        "is_unknown_registration",
        lambda d, name: (d == "cpu" and name == "aten::relu") or real(d, name),
    )
    m, x = M().eval(), torch.randn(4, 8)
    res = precast.convert(m, (x,), policy="torch", dtype=torch.bfloat16)
    warned = [d for d in res.report.diagnostics if d.code == "autocast-category-unknown"]
    assert len(warned) == 1 and warned[0].severity == "warning" and "aten.relu.default" in warned[0].message
    relus = [r for r in res.report.nodes if r.op == "aten.relu.default"]
    assert len(relus) == 2 and all(r.rule == "unknown-category" for r in relus)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x)
    got = res.program.module()(x)
    assert torch.equal(got, want)
