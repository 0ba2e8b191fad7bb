"""How fast the target device runs each op: the stages that time ops for the auto policy.

- ``measure_program``: per matmul / convolution / attention op (``precast.policy.auto.is_measured``), its
  latency in fp32 and in the low dtype with its real shapes (from the fake values of its inputs), and the
  casts the low choice forces at its boundaries. A dynamic dimension is measured at its example size and at
  the low end of its range (a decode step's single token under a dynamic sequence length), and the op is
  given the measurement least favourable to the low dtype: auto never lowers an op that is slower low at
  some size the program runs at. Cached per device, op, shapes and dtype in
  ``<cache dir>/latency.json`` (``$PRECAST_CACHE_DIR`` or the user cache dir), so a second conversion of the
  same shapes times nothing.
- ``time_programs``: the converted program against the fp32 one on the example inputs (interleaved repeats).

Input: a ``Program`` / ``ExportedProgram``, the low dtype, the device. Output: ``OpLatency`` per node name;
diagnostics.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast import cpu
from precast.dtypes import dtype_name
from precast.entries import read_entries, write_entries
from precast.errors import first_line
from precast.io import cache_root
from precast.ir.program import Program, private_state
from precast.ir.regions import innermost_region
from precast.policy.auto import OpLatency, is_measured

CACHE_FILE = "latency.json"
CACHE_VERSION = 1
BUDGET_S = 0.03  # at most this much time spent timing one variant of one op (after its first sample)
SAMPLE_S = 0.0005  # one sample: this long a loop of calls
SAMPLES = 30


# ---- the device ------------------------------------------------------------------------------------------
def device_key(device: str) -> str:
    """What a measurement depends on: the device model and capability, torch's version, the thread count."""
    if device == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    else:
        name = f"{cpu.model_name()} {cpu.capability()} threads={torch.get_num_threads()}"
    return f"{device} {name} torch={torch.__version__}"


def native_note(device: str, low: torch.dtype) -> str:
    """A phrase on whether the device has native instructions for ``low`` (for the report's "why")."""
    if device != "cpu":
        return ""
    native = cpu.has_native(low)
    if native is None:
        return ""
    cap = cpu.capability()
    if native:
        return f"this CPU ({cap}) has native {dtype_name(low)} instructions"
    return f"no native {dtype_name(low)} on this CPU ({cap}): it is emulated"


# ---- the cache -------------------------------------------------------------------------------------------
def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<precast cache dir>/latency.json`` (``precast.io.cache_root``: the AOTInductor cache's root)."""
    return cache_root(cache_dir) / CACHE_FILE


def _entry_ok(e: Any) -> bool:
    return isinstance(e, dict) and all(
        type(e.get(f)) in (int, float) for f in ("fp32", "low", "cast_in", "cast_out")
    )


def _load(path: Path) -> dict:
    """The cached entries; a malformed file or entry is a miss with a warning, never a crash (``entries.read_entries``)."""
    return read_entries(path, "latency cache", CACHE_VERSION, _entry_ok)


def _store(path: Path, new: dict) -> None:
    write_entries(path, "latency cache", CACHE_VERSION, _entry_ok, new)


# ---- measuring -------------------------------------------------------------------------------------------
@dataclass
class LatencyRun:
    """What ``measure_program`` did: ops timed now, read from the cache, and skipped (with why)."""

    timed: int = 0
    cached: int = 0
    skipped: dict[str, str] | None = None


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def low_ends(program: Program) -> dict[str, int]:
    """Each symbol of the program's dynamic dimensions at the low end of its range (at least 1): the exported
    range (``Dim(min=1)`` reads 1 there, where the tracer's own range starts at 2)."""
    out = {}
    for sym, vr in program.source.range_constraints.items():
        try:
            out[str(sym)] = max(1, int(vr.lower))
        except (TypeError, ValueError, OverflowError):  # an unbounded range: no low end to measure at
            continue
    return out


def _size(d: Any, at: dict[str, int] | None) -> int:
    """``d`` at its example size (``at`` None) or with its symbols at the sizes ``at`` gives (the low ends)."""
    if at is None or isinstance(d, int):
        return _hint(d)
    expr = getattr(getattr(d, "node", None), "expr", None)
    try:
        value = expr.subs({s: at[str(s)] for s in expr.free_symbols if str(s) in at})
        return max(1, int(value)) if value.is_number else _hint(d)
    except Exception:  # noqa: BLE001 - an expression we cannot evaluate: its example size
        return _hint(d)


def varies(v: Any, at: dict[str, int]) -> bool:
    """Whether some dimension in ``v`` (fake values) is another size with its symbols at ``at``."""
    return any(
        isinstance(d, torch.SymInt) and _size(d, at) != _hint(d)
        for t in pytree.tree_leaves(v)
        if isinstance(t, torch.Tensor)
        for d in t.shape
    )


def _signature(v: Any, at: dict[str, int] | None = None) -> Any:
    if isinstance(v, torch.Tensor):
        return ["T", [_size(d, at) for d in v.shape], [_size(s, at) for s in v.stride()], str(v.dtype)]
    if isinstance(v, (list, tuple)):
        return [_signature(x, at) for x in v]
    if isinstance(v, dict):
        return {k: _signature(x, at) for k, x in sorted(v.items())}
    if isinstance(v, torch.SymInt):
        return _size(v, at)
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return repr(v)


def _real(v: Any, gen: torch.Generator, at: dict[str, int] | None = None) -> Any:
    """A real tensor shaped like the fake value ``v`` (its strides when they are concrete and dense)."""
    if isinstance(v, (list, tuple)):
        return type(v)(_real(x, gen, at) for x in v)
    if isinstance(v, torch.SymInt):
        return _size(v, at)
    if not isinstance(v, torch.Tensor):
        return v
    shape = [_size(d, at) for d in v.shape]
    stride = [_size(s, at) for s in v.stride()]
    try:
        t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
    except RuntimeError:
        t = torch.empty(shape, dtype=v.dtype, device=v.device)
    if t.is_floating_point():
        t.copy_(torch.randn(shape, generator=gen).mul_(0.1))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.zero_()
    return t


def _time(fns: list[Callable[[], Any]], device: str, budget_s: float = BUDGET_S) -> list[float]:
    """Seconds per call of each of ``fns``, timed in turn: after a warm-up, up to ``SAMPLES`` interleaved
    samples of a few calls each (about ``SAMPLE_S``), within ``budget_s`` per function; the best sample of
    each. The best, not the median: on a shared machine, load only ever adds time (a stalled thread of the
    intra-op pool costs a whole scheduler slice), so the fastest sample is the one closest to the op's cost."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sizes = []
    for fn in fns:
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-7)
        sizes.append(max(1, min(1000, int(SAMPLE_S / one))))
    best = [float("inf")] * len(fns)
    spent = 0.0
    for _ in range(SAMPLES):
        for i, (fn, n) in enumerate(zip(fns, sizes, strict=True)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            took = time.perf_counter() - t0
            spent += took
            best[i] = min(best[i], took / n)
        if spent > budget_s * len(fns):
            break
    return best


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def measure_node(
    node: torch.fx.Node,
    constants: set[str],
    low: torch.dtype,
    device: str,
    at: dict[str, int] | None = None,
) -> OpLatency:
    """Time one op here: fp32, low (every fp32 tensor input already low), the casts of its activation inputs
    to low and of its outputs back to fp32. µs. ``at``: dynamic sizes at their example (None) or with their
    symbols at these sizes (``low_ends``)."""
    gen = torch.Generator().manual_seed(0)
    val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    args = _real(torch.fx.node.map_aggregate(node.args, val), gen, at)
    kwargs = _real(torch.fx.node.map_aggregate(node.kwargs, val), gen, at)
    to_low = lambda t: t.to(low) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
    largs, lkwargs = pytree.tree_map(to_low, (args, kwargs))
    acts = [
        v
        for a, v in zip(node.args, args, strict=False)
        if isinstance(a, torch.fx.Node) and a.name not in constants and isinstance(v, torch.Tensor)
    ]
    acts = [t for t in acts if t.dtype == torch.float32]
    target = node.target
    with torch.no_grad():
        outs = _tensors(target(*largs, **lkwargs))
        casts = [lambda t=t: t.to(low) for t in acts] + [lambda t=t: t.to(torch.float32) for t in outs]
        t32, tlow, *tc = _time(
            [lambda: target(*args, **kwargs), lambda: target(*largs, **lkwargs), *casts], device
        )
        cin, cout = sum(tc[: len(acts)]), sum(tc[len(acts) :])
    return OpLatency(t32 * 1e6, tlow * 1e6, cin * 1e6, cout * 1e6)


def measure_program(
    program: Program,
    low: torch.dtype,
    device: str,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[dict[str, OpLatency], LatencyRun]:
    """``OpLatency`` per measured node of ``program`` (same shapes: timed once), from the cache where it has
    them; new measurements are written back to the cache."""
    path = cache_path(cache_dir)
    entries = _load(path)
    dkey = device_key(device)
    constants = {n.name for n in program.input_spec if program.constant_target(n) is not None}
    timings = _Timings(low, device, entries, dkey, constants, low_ends(program))
    table: dict[str, OpLatency] = {}
    for node in program.graph.nodes:
        if not is_measured(node) or innermost_region(node, device) is not None:
            continue  # not a candidate, or the program's own autocast region decides it
        measured = _node_latencies(timings, node)
        if measured:  # the size least favourable to the low dtype decides
            table[node.name] = max(
                measured, key=lambda m: (m.low + m.cast_in + m.cast_out) / max(m.fp32, 1e-12)
            )
    if timings.new:
        _store(path, timings.new)
    return table, timings.run


@dataclass
class _Timings:
    """One ``measure_program`` run: what it reads (the cache's entries, the device's key, the program's
    constants and the low ends of its dynamic dimensions) and what it gathers (new entries, the cache's entries
    it used, what it did)."""

    low: torch.dtype
    device: str
    entries: dict
    dkey: str
    constants: set[str]
    lows: dict[str, int]
    new: dict[str, dict] = field(default_factory=dict)
    hits: set[str] = field(default_factory=set)
    run: LatencyRun = field(default_factory=lambda: LatencyRun(skipped={}))


def _node_latencies(timings: _Timings, node: torch.fx.Node) -> list[OpLatency]:
    """The op's latency at each size it runs at (its example sizes, and its dynamic dimensions' low ends): known
    already or timed now; none when it cannot be timed (said in the run's ``skipped``)."""
    val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    acts = [isinstance(a, torch.fx.Node) and a.name not in timings.constants for a in node.args]
    fake_args = torch.fx.node.map_aggregate(node.args, val)
    fake_kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    measured: list[OpLatency] = []
    for at in (None, timings.lows) if varies((fake_args, fake_kwargs), timings.lows) else (None,):
        sig = json.dumps(
            [
                timings.dkey,
                str(node.target),
                dtype_name(timings.low),
                _signature(fake_args, at),
                _signature(fake_kwargs, at),
                acts,
            ],
            default=repr,
        )
        key = hashlib.sha256(sig.encode()).hexdigest()[:32]
        known = _known(timings, key)
        if known is not None:
            measured.append(known)
            continue
        try:
            lat = measure_node(node, timings.constants, timings.low, timings.device, at=at)
        except Exception as exc:  # noqa: BLE001 - an op that cannot be timed stays fp32, and the report says so
            timings.run.skipped[node.name] = f"{type(exc).__name__}: {first_line(exc)[:160]}"
            return []
        timings.run.timed += 1
        measured.append(lat)
        d = asdict(lat)
        d.pop("cached")
        timings.new[key] = {**d, "op": str(node.target), "device": timings.dkey}
    return measured


def _known(timings: _Timings, key: str) -> OpLatency | None:
    """The latency under ``key`` this run timed already, else the cache's (each cache entry counted once)."""
    if key in timings.new:
        e = timings.new[key]
        return OpLatency(e["fp32"], e["low"], e["cast_in"], e["cast_out"])
    if key in timings.entries:
        e = timings.entries[key]
        timings.run.cached += key not in timings.hits
        timings.hits.add(key)
        return OpLatency(e["fp32"], e["low"], e["cast_in"], e["cast_out"], cached=True)
    return None


def time_programs(
    converted: ExportedProgram,
    reference: ExportedProgram,
    batch: tuple[tuple, dict],
    device: str,
    budget_s: float = 0.3,
) -> tuple[float, float]:
    """(converted, reference) milliseconds per call on ``batch``: interleaved samples, the best of each."""
    a, k = batch
    conv, ref = private_state(converted).module(), private_state(reference).module()
    with torch.no_grad():
        best_c, best_r = _time([lambda: conv(*a, **k), lambda: ref(*a, **k)], device, budget_s=budget_s)
    return best_c * 1e3, best_r * 1e3
