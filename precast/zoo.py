"""Built-in example models (seeded random weights), shared by ``precast demo``, ``precast bench`` and the tests.

Each entry is a factory returning ``(model, example_inputs)`` with the model in eval mode on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BF16 = torch.bfloat16


def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)


# ---- the seed's model (shared/seeds/000), corrected so it runs --------------------------------------------
class SeedSubModule(nn.Module):
    def __init__(self, device_type: str = "cpu", dtype: torch.dtype = BF16):
        super().__init__()
        self.linear1 = nn.Linear(128, 256)
        self.linear2 = nn.Linear(256, 128)
        self.device_type, self.dtype = device_type, dtype

    def forward(self, x):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            x = self.linear1(x)
            x = torch.relu(x)
            x = self.linear2(x)
        return x


class SeedModel(nn.Module):
    """As posted, ``output`` receives low-precision activations with fp32 weights and fails at run time."""

    def __init__(self, fixed: bool = True, device_type: str = "cpu", dtype: torch.dtype = BF16):
        super().__init__()
        self.sub = SeedSubModule(device_type, dtype)
        self.output = nn.Linear(128, 10)
        self.fixed = fixed

    def forward(self, x):
        x = self.sub(x)
        if self.fixed:
            x = x.float()  # the fix: leave the region in fp32
        x = self.output(x)
        return x


def seed_model(fixed: bool = True):
    _seed()
    return SeedModel(fixed).eval(), (torch.randn(4, 128),)


# ---- benchmark MLP: 4x Linear(1024, 1024) + head, all under one autocast region ---------------------------
class MLP(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 4, out: int = 10, autocast: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, out)
        self.autocast = autocast

    def forward(self, x):
        if not self.autocast:
            return self._body(x)
        with torch.autocast("cpu", dtype=BF16):
            x = self._body(x)
        return x.float()

    def _body(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def mlp(batch: int = 1, width: int = 1024):
    _seed()
    return MLP(width).eval(), (torch.randn(batch, width),)


def small_mlp(batch: int = 4):
    _seed()
    return MLP(64, depth=3).eval(), (torch.randn(batch, 64),)


# ---- CNN with conv / batchnorm / pool ---------------------------------------------------------------------
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = F.relu(self.bn2(self.conv2(x)))
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
            x = self.fc(x)
        return x.float()


def cnn(batch: int = 2):
    _seed()
    m = CNN().eval()
    for bn in (m.bn1, m.bn2):  # non-trivial running statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m, (torch.randn(batch, 3, 16, 16),)


# ---- transformer encoder layer with attention -------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            for layer in self.layers:
                x = layer(x)
        return x.float()


def encoder(batch: int = 2, seq: int = 8):
    _seed()
    return Encoder().eval(), (torch.randn(batch, seq, 64),)


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


class AutocastRegion(nn.Module):
    """A model written without autocast, run inside one ``torch.autocast`` region (outputs back to fp32): the
    seed's situation for any model."""

    def __init__(self, model: nn.Module, device_type: str = "cpu", dtype: torch.dtype = BF16):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.model(*args, **kwargs)
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out
        )


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
