"""The precision of 16-bit attention under ``precast.compile`` (``backends/aoti/attention.py``): which attentions
a program has and the sizes they are timed at, the decision (measured and cached, or by the CPU's reported
capabilities), and the rewrite: fp32 attention on casts of the inputs, bitwise what fp32 SDPA gives, on a copy.

The real compile of a decoder with this rewrite is checked by tests/realmodels/test_llm.py (AOTInductor decode
against the converted program's eager run; its record names the dtype the capability rule implies)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from precast.backends.aoti import attention as at
from precast.backends.aoti.forms import FORM_ENV
from precast.errors import PrecastError

NO_AMX = {"amx_tile": False, "amx_bf16": False, "amx_fp16": False, "avx512_bf16": True}
AMX = {"amx_tile": True, "amx_bf16": True, "amx_fp16": True, "avx512_bf16": True}


class CachedAttention(torch.nn.Module):
    """Queries of a dynamic length against a fixed-size key/value cache (a decoder's static cache), a bool mask."""

    def __init__(self, length: int = 16, heads: int = 4, dim: int = 8, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("k", torch.randn(1, heads, length, dim, generator=g).to(dtype))
        self.register_buffer("v", torch.randn(1, heads, length, dim, generator=g).to(dtype))

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, scale=0.3) * 2


class CachedFlash(CachedAttention):
    """The same through ATen's CPU flash op itself (a program exported after SDPA was chosen: output, logsumexp)."""

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(
            ~mask, float("-inf")
        )  # the op's mask dtype
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, _ = flash(q, self.k, self.v, attn_mask=additive, scale=0.3)
        return out * 2


class SelfAttention(torch.nn.Module):
    """An encoder's attention: queries, keys and values of one dynamic length, a float mask in the inputs' dtype."""

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _cached(dtype=torch.bfloat16, flash: bool = False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=g).to(dtype)
    mask = torch.ones(1, 1, 3, 16, dtype=torch.bool).tril(13)
    seq = Dim("seq", min=1, max=15)
    module = (CachedFlash if flash else CachedAttention)(dtype=dtype).eval()
    return torch.export.export(module, (q, mask), dynamic_shapes=({2: seq}, {2: seq})), (q, mask)


def _self(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5, dtype=dtype).masked_fill(torch.rand(2, 1, 5, 5, generator=g) < 0.3, -1e4)
    seq = Dim("seq", min=2, max=64)
    shapes = ({2: seq}, {2: seq}, {2: seq}, {2: seq, 3: seq})
    return torch.export.export(SelfAttention(), (q, k, v, mask), dynamic_shapes=shapes), (q, k, v, mask)


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


# ---- what a program's attentions are, and where they are timed ------------------------------------------------
def test_a_fixed_size_cache_is_timed_at_one_query_and_a_prompt():
    ep, _ = _cached()
    (a, names), *rest = at.attentions(ep).items()
    assert not rest and len(names) == 1
    assert (a.dtype, a.heads, a.kv_heads, a.head_dim, a.q_len, a.kv_len, a.mask) == (
        torch.bfloat16,
        4,
        4,
        8,
        None,
        16,
        "bool",
    )
    assert at.points(a) == ((1, 16), (16, 16))


def test_queries_and_keys_of_one_length_are_timed_as_one_sequence():
    ep, _ = _self()
    ((a, _),) = at.attentions(ep).items()
    assert a.same_len and a.kv_len is None and a.mask == "bfloat16"
    assert at.points(a) == ((at.SEQ, at.SEQ),)


def test_fp32_attention_is_not_planned():
    ep, _ = _cached(torch.float32)
    assert at.attentions(ep) == {}
    assert at.plan_attention(ep, "cpu", 1) == at.AttentionPlan()


# ---- the decision ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "times, want",
    [
        ({"q=1": {"bfloat16": 0.9, "float32": 0.12}, "q=256": {"bfloat16": 7.9, "float32": 7.7}}, "float32"),
        # 7x faster at one query, 12% slower at the prompt (torch 2.15 on a Zen 4): a decode step runs per token
        (
            {"q=1": {"bfloat16": 1.11, "float32": 0.176}, "q=256": {"bfloat16": 7.78, "float32": 8.70}},
            "float32",
        ),
        # faster at one query, 60% slower at the prompt: kept
        (
            {"q=1": {"bfloat16": 0.9, "float32": 0.12}, "q=256": {"bfloat16": 7.0, "float32": 11.2}},
            "bfloat16",
        ),
        # within the tie
        ({"q=1": {"bfloat16": 1.0, "float32": 0.97}}, "bfloat16"),
    ],
)
def test_fp32_is_taken_when_faster_overall_and_much_slower_nowhere(times, want):
    dtype, why = at.decide(times, "bfloat16")
    assert dtype == want
    assert "q=1" in why and "fp32" in why


def test_the_capability_rule_keeps_16_bits_only_on_amx(monkeypatch):
    monkeypatch.setenv(FORM_ENV, "flags")
    ep, _ = _cached()
    plan = at.plan_attention(ep, "cpu", 1, caps=NO_AMX)
    assert len(plan.fp32) == 1 and plan.records[0]["dtype"] == "float32"
    assert "lacks amx_tile, amx_bf16" in plan.why
    kept = at.plan_attention(ep, "cpu", 1, caps=AMX)
    assert not kept.fp32 and kept.key() == {} and kept.records[0]["dtype"] == "bfloat16"
    assert at.plan_attention(ep, "cuda", 1, caps=NO_AMX) == at.AttentionPlan()


def test_the_measured_choice_is_cached_and_keyed_by_threads(monkeypatch, tmp_path):
    monkeypatch.delenv(FORM_ENV, raising=False)
    calls = []

    def measure(a, pts, threads):
        calls.append((pts, threads))
        return {f"q={q} kv={k}": {"bfloat16": 1.0, "float32": 0.25} for q, k in pts}

    ep, _ = _cached()
    monkeypatch.setattr(at, "time_attention", measure)
    monkeypatch.setattr("precast.backends.aoti.forms.quiet_now", lambda threads: False)
    first = at.plan_attention(ep, "cpu", 1, tmp_path)
    again = at.plan_attention(ep, "cpu", 1, tmp_path)
    assert calls == [(((1, 16), (16, 16)), 1)]
    assert first == again and first.records[0]["dtype"] == "float32"
    assert "4.00x faster" in first.why
    at.plan_attention(ep, "cpu", 2, tmp_path)
    assert [t for _, t in calls] == [1, 2]
    entries = json.loads((tmp_path / at.ATTENTION_FILE).read_text())
    assert len(entries["entries"]) == 2
    # a file that is not the cache's shape is measured again, with a warning, never a crash
    (tmp_path / at.ATTENTION_FILE).write_text('{"version": 1, "entries": {"x": 3}}')
    with pytest.warns(UserWarning, match="attention cache"):
        at.plan_attention(ep, "cpu", 1, tmp_path)
    assert len(calls) == 3


def test_the_timing_runs_aten_attention_in_both_dtypes():
    ep, _ = _cached()
    ((a, _),) = at.attentions(ep).items()
    times = at.time_attention(a, ((1, 16),), 1)
    assert set(times) == {"q=1 kv=16"} and set(times["q=1 kv=16"]) == {"bfloat16", "float32"}
    assert all(0 < ms < 1000 for ms in times["q=1 kv=16"].values())


# ---- the rewrite -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flash", [False, True], ids=["sdpa", "cpu-flash-op"])
def test_the_rewrite_is_fp32_attention_rounded_once_on_a_copy(monkeypatch, flash):
    monkeypatch.setenv(FORM_ENV, "flags")
    ep, (q, mask) = _cached(flash=flash)
    before = _targets(ep)
    assert (at.FLASH if flash else at.SDPA) in before
    want_16 = ep.module()(q, mask)
    plan = at.plan_attention(ep, "cpu", 1, caps=NO_AMX)
    out = at.apply_attention(ep, plan)
    assert _targets(ep) == before  # the caller's program untouched
    assert torch.equal(ep.module()(q, mask), want_16)
    out.graph.lint()
    k, v = ep.state_dict["k"], ep.state_dict["v"]
    ref = (F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3)).to(
        q.dtype
    )
    got = out.module()(q, mask)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref * 2)
    # a shorter query (the dynamic size kept)
    assert torch.equal(
        out.module()(q[:, :, :1], mask[:, :, :1]),
        F.scaled_dot_product_attention(
            q[:, :, :1].float(), k.float(), v.float(), attn_mask=mask[:, :, :1], scale=0.3
        ).to(q.dtype)
        * 2,
    )
    low = [n for n in out.graph.nodes if at.attention_of(n) is not None]
    assert low == []  # no 16-bit attention left


class GroupedCache(torch.nn.Module):
    """A decoder layer's attention as transformers writes it: the step's key/value written into a static cache in
    place (``index_copy_``), the cache repeated for grouped-query attention (``repeat_kv``: unsqueeze, expand,
    reshape), the cache written again before SDPA (with a bool mask) reads the repeat (a later version)."""

    def __init__(
        self, length: int = 16, heads: int = 4, kv_heads: int = 2, dim: int = 8, flash: bool = False
    ):
        super().__init__()
        self.heads, self.kv_heads, self.flash = heads, kv_heads, flash
        self.register_buffer("k", torch.zeros(1, kv_heads, length, dim, dtype=torch.bfloat16))
        self.register_buffer("v", torch.zeros(1, kv_heads, length, dim, dtype=torch.bfloat16))

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, kv, s, d = x.shape
        rep = self.heads // kv
        return x[:, :, None, :, :].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)

    def forward(self, q, k_new, v_new, pos, mask):
        self.k.index_copy_(2, pos, k_new)
        self.v.index_copy_(2, pos, v_new)
        k, v = self._repeat(self.k), self._repeat(self.v)
        self.k.add_(1.0)  # written between the repeat and the read: the attention sees the version repeated
        if self.flash:
            additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=additive)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out


@pytest.mark.parametrize("flash", [False, True])
def test_grouped_keys_are_cast_unrepeated_and_give_the_same_bits(monkeypatch, flash):
    monkeypatch.setenv(FORM_ENV, "flags")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 2, 8, generator=g).to(torch.bfloat16)
    k_new, v_new = (torch.randn(1, 2, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    pos, mask = torch.tensor([3, 4]), torch.ones(1, 1, 2, 16, dtype=torch.bool).tril(4)
    args = (q, k_new, v_new, pos, mask)
    ep = torch.export.export(GroupedCache(flash=flash), args)
    plan = at.plan_attention(ep, "cpu", 1, caps=NO_AMX)
    assert plan.fp32
    out = at.apply_attention(ep, plan)
    out.graph.lint()
    calls = [n for n in out.graph.nodes if n.target in (at.SDPA, at.FLASH)]
    assert len(calls) == 1 and all(
        at._val(a).shape[1] == 2 for a in calls[0].args[1:3]
    )  # 2 key heads, read as such
    assert calls[0].target is at.FLASH or calls[0].kwargs.get("enable_gqa") is True
    assert not [n for n in out.graph.nodes if n.target is torch.ops.aten.expand.default]  # the 2x copy gone
    # bitwise fp32 attention over the repeated cache, as the rewrite without grouping computes it
    cache_k = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16).index_copy_(2, pos, k_new)
    cache_v = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16).index_copy_(2, pos, v_new)
    rk, rv = (GroupedCache()._repeat(c).float() for c in (cache_k, cache_v))
    if flash:
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), rk, rv, attn_mask=additive
        )[0]
    else:
        want = F.scaled_dot_product_attention(q.float(), rk, rv, attn_mask=mask)
    module = out.module()
    assert torch.equal(module(*args), want.to(torch.bfloat16))
    assert torch.equal(module.k, (cache_k + 1.0))  # the program's own writes kept, in order


def test_a_float_mask_is_cast_up_exactly():
    ep, (q, k, v, mask) = _self()
    plan = at.AttentionPlan(frozenset(at.attentions(ep)), (), "")
    got = at.apply_attention(ep, plan).module()(q, k, v, mask)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float()).to(q.dtype)
    assert torch.equal(got, want)
    assert not torch.equal(got, ep.module()(q, k, v, mask))  # the 16-bit kernel rounds otherwise


def test_a_plan_naming_no_attention_of_the_program_is_an_error():
    ep, _ = _cached()
    other, _ = _self()
    plan = at.AttentionPlan(frozenset(at.attentions(other)), (), "")
    with pytest.raises(PrecastError, match=r"precast.compile \(attention\)"):
        at.apply_attention(ep, plan)
    assert at.apply_attention(ep, at.AttentionPlan()) is ep
