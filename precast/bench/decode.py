"""LLM decode on a CPU, measured: the harness of ``precast bench --llm`` (and of the source checkout's decode script).

- ``Shape``, ``llama``, ``wrapped``, ``export_decoder``, ``decode_inputs``: the seeded Llama-shaped decoder of
  transformers (random weights), its ExecuTorch export recipe (static KV cache in buffers), the prompt and tokens.
- ``InProcess`` / ``AnchorProcess``: one form, sampled as (prefill ms, ms per decoded token). ``AnchorProcess``
  runs OpenVINO's own export of the same saved weights (optimum-intel) in another Python environment
  (``anchor_env_commands``: optimum-intel 2.2 needs transformers < 5.6), one persistent process per thread
  count, so its samples interleave with the in-process forms' repeat by repeat.
- ``interleaved``: every repeat samples each form once, in turn: load on the machine hits all alike.
- ``bandwidth_gbs``, ``read_bytes``, ``load_average``: the machine's memory read rate, the bytes a decode step
  reads (every weight but the embedding table, plus the whole static cache), the load before and after.
- ``run_decode_bench``: the forms ``precast bench --llm`` compares (eager fp32, eager hand-cast bf16, precast
  through ``precast.compile`` with no options and with ``mode="default"``, precast on OpenVINO, the anchor).

Input: a shape, thread counts, repeats. Output: rows of ms/token, tokens/s, prefill ms, resident MiB of a fresh
process, bytes read per token against the measured bandwidth, compile/export seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs
import torch

# where `precast bench --llm --build-anchor-env` builds the anchor's environment (optimum-intel pins transformers
# < 5.6); $PRECAST_OV_ANCHOR_PYTHON or --anchor-python point elsewhere
ANCHOR_ENV = str(Path(platformdirs.user_data_dir("precast")) / "ov-anchor")
ANCHOR_SCRIPT = Path(__file__).with_name("ov_anchor.py")


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 32000
    cache_len: int = 512
    context: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tag(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self)).encode()).hexdigest()[:10]


QUICK = Shape(
    layers=2, hidden=128, heads=4, kv_heads=2, intermediate=352, vocab=512, cache_len=64, context=32
)


# ---- the model ----------------------------------------------------------------------------------------------
def llama(shape: Shape, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The seeded random Llama-shaped ``LlamaForCausalLM`` (eval), in ``dtype``, set up for a static cache."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max(1024, shape.cache_len),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=shape.cache_len,
        cache_config={"batch_size": 1, "max_cache_len": shape.cache_len},
    )
    return model.to(dtype)


def wrapped(model: torch.nn.Module, shape: Shape) -> torch.nn.Module:
    """transformers' export wrapper (``TorchExportableModuleForDecoderOnlyLM``): the static cache in buffers."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=shape.cache_len)


def export_decoder(model: torch.nn.Module, shape: Shape) -> torch.export.ExportedProgram:
    """The recipe's strict export, with the sequence dimension dynamic (1 .. cache_len - 1)."""
    from torch.export import Dim

    w = wrapped(model, shape)
    seq = Dim("seq", min=1, max=shape.cache_len - 1)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w.export(
            input_ids=ids,
            cache_position=torch.arange(4),
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
        )


def decode_inputs(shape: Shape) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prompt (``context`` tokens) and the decode tokens' ids, seeded."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape.vocab, (1, shape.context), generator=g)
    tokens = [
        torch.randint(0, shape.vocab, (1, 1), generator=g) for _ in range(shape.cache_len - shape.context)
    ]
    return prompt, tokens


def read_bytes(state: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """(bytes held as weights / as cache, bytes one decode step reads) from a state dict of tensors: every weight
    but the embedding table (one row read per token), plus the whole static cache."""
    weights = cache = read = 0
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        n = t.numel() * t.element_size()
        if "cache" in name and ("key" in name or "value" in name or "keys" in name or "values" in name):
            cache += n
            read += n
        elif "cumulative_length" in name or "inv_freq" in name:
            continue
        else:
            weights += n
            read += n // t.shape[0] if "embed_tokens" in name else n
    return {"weights": weights, "cache": cache}, read


# ---- the machine --------------------------------------------------------------------------------------------
def bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 7, best: bool = False) -> float:
    """Memory read bandwidth (GB/s) at ``threads``: the median (``best``: the shortest; load only ever adds time)
    time of summing a ``mib`` MiB fp32 tensor."""
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / (min(times) if best else statistics.median(times)) / 1e9


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none)."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(v, 2) for v in os.getloadavg()]
    return []


# ---- forms, sampled -------------------------------------------------------------------------------------------
class InProcess:
    """A form run in this process: ``run(input_ids=, cache_position=)``; one sample is the prompt's prefill then
    ``steps`` decode steps from position ``context``."""

    def __init__(self, run: Callable[..., Any], shape: Shape):
        self.run = run
        self.prompt, tokens = decode_inputs(shape)
        self.tokens = tokens
        self.ctx = shape.context

    def warm(self) -> None:
        self.run(input_ids=self.prompt, cache_position=torch.arange(self.ctx))
        for i in range(3):
            self.run(input_ids=self.tokens[i], cache_position=torch.tensor([self.ctx + i]))

    def sample(self, steps: int, threads: int) -> tuple[float, float]:
        torch.set_num_threads(threads)
        positions = [torch.tensor([self.ctx + i]) for i in range(steps)]
        t = time.perf_counter()
        self.run(input_ids=self.prompt, cache_position=torch.arange(self.ctx))
        prefill = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for i in range(steps):
            self.run(input_ids=self.tokens[i], cache_position=positions[i])
        return prefill, (time.perf_counter() - t) * 1e3 / steps


def anchor_python(explicit: str | None = None) -> str | None:
    """The Python of the anchor's environment: ``explicit``, ``$PRECAST_OV_ANCHOR_PYTHON``, or ``ANCHOR_ENV``'s;
    None where none exists."""
    for cand in (explicit, os.environ.get("PRECAST_OV_ANCHOR_PYTHON"), f"{ANCHOR_ENV}/bin/python"):
        if cand and Path(cand).exists():
            return cand
    return None


def anchor_env_commands(env: str = ANCHOR_ENV, torch_wheel: str | None = None) -> list[list[str]]:
    """The commands that build the anchor's environment: optimum-intel 2.2 pins transformers < 5.6 (precast tests
    5.23), and pip would pull a CUDA-built torchvision that breaks ``import optimum.intel``
    (``torchvision::nms does not exist``): torch CPU first (``torch_wheel``: a local wheel, else the CPU index),
    every pin in a constraints file, torchvision removed after."""
    pip = f"{env}/bin/pip"
    constraints = Path(env) / "constraints.txt"
    return [
        ["python3.11", "-m", "venv", env],
        [pip, "install", "-q", "--upgrade", "pip"],
        [pip, "install", "-q", torch_wheel or "torch==2.13.0"]
        + ([] if torch_wheel else ["--index-url", "https://download.pytorch.org/whl/cpu"]),
        ["sh", "-c", f"printf 'transformers<5.6\\nopenvino==2026.4.1\\n' > {constraints}"],
        [pip, "install", "-q", "-c", str(constraints), "optimum-intel[openvino]==2.2.*", "transformers<5.6"],
        [pip, "uninstall", "-y", "-q", "torchvision"],
    ]


class AnchorProcess:
    """OpenVINO's own export of the saved model (``optimum-intel``, stateful KV cache) in a persistent process of
    the anchor's environment, at one thread count; ``sample`` asks it for one (prefill, decode) sample. The
    process reports its export seconds and the resident memory it gained (a fresh process: the memory row)."""

    def __init__(
        self,
        python: str,
        model_dir: Path,
        shape: Shape,
        threads: int,
        hint: str = "bf16",
        timeout: float = 900,
    ):
        self.threads = threads
        self.proc = subprocess.Popen(
            [python, "-P", str(ANCHOR_SCRIPT)],  # -P: its folder (precast/bench/openvino.py) off sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.info = self._ask(
            {
                "model_dir": str(model_dir),
                "threads": threads,
                "hint": hint,
                "context": shape.context,
                "cache_len": shape.cache_len,
                "vocab": shape.vocab,
            },
            timeout,
        )

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(
                f"the OpenVINO anchor process ended: {err.strip().splitlines()[-1:] or 'no output'}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the OpenVINO anchor: {reply['error']}")
        return reply

    def warm(self) -> None:
        self._ask({"sample": 2}, 600)

    def sample(self, steps: int, threads: int) -> tuple[float, float]:
        reply = self._ask({"sample": steps}, 600)
        return reply["prefill_ms"], reply["decode_ms"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def interleaved(
    forms: dict[str, Any], threads: int, repeats: int, steps: int, log: Callable[[str], None]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every repeat samples each form once, in turn (``forms``: name -> an object with ``warm()`` and
    ``sample(steps, threads)``); medians per form, and the forms that failed with why."""
    torch.set_num_threads(threads)
    failed: dict[str, str] = {}
    live = dict(forms)
    with torch.no_grad():
        for name, form in list(live.items()):
            try:
                form.warm()
            except Exception as exc:  # noqa: BLE001 - a form failing is a row of the table, not the end of the run
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                log(f"  {name} failed at run time: {failed[name]}")
                del live[name]
        prefill: dict[str, list[float]] = {n: [] for n in live}
        decode: dict[str, list[float]] = {n: [] for n in live}
        for r in range(repeats):
            for name, form in live.items():
                p, d = form.sample(steps, threads)
                prefill[name].append(p)
                decode[name].append(d)
            log(f"  threads={threads} repeat {r + 1}/{repeats}")
    out = {
        name: {
            "prefill_ms": round(statistics.median(prefill[name]), 2),
            "decode_ms": round(statistics.median(decode[name]), 3),
            "decode_samples_ms": [round(s, 3) for s in decode[name]],
        }
        for name in live
    }
    return out, failed


def save_for_anchor(model: torch.nn.Module, folder: Path) -> Path:
    """The seeded fp32 model saved with ``save_pretrained`` (the anchor exports these same weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").exists():
        model.save_pretrained(str(folder))
    return folder


# ---- precast bench --llm -------------------------------------------------------------------------------------
FORMS = ("eager_fp32", "eager_bf16", "precast", "precast_default", "precast_openvino", "openvino_anchor")


def run_decode_bench(
    shape: Shape,
    threads: list[int],
    repeats: int,
    steps: int,
    forms: tuple[str, ...] = FORMS,
    cache_dir: str | None = None,
    anchor: str | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    """The decode forms ``precast bench --llm`` compares, measured interleaved at each thread count; a JSON-able
    payload (rows per thread count, errors, machine, load before / after, bandwidth)."""
    import precast
    from precast.bench.measure import machine_info

    load_start = load_average()
    fp32 = llama(shape)
    built: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    ep = export_decoder(fp32, shape) if any(f.startswith("precast") for f in forms) else None
    res = None
    if ep is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = precast.convert(ep, policy="torch", dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    for name in forms:
        started = time.perf_counter()
        try:
            if name == "eager_fp32":
                m = wrapped(fp32, shape).model
                built[name] = m
                info[name] = {"state": {**dict(m.named_parameters()), **dict(m.named_buffers())}}
            elif name == "eager_bf16":
                m = wrapped(llama(shape, torch.bfloat16), shape).model
                built[name] = m
                info[name] = {"state": {**dict(m.named_parameters()), **dict(m.named_buffers())}}
            elif name in ("precast", "precast_default"):
                assert res is not None
                kw = {} if name == "precast" else {"mode": "default"}
                cm = precast.compile(res.program, cache_dir=cache_dir, dynamic=False, progress=False, **kw)
                built[name] = cm
                info[name] = {"state": {**res.program.state_dict, **res.program.constants}, "form": cm.form}
            elif name == "precast_openvino":
                assert res is not None
                models = {
                    t: precast.compile(res.program, backend="openvino", precision_hint="bf16", threads=t)
                    for t in threads
                }
                built[name] = models
                info[name] = {"state": {**res.program.state_dict, **res.program.constants}}
            elif name == "openvino_anchor":
                python = anchor_python(anchor)
                if python is None:
                    raise RuntimeError(
                        f"no anchor environment ({ANCHOR_ENV}; build it with precast bench --llm "
                        "--build-anchor-env, or give --anchor-python)"
                    )
                folder = save_for_anchor(fp32, Path(tempfile.gettempdir()) / f"precast-anchor-{shape.tag()}")
                built[name] = {t: AnchorProcess(python, folder, shape, t) for t in threads}
                bf16 = llama(shape, torch.bfloat16)
                state = {**dict(bf16.named_parameters())}
                state.update(
                    {
                        f"cache.{i}.keys": torch.empty(
                            1, shape.kv_heads, shape.cache_len, shape.head_dim, dtype=torch.bfloat16
                        )
                        for i in range(2 * shape.layers)
                    }
                )
                first = built[name][threads[0]].info
                info[name] = {
                    "state": state,
                    "export_s": first.get("export_s"),
                    "rss_mb": first.get("rss_mb"),
                    "versions": first.get("versions"),
                }
            info.setdefault(name, {})["compile_s"] = round(time.perf_counter() - started, 1)
        except Exception as exc:  # noqa: BLE001 - a form failing is a row, not the end of the run
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            log(f"  {name} failed: {errors[name]}")
    runs: dict[int, dict[str, Any]] = {}
    bandwidth: dict[int, float] = {}
    for t in threads:
        bandwidth[t] = round(bandwidth_gbs(t), 2)
        forms_t: dict[str, Any] = {}
        for name, obj in built.items():
            if name == "openvino_anchor":
                forms_t[name] = obj[t]
            elif name == "precast_openvino":
                forms_t[name] = InProcess(obj[t], shape)
            else:
                forms_t[name] = InProcess(obj, shape)
        runs[t], failed = interleaved(forms_t, t, repeats, steps, log)
        errors.update(failed)
    for obj in built.get("openvino_anchor", {}).values():
        obj.close()
    rows = {}
    for name, i in info.items():
        held, read = read_bytes(i.pop("state", {}))
        rows[name] = {**i, "stored_bytes": held, "read_bytes": read}
    return {
        "machine": machine_info(),
        "load_start": load_start,
        "load_end": load_average(),
        "shape": dataclasses.asdict(shape),
        "repeats": repeats,
        "steps": steps,
        "bandwidth_gbs": bandwidth,
        "forms": rows,
        "runs": runs,
        "errors": errors,
    }


def decode_markdown(payload: dict[str, Any]) -> str:
    """The payload of ``run_decode_bench`` as a markdown table (one row per thread count and form)."""
    m = payload["machine"]
    lines = [
        "# LLM decode (precast bench --llm)",
        "",
        f"CPU: {m.get('cpu')} (torch capability {m.get('cpu_capability')}), torch {m.get('torch')}. Load average "
        f"{payload['load_start']} before, {payload['load_end']} after. Shape {payload['shape']}; median of "
        f"{payload['repeats']} interleaved repeats of {payload['steps']} decode steps.",
        "",
        "| threads | form | prefill ms | decode ms/token | tokens/s | read/token MB | share of bandwidth | "
        "compile/export s | form chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, table in payload["runs"].items():
        bw = payload["bandwidth_gbs"][t]
        for name, r in table.items():
            f = payload["forms"].get(name, {})
            gbs = f.get("read_bytes", 0) / (r["decode_ms"] / 1e3) / 1e9
            chosen = f.get("form", {}).get("name", "") if isinstance(f.get("form"), dict) else ""
            lines.append(
                f"| {t} | {name} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {1e3 / r['decode_ms']:.1f} | "
                f"{f.get('read_bytes', 0) / 1e6:.0f} | {gbs / bw:.0%} of {bw} GB/s | "
                f"{f.get('export_s') or f.get('compile_s') or '-'} | {chosen} |"
            )
    if payload["errors"]:
        lines += ["", "Forms that did not run:", ""]
        lines += [f"- `{n}`: {e}" for n, e in payload["errors"].items()]
    return "\n".join(lines) + "\n"
