"""The precision a program's 16-bit attention runs in under ``precast.compile`` on a CPU (every ``mode``).

An exported ``scaled_dot_product_attention`` runs ATen's CPU flash attention, in eager and inside an AOTInductor
package alike (Inductor keeps it as a call into ATen). With bf16 / fp16 inputs that kernel multiplies each block
through a library GEMM call, packed into AMX tiles where the CPU has them; where it has none, a decode step's one
query pays the calls' overhead per head and block. Measured on a Zen 4 (AVX512-BF16, no AMX), 16 heads x 512
cached keys x 64, one query, 1 thread: bf16 **0.90 ms**, fp32 **0.12 ms**; at 256 queries they tie (7.9 / 7.7 ms).
In a 0.246 B decoder that was 16.6 ms of a 31 ms int8 step (torch's profiler, ``cpp.enable_kernel_profile``).

So on a CPU, each distinct 16-bit attention (its dtype, heads, head sizes, key length, mask kind) is timed in
its own dtype and in fp32 at the sizes a decode step and a prompt give it (``points``): one query and a prompt's
worth against a fixed-size cache; a 128-token sequence where queries and keys are one length. It runs in fp32
when that is faster overall (the geometric mean of the fp32 / 16-bit time ratios under ``1 - TIE``) and slower at
no size by more than ``SLOWER`` (a prompt's attention runs once per call, a decode step's once per token: on torch
2.15 the same attention measured 6.3x faster in fp32 at one query and 1.12x slower at 256, and fp32 is the right
call for any generation longer than one token): on precast.compile's private copy of the program, its query, key
and value (and
a float mask, exactly) are cast to fp32 and its result rounded once back to the program's dtype. Keys and values
transformers' grouped-query ``repeat_kv`` copied per query head are cast unrepeated instead and the call told
``enable_gqa`` (``_inputs_in_fp32``: bitwise the same, a quarter of the copy at 4 query heads per key head). The
result is at least as accurate as the 16-bit kernel's, which also accumulates in fp32, and
differs from it within the 16-bit rounding of the output.

The times are cached in ``<cache dir>/attention.json`` (JSON, written atomically under a file lock, never
unpickled), keyed by the CPU, torch's capability level, the thread count, torch's and precast's versions and the
attention's sizes; a choice timed under load is timed again once the machine is quiet, as the forms are
(``forms.quiet_now``). ``$PRECAST_FORM`` set (the test suite's ``flags``, or a form's name) takes the rule of the
CPU's reported capabilities instead: fp32 unless the CPU has AMX for the dtype (``amx_bf16`` / ``amx_fp16``,
which ATen's kernel packs into). The decision is in the compile's cache key and in ``CompiledModel.form``
(``"attention"``: each attention's times and dtype; its ``why``).

Input: an ExportedProgram, the device, thread count and cache folder. Output: an ``AttentionPlan``;
``apply_attention`` rewrites a program by it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from precast.entries import read_entries, write_entries
from precast.errors import PrecastError

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
LOW = (torch.bfloat16, torch.float16)
ATTENTION_FILE = "attention.json"
ATTENTION_VERSION = 1
# the rewrite the package compiles, in its cache key (2: grouped keys and values cast unrepeated, enable_gqa)
REWRITE_VERSION = 2
TIE = 0.05  # fp32 must be this much faster (geometric mean over the points) to be taken
SLOWER = 0.5  # and at no point this much slower
LONG = 256  # a prompt's worth of queries against a fixed-size cache (capped at the cache's length)
SEQ = 128  # queries = keys: the length timed when both are one dynamic size
CACHED = 512  # the keys timed for a cache of dynamic length
AMX = {torch.bfloat16: ("amx_tile", "amx_bf16"), torch.float16: ("amx_tile", "amx_fp16")}
Measure = Callable[["Attention", tuple[tuple[int, int], ...], int], Mapping[str, Mapping[str, float]]]


@dataclass(frozen=True)
class Attention:
    """One distinct attention of a program: what its time depends on. ``q_len`` / ``kv_len``: an int where the
    program fixes it (a static KV cache's length), else None; ``same_len``: queries and keys one dynamic size."""

    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    q_len: int | None
    kv_len: int | None
    same_len: bool
    mask: str  # "none", "bool" or the float mask's dtype
    causal: bool

    def label(self) -> str:
        kv = self.kv_len if self.kv_len is not None else "dynamic"
        return (
            f"{str(self.dtype).removeprefix('torch.')} {self.heads}x{self.head_dim} heads "
            f"({self.kv_heads} kv), {kv} keys, mask {self.mask}{', causal' if self.causal else ''}"
        )

    def to_key(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype),
            "batch": self.batch,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "v_dim": self.v_dim,
            "q_len": self.q_len,
            "kv_len": self.kv_len,
            "same_len": self.same_len,
            "mask": self.mask,
            "causal": self.causal,
        }


@dataclass(frozen=True)
class AttentionPlan:
    """Which of the program's attentions run in fp32 (by ``Attention``), and why, with each one's record."""

    fp32: frozenset[Attention] = frozenset()
    records: tuple[dict[str, Any], ...] = ()
    why: str = ""

    def key(self) -> dict[str, Any]:
        """What the plan adds to the compile's cache key (nothing when no attention changes precision)."""
        if not self.fp32:
            return {}
        return {
            "precast.attention": {
                "version": ATTENTION_VERSION,
                "rewrite": REWRITE_VERSION,
                "fp32": sorted(json.dumps(a.to_key(), sort_keys=True) for a in self.fp32),
            }
        }

    def to_dict(self) -> list[dict[str, Any]]:
        return list(self.records)


# ---- finding the attentions ----------------------------------------------------------------------------------
def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _int(size: Any) -> int | None:
    return int(size) if isinstance(size, int) else None


def _call_args(node: Node) -> tuple[Node, Node, Node, Any, bool]:
    """``(query, key, value, attn_mask, is_causal)`` of an SDPA or CPU flash attention call."""
    a, kw = node.args, node.kwargs
    if node.target is SDPA:
        mask = a[3] if len(a) > 3 else kw.get("attn_mask")
        causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
    else:
        mask = kw.get("attn_mask")
        causal = a[4] if len(a) > 4 else kw.get("is_causal", False)
    return a[0], a[1], a[2], mask, bool(causal)


def attention_of(node: Node) -> Attention | None:
    """The ``Attention`` an SDPA / CPU flash attention call computes in a 16-bit dtype (4-d inputs), else None."""
    if node.op != "call_function" or node.target not in (SDPA, FLASH):
        return None
    q, k, v, mask, causal = _call_args(node)
    qv, kv, vv = _val(q), _val(k), _val(v)
    if qv is None or kv is None or vv is None or qv.dim() != 4 or qv.dtype not in LOW:
        return None
    if not (kv.dtype == vv.dtype == qv.dtype) or kv.dim() != 4 or vv.dim() != 4:
        return None
    mv = _val(mask)
    if mask is not None and mv is None:
        return None
    kind = (
        "none" if mv is None else "bool" if mv.dtype == torch.bool else str(mv.dtype).removeprefix("torch.")
    )
    if mv is not None and mv.is_floating_point() and mv.dtype not in (qv.dtype, torch.float32):
        return None
    batch, heads, head_dim = _int(qv.shape[0]) or 1, _int(qv.shape[1]), _int(qv.shape[3])
    kv_heads, v_dim = _int(kv.shape[1]), _int(vv.shape[3])
    if None in (heads, head_dim, kv_heads, v_dim):
        return None
    return Attention(
        qv.dtype,
        batch,
        heads,
        kv_heads,
        head_dim,
        v_dim,
        _int(qv.shape[2]),
        _int(kv.shape[2]),
        str(qv.shape[2]) == str(kv.shape[2]),
        kind,
        causal,
    )


def attentions(ep: ExportedProgram) -> dict[Attention, list[str]]:
    """The program's 16-bit attentions, each with the names of the calls computing it."""
    out: dict[Attention, list[str]] = {}
    for node in ep.graph.nodes:
        found = attention_of(node)
        if found is not None:
            out.setdefault(found, []).append(node.name)
    return out


def points(a: Attention) -> tuple[tuple[int, int], ...]:
    """The (queries, keys) sizes ``a`` is timed at: what a decode step and a prompt give it."""
    if a.q_len is not None:
        return ((a.q_len, a.kv_len if a.kv_len is not None else max(SEQ, a.q_len)),)
    if a.kv_len is not None:  # a fixed-size cache: one new token, and a prompt
        return ((1, a.kv_len), (min(LONG, a.kv_len), a.kv_len))
    if a.same_len:  # queries attend to themselves (an encoder, a prompt without a cache)
        return ((SEQ, SEQ),)
    return ((1, CACHED), (LONG, CACHED))  # a growing cache: a decode step, and a prompt


# ---- the plan --------------------------------------------------------------------------------------------------
def plan_attention(
    ep: ExportedProgram,
    device: str,
    threads: int,
    cache_dir: str | os.PathLike | None = None,
    *,
    caps: Mapping[str, Any] | None = None,
    measure: Measure | None = None,
) -> AttentionPlan:
    """Which 16-bit attentions of ``ep`` run in fp32 on this CPU at ``threads``: measured (cached), or by the CPU's
    reported capabilities when ``$PRECAST_FORM`` is set. ``measure`` (tests) times an attention at its points."""
    from precast.backends.aoti.forms import FORM_ENV

    found = attentions(ep)
    if device != "cpu" or not found:
        return AttentionPlan()
    by_flags = bool(os.environ.get(FORM_ENV, "").strip())
    fp32: set[Attention] = set()
    records: list[dict[str, Any]] = []
    for a, names in found.items():
        if by_flags:
            record = _by_flags(a, cpu_caps() if caps is None else caps)
        else:
            record = _measured(a, threads, cache_dir, measure)
        record = {"attention": a.label(), "calls": len(names), **record}
        records.append(record)
        if record["dtype"] == "float32":
            fp32.add(a)
    why = "; ".join(f"attention {r['attention']} x{r['calls']}: {r['dtype']} ({r['why']})" for r in records)
    return AttentionPlan(frozenset(fp32), tuple(records), why)


def cpu_caps() -> Mapping[str, Any]:
    from precast.cpu import capabilities

    return capabilities()


def _by_flags(a: Attention, caps: Mapping[str, Any]) -> dict[str, Any]:
    needs = AMX[a.dtype]
    name = str(a.dtype).removeprefix("torch.")
    if all(caps.get(c) for c in needs):
        return {
            "dtype": name,
            "why": f"the CPU reports {', '.join(needs)}: ATen's kernel packs {name} into tiles",
        }
    return {
        "dtype": "float32",
        "why": f"the CPU lacks {', '.join(c for c in needs if not caps.get(c))}: ATen's {name} kernel is "
        "slower than fp32 there (CPU-flags rule, $PRECAST_FORM set)",
    }


def decide(times_ms: Mapping[str, Mapping[str, float]], low: str) -> tuple[str, str]:
    """``(dtype, why)`` from each point's times in ``low`` and in fp32."""
    ratios = {p: t["float32"] / t[low] for p, t in times_ms.items() if t.get(low) and t.get("float32")}
    if not ratios:
        return low, "no time measured"
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    shown = ", ".join(f"{p}: {low} {t[low]:.3g} ms, fp32 {t['float32']:.3g} ms" for p, t in times_ms.items())
    if mean < 1 - TIE and max(ratios.values()) <= 1 + SLOWER:
        return "float32", f"fp32 measured {1 / mean:.2f}x faster: {shown}"
    return low, f"{low} kept: fp32 measured {1 / mean:.2f}x its speed: {shown}"


def _measured(
    a: Attention, threads: int, cache_dir: str | os.PathLike | None, measure: Measure | None
) -> dict[str, Any]:
    from precast.backends.aoti.forms import quiet_now
    from precast.io import cache_root, file_lock, private_dir

    path = cache_root(cache_dir) / ATTENTION_FILE
    pts = points(a)
    key = _key(a, pts, threads)
    entry = read_entries(path, "attention cache", ATTENTION_VERSION, _entry_ok).get(key)
    if entry is None or (entry["under_load"] and quiet_now(threads)):
        stale = entry
        locks = private_dir(private_dir(path.parent) / "locks")
        with file_lock(locks / f"attention-{key}.lock", "measuring the attention's precision"):
            entry = read_entries(path, "attention cache", ATTENTION_VERSION, _entry_ok).get(key)
            if entry is None or entry == stale:
                entry = _measure_entry(a, pts, threads, measure)
                write_entries(path, "attention cache", ATTENTION_VERSION, _entry_ok, {key: entry})
    low = str(a.dtype).removeprefix("torch.")
    dtype, why = decide(entry["times_ms"], low)
    if entry["under_load"]:
        why += " (measured under load; timed again when the machine is quiet)"
    return {"dtype": dtype, "why": why, "times_ms": entry["times_ms"], "threads": threads}


def _key(a: Attention, pts: tuple[tuple[int, int], ...], threads: int) -> str:
    from precast.backends.aoti.forms import machine_key

    return machine_key(threads, {"attention": a.to_key(), "points": [list(p) for p in pts]})


def _entry_ok(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("times_ms"), dict)
        and all(
            isinstance(p, str)
            and isinstance(t, dict)
            and all(isinstance(d, str) and type(ms) in (int, float) for d, ms in t.items())
            for p, t in e["times_ms"].items()
        )
        and type(e.get("threads")) is int
        and isinstance(e.get("under_load"), bool)
    )


def _measure_entry(
    a: Attention, pts: tuple[tuple[int, int], ...], threads: int, measure: Measure | None
) -> dict[str, Any]:
    from precast.backends.aoti.forms import timed_here

    times, machine = timed_here(lambda: (measure or time_attention)(a, pts, threads), threads)
    return {
        "times_ms": {p: {d: round(float(ms), 4) for d, ms in t.items()} for p, t in times.items()},
        **machine,
    }


def time_attention(
    a: Attention, pts: tuple[tuple[int, int], ...], threads: int
) -> dict[str, dict[str, float]]:
    """Milliseconds per call of ATen's attention on ``a``'s sizes at each point, in ``a``'s dtype and in fp32 (on
    fp32 inputs: the casts run fused into neighbouring copies once compiled), timed interleaved at ``threads``."""
    from precast.backends.aoti.form_timing import time_interleaved
    from precast.runtime.threads import running_at

    g = torch.Generator().manual_seed(0)
    runs: dict[str, Callable[[], Any]] = {}
    for q_len, kv_len in pts:
        q = torch.randn(a.batch, a.heads, q_len, a.head_dim, generator=g)
        k = torch.randn(a.batch, a.kv_heads, kv_len, a.head_dim, generator=g)
        v = torch.randn(a.batch, a.kv_heads, kv_len, a.v_dim, generator=g)
        mask = _mask(a, q_len, kv_len)
        gqa = a.kv_heads != a.heads
        for dtype in (a.dtype, torch.float32):
            args = [t.to(dtype) for t in (q, k, v)]
            m = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
            label = f"q={q_len} kv={kv_len}|{str(dtype).removeprefix('torch.')}"
            runs[label] = lambda args=args, m=m, gqa=gqa: torch.nn.functional.scaled_dot_product_attention(
                *args, attn_mask=m, is_causal=a.causal and m is None, enable_gqa=gqa
            )
    with torch.no_grad(), running_at(threads):
        best = time_interleaved(runs, rounds=8)
    out: dict[str, dict[str, float]] = {}
    for label, seconds in best.items():
        point, dtype = label.split("|")
        out.setdefault(point, {})[dtype] = seconds * 1e3
    return out


def _mask(a: Attention, q_len: int, kv_len: int) -> torch.Tensor | None:
    if a.mask == "none":
        return None
    keep = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    if a.mask == "bool":
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


# ---- the rewrite -----------------------------------------------------------------------------------------------
@dataclass
class _Calls:
    graph: torch.fx.Graph
    fake_mode: Any
    made: list[Node] = field(default_factory=list)

    def call(self, op: Any, *args: Any, meta: Mapping[str, Any], **kwargs: Any) -> Node:
        node = self.graph.call_function(op, args, kwargs)
        vals = torch.utils._pytree.tree_map(
            lambda x: x.meta["val"] if isinstance(x, Node) else x, (args, kwargs)
        )
        with self.fake_mode:
            node.meta["val"] = op(*vals[0], **vals[1])
        node.meta.update({k: v for k, v in meta.items() if k not in ("val", "tensor_meta")})
        return node


def apply_attention(ep: ExportedProgram, plan: AttentionPlan) -> ExportedProgram:
    """A copy of ``ep`` (the caller's untouched) whose attentions in ``plan.fp32`` compute in fp32 on casts of
    their inputs, each result rounded once back to its dtype; ``ep`` itself when there are none."""
    if not plan.fp32:
        return ep
    from torch._guards import detect_fake_mode

    from precast.ir.program import Program

    prog = Program(ep)
    graph = prog.graph
    calls = _Calls(graph, detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]))
    changed = 0
    for node in list(graph.nodes):
        a = attention_of(node)
        if a is None or a not in plan.fp32:
            continue
        with graph.inserting_before(node):
            _in_fp32(calls, node, a.dtype)
        changed += 1
    if not changed:
        raise PrecastError(
            "precast.compile (attention): the plan's attentions are not in the program it compiles"
        )
    graph.eliminate_dead_code()
    return prog.to_exported_program()


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _grouped_source(node: Any, heads: int) -> Node | None:
    """The keys (or values) ``node`` repeats for grouped-query attention, as transformers' ``repeat_kv`` does
    (``x[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)``, a clone allowed before the reshape):
    ``x`` when ``node`` is that copy of it with ``heads`` heads, else None."""
    src = node.args[0] if isinstance(node, Node) and node.target in _RESHAPES else None
    if isinstance(src, Node) and src.target is aten.clone.default:
        src = src.args[0]
    up = src.args[0] if isinstance(src, Node) and src.target is aten.expand.default else None
    if not isinstance(up, Node) or up.target is not aten.unsqueeze.default or up.args[1] != 2:
        return None
    xv, ev, out = _val(up.args[0]), _val(src), _val(node)
    if xv is None or ev is None or out is None or xv.dim() != 4 or out.dtype != xv.dtype:
        return None
    b, kv, s, d = (str(n) for n in xv.shape)
    rep = _int(ev.shape[2])
    expanded = [str(n) for n in ev.shape] == [b, kv, str(rep), s, d]  # along the new dimension only
    if rep is None or rep == 1 or not expanded or [str(n) for n in out.shape] != [b, str(heads), s, d]:
        return None
    groups = _int(xv.shape[1])
    return up.args[0] if groups is not None and groups * rep == heads else None


def _inputs_in_fp32(calls: _Calls, node: Node, q: Node, k: Node, v: Node) -> tuple[list[Node], bool]:
    """q, k, v cast to fp32. Keys and values repeated for grouped-query attention are cast unrepeated instead, at
    the point the repeat copied them (the same version of the cache), and the call told ``enable_gqa``: ATen's CPU
    kernel reads each query head's group in place, the same arithmetic (bitwise), without the 4x copy (a decode
    step's cast of the repeated cache measured 0.125 ms a layer, 16 heads x 512 x 64, 1 thread)."""
    meta = node.meta
    heads = _int(_val(q).shape[1])
    sources = [_grouped_source(t, heads) if heads else None for t in (k, v)]
    grouped = None not in sources and _int(_val(sources[0]).shape[1]) == _int(_val(sources[1]).shape[1])
    up = [calls.call(aten._to_copy.default, q, dtype=torch.float32, meta=meta)]
    for t, src in zip((k, v), sources, strict=True):
        if grouped:
            with calls.graph.inserting_after(t):
                up.append(calls.call(aten._to_copy.default, src, dtype=torch.float32, meta=meta))
        else:
            up.append(calls.call(aten._to_copy.default, t, dtype=torch.float32, meta=meta))
    return up, grouped


def _in_fp32(calls: _Calls, node: Node, dtype: torch.dtype) -> None:
    q, k, v, mask, _ = _call_args(node)
    meta = node.meta
    up, grouped = _inputs_in_fp32(calls, node, q, k, v)
    mv = _val(mask)
    if mv is not None and mv.is_floating_point() and mv.dtype != torch.float32:
        mask = calls.call(aten._to_copy.default, mask, dtype=torch.float32, meta=meta)
    args, kwargs = list(node.args), dict(node.kwargs)
    args[:3] = up
    if node.target is SDPA and len(args) > 3:
        args[3] = mask
    elif "attn_mask" in kwargs:
        kwargs["attn_mask"] = mask
    if grouped and node.target is SDPA:  # the CPU flash op takes fewer key heads as they are
        kwargs["enable_gqa"] = True
    out = calls.call(node.target, *args, meta=meta, **kwargs)
    if node.target is SDPA:
        down = calls.call(aten._to_copy.default, out, dtype=dtype, meta=meta)
        node.replace_all_uses_with(down)
        calls.graph.erase_node(node)
        return
    # the CPU flash op returns (output, logsumexp): the output rounded back; logsumexp is fp32 in both
    import operator

    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise PrecastError(
                f"precast.compile (attention): {node.name}'s result is read by {user.name} other than by index"
            )
        with calls.graph.inserting_before(user):
            part = calls.call(operator.getitem, out, user.args[1], meta=user.meta)
            if user.args[1] == 0:
                part = calls.call(aten._to_copy.default, part, dtype=dtype, meta=user.meta)
        user.replace_all_uses_with(part)
        calls.graph.erase_node(user)
    calls.graph.erase_node(node)
