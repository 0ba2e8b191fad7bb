"""The KV cache in OpenVINO's fused form (``precast/backends/openvino/growing_cache.py``): a static cache written at
consecutive positions and read only by masked attention becomes a growing cache OpenVINO fuses with its attention;
the compiled model keeps the static cache's contract (continue, start over, cut back; a gap refused in one line),
and a program that does not fit keeps the static form.

The module here has the recipe's structure (grouped-query attention over a zero-initialised ``[B, H, L, D]``
cache, ``index_copy_`` at ``cache_position``, repeat_kv, a causal mask over the L slots), small. Reference: the
same module run eagerly step by step. Tolerance: fp32 (f32 hint): OpenVINO's kernels against torch's, 1e-5
relative to the output's largest magnitude.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("openvino", reason="openvino not installed (pip install 'precast[openvino]')")

import precast  # noqa: E402
from precast.errors import PrecastError  # noqa: E402

L, H, KV, D, E = 16, 4, 2, 8, 32


class CachedAttention(torch.nn.Module):
    """One attention layer over a static cache (transformers' StaticCache layout), ``visible``: which slots a
    query sees ("causal": those written up to its position; "all": every slot, unwritten ones too)."""

    def __init__(self, visible: str = "causal", start: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(E, H * D)
        self.kv = torch.nn.Linear(E, 2 * KV * D)
        self.o = torch.nn.Linear(H * D, E)
        self.visible = visible
        self.register_buffer("k_cache", torch.full((1, KV, L, D), start))
        self.register_buffer("v_cache", torch.full((1, KV, L, D), start))

    def forward(self, x, cache_position):
        q_len = x.shape[1]
        q = self.q(x).view(1, q_len, H, D).transpose(1, 2)
        k, v = self.kv(x).view(1, q_len, 2 * KV, D).transpose(1, 2).chunk(2, dim=1)
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        keys = self.k_cache[:, :, None].expand(1, KV, H // KV, L, D).reshape(1, H, L, D)
        values = self.v_cache[:, :, None].expand(1, KV, H // KV, L, D).reshape(1, H, L, D)
        if self.visible == "causal":
            mask = torch.arange(L)[None, :] <= cache_position[:, None]
        else:
            mask = torch.ones(q_len, L, dtype=torch.bool)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None])
        return self.o(out.transpose(1, 2).reshape(1, q_len, H * D))


def export(module: torch.nn.Module) -> torch.export.ExportedProgram:
    seq = torch.export.Dim("seq", min=1, max=L - 1)
    x = torch.randn(1, 3, E)
    return torch.export.export(
        module, (x, torch.arange(3)), dynamic_shapes={"x": {1: seq}, "cache_position": {0: seq}}
    )


def steps(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prompt of 5, then 4 single tokens."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(1, 5, E, generator=g), torch.arange(5))]
    return out + [(torch.randn(1, 1, E, generator=g), torch.tensor([5 + i])) for i in range(4)]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6)


def compiled(module: torch.nn.Module, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precast.compile(export(module), backend="openvino", precision_hint="f32", **options)


def runtime_layers(model) -> list[str]:
    return [
        op.get_rt_info()["layerType"].astype(str)
        for op in model.compiled.get_runtime_model().get_ordered_ops()
    ]


@pytest.fixture(scope="module")
def grown():
    return compiled(CachedAttention())


def test_the_cache_grows_and_openvino_fuses_its_attention(grown):
    """The cache is a variable growing along the sequence from empty, gathered by ``beam_idx``; OpenVINO runs one
    fused attention over it (no scatter into a whole static cache, no separate matmuls and softmax); every step
    matches eager, the state read back as the static buffers eager holds."""
    module = CachedAttention()
    assert grown.growing is not None and grown.growing.positions == "cache_position"
    params = [p.get_friendly_name() for p in grown.ov_model.get_parameters()]
    assert params == ["x", "cache_position", "beam_idx"]
    reads = [op for op in grown.ov_model.get_ordered_ops() if op.get_type_name() == "ReadValue"]
    assert [str(op.get_output_partial_shape(0)) for op in reads] == [f"[1,{KV},?,{D}]"] * 2
    layers = runtime_layers(grown)
    assert layers.count("ScaledDotProductAttention") == 1
    assert "ScatterUpdate" not in layers and "Softmax" not in layers and "MatMul" not in layers
    eager = copy.deepcopy(module)
    grown.reset()
    with torch.no_grad():
        for x, pos in steps():
            assert close(grown(x, pos), eager(x, pos))
    state = grown.state()
    assert state["k_cache"].shape == (1, KV, L, D)
    assert close(state["k_cache"], eager.k_cache) and close(state["v_cache"], eager.v_cache)
    assert torch.equal(module.k_cache, torch.zeros(1, KV, L, D))  # the caller's module untouched


def test_start_over_cut_back_and_a_gap(grown):
    """Position 0 starts a new conversation, an earlier position cuts the cache back there (the static cache
    overwrites from it and masks past it): both what eager computes. A gap, or positions not consecutive, is one
    line before OpenVINO runs, the state unchanged."""
    first, other = steps(0), steps(1)
    grown.reset()
    for x, pos in first:
        grown(x, pos)
    eager = copy.deepcopy(CachedAttention())
    with torch.no_grad():
        for x, pos in first:
            eager(x, pos)
        # cut back to position 3, then continue
        x, _ = other[0]
        assert close(grown(x[:, :2], torch.tensor([3, 4])), eager(x[:, :2], torch.tensor([3, 4])))
        assert close(grown(other[1][0], torch.tensor([5])), eager(other[1][0], torch.tensor([5])))
        # start over: a fresh module's run
        fresh = copy.deepcopy(CachedAttention())
        for x, pos in other:
            assert close(grown(x, pos), fresh(x, pos))
    held = grown.state()
    with pytest.raises(PrecastError, match=r"position 11 leaves a gap after the 9 position\(s\)") as info:
        grown(other[1][0], torch.tensor([11]))
    assert "\n" not in str(info.value)
    with pytest.raises(PrecastError, match=r"are not consecutive"):
        grown(torch.randn(1, 2, E), torch.tensor([9, 11]))
    assert all(torch.equal(held[k], v) for k, v in grown.state().items())
    with pytest.raises(PrecastError, match=r"outside the cache, which holds 16 positions"):
        grown(torch.randn(1, 1, E), torch.tensor([L]))


def test_two_models_hold_their_own_growing_caches():
    """Two compiled models of one program: interleaved calls leave each its own cache."""
    program = export(CachedAttention())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = precast.compile(program, backend="openvino", precision_hint="f32")
        b = precast.compile(program, backend="openvino", precision_hint="f32")
    eager_a, eager_b = copy.deepcopy(CachedAttention()), copy.deepcopy(CachedAttention())
    with torch.no_grad():
        for (xa, pa), (xb, pb) in zip(steps(0), steps(1), strict=True):
            assert close(a(xa, pa), eager_a(xa, pa))
            assert close(b(xb, pb), eager_b(xb, pb))


@pytest.mark.parametrize(
    "module, why",
    [
        (CachedAttention(visible="all"), "the mask lets a query see a slot past the positions written"),
        (CachedAttention(start=0.5), "not a zero-initialised"),
    ],
    ids=["mask-sees-unwritten-slots", "cache-not-zeros"],
)
def test_a_program_that_does_not_fit_keeps_the_static_cache(module, why):
    """Where dropping the unwritten slots would change the result (a query that sees them; a cache that does not
    start empty), the cache stays static, and the model still computes what eager does."""
    model = compiled(module)
    assert model.growing is None and why in model.cache_form
    assert [p.get_friendly_name() for p in model.ov_model.get_parameters()] == ["x", "cache_position"]
    eager = copy.deepcopy(module)
    with torch.no_grad():
        for x, pos in steps():
            assert close(model(x, pos), eager(x, pos))


def test_the_saved_ir_takes_beam_idx_and_grows(grown, tmp_path):
    """The IR written by save() is the growing form: plain OpenVINO decodes from it with ``beam_idx``
    (``arange(batch)``, as optimum-intel's IRs take), the same outputs as the compiled model."""
    from tests.backends.openvino.test_model import fresh_process_steps

    grown.reset()
    want = [grown(x, pos) for x, pos in steps()]
    grown.save(tmp_path / "attn.xml")
    feeds = [
        {"x": x.numpy(), "cache_position": pos.numpy(), "beam_idx": torch.zeros(1, dtype=torch.int32).numpy()}
        for x, pos in steps()
    ]
    got = fresh_process_steps(tmp_path / "attn.xml", tmp_path, feeds)
    assert all(close(g, w) for g, w in zip(got, want, strict=True))
