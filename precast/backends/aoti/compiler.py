"""AOTInductor compilation of (converted) programs, with a disk cache and weight swapping.

    cm = precast.compile(res.program)           # compile once, cached on disk and in process
    y = cm(x)                                   # any batch size (dim 0 is dynamic by default)
    cm.load_weights(model.state_dict())         # new fp32 weights by original name, cast on load

Cache entries live in ``<cache_dir>/aoti/<key>/`` (``model.pt2`` + ``manifest.json``). The package holds no
weights: the model hands the loader the program's own tensors (or, for a program with meta weights, those read
from ``weights=`` shards), held once (``weights/sources.py``, ``backends/aoti/model.py``). The key hashes the
graph, the weights, the compile options, inductor's config and environment, the C++ compiler and its version, the
CPU's ISA, torch's version and git commit, precast's version and the device. An entry is built in a temporary
folder and renamed into place after its manifest (sha256 of every file, the compiled program's input signature)
is written, under a file lock, so concurrent processes compile a key once and a killed compile never leaves a
loadable entry. An entry whose files do not match its manifest is rebuilt, never loaded: it is native code.
Every call's inputs are checked against the compiled program's signature (``runtime/signature.py``) before
the native code runs: AOTInductor itself reads past its buffers on a wrong shape.

Forms: ``mode="auto"`` (the default) compiles in the form measured fastest on this machine, at this thread count,
for the program's matmul weight dtype and shapes (``backends/aoti/forms.py``: Inductor's defaults, oneDNN's packed
linear (freezing) or the C++ GEMM template; timed once on a synthetic module of the program's weight shapes and
cached in ``<cache dir>/forms.json``; ``$PRECAST_FORM`` overrides). ``CompiledModel.form`` says which, why, and
the times; it names what the final configs compile (a caller's ``inductor_configs`` win: ``forms.form_of``). Each
16-bit attention is computed in fp32 where that is measured faster here (``backends/aoti/attention.py``: ATen's
single-query bf16 flash attention is 7x slower than fp32's on a CPU without AMX).

Folded constants: under freezing, Inductor folds each 16-bit linear's weight into oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``) at compile time. The compile records each folded constant's subgraph as a
recipe (``record_folded_constants``), keeps those whose replay on the program's weights gives back every bit
(``match_folded``), and recomputes them from the weights at load and in ``load_weights`` (``replay``): the package
holds no weights, a streamed program gets the same form, and the originals the code never reads are not loaded.

Packed weights: under ``mode="max-autotune"`` (or the ``gemm-template`` form) on a CPU, Inductor's C++ GEMM template (AMX / AVX512 micro-kernels)
copies each weight it uses into a blocked (and for bf16 VNNI-interleaved) constant at compile time and reads only
that copy. The compile records those copies (``record_new_constants``), finds the stored weight and the packing
that reproduces each bit for bit (``match_packed``), and writes the plan in the manifest; ``load_weights`` packs
the new weights the same way (``gemm_pack``), so they stay swappable. A copy precast cannot reproduce makes
``load_weights`` refuse, as for weights folded by freezing. The originals the code never reads are not loaded.

Input: an ExportedProgram (converted or not) and compile options. Output: a ``CompiledModel`` (callable,
``load_weights`` by original names) backed by a cached AOTInductor package (``backends/aoti/package_cache.py``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from torch.export import ExportedProgram

from precast.backends.aoti.attention import plan_attention
from precast.backends.aoti.build import IN_SO, entry_manifest
from precast.backends.aoti.facts import CompileJob, ProgramFacts
from precast.backends.aoti.forms import Form, as_configured, choose_form
from precast.backends.aoti.int_weights import int_kernel_configs, plan_int_weights, warn_int_weights
from precast.backends.aoti.load import load_model, load_package
from precast.backends.aoti.model import CompiledModel
from precast.backends.aoti.package_cache import cache_key, resolve_cache_dir
from precast.errors import PrecastError
from precast.ir.fake import has_data, lacks_data
from precast.ir.program import program_devices
from precast.runtime.exported import exported_program, with_example_inputs
from precast.runtime.threads import check_threads, running_at
from precast.threads import TORCH_LOCK
from precast.weights.sources import tensor_constants

MODES = ("auto", "default", "max-autotune")
THREADS = "cpp.threads"  # the inductor config the generated C++ reads its OpenMP thread count from

# program -> {options key: CompiledModel}; weak so a cached model never keeps a program's weights alive. A hit
# counts only if the model's key is the program's key now (weights changed in place give a new key) and the model
# still serves the program's weights (not after its load_weights: every compile starts from the program's values)
_MEMO: weakref.WeakKeyDictionary[ExportedProgram, dict[str, CompiledModel]] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


# ---- public entry point -------------------------------------------------------------------------------------
def compile_configs(
    mode: str = "default",
    inductor_configs: Mapping[str, Any] | None = None,
    form: Form | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The inductor configs ``compile`` compiles with (and keys its cache entry by): ``form``'s (``mode="auto"``,
    ``backends/aoti/forms.py``), then the caller's ``inductor_configs`` over them, and ``cpp.threads``: the thread
    count (default ``torch.get_num_threads()``), which Inductor writes into its C++ kernels
    (``#pragma omp parallel num_threads(N)``, and how each loop nest and GEMM is split among them): a package
    serves the count it was compiled for, so the count is in the cache key. A caller's ``cpp.threads`` that
    differs from ``threads`` is refused.

    Every constant stays a swappable constant: AOTInductor otherwise inlines 0-d constants and 1-d ones of <= 8
    elements into its code (``GraphLowering.can_inline_constant``), and ``load_weights`` could never swap an
    8-element bias (``always_keep_tensor_constants``; the caller's own value wins). And the package leaves its
    constants out (``aot_inductor.package_constants_in_so=False``, the same name on torch 2.13 and 2.15): the
    model hands the loader tensors it owns, held once (``weights/sources.py``). Constants freezing computes
    from the weights (a transpose, oneDNN's blocked copy) are recomputed at load from recorded recipes
    (``packed.record_folded_constants``); a package whose code reads one precast cannot recompute keeps its
    constants in the .so instead (``build.build_locked``)."""
    configs = {**(form.configs if form else {}), **dict(inductor_configs or {})}
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    if configs.get(THREADS, threads) != threads:
        raise PrecastError(
            f"precast.compile: inductor_configs {THREADS}={configs[THREADS]!r} but the compile runs at "
            f"{threads} thread(s); pass threads={configs[THREADS]!r} instead"
        )
    configs[THREADS] = threads
    if mode == "max-autotune":
        configs["max_autotune"] = True
    configs.setdefault("always_keep_tensor_constants", True)
    configs.setdefault(IN_SO, False)
    return configs


def compile(
    program: ExportedProgram | Any,
    *,
    mode: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    dynamic: bool = True,
    inductor_configs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    lock_timeout: float | None = None,
    weights: str | os.PathLike | None = None,
    threads: int | None = None,
) -> CompiledModel:
    """Compile ``program`` (an ExportedProgram or a ConvertResult) with AOTInductor, cached; returns a loaded model.

    ``mode``: ``"auto"`` (default) compiles in the form measured fastest on this machine at this thread count
    for the program's 16-bit matmul weights (``backends/aoti/forms.py``: Inductor's defaults, oneDNN's packed linear or
    the C++ GEMM template, timed once on a synthetic module of the program's weight shapes, ~1 min, and cached in
    ``<cache dir>/forms.json``; fp32 programs compile in Inductor's defaults without timing; ``$PRECAST_FORM``
    overrides; ``CompiledModel.form`` says which, why and the times);
    ``"default"``: Inductor's defaults; ``"max-autotune"``: Inductor's autotuning (``inductor_configs`` picks
    its GEMM backends). In every mode each 16-bit attention is timed in its dtype and in fp32 and computed in fp32 where
    that is faster, as it is on CPUs without AMX (``backends/aoti/attention.py``; ``cm.form["attention"]``).
    Weights stay swappable with ``load_weights`` in every form.
    ``dynamic``: re-export with a dynamic dim 0 (batch) on every tensor input, as PyTorch's benchmark harness does.
    ``cache_dir``: default ``$PRECAST_CACHE_DIR`` or the user cache dir. ``progress``: a spinner on stderr
    (default: only when stderr is a terminal and ``CI`` is unset). ``lock_timeout``: seconds to wait for another
    process compiling the same key (default ``$PRECAST_LOCK_TIMEOUT`` or 600); a line on stderr after 5 s.
    Safe to call from several threads (torch's compile and load are serialized; see precast/threads.py).
    ``weights``: for a program whose constants are fake or meta (converted with streamed weights), a
    ``.safetensors`` file or a directory of shards (+ ``model.safetensors.index.json``) holding them by the
    program's stored names, in their stored dtypes; checked against the program, then read once.
    The compiled model reads the program's own weight tensors (no copy): change weights with ``load_weights``.
    ``threads``: the intra-op thread count the model runs at (default: ``torch.get_num_threads()`` now; the
    CLI's default is ``precast.runtime.threads.default_threads()``, which leaves out the cores other processes
    keep busy). The package is compiled for it (Inductor writes the count into its kernels), the form is measured
    at it, and each call runs at it: torch's count (OpenMP's for the calling thread) is set for the call and
    restored after (``runtime/threads.running_at``), so the caller's ``torch.get_num_threads()`` is unchanged.
    ``cm.threads`` says which.
    """
    ep = with_example_inputs(exported_program(program, "precast.compile"))
    if mode not in MODES:
        raise PrecastError(f"precast.compile: mode={mode!r}; choose one of {', '.join(MODES)}")
    threads = _threads(threads)
    facts = _facts(ep, weights)
    job = _job(facts, mode, inductor_configs, cache_dir, dynamic, threads)
    # warned from here: the warning names the line that called precast.compile
    warn_int_weights(job.ints, freezing=bool(job.configs.get("freezing")))
    model = None if weights is not None else _memoized(ep, job)
    if model is not None:
        return model
    started = time.perf_counter()
    # autotuning (the GEMM template) times its candidates at the count the package is compiled for
    with running_at(threads):
        compile_seconds, manifest = entry_manifest(facts, job, progress, lock_timeout)
    model = load_model(facts, job, manifest, weights, compile_seconds, started)
    with _MEMO_LOCK:
        _MEMO.setdefault(ep, {})[job.options] = model
    return model


def _threads(threads: int | None) -> int:
    if threads is None:
        import torch

        return torch.get_num_threads()
    return check_threads(threads, "precast.compile")


def _facts(ep: ExportedProgram, weights: Any) -> ProgramFacts:
    """The program's facts, each read once (``facts.py``); refuses a fake-weight program this compile cannot
    serve."""
    constants = tensor_constants(ep)
    fake = sorted(n for n, v in constants.items() if lacks_data(v))
    return ProgramFacts(ep, constants, fake, _check_fake(ep, fake, weights))


def _job(
    facts: ProgramFacts,
    mode: str,
    inductor_configs: Mapping[str, Any] | None,
    cache_dir: str | os.PathLike | None,
    dynamic: bool,
    threads: int,
) -> CompileJob:
    """The compile's decisions: the form, the final inductor configs, the int weights' plan, the cache folder
    and the key; refuses configs a fake-weight program cannot compile with."""
    form = _form(facts.ep, mode, facts.device, bool(facts.fake), cache_dir, threads)
    configs = compile_configs(mode, inductor_configs, form, threads)
    # int8 / int4 weights: the linears a low-bit kernel will read (int_weights; one warning line for the others);
    # those kernels are ATen's, so a GEMM backend list without ATEN gets it added
    ints = plan_int_weights(facts.ep, facts.device)
    configs, int_why = int_kernel_configs(configs, ints)
    form = as_configured(form, configs)  # what the final configs compile, not what the form asked for
    if int_why:
        form = dataclasses.replace(form, why=f"{form.why}; {int_why}")
    # the precision of 16-bit attention, in every mode (ATen's attention kernel, not one of Inductor's forms:
    # measured here, backends/aoti/attention.py)
    attention = plan_attention(facts.ep, facts.device, threads, cache_dir)
    if attention.records:
        record = {**form.record, "attention": attention.to_dict()}
        form = dataclasses.replace(form, why=f"{form.why}; {attention.why}", record=record)
    _check_fake_configs(facts.fake, configs)
    root = resolve_cache_dir(cache_dir)
    # by content; the form is in the configs, and the CPU's flags are in the key: a package built for AMX is
    # never served to a CPU without it; the int weights' and the attention's rewrites are functions of the
    # program and their plans
    extra = {"precast.form": form.name, **ints.key(), **attention.key()}
    key = cache_key(facts.ep, {**configs, **extra}, dynamic, facts.device)
    return CompileJob(root, key, configs, dynamic, form, ints, threads, attention)


def _memoized(ep: ExportedProgram, job: CompileJob) -> CompiledModel | None:
    """The model an earlier compile of ``ep`` with these options made, while it still serves the program's
    weights at this key: itself, or for a program that writes state, a model of its own; None otherwise."""
    with _MEMO_LOCK:
        model = _MEMO.get(ep, {}).get(job.options)
    if model is None or model.key != job.key or model.weights_replaced:
        return None
    if not model.stateful:
        return model
    # a program that writes state (a KV cache): a model of its own each call, never another's state; the
    # package is loaded again (AOTInductor keeps the state a loaded package writes per loaded package), the
    # read-only weights shared
    started = time.perf_counter()
    with TORCH_LOCK:
        runner = load_package(model.package_path)
    return model._sibling(runner, time.perf_counter() - started)


def _form(
    ep: ExportedProgram,
    mode: str,
    device: str,
    fake: bool,
    cache_dir: str | os.PathLike | None,
    threads: int,
) -> Form:
    """The form ``mode`` compiles in: chosen for this machine and thread count under ``"auto"``
    (``backends/aoti/forms.py``)."""
    if mode == "default":
        return Form("default", {}, "mode='default': Inductor's defaults")
    if mode == "max-autotune":
        return Form("max-autotune", {}, "mode='max-autotune'")
    where = {"device": device, "cache_dir": cache_dir, "compile_fn": compile, "threads": threads}
    form = choose_form(ep, **where)
    if not fake or form.name != "gemm-template":
        return form
    # the template's packed copies are matched to their weights by value (packed.match_packed), which a
    # program without weight values cannot give; oneDNN's blocked copies are recorded by recipe
    form = choose_form(ep, exclude=("gemm-template",), **where)
    return Form(form.name, form.configs, f"{form.why} (streamed weights: no C++ GEMM template)", form.record)


def _check_fake(ep: ExportedProgram, fake: list[str], weights: Any) -> str:
    """The device the constants live on at run time; refuses a fake-weight program this compile cannot serve."""
    real, inputs = program_devices(ep, has_data)  # the constants holding data, then the inputs
    device = next((d for d in real + inputs if d != "meta"), "cpu")
    if weights is not None and not fake:
        raise PrecastError(
            "precast.compile: weights= is for a program whose constants are fake or meta (converted with streamed "
            "weights); this one holds its weights: drop weights=, or swap them after with load_weights"
        )
    if fake and weights is None:
        raise PrecastError(
            f"precast.compile: {len(fake)} constant(s) of the program have no data (fake or meta), e.g. "
            f"{fake[0]!r}; pass weights=DIR (the shards the conversion wrote) or a .safetensors file"
        )
    return device


def _check_fake_configs(fake: list[str], configs: dict[str, Any]) -> None:
    if fake and (configs.get(IN_SO, True) or configs.get("max_autotune")):
        raise PrecastError(
            "precast.compile: a program with fake or meta weights compiles only with its weights outside the "
            f"package ({IN_SO} not True) and without max-autotune (its C++ GEMM template packs copies matched "
            "to the weights' values at compile time); use mode='auto' or mode='default', or load the weights into "
            "the program"
        )
