"""Writes across dtypes and caches in low precision (issue 27 items 1 and 3), on small hand-written decoders
whose KV cache is a buffer written in place, as transformers' static cache writes it (the real recipe's models are
in tests/realmodels/test_llm.py).

- A value a policy lowers and an op writes into a buffer of another dtype (``index_copy_``, ``index_put_``,
  ``scatter_``) is cast to the buffer's dtype at the write, under every policy, with one ``write-cast`` info per
  write; policy "torch" is bitwise eager autocast of the same module whose writes cast (``cast_at_write``), at
  every step.
- ``cache_dtype=`` holds the caches in a low dtype: stored so, bytes halved in the report, refused with one line
  for state that is not a cache; the caller's module and program are never changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import precast
from precast.errors import PrecastError
from tests.helpers import assert_bitwise

BF16, FP16 = torch.bfloat16, torch.float16
HEADS, DIM, MAX = 2, 8, 16


class TinyDecoder(nn.Module):
    """One attention layer with a static KV cache written by ``how`` at ``pos``: the key leaves a rotary-like
    product with an fp32 table (fp32 under autocast, as in Llama), the value leaves its projection (low)."""

    def __init__(self, how: str = "index_copy_", cast_at_write: bool = False, extra_state: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(32, HEADS * DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(HEADS * DIM, HEADS * DIM) for _ in range(4))
        self.head = nn.Linear(HEADS * DIM, 32)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.register_buffer("rot", torch.rand(MAX, DIM, generator=g) + 0.5, persistent=False)
        self.register_buffer("key_cache", torch.zeros(1, HEADS, MAX, DIM), persistent=False)
        self.register_buffer("value_cache", torch.zeros(1, HEADS, MAX, DIM), persistent=False)
        if extra_state:
            self.register_buffer("total", torch.zeros(()), persistent=False)
        self.how, self.cast_at_write, self.extra_state = how, cast_at_write, extra_state

    def split(self, t):
        return t.view(1, -1, HEADS, DIM).transpose(1, 2)

    def write(self, cache, pos, value):
        if self.cast_at_write:  # what a patched StaticLayer.update does: the eager reference
            value = value.to(cache.dtype)
        if self.how == "index_copy_":
            cache.index_copy_(2, pos, value)
        elif self.how == "index_put_":
            cache[:, :, pos] = value
        elif self.how == "scatter_":
            index = pos.view(1, 1, -1, 1).expand(1, HEADS, pos.numel(), DIM)
            cache.scatter_(2, index, value)
        return cache

    def forward(self, ids, pos):
        h = self.emb(ids)
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        k = k * self.rot[pos]  # bf16 * fp32 -> fp32 under autocast, as rotary embeddings do
        keys, values = self.write(self.key_cache, pos, k), self.write(self.value_cache, pos, v)
        if self.extra_state:
            self.total.add_(h.float().sum())  # a running statistic: state, not a cache
        mask = torch.arange(MAX)[None, :] <= pos[:, None]  # causal over the cache
        a = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.head(self.o(a.transpose(1, 2).reshape(1, -1, HEADS * DIM)))


def steps(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prefill of 4 tokens, then single-token decode steps."""
    out = [(torch.tensor([[3, 1, 4, 1]]), torch.arange(4))]
    for i in range(n):
        out.append((torch.tensor([[(5 * i + 2) % 32]]), torch.tensor([4 + i])))
    return out


def export(model: nn.Module) -> torch.export.ExportedProgram:
    """Strict export with a dynamic sequence length, as transformers' recipe exports: the caches stay buffers
    written in place; one program serves the prefill and every decode step."""
    seq = torch.export.Dim("seq", min=1, max=MAX)
    return torch.export.export(model, steps()[0], dynamic_shapes=({1: seq}, {0: seq}), strict=True)


def run_steps(module, dtype=None, cache_dtype=None):
    """Outputs of ``module`` over ``steps()`` (eager autocast when ``dtype``), and its caches after."""
    outs = []
    for ids, pos in steps():
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            outs.append(module(ids, pos))
    return outs


def convert_fixed(ep, **kw):
    return precast.convert(ep, verify=False, **kw)


def decoder(how="index_copy_", **kw):
    return TinyDecoder(how, **kw).eval()


@pytest.mark.parametrize("how", ["index_copy_", "index_put_", "scatter_"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_policy_torch_casts_each_write_bitwise_eager(how, dtype):
    """Eager autocast raises on this module (fp32 cache, low value); precast casts at the write, which is eager
    autocast of the module whose writes cast, bitwise at the prefill and every decode step."""
    model = decoder(how)
    with pytest.raises(RuntimeError, match="dtype"):  # eager autocast itself cannot run it
        run_steps(copy.deepcopy(model), dtype)
    ep = export(model)
    res = precast.convert(ep, policy="torch", dtype=dtype)
    writes = [d for d in res.report.diagnostics if d.code == "write-cast"]
    assert len(writes) == 1 and writes[0].severity == "info"  # the value: the key is fp32 like the cache
    assert "value_cache" in writes[0].message and "test_cache_writes.py" in (writes[0].location or "")
    assert res.report.verification["bitwise"], res.report.verification
    reference = decoder(how, cast_at_write=True)
    got, want = run_steps(res.program.module()), run_steps(reference, dtype)
    for g, w in zip(got, want, strict=True):
        assert_bitwise(g, w)


@pytest.mark.parametrize("policy", ["rules", "auto"])
def test_rules_and_auto_convert_a_cached_decoder(policy):
    """Rules lowered the value projection and its own device check rejected the program it built (fp16 into an
    fp32 cache): now the write casts, every step is finite and close to fp32."""
    model = decoder()
    # auto with a given table (no timing in a test): every linear 5x faster low
    fast = {f"linear{s}": (10.0, 2.0) for s in ("", "_1", "_2", "_3", "_4")}
    chosen = precast.AutoPolicy(dtype=FP16, latencies=fast, confirm=False) if policy == "auto" else policy
    res = precast.convert(export(model), policy=chosen, dtype=FP16)
    assert any(d.code == "write-cast" for d in res.report.diagnostics)
    assert not any(d.severity == "error" for d in res.report.diagnostics)
    got, want = run_steps(res.program.module()), run_steps(decoder())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), w, atol=0.05, rtol=0.05)


def test_policy_none_with_a_region_writes_in_the_cache_dtype():
    """Policy None: the program's own region lowers the value projection; the write still casts."""

    class InRegion(TinyDecoder):
        def forward(self, ids, pos):
            h = self.emb(ids)
            with torch.autocast("cpu", dtype=BF16):
                v = self.split(self.v(h))
            self.write(self.value_cache, pos, v.float() if self.cast_at_write else v)
            return self.value_cache.sum(-1)

    model = InRegion().eval()
    res = precast.convert(export(model))
    assert [d.code for d in res.report.diagnostics if d.code == "write-cast"] == ["write-cast"]
    got, want = run_steps(res.program.module()), run_steps(InRegion(cast_at_write=True).eval())
    for g, w in zip(got, want, strict=True):
        assert_bitwise(g, w)


def test_cache_dtype_holds_the_caches_low():
    model = decoder()
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()} | {
        k: b.clone() for k, b in model.named_buffers()
    }
    ep = export(model)
    graph_before = str(ep.graph)
    res = precast.convert(ep, policy="torch", dtype=BF16, cache_dtype="bf16")
    consts = {**res.program.state_dict, **res.program.constants}
    assert consts["key_cache"].dtype == BF16 and consts["value_cache"].dtype == BF16
    assert consts["rot"].dtype == torch.float32  # read-only: not a cache
    cache = res.report.cache
    assert cache["dtype"] == "bf16" and [c["name"] for c in cache["caches"]] == [
        "b_key_cache",
        "b_value_cache",
    ]
    assert cache["bytes_after"] * 2 == cache["bytes_before"] == 2 * HEADS * MAX * DIM * 4
    assert "caches held in bf16: 2" in res.report.summary()
    # every reader of the cache here computes in bf16 under autocast: holding it bf16 loses nothing
    reference = decoder(cast_at_write=True).to(torch.float32)
    got, want = run_steps(res.program.module()), run_steps(reference, BF16)
    for g, w in zip(got, want, strict=True):
        assert_bitwise(g, w)
    # the caller's program and module are untouched
    assert str(ep.graph) == graph_before
    assert ep.state_dict.keys() == export(model).state_dict.keys()
    for k, b in model.named_buffers():
        assert b.dtype == torch.float32 and torch.equal(b, before[k])
    # saved and loaded, the report still states the caches
    rebuilt = precast.report(res.program)
    assert rebuilt.cache["bytes_after"] == cache["bytes_after"]


@pytest.mark.parametrize("policy,dtype", [("torch", BF16), (None, None), ("rules", FP16)])
def test_report_cache_section_says_one_thing(policy, dtype):
    """The report's cache section (issue 33 item 12): one set of names (the program's placeholders, which the node
    reasons use), dtypes labelled before and after, and every reason of an op reading a held cache says the dtype it
    is held in after conversion, never the one the program gave it; saved and loaded, the same."""
    ep = export(decoder())
    res = precast.convert(ep, policy=policy, dtype=dtype, cache_dtype="bf16")
    placeholders = {
        s.arg.name: s.target
        for s in res.program.graph_signature.input_specs
        if s.target in ("key_cache", "value_cache")
    }
    per_cache = HEADS * MAX * DIM
    want = [
        {
            "name": n,
            "dtype_before": "fp32",
            "dtype_after": "bf16",
            "bytes_before": per_cache * 4,
            "bytes_after": per_cache * 2,
        }
        for n in ("b_key_cache", "b_value_cache")
    ]
    assert res.report.cache == {
        "dtype": "bf16",
        "caches": want,
        "bytes_before": 2 * per_cache * 4,
        "bytes_after": 2 * per_cache * 2,
    }
    assert set(placeholders) == {"b_key_cache", "b_value_cache"}
    consts = {**res.program.state_dict, **res.program.constants}
    assert {consts[t].dtype for t in placeholders.values()} == {BF16}
    assert "caches held in bf16: 2" in res.report.summary()
    readers = [n for n in res.report.nodes if "cache" in n.reason and n.op != "aten.index_copy_.default"]
    assert readers, [(n.name, n.reason) for n in res.report.nodes]
    for n in readers:
        assert "as the program gave it" not in n.reason and "held in fp32" not in n.reason, n.reason
        named = [
            c for c in placeholders if f"reads cache {c}, held in bf16 (the program gave it fp32)" in n.reason
        ]
        assert named, n.reason
    # the attention reads both caches
    (sdpa,) = [n for n in res.report.nodes if "scaled_dot_product" in n.op]
    assert all(f"reads cache {c}, held in bf16" in sdpa.reason for c in placeholders), sdpa.reason
    rebuilt = precast.report(res.program)
    assert rebuilt.cache == res.report.cache
    assert [n.reason for n in rebuilt.nodes] == [n.reason for n in res.report.nodes]


@pytest.mark.parametrize("policy,dtype", [(None, None), ("rules", FP16)])
def test_cache_dtype_under_other_policies_states_its_error(policy, dtype):
    """Policy None promises the unconverted program bitwise: with the cache held bf16 the difference is the
    measured error of that choice (info), not a broken promise."""
    res = precast.convert(export(decoder()), policy=policy, dtype=dtype, cache_dtype=BF16)
    consts = {**res.program.state_dict, **res.program.constants}
    assert consts["key_cache"].dtype == BF16
    codes = [d.code for d in res.report.diagnostics]
    assert "not-bitwise" not in codes
    assert res.report.verification["max_abs"] < 0.05
    got, want = run_steps(res.program.module()), run_steps(decoder())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.float(), w, atol=0.05, rtol=0.05)


def test_cache_reads_are_cast_back_for_fp32_readers():
    """A reader that computes in fp32 (not cast low by the policy) reads the held cache cast back to fp32: the
    op sees the dtype the program gave it, rounded through the cache's dtype."""

    class Summed(TinyDecoder):
        def forward(self, ids, pos):
            self.write(self.value_cache, pos, self.split(self.emb(ids)))
            return self.value_cache.sum(-1) + self.value_cache.exp().mean()

    model = Summed().eval()
    res = convert_fixed(export(model), cache_dtype=BF16)
    out = res.program.module()(*steps()[0])
    assert out.dtype == torch.float32
    m = Summed().eval()
    with torch.no_grad():
        m(*steps()[0])
        m.value_cache.copy_(m.value_cache.to(BF16).float())
        want = m.value_cache.sum(-1) + m.value_cache.exp().mean()
    assert_bitwise(out, want)


def test_cache_dtype_works_on_a_functional_program():
    """After run_decompositions() the writes are functional (index_put + buffer mutation outputs). The
    decomposed attention scales the keys in fp32 before its matmul, so the bf16 cache's rounding shows: close to
    the same program converted with an fp32 cache, not bitwise."""
    ep = export(decoder()).run_decompositions()
    res = precast.convert(ep, policy="torch", dtype=BF16, cache_dtype="bf16")
    assert {**res.program.state_dict, **res.program.constants}["key_cache"].dtype == BF16
    assert res.report.cache["bytes_after"] * 2 == res.report.cache["bytes_before"]
    fp32_cache = precast.convert(ep, policy="torch", dtype=BF16)
    got, want = run_steps(res.program.module()), run_steps(fp32_cache.program.module())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.03, rtol=0.03)


def test_cache_dtype_refused_for_state_that_is_not_a_cache():
    with pytest.raises(PrecastError, match=r"total is not a cache the program fully owns: .*add_") as info:
        precast.convert(export(decoder(extra_state=True)), policy="torch", cache_dtype="bf16")
    assert "\n" not in str(info.value) and info.value.code == "cache-not-owned"


def test_cache_dtype_refused_without_a_cache():
    model = nn.Linear(4, 4)
    with pytest.raises(PrecastError, match="writes no floating buffer"):
        precast.convert(model, (torch.randn(2, 4),), policy="torch", cache_dtype="bf16")
    with pytest.raises(PrecastError, match=r"cache_dtype='int8': give 'bf16'"):
        precast.convert(model, (torch.randn(2, 4),), policy="torch", cache_dtype="int8")


def test_cli_cache_dtype(tmp_path):
    from precast.cli import main

    src, out = tmp_path / "in.pt2", tmp_path / "out.pt2"
    torch.export.save(export(decoder()), src)
    assert (
        main(["convert", str(src), "-o", str(out), "--policy", "torch", "--cache-dtype", "bf16", "--json"])
        == 0
    )
    saved = torch.export.load(out)
    assert {**saved.state_dict, **saved.constants}["key_cache"].dtype == BF16
    # converted from a file, the dynamic sequence still takes the 1-token decode steps (export's 0/1 assumption
    # is not a narrowing by precast)
    for out_ in run_steps(saved.module()):
        assert torch.isfinite(out_).all()
    assert main(["convert", str(src), "-o", str(tmp_path / "x.pt2"), "--cache-dtype", "int4"]) == 2
    assert not (tmp_path / "x.pt2").exists()
