"""Integer weights read in the kernel: the dequantize-then-linear of int8 / int8-asym / int4 weights rewritten to
ATen's weight-only kernels before AOTInductor compiles (``precast.compile``'s private copy; the caller's program is
never changed).

The program's form (issue 41), for a linear weight W [N, K] and compute dtype ``dt``:

- int8 per output channel: ``linear(x, mul(_to_copy(q, dtype=dt), scale), bias)``, ``q`` int8 [N, K], ``scale`` dt
  [N, 1] -> ``_weight_int8pack_mm(x2d, q, scale.view(N))`` (+ bias): the kernel reads ``q`` as it is stored.
- int8-asym per output channel: ``linear(x, mul(sub(_to_copy(q, dtype=dt), _to_copy(zero, dtype=dt)), scale),
  bias)``, ``q`` uint8 [N, K], ``zero`` uint8 [N, 1], ``scale`` dt [N, 1]; ``(q - zero) * scale`` is
  ``(q8 - z8) * scale`` with ``q8 = q - 128``, ``z8 = zero - 128`` ->
  ``_weight_int8pack_mm(x2d, q8, scale.view(N)) - sum(x2d, -1, keepdim=True) * c`` (+ bias), the int8 kernel and
  a rank-1 correction (computed in fp32, rounded once to dt), on two new constants: ``<q>.int8s`` (``q8``, int8
  [N, K]) and ``<zero>.int8c`` (``c = z8 * scale``, fp32 [N]).
- int4 grouped (g in 32/64/128/256), asymmetric: ``packed`` uint8 [N, K/2] (low nibble even k), ``zero`` uint8
  [N, K/g, 1], ``scale`` dt [N, K/g, 1]; unpacked by ``bitwise_and`` / ``bitwise_right_shift`` / ``stack`` /
  ``reshape``, then ``(q - zero) * scale`` -> ``_weight_int4pack_mm_for_cpu(x2d, int4pack, g, scales_and_zeros)``
  on two new constants: ``<packed>.int4pack`` (``_convert_weight_to_int4pack_for_cpu`` of the unpacked values,
  the kernel's own blocked layout) and ``<scale>.int4sz`` ([K/g, N, 2] in dt: the scale, and torch's float zero
  ``(8 - zero) * scale``, computed in fp32 and rounded once: torch's int4 is ``(q - 8) * scale + zero_float``).

The new constants are stated as recipes over the program's stored constants (``backends/aoti/packed.py``'s format),
written in the manifest with freezing's folded constants: the package holds neither, and every load and
``load_weights`` recomputes them from the weights (``CompiledModel.load_weights`` quantizes originals first).

Kernel facts (torch 2.13 CPU, checked in eager): both kernels take fp32, bf16 and fp16 activations, the scale
(and int4's scales_and_zeros) in the activation's dtype and nothing else; ``_convert_weight_to_int4pack_for_cpu``
takes int32 [N, K] values in 0..15 with N a multiple of 16; ``_weight_int4pack_mm_for_cpu`` takes group sizes 32,
64, 128, 256 only; ``_weight_int8pack_mm`` reads int8 only (int8-asym's uint8 ``q`` is shifted to int8 for it,
the shift undone by the correction). An int weight precast cannot hand to a kernel (another pattern, N not a
multiple of 16, a scale dtype other than the activation's) runs as the program states it (dequantized to ``dt``
on every call; under freezing a ``dt`` copy folded at compile time), and ``precast.compile`` says so in one
warning line naming them (a zero point with its weight).

Input: an ExportedProgram. Output: an ``IntPlan`` (what runs where: part of the cache key), and on a cache miss
the rewritten program with its new constants' recipes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from precast.quant.forms import VIEWS, Dequantized, cast_dtype, is_call, recognise, value_of

aten = torch.ops.aten
VERSION = 2  # of the rewrite: in the cache key with the plan
INT4_GROUPS = (32, 64, 128, 256)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
PACK_SUFFIX = ".int4pack"
SZ_SUFFIX = ".int4sz"
INT8S_SUFFIX = ".int8s"  # int8-asym's q - 128 (int8), the int8 kernel's weight
CORR_SUFFIX = ".int8c"  # int8-asym's (zero - 128) * scale (fp32 [N]), the rank-1 correction's row factor


@dataclasses.dataclass(frozen=True)
class IntLinear:
    """One linear whose weight the kernel reads in low bit."""

    kind: str  # "int8" | "int8-asym" | "int4"
    linear: str  # node name
    weight: str  # stored name of q (int8, int8-asym) / packed (int4)
    scale: str
    zero: str | None  # int8-asym, int4
    group: int | None  # int4
    dtype: torch.dtype
    chain: tuple[str, ...]  # the dequantize nodes the rewrite leaves dead (unless read elsewhere)


@dataclasses.dataclass(frozen=True)
class IntPlan:
    rewrites: tuple[IntLinear, ...]
    dequantized: dict[str, str]  # int weight -> why it runs dequantized (what reads it)
    dtypes: dict[str, torch.dtype]  # int weight -> the dtype it is dequantized to

    def key(self) -> dict[str, Any]:
        """What the plan adds to the cache key (nothing for a program without int weights)."""
        if not self.rewrites and not self.dequantized:
            return {}
        return {
            "precast.int_weights": {
                "version": VERSION,
                "int8": sorted(r.weight for r in self.rewrites if r.kind == "int8"),
                "int8-asym": sorted(r.weight for r in self.rewrites if r.kind == "int8-asym"),
                "int4": sorted(f"{r.weight}:{r.group}" for r in self.rewrites if r.kind == "int4"),
                "dequantized": sorted(self.dequantized),
            }
        }

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``"int_weights"``."""
        return {
            "int8": sorted(r.weight for r in self.rewrites if r.kind == "int8"),
            "int8-asym": sorted(r.weight for r in self.rewrites if r.kind == "int8-asym"),
            "int4": sorted(r.weight for r in self.rewrites if r.kind == "int4"),
            "dequantized": dict(sorted(self.dequantized.items())),
        }

    def warning(self, freezing: bool) -> str | None:
        """One line naming the int weights no low-bit kernel reads, and what runs instead; None if none."""
        if not self.dequantized:
            return None
        names = sorted(n for n, why in self.dequantized.items() if not why.startswith("the zero point of"))
        shown = "; ".join(f"{n} ({self.dequantized[n]})" for n in names[:4]) + (
            " ..." if len(names) > 4 else ""
        )
        dtypes = sorted({str(self.dtypes.get(n, "float")).removeprefix("torch.") for n in names})
        instead = (
            f"a {'/'.join(dtypes)} copy of each, folded at compile time (freezing), is held and read instead"
            if freezing
            else f"each is dequantized to {'/'.join(dtypes)} on every call and the float copy read instead"
        )
        return (
            f"precast.compile: {len(names)} int weight(s) run without a low-bit kernel: {shown}; {instead} "
            "(torch's kernels take a linear's weight, its scale in the activation's dtype; int4: N a multiple "
            "of 16, groups 32/64/128/256)"
        )


# ---- planning (cheap: no values read) ----------------------------------------------------------------------------
def plan_int_weights(ep: ExportedProgram, device: str = "cpu") -> IntPlan:
    """The linears whose int8 / int8-asym / int4 weight a kernel will read, and the int weights left dequantized
    (and why; a zero point is named with its weight). ``device``: where the program runs; the kernels and the int4
    packing here are torch's CPU ones."""
    consts = _constant_names(ep)
    rewrites: list[IntLinear] = []
    why_not: dict[str, str] = {}
    for node in ep.graph.nodes:
        if device != "cpu":
            break
        if node.op == "call_function" and node.target is aten.linear.default:
            found = _match(node, consts)
            if isinstance(found, IntLinear):
                rewrites.append(found)
            elif isinstance(found, tuple):
                why_not.setdefault(found[0], found[1])
                for partner in found[2:]:  # int8-asym's and int4's zero: named with its weight
                    why_not.setdefault(partner, f"the zero point of {found[0]}")
    dead = {n for r in rewrites for n in (*r.chain, r.linear)}
    dequantized: dict[str, str] = {}
    dtypes: dict[str, torch.dtype] = {}
    for node in ep.graph.nodes:
        name = consts.get(node)
        val = node.meta.get("val")
        if name is None or not isinstance(val, torch.Tensor) or val.dtype not in (torch.int8, torch.uint8):
            continue
        reader = _live_reader(node, dead)
        if reader is None:
            continue
        if device != "cpu":
            dequantized[name] = f"device {device}: precast hands int weights to torch's CPU kernels only"
        else:
            dequantized[name] = why_not.get(name) or f"read by {_op_name(reader)}"
        dtypes[name] = _float_of(node) or torch.float32
    return IntPlan(tuple(rewrites), dequantized, dtypes)


def int_kernel_configs(configs: dict[str, Any], plan: IntPlan) -> tuple[dict[str, Any], str | None]:
    """``configs`` with ATEN among the GEMM backends where autotuning would leave torch's int kernels no choice
    (the ``gemm-template`` form: ``max_autotune_gemm_backends="CPP"``; measured on an AVX2 CPU: "No choices to
    select", the compile fails), and why; unchanged otherwise."""
    if not plan.rewrites or not configs.get("max_autotune") or "max_autotune_gemm_backends" not in configs:
        return configs, None
    backends = str(configs["max_autotune_gemm_backends"]).upper().replace(" ", "")
    if "ATEN" in backends.split(","):
        return configs, None
    why = "ATEN added to the GEMM backends: torch's int8/int4 kernels are ATen's"
    return {**configs, "max_autotune_gemm_backends": f"{backends},ATEN"}, why


def warn_int_weights(plan: IntPlan, freezing: bool) -> None:
    line = plan.warning(freezing)
    if line:
        warnings.warn(line, stacklevel=4)  # the caller of precast.compile (through backends.compile)


def _constant_names(ep: ExportedProgram) -> dict[Node, str]:
    sig = ep.graph_signature
    by_input = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    return {n: by_input[n.name] for n in ep.graph.nodes if n.op == "placeholder" and n.name in by_input}


def _sizes(node: Node) -> tuple[int, ...] | None:
    val = value_of(node)
    if val is None or not all(isinstance(s, int) for s in val.shape):
        return None
    return tuple(val.shape)


def linear_args(linear: Node) -> tuple[Node, Node, Any]:
    args = list(linear.args) + [None] * (3 - len(linear.args))
    return args[0], args[1], linear.kwargs.get("bias", args[2])


def _scale_bad(kind: str, s: Node, dt: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """Why the kernels cannot take this scale (they take it in the activation's dtype ``dt``, of ``shape``), or
    None."""
    sv = value_of(s)
    if sv is not None and dt in FLOATS and sv.dtype == dt and _sizes(s) == shape:
        return None
    what = f"{kind} scale {getattr(sv, 'dtype', None)} {list(getattr(sv, 'shape', []))}, dequantized to {dt}"
    return what.replace("torch.", "")


def _kernel_bad(x: Any, bias: Any, dt: torch.dtype, k: int) -> str | None:
    """Why the kernels cannot take this activation (``dt``, last size ``k``) or bias (``dt``, 1-d), or None."""
    xv = value_of(x)
    if xv is None or xv.dim() < 1 or xv.dtype != dt:
        return f"activation {getattr(xv, 'dtype', None)}, scale {dt}".replace("torch.", "")
    if xv.shape[-1] != k:
        return "activation's last size is not K"
    if bias is None:
        return None
    bv = value_of(bias)
    return None if bv is not None and bv.dtype == dt and bv.dim() == 1 else "a bias of another dtype"


def _match(linear: Node, consts: dict[Node, str]) -> IntLinear | tuple[str, ...] | None:
    """The linear's weight as the stored form (``precast.quant.forms.recognise``: the one recogniser) a kernel
    takes: an ``IntLinear``; a tuple ``(q's name, why not[, zero's name])`` where the form is there but no kernel
    takes it; None for a float weight."""
    x, w, bias = linear_args(linear)
    d = recognise(w)
    if (
        d is None
        or d.q not in consts
        or d.scale not in consts
        or (d.zero is not None and d.zero not in consts)
    ):
        return None
    kind, name, dt = d.format.kind, consts[d.q], d.dtype
    zero = consts[d.zero] if d.zero is not None else None
    partner = (zero,) if zero else ()
    n, k = _sizes(d.q) or (None, None)
    chain = tuple(node.name for node in d.chain)
    if kind == "int4":
        return _int4(d, x, bias, (name, consts[d.scale], zero), chain, linear)
    if zero is not None and (value_of(d.zero).dtype != torch.uint8 or _sizes(d.zero) != (n, 1)):
        zv = value_of(d.zero)
        return name, f"int8-asym zero point {zv.dtype} {list(zv.shape)}".replace("torch.", ""), zero
    if bad := _scale_bad(kind, d.scale, dt, (n, 1)) or _kernel_bad(x, bias, dt, k):
        return (name, bad, *partner)
    return IntLinear(kind, linear.name, name, consts[d.scale], zero, None, dt, chain)


def _int4(d: Dequantized, x: Any, bias: Any, names: tuple[str, str, str], chain: tuple, linear: Node) -> Any:
    """An int4 linear the kernel takes (``IntLinear``), or ``(name, why not, zero)``; ``names``: the stored names
    of its packed bytes, scale and zero point."""
    name, scale, zero = names
    ps, zs, qs, w = _sizes(d.q), _sizes(d.zero), _sizes(d.chain[3]), d.chain[-1]
    zv, dt = value_of(d.zero), d.dtype
    if None in (ps, zs, qs, zv, _sizes(d.scale)) or len(ps) != 2:
        return name, "int4 shapes outside the documented form", zero
    n, k, g = ps[0], 2 * ps[1], d.format.group
    if qs != (n, k // g, g) or zs != (n, k // g, 1) or zv.dtype != torch.uint8 or _sizes(w) != (n, k):
        return name, "int4 shapes outside the documented form", zero
    if bad := _scale_bad("int4", d.scale, dt, (n, k // g, 1)):
        return name, bad, zero
    if g not in INT4_GROUPS:
        return name, f"int4 group {g}: torch's CPU kernel takes 32, 64, 128, 256", zero
    if n % 16:
        return name, f"int4 N={n} not a multiple of 16 (torch's CPU packing)", zero
    if bad := _kernel_bad(x, bias, dt, k):
        return name, bad, zero
    return IntLinear("int4", linear.name, name, scale, zero, g, dt, chain)


def _live_reader(node: Node, dead: set[str]) -> Node | None:
    """A reader of ``node`` (through the dequantize nodes the rewrite leaves dead) that still reads the int
    weight after the rewrite, other than an embedding's table lookup, directly or through views of the table (a
    gather of int rows: read in low bit; int4's scale and zero are read as [N, K/g] views)."""
    todo, seen = [(node, True)], set()
    while todo:
        n, table = todo.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.name in dead:
                if user.op == "call_function" and user.target is not aten.linear.default:
                    todo.append((user, False))
                continue
            if table and is_call(user, aten.embedding.default) and user.args[0] is n:
                continue
            if (
                table
                and is_call(user, *VIEWS, aten.unsqueeze.default, aten.squeeze.dim)
                and user.args[0] is n
            ):
                todo.append((user, True))
                continue
            return user
    return None


def _op_name(node: Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def _float_of(node: Node) -> torch.dtype | None:
    """The float dtype the int weight is dequantized to: the first cast to a float among what reads it."""
    todo, seen = list(node.users), set()
    while todo and len(seen) < 32:
        user = todo.pop(0)
        if user in seen:
            continue
        seen.add(user)
        dt = cast_dtype(user)
        if dt in FLOATS:
            return dt
        todo.extend(user.users)
    return None
