"""The module route on transformers' export recipe for decoder LLMs (``TorchExportableModuleForDecoderOnlyLM``):
its inner ``TorchExportableModuleWithStaticCache`` converted from the module with a dynamic sequence dimension.

Non-strict export binds the cache both as registered buffers (``key_cache_i``) and as lifted constants
(``static_cache.layers[i].keys`` reached through a plain object): verification runs the eager reference on
private clones found by identity; the caller's cache is bitwise unchanged and the program owns its copies.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import precast
from precast.ir.module_state import private_call
from precast.ir.program import written_targets
from precast.pipeline.capture import capture

transformers = pytest.importorskip("transformers")

MAX_CACHE = 32
# issue 27 item 1 (a value written into the fp32 cache is cast to the cache's dtype at the write) is what lets
# a low-precision policy run index_copy_ on this cache at all; it lands separately
WRITE_CASTS = importlib.util.find_spec("precast.policy.writes") is not None
needs_write_casts = pytest.mark.skipif(
    not WRITE_CASTS, reason="needs the casts at the write (issue 27 item 1), not on this branch yet"
)


FAMILIES = {
    "llama": {},
    "qwen3": {"head_dim": 16},  # RMSNorm on q and k: weight * h.to(input_dtype), a dtype read
}


def build(family: str):
    """The recipe's inner module (``TorchExportableModuleWithStaticCache``) and its strict export."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    cfg = AutoConfig.for_model(
        family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=MAX_CACHE,
        cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE},
    )
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE)


@pytest.fixture(scope="module")
def recipe():
    return build("llama").model


def inputs(n: int = 4) -> dict:
    return {"input_ids": torch.arange(1, n + 1)[None], "cache_position": torch.arange(n)}


SEQ = torch.export.Dim("seq", max=MAX_CACHE - 1)
DYNAMIC = {"input_ids": {1: SEQ}, "cache_position": {0: SEQ}}


def cache_tensors(inner) -> list[torch.Tensor]:
    layers = inner.static_cache.layers
    return [t for layer in layers for t in (layer.keys, layer.values, layer.cumulative_length)] + [
        b for _, b in inner.named_buffers()
    ]


def snapshot(inner) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    return [(t, t.clone(), t.requires_grad) for t in cache_tensors(inner)]


def assert_untouched(inner, before) -> None:
    for (obj, value, grad), cur in zip(before, cache_tensors(inner), strict=True):
        assert cur is obj and torch.equal(cur, value), "the caller's cache changed"
        assert cur.requires_grad == grad, "the caller's cache changed requires_grad"


def caller_written(inner) -> dict[str, torch.Tensor]:
    """What the forward writes, by the caller's own tensor objects (precast's capture: a plain static-shape
    export would itself write the caller's ``cumulative_length``)."""
    captured = capture(inner, inputs())
    return {t: captured.origins[t] for t in written_targets(captured.program)}


def assert_owns_written(program, inner) -> None:
    written = written_targets(program)
    # the cache is the recipe's registered buffers, as a strict export names them, not lifted constants
    kinds = {s.target: s.kind.name for s in program.graph_signature.input_specs}
    assert {kinds[name] for name in written} == {"BUFFER"}, kinds
    assert {f"key_cache_{i}" for i in range(len(inner.static_cache.layers))} <= written, written
    assert len(written) >= 2 * len(inner.static_cache.layers), written  # keys and values of every layer
    caller = {id(t) for t in cache_tensors(inner)}
    for name in written:
        value = program.constants.get(name, program.state_dict.get(name))
        assert id(value) not in caller, f"{name} is the caller's tensor"
        assert value.dtype in (torch.float32, torch.int64)  # written constants are never folded to bf16


def test_policy_none_returns_a_program_owning_its_cache(recipe):
    """No regions: returned unchanged (nothing to verify), but as a program of its own: its cache tensors are
    copies, running it at two sequence lengths leaves the caller's cache alone, and it computes what the
    module computes on a fresh cache."""
    before = snapshot(recipe)
    res = precast.convert(recipe, inputs(), dynamic_shapes=DYNAMIC)
    assert [d.code for d in res.report.diagnostics] == ["no-regions"]
    assert_untouched(recipe, before)
    assert_owns_written(res.program, recipe)
    res.program.run_decompositions()  # what AOTInductor and ExecuTorch start from
    with torch.no_grad():
        got = res.program.module()(**inputs())
    res.program.module()(**inputs(6))
    assert_untouched(recipe, before)
    # the module itself on a fresh cache (its state is all zeros at the start), run on private clones of what
    # it writes: the same logits up to export's record of the forward
    with torch.no_grad():
        want = private_call(recipe, caller_written(recipe))(**inputs())
    assert_untouched(recipe, before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_write_casts
@pytest.mark.parametrize("policy", ["torch", "rules"])
def test_low_precision_policies_convert_and_verify(recipe, policy):
    """Policy torch: bitwise eager autocast of the module (the value written into the fp32 cache cast at the
    write, as precast's reference does); rules: measured against the unconverted program. Both leave the
    caller's cache alone, at the traced and at another sequence length."""
    before = snapshot(recipe)
    res = precast.convert(recipe, inputs(), policy=policy, dtype=torch.bfloat16, dynamic_shapes=DYNAMIC)
    v = res.report.verification
    assert v and "max_abs" in v, res.report.summary()
    if policy == "torch":
        assert v["reference"] == "eager torch.autocast of the module (cpu, bf16)" and v["bitwise"], v
    else:
        assert v["reference"] == "the unconverted program"
    assert_untouched(recipe, before)
    assert_owns_written(res.program, recipe)
    with torch.no_grad():
        res.program.module()(**inputs(7))
    assert_untouched(recipe, before)


@needs_write_casts
def test_qwen3_program_route_names_its_dtype_reads_and_the_module_route_reads_them():
    """Qwen3's q/k RMSNorm casts back to the dtype it read: the recipe's fp32 program fixed float32 there.
    Given that program, policy torch says so (``dtype-read-at-export``) and verifies against the program run
    under autocast; given the module, it traces the reads under autocast and is bitwise eager autocast."""
    wrapper = build("qwen3")
    ep = wrapper.export(input_ids=inputs()["input_ids"], cache_position=inputs()["cache_position"])
    from_program = precast.convert(ep, policy="torch", dtype=torch.bfloat16)
    reads = [d for d in from_program.report.diagnostics if d.code == "dtype-read-at-export"]
    assert len(reads) == 1 and "to(input_dtype)" in reads[0].message, from_program.report.diagnostics
    assert reads[0].location.endswith("modeling_qwen3.py:" + reads[0].location.rsplit(":", 1)[1])
    assert from_program.report.verification["reference"] == "the program run under torch.autocast (cpu, bf16)"

    inner = wrapper.model
    before = snapshot(inner)
    from_module = precast.convert(
        inner, inputs(), policy="torch", dtype=torch.bfloat16, dynamic_shapes=DYNAMIC
    )
    assert not [d for d in from_module.report.diagnostics if d.code == "dtype-read-at-export"]
    v = from_module.report.verification
    assert v["reference"] == "eager torch.autocast of the module (cpu, bf16)", v
    # bitwise eager, or bitwise the program torch.export recorded under autocast (measured on transformers
    # 5.23: with the static cache, export's record of Qwen3's forward is 0.002 from eager; without it, bitwise)
    assert v["bitwise"] or v["export_baseline"]["bitwise"], v
    assert_untouched(inner, before)
