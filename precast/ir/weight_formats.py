"""Weight formats: how a matmul's or an embedding's weight is stored, and the exact arithmetic of each.

A weight of a linear, matmul or embedding is stored in one of:

- ``float``: the dtype its reader computes in (the policy's low dtype or fp32), as every conversion does;
- ``int8``: per output channel (row), symmetric: ``q = round(w / s)`` in [-127, 127], ``s = absmax(row) / 127``
  on the scale grid (``scale_grid``: bf16's values) stored in the compute dtype, value ``q * s``;
- ``int4`` (``int4-g32``, ``int4-g64``, ``int4-g128``): grouped along the input dimension, asymmetric with an
  integer zero point: ``s = (max - min) / 15``, ``z = round(-min / s)`` in [0, 15], ``q = round(w / s) + z`` in
  [0, 15], value ``(q - z) * s``; two values packed per byte (low nibble the even index), ``z`` one byte per
  group, ``s`` in the compute dtype. Asymmetric because it measured better than symmetric on real weights
  (docs/weight_formats.md) and because it is the form OpenVINO's CPU plugin and torch's int4 kernel read.

Every stored part is computed from the original (fp32) weight by ``quantize``, and ``quantized_part`` recomputes any
one part from the original by its ``derive`` tag (``"int8-bf16.q"``, ``"int4g64-fp32.scale"``, ...): the conversion,
the streamed weight writer and ``CompiledModel.load_weights`` all go through it, so the same fp32 weight always gives
the same bytes. ``dequantize`` is the reference value (the same ops, in the same order, the conversion writes into
the graph: a program run eagerly gives it bitwise).

Input: fp32 weights and a format. Output: the stored parts, their bytes, the value they stand for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from precast.errors import PrecastError

INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 64  # divides the hidden sizes of most LLMs (576, 1536, 2048, 4096, ...)
_SPELLING = re.compile(r"^(float|int8|int4)(?:[-_:]?g(\d+))?$")


@dataclass(frozen=True)
class WeightFormat:
    """One storage format: ``kind`` "float" | "int8" | "int4", ``group`` the int4 group size (else None)."""

    kind: str
    group: int | None = None

    @property
    def name(self) -> str:
        return f"int4-g{self.group}" if self.kind == "int4" else self.kind

    @property
    def tag(self) -> str:
        """The prefix of the parts' ``derive`` tags (``int8``, ``int4g64``)."""
        return f"int4g{self.group}" if self.kind == "int4" else self.kind

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    def parts(self) -> tuple[str, ...]:
        """The stored constants of one weight in this format, by role."""
        return {"float": (), "int8": ("q", "scale"), "int4": ("q", "scale", "zero")}[self.kind]

    def bits(self, shape: tuple[int, ...], scale_dtype: torch.dtype) -> float:
        """Stored bits per weight element, scales and zero points included."""
        n, k = shape
        scale_bits = torch.finfo(scale_dtype).bits
        if self.kind == "int8":
            return 8 + scale_bits / k
        if self.kind == "int4":
            return 4 + (scale_bits + 8) / self.group
        return float(scale_bits)


FLOAT = WeightFormat("float")
INT8 = WeightFormat("int8")


def parse_format(value: object, what: str = "weight_format") -> WeightFormat:
    """``"int8"``, ``"int4"`` (group 64), ``"int4-g32"``/``"int4-g128"``, ``"float"``, or a ``WeightFormat``; one
    line for anything else."""
    if isinstance(value, WeightFormat):
        return value
    if isinstance(value, str):
        m = _SPELLING.match(value.strip().lower())
        if m:
            kind, group = m.group(1), m.group(2)
            if kind == "int4":
                g = int(group) if group else DEFAULT_INT4_GROUP
                if g not in INT4_GROUPS:
                    raise PrecastError(
                        f"{what}={value!r}: int4 groups are {', '.join(map(str, INT4_GROUPS))} (e.g. 'int4-g128')"
                    )
                return WeightFormat("int4", g)
            if group is None:
                return WeightFormat(kind)
    raise PrecastError(
        f"{what}={value!r}: give 'int8', 'int4' (group 64), 'int4-g32', 'int4-g128' or 'float' (stored in the "
        "dtype its op computes in)"
    )


def fits(fmt: WeightFormat, shape: tuple[int, ...]) -> str | None:
    """Why ``fmt`` cannot store a weight of ``shape`` ([out, in]), or None."""
    if len(shape) != 2:
        return f"a {len(shape)}-d weight (2-d [out, in] only)"
    if fmt.kind == "int4" and (shape[1] % fmt.group or shape[1] % 2):
        return f"its input size {shape[1]} is not a multiple of the int4 group {fmt.group}"
    return None


def scale_grid(dtype: torch.dtype) -> torch.dtype:
    """The values a weight's scales take when it is read in ``dtype``: bf16's (8 significant bits, fp32's range)
    for bf16 and fp32 reads, so that one set of integers serves a weight read in both (a tied embedding table:
    fp32 under autocast, bf16 as the head) with each read's scales exact in its dtype; fp16's for fp16 reads. The
    integers are rounded against the scale as stored: no accuracy is lost to the grid."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def _scale_of(peak: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The step, stored in ``scale_dtype``: ``peak / levels``, never zero (a zero row stores zeros exactly)."""
    scale = (peak / levels).to(scale_dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize(weight: torch.Tensor, fmt: WeightFormat, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored parts of ``weight`` ([out, in], any float dtype; computed in fp32) in ``fmt``, by role. The
    integers are computed against the stored (rounded) scale, so ``dequantize`` is the nearest representable
    value to each weight. Meta weights give meta parts of the right shapes (streamed conversions)."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if fmt.kind == "int8":
        scale = _scale_of(w.abs().amax(dim=1, keepdim=True), 127, scale_dtype)
        q = torch.clamp(torch.round(w / scale.to(torch.float32)), -127, 127).to(torch.int8)
        return {"q": q, "scale": scale}
    if fmt.kind == "int4":
        g = fmt.group
        groups = w.reshape(n, k // g, g)
        low = groups.amin(dim=2, keepdim=True).clamp(max=0)
        high = groups.amax(dim=2, keepdim=True).clamp(min=0)
        scale = _scale_of(high - low, 15, scale_dtype)
        step = scale.to(torch.float32)
        zero = torch.clamp(torch.round(-low / step), 0, 15)
        q = torch.clamp(torch.round(groups / step) + zero, 0, 15).to(torch.uint8).reshape(n, k // 2, 2)
        packed = q[..., 0] | (q[..., 1] << 4)
        return {"q": packed.contiguous(), "scale": scale, "zero": zero.to(torch.uint8)}
    raise PrecastError(f"internal: quantize in format {fmt.name}")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] bytes -> [out, in/2, 2] values 0..15 (low nibble first), as the graph computes it."""
    return torch.stack([torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)], -1)


def dequantize(parts: dict[str, torch.Tensor], fmt: WeightFormat, dtype: torch.dtype) -> torch.Tensor:
    """The value the parts stand for, in ``dtype``: the ops the conversion writes into the graph, in its order."""
    if fmt.kind == "int8":
        return parts["q"].to(dtype) * parts["scale"]
    n, half = parts["q"].shape
    q = unpack_int4(parts["q"]).reshape(n, (2 * half) // fmt.group, fmt.group).to(dtype)
    return ((q - parts["zero"].to(dtype)) * parts["scale"]).reshape(n, 2 * half)


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_BY_SHORT = {v: k for k, v in _SHORT.items()}


def derive_tag(fmt: WeightFormat, scale_dtype: torch.dtype, role: str) -> str:
    """The tag a stored part carries (``ConstantSource.derive``): everything needed to recompute it from the
    original weight, e.g. ``"int4g64-bf16.q"`` (the integers depend on the stored scale's rounding)."""
    return f"{fmt.tag}-{_SHORT[scale_dtype]}.{role}"


def parse_tag(tag: str) -> tuple[WeightFormat, torch.dtype, str]:
    """``"int4g64-bf16.scale"`` -> (int4-g64, torch.bfloat16, "scale"); one line for a tag this precast cannot read."""
    m = re.fullmatch(r"(int8|int4)(?:g(\d+))?-(bf16|fp16|fp32)\.(q|scale|zero)", tag)
    if not m or (m.group(1) == "int4") != (m.group(2) is not None):
        raise PrecastError(f"unknown stored weight part {tag!r} (written by a newer precast?)")
    fmt = WeightFormat("int4", int(m.group(2))) if m.group(1) == "int4" else INT8
    return fmt, _BY_SHORT[m.group(3)], m.group(4)


def quantized_part(original: torch.Tensor, tag: str) -> torch.Tensor:
    """One stored part recomputed from its original weight by its tag."""
    fmt, scale_dtype, role = parse_tag(tag)
    if role not in fmt.parts():
        raise PrecastError(f"unknown stored weight part {tag!r}")
    return quantize(original, fmt, scale_dtype)[role]
