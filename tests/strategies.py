"""A hypothesis generator of small random ``nn.Module`` programs for the property tests.

Each example is Python source: one ``nn.Module`` class whose ``forward`` is 2-8 ops (linear, matmul, bmm,
conv1d, layer_norm, softmax, einsum, cat, add, mul, relu, sum) over a ``(batch, dim)`` activation, inside
nested ``torch.autocast`` regions (fp16 / bf16, ``enabled=False`` inside enabled), with the patterns that
broke precast on programs nobody here wrote: tied weights, weights read through views, buffers written in
place and read under autocast, activations written through a view between two readers, values used beside
their ``.float()`` copies, cast round trips, nested einsums and strided inputs. Generating source (rather than
interpreting op specs) makes a failing example print as a module one can paste into a file.

The generator keeps programs valid for eager PyTorch by construction: an op that takes a weight gets
``.float()`` on an input that may be low precision wherever autocast is off (outside every region, or in an
``enabled=False`` region, where under an ambient autocast every activation may be low).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch.export import Dim

LOW = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@dataclass
class Var:
    """An activation in the generated forward: its name, whether it may be low precision, and whether it
    may be written in place (fresh compute results only: never the input or a possible alias of it)."""

    name: str
    low: bool
    writable: bool


@dataclass
class GeneratedProgram:
    """A generated module: its source, the names of its features, and how to build it and its inputs."""

    source: str
    dim: int
    batch: int
    batch2: int
    dynamic: bool
    seed: int
    features: list[str] = field(default_factory=list)

    def module(self) -> torch.nn.Module:
        """A fresh instance (weights from ``seed``, so two instances are bit-identical)."""
        scope: dict = {}
        exec(compile(self.source, "<generated>", "exec"), scope)  # noqa: S102 - our own generated source
        torch.manual_seed(self.seed)
        return scope["Generated"]()

    def inputs(self, batch: int | None = None) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + (batch or self.batch))
        return (torch.randn(batch or self.batch, self.dim, generator=g),)

    def dynamic_shapes(self) -> dict | None:
        return {"x": {0: Dim("batch", min=2, max=64)}} if self.dynamic else None

    def batches(self) -> list[int]:
        """Batch sizes to run: the example's, and a second one when the batch dimension is dynamic."""
        return [self.batch, self.batch2] if self.dynamic else [self.batch]

    def __repr__(self) -> str:
        return (
            f"\n# features: {', '.join(sorted(set(self.features)))}\n"
            f"# inputs: x = torch.randn({self.batch}, {self.dim}) (seed {self.seed}); "
            f"dynamic batch: {self.dynamic}{f', second batch {self.batch2}' if self.dynamic else ''}\n"
            f"{self.source}"
        )


WEIGHT_OPS = ("linear", "matmul", "bmm", "conv1d", "einsum", "einsum_strided", "layer_norm")
PLAIN_OPS = ("relu", "softmax", "sum", "add", "mul", "cat", "einsum_nested")
PATTERNS = ("write_between_readers", "write_buffer", "float_beside", "round_trip")
OPS = WEIGHT_OPS + PLAIN_OPS + PATTERNS


class _Builder:
    """Writes one module's ``__init__`` and ``forward`` from hypothesis draws."""

    def __init__(self, draw, dim: int):
        self.draw, self.d = draw, dim
        self.init: list[str] = []
        self.body: list[str] = []
        self.vars = [Var("x", low=False, writable=False)]
        self.regions: list[bool] = []  # enabled flag per open region, innermost last
        self.params: dict[str, list[str]] = {}  # shape kind -> attribute names
        self.buffers: list[str] = []
        self.count = False
        self.features: list[str] = []
        self.n = 0

    # ---- names and emission ----------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.body.append("    " * (2 + len(self.regions)) + line)

    def fresh(self, prefix: str = "h") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def new(self, expr: str, low: bool, writable: bool = True) -> Var:
        v = Var(self.fresh(), low, writable)
        self.emit(f"{v.name} = {expr}")
        self.vars.append(v)
        return v

    def autocast_on(self) -> bool:
        return bool(self.regions) and self.regions[-1]

    def in_disabled(self) -> bool:
        return bool(self.regions) and not self.regions[-1]

    def pick(self, writable: bool = False) -> Var:
        """Mostly the latest activation (what shrinking tends to), sometimes an earlier one."""
        pool = [v for v in self.vars if v.writable] if writable else self.vars
        if not pool:
            return self.vars[-1]
        if self.draw(st.booleans()):
            return pool[self.draw(st.integers(0, len(pool) - 1))]
        return pool[-1]

    def weight_input(self, v: Var) -> str:
        """The input of an op with fp32 weights: ``.float()`` where nothing would cast a low activation."""
        if self.in_disabled() or (not self.autocast_on() and v.low):
            self.features.append("float-before-weight-op")
            return f"{v.name}.float()"
        return v.name

    def out_low(self, *inputs: Var) -> bool:
        return self.autocast_on() or any(v.low for v in inputs)

    # ---- weights ----------------------------------------------------------------------------------------
    def param(self, kind: str, shape: tuple[int, ...], scale: float = 1.0) -> str:
        """A parameter of this shape kind: a new one, or (tied) one already used by another op."""
        have = self.params.setdefault(kind, [])
        if have and self.draw(st.booleans()):
            self.features.append("tied-weights")
            return have[self.draw(st.integers(0, len(have) - 1))]
        name = f"{kind}{len(have)}"
        have.append(name)
        self.init.append(f"self.{name} = nn.Parameter(torch.randn{shape} * {scale:.4g})")
        return name

    def buffer(self) -> str:
        if self.buffers and self.draw(st.booleans()):
            return self.buffers[self.draw(st.integers(0, len(self.buffers) - 1))]
        name = f"buf{len(self.buffers)}"
        self.buffers.append(name)
        d = self.d
        self.init.append(f'self.register_buffer("{name}", torch.randn({d}, {d}) * {d**-0.5:.4g})')
        return name

    def weight(self) -> str:
        """A (dim, dim) weight expression: a parameter, read directly or through a view, or a buffer."""
        d, s = self.d, self.d**-0.5
        how = self.draw(st.sampled_from(["param", "t", "slice", "reshape", "buffer"]))
        if how == "param":
            return f"self.{self.param('w', (d, d), s)}"
        self.features.append(f"weight-{how}")
        if how == "t":
            return f"self.{self.param('w', (d, d), s)}.t()"
        if how == "slice":
            half = self.draw(st.sampled_from([f":{d}", f"{d}:"]))
            return f"self.{self.param('tall', (2 * d, d), s)}[{half}]"
        if how == "reshape":
            return f"self.{self.param('flat', (d * d,), s)}.reshape({d}, {d})"
        w = self.buffer()
        if self.count and self.draw(st.booleans()):
            self.features.append("weight-times-counter")
            return f"(self.{w} * self.count)"
        return f"self.{w}"

    # ---- ops --------------------------------------------------------------------------------------------
    def op(self, name: str) -> None:
        self.features.append(name)
        getattr(self, f"op_{name}")()

    def op_linear(self) -> None:
        v = self.pick()
        w, x = self.weight(), self.weight_input(v)
        if self.draw(st.booleans()):
            b = self.param("b", (self.d,), 0.1)
            self.new(f"F.linear({x}, {w}, self.{b})", self.out_low(v))
        else:
            self.new(f"F.linear({x}, {w})", self.out_low(v))

    def op_matmul(self) -> None:
        v = self.pick()
        w, x = self.weight(), self.weight_input(v)
        form = self.draw(st.sampled_from(["torch.matmul({x}, {w})", "{x} @ {w}"]))
        self.new(form.format(x=x, w=w), self.out_low(v))

    def op_bmm(self) -> None:
        v = self.pick()
        d, h = self.d, self.d // 2
        x = self.weight_input(v)
        a = self.fresh("a")  # a 3-d view: not put in the pool of (batch, dim) activations
        self.emit(f"{a} = {x}.reshape(-1, 2, {h})")
        if self.draw(st.booleans()):
            expr = f"torch.bmm(torch.bmm({a}, {a}.transpose(1, 2)), {a}).reshape(-1, {d}) * 0.1"
        else:
            w = self.param("sq", (h, h), h**-0.5)
            self.features.append("weight-expand")
            expr = f"torch.bmm({a}, self.{w}.expand({a}.shape[0], -1, -1)).reshape(-1, {d})"
        self.new(expr, self.out_low(v))

    def op_conv1d(self) -> None:
        v = self.pick()
        d, h = self.d, self.d // 2
        x = self.weight_input(v)
        w = self.param("conv", (2, 2, 3), 0.4)
        if self.draw(st.booleans()):
            self.features.append("strided-input")
            c = f"{x}.reshape(-1, {h}, 2).transpose(1, 2)"
        else:
            c = f"{x}.reshape(-1, 2, {h})"
        self.new(f"F.conv1d({c}, self.{w}, padding=1).reshape(-1, {d})", self.out_low(v))

    def op_layer_norm(self) -> None:
        v = self.pick()
        d = self.d
        if self.draw(st.booleans()):
            self.new(f"F.layer_norm({v.name}, ({d},))", v.low)
            return
        x = self.weight_input(v)
        g, b = self.param("ln_w", (d,), 1.0), self.param("ln_b", (d,), 0.1)
        self.new(f"F.layer_norm({x}, ({d},), self.{g}, self.{b})", v.low and x == v.name)

    def op_einsum(self) -> None:
        v = self.pick()
        w, x = self.weight(), self.weight_input(v)
        self.new(f'torch.einsum("bi,ij->bj", {x}, {w})', self.out_low(v))

    def op_einsum_strided(self) -> None:
        v = self.pick()
        d, h = self.d, self.d // 2
        x = self.weight_input(v)
        w = self.param("mix", (2, 2), 0.7)
        self.features.append("strided-input")
        a = f"{x}.reshape(-1, 2, {h}).transpose(1, 2)"
        self.new(f'torch.einsum("bij,jk->bik", {a}, self.{w}).reshape(-1, {d})', self.out_low(v))

    def op_einsum_nested(self) -> None:
        v = self.pick()
        n = v.name
        self.new(
            f'torch.einsum("bij,bj->bi", torch.einsum("bi,bj->bij", {n}, {n}), {n}) * {1 / self.d:.4g}',
            self.out_low(v),
        )

    def op_relu(self) -> None:
        v = self.pick()
        self.new(self.draw(st.sampled_from(["torch.relu({})", "F.relu({})"])).format(v.name), v.low)

    def op_softmax(self) -> None:
        v = self.pick()
        self.new(f"torch.softmax({v.name}, -1)", v.low)

    def op_sum(self) -> None:
        v = self.pick()
        self.new(f"{v.name} - {v.name}.sum(-1, keepdim=True) * {1 / self.d:.4g}", v.low)

    def op_add(self) -> None:
        a, b = self.vars[-1], self.pick()
        self.new(f"{a.name} + {b.name}", a.low or b.low)

    def op_mul(self) -> None:
        a, b = self.vars[-1], self.pick()
        self.new(f"{a.name} * {b.name}", a.low or b.low)

    def op_cat(self) -> None:
        a, b, h = self.vars[-1], self.pick(), self.d // 2
        self.new(f"torch.cat([{a.name}[:, :{h}], {b.name}[:, {h}:]], -1)", a.low or b.low)

    def op_write_between_readers(self) -> None:
        """Read an activation, write it in place through a view, read it again (``t = h[:, :1]; t.mul_(2)``)."""
        v = self.pick(writable=True)
        if not v.writable:  # nothing fresh yet: make one
            v = self.new(f"torch.relu({v.name})", v.low)
        w, x = self.weight(), self.weight_input(v)
        first = self.new(f"F.linear({x}, {w})", self.out_low(v))
        t = self.fresh("t")
        cols = self.draw(st.sampled_from([":1", "1:3", "-2:"]))
        self.emit(f"{t} = {v.name}[:, {cols}]")
        self.emit(f"{t}.{self.draw(st.sampled_from(['mul_(2)', 'add_(1)']))}")
        self.new(f"F.linear({self.weight_input(v)}, {w}) + {first.name}", self.out_low(v))

    def op_write_buffer(self) -> None:
        """Write a buffer in place (scale it, copy an activation into it, or count a step)."""
        how = self.draw(st.sampled_from(["mul", "copy", "count"]))
        if how == "count":
            if not self.count:
                self.count = True
                self.init.append('self.register_buffer("count", torch.ones(1))')
            self.emit("self.count.add_(1)")
            v = self.pick()
            self.new(f"{v.name} * self.count", v.low)
            return
        b = self.buffer()
        if how == "mul":
            self.emit(f"self.{b}.mul_(1.5)")
        else:
            v = self.pick()
            self.emit(f"self.{b}[:1].copy_({v.name}.detach()[:1].float())")

    def op_float_beside(self) -> None:
        """A value used beside its own ``.float()`` copy (a no-op alias when the value is fp32)."""
        v = self.pick()
        if v.name == "x":
            v = self.new(f"F.linear({self.weight_input(v)}, {self.weight()})", self.out_low(v))
        self.new(f"{v.name}.float() * 0.5 + {v.name} * {v.name}", self.out_low(v) or v.low, writable=False)

    def op_round_trip(self) -> None:
        """``h = x.half(); F.linear(h.float(), W) + h.float()``: casts there and back."""
        v = self.pick()
        low = self.draw(st.sampled_from(["half", "bfloat16"]))
        hh = self.new(f"{v.name}.{low}()", True)
        self.new(f"F.linear({hh.name}.float(), {self.weight()}) + {hh.name}.float()", self.out_low(v))

    # ---- regions ----------------------------------------------------------------------------------------
    def block(self, budget: int) -> int:
        """Emit ops and regions using at most ``budget`` ops; return how many were used."""
        used = 0
        while used < budget:
            left = budget - used
            if len(self.regions) < 3 and self.draw(st.integers(0, 2)) == 0:
                used += self.region(self.draw(st.integers(1, left)))
            else:
                self.op(self.draw(st.sampled_from(OPS)))
                used += 1
            if used and self.draw(st.integers(0, 3)) == 0:
                break
        return max(used, 1) if budget else 0

    def region(self, budget: int) -> int:
        if self.autocast_on() and self.draw(st.booleans()):
            self.features.append("disabled-region")
            self.emit('with torch.autocast("cpu", enabled=False):')
            self.regions.append(False)
        else:
            low = self.draw(st.sampled_from(sorted(LOW)))
            self.features.append(f"{'nested-' if self.regions else ''}{low}-region")
            self.emit(f'with torch.autocast("cpu", dtype={LOW[low]}):')
            self.regions.append(True)
        start = len(self.body)
        used = self.block(budget)
        if len(self.body) == start:
            self.op("relu")
        self.regions.pop()
        return used

    def source(self, outputs: list[str]) -> str:
        init = "\n".join(f"        {line}" for line in self.init) or "        pass"
        return (
            "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n"
            "class Generated(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            f"{init}\n\n    def forward(self, x):\n"
            + "\n".join(self.body)
            + f"\n        return {', '.join(outputs)}\n"
        )


@st.composite
def programs(draw, min_ops: int = 2, max_ops: int = 8) -> GeneratedProgram:
    """A random small module (2-8 ops on ``(4..8, 8|16)`` activations) as a ``GeneratedProgram``."""
    dim = draw(st.sampled_from([8, 16]))
    b = _Builder(draw, dim)
    budget = draw(st.integers(min_ops, max_ops))
    used = 0
    while used < budget:
        used += b.block(budget - used)
    outputs = [b.vars[-1].name]
    if len(b.vars) > 2 and draw(st.booleans()):
        extra = b.vars[draw(st.integers(1, len(b.vars) - 2))].name
        outputs.append(extra)
    dynamic = draw(st.booleans())
    return GeneratedProgram(
        source=b.source(outputs),
        dim=dim,
        batch=draw(st.integers(4, 8)),
        batch2=draw(st.integers(2, 12)),
        dynamic=dynamic,
        seed=draw(st.integers(0, 2**16)),
        features=b.features + (["dynamic-batch"] if dynamic else []),
    )
