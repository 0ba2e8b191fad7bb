"""Capture: get an ExportedProgram from what the user has (a program, or a module + example inputs, exported here).
Files and factory specs are read by ``pipeline/load.py``.

Input: an ExportedProgram, or a module + example inputs. Output: a ``Captured`` (the ExportedProgram, and for a
module the caller's tensor behind each constant).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec
from torch.overrides import TorchFunctionMode

from precast.errors import PrecastError, first_line
from precast.ir.inputs import normalize_inputs
from precast.ir.module_state import private_tensors
from precast.ir.program import written_targets
from precast.threads import TORCH_LOCK


class KeepValuesDistinct(TorchFunctionMode):
    """While precast exports a module for ``policy="torch"``: a dtype conversion that is a no-op at trace time
    (``v.float()`` of an fp32 ``v``) is recorded as a copy, not as an alias of ``v``.

    Exported without autocast, ``v.float()`` returns ``v`` itself, so the tracer records every later use of
    ``v`` as a use of the ``.float()`` node: ``v.float() * 0.5 + v * v`` would compute ``v * v`` in fp32 where
    eager autocast computes it in bf16 (``v`` comes out of a linear). A copy keeps ``v`` distinct, and under
    autocast it is the real cast eager makes. A device move with no dtype (``v.to("cpu")`` on the same device)
    returns ``v`` unrecorded: eager autocast keeps its dtype.
    """

    CONVERSIONS = {
        torch.Tensor.float: torch.float32,
        torch.Tensor.half: torch.float16,
        torch.Tensor.bfloat16: torch.bfloat16,
        torch.Tensor.double: torch.float64,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.CONVERSIONS and len(args) == 1 and not kwargs:
            self_, dtype = args[0], self.CONVERSIONS[func]
            if isinstance(self_, torch.Tensor) and self_.dtype == dtype:
                return torch.ops.aten._to_copy.default(self_, dtype=dtype)
        elif func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            self_ = args[0]
            # .to(device|dtype [, dtype|non_blocking]) and keywords; a positional `copy` (4+ args) is left alone
            if (
                len(args) <= 3
                and not any(isinstance(a, torch.Tensor) for a in args[1:])
                and set(kwargs) <= {"device", "dtype", "non_blocking", "copy", "memory_format"}
            ):
                rest = {k: v for k, v in kwargs.items() if k != "copy"}
                copy = bool(kwargs.get("copy", False))
                device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **rest)
                same_device = device is None or torch.device(device) == self_.device
                plain = not copy and memory_format in (None, torch.preserve_format)
                if same_device and plain and dtype == self_.dtype:
                    return torch.ops.aten._to_copy.default(self_, dtype=dtype)
                if same_device and plain and dtype is None:
                    return self_
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Captured:
    """The program to convert, and for a module: the caller's tensor behind each of the program's non-parameter
    constants (FQN -> the module's own tensor object), which the program holds as precast's private clones."""

    program: ExportedProgram
    origins: dict[str, torch.Tensor] = field(default_factory=dict)


def capture(
    program_or_module: ExportedProgram | torch.nn.Module,
    example_inputs: Any = None,
    dynamic_shapes: Any = None,
    *,
    distinct_values: bool = False,
    autocast: tuple[str, torch.dtype] | None = None,
) -> Captured:
    """The program to convert. A module is exported on private clones of the tensors it holds other than its
    parameters (``ir/module_state.private_tensors``): export's own writes to lifted constants never reach the
    caller. For ``policy="torch"`` on a module: ``distinct_values`` exports with
    ``KeepValuesDistinct``, and ``autocast=(device_type, dtype)`` traces the forward inside that autocast, as
    eager runs it, so model code that reads a tensor's dtype while tracing (``h.to(input_dtype)``,
    ``torch.finfo(q.dtype).min``) sees the low dtype; the enclosing region is marked ``POLICY_REGION`` and
    lowered as the policy, not as one of the program's own regions."""
    if isinstance(program_or_module, ExportedProgram):
        if dynamic_shapes is not None:
            raise PrecastError(
                "dynamic_shapes= applies when precast exports a module; this program is already exported: pass "
                "dynamic_shapes to torch.export.export instead"
            )
        return Captured(program_or_module)
    args, kwargs = _module_inputs(program_or_module, example_inputs)
    ep, origin_of = _export_or_explain(
        program_or_module, args, kwargs, dynamic_shapes, distinct_values, autocast
    )
    if autocast is not None:
        for node in ep.graph.nodes:  # the top-level regions are the one the policy opened around the forward
            if node.op == "call_function" and node.target is torch.ops.higher_order.wrap_with_autocast:
                node.meta[POLICY_REGION] = True
    ep = written_constants_as_buffers(ep)
    held = {**ep.state_dict, **ep.constants}
    origins = {fqn: origin_of[id(v)] for fqn, v in held.items() if id(v) in origin_of}
    return Captured(ep, origins)


def _module_inputs(module: object, example_inputs: Any) -> tuple[tuple, dict]:
    """The example inputs to export ``module`` on, once what cannot be exported is refused (not a module, no
    inputs, an ambient autocast)."""
    if not isinstance(module, torch.nn.Module):
        raise PrecastError(
            f"precast.convert takes a torch.export.ExportedProgram or an nn.Module, got {type(module).__name__}"
        )
    if example_inputs is None:
        raise PrecastError(
            f"converting the module {type(module).__name__} needs example_inputs to export it; pass "
            "example_inputs=(x,) or export it yourself with torch.export.export"
        )
    args, kwargs = normalize_inputs(example_inputs)
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise PrecastError(
            "precast.convert was called under an ambient torch.autocast, which torch.export does not record; "
            "call it outside the autocast block and pass policy='torch' (and dtype=...) to get eager autocast "
            "semantics"
        )
    return args, kwargs


def _export_or_explain(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dynamic_shapes: Any,
    distinct_values: bool,
    autocast: tuple[str, torch.dtype] | None,
) -> tuple[ExportedProgram, dict[int, torch.Tensor]]:
    """``_export``, its failure said in one line: autocast's when the forward exports without it, else the
    export's, with how the example inputs bound to the forward."""
    name = type(module).__name__
    try:
        return _export(module, args, kwargs, dynamic_shapes, distinct_values, autocast)
    except PrecastError:
        raise
    except Exception as exc:
        first = first_line(exc)
        # blame autocast only when the forward exports without it: a forward that fails either way (example
        # inputs bound to the wrong parameters) is the export's failure, and says how the inputs were bound
        if autocast is not None and _exports(module, args, kwargs, dynamic_shapes):
            raise PrecastError(
                f"policy='torch': {name} fails under eager torch.autocast({autocast[0]}, {autocast[1]}) itself "
                f"while tracing: {first}; eager autocast has no result to reproduce (export it yourself and "
                "convert with policy=None or 'rules')"
            ) from exc
        raise PrecastError(
            f"torch.export.export failed on {name}: {first} ({binding(module, args, kwargs)}; fix the "
            "export first: see https://pytorch.org/docs/stable/export.html)"
        ) from exc


POLICY_REGION = "precast_policy_region"


def written_constants_as_buffers(ep: ExportedProgram) -> ExportedProgram:
    """The tensors non-strict export lifted as constants and the program writes (a KV cache held by a plain
    object, ``static_cache.layers[i].keys``), as the buffers they are: under the name of the registered buffer
    holding the same tensor when its own placeholder is unused (``key_cache_0``, as a strict export names it),
    else as a non-persistent buffer of the lifted name. torch refuses to ``run_decompositions()`` a program that
    mutates a constant ("Constant lifted_tensor_0 is mutated in the forward method"), and with it AOTInductor
    and ExecuTorch; as buffers, the writes become ``BUFFER_MUTATION`` outputs. ``ep`` is capture's own: its
    graph is edited in place."""
    written = written_targets(ep)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    specs = list(ep.graph_signature.input_specs)
    lifted = [s for s in specs if s.kind == InputKind.CONSTANT_TENSOR and s.target in written]
    if not lifted:
        return ep
    registered: dict[int, tuple[torch.fx.Node, InputSpec]] = {}
    for node, spec in zip(placeholders, specs, strict=True):
        if spec.kind == InputKind.BUFFER:
            value = ep.constants.get(spec.target, ep.state_dict.get(spec.target))
            registered.setdefault(id(value), (node, spec))
    new_specs, unused = [], set()
    for node, spec in zip(placeholders, specs, strict=True):
        if spec.kind != InputKind.CONSTANT_TENSOR or spec.target not in written:
            new_specs.append((node, spec))
            continue
        buffer = registered.get(id(ep.constants[spec.target]))
        if buffer is not None and not buffer[0].users and buffer[0] not in unused:
            unused.add(buffer[0])
            new_specs.append(
                (node, InputSpec(InputKind.BUFFER, spec.arg, buffer[1].target, buffer[1].persistent))
            )
        else:
            new_specs.append((node, InputSpec(InputKind.BUFFER, spec.arg, spec.target, persistent=False)))
    for node in unused:
        ep.graph.erase_node(node)
    ep.graph_module.recompile()
    kept = [spec for node, spec in new_specs if node not in unused]
    used = {spec.target for spec in kept}
    return ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=ExportGraphSignature(kept, list(ep.graph_signature.output_specs)),
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        example_inputs=ep.example_inputs,
        constants={k: v for k, v in ep.constants.items() if k in used or not isinstance(v, torch.Tensor)},
        verifiers=list(ep.verifiers),
    )


def _export(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dynamic_shapes: Any,
    distinct_values: bool,
    autocast: tuple[str, torch.dtype] | None = None,
) -> tuple[ExportedProgram, dict[int, torch.Tensor]]:
    """Non-strict ``torch.export.export`` of ``module`` (inside ``autocast`` when given) on fresh private clones
    of its tensors, and id(clone) -> the caller's tensor. A module that runs only without autograd (a Parameter
    passed as batch_norm's running_var) is traced again under no_grad, as inference runs it, on fresh clones
    (the failed attempt may have written its own); one that fails under no_grad too reports its first failure."""

    def export() -> tuple[ExportedProgram, dict[int, torch.Tensor]]:
        # non-strict export patches process-global state (CURRENT_PATCHER): one thread at a time
        with TORCH_LOCK, private_tensors(module) as origin_of:
            # the autocast wrapper is a shallow copy: made after the swap, it holds the clones too
            traced = module if autocast is None else _in_autocast(module, *autocast)
            with KeepValuesDistinct() if distinct_values else contextlib.nullcontext():
                ep = torch.export.export(traced, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
            return ep, origin_of

    try:
        return export()
    except Exception:
        if not torch.is_grad_enabled():
            raise
        with torch.no_grad():
            return export()


def _exports(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> bool:
    """Whether ``module`` exports without autocast: after a failure under autocast, says which message is true."""
    try:
        _export(module, args, kwargs, dynamic_shapes, distinct_values=True)
    except Exception:  # noqa: BLE001 - the answer is the bool; the caller raises the first failure itself
        return False
    return True


def binding(module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """How the example inputs bind to ``module.forward``'s parameters, for an export failure's message:
    ``forward(input_ids, inputs_embeds, cache_position)`` given two positional tensors fills ``inputs_embeds``,
    not ``cache_position``."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward without a signature (a builtin): nothing to say
        return "the example inputs bound as given"
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        return f"the example inputs do not fit forward{sig}: {exc}"
    filled = ", ".join(bound.arguments) or "no parameter"
    left = [
        f"{n}={p.default!r}"
        for n, p in sig.parameters.items()
        if n not in bound.arguments
        and p.default is not inspect.Parameter.empty
        and len(repr(p.default)) <= 20
    ]
    return f"the example inputs fill {filled} of forward" + (
        f"; {', '.join(left)} by default" if left else ""
    )


def _in_autocast(module: torch.nn.Module, device_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """A shallow copy of ``module`` (same parameters, buffers and submodules, so the same names) whose forward
    runs inside ``torch.autocast(device_type, dtype)``. The caller's module is not touched."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)

    wrapper = copy.copy(module)
    wrapper.forward = forward
    return wrapper


def policy_region(
    module: ExportedProgram | torch.nn.Module,
    under_autocast: bool,
    device_type: str | None,
    low: torch.dtype | None,
) -> tuple[str, torch.dtype] | None:
    """For a policy that captures under autocast (policy torch) on a module: the autocast (device, dtype) to export
    its forward in (see capture), when that autocast can run here (a CUDA autocast needs a GPU; without one the
    policy applies to the plain export)."""
    if not under_autocast or not isinstance(module, torch.nn.Module):
        return None
    floats = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    device = device_type or (floats[0].device.type if floats else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        return None
    return device, low if low is not None else torch.get_autocast_dtype(device)
