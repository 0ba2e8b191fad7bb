"""``OpenVINOModel``: a program compiled by OpenVINO for the CPU, as ``precast.compile(program,
backend="openvino")`` (``model.py``) makes it and ``saved.open_form`` opens a saved one: inputs checked against
the program's signature before OpenVINO runs, torch tensors out, a decoder's KV cache held as OpenVINO state
(``kv_state``) with ``reset()``, the plan check, and ``save`` (the IR as converted).

Input: what a compile made (the OpenVINO models, the plan check, how the caches are held). Output: a callable.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from precast.backends.openvino.compressed import WeightCheck
from precast.backends.openvino.growing_cache import Growing
from precast.backends.openvino.ir_files import save_ir
from precast.backends.openvino.kv_state import GrowingState, initial_values, ov_tensor, state_values, to_torch
from precast.backends.openvino.plan_check import PlanCheck
from precast.runtime.owner import StateOwner, holds_state
from precast.runtime.signature import ProgramSignature


class OpenVINOModel:
    """A program compiled by OpenVINO for the CPU. Call it like the program's module (the same input checks as
    ``precast.compile``'s AOTInductor model, before OpenVINO runs); outputs are torch tensors in the program's
    output structure."""

    def __init__(
        self,
        ov_model: Any,
        compiled: Any,
        program: ExportedProgram | None,
        plan: PlanCheck,
        *,
        weights: tuple[torch.Tensor, ...] = (),
        growing: Growing | None = None,
        precision_hint: str | None,
        threads: int | None,
        compile_seconds: float,
        weight_check: WeightCheck | None = None,
        dynamic_quantization: bool = False,
        config: dict[str, Any] | None = None,
        form_model: Any = None,
        signature: ProgramSignature | None = None,
        out_spec: Any = None,
    ):
        self.ov_model = ov_model  # the openvino.Model (what ``save`` writes)
        self.compiled = compiled  # the openvino.CompiledModel
        # the form compiled (``precision.prepare``'s copy for the hint) and the options it was compiled with but the
        # thread count: what ``saved.save_form`` writes, so a saved model opens without converting (``saved``)
        self.form_model = form_model
        self.config = {k: v for k, v in (config or {}).items() if k != "INFERENCE_NUM_THREADS"}
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
        # what the model accepts (dynamic batch where it could be); a saved form gives them without the program
        self.signature = signature if signature is not None else ProgramSignature.from_program(program)
        self._out_spec = out_spec if program is None else program.call_spec.out_spec
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
