"""Property-based tests: random small programs (``tests/strategies.py``) against precast's promises.

Checked on every generated example:
  (a) ``policy=None``: the converted program's outputs are bitwise the unconverted program's, over three
      successive calls (programs that write buffers!) and at a second batch size when the batch is dynamic;
      each program runs on its own state.
  (b) ``policy="torch"``: bitwise eager ``torch.autocast(cache_enabled=False)`` on a copy of the model, same
      calls, where eager autocast itself runs.
  (c) convert leaves the caller's module and the input ExportedProgram bit-identical (state, constants, graph
      code, custom node meta), and running the converted program leaves them alone too.
  (d) a ``copy.deepcopy`` of the converted program with its parameters zeroed computes what a conversion of
      the zero-weight model computes, and the original is unaffected: a copy owns its weights.
  (e) a valid program (one eager PyTorch runs) converts without error: any exception from ``convert`` fails.

Runs are deterministic (``derandomize``, no example database). ``PRECAST_PROPERTY_EXAMPLES=N`` sets the examples
per property test (default: the CI budget below), ``PRECAST_PROPERTY_SEED=S`` draws random examples from seed
``S`` instead of the derandomized ones. The deterministic regression tests at the end pin each defect class the
generator found, as plain pytest tests.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, Phase, given, note, reject, seed, settings
from hypothesis import strategies as st
from torch import nn
from torch.export import ExportedProgram

import precast
from precast.errors import PrecastError
from tests.strategies import GeneratedProgram, programs

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
CALLS = 3  # successive calls at the example's batch size: a written buffer shows on the second and third


def _property(examples: int):
    """Hypothesis settings for one property test: ``examples`` in CI, ``PRECAST_PROPERTY_EXAMPLES`` when set.

    Shrinking is off unless ``PRECAST_PROPERTY_SHRINK=1``: an example costs about a second (export + convert),
    so shrinking one failure takes minutes, far beyond the CI budget; an unshrunk example is still at most
    eight ops and prints as a module to paste, and each defect class found has a minimal regression test below.
    """
    n = int(os.environ.get("PRECAST_PROPERTY_EXAMPLES") or examples)
    fixed_seed = os.environ.get("PRECAST_PROPERTY_SEED")
    phases = [Phase.explicit, Phase.generate]
    if os.environ.get("PRECAST_PROPERTY_SHRINK") == "1":
        phases.append(Phase.shrink)
    conf = settings(
        max_examples=n,
        phases=phases,
        derandomize=fixed_seed is None,
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )

    def apply(test):
        test = conf(test)
        return seed(int(fixed_seed))(test) if fixed_seed is not None else test

    return apply


# ---- comparisons and snapshots ----------------------------------------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, NaN equal to NaN (fp16 overflow makes inf - inf in both programs alike)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def assert_bitwise(got, want, what: str) -> None:
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(g) == len(w), f"{what}: {len(g)} outputs, expected {len(w)}"
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        assert a.dtype == b.dtype, f"{what}, output {i}: dtype {a.dtype}, expected {b.dtype}"
        assert a.shape == b.shape, f"{what}, output {i}: shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        if not _same(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
            raise AssertionError(f"{what}, output {i}: values differ, max abs difference {diff:.4g}")


def run_calls(module, prog: GeneratedProgram, autocast: torch.dtype | None = None) -> list:
    """Outputs of CALLS successive calls, then one at the second batch size when the batch is dynamic."""
    out = []
    batches = [prog.batch] * CALLS + ([prog.batch2] if prog.dynamic else [])
    for b in batches:
        with torch.no_grad():
            if autocast is None:
                y = module(*prog.inputs(b))
            else:
                with torch.autocast("cpu", dtype=autocast, cache_enabled=False):
                    y = module(*prog.inputs(b))
        out.append(pytree.tree_map(lambda t: t.detach().clone(), y))
    return out


def assert_calls_bitwise(got: list, want: list, against: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        call = f"call {i + 1}" if i < CALLS else "call at the second batch size"
        assert_bitwise(g, w, f"{call} vs {against}")


def tensors(d: dict) -> dict:
    return {k: v.detach().clone() for k, v in d.items() if isinstance(v, torch.Tensor)}


def assert_tensors_equal(now: dict, before: dict, what: str) -> None:
    assert sorted(now) == sorted(before), f"{what}: names changed {sorted(set(now) ^ set(before))}"
    for k, v in before.items():
        assert now[k].dtype == v.dtype and now[k].shape == v.shape, f"{what}: {k} changed dtype/shape"
        assert _same(now[k], v), f"{what}: {k} changed value (max abs {(now[k] - v).abs().max().item():.4g})"


def program_snapshot(ep: ExportedProgram) -> dict:
    """Everything of an input program that conversion must leave alone."""
    graphs = [
        (name, m.code) for name, m in ep.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)
    ]
    meta = [
        (name, n.name, copy.deepcopy(n.meta.get("custom")))
        for name, m in ep.graph_module.named_modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    ]
    return {
        "state": tensors(ep.state_dict),
        "constants": tensors(ep.constants),
        "graphs": graphs,
        "meta": meta,
        "signature": str(ep.graph_signature),
    }


def assert_program_unchanged(ep: ExportedProgram, before: dict, when: str) -> None:
    now = program_snapshot(ep)
    assert_tensors_equal(now["state"], before["state"], f"input program's state_dict {when}")
    assert_tensors_equal(now["constants"], before["constants"], f"input program's constants {when}")
    assert now["graphs"] == before["graphs"], f"input program's graph code changed {when}"
    assert now["meta"] == before["meta"], f"input program's node meta['custom'] changed {when}"
    assert now["signature"] == before["signature"], f"input program's graph signature changed {when}"


def export(prog: GeneratedProgram, model: nn.Module | None = None) -> ExportedProgram:
    model = prog.module() if model is None else model
    return torch.export.export(model, prog.inputs(), dynamic_shapes=prog.dynamic_shapes(), strict=False)


def exported_or_reject(prog: GeneratedProgram) -> ExportedProgram:
    """The example's program, or reject the example when eager PyTorch cannot export and run it (then it is
    not a valid program, and precast owes nothing on it)."""
    try:
        ep = export(prog)
        run_calls(copy.deepcopy(ep).module(), prog)
    except Exception as exc:  # the generator makes valid programs; note what torch refused
        note(f"torch itself fails on this program: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        reject()
    return ep


# ---- the properties --------------------------------------------------------------------------------------
@_property(examples=25)
@given(prog=programs())
def test_policy_none_is_bitwise_the_unconverted_program(prog):
    """(a), (c) for the input program, (e) under policy=None."""
    ep = exported_or_reject(prog)
    reference = copy.deepcopy(ep)  # its own state: buffers the program writes evolve separately
    before = program_snapshot(ep)
    res = precast.convert(ep)  # (e): any exception here fails the property
    assert_program_unchanged(ep, before, "after convert")
    got = run_calls(res.program.module(), prog)
    assert_calls_bitwise(got, run_calls(reference.module(), prog), "the unconverted program")
    assert_tensors_equal(
        tensors(ep.state_dict), before["state"], "input program's buffers after running the result"
    )


@_property(examples=25)
@given(prog=programs(), low=st.sampled_from(sorted(LOW)))
def test_policy_torch_is_bitwise_eager_autocast(prog, low):
    """(b), (c) for the caller's module, (e) under policy="torch"."""
    dtype = LOW[low]
    model = prog.module()
    try:
        want = run_calls(copy.deepcopy(model), prog, autocast=dtype)
    except RuntimeError as exc:
        # eager autocast itself fails (e.g. cat of fp16 and bf16 in "prioritize"): no reference; precast may
        # refuse the program, with a PrecastError, or convert it
        note(f"eager autocast fails: {str(exc).splitlines()[0]}")
        with contextlib.suppress(PrecastError):
            precast.convert(
                model, prog.inputs(), policy="torch", dtype=dtype, dynamic_shapes=prog.dynamic_shapes()
            )
        return
    before = tensors(model.state_dict())
    res = precast.convert(
        model, prog.inputs(), policy="torch", dtype=dtype, dynamic_shapes=prog.dynamic_shapes()
    )
    assert_tensors_equal(tensors(model.state_dict()), before, "caller's module after convert")
    got = run_calls(res.program.module(), prog)
    assert_calls_bitwise(got, want, f"eager autocast {low}")
    assert_tensors_equal(tensors(model.state_dict()), before, "caller's module after running the result")


def zero_parameters(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def zero_copy(res: precast.ConvertResult, model: nn.Module) -> ExportedProgram:
    """A deepcopy of the converted program with every constant that stores a parameter of ``model`` zeroed."""
    clone = copy.deepcopy(res.program)
    params = {name for name, _ in model.named_parameters()}
    for stored, source in precast.constant_sources(clone).items():
        if source.original in params:
            value = clone.state_dict.get(stored, clone.constants.get(stored))
            with torch.no_grad():
                value.zero_()
    return clone


@_property(examples=10)
@given(prog=programs(), policy=st.sampled_from([None, "torch"]))
def test_copy_of_converted_program_owns_its_weights(prog, policy):
    """(d): deepcopy, zero the copy's parameters: it computes as the zero-weight model converted, and the
    original still computes as before."""
    ep = exported_or_reject(prog)
    model = prog.module()
    kw = {"policy": "torch", "dtype": torch.bfloat16} if policy else {}
    if policy:
        try:
            run_calls(copy.deepcopy(model), prog, autocast=torch.bfloat16)
        except RuntimeError:
            note("eager autocast fails on this program: policy='torch' owes it no conversion")
            reject()
    res = precast.convert(copy.deepcopy(ep), **kw)
    clone = zero_copy(res, model)
    zero_ep = export(prog, zero_parameters(prog.module()))
    want = run_calls(precast.convert(zero_ep, **kw).program.module(), prog)
    assert_calls_bitwise(run_calls(clone.module(), prog), want, "the zero-weight model converted")
    fresh = precast.convert(copy.deepcopy(ep), **kw)
    assert_calls_bitwise(
        run_calls(res.program.module(), prog),
        run_calls(fresh.program.module(), prog),
        "a fresh conversion (original after its copy was zeroed)",
    )


# ---- deterministic regressions: one minimal program per defect class the generator found -------------------
class _WriteBetweenReaders(nn.Module):
    """An activation written through a view between two readers in a bf16 region."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(x) + 0.5
            a = F.linear(h, self.w)
            t = h[:, :1]
            t.add_(1)
            return F.linear(h, self.w) + a


class _WrittenBuffer(nn.Module):
    """A buffer scaled in place each call and read as a weight under autocast."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.randn(8, 8) * 0.35)

    def forward(self, x):
        self.buf.mul_(1.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, self.buf)


class _Counter(nn.Module):
    """A step counter (written buffer) read under a region."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)
        self.register_buffer("count", torch.ones(1))

    def forward(self, x):
        self.count.add_(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x * self.count, self.w)


class _RoundTrip(nn.Module):
    """``h = x.half(); F.linear(h.float(), W) + h.float()`` in an fp16 region."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = x.half()
            return F.linear(h.float(), self.w) + h.float()


class _NestedEinsum(nn.Module):
    """``einsum(einsum(h, h), x)`` in an fp16 region: the outer einsum's inputs are fp16 and fp32."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = F.linear(x, self.w)
            return torch.einsum("bij,bj->bi", torch.einsum("bi,bj->bij", h, h), x)


class _EinsumOfRegionOutput(nn.Module):
    """An einsum reading an fp16 activation and an fp32 weight inside an fp16 region (inputs mixed)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = F.linear(x, self.w)
            return torch.einsum("bi,ij->bj", h, self.w)


class _FloatBeside(nn.Module):
    """A value used beside its own ``.float()`` copy, no region (policy torch decides)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.35)

    def forward(self, x):
        v = F.linear(x, self.w)
        return v.float() * 0.5 + v * v


class _DynamicConv(nn.Module):
    """conv1d on a strided view with a dynamic batch, after a bf16 region."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Parameter(torch.randn(2, 2, 3) * 0.4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(x)
        return F.conv1d(x.reshape(-1, 4, 2).transpose(1, 2), self.conv, padding=1).reshape(-1, 8) + h


class _DynamicRegion(nn.Module):
    """A dynamic batch (sym_size nodes) and nested regions."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x):
        a = x.reshape(-1, 2, 4)
        h = torch.bmm(a, self.w.expand(a.shape[0], -1, -1)).reshape(-1, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.autocast("cpu", enabled=False):
                h = h + 1
            return h * 2


def _x(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))


def _dynamic() -> dict:
    return {"x": {0: torch.export.Dim("batch", min=2, max=64)}}


def _calls(module, n: int = CALLS) -> list:
    with torch.no_grad():
        return [pytree.tree_map(lambda t: t.clone(), module(_x())) for _ in range(n)]


def _eager_autocast(model: nn.Module, dtype: torch.dtype, n: int = CALLS) -> list:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        return [model(_x()).clone() for _ in range(n)]


@pytest.mark.parametrize(
    "cls", [_WriteBetweenReaders, _WrittenBuffer, _Counter, _RoundTrip, _NestedEinsum, _EinsumOfRegionOutput]
)
def test_regression_policy_none_bitwise(cls):
    """(a)+(e): reused cast across an in-place write; written buffer folded into a stale copy; counter read
    after the verification run bumped it; cast-cleanup crash on a round trip; einsums with mixed fp16/fp32
    inputs in a region (nested or not) refused as a dtype mismatch."""
    torch.manual_seed(0)
    ep = torch.export.export(cls(), (_x(),))
    reference = copy.deepcopy(ep)
    res = precast.convert(ep)
    assert_calls_bitwise(_calls(res.program.module()), _calls(reference.module()), "the unconverted program")


@pytest.mark.parametrize(
    ("cls", "low"),
    [
        (_WriteBetweenReaders, "bf16"),
        (_WrittenBuffer, "bf16"),
        (_EinsumOfRegionOutput, "bf16"),
        (_NestedEinsum, "fp16"),
        (_FloatBeside, "fp16"),
        (_RoundTrip, "bf16"),
    ],
)
def test_regression_policy_torch_bitwise_eager(cls, low):
    """(b)+(e): the same classes under policy='torch', and the ``.float()`` alias taken for the value."""
    torch.manual_seed(0)
    model = cls()
    want = _eager_autocast(copy.deepcopy(model), LOW[low])
    res = precast.convert(model, (_x(),), policy="torch", dtype=LOW[low])
    assert_calls_bitwise(_calls(res.program.module()), want, f"eager autocast {low}")


@pytest.mark.parametrize("cls", [_WrittenBuffer, _Counter])
def test_regression_input_program_untouched(cls):
    """(c): convert must not run forwards on the input program's buffers, and the converted program must own
    the buffers it writes."""
    torch.manual_seed(0)
    ep = torch.export.export(cls(), (_x(),))
    before = program_snapshot(ep)
    res = precast.convert(ep)
    assert_program_unchanged(ep, before, "after convert")
    _calls(res.program.module())
    assert_tensors_equal(
        tensors(ep.state_dict), before["state"], "input program's buffers after running the result"
    )


@pytest.mark.parametrize("cls", [_WrittenBuffer, _Counter])
def test_regression_caller_module_untouched(cls):
    """(c): convert(model, x, policy='torch') must leave the caller's module bit-identical, also after the
    converted program runs."""
    torch.manual_seed(0)
    model = cls()
    before = tensors(model.state_dict())
    res = precast.convert(model, (_x(),), policy="torch", dtype=torch.bfloat16)
    assert_tensors_equal(tensors(model.state_dict()), before, "caller's module after convert")
    _calls(res.program.module())
    assert_tensors_equal(tensors(model.state_dict()), before, "caller's module after running the result")


def test_regression_input_node_meta_untouched_with_dynamic_batch():
    """(c): with a dynamic batch, convert wrote its records into the input program's ``sym_size`` node meta."""
    torch.manual_seed(0)
    ep = torch.export.export(_DynamicRegion(), (_x(),), dynamic_shapes=_dynamic())
    before = program_snapshot(ep)
    precast.convert(ep)
    assert_program_unchanged(ep, before, "after convert")


def test_regression_dynamic_conv_converts():
    """(e): conv1d on a strided view with a dynamic batch: refused because re-propagating fake values
    'narrowed' the batch range, though the program is valid at every batch size in its range."""
    torch.manual_seed(0)
    ep = torch.export.export(_DynamicConv(), (_x(),), dynamic_shapes=_dynamic())
    reference = copy.deepcopy(ep).module()
    res = precast.convert(ep)
    with torch.no_grad():
        for b in (4, 16, 40):
            assert_bitwise(res.program.module()(_x(b)), reference(_x(b)), f"batch {b}")


def test_regression_deepcopy_owns_its_weights():
    """(d): a deepcopy of a converted program with zeroed weights computes zeros, not the original's output."""
    torch.manual_seed(0)
    res = precast.convert(torch.export.export(_WriteBetweenReaders(), (_x(),)))
    clone = copy.deepcopy(res.program)
    for value in list(clone.state_dict.values()) + list(clone.constants.values()):
        with torch.no_grad():
            value.zero_()
    with torch.no_grad():
        out = clone.module()(_x())
    assert_bitwise(out, torch.zeros_like(out), "zero-weight copy")
