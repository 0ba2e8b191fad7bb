"""OpenVINO (CPU) for converted programs: ``precast.compile(program, backend="openvino")``.

    model = precast.compile(res.program, backend="openvino")   # an OpenVINOModel
    y = model(x)                   # inputs checked against the program's specs first; torch tensors out
    model.plan.summary()           # each executed layer's runtime precision against precast's decisions
    model.save("model.xml")        # OpenVINO IR (model.xml + model.bin), weights once in their stored dtype

``openvino.convert_model`` reads the ExportedProgram itself (after ``run_decompositions`` with OpenVINO's table),
so every cast precast wrote is a ``Convert`` on an activation and every folded weight a constant in its stored
dtype (the attention's ``scale=`` kept exact). The precision hint (``precision``): a bf16 plan on a CPU
with native bf16 is compiled with OpenVINO's own ``bf16`` hint, OpenVINO lowering the plan itself (precast's casts
read through), when every layer then runs the dtype precast decided; otherwise with
``INFERENCE_PRECISION_HINT=f32``, under which OpenVINO runs each op in the precision the graph states (precast's
bf16 ops in bf16, the ops it kept fp32 in fp32; on a CPU without native bf16 it computes the bf16 ops in f32), with
precast's casts to bf16 corrected to round to nearest and its bf16 weights read as compressed weights. An
fp16 plan runs in fp16 only under OpenVINO's ``f16`` hint (the f32 hint runs fp16 ops in f32), tried first where the
CPU has fp16 kernels (OpenVINO lists ``FP16`` in its capabilities: AVX512-FP16 or AVX2-VNNI-2).
Under the bf16 hint the ops precast kept fp32 are marked so that OpenVINO keeps them in f32
(``keep_f32``; fused f32 RMS/RoPE kernels accepted: ``fused_kernels``). ``check_plan`` (``plan_check``) reads the
compiled model back and warns in one line about the layers that run another precision (``plan.overridden``).
``save`` writes the model as converted (no hint-specific form: ``precision.prepare`` makes one from a model
read back).

A program that writes a KV cache keeps it as OpenVINO state (``kv_state``), in the growing form OpenVINO fuses
with its attention where that is the same computation (``growing_cache``; ``model.cache_form`` says which), the
cache held in the dtype precast stored it in (``KV_CACHE_PRECISION``, in the compile and the IR).

Dynamic batch: a program whose dim 0 is static is re-exported with a dynamic one (``exported.dynamic_batch``, as
``precast.compile`` does); every other dimension keeps its size. Needs ``pip install 'precast[openvino]'``.

Input: an ExportedProgram (or a ConvertResult). Output: an ``OpenVINOModel``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.openvino.compiled import OpenVINOModel
from precast.backends.openvino.compressed import WeightCheck, check_weights, stored_weights, warn_uncompressed
from precast.backends.openvino.convert import convert, ov_message, require_openvino, shared_tensors
from precast.backends.openvino.growing_cache import Growing
from precast.backends.openvino.kv_state import (
    cache_precision,
    carried,
)
from precast.backends.openvino.plan_check import (
    PlanCheck,
    check_plan,
    planned_dtypes,
    rounded_batch_norms,
    warn_overrides,
)
from precast.backends.openvino.precision import HINTS, hint_reason, hints_to_try, prepare
from precast.errors import PrecastError
from precast.ir.program import node_records
from precast.runtime.exported import batch_symbols, dynamic_batch, exported_program

WHERE = "precast.compile(backend='openvino')"
AUTO_NOTE = (
    "precast.compile(backend='openvino'): policy='auto' chose this program's precisions by timing torch's own "
    "kernels on this CPU (what eager and AOTInductor run), not OpenVINO's; on OpenVINO, policy='torch' or "
    "'rules' gives a plan that does not depend on those timings"
)


# ---- converting and compiling -------------------------------------------------------------------------------
def compile_openvino(
    program: ExportedProgram | Any,
    *,
    dynamic: bool = True,
    threads: int | None = None,
    precision_hint: str | None = "auto",
    warn: bool = True,
    dynamic_quantization: bool | None = None,
) -> OpenVINOModel:
    """Convert ``program`` with ``openvino.convert_model`` and compile it for the CPU.

    ``precision_hint`` (see ``precision``): ``"auto"`` (default) compiles a bf16 plan with OpenVINO's
    bf16 hint where the CPU has native bf16 and every layer then honours the plan, else with ``"f32"``, which runs
    the dtypes the graph states (its bf16 casts corrected to round to nearest, its bf16 weights read as
    compressed weights; fp16 ops run in f32 there); an
    fp16 plan is compiled with the f16 hint first where OpenVINO reports fp16 kernels (``FP16`` in the CPU's
    capabilities); ``"bf16"`` / ``"f16"`` force that hint;
    ``None`` leaves OpenVINO's own default untouched (bf16 on CPUs with native bf16), whose overrides of
    precast's decisions are then warned about. ``threads``: OpenVINO's ``INFERENCE_NUM_THREADS`` (default: its
    own choice). ``dynamic``: keep or make dim 0 dynamic. ``warn``: one ``PlanOverrideWarning`` line summing up
    the layers that do not run precast's dtype (``model.plan.overridden`` lists them), one line when auto gave up
    the faster hint. Under the bf16 hint the ops the plan keeps fp32 are marked to stay in f32
    (``keep_f32``; ``model.plan.accepted``: fused f32 kernels); ``model.plan.reason`` says why the hint was chosen.
    Weights the program stores as int8/int4 run compressed where OpenVINO can (``model.compressed``; one
    ``CompressedWeightWarning`` line names those it runs on an f32 copy). ``dynamic_quantization``: let OpenVINO
    quantize the activations of those layers to 8 bits on the fly (its ``DYNAMIC_QUANTIZATION_GROUP_SIZE``, on CPUs
    with VNNI). ``None`` (default): as OpenVINO's own exports run them (``dynamic_quantization_for``): on where the
    program stores int4 weights, off otherwise; ``model.weights.activations`` says which and why.
    """
    require_openvino()
    ep = exported_program(program, WHERE)
    _check_options(precision_hint, threads, dynamic_quantization)
    _check_cpu_tensors(ep)
    state = carried(ep, WHERE)
    started = time.perf_counter()
    if dynamic and not state and not batch_symbols(ep):
        ep = dynamic_batch(ep)  # warns when the graph fixes the batch size (a cache's shape fixes it: kept)
    built = _build(ep, state, precision_hint, threads, dynamic_quantization)
    dynamic_quantization = built.dynamic_quantization
    if warn:
        _warn(built, ep)
    return OpenVINOModel(
        built.ov_model,
        built.compiled,
        ep,
        built.plan,
        weights=built.weights,
        growing=built.growing,
        precision_hint=built.plan.hint,
        threads=threads,
        compile_seconds=time.perf_counter() - started,
        weight_check=built.weight_check,
        dynamic_quantization=dynamic_quantization,
        config=built.config,
        form_model=built.form_model,
    )


def _check_options(
    precision_hint: str | None, threads: int | None, dynamic_quantization: bool | None
) -> None:
    """Refuse, in one line each, a precision hint, thread count or dynamic-quantization flag that is not
    one."""
    if precision_hint not in HINTS:
        raise PrecastError(
            f"{WHERE}: precision_hint={precision_hint!r}; use 'auto' (default), 'f32' "
            "(the program's own dtypes), 'bf16', 'f16' or None (OpenVINO's default)"
        )
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise PrecastError(f"{WHERE}: threads={threads!r}; give a positive int")
    if dynamic_quantization is not None and not isinstance(dynamic_quantization, bool):
        raise PrecastError(
            f"{WHERE}: dynamic_quantization={dynamic_quantization!r}; give True, False or None (as OpenVINO's "
            "own exports run it: on for int4 weights)"
        )


@dataclasses.dataclass
class _Built:
    """What converting and compiling one program gives ``OpenVINOModel``: the converted and compiled models,
    the weights OpenVINO reads from torch's memory, how the caches are held, and the checks of what OpenVINO
    runs."""

    ov_model: Any
    compiled: Any
    plan: PlanCheck
    weights: tuple[torch.Tensor, ...]
    growing: Growing | None
    weight_check: WeightCheck
    form_model: Any = None  # the form compiled (precision.prepare's copy)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the options it was compiled with
    # whether OpenVINO quantizes the stored weights' activations on the fly (``dynamic_quantization_for``)
    dynamic_quantization: bool = False


def _build(
    ep: ExportedProgram,
    state: dict[str, str],
    precision_hint: str | None,
    threads: int | None,
    dynamic_quantization: bool | None,
) -> _Built:
    """Convert ``ep``, compile it with the hint that honours its plan, and check the compiled model against
    the plan (each layer's precision) and the weights the program stores as int8/int4 (which run
    compressed)."""
    ov_model, graph_module, growing = convert(ep, state)
    weights = shared_tensors(ov_model, graph_module)  # what OpenVINO reads from torch's memory: kept alive
    stored = stored_weights(graph_module)
    quantized, why = dynamic_quantization_for(stored, dynamic_quantization)
    kv_precision, options = _runtime_options(ov_model, growing, bool(stored) and not quantized)
    compiled, plan, form = _compile_for_plan(
        ov_model, graph_module, precision_hint, threads, kv_precision, options
    )
    weight_check = check_weights(compiled, graph_module)
    weight_check.activations = why if stored else ""
    plan.batch_norms = rounded_batch_norms(ep.graph)
    config = compile_config(plan.hint, threads, options)
    return _Built(ov_model, compiled, plan, weights, growing, weight_check, form, config, quantized)


def dynamic_quantization_for(stored: list[Any], asked: bool | None) -> tuple[bool, str]:
    """Whether OpenVINO quantizes the activations of the layers reading stored weights (``stored``:
    ``compressed.stored_weights``) to 8 bits on the fly, and why. ``asked``: the caller's; None: as OpenVINO's own
    exports run them, decided per format by measurement (SmolLM2-135M, docs/backends.md): with int4 weights on
    (OpenVINO's int4 kernels then take 8-bit activations with VNNI dot products: the 0.246 B decoder's int4 step
    22.6 -> 12.3 ms at 1 thread on a Zen 4, OpenVINO's own int4 export 12.3; the activations' rounding adds little
    to int4's own error: KLD 0.4562 -> 0.4584), with int8 only off (no faster there, and KLD 0.0058 -> 0.0090)."""
    if asked is not None:
        return asked, f"{'on' if asked else 'off'}: dynamic_quantization={asked}"
    int4 = sum(1 for w in stored if w.form == "int4")
    if int4:
        return True, (
            f"on: {int4} int4 weight read(s), whose layers OpenVINO runs with 8-bit activations as its own int4 "
            "export does (dynamic_quantization=False: the program's own activations, slower)"
        )
    return (
        False,
        "off: int8 weights only, whose layers run the program's own activations (OpenVINO's would not be faster)",
    )


def _runtime_options(
    ov_model: Any, growing: Growing | None, activations_as_written: bool
) -> tuple[str | None, dict[str, Any]]:
    """The cache precision (growing caches only) and the compile options precast sets, each also written into
    the model's runtime info, so the IR carries it."""
    kv_precision = cache_precision(ov_model) if growing is not None and growing.grown else None
    if kv_precision is not None:  # carried by the IR too: plain OpenVINO's default for this cache is u8
        ov_model.set_rt_info(kv_precision, ["runtime_options", "KV_CACHE_PRECISION"])
    options: dict[str, Any] = {"KV_CACHE_PRECISION": kv_precision} if kv_precision is not None else {}
    if activations_as_written:  # the IR carries it too
        options["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        ov_model.set_rt_info("0", ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"])
    return kv_precision, options


def _warn(built: _Built, ep: ExportedProgram) -> None:
    """One line each: the layers that do not run precast's dtype, the stored weights OpenVINO runs on an f32
    copy, and a plan chosen by timing torch's kernels (policy 'auto'). Attributed to the caller of
    ``precast.compile`` (``compile_openvino``'s caller's caller)."""
    warn_overrides(built.plan, stacklevel=5)
    warn_uncompressed(built.weight_check, stacklevel=5)
    if any(r.get("source") == "auto" for r in node_records(ep).values()):
        warnings.warn(AUTO_NOTE, stacklevel=4)


def _compile_for_plan(
    ov_model: Any,
    graph_module: Any,
    precision_hint: str | None,
    threads: int | None,
    kv_precision: str | None,
    options: dict[str, Any],
) -> tuple[Any, PlanCheck, Any]:
    """Compile with each hint ``hints_to_try`` gives until one honours the plan (the last is kept regardless);
    the plan check says which hint, why it was chosen, and why an earlier one was given up. Returns the compiled
    model, the plan check and the form compiled."""
    import openvino as ov

    core = ov.Core()
    planned = {dtype for dtype, _ in planned_dtypes(graph_module).values()}
    hints = hints_to_try(precision_hint, planned, core)
    fallback = ""
    for hint in hints:
        prepared, form = prepare(
            ov_model, hint, fused_cache=kv_precision is not None, graph_module=graph_module
        )
        compiled = _compile(core, prepared, hint, threads, options)
        plan = check_plan(compiled, graph_module)
        plan.form = form
        if not plan.overridden or hint == hints[-1]:
            break
        first = plan.overridden[0].describe()
        fallback = (
            f"the {hint} hint overrides {len(plan.overridden)} layer(s) of the plan (e.g. {first}): compiled "
            f"with {hints[-1]}"
        )
    plan.hint, plan.fallback = hint, fallback
    plan.reason = hint_reason(precision_hint, planned, core)
    return compiled, plan, prepared


def compile_config(
    hint: str | None, threads: int | None, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The CPU plugin's compile options: precast's (KV_CACHE_PRECISION, DYNAMIC_QUANTIZATION_GROUP_SIZE), the
    precision hint and the thread count."""
    config: dict[str, Any] = dict(options or {})
    if hint is not None:
        config["INFERENCE_PRECISION_HINT"] = hint
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    return config


def _compile(
    core: Any, model: Any, hint: str | None, threads: int | None, options: dict[str, Any] | None = None
) -> Any:
    config = compile_config(hint, threads, options)
    try:
        return core.compile_model(model, "CPU", config)
    except RuntimeError as exc:
        raise PrecastError(
            f"{WHERE}: OpenVINO cannot compile the model for the CPU: {ov_message(exc)}"
        ) from exc


def _check_cpu_tensors(ep: ExportedProgram) -> None:
    for t in [*ep.state_dict.values(), *ep.constants.values()]:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise PrecastError(
                f"{WHERE}: the program's weights are on {t.device.type}; OpenVINO "
                "runs here on the CPU: export and convert the model on the CPU"
            )
