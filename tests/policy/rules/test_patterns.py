"""Precision-sensitive patterns (``precast.policy.rules.patterns``): each matches its shape and only it, keeps it in fp32
under policy "rules" (bitwise the fp32 computation where the whole pattern reads fp32 inputs), is named in the
report, and can be switched off."""

from __future__ import annotations

import contextlib
import importlib.util
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precast
from precast.errors import PrecastError
from precast.policy.rules import patterns
from precast.policy.rules.options import RuleOptions

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def convert(model, inputs, patterns=None, **kw):
    """policy "rules" with ``patterns`` (None: all of them)."""
    kw.setdefault("dtype", FP16)
    kw.setdefault("data_max", math.inf)
    return precast.convert(model, inputs, policy="rules", patterns=patterns, **kw)


def rules_of(res) -> dict[str, str]:
    return {n.name: n.rule for n in res.report.nodes}


def marked(res, pattern: str) -> set[str]:
    return {n.name for n in res.report.nodes if n.rule == f"pattern:{pattern}"}


def fp32_of(res) -> set[str]:
    return {n.name for n in res.report.nodes if n.dtype == "fp32" and n.source != "none"}


# ---- sincos_angles ---------------------------------------------------------------------------------------------


class Rotary(nn.Module):
    """A rotary embedding written as Llama's: inv_freq buffer, positions, outer product, cat, cos/sin, scaling;
    then applied to a projection (a learned layer: the angle search stops there)."""

    def __init__(self, d=16):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False
        )
        self.q = nn.Linear(d, d, bias=False)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = pos[:, None] @ self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        q = self.q(x)
        half = q.shape[-1] // 2
        rot = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
        return q * cos + rot * sin, cos, sin


def rotary():
    torch.manual_seed(0)
    return Rotary().eval(), (torch.randn(2, 600, 16),)


def test_sincos_angles_keeps_the_tables_bitwise_fp32():
    model, inputs = rotary()
    res = convert(model, inputs)
    got = marked(res, "sincos_angles")
    # matmul (positions x inv_freq), cos, sin and their constant scalings; not the projection nor its rotation
    assert {"matmul", "cos", "sin", "mul", "mul_1"} <= got
    assert "linear" not in got and rules_of(res)["linear"] == "default"
    assert not got & {"mul_2", "mul_3", "add"}  # q * cos, rot * sin, their sum: meet an activation
    reason = next(n.reason for n in res.report.nodes if n.name == "cos")
    assert reason.startswith("pattern sincos_angles: cos of angles")
    with torch.no_grad():
        out, cos, sin = res.module()(*inputs)
        _, cos_ref, sin_ref = model(*inputs)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)


@pytest.mark.parametrize("dtype,worst", [(FP16, 0.05), (BF16, 0.5)])
def test_sincos_angles_off_rounds_the_angles(dtype, worst):
    """Without the pattern the tables are computed in the low dtype: positions near 600 are off by a lot."""
    model, inputs = rotary()
    res = convert(model, inputs, patterns=(), dtype=dtype)
    assert not any(r.startswith("pattern:") for r in rules_of(res).values())
    with torch.no_grad():
        _, cos, _ = res.module()(*inputs)
        _, cos_ref, _ = model(*inputs)
    assert (cos - cos_ref).abs().max() > worst


class Sinusoidal(nn.Module):
    """A diffusion-style timestep embedding: input times x frequencies, cat(sin, cos), then an MLP."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", torch.exp(-math.log(10000) * torch.arange(8) / 8))
        self.mlp = nn.Linear(16, 16)

    def forward(self, t):
        ang = t[:, None].float() * self.freqs[None]
        return self.mlp(torch.cat([ang.sin(), ang.cos()], dim=-1))


def test_sincos_angles_sinusoidal_timestep_embedding():
    torch.manual_seed(0)
    res = convert(Sinusoidal().eval(), (torch.rand(4) * 1000,))
    assert marked(res, "sincos_angles") == {"mul", "sin", "cos"}
    assert rules_of(res)["linear"] == "default"


class Siren(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return torch.sin(self.b(torch.relu(self.a(x))) * 30.0)


def test_sincos_angles_stops_at_learned_layers():
    torch.manual_seed(0)
    res = convert(Siren().eval(), (torch.randn(2, 4),))
    assert marked(res, "sincos_angles") == {"sin", "mul"}  # the scaling of the angle, not the linears
    assert rules_of(res)["linear"] == rules_of(res)["linear_1"] == "default"


# ---- exp_reduce ------------------------------------------------------------------------------------------------


class HandSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        e = (h - h.amax(-1, keepdim=True)).exp()
        lse = torch.log(torch.exp(h).sum(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True), lse, torch.exp(x) * h  # the last exp feeds no reduction


def test_exp_reduce_hand_softmax_and_logsumexp():
    torch.manual_seed(0)
    res = convert(HandSoftmax().eval(), (torch.randn(3, 8),))
    got = marked(res, "exp_reduce")
    assert got == {"exp", "sum_1", "div", "exp_1", "sum_2", "log"}  # fx renames `sum` (a builtin) to sum_1
    assert rules_of(res)["exp_2"] == "default" and rules_of(res)["linear"] == "default"
    assert rules_of(res)["sub"] == "default"  # x - max is exact enough; the exp is what overflows


# ---- small_divisor ---------------------------------------------------------------------------------------------


class Divisions(nn.Module):
    def forward(self, x, y):
        a = x / 1e-4  # a small constant
        b = x / 2.0  # not small
        c = x / (y.abs() + 1e-6)  # (y + eps)
        d = x / (y.abs() + 0.5)  # eps too large to matter
        e = x * torch.rsqrt(y.abs() + 1e-5)  # x * rsqrt(y + eps)
        f = x / torch.clamp(y.abs(), min=1e-9)  # clamp(y, min=eps), as mean pooling writes it
        return a, b, c, d, e, f


def test_small_divisor_matches_only_small_eps():
    torch.manual_seed(0)
    res = convert(Divisions(), (torch.randn(4), torch.randn(4)))
    r = rules_of(res)
    assert r["div"] == "pattern:small_divisor"
    assert r["div_1"] == "default"
    assert r["add"] == r["div_2"] == "pattern:small_divisor"
    assert r["add_1"] == r["div_3"] == "default"
    assert r["add_2"] == r["rsqrt"] == r["mul"] == "pattern:small_divisor"
    assert r["clamp"] == r["div_4"] == "pattern:small_divisor"


# ---- manual_norm -----------------------------------------------------------------------------------------------


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8) * 1.5)

    def forward(self, x):
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # Llama / T5 RMSNorm
        mu = x.mean(-1, keepdim=True)
        mvn = (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + 1e-5)  # variance by hand
        l2 = F.normalize(x, dim=-1)  # norm -> clamp_min(eps) -> div
        mse = (x * x).mean()  # a mean of squares not used to normalise
        return self.w * rms, mvn, l2, mse


def test_manual_norm_rms_variance_l2_bitwise():
    torch.manual_seed(0)
    model, inputs = Norms(), (torch.randn(3, 8) * 100,)
    res = convert(model, inputs)
    r = rules_of(res)
    for name in ("pow_1", "mean", "add", "rsqrt", "mul"):  # RMSNorm
        assert r[name] == "pattern:manual_norm", name
    assert r["mul_1"] == "default"  # the learned scale
    for name in ("mean_1", "sub", "sub_1", "pow_2", "mean_2", "add_1", "sqrt", "div"):  # MVN
        assert r[name] == "pattern:manual_norm", name
    for name in ("linalg_vector_norm", "clamp_min", "div_1"):  # F.normalize
        assert r[name] == "pattern:manual_norm", name
    assert r["mul_2"] == r["mean_3"] == "default"  # mse
    with torch.no_grad():
        got, want = res.module()(*inputs), model(*inputs)
    for i in (1, 2):  # fp32 end to end: bitwise eager fp32
        assert torch.equal(got[i], want[i])
    off = convert(model, inputs, patterns=())
    with torch.no_grad():
        assert not torch.equal(off.module()(*inputs)[2], want[2])


# ---- the option ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chosen,expect",
    [
        (None, {"manual_norm"}),  # the first pattern to claim a node names it
        ((), set()),
        ("small_divisor", {"small_divisor"}),  # RMSNorm's rsqrt(x + eps), F.normalize's clamp_min(eps)
        ({"manual_norm"}, {"manual_norm"}),
    ],
)
def test_patterns_option_switches(chosen, expect):
    torch.manual_seed(0)
    res = convert(Norms(), (torch.randn(3, 8),), patterns=chosen)
    found = {r.removeprefix("pattern:") for r in rules_of(res).values() if r.startswith("pattern:")}
    assert found == expect


@pytest.mark.parametrize("bad", ["angles", ("manual_norm", "nope"), 3])
def test_patterns_option_unknown_is_one_clear_error(bad):
    with pytest.raises(PrecastError, match="patterns") as err:
        RuleOptions.build(FP16, patterns=bad)
    assert "\n" not in str(err.value)


def test_user_rules_win_over_patterns():
    torch.manual_seed(0)
    res = convert(Norms(), (torch.randn(3, 8),), include_nodes=[r"^rsqrt$"], exclude_nodes=[r"^pow_1$"])
    r = rules_of(res)
    assert (
        r["rsqrt"] == "include_nodes" and r["pow_1"] == "exclude_nodes" and r["mean"] == "pattern:manual_norm"
    )


def test_mark_reads_a_bare_graph():
    """mark() works on any FX graph, without a conversion: no parameters known, every pattern."""
    gm = torch.fx.symbolic_trace(lambda x: x / 1e-5)
    assert patterns.mark(gm.graph) == {}  # not ATen: matchers recognise ATen ops only
    ep = torch.export.export(Divisions(), (torch.randn(4), torch.randn(4)))
    found = patterns.mark(ep.graph, ["small_divisor"])
    assert {m.pattern for m in found.values()} == {"small_divisor"} and "div" in found


# ---- transformers' Llama ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_llama_rotary_tables_exact_under_rules_fp16():
    """transformers' LlamaRotaryEmbedding exported plainly (no autocast while tracing, so its own disabled
    region is absent): under rules fp16 its cos/sin are bitwise fp32; without the pattern they are not."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024)
    rope = LlamaRotaryEmbedding(cfg).eval()
    inputs = (torch.randn(1, 512, 64), torch.arange(512)[None])
    ep = torch.export.export(rope, inputs)
    with torch.no_grad():
        want = rope(*inputs)
    res = convert(ep, None)
    trig = {n.name: n for n in res.report.nodes if n.op in ("aten.cos.default", "aten.sin.default")}
    assert trig and all(n.dtype == "fp32" and n.rule == "pattern:sincos_angles" for n in trig.values())
    with torch.no_grad():
        got = res.module()(*inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with torch.no_grad():
        off = convert(ep, None, patterns=()).module()(*inputs)
    assert max((g - w).abs().max().item() for g, w in zip(off, want, strict=True)) > 0.05


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_llama_causal_lm_rules_fp16_keeps_rotary_and_rmsnorm_fp32():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=1024,
        attn_implementation="eager",
        use_cache=False,
    )
    torch.manual_seed(0)

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    model = CausalLM().eval()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with contextlib.nullcontext():  # plainly: no autocast while tracing
        ep = torch.export.export(model, (ids,))
    res = convert(ep, None)
    nodes = {n.name: n for n in res.report.nodes}
    assert nodes["cos"].dtype == nodes["sin"].dtype == "fp32"
    rms = [n for n in nodes.values() if n.op == "aten.rsqrt.default"]
    assert len(rms) == 5 and all(n.rule == "pattern:manual_norm" for n in rms)  # 2 per layer + the final norm
    assert nodes["linear"].dtype == "fp16"
    with torch.no_grad():
        got, want = res.module()(ids), model(ids)
    assert F.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0) > 0.9999
