"""load_weights on packages whose code reads packed weight copies (Inductor's C++ GEMM template, max-autotune).

The template copies each weight it uses into a blocked / VNNI constant at compile time; before precast recorded
and repacked them, ``load_weights`` swapped the originals the code no longer reads and the model went on serving
its compile-time weights without a word.
"""

from __future__ import annotations

import json

import pytest
import torch

import precast
from precast.backends.aoti.package_cache import MANIFEST
from precast.backends.aoti.packed import gemm_pack, match_packed
from tests.conftest import small_model


# ---- the packing itself (no compile) --------------------------------------------------------------------------
def inductor_pack(b: torch.Tensor, block_n: int, vnni: int) -> torch.Tensor:
    """Inductor's own tensor path: CppGemmTemplate.block_weight then pack_vnni_weight, as in torch 2.13."""
    k, n = b.shape
    padded = -(-n // block_n) * block_n
    blocked = (
        torch.nn.functional.pad(b, (0, padded - n)).reshape(k, padded // block_n, block_n).transpose(-3, -2)
    ).contiguous()
    if vnni > 1:
        blocked = blocked.view(padded // block_n, k // vnni, vnni, block_n).transpose(-1, -2)
        blocked = blocked.reshape(padded // block_n, k, block_n)
    return blocked.contiguous()


@pytest.mark.parametrize(
    "n,k,block_n,vnni", [(64, 64, 32, 2), (10, 64, 16, 2), (48, 32, 32, 1), (40, 16, 16, 4)]
)
def test_gemm_pack_matches_inductors_layout(n, k, block_n, vnni):
    w = torch.randn(n, k).to(torch.bfloat16)  # a Linear's [out, in]: B = w.T
    assert torch.equal(
        gemm_pack(w, transposed=True, block_n=block_n, vnni=vnni), inductor_pack(w.t(), block_n, vnni)
    )
    assert torch.equal(
        gemm_pack(w.t(), transposed=False, block_n=block_n, vnni=vnni), inductor_pack(w.t(), block_n, vnni)
    )


def test_match_packed_finds_the_source_and_reports_strangers():
    g = torch.Generator().manual_seed(0)
    weights = {f"l{i}.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(3)}
    added = {
        "constant7": gemm_pack(weights["l1.weight"], transposed=True, block_n=32, vnni=2),
        "constant8": gemm_pack(weights["l2.weight"], transposed=True, block_n=16, vnni=1),
        "constant9": torch.randn(2, 32, 32, generator=g).to(torch.bfloat16),  # no weight packs to this
    }
    plans, unmatched = match_packed(added, weights)
    assert plans == {
        "constant7": {"source": "l1.weight", "transposed": True, "block_n": 32, "vnni": 2},
        "constant8": {"source": "l2.weight", "transposed": True, "block_n": 16, "vnni": 1},
    }
    assert unmatched == ["constant9"]


# ---- one compile: the small MLP under max-autotune with the C++ GEMM backend -------------------------------------
@pytest.fixture(scope="module")
def autotuned(aoti_cache):
    model, inputs = small_model(0)
    res = precast.convert(model, inputs)
    cm = precast.compile(
        res.program,
        cache_dir=aoti_cache,
        mode="max-autotune",
        inductor_configs={"max_autotune_gemm_backends": "CPP"},
        progress=False,
    )
    manifest = json.loads((cm.package_path.parent / MANIFEST).read_text())
    if not manifest["packed"]["plans"]:
        pytest.skip("the C++ GEMM template was not chosen on this CPU (no packed weights)")
    return model, inputs, cm, manifest


@pytest.mark.aoti
def test_max_autotune_load_weights_swaps_the_packed_copies(autotuned):
    model, inputs, cm, manifest = autotuned
    assert manifest["packed"]["unmatched"] == []
    sources = {p["source"] for p in manifest["packed"]["plans"].values()}
    assert sources <= set(model.state_dict())
    # the code reads only the packed copies: the originals are neither loaded nor kept (issue 27 item 2)
    assert manifest["weights"]["external"] and sources <= set(manifest["weights"]["unread"])
    held = {n for n in cm._runner.get_constant_fqns() if n not in cm._unread}
    assert set(cm._constants) == held and not sources & set(cm._constants)
    assert sources <= set(cm.constant_fqns())  # read through their packed copies
    with torch.no_grad():
        before = cm(*inputs).clone()
        model_b, _ = small_model(1)
        cm.load_weights(model_b.state_dict())
        got = cm(*inputs)
        want = precast.convert(model_b, inputs).program.module()(*inputs)
        # the compiled code reads the new weights (bf16 GEMM rounding apart); before the repack it did not
        assert float((got - want).abs().max()) < 0.02 < float((before - want).abs().max())
        cm.load_weights(model.state_dict())
        assert torch.equal(cm(*inputs), before)


@pytest.mark.aoti
def test_load_weights_refuses_a_packed_copy_it_cannot_reproduce(autotuned):
    model, inputs, cm, _ = autotuned
    stranger = precast.backends.aoti.compiler.CompiledModel.__new__(
        precast.backends.aoti.compiler.CompiledModel
    )
    stranger.__dict__.update(cm.__dict__)
    stranger._packed_unmatched = ["constant99"]
    with pytest.raises(precast.PrecastError, match="cannot reproduce"):
        stranger.load_weights(model.state_dict())


@pytest.mark.parametrize(
    "packed",
    [
        None,
        [],
        {"plans": {}},
        {"plans": [], "unmatched": []},
        {"plans": {"c": {"source": "w"}}, "unmatched": []},
    ],
    ids=["absent", "list", "no-unmatched", "plans-list", "plan-fields"],
)
def test_a_malformed_packed_plan_is_a_miss_not_a_crash(packed):
    from precast.backends.aoti.package_cache import packed_plan_ok

    assert not packed_plan_ok(packed)
    ok = {"plans": {"c": {"source": "w", "transposed": True, "block_n": 32, "vnni": 2}}, "unmatched": []}
    assert packed_plan_ok(ok)
