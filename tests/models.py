"""The test models: small, built in code, seeded random weights. Each factory returns ``(model in eval mode on
CPU, example_inputs)``.

The demo model comes from the package (``precast.examples``), the benchmark models (mlp, cnn, encoder) from
``precast.bench.models``; everything else here is test-only. ``REGION_MODELS``: models with autocast regions of
their own (policy None); ``PLAIN_MODELS``: models without (policy "torch"/"rules"); ``ZOO``: both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from precast.bench.models import CNN, MLP, AutocastRegion, Encoder, cnn, encoder, mlp  # noqa: F401
from precast.examples import SeedModel, SeedSubModule, seed_model  # noqa: F401

BF16 = torch.bfloat16


def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)


def small_mlp(batch: int = 4):
    _seed()
    return MLP(64, depth=3).eval(), (torch.randn(batch, 64),)


# ---- nested and disabled regions, regions for another device ----------------------------------------------
class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):
                g = self.b(h.float())  # fp32 inside the disabled region
                with torch.autocast("cpu", dtype=torch.float16):
                    k = self.c(g)  # fp16 in a nested enabled region
            h = h + self.c(g)  # bf16 again
        return h.float() + g + k.float()


def nested(batch: int = 4):
    _seed()
    return Nested().eval(), (torch.randn(batch, 32),)


# ---- a weight shared between an fp32 and a low-precision region; weight tying; buffers --------------------
class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        y = self.proj(x)  # fp32 use
        with torch.autocast("cpu", dtype=BF16):
            z = self.proj(x)  # bf16 use of the same weight
            z = self.proj(z)  # used twice in the region: cast once
        return y + z.float()


def shared_weight(batch: int = 4):
    _seed()
    return SharedWeight().eval(), (torch.randn(batch, 32),)


class Tied(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids)
        with torch.autocast("cpu", dtype=BF16):
            h = torch.tanh(self.mid(h))
            logits = self.out(h)
        return logits.float()


def tied(batch: int = 2):
    _seed()
    return Tied().eval(), (torch.randint(0, 50, (batch, 6)),)


class BufferUnderAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("basis", torch.randn(32, 16))
        self.register_buffer("mix", torch.randn(16, 16) / 4, persistent=False)
        self.register_buffer("scale", torch.rand(16) + 0.5, persistent=False)
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            h = self.lin(x)
            y = h @ self.basis  # persistent buffer cast under autocast
            y = y @ self.mix  # non-persistent buffer cast under autocast
            y = y * self.scale  # mul is not an autocast op: promotes to fp32, scale stays fp32
        return y.float()


def buffer_model(batch: int = 4):
    _seed()
    return BufferUnderAutocast().eval(), (torch.randn(batch, 32),)


# ---- plain models without regions (for policy "torch"/"rules") --------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, kind: str = "lstm"):
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(16, 24, num_layers=1, batch_first=True)
        self.head = nn.Linear(24, 8)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


def lstm(batch: int = 2):
    _seed()
    return Recurrent("lstm").eval(), (torch.randn(batch, 5, 16),)


def gru(batch: int = 2):
    _seed()
    return Recurrent("gru").eval(), (torch.randn(batch, 5, 16),)


class EmbedNormSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.ln = nn.LayerNorm(32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        scores = self.proj(h) @ h.transpose(-1, -2)
        return torch.softmax(scores, dim=-1) @ h


def embed_norm_softmax(batch: int = 2):
    _seed()
    return EmbedNormSoftmax().eval(), (torch.randint(0, 100, (batch, 7)),)


class CatMixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.extra = nn.Parameter(torch.randn(4, 16, dtype=torch.float64))

    def forward(self, x):
        low = self.a(x)  # bf16 under autocast
        both = torch.cat([low, x], dim=0)  # promote: bf16 + fp32 -> fp32
        stacked = torch.stack([low, low * 2])  # promote: all bf16 -> bf16
        return both.sum() + stacked.float().sum() + self.extra.sum()  # float64 never touched


def cat_mixed(batch: int = 3):
    _seed()
    return CatMixed().eval(), (torch.randn(batch, 16),)


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


def attention(batch: int = 2):
    _seed()
    return Attention().eval(), (torch.randn(batch, 6, 32),)


class PlainCNN(CNN):
    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def plain_cnn(batch: int = 2):
    m, inputs = cnn(batch)
    plain = PlainCNN()
    plain.load_state_dict(m.state_dict())
    return plain.eval(), inputs


def plain_mlp(batch: int = 4):
    _seed()
    return MLP(64, depth=3, autocast=False).eval(), (torch.randn(batch, 64),)


class PlainEncoder(Encoder):
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def plain_encoder(batch: int = 2, seq: int = 8):
    _seed()
    return PlainEncoder().eval(), (torch.randn(batch, seq, 64),)


# models with the program's own autocast regions (policy None)
REGION_MODELS: dict[str, Callable] = {
    "seed": seed_model,
    "mlp": small_mlp,
    "cnn": cnn,
    "encoder": encoder,
    "nested": nested,
    "shared_weight": shared_weight,
    "tied": tied,
    "buffer": buffer_model,
}
# models without regions (policy "torch" / "rules")
PLAIN_MODELS: dict[str, Callable] = {
    "plain_mlp": plain_mlp,
    "plain_cnn": plain_cnn,
    "plain_encoder": plain_encoder,
    "lstm": lstm,
    "gru": gru,
    "embed_norm_softmax": embed_norm_softmax,
    "cat_mixed": cat_mixed,
    "attention": attention,
}
ZOO: dict[str, Callable] = {**REGION_MODELS, **PLAIN_MODELS}


class Decorated(nn.Module):
    """``@torch.autocast`` as a decorator on forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return torch.relu(self.lin(x))


class OtherDevice(nn.Module):
    """A CUDA autocast region in a CPU program: eager autocast does nothing to CPU tensors there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.float16):
            y = self.lin(x)
        return y


class ViewsOfWeights(nn.Module):
    """Weights reach the cast through views (t, transpose, reshape, expand)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.k = nn.Parameter(torch.randn(4, 4, 16))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w.t()
            b = x @ self.w.transpose(0, 1)  # same view, same cast: shared
            c = torch.bmm(
                x.unsqueeze(0).expand(4, -1, -1), self.k.reshape(4, 16, 4) @ self.k.reshape(4, 4, 16)
            )
        return a.float() + b.float() + c.float().sum(0)


class Einsum(nn.Module):
    """einsum is a composite with no autocast kernel: eager decomposes it under autocast and casts its bmm."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))

    def forward(self, x):
        return torch.einsum("bi,ij->bj", x, self.w)


def decorated():
    torch.manual_seed(0)
    return Decorated().eval(), (torch.randn(4, 16),)


def other_device():
    torch.manual_seed(0)
    return OtherDevice().eval(), (torch.randn(4, 16),)


def views_of_weights():
    torch.manual_seed(0)
    return ViewsOfWeights().eval(), (torch.randn(4, 16),)


def einsum():
    torch.manual_seed(0)
    return Einsum().eval(), (torch.randn(3, 8),)


class TinyDecoder(nn.Module):
    """A decoder with transformers' recipe's call convention (``forward(input_ids, cache_position)``): a static
    cache buffer of ``length`` positions written in place by ``index_copy_`` at ``cache_position``, attention over
    the positions written so far, logits (1, seq, vocab). Seeded weights; greedy continuations vary."""

    def __init__(self, vocab: int = 32, d: int = 16, length: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, vocab)
        self.register_buffer("cache", torch.zeros(1, length, d))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        self.cache.index_copy_(1, cache_position, x)
        seen = torch.arange(self.cache.shape[1])[None, :] <= cache_position[:, None]
        scores = (x @ self.cache.transpose(1, 2)) / x.shape[
            -1
        ]  # |x|^2 / d ~ 1: attention spread over the past
        att = scores.masked_fill(~seen, -1e9).softmax(-1)
        return self.out(att @ self.cache)


def tiny_decoder_program(dynamic: bool = True, length: int = 8) -> torch.export.ExportedProgram:
    """``TinyDecoder`` exported like the recipe: sequence length dynamic (1..length-1), or static at 1 token."""
    from torch.export import Dim

    _seed(0)
    model = TinyDecoder(length=length).eval()
    n = 3 if dynamic else 1
    kwargs = {"input_ids": torch.arange(1, n + 1)[None], "cache_position": torch.arange(n)}
    shapes = None
    if dynamic:
        seq = Dim("seq", min=1, max=length - 1)
        shapes = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    with torch.no_grad():
        return torch.export.export(model, (), kwargs, dynamic_shapes=shapes)
