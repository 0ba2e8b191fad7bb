"""Conversion cost per GB of weights (``precast bench --convert --llama 0.2b 1.1b``): wall and CPU seconds per
GB of input weights and peak resident memory above the input, stage by stage, for Llama-shaped models of real
size, one fresh process per (size, policy).

How it is measured: the child builds a transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` with seeded
random weights (nothing downloaded), exports its plain forward (``input_ids`` batch 1 x 16 tokens, no cache,
static shapes; policy None gets the forward inside one bf16 autocast region), frees the module, then runs
``precast.convert(ep, policy=..., dtype=bf16)`` with default options (``verify=True``) under
``precast.passes.runner.observe``: every stage timed (wall, CPU) and its peak RSS sampled (``RssClock``: a
thread reading /proc/self/statm every 2 ms). Peak extra = the highest RSS during convert minus the RSS just
before it; divided by the input weight bytes (the program's parameters, buffers and constants, each storage
once). A fresh process per row: the allocator's free lists of one conversion never lower the next one's peak.

Input: sizes (``LLAMA_SHAPES`` keys), policies. Output: ``GbCost`` rows (JSON from the child).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from precast.bench.convert.cost import VERIFY, StageClock
from precast.errors import PrecastError, first_line

# hidden, layers, heads, kv heads, intermediate, vocab
LLAMA_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128, 256),  # for tests
    "0.2b": (1024, 16, 16, 4, 2816, 32000),  # the LLM decode benchmark's 0.2 B shape
    "1.1b": (2048, 22, 32, 4, 5632, 32000),  # TinyLlama-1.1B's shape
}
BIGMEM_LOCK = "/tmp/precast-bigmem.lock"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class RssClock(StageClock):
    """A ``StageClock`` that also records, per stage, the peak RSS above the RSS when the conversion started
    (``rss_peak``, bytes), from a thread sampling it every ``interval`` seconds; ``peak_extra`` is the whole
    conversion's."""

    def __init__(self, interval: float = 0.002):
        super().__init__(memory=False)
        self.interval = interval
        self.rss_peak: dict[str, int] = {}
        self.peak_extra = 0
        self.base = 0
        self._high = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._high = max(self._high, rss_bytes())

    def __enter__(self) -> RssClock:
        gc.collect()
        self.base = self._high = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_extra = max(self.peak_extra, self._high - self.base)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        outer, self._high = self._high, rss_bytes()  # the stage's own peak, from where it starts
        try:
            with super().__call__(stage):
                yield
        finally:
            self._high = max(self._high, rss_bytes())
            self.rss_peak[stage] = max(self.rss_peak.get(stage, 0), self._high - self.base)
            self.peak_extra = max(self.peak_extra, self._high - self.base)
            self._high = max(self._high, outer)


@dataclass
class GbCost:
    """One (size, policy) row: seconds per GB of input weights and peak RSS above them, per stage too."""

    size: str
    policy: str
    params: int = 0
    weight_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_extra: int = 0  # bytes above the RSS before convert
    stage_s: dict[str, float] = field(default_factory=dict)
    stage_cpu_s: dict[str, float] = field(default_factory=dict)
    stage_peak: dict[str, int] = field(default_factory=dict)  # bytes above the RSS before convert
    export_s: float = 0.0
    error: str | None = None

    @property
    def gb(self) -> float:
        return self.weight_bytes / 1e9

    @property
    def peak_ratio(self) -> float:
        return self.peak_extra / self.weight_bytes if self.weight_bytes else float("nan")


def llama_program(size: str, region: bool, seed: int = 0) -> tuple[Any, int]:
    """(exported program, parameter count) of a Llama of ``LLAMA_SHAPES[size]`` with seeded random weights."""
    import transformers as tf

    hidden, layers, heads, kv, inter, vocab = LLAMA_SHAPES[size]
    cfg = tf.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=2048,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    params = sum(p.numel() for p in model.parameters())

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if not region:
                return self.model(input_ids=ids, use_cache=False).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(input_ids=ids, use_cache=False).logits

    ids = torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ep = torch.export.export(Logits().eval(), (ids,), strict=False)
    return ep, params


def weight_bytes(ep: Any) -> int:
    """Bytes of the program's parameters, buffers and constants, each storage counted once."""
    seen: dict[int, int] = {}
    for t in [*ep.state_dict.values(), *ep.constants.values()]:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def measure_gb(size: str, policy: str | None) -> GbCost:
    """In this process: export the model, then one observed ``precast.convert(ep, policy, dtype=bf16)``."""
    import precast
    from precast.passes.runner import observe

    row = GbCost(size=size, policy=str(policy).lower())
    start = time.perf_counter()
    ep, row.params = llama_program(size, region=policy is None)
    row.export_s = round(time.perf_counter() - start, 2)
    row.weight_bytes = weight_bytes(ep)
    clock = RssClock()
    wall, cpu = time.perf_counter(), time.process_time()
    with clock, observe(clock):
        result = precast.convert(ep, policy=policy, dtype=torch.bfloat16)
    row.wall_s = round(time.perf_counter() - wall, 3)
    row.cpu_s = round(time.process_time() - cpu, 3)
    del result
    row.peak_extra = clock.peak_extra
    row.stage_s = {k: round(v / 1e3, 3) for k, v in clock.ms.items()}
    row.stage_cpu_s = {k: round(v / 1e3, 3) for k, v in clock.cpu_ms.items()}
    row.stage_peak = dict(clock.rss_peak)
    return row


def run_gb_bench(sizes: tuple[str, ...], policies: tuple[str | None, ...]) -> list[GbCost]:
    """One fresh child process per (size, policy); a child whose model is large runs under ``flock
    BIGMEM_LOCK`` (when flock exists) so that two big jobs never share the machine's memory."""
    unknown = [s for s in sizes if s not in LLAMA_SHAPES]
    if unknown:
        raise PrecastError(f"bench --convert --llama {unknown}: choose from {', '.join(LLAMA_SHAPES)}")
    rows = []
    for size in sizes:
        big = size != "tiny"  # 0.2b peaks near 3 GB, 1.1b near 11 GB: keep them off each other's memory
        for policy in policies:
            cmd = [sys.executable, "-m", "precast.bench.convert.gb", size, str(policy).lower()]
            if big and shutil.which("flock"):
                cmd = ["flock", BIGMEM_LOCK, *cmd]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                rows.append(GbCost(size=size, policy=str(policy).lower(), error=tail[:200]))
                continue
            data = json.loads(lines[-1])
            rows.append(GbCost(**data))
    return rows


def gb_rows(rows: list[GbCost]) -> list[list[str]]:
    """Markdown rows: size, policy, params, GB, wall s/GB, CPU s/GB, peak extra / input, then per stage."""
    out = []
    for r in rows:
        if r.error:
            out.append([r.size, r.policy, "-", "-", "-", "-", "-", f"error: {r.error}"])
            continue
        top = sorted(((k, v) for k, v in r.stage_cpu_s.items() if k != VERIFY), key=lambda kv: -kv[1])[:4]
        where = ", ".join(
            f"{k} {v / r.gb:.2f} s/GB {r.stage_peak.get(k, 0) / r.weight_bytes:.2f}x" for k, v in top
        )
        verify = f"; verify {r.stage_cpu_s.get(VERIFY, 0) / r.gb:.2f} s/GB" if VERIFY in r.stage_cpu_s else ""
        out.append(
            [
                r.size,
                r.policy,
                f"{r.params / 1e9:.2f} B",
                f"{r.gb:.2f}",
                f"{r.wall_s / r.gb:.2f}",
                f"{r.cpu_s / r.gb:.2f}",
                f"{r.peak_ratio:.2f}",
                where + verify,
            ]
        )
    return out


GB_HEADER = [
    "size",
    "policy",
    "params",
    "GB in",
    "wall s/GB",
    "CPU s/GB",
    "peak extra / input",
    "top stages (CPU)",
]


def gb_markdown(rows: list[GbCost], machine: dict[str, Any] | None = None) -> str:
    """The rows as a markdown table, with the machine, and each row's stages in full (CPU s/GB, peak/input)."""
    lines = ["Machine: " + ", ".join(f"{k}: {v}" for k, v in (machine or {}).items()), ""]
    lines += ["| " + " | ".join(GB_HEADER) + " |", "|" + "---|" * len(GB_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in gb_rows(rows)]
    for r in rows:
        if not r.error:
            stages = ", ".join(
                f"{k} {v / r.gb:.2f} ({r.stage_peak.get(k, 0) / r.weight_bytes:.2f}x)"
                for k, v in r.stage_cpu_s.items()
                if v / r.gb >= 0.01
            )
            lines += ["", f"{r.size} {r.policy}, CPU s/GB per stage (peak RSS above input / input): {stages}"]
    return "\n".join(lines) + "\n"


def write_gb_outputs(rows: list[GbCost], out_dir: str, machine: dict[str, Any]) -> list[str]:
    """convert_gb.json and convert_gb.md in ``out_dir``, each written whole or not at all."""
    from pathlib import Path

    from precast.io import atomic_path

    out = Path(out_dir)
    with atomic_path(out / "convert_gb.json") as tmp:
        tmp.write_text(
            json.dumps({"machine": machine, "results": [asdict(r) for r in rows]}, indent=1) + "\n"
        )
    with atomic_path(out / "convert_gb.md") as tmp:
        tmp.write_text("# precast conversion cost per GB of weights\n\n" + gb_markdown(rows, machine))
    return [str(out / "convert_gb.json"), str(out / "convert_gb.md")]


def _child(argv: list[str]) -> int:
    size, policy = argv[0], None if argv[1] == "none" else argv[1]
    try:
        row = measure_gb(size, policy)
    except Exception as exc:  # noqa: BLE001 - reported as the row's error by the parent
        print(f"{type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(row)))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
