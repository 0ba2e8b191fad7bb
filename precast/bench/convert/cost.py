"""Conversion cost per node (``precast bench --convert``): wall/CPU time and peak
traced Python memory of every stage of the real ``precast.convert``.

How it is measured: ``precast.passes.runner.observe(clock)`` makes every stage of ``precast.convert`` run
inside ``clock(stage_name)``; ``StageClock`` times each (wall, this process's CPU time, and in a separate run
the tracemalloc peak). No copy of the pipeline, no monkeypatching: the stages and their names are whatever the
conversion reports (a stage nested in another is counted once, as its own, not again in its parent); ``verify``
is kept apart from the stages. The whole ``convert()`` call is timed too: the share of it the stages account
for is a column, so work outside any stage shows up.

Input: exported programs -- a synthetic chain of N ops in one bf16 region (``chain_program``; the linearity
check) and small-config transformers/timm models (``precast.bench.convert.models``,
skipped when their library is missing). Output: ``run_convert_bench`` -> one ``ConvertCost`` per (program,
policy); ``linearity`` -> CPU ms/node at the largest N over the smallest; ``profile_convert`` -> cProfile text.
"""

from __future__ import annotations

import contextlib
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from precast.bench.convert.programs import chain_program, model_programs, real_models
from precast.errors import PrecastError, first_line
from precast.progress import ProgressBar

CHAIN_SIZES = (250, 500, 1000, 2000, 4000, 8000)
CONVERT_POLICIES: tuple[str | None, ...] = (None, "torch")
VERIFY = "verify"  # the stage kept apart from the conversion's own stages


@dataclass
class ConvertCost:
    """Cost of converting one program with one policy: ms and peak traced Python memory (KiB) per stage."""

    model: str
    policy: str  # "none" | "torch"
    ops: int | None  # the chain's N (None for a real architecture)
    nodes: int = 0  # nodes of the graph the passes work on (after inlining the regions)
    stage_ms: dict[str, float] = field(default_factory=dict)  # in order of first appearance
    stage_cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU time of this process: robust to load
    stage_kib: dict[str, float] = field(default_factory=dict)  # peak Python memory added during the stage
    peak_kib: float | None = None  # peak Python memory of the whole conversion (verify excluded)
    verify_ms: float | None = None
    convert_ms: float | None = None  # the whole precast.convert() call (verify included when measured)
    note: str = ""
    error: str | None = None

    @property
    def total_ms(self) -> float:
        return sum(self.stage_ms.values())

    @property
    def ms_per_node(self) -> float:
        return self.total_ms / self.nodes if self.nodes else float("nan")

    @property
    def cpu_ms_per_node(self) -> float:
        return sum(self.stage_cpu_ms.values()) / self.nodes if self.nodes else float("nan")

    @property
    def in_stages(self) -> float | None:
        """Share of ``convert_ms`` spent inside observed stages (verify included)."""
        if not self.convert_ms:
            return None
        return (self.total_ms + (self.verify_ms or 0.0)) / self.convert_ms


class StageClock:
    """The stage observer: ``with clock: ...`` brackets a conversion (starts tracemalloc with ``memory``);
    ``with clock("stage"): ...`` adds the stage's own wall and CPU time (minus stages nested in it) and, with
    ``memory``, the peak traced memory above what was allocated when it started. ``failed_in``: the innermost
    stage an exception came out of first."""

    def __init__(self, memory: bool = False):
        self.memory = memory
        self.ms: dict[str, float] = {}
        self.cpu_ms: dict[str, float] = {}
        self.kib: dict[str, float] = {}
        self.peak = 0
        self.failed_in: str | None = None
        self._base = 0
        self._started = False
        self._stack: list[dict[str, float]] = []

    def __enter__(self) -> StageClock:
        if self.memory:
            self._started = not tracemalloc.is_tracing()
            if self._started:
                tracemalloc.start()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._started:
            tracemalloc.stop()
            self._started = False

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        frame = {"wall": 0.0, "cpu": 0.0, "peak": 0.0}  # nested stages' wall/cpu; peak before a reset
        parent = self._stack[-1] if self._stack else None
        before = 0
        if self.memory:
            current, peak = tracemalloc.get_traced_memory()
            if parent is not None:
                parent["peak"] = max(parent["peak"], peak)
            tracemalloc.reset_peak()
            before = current
        self._stack.append(frame)
        self.ms.setdefault(stage, 0.0)  # order of first appearance: when a stage starts
        self.cpu_ms.setdefault(stage, 0.0)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        except BaseException:
            self.failed_in = self.failed_in or stage
            raise
        finally:
            wall, used = (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3
            self._stack.pop()
            self.ms[stage] = self.ms.get(stage, 0.0) + wall - frame["wall"]
            self.cpu_ms[stage] = self.cpu_ms.get(stage, 0.0) + used - frame["cpu"]
            if parent is not None:
                parent["wall"] += wall
                parent["cpu"] += used
            if self.memory:
                peak = max(tracemalloc.get_traced_memory()[1], frame["peak"])
                self.kib[stage] = max(self.kib.get(stage, 0.0), (peak - before) / 1024)
                self.peak = max(self.peak, peak - self._base)
                if parent is not None:
                    parent["peak"] = max(parent["peak"], peak)


# ---- measuring --------------------------------------------------------------------------------------------
def graph_nodes(ep: Any) -> int:
    """Nodes of the graph the passes work on: the program's, its autocast regions inlined."""
    from precast.ir.program import Program
    from precast.passes.regions import inline_regions

    program = Program(ep)
    inline_regions(program.gm)
    return len(program.graph.nodes)


def observed_convert(
    ep: Any, policy: str | None, *, verify: bool, memory: bool
) -> tuple[StageClock, float, str]:
    """One ``precast.convert(ep, policy=policy, verify=verify)`` observed stage by stage: the clock, the wall ms
    of the whole call, and a note (a verification failure leaves the stage times standing)."""
    import precast
    from precast.passes.runner import observe

    _cold_start(ep)
    clock, note = StageClock(memory), ""
    start = time.perf_counter()
    with clock, observe(clock):
        try:
            precast.convert(ep, policy=policy, verify=verify)
        except Exception as exc:
            if clock.failed_in != VERIFY:
                raise
            note = f"verify failed: {type(exc).__name__}: {first_line(exc)[:100]}"
    wall = (time.perf_counter() - start) * 1e3
    if not clock.ms:
        raise PrecastError(
            "bench --convert: precast.convert reported no stages to precast.passes.runner.observe; "
            "nothing to measure"
        )
    return clock, wall, note


def measure_convert_cost(
    ep: Any,
    model: str,
    policy: str | None,
    ops: int | None = None,
    *,
    memory: bool = True,
    verify: bool = True,
) -> ConvertCost:
    """One row: stage times (and verify time) from one observed conversion; with ``memory``, peak memory per
    stage from a second one under tracemalloc (which slows every stage: the times come from the first)."""
    cost = ConvertCost(model=model, policy=str(policy).lower(), ops=ops, nodes=graph_nodes(ep))
    clock, cost.convert_ms, cost.note = observed_convert(ep, policy, verify=verify, memory=False)
    cost.convert_ms = round(cost.convert_ms, 3)
    cost.stage_ms = {k: round(v, 3) for k, v in clock.ms.items() if k != VERIFY}
    cost.stage_cpu_ms = {k: round(v, 3) for k, v in clock.cpu_ms.items() if k != VERIFY}
    if VERIFY in clock.ms and not cost.note:
        cost.verify_ms = round(clock.ms[VERIFY], 3)
    if memory:
        mem, _, _ = observed_convert(ep, policy, verify=False, memory=True)
        cost.stage_kib = {k: round(v, 1) for k, v in mem.kib.items() if k != VERIFY}
        cost.peak_kib = round(mem.peak / 1024, 1)
    return cost


def _cold_start(ep: Any) -> None:
    """Every run starts as a first conversion in a fresh process would: FakeTensor's dispatch caches (one per
    class, one per ShapeEnv, which the input program shares with every conversion of it) emptied, garbage
    collected. Without this a second run of the same program reuses the first's cache entries (measured: up to
    4x faster), and the order of the runs would decide the numbers."""
    import gc

    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    mode = detect_fake_mode([n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"])
    cache = getattr(getattr(mode, "shape_env", None), "fake_tensor_cache", None)
    if isinstance(cache, dict):
        cache.clear()
    gc.collect()


def _failed(model: str, policy: str | None, ops: int | None, exc: Exception) -> ConvertCost:
    return ConvertCost(
        model=model,
        policy=str(policy).lower(),
        ops=ops,
        error=f"{type(exc).__name__}: {first_line(exc)[:160]}",
    )


def run_convert_bench(
    sizes: tuple[int, ...] = CHAIN_SIZES,
    models: tuple[str, ...] | None = None,
    policies: tuple[str | None, ...] = CONVERT_POLICIES,
    *,
    memory: bool = True,
    verify: bool = True,
    dynamic: bool = True,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> list[ConvertCost]:
    """Conversion cost over the synthetic chain at each N in ``sizes`` and over the real ``models`` (default:
    all of ``precast.bench.convert.models``) whose library is installed (a missing one is skipped with its reason
    passed to ``log``)."""
    available = real_models()
    models = tuple(available) if models is None else models
    unknown = [m for m in models if m not in available]
    if unknown:
        raise PrecastError(
            f"bench --convert: unknown model(s) {unknown}; choose from chain, {', '.join(available)} (the "
            "synthetic chain is "
            "measured at the sizes given with --sizes)"
        )
    log = log or (lambda text: print(text, file=sys.stderr))
    results: list[ConvertCost] = []
    with ProgressBar("convert cost", (len(sizes) + len(models)) * len(policies), progress) as bar:
        for n in sizes:
            bar.describe(f"chain N={n}: export")
            ep = chain_program(n, dynamic=dynamic)
            for policy in policies:
                bar.describe(f"chain N={n}: policy {policy}")
                try:
                    results.append(measure_convert_cost(ep, "chain", policy, n, memory=memory, verify=verify))
                except Exception as exc:  # noqa: BLE001 - one failing row must not sink the table
                    results.append(_failed("chain", policy, n, exc))
                bar.advance()
        for name in models:
            bar.describe(f"{name}: export")
            library, builder = available[name]
            try:
                programs, note = model_programs(library, builder, policies)
            except ImportError as exc:
                log(f"skipped {name}: {library} is not installed ({exc})")
                continue
            except Exception as exc:  # noqa: BLE001
                results.extend(_failed(name, p, None, exc) for p in policies)
                continue
            for policy, ep in programs.items():
                bar.describe(f"{name}: policy {policy}")
                try:
                    cost = measure_convert_cost(ep, name, policy, memory=memory, verify=verify)
                    cost.note = "; ".join(x for x in (note, cost.note) if x)
                except Exception as exc:  # noqa: BLE001
                    cost = _failed(name, policy, None, exc)
                results.append(cost)
                bar.advance()
    return results


def linearity(results: list[ConvertCost]) -> dict[str, float]:
    """Per policy: CPU ms/node at the chain's largest N over that at its smallest (1.0 = linear in N; CPU time,
    not wall time, so that other processes on the machine do not decide it)."""
    out = {}
    for policy in dict.fromkeys(r.policy for r in results):
        chain = sorted(
            (r for r in results if r.model == "chain" and r.policy == policy and not r.error),
            key=lambda r: r.ops or 0,
        )
        if len(chain) >= 2 and chain[0].cpu_ms_per_node > 0:
            out[f"{policy}: N={chain[-1].ops} vs N={chain[0].ops}"] = round(
                chain[-1].cpu_ms_per_node / chain[0].cpu_ms_per_node, 2
            )
    return out


def profile_convert(ep: Any, policy: str | None, top: int = 25) -> str:
    """cProfile of ``precast.convert(ep, policy=policy, verify=False)``: the top functions by cumulative time
    (precast's own) and by own time (everything), as text. Profiling slows fake-tensor code ~2-3x: read shares,
    not absolute times."""
    import cProfile
    import io
    import pstats

    import precast

    prof = cProfile.Profile()
    prof.enable()
    precast.convert(ep, policy=policy, verify=False)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(r"precast", top)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()
