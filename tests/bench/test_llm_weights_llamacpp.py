"""benchmarks/llm_weights_llamacpp.py's own parts, without llama.cpp: the bits a GGUF stores (its 2-D tensors only,
counted from the block layouts' definitions) and the weights written into one exported program (bitwise what a
fresh export of the model with those weights computes)."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")


def write_gguf(path, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        data = gguf.quants.quantize(array, qtype) if qtype != gguf.GGMLQuantizationType.F32 else array
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_stored_counts_the_weights_as_stored(tmp_path):
    """Q8_0: blocks of 32 values in 34 bytes (an fp16 scale, 32 int8); Q4_0: 18 bytes (fp16 scale, 16 bytes of
    nibbles); F32: 4 bytes a value; a 1-D tensor (a norm) is no weight."""
    import numpy as np

    from benchmarks.llm_weights_llamacpp import stored

    rng = np.random.default_rng(0)
    t = gguf.GGMLQuantizationType
    path = tmp_path / "m.gguf"
    write_gguf(
        path,
        {
            "token_embd.weight": (rng.standard_normal((64, 96), dtype=np.float32), t.Q8_0),
            "blk.0.ffn_down.weight": (rng.standard_normal((32, 64), dtype=np.float32), t.Q4_0),
            "blk.0.attn_q.weight": (rng.standard_normal((8, 32), dtype=np.float32), t.F32),
            "blk.0.attn_norm.weight": (rng.standard_normal(32, dtype=np.float32), t.F32),
        },
    )
    got = stored(path)
    assert got["elements"] == 64 * 96 + 32 * 64 + 8 * 32
    assert got["bytes"] == 64 * 96 // 32 * 34 + 32 * 64 // 32 * 18 + 8 * 32 * 4
    assert got["types"] == {"Q8_0": 1, "Q4_0": 1, "F32": 1}


class Wrapped(torch.nn.Module):
    """A tied embedding/head model under a wrapper's prefix (as the static-cache recipe wraps the decoder)."""

    def __init__(self):
        super().__init__()
        inner = torch.nn.Module()
        inner.embed_tokens = torch.nn.Embedding(50, 16)
        inner.proj = torch.nn.Linear(16, 16)
        inner.lm_head = torch.nn.Linear(16, 50, bias=False)
        inner.lm_head.weight = inner.embed_tokens.weight
        self.model = inner

    def forward(self, ids):
        m = self.model
        return m.lm_head(torch.relu(m.proj(m.embed_tokens(ids))))


def test_swap_weights_is_a_fresh_export_with_those_weights():
    from benchmarks.llm_weights_llamacpp import swap_weights

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (1, 7))
    model = Wrapped().eval()
    ep = torch.export.export(model, (ids,))
    other = Wrapped().eval()  # different random weights, names without the wrapper's prefix
    weights = {k.removeprefix("model."): v.clone() for k, v in other.state_dict().items()}
    assert "lm_head.weight" in weights
    swap_weights(ep, weights)
    fresh = torch.export.export(other, (ids,))
    assert torch.equal(ep.module()(ids), fresh.module()(ids))
    assert not torch.equal(ep.module()(ids), torch.export.export(Wrapped().eval(), (ids,)).module()(ids))


def test_swap_weights_refuses_a_weight_the_program_lacks():
    from benchmarks.llm_weights_llamacpp import swap_weights

    ids = torch.randint(0, 50, (1, 7))
    ep = torch.export.export(Wrapped().eval(), (ids,))
    weights = {k.removeprefix("model."): v for k, v in Wrapped().state_dict().items()}
    weights["extra.weight"] = torch.zeros(3)
    with pytest.raises(SystemExit, match="no parameter for"):
        swap_weights(ep, weights)
