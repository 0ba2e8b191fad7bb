"""policy="torch": eager torch.autocast semantics, bitwise, with casts in the graph and weights cast once."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

import precast
from precast.errors import PrecastError
from precast.policy.autocast import autocast_decision
from precast.policy.base import apply_decision
from tests import models
from tests.autocast_cases import OneOp, cpu_cases
from tests.helpers import assert_bitwise, casts_per_producer, constant_casts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LSTM_ONEDNN = "could not create a primitive descriptor for the LSTM"


def eager_autocast(model, inputs, dtype):
    """Eager autocast, with nn.MultiheadAttention's fused fast path off: torch.export records the regular path
    (the fast path is a different kernel; the exported program differs from eager by the same amount without
    precast), so the slow path is the eager semantics a program can have."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        # cache_enabled=False: eager's weight-cast cache is keyed by tensor, not dtype, and hands a stale fp16
        # copy to a nested bf16 region (a PyTorch bug); the cache is an optimization, not part of the semantics
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            return model(*inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


# ---- PyTorch's own CPU autocast test cases, one-op modules ----------------------------------------------
CASES = cpu_cases(torch.bfloat16) + cpu_cases(torch.float16)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_pytorch_autocast_test_lists(case):
    module = OneOp(case.fn, case.args, case.kwargs)
    inputs = module.inputs()
    try:
        want = eager_autocast(module, inputs, case.dtype)
    except RuntimeError as exc:  # pragma: no cover - depends on the CPU
        pytest.skip(f"eager autocast itself fails for this case on this CPU: {str(exc).splitlines()[0]}")
    res = precast.convert(module, inputs, policy="torch", dtype=case.dtype, verify=False)
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), want)


# ---- the zoo ------------------------------------------------------------------------------------------
ZOO = {**models.ZOO, "einsum": models.einsum, "decorated": models.decorated}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_bitwise_equal_to_eager_autocast(name, dtype):
    model, inputs = ZOO[name]()
    try:
        want = eager_autocast(model, inputs, DTYPES[dtype])
    except RuntimeError as exc:
        if LSTM_ONEDNN in str(exc):
            pytest.skip(
                f"eager autocast fails here too: oneDNN has no {dtype} LSTM primitive on this CPU (none on AVX2; "
                "none for fp16 on AVX512-BF16)"
            )
        raise
    res = precast.convert(model, inputs, policy="torch", dtype=DTYPES[dtype])
    with torch.no_grad():
        assert_bitwise(res.program.module()(*inputs), want)
    # zero weight casts at run time; casts left only where an activation changes dtype
    assert constant_casts(res.program) == []
    assert constant_casts(res.program.run_decompositions()) == []
    assert all(c == 1 for c in casts_per_producer(res.program).values())


def test_default_dtype_is_the_devices_autocast_dtype():
    model, inputs = models.plain_mlp()
    res = precast.convert(model, inputs, policy="torch")
    assert res.report.dtype == "bf16" and res.report.device_type == "cpu"
    assert res.program.state_dict["layers.0.weight"].dtype == torch.get_autocast_dtype("cpu")


def test_regions_override_the_policy():
    model, inputs = models.nested()
    res = precast.convert(model, inputs, policy="torch", dtype=torch.float16)
    linears = [n for n in res.report.nodes if n.op == "aten.linear.default"]
    # a and the second c follow their bf16 regions, b stays fp32 in the disabled region, the nested c is fp16
    assert [n.dtype for n in linears] == ["bf16", "fp32", "fp16", "bf16"]
    assert [n.source for n in linears] == ["region"] * 4


def test_composites_are_decomposed_as_eager_does():
    model, inputs = models.einsum()
    res = precast.convert(model, inputs, policy="torch")
    assert res.report.decomposed and "einsum" in res.report.decomposed[0]
    assert res.program.module()(*inputs).dtype == torch.bfloat16
    # layer_norm's decomposition reaches no autocast op on CPU: kept as the user wrote it
    model, inputs = models.embed_norm_softmax()
    res = precast.convert(model, inputs, policy="torch")
    assert not res.report.decomposed
    assert any(n.target is torch.ops.aten.layer_norm.default for n in res.program.graph.nodes)


def test_float64_and_integers_are_never_cast():
    model, inputs = models.cat_mixed()
    res = precast.convert(model, inputs, policy="torch")
    assert res.program.state_dict["extra"].dtype == torch.float64
    model, inputs = models.tied()
    res = precast.convert(model, inputs, policy="torch")
    ids = [n for n in res.program.graph.nodes if n.op == "placeholder" and n.name == "ids"][0]
    assert all(u.target is not torch.ops.aten._to_copy.default for u in ids.users)


def test_ambient_autocast_at_conversion_is_refused():
    model, inputs = models.plain_mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(PrecastError, match="policy='torch'"):
        precast.convert(model, inputs)


# ---- the CUDA table, without a GPU: classifier decisions vs eager autocast on fake CUDA tensors ---------
@contextlib.contextmanager
def cuda_autocast(dtype):
    """torch.autocast('cuda') refuses to enable without a GPU; the dispatcher itself works on fake CUDA tensors."""
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


aten = torch.ops.aten


def _cuda_cases(mode):
    with mode:
        f32 = torch.randn(4, 8, device="cuda")
        f16 = f32.half()
        bf = f32.bfloat16()
        f64 = f32.double()
        w = torch.randn(6, 8, device="cuda")
        sq = torch.randn(8, 8, device="cuda")
        b3 = torch.randn(2, 4, 8, device="cuda")
        img = torch.randn(1, 3, 8, 8, device="cuda")
        k = torch.randn(4, 3, 3, 3, device="cuda")
        idx = torch.zeros(4, 8, dtype=torch.long, device="cuda")
        prob = torch.rand(4, 8, device="cuda")
    return [
        ("linear fp32", aten.linear.default, (f32, w), {}),
        ("linear fp64 untouched", aten.linear.default, (f64, w.double()), {}),
        ("mm mixed", aten.mm.default, (f16, sq), {}),
        ("matmul bf16 in", aten.matmul.default, (bf, sq), {}),
        ("bmm", aten.bmm.default, (b3, b3.transpose(1, 2)), {}),
        (
            "addmm",
            aten.addmm.default,
            (torch.zeros(4, 8, device="meta").to("cpu") if False else f32, f32, sq),
            {},
        ),
        ("conv2d", aten.conv2d.default, (img, k), {}),
        ("sdpa", aten.scaled_dot_product_attention.default, (b3, b3, b3), {}),
        ("exp fp16 -> fp32", aten.exp.default, (f16,), {}),
        ("log fp32", aten.log.default, (f32,), {}),
        ("pow", aten.pow.Tensor_Scalar, (f16, 2), {}),
        ("layer_norm", aten.layer_norm.default, (f16, [8]), {}),
        ("softmax set_opt", aten.softmax.int, (f16, 1), {}),
        ("softmax dtype given", aten.softmax.int, (f16, 1, torch.float16), {}),
        ("log_softmax", aten.log_softmax.int, (f16, 1), {}),
        ("cumsum", aten.cumsum.default, (f16, 1), {}),
        ("sum", aten.sum.default, (f16,), {}),
        ("sum fp64 first arg", aten.sum.default, (f64,), {}),
        ("norm append", aten.norm.Scalar, (f16,), {}),
        ("norm dim append", aten.norm.ScalarOpt_dim, (f16, 2, [1]), {}),
        ("cat promote mixed", aten.cat.default, ([f16, f32],), {}),
        ("cat promote low", aten.cat.default, ([f16, f16],), {}),
        ("stack promote", aten.stack.default, ([f16, f32],), {}),
        ("addcmul promote", aten.addcmul.default, (f32, f16, f16), {}),
        ("atan2 promote", aten.atan2.default, (f16, f32), {}),
        ("scatter_add int index", aten.scatter_add.default, (f16, 1, idx, f32), {}),
        ("relu not in table", aten.relu.default, (f16,), {}),
        ("mse_loss fp32", aten.mse_loss.default, (f16, f16), {}),
        ("bce banned", aten.binary_cross_entropy.default, (prob, prob), {}),
    ]


def _node_for(op, args, kwargs):
    graph = torch.fx.Graph()
    flat, spec = pytree.tree_flatten((args, kwargs))
    flat = [graph.placeholder(f"a{i}") if isinstance(v, torch.Tensor) else v for i, v in enumerate(flat)]
    a, k = pytree.tree_unflatten(flat, spec)
    return graph.call_function(op, tuple(a), k)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_classifier_matches_eager_dispatcher(low):
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    checked = 0
    for name, op, args, kwargs in _cuda_cases(mode):
        node = _node_for(op, args, kwargs)
        eager_error = precast_error = None
        try:
            with mode, cuda_autocast(low):
                want = op(*args, **kwargs)
        except RuntimeError as exc:
            eager_error = str(exc)
        try:
            decision = autocast_decision(node, args, kwargs, "cuda", low, source="torch", context="test")
            target, a, k = apply_decision(op, args, kwargs, decision, lambda v, d: v.to(d))
            with mode:
                got = target(*a, **k)
        except PrecastError as exc:
            precast_error = str(exc)
        if eager_error is not None:
            assert precast_error is not None, f"{name}: eager raised ({eager_error[:80]}) but precast did not"
            assert eager_error.splitlines()[0][:60] in precast_error, name
            continue
        assert precast_error is None, f"{name}: {precast_error}"
        assert got.dtype == want.dtype, f"{name}: precast {got.dtype} vs eager {want.dtype}"
        checked += 1
    assert checked >= 25


class _WritesAndEinsums(torch.nn.Module):
    """The shape of a random program from issue 19: nested einsum, a buffer written with ``copy_`` from a bf16
    value (before or after it is read), and an ``nn.Parameter`` passed as batch_norm's running_var, which autograd
    refuses (the module only runs without it)."""

    def __init__(self, write_first: bool, training_bn: bool):
        super().__init__()
        self.write_first, self.training_bn = write_first, training_bn
        self.register_buffer("buf", torch.randn(4, 8))
        self.register_buffer("rm", torch.zeros(8))
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.rv = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        h = torch.einsum("bi,ij->bj", torch.einsum("bi,ij->bj", x, self.w), self.w)
        if self.write_first:
            self.buf.copy_(h.to(torch.bfloat16))
        y = torch.nn.functional.batch_norm(h + self.buf @ self.w, self.rm, self.rv, training=self.training_bn)
        if not self.write_first:
            self.buf.copy_(h.to(torch.bfloat16))
        return torch.einsum("bj,jk->bk", y, self.w)


@pytest.mark.parametrize("route", ["module", "program"])
@pytest.mark.parametrize("write_first", [True, False])
@pytest.mark.parametrize("training_bn", [False, True])
def test_written_buffers_and_grad_free_parameters_stay_eager_exact_over_calls(
    route, write_first, training_bn
):
    """Converted with grad mode on (as a user calls convert), the program is bitwise eager autocast on every one
    of three successive calls, each side starting from its own copy of the state."""
    torch.manual_seed(0)
    model, x = _WritesAndEinsums(write_first, training_bn).eval(), torch.randn(4, 8)
    before = copy.deepcopy(model.state_dict())
    if route == "program":
        with torch.no_grad():  # autograd refuses the Parameter running_var: inference export
            source = torch.export.export(copy.deepcopy(model), (x,))
    else:
        source = copy.deepcopy(model)
    res = precast.convert(source, (x,), policy="torch", dtype=torch.float16)
    assert all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )  # the caller's state untouched
    got_module, eager = res.program.module(), copy.deepcopy(model)
    with torch.no_grad():
        for _ in range(3):
            got = got_module(x)
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                want = eager(x)
            assert_bitwise(got, want)


class _ExportsOtherOps(torch.nn.Module):
    """Eager runs one computation, torch.export records another that rounds differently in low precision (as it
    records timm LeViT's Linear on a 3-D transposed input as ``bmm`` where eager runs ``mm``)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        if torch.compiler.is_exporting():
            return torch.mm(x * 3.0, self.w.t())
        return torch.mm(x, self.w.t()) * 3.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_difference_of_the_export_itself_is_reported_as_the_exports(dtype):
    torch.manual_seed(0)
    m, x = _ExportsOtherOps().eval(), torch.randn(8, 64)
    res = precast.convert(m, (x,), policy="torch", dtype=dtype)
    v = res.report.verification
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        eager = m(x)
    got = res.program.module()(x)
    gap = (got.double() - eager.double()).abs().max().item()
    assert gap > 0 and not v["bitwise"]  # the premise: the export's record rounds otherwise than eager
    assert v["export_baseline"]["bitwise"] and v["export_baseline"]["export_vs_eager"] == pytest.approx(gap)
    codes = {d.code: d.severity for d in res.report.diagnostics}
    assert codes.get("export-differs-from-eager") == "info" and "not-bitwise" not in codes
