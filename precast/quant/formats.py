"""Weight formats: how a matmul's or an embedding's weight is stored, and the exact arithmetic of each.

A weight of a linear, matmul or embedding is stored in one of:

- ``float``: the dtype its reader computes in (the policy's low dtype or fp32), as every conversion does;
- ``int8``: per output channel (row), symmetric: ``q = round(w / s)`` in [-127, 127], ``s = absmax(row) / 127``
  on the scale grid (``scale_grid``: the compute dtype's values, bf16's for a table read in fp32 and bf16) stored
  in the compute dtype, value ``q * s`` (the form AOTInductor's int8 kernel reads);
- ``int8-asym``: per output channel, asymmetric with an integer zero point (NNCF's ``INT8_ASYM``, what
  ``optimum-cli export openvino --weight-format int8`` stores): ``s = (max - min) / 255`` rounded up to the scale
  grid (so the 256 integers cover the row: ``_scale_up``), ``z = round(-min / s)`` in [0, 255],
  ``q = round(w / s) + z`` in [0, 255] (uint8), value ``(q - z) * s``; ``z`` one byte per row. The same bits, a
  finer step for a row whose values are not centred on zero;
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
from collections.abc import Iterable

import torch

from precast.errors import PrecastError

INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 64  # divides the hidden sizes of most LLMs (576, 1536, 2048, 4096, ...)
_SPELLING = re.compile(r"^(float|int8|int4)(?:[-_:]?(sym|asym))?(?:[-_:]?g(\d+))?$")
# kind -> the stored parts of one weight, by role
_PARTS = {
    "float": (),
    "int8": ("q", "scale"),
    "int8-asym": ("q", "scale", "zero"),
    "int4": ("q", "scale", "zero"),
}


class _FormatType(type):
    """``WeightFormat(kind, group)`` builds the typed format (``Int4(group=64)``); a subclass builds itself."""

    def __call__(cls, *args: object, **kwargs: object) -> WeightFormat:
        if cls is WeightFormat:
            return format_of(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class WeightFormat(metaclass=_FormatType):
    """One storage format: ``kind`` "float" | "int8" | "int8-asym" | "int4", ``group`` the int4 group size (else
    None). The typed formats are its subclasses, one per format: ``Float()``, ``Int8()`` / ``Int8(asym=True)``,
    ``Int4(group=64)``; each holds its arithmetic (``quantize`` / ``dequantize``), its stored parts and its cost
    (``stored_bits``). The graph form of each (the ops that dequantize it) and its recogniser:
    ``precast.quant.graph``. Formats compare by (kind, group): ``WeightFormat("int8") == Int8()``, and
    ``WeightFormat(kind, group)`` builds the typed one."""

    kind: str
    group: int | None

    def __init__(self, kind: str = "float", group: int | None = None) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "group", group)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> tuple:
        return format_of, (self.kind, self.group)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeightFormat) and (self.kind, self.group) == (other.kind, other.group)

    def __hash__(self) -> int:
        return hash((self.kind, self.group))

    def __repr__(self) -> str:
        return f"WeightFormat({self.kind!r}, {self.group!r})"

    @property
    def name(self) -> str:
        return f"int4-g{self.group}" if self.kind == "int4" else self.kind

    @property
    def tag(self) -> str:
        """The prefix of the parts' ``derive`` tags (``int8``, ``int8a``, ``int4g64``)."""
        return {"int4": f"int4g{self.group}", "int8-asym": "int8a"}.get(self.kind, self.kind)

    @property
    def suffix(self) -> str:
        """What the names of its stored constants end with (``_int8``, ``_int8a_zero``): identifier characters."""
        return "int8a" if self.kind == "int8-asym" else self.kind

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    def parts(self) -> tuple[str, ...]:
        """The stored constants of one weight in this format, by role."""
        return _PARTS[self.kind]

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The stored parts of ``weight`` ([out, in]), by role (module function ``quantize``)."""
        raise PrecastError(f"internal: quantize in format {self.name}")

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The value the parts stand for, in ``dtype`` (module function ``dequantize``)."""
        raise PrecastError(f"internal: dequantize in format {self.name}")

    def scale_count(self, shape: tuple[int, ...]) -> int:
        """Scales (and as many zero points, where the format has them) of one weight of ``shape``."""
        return 0

    def stored_bits(self, shape: tuple[int, ...], read_dtypes: Iterable[torch.dtype]) -> float:
        """Stored bits per weight element **as the conversion stores them**: the integers once, the zero points
        once (a byte each), and the scales once per grid (``scale_grid``: a tied table read in fp32 by the
        embedding and in bf16 by the head stores one bf16 scale vector, which the embedding casts to fp32 after
        gathering its rows: ``precast.quant.graph``). ``float`` stores one copy per read dtype (a weight read in
        two dtypes keeps both copies)."""
        n, k = shape
        dtypes = set(read_dtypes) or {torch.float32}
        if not self.quantized:
            return float(sum(torch.finfo(d).bits for d in dtypes))
        scales = self.scale_count(shape)
        zero_bits = 8 * scales if "zero" in self.parts() else 0
        grids = {scale_grid(d, dtypes) for d in dtypes}
        scale_bits = scales * sum(torch.finfo(d).bits for d in grids)
        return self.int_bits + (scale_bits + zero_bits) / (n * k)

    int_bits = 16

    def bits(self, shape: tuple[int, ...], scale_dtype: torch.dtype) -> float:
        """Stored bits per weight element of a weight read in one dtype, scales and zero points included."""
        return self.stored_bits(shape, (scale_dtype,))


class Float(WeightFormat):
    """``float``: the weight in the dtype its op computes in (the policy's low dtype, or fp32)."""

    def __init__(self) -> None:
        super().__init__("float", None)

    def __repr__(self) -> str:
        return "Float()"


class Int8(WeightFormat):
    """``Int8()``: per output channel, symmetric, ``q`` int8 in [-127, 127], ``q * s``. ``Int8(asym=True)``
    (``"int8-asym"``): per output channel with an integer zero point, ``q`` uint8, ``(q - z) * s``."""

    int_bits = 8

    def __init__(self, asym: bool = False) -> None:
        if not isinstance(asym, bool):
            raise PrecastError(f"Int8(asym={asym!r}): give True or False")
        super().__init__("int8-asym" if asym else "int8", None)

    @property
    def asym(self) -> bool:
        return self.kind == "int8-asym"

    def __repr__(self) -> str:
        return "Int8(asym=True)" if self.asym else "Int8()"

    def scale_count(self, shape: tuple[int, ...]) -> int:
        return shape[0]

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        w = weight.detach().to(torch.float32)
        if not self.asym:
            scale = _scale_of(w.abs().amax(dim=1, keepdim=True), 127, scale_dtype)
            q = torch.clamp(torch.round(w / scale.to(torch.float32)), -127, 127).to(torch.int8)
            return {"q": q, "scale": scale}
        low = w.amin(dim=1, keepdim=True).clamp(max=0)
        high = w.amax(dim=1, keepdim=True).clamp(min=0)
        scale = _scale_up(high - low, 255, scale_dtype)
        step = scale.to(torch.float32)
        zero = torch.clamp(torch.round(-low / step), 0, 255)
        q = torch.clamp(torch.round(w / step) + zero, 0, 255).to(torch.uint8)
        return {"q": q, "scale": scale, "zero": zero.to(torch.uint8)}

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if not self.asym:
            return parts["q"].to(dtype) * parts["scale"]
        return (parts["q"].to(dtype) - parts["zero"].to(dtype)) * parts["scale"]


def Int8Asym() -> Int8:  # noqa: N802 - a format's constructor, spelled as the class it returns
    """``Int8(asym=True)``: int8 per output channel with a zero point (``"int8-asym"``)."""
    return Int8(asym=True)


class Int4(WeightFormat):
    """``Int4(group=64)``: groups of ``group`` (32, 64 or 128) along the input, asymmetric with an integer zero point
    per group, two values packed per byte (low nibble the even index), ``(q - z) * s``."""

    int_bits = 4

    def __init__(self, group: int = DEFAULT_INT4_GROUP) -> None:
        if isinstance(group, bool) or group not in INT4_GROUPS:
            raise PrecastError(
                f"Int4(group={group!r}): int4 groups are {', '.join(map(str, INT4_GROUPS))} (e.g. Int4(group=128))"
            )
        super().__init__("int4", int(group))

    def __repr__(self) -> str:
        return f"Int4(group={self.group})"

    def scale_count(self, shape: tuple[int, ...]) -> int:
        return shape[0] * (shape[1] // self.group)

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        w = weight.detach().to(torch.float32)
        n, k = w.shape
        g = self.group
        groups = w.reshape(n, k // g, g)
        low = groups.amin(dim=2, keepdim=True).clamp(max=0)
        high = groups.amax(dim=2, keepdim=True).clamp(min=0)
        scale = _scale_of(high - low, 15, scale_dtype)
        step = scale.to(torch.float32)
        zero = torch.clamp(torch.round(-low / step), 0, 15)
        q = torch.clamp(torch.round(groups / step) + zero, 0, 15).to(torch.uint8).reshape(n, k // 2, 2)
        packed = q[..., 0] | (q[..., 1] << 4)
        return {"q": packed.contiguous(), "scale": scale, "zero": zero.to(torch.uint8)}

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        n, half = parts["q"].shape
        q = unpack_int4(parts["q"]).reshape(n, (2 * half) // self.group, self.group).to(dtype)
        return ((q - parts["zero"].to(dtype)) * parts["scale"]).reshape(n, 2 * half)


def format_of(kind: str, group: int | None = None) -> WeightFormat:
    """The typed format of (kind, group): ``("int4", 64)`` -> ``Int4(group=64)``."""
    if kind == "int4":
        return Int4(group)
    if kind in ("int8", "int8-asym") and group is None:
        return Int8(asym=kind == "int8-asym")
    if kind == "float" and group is None:
        return Float()
    raise PrecastError(f"unknown weight format ({kind!r}, group {group!r})")


FLOAT = Float()
INT8 = Int8()
INT8_ASYM = Int8(asym=True)


def parse_format(value: object, what: str = "weight_format") -> WeightFormat:
    """``"int8"`` (symmetric; ``"int8-sym"``), ``"int8-asym"``, ``"int4"`` (group 64, asymmetric; ``"int4-asym"``),
    ``"int4-g32"``/``"int4-g128"``, ``"float"``, or a ``WeightFormat``; one line for anything else."""
    if isinstance(value, WeightFormat):
        return value
    if isinstance(value, str):
        m = _SPELLING.match(value.strip().lower())
        kind, sym, group = m.groups() if m else (None, None, None)
        if kind == "int4" and sym == "sym":
            raise PrecastError(
                f"{what}={value!r}: int4 is stored asymmetric (with a zero point) only; give 'int4' or 'int4-g128'"
            )
        if kind == "int4":
            g = int(group) if group else DEFAULT_INT4_GROUP
            if g not in INT4_GROUPS:
                raise PrecastError(
                    f"{what}={value!r}: int4 groups are {', '.join(map(str, INT4_GROUPS))} (e.g. 'int4-g128')"
                )
            return Int4(g)
        if kind == "int8" and group is None:
            return INT8_ASYM if sym == "asym" else INT8
        if kind == "float" and group is None and sym is None:
            return FLOAT
    raise PrecastError(
        f"{what}={value!r}: give 'int8' (symmetric), 'int8-asym', 'int4' (group 64), 'int4-g32', 'int4-g128' or "
        "'float' (stored in the dtype its op computes in)"
    )


def fits(fmt: WeightFormat, shape: tuple[int, ...]) -> str | None:
    """Why ``fmt`` cannot store a weight of ``shape`` ([out, in]), or None."""
    if len(shape) != 2:
        return f"a {len(shape)}-d weight (2-d [out, in] only)"
    if fmt.kind == "int4" and (shape[1] % fmt.group or shape[1] % 2):
        return f"its input size {shape[1]} is not a multiple of the int4 group {fmt.group}"
    return None


def scale_grid(
    dtype: torch.dtype, also: frozenset[torch.dtype] | set[torch.dtype] = frozenset()
) -> torch.dtype:
    """The values a weight's scales take when it is read in ``dtype``, ``also`` the dtypes of the weight's other
    reads: the read's own dtype, except an fp32 read of a weight also read in bf16 (fp16), which takes bf16's
    (fp16's) grid, so that one set of integers serves both reads (a tied embedding table: fp32 under autocast, bf16
    as the head) with each read's scales exact in its dtype. The integers are rounded against the scale as stored:
    no accuracy is lost to the grid but its spacing (on SmolLM2-135M, int8-asym with fp32 scales 0.00397
    nats/token, on bf16's grid 0.00405: docs/benchmarks/llm_weights.md)."""
    if dtype == torch.float32:
        for low in (torch.bfloat16, torch.float16):
            if low in also:
                return low
    return dtype


def _scale_of(peak: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The step, stored in ``scale_dtype``: ``peak / levels``, never zero (a zero row stores zeros exactly)."""
    scale = (peak / levels).to(scale_dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def scale_of(peak: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """RTN's stored step of a range ``peak`` over ``levels`` (``Int8``, ``Int4``): the data-aware roundings
    (``precast.quant.rounding``) take their candidates' steps by the same arithmetic."""
    return _scale_of(peak, levels, scale_dtype)


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _scale_up(span: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The step ``span / levels`` rounded **up** to ``scale_dtype``'s grid (never zero): the integers then cover
    the whole range. Rounding to nearest would shrink a step by up to half the grid's spacing (2**-9 relative in
    bf16), which over 255 steps clips a row's extreme values by up to one step."""
    step = span / levels
    scale = step.to(scale_dtype)
    if step.device.type != "meta":
        below = scale.to(step.dtype) < step
        scale = torch.where(below, (scale.view(_BITS[scale_dtype]) + 1).view(scale_dtype), scale)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize(weight: torch.Tensor, fmt: WeightFormat, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored parts of ``weight`` ([out, in], any float dtype; computed in fp32) in ``fmt``, by role. The
    integers are computed against the stored (rounded) scale, so ``dequantize`` is the nearest representable
    value to each weight. Meta weights give meta parts of the right shapes (streamed conversions)."""
    return fmt.quantize(weight, scale_dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] bytes -> [out, in/2, 2] values 0..15 (low nibble first), as the graph computes it."""
    return torch.stack([torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)], -1)


def dequantize(parts: dict[str, torch.Tensor], fmt: WeightFormat, dtype: torch.dtype) -> torch.Tensor:
    """The value the parts stand for, in ``dtype``: the ops the conversion writes into the graph, in its order."""
    return fmt.dequantize(parts, dtype)


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_BY_SHORT = {v: k for k, v in _SHORT.items()}


# the derive-tag mark of a part fitted to calibration data (``precast.quant.rounding``): not recomputable from the
# fp32 weight alone, so ``quantized_part`` refuses it (``"int4g64-bf16-dw.q"``)
DATA_AWARE = "dw"


def derive_tag(fmt: WeightFormat, scale_dtype: torch.dtype, role: str, data_aware: bool = False) -> str:
    """The tag a stored part carries (``ConstantSource.derive``): everything needed to recompute it from the
    original weight, e.g. ``"int4g64-bf16.q"`` (the integers depend on the stored scale's rounding); with
    ``data_aware`` (int4 rounded against calibration data) ``"int4g64-bf16-dw.q"``, which says it is not."""
    mark = f"-{DATA_AWARE}" if data_aware else ""
    return f"{fmt.tag}-{_SHORT[scale_dtype]}{mark}.{role}"


def parse_tag(tag: str) -> tuple[WeightFormat, torch.dtype, str]:
    """``"int4g64-bf16.scale"`` -> (int4-g64, torch.bfloat16, "scale"); one line for a tag this precast cannot read."""
    m = re.fullmatch(r"(int8a?|int4)(?:g(\d+))?-(bf16|fp16|fp32)(?:-dw)?\.(q|scale|zero)", tag)
    if (
        not m
        or (m.group(1) == "int4") != (m.group(2) is not None)
        or (is_data_aware(tag) and m.group(1) != "int4")
    ):
        raise PrecastError(f"unknown stored weight part {tag!r} (written by a newer precast?)")
    fmt = {"int4": lambda: Int4(int(m.group(2))), "int8a": lambda: INT8_ASYM}.get(m.group(1), lambda: INT8)()
    return fmt, _BY_SHORT[m.group(3)], m.group(4)


def is_data_aware(tag: str) -> bool:
    """Whether a part's tag marks it fitted to calibration data (``derive_tag(..., data_aware=True)``)."""
    return tag.rsplit(".", 1)[0].endswith(f"-{DATA_AWARE}")


def quantized_part(original: torch.Tensor, tag: str) -> torch.Tensor:
    """One stored part recomputed from its original weight by its tag; one line for a part fitted to calibration
    data (it depends on the data's statistics, not only on the weight)."""
    fmt, scale_dtype, role = parse_tag(tag)
    if is_data_aware(tag):
        raise PrecastError(
            f"stored weight part {tag!r} is data-aware int4 (fitted to calibration data): it cannot be recomputed "
            "from a new weight alone; convert again with the new weights and the calibration data"
        )
    if role not in fmt.parts():
        raise PrecastError(f"unknown stored weight part {tag!r}")
    # a convolution's weight is stored as its [out, in*kh*kw] matrix (precast.quant.graph)
    if original.dim() > 2:
        original = original.reshape(original.shape[0], -1)
    return quantize(original, fmt, scale_dtype)[role]
