"""Which compiled form ``precast.compile`` picks on the machine it runs on (``mode="auto"``, the default).

A decoder step at batch 1 is a chain of matrix-vector products: its speed is how fast each kernel streams its
weight, and which kernel streams a 16-bit weight fastest depends on the CPU *and* the thread count. A table of
CPU flags was right on a Xeon without AMX and wrong on a Zen 4 (AVX512-BF16, no AMX) at 2 threads, where it chose
``onednn-packed`` at 27.9 ms/token against 21.6 for max-autotune (issue 40). So the choice is measured:

- ``default``: ATen ``mm`` on weights as stored (Inductor's defaults).
- ``onednn-packed``: freezing's CPU linear fusion (``mkldnn._linear_pointwise`` on weights reordered into
  oneDNN's blocked layout where oneDNN has the 16-bit ISA); blocked copies recomputed at load
  (``packed.record_folded_constants``).
- ``gemm-template``: Inductor's C++ GEMM template (``max_autotune``, C++ backend) on packed copies
  (``packed.match_packed``).

How (``measured_form``): for a program whose matmul weight bytes are mostly bf16 / fp16, a small synthetic module
holds one weight of each distinct matmul weight shape of the program, in that dtype, called at M=1 (a decode step
at batch 1). It is compiled by ``precast.compile`` itself in each candidate form (so what is timed is what would
run: weights outside the package, folded and packed copies recomputed, at the compile's thread count), into a
temporary cache; the candidates are timed interleaved (each round calls every form in turn; the best round of each:
load only ever adds time), at the thread count the compile runs at (``threads``; by default
``torch.get_num_threads()``). The fastest wins; forms within ``TIE`` of the fastest go to the earliest in
``CANDIDATES`` (the simplest code). A form that fails to compile is recorded with its error, never chosen.

The choice is cached in ``<cache dir>/forms.json`` (JSON, written atomically under a file lock, never unpickled),
keyed by the CPU (model name and flags), torch's capability level, the thread count, torch's version and commit,
precast's version, the dtype, the shape set, M and the candidates: a cached choice is reused without timing; a
malformed file is measured again with a warning. The ``Form`` records the times, the thread count, the load
average during the timing, the cores other processes kept busy meanwhile (``"under_load"`` past half a core; where
the system cannot say, when the load average exceeded the cores left), and why. The chosen
name is in the compile's cache key (``aoti.compile``), like the configs it implies.

A choice timed under load is provisional: a busy machine skews the times (load 7 gave ``default`` 62 ms, packed
2 ms, template 61 ms), so it serves while the machine stays busy, and the first compile that finds the machine quiet
(``quiet_now``: other processes busy on at most half a core over ``runtime/threads.SAMPLE_S``) measures it again
and replaces it. A choice timed quiet is kept until its key changes.

Programs whose linears read int8 / int4 weights (``int_weights``) are measured the same way, the synthetic module's
weights converted to the program's formats (``form_timing._stored_in``): Inductor's C++ GEMM template has kernels
of its own for torch's weight-only int8 and int4 matmuls (a 1024 x 2816 int8 GEMV at M=1 on a Zen 4: 0.15 ms
against ATen's ``_weight_int8pack_mm`` 0.37 and a bf16 ``linear`` 0.41), so the form matters as much there.

No measurement: fp32 programs (ATen's fp32 GEMV measured fastest at M=1: ``default``), other devices
(``default``), and ``$PRECAST_FORM``: a form name forces it; ``flags`` takes the table of CPU capabilities below
(``flags_form``: the C++ GEMM template on AMX, oneDNN on AVX512-BF16 / -FP16 without AMX, else the defaults; for
int8 / int4 weights the defaults), the test suite's setting (deterministic, no timing). ``form_of`` names the form a
set of inductor configs compiles (what ``CompiledModel.form`` records once a caller's ``inductor_configs`` are
merged).

Input: a program, the cache dir (and for tests: capabilities, a ``measure`` callable). Output: a ``Form``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast import cpu
from precast.backends.aoti.form_timing import (
    FORMS_FILE,
    M,
    Shapes,
    cores,
    load_choices,
    measure_forms,
    store_choice,
)
from precast.cpu import capabilities as cpu_capabilities
from precast.errors import PrecastError
from precast.runtime.threads import busy_now, cpu_seconds, load_average, others_busy

# form -> the inductor configs it compiles with (precast adds its constant layout: aoti.compile_configs)
FORM_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "gemm-template": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    "onednn-packed": {"freezing": True},
}
CANDIDATES = ("default", "onednn-packed", "gemm-template")  # measured, in this order; ties go to the first
TIE = 0.02  # forms within 2% of the fastest are a tie
FORM_ENV = "PRECAST_FORM"
# the capability each 16-bit dtype needs for a form, per form: (form, {dtype: [capabilities all required]})
RULES: tuple[tuple[str, dict[torch.dtype, tuple[str, ...]]], ...] = (
    ("gemm-template", {torch.bfloat16: ("amx_tile", "amx_bf16"), torch.float16: ("amx_tile", "amx_fp16")}),
    ("onednn-packed", {torch.bfloat16: ("avx512_bf16",), torch.float16: ("avx512_fp16",)}),
)
LOW = (torch.bfloat16, torch.float16)
Measure = Callable[[torch.dtype, Shapes, tuple[str, ...]], Mapping[str, "float | str"]]


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    configs: dict[str, Any]
    why: str
    record: dict[str, Any] = dataclasses.field(
        default_factory=dict
    )  # how it was chosen (times, threads, load)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "why": self.why, **self.record}


@dataclasses.dataclass(frozen=True)
class Measuring:
    """How ``choose_form`` measures (its keywords, as one record for ``measured_form``): the cache folder, what
    times the candidates (tests inject timings) or the compile function the default timing compiles with, the
    forms this program cannot compile in, and the thread count the choice is measured at and keyed by."""

    cache_dir: str | os.PathLike | None = None
    measure: Measure | None = None
    exclude: tuple[str, ...] = ()
    compile_fn: Callable[..., Any] | None = None
    threads: int | None = None


def form_of(configs: Mapping[str, Any]) -> str:
    """The form ``configs`` compile (inductor's own config fills the options they leave out)."""
    import torch._inductor.config as inductor_config

    def get(name: str) -> Any:
        return configs[name] if name in configs else getattr(inductor_config, name)

    name = "default"
    if get("max_autotune"):
        backends = str(get("max_autotune_gemm_backends")).upper().replace(" ", "")
        name = "gemm-template" if backends == "CPP" else "max-autotune"
    if get("freezing"):
        name = "onednn-packed" if name == "default" else f"{name}+freezing"
    return name


def as_configured(form: Form, configs: Mapping[str, Any]) -> Form:
    """``form`` renamed for what ``configs`` (the caller's merged over the form's) actually compile."""
    name = form_of(configs)
    if name == form.name:
        return form
    return Form(name, form.configs, f"{form.why}; inductor_configs make it {name}", form.record)


def matmul_weights(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """The 2-d floating constants the program's matmuls / linears read, by stored name (values may be fake)."""
    from precast.weights.sources import tensor_constants

    constants = tensor_constants(ep)
    by_input = {**ep.graph_signature.inputs_to_parameters, **ep.graph_signature.inputs_to_buffers}
    by_input.update(ep.graph_signature.inputs_to_lifted_tensor_constants)
    ops = {
        torch.ops.aten.linear.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.matmul.default,
    }
    out: dict[str, torch.Tensor] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        for arg in node.args:
            while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and len(arg.args) >= 1:
                if arg.target not in (torch.ops.aten.t.default, torch.ops.aten.permute.default):
                    break
                arg = arg.args[0]
            if not isinstance(arg, torch.fx.Node) or arg.op != "placeholder" or arg.name not in by_input:
                continue
            value = constants.get(by_input[arg.name])
            if value is not None and value.dim() == 2 and value.is_floating_point():
                out[by_input[arg.name]] = value
    return out


def matmul_weight_bytes(ep: ExportedProgram) -> dict[torch.dtype, int]:
    """Bytes of the matmul weights by dtype (a decode step streams these)."""
    out: dict[torch.dtype, int] = {}
    for value in matmul_weights(ep).values():
        out[value.dtype] = out.get(value.dtype, 0) + value.numel() * value.element_size()
    return out


def _low_dtype(ep: ExportedProgram) -> torch.dtype | None:
    """The 16-bit dtype holding most matmul weight bytes, or None when most bytes are fp32 (or there are none)."""
    weights = matmul_weight_bytes(ep)
    low = {d: n for d, n in weights.items() if d in LOW}
    if not weights or sum(low.values()) * 2 < sum(weights.values()):
        return None
    return max(low, key=lambda d: low[d])


def choose_form(
    ep: ExportedProgram,
    caps: Mapping[str, Any] | None = None,
    device: str = "cpu",
    *,
    cache_dir: str | os.PathLike | None = None,
    measure: Measure | None = None,
    exclude: tuple[str, ...] = (),
    compile_fn: Callable[..., Any] | None = None,
    threads: int | None = None,
) -> Form:
    """The form ``mode="auto"`` compiles ``ep`` in here: measured (cached), or by ``$PRECAST_FORM``.

    ``caps``: the capabilities ``PRECAST_FORM=flags`` reads (``cpu_capabilities()`` by default); ``measure``:
    what times the candidates (``form_timing.measure_forms`` with ``compile_fn``, ``precast.compile``, by default;
    tests inject timings); ``exclude``: forms this program cannot compile in (streamed weights: no C++ GEMM
    template); ``threads``: the count the model will run at, which the choice is measured at and keyed by
    (default ``torch.get_num_threads()``)."""
    if device != "cpu":
        return Form("default", {}, f"device {device}: Inductor's defaults")
    int_dtype, ints = int_weights(ep)
    if ints:
        how = Measuring(cache_dir, measure, exclude, compile_fn, threads)
        return _int_form(ep, int_dtype, ints, how)
    dtype = _low_dtype(ep)
    if dtype is None:
        return Form(
            "default",
            {},
            "most float matmul weight bytes are fp32, or there are none: ATen's fp32 GEMV is the fastest measured "
            "form",
        )
    override = os.environ.get(FORM_ENV, "").strip()
    if override == "flags":
        return flags_form(dtype, cpu_capabilities() if caps is None else caps, exclude)
    if override:
        if override not in FORM_CONFIGS or override in exclude:
            allowed = ", ".join([*(f for f in FORM_CONFIGS if f not in exclude), "flags"])
            raise PrecastError(f"${FORM_ENV}={override!r}: not a form for this program; use one of {allowed}")
        return Form(override, dict(FORM_CONFIGS[override]), f"${FORM_ENV}={override}")
    shapes = tuple(sorted({tuple(w.shape) for w in matmul_weights(ep).values() if w.dtype == dtype}))
    return measured_form(dtype, shapes, Measuring(cache_dir, measure, exclude, compile_fn, threads))


def int_weights(ep: ExportedProgram) -> tuple[torch.dtype | None, dict[tuple[int, int], str]]:
    """The linears' weights the program stores in int8 / int4 (``precast.quant.forms.recognise``): the dtype they
    are dequantized to (the activations'), and each (out, in) shape's format."""
    from precast.quant.forms import recognise, value_of

    found: dict[tuple[int, int], str] = {}
    dtype = None
    for node in ep.graph.nodes:
        if (
            node.op != "call_function"
            or node.target is not torch.ops.aten.linear.default
            or len(node.args) < 2
        ):
            continue
        stored, value = recognise(node.args[1]), value_of(node.args[1])
        if stored is not None and value is not None and value.dim() == 2:
            found[(int(value.shape[0]), int(value.shape[1]))] = stored.format.name
            dtype = stored.dtype
    return dtype, found


def _int_form(
    ep: ExportedProgram, dtype: torch.dtype, ints: dict[tuple[int, int], str], how: Measuring
) -> Form:
    """The form of a program with int8 / int4 weights: measured like a 16-bit one, on a synthetic module with the
    program's weight shapes in their formats (Inductor's C++ GEMM template has its own kernels for torch's int8 and
    int4 weight-only matmuls: on a Zen 4, a 1024 x 2816 int8 GEMV 0.15 ms against ATen's 0.37, bf16's 0.41).
    ``$PRECAST_FORM`` names a form; ``flags`` (the test suite's) keeps Inductor's defaults: no table of CPU
    capabilities speaks for these kernels."""
    override = os.environ.get(FORM_ENV, "").strip()
    if override == "flags":
        return Form(
            "default", {}, "int8/int4 weights: no CPU-flags rule for their kernels; Inductor's defaults"
        )
    if override:
        if override not in FORM_CONFIGS or override in how.exclude:
            allowed = ", ".join([*(f for f in FORM_CONFIGS if f not in how.exclude), "flags"])
            raise PrecastError(f"${FORM_ENV}={override!r}: not a form for this program; use one of {allowed}")
        return Form(override, dict(FORM_CONFIGS[override]), f"${FORM_ENV}={override}")
    floats = {tuple(w.shape): "float" for w in matmul_weights(ep).values() if w.dtype == dtype}
    both = sorted({**floats, **ints}.items())
    shapes = tuple((int(n), int(k)) for (n, k), _ in both)
    return measured_form(dtype, shapes, how, formats=tuple(f for _, f in both))


def flags_form(dtype: torch.dtype, caps: Mapping[str, Any], exclude: tuple[str, ...] = ()) -> Form:
    """The form the CPU's reported capabilities imply for 16-bit ``dtype`` weights (``PRECAST_FORM=flags``)."""
    name = str(dtype).removeprefix("torch.")
    for form, needs in RULES:
        required = needs.get(dtype, ())
        if form not in exclude and required and all(caps.get(c) for c in required):
            return Form(
                form,
                dict(FORM_CONFIGS[form]),
                f"{name} matmul weights; the CPU reports {', '.join(required)}",
            )
    missing = ", ".join(sorted({c for _, needs in RULES for c in needs.get(dtype, ()) if not caps.get(c)}))
    return Form("default", {}, f"{name} matmul weights; the CPU lacks {missing or 'nothing'}: ATen's kernels")


# ---- the measured choice -------------------------------------------------------------------------------------
def choice_key(
    dtype: torch.dtype,
    shapes: Shapes,
    threads: int,
    candidates: tuple[str, ...],
    formats: tuple[str, ...] | None = None,
) -> str:
    """What a measured choice depends on, hashed: the CPU, torch, precast, threads, dtype, shapes (and their
    weight formats, where some are int8 / int4), M, candidates."""
    parts: dict[str, Any] = {
        "dtype": str(dtype),
        "shapes": [list(s) for s in shapes],
        "m": M,
        "candidates": list(candidates),
    }
    if formats:
        parts["formats"] = list(formats)
    return machine_key(threads, parts)


def machine_key(threads: int, parts: Mapping[str, Any]) -> str:
    """A timing's cache key, hashed: ``parts`` (what was timed) with what any timing here depends on: the CPU
    (model and flags), torch's capability level, the thread count, torch's version and commit, precast's."""
    from precast.version import __version__

    every = {
        "cpu": cpu.identity(),
        "capability": cpu.capability(),
        "threads": threads,
        "torch": f"{torch.__version__} git={torch.version.git_version}",
        "precast": __version__,
        **parts,
    }
    return hashlib.sha256(json.dumps(every, sort_keys=True).encode()).hexdigest()[:32]


def timed_here(measure: Callable[[], Any], threads: int) -> tuple[Any, dict[str, Any]]:
    """``measure()``'s result, and how the machine was while it ran: the entry fields every cached timing keeps
    (threads, load average, the cores other processes kept busy, the cores the timing left, under load or not,
    the CPU, when)."""
    load_before, busy_before, started = load_average(), cpu_seconds(), time.perf_counter()
    result = measure()
    load = max(load_before, load_average())
    others = others_busy(busy_before, cpu_seconds(), time.perf_counter() - started)
    cores_left = max(cores() - threads, 0)
    # under load: other processes kept more than half a core busy while precast timed (where the system says;
    # else the load average beyond the cores the timing leaves free, which counts precast's own compiles too)
    return result, {
        "threads": threads,
        "load": round(load, 2),
        "others_busy": None if others is None else round(others, 2),
        "cores_left": cores_left,
        "under_load": is_loaded(others, load, cores_left),
        "cpu": cpu.model_name(),
        "measured": time.time(),
    }


def measured_form(
    dtype: torch.dtype, shapes: Shapes, how: Measuring = Measuring(), formats: tuple[str, ...] | None = None
) -> Form:
    """The fastest candidate for ``dtype`` weights of ``shapes`` (each stored in ``formats``' format where given:
    int8 / int4 weights dequantized to ``dtype``) at ``how.threads`` (default: this process's count): cached, else
    timed now; a cached choice timed under load is timed again once the machine is quiet."""
    from precast.io import cache_root

    path = cache_root(how.cache_dir) / FORMS_FILE
    threads = torch.get_num_threads() if how.threads is None else how.threads
    key = choice_key(dtype, shapes, threads, CANDIDATES, formats)
    entry = load_choices(path).get(key)
    if entry is None or (entry["under_load"] and quiet_now(threads)):
        entry = _measure_locked(path, key, entry, dtype, shapes, threads, how, formats)
    name, why = pick(entry["times_ms"], how.exclude)
    record = {k: entry[k] for k in ("times_ms", "threads", "load", "cores_left", "under_load", "m")}
    record["others_busy"] = entry.get("others_busy")
    return Form(name, dict(FORM_CONFIGS[name]), _why(entry, name, why), record)


def quiet_now(threads: int) -> bool:
    """Whether the machine is quiet enough to time on now: other processes busy on at most half a core over a
    short sample (where the system cannot say: the load average within the cores ``threads`` leave)."""
    others = busy_now()
    return not is_loaded(others, load_average(), max(cores() - threads, 0))


def is_loaded(others: float | None, load: float, cores_left: int) -> bool:
    """Whether a timing ran under load: other processes busy on more than half a core (where the system says),
    else the load average beyond the cores the timing left free."""
    return others > 0.5 if others is not None else load > cores_left


def _measure_locked(
    path: Path,
    key: str,
    stale: dict[str, Any] | None,
    dtype: torch.dtype,
    shapes: Shapes,
    threads: int,
    how: Measuring,
    formats: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Time ``key``'s candidates and store the entry, under the key's file lock: one process measures a key at a
    time (two timing at once would each measure the other's load). ``stale``: the provisional entry being replaced
    (None: there was none); an entry another process stored meanwhile is used."""
    from precast.io import file_lock, private_dir

    locks = private_dir(private_dir(path.parent) / "locks")
    with file_lock(locks / f"form-{key}.lock", "measuring the compile form"):
        entry = load_choices(path).get(key)
        if entry is None or entry == stale:
            entry = _measure_entry(dtype, shapes, threads, path.parent, how, formats)
            store_choice(path, key, entry)
    return entry


def _measure_entry(
    dtype: torch.dtype,
    shapes: Shapes,
    threads: int,
    root: Path,
    how: Measuring,
    formats: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Time the candidates now, at ``threads``; the cache entry: times, threads, the load during the timing, why."""
    if (
        how.measure is None and how.compile_fn is None
    ):  # forms.py does not import compiler.py (it imports this)
        raise PrecastError("choose_form: measuring needs compile_fn=precast.backends.aoti.compiler.compile")

    def measure() -> Mapping[str, float | str]:
        if how.measure is not None:
            return dict(how.measure(dtype, shapes, CANDIDATES))
        configs = {n: FORM_CONFIGS[n] for n in CANDIDATES}
        return measure_forms(dtype, shapes, configs, root, how.compile_fn, threads, formats=formats)

    times, machine = timed_here(measure, threads)
    return {
        "times_ms": {n: round(t * 1e3, 4) if isinstance(t, float) else str(t) for n, t in times.items()},
        **machine,
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": [list(s) for s in shapes],
        **({"formats": list(formats)} if formats else {}),
        "m": M,
    }


def pick(times_ms: Mapping[str, float | str], exclude: tuple[str, ...] = ()) -> tuple[str, str]:
    """``(form, why)``: the fastest timed form not excluded; within ``TIE`` of it, the earliest candidate."""
    timed = {n: t for n, t in times_ms.items() if isinstance(t, (int, float)) and n not in exclude}
    timed = {n: t for n, t in timed.items() if n in FORM_CONFIGS}
    if not timed:
        return "default", "no candidate form could be timed: Inductor's defaults"
    best = min(timed.values())
    order = [n for n in CANDIDATES if n in timed] + sorted(n for n in timed if n not in CANDIDATES)
    name = next(n for n in order if timed[n] <= best * (1 + TIE))
    if timed[name] == best:
        return name, "the fastest"
    fastest = min(timed, key=lambda n: timed[n])
    return name, f"within {TIE:.0%} of the fastest ({fastest}) and simpler"


def _why(entry: Mapping[str, Any], name: str, why: str) -> str:
    times = ", ".join(
        f"{n} {t:.3g} ms" if isinstance(t, (int, float)) else f"{n} failed ({t})"
        for n, t in entry["times_ms"].items()
    )
    load = f"load average {entry['load']} with {entry['cores_left']} core(s) left"
    if entry.get("others_busy") is not None:
        load += f", other processes busy on {entry['others_busy']} core(s)"
    if entry["under_load"]:
        load = f"measured under load: {load}; provisional, timed again when the machine is quiet"
    held = entry.get("formats")
    what = (
        f"matmul weights in {', '.join(sorted(set(held)))} ({entry['dtype']} activations)"
        if held
        else f"{entry['dtype']} matmul weights"
    )
    return (
        f"{what}; {name} is {why}, measured on this CPU at {entry['threads']} thread(s), "
        f"M={entry['m']}, {len(entry['shapes'])} weight shape(s): {times} ({load})"
    )
