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
bf16 ops in bf16, the ops it kept fp32 in fp32), with precast's casts to bf16 corrected to round to nearest. An
fp16 plan runs in fp16 only under OpenVINO's ``f16`` hint (the f32 hint runs fp16 ops in f32), tried first where the
CPU has fp16 kernels (OpenVINO lists ``FP16`` in its capabilities: AVX512-FP16 or AVX2-VNNI-2).
Under the bf16 hint the ops precast kept fp32 are marked so that OpenVINO keeps them in f32
(``precision.keep_plan_fp32``). ``check_plan`` (``plan_check``) reads the compiled model back and warns,
in one line, about the layers where OpenVINO runs another precision than precast decided (``plan.overridden``).
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
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast.backends.openvino.compressed import WeightCheck, check_weights, stored_weights, warn_uncompressed
from precast.backends.openvino.convert import convert, ov_message, require_openvino, shared_tensors
from precast.backends.openvino.growing_cache import Growing
from precast.backends.openvino.ir_files import save_ir
from precast.backends.openvino.kv_state import (
    GrowingState,
    cache_precision,
    carried,
    initial_values,
    ov_tensor,
    state_values,
    to_torch,
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
from precast.runtime.owner import StateOwner, holds_state
from precast.runtime.signature import ProgramSignature

WHERE = "precast.compile(backend='openvino')"
AUTO_NOTE = (
    "precast.compile(backend='openvino'): policy='auto' chose this program's precisions by timing torch's own "
    "kernels on this CPU (what eager and AOTInductor run), not OpenVINO's; on OpenVINO, policy='torch' or "
    "'rules' gives a plan that does not depend on those timings"
)


class OpenVINOModel:
    """A program compiled by OpenVINO for the CPU. Call it like the program's module (the same input checks as
    ``precast.compile``'s AOTInductor model, before OpenVINO runs); outputs are torch tensors in the program's
    output structure."""

    def __init__(
        self,
        ov_model: Any,
        compiled: Any,
        program: ExportedProgram,
        plan: PlanCheck,
        *,
        weights: tuple[torch.Tensor, ...] = (),
        growing: Growing | None = None,
        precision_hint: str | None,
        threads: int | None,
        compile_seconds: float,
        weight_check: WeightCheck | None = None,
        dynamic_quantization: bool = False,
    ):
        self.ov_model = ov_model  # the openvino.Model (what ``save`` writes)
        self.compiled = compiled  # the openvino.CompiledModel
        # the program itself is not kept (what calls need from it, its signature and output structure, is), only
        # the weights OpenVINO reads in place from torch's memory (convert.shared_tensors): OpenVINO does
        # not keep those alive itself, and a caller who dropped the program would leave it reading freed memory
        self._weights = weights
        self.plan = plan
        # the weights the program stores as int8/int4, and which OpenVINO runs compressed (compressed)
        self.weights = weight_check if weight_check is not None else WeightCheck()
        # whether OpenVINO quantizes those layers' activations on the fly (DYNAMIC_QUANTIZATION_GROUP_SIZE)
        self.dynamic_quantization = dynamic_quantization
        self.precision_hint = precision_hint
        self.threads = threads
        self.compile_seconds = compile_seconds
        # what the model accepts (dynamic batch where it could be)
        self.signature = ProgramSignature.from_program(program)
        self._out_spec = program.call_spec.out_spec
        self._request = compiled.create_infer_request()  # its own: two models never share state
        self._outputs = len(compiled.outputs)
        self._lock = threading.Lock()  # one infer request: calls from several threads take turns
        # precast.generate holds it; every call/reset waits and bumps it (runtime/owner.py)
        self._owner = StateOwner()
        # the caches OpenVINO holds as variables between calls (kv_state), by name
        self.state_names = tuple(v.get_variable_id() for v in ov_model.get_sinks())
        self._initial = initial_values(ov_model) if self.state_names else {}
        # whether a call ran since creation or reset (OpenVINO evaluates the variables' initial values then)
        self._started = False
        # caches in OpenVINO's growing form (growing_cache): how they grew (``growing``), and at run time their
        # live positions, checked before every call (``_growing_state``)
        self.growing = growing if growing is not None and growing.grown else None
        self.cache_form = _cache_form(growing)
        self._growing_state = None
        if self.growing is not None:
            where = [s.name for s in self.signature.inputs].index(self.growing.positions)
            self._growing_state = GrowingState(self.growing, where, self._initial)

    @holds_state  # waits while a generation holds the model in another thread (runtime/owner.py)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.signature.check(args, kwargs)
        feeds = [ov_tensor(t, shared=True) for t in flat if isinstance(t, torch.Tensor)]
        with self._lock:
            growing_state = self._growing_state
            if growing_state is not None:
                live = growing_state.begin(self._request, flat[growing_state.position_index])
                feeds.append(growing_state.beam)
            # each input set as a tensor over torch's memory (the signature checked its dtype), then a bare
            # infer: OpenVINO's data dispatch and its copy of the outputs cost ~75 us a call (a decode step)
            for i, feed in enumerate(feeds):
                self._request.set_input_tensor(i, feed)
            self._request.infer(share_outputs=True)
            self._started = True
            if growing_state is not None:
                growing_state.live = live
            outs = [to_torch(self._request.get_output_tensor(i)) for i in range(self._outputs)]
        return pytree.tree_unflatten(outs, self._out_spec) if self._out_spec is not None else outs

    def __repr__(self) -> str:
        hint = self.precision_hint or "OpenVINO's default"
        return f"OpenVINOModel(precision hint {hint}, {self.plan.summary()})"

    @holds_state
    def reset(self) -> None:
        """Restart from the program's initial state (a new conversation): every cache variable back to the
        buffer the program was exported with (zeros for transformers' recipe). No-op for a stateless program."""
        with self._lock:
            self._request.reset_state()
            self._started = False
            if self._growing_state is not None:
                self._growing_state.live = 0

    def state(self) -> dict[str, torch.Tensor]:
        """The caches as OpenVINO holds them now, by buffer name (copies, in the dtype precast stored them)."""
        with self._lock:
            if self._growing_state is not None:  # the live positions, zeros past them (the program's buffers)
                return self._growing_state.static_view(self._request, self._started)
            if not self._started:  # OpenVINO reports zeros until a call evaluates the initial values
                return {k: v.clone() for k, v in self._initial.items()}
            return state_values(self._request)

    @property
    def compressed(self) -> dict[str, str]:
        """Each weight the program stores as int8/int4 that OpenVINO runs compressed -> the element type it reads
        it in (``i8``, ``u4``); ``model.weights.uncompressed`` lists the others (warned about at compile)."""
        return self.weights.compressed

    def runtime_precision(self) -> str:
        """The inference precision the compiled model runs with (OpenVINO's INFERENCE_PRECISION_HINT: f32, bf16, f16)."""
        return self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def save(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the OpenVINO IR to ``path`` (``.xml``) and its weights beside it (``.bin``), see ``save_ir``."""
        return save_ir(self.ov_model, path)


def _cache_form(growing: Growing | None) -> str:
    """How the model holds its caches, in words (``OpenVINOModel.cache_form``): empty without caches."""
    if growing is None:
        return ""
    if growing.grown:
        return (
            "growing along the sequence, attention fused by OpenVINO; the IR takes beam_idx (int32 [batch]: "
            "arange(batch))"
        )
    return f"static ({growing.reason})"


# ---- converting and compiling -------------------------------------------------------------------------------
def compile_openvino(
    program: ExportedProgram | Any,
    *,
    dynamic: bool = True,
    threads: int | None = None,
    precision_hint: str | None = "auto",
    warn: bool = True,
    dynamic_quantization: bool = False,
) -> OpenVINOModel:
    """Convert ``program`` with ``openvino.convert_model`` and compile it for the CPU.

    ``precision_hint`` (see ``precision``): ``"auto"`` (default) compiles a bf16 plan with OpenVINO's
    bf16 hint where the CPU has native bf16 and every layer then honours the plan, else with ``"f32"``, which runs
    the dtypes the graph states (its bf16 casts corrected to round to nearest; fp16 ops run in f32 there); an
    fp16 plan is compiled with the f16 hint first where OpenVINO reports fp16 kernels (``FP16`` in the CPU's
    capabilities); ``"bf16"`` / ``"f16"`` force that hint;
    ``None`` leaves OpenVINO's own default untouched (bf16 on CPUs with native bf16), whose overrides of
    precast's decisions are then warned about. ``threads``: OpenVINO's ``INFERENCE_NUM_THREADS`` (default: its
    own choice). ``dynamic``: keep or make dim 0 dynamic. ``warn``: one ``PlanOverrideWarning`` line summing up
    the layers that do not run precast's dtype (``model.plan.overridden`` lists them), one line when auto gave up
    the faster hint. Under the bf16 hint the ops the plan keeps fp32 are marked to stay in f32
    (``precision.keep_plan_fp32``); ``model.plan.reason`` says why the hint was chosen.
    Weights the program stores as int8/int4 run compressed where OpenVINO can (``model.compressed``; one
    ``CompressedWeightWarning`` line names those it runs on an f32 copy). ``dynamic_quantization``: let OpenVINO
    quantize the activations of those layers to 8 bits on the fly (its ``DYNAMIC_QUANTIZATION_GROUP_SIZE``, on CPUs
    with VNNI): off by default, since the program computes them in its own dtype (``compressed``).
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
    )


def _check_options(precision_hint: str | None, threads: int | None, dynamic_quantization: bool) -> None:
    """Refuse, in one line each, a precision hint, thread count or dynamic-quantization flag that is not
    one."""
    if precision_hint not in HINTS:
        raise PrecastError(
            f"{WHERE}: precision_hint={precision_hint!r}; use 'auto' (default), 'f32' "
            "(the program's own dtypes), 'bf16', 'f16' or None (OpenVINO's default)"
        )
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise PrecastError(f"{WHERE}: threads={threads!r}; give a positive int")
    if not isinstance(dynamic_quantization, bool):
        raise PrecastError(f"{WHERE}: dynamic_quantization={dynamic_quantization!r}; give True or False")


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


def _build(
    ep: ExportedProgram,
    state: dict[str, str],
    precision_hint: str | None,
    threads: int | None,
    dynamic_quantization: bool,
) -> _Built:
    """Convert ``ep``, compile it with the hint that honours its plan, and check the compiled model against
    the plan (each layer's precision) and the weights the program stores as int8/int4 (which run
    compressed)."""
    ov_model, graph_module, growing = convert(ep, state)
    weights = shared_tensors(ov_model, graph_module)  # what OpenVINO reads from torch's memory: kept alive
    kv_precision, options = _runtime_options(ov_model, graph_module, growing, dynamic_quantization)
    compiled, plan = _compile_for_plan(ov_model, graph_module, precision_hint, threads, kv_precision, options)
    weight_check = check_weights(compiled, graph_module)
    plan.batch_norms = rounded_batch_norms(ep.graph)
    return _Built(ov_model, compiled, plan, weights, growing, weight_check)


def _runtime_options(
    ov_model: Any, graph_module: Any, growing: Growing | None, dynamic_quantization: bool
) -> tuple[str | None, dict[str, Any]]:
    """The cache precision (growing caches only) and the compile options precast sets, each also written into
    the model's runtime info, so the IR carries it."""
    kv_precision = cache_precision(ov_model) if growing is not None and growing.grown else None
    if kv_precision is not None:  # carried by the IR too: plain OpenVINO's default for this cache is u8
        ov_model.set_rt_info(kv_precision, ["runtime_options", "KV_CACHE_PRECISION"])
    options: dict[str, Any] = {"KV_CACHE_PRECISION": kv_precision} if kv_precision is not None else {}
    if stored_weights(graph_module) and not dynamic_quantization:  # the IR carries it too
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
) -> tuple[Any, PlanCheck]:
    """Compile with each hint ``hints_to_try`` gives until one honours the plan (the last is kept regardless);
    the plan check says which hint, why it was chosen, and why an earlier one was given up."""
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
    return compiled, plan


def _compile(
    core: Any, model: Any, hint: str | None, threads: int | None, options: dict[str, Any] | None = None
) -> Any:
    config: dict[str, Any] = dict(options or {})  # KV_CACHE_PRECISION, DYNAMIC_QUANTIZATION_GROUP_SIZE
    if hint is not None:
        config["INFERENCE_PRECISION_HINT"] = hint
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
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
