"""``openvino.convert_model`` of a program: the OpenVINO model and the decomposed GraphModule it translated (whose
node names the OpenVINO ops carry and whose nodes carry precast's decisions), the caches as OpenVINO variables
where the program writes them (``openvino_state``), attention scales kept exact (``openvino_precision``), the
rotary embedding in the form OpenVINO fuses (``openvino_fusions``); and
OpenVINO's messages cut to the line that names the cause. Compiling and running is ``backends/openvino/model.py``.

Input: an ExportedProgram (checked by ``compile_openvino``). Output: (openvino.Model, torch.fx.GraphModule), or a
one-line PrecastError naming the op OpenVINO cannot convert.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.openvino.fusions import fold_scalar_casts, rotation_reads_promoted
from precast.backends.openvino.growing_cache import Growing, grow_caches
from precast.backends.openvino.kv_state import make_stateful, stateful_module
from precast.backends.openvino.precision import exact_attention_scales
from precast.backends.openvino.weight_forms import compressible_weights
from precast.errors import PrecastError, first_line

EXTRA = "pip install 'precast[openvino]' (openvino==2026.4.1)"


def require_openvino() -> Any:
    """The ``openvino`` module, or a one-line PrecastError naming the extra to install."""
    try:
        import openvino
    except ImportError as exc:
        raise PrecastError(f"OpenVINO is not installed ({first_line(exc)}); {EXTRA}") from exc
    return openvino


def convert(
    ep: ExportedProgram, state: dict[str, str] | None = None
) -> tuple[Any, torch.fx.GraphModule, Growing | None]:
    """``openvino.convert_model`` of ``ep``, the decomposed GraphModule it translated (whose node names the
    OpenVINO ops carry, and whose nodes carry precast's decisions: ``openvino_plan`` reads both), and how the
    caches are held (None: no state).

    Each user input keeps its static sizes; a symbolic size is a dynamic OpenVINO dimension. ``state`` (from
    ``openvino_state.carried``): the caches become OpenVINO variables (``openvino_state``), in the growing form
    OpenVINO fuses with attention where the program fits it (``openvino_kv``)."""
    ov = require_openvino()
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    caches = [name for name, kind in (state or {}).items() if kind == "cache"]
    kinds = (torch.export.graph_signature.InputKind.USER_INPUT,)
    shapes, dtypes = [], []
    for spec in sorted(
        (s for s in ep.graph_signature.input_specs if s.kind in kinds or s.target in caches),
        key=lambda s: s.kind not in kinds,  # user inputs first, then the caches (stateful_module's order)
    ):
        val = _placeholder_val(ep, spec.arg.name)
        if not isinstance(val, torch.Tensor):
            raise PrecastError(
                f"precast.compile(backend='openvino'): input {spec.arg.name!r} is not a tensor; OpenVINO "
                "takes tensor inputs only (export the program with that value fixed)"
            )
        dims = [d if isinstance(d, int) else -1 for d in (_static(s) for s in val.shape)]
        shapes.append(ov.PartialShape(dims))
        dtypes.append(val.dtype)
    names: list[str] = []
    initial: dict[str, torch.Tensor] = {}
    growing = None
    try:
        with _quiet(), torch.no_grad():
            if state:
                module, names = stateful_module(_decomposed(ep), state)
                initial = {n: ep.state_dict[n] if n in ep.state_dict else ep.constants[n] for n in names}
                growing = grow_caches(module, names, initial)
                if growing.grown:  # beam_idx after the user inputs; each cache grows along dim 2
                    users = len(shapes) - len(names)
                    shapes = (
                        shapes[:users]
                        + [ov.PartialShape([-1])]
                        + [
                            ov.PartialShape([d if i != 2 else -1 for i, d in enumerate(growing.shapes[n])])
                            for n in names
                        ]
                    )
                    dtypes = dtypes[:users] + [torch.int32] + dtypes[users:]
                # each input's type stated: the frontend would read a held cache's (cache_dtype) from the
                # tensor metadata export wrote before precast retyped it
                rotation_reads_promoted(module)
                compressible_weights(module)  # int8/int4 weights in the forms OpenVINO keeps compressed
                decoder = TorchFXPythonDecoder(
                    module, input_shapes=shapes, input_types=dtypes, dynamic_shapes=True
                )
            else:  # what TorchFXPythonDecoder.from_exported_program does, the rotations rewritten between
                module = _decomposed(ep).module()
                rotation_reads_promoted(module)
                compressible_weights(module)
                decoder = TorchFXPythonDecoder(module, dynamic_shapes=True)
            model = ov.convert_model(decoder, input=shapes)
            fold_scalar_casts(model)
    except Exception as exc:  # noqa: BLE001 - the frontend raises OpConversionFailure, RuntimeError, ...
        cause = ov_message(exc)
        route = (
            "convert with policy='rules', which keeps the recurrent layer as aten.lstm in float32 (policy "
            "'torch' takes autocast's oneDNN-only RNN kernel)"
            if "mkldnn_rnn_layer" in cause
            else "keep that op out of the program, or serve it with precast.compile (AOTInductor)"
        )
        raise PrecastError(
            f"precast.compile(backend='openvino'): openvino.convert_model failed: {cause}; {route}"
        ) from exc
    if names:
        users = len(ep.graph_signature.user_outputs)
        model = make_stateful(model, names, initial, users, growing=bool(growing and growing.grown))
    exact_attention_scales(model, decoder.pt_module)
    return model, decoder.pt_module, growing


def _decomposed(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` decomposed with OpenVINO's own table (what ``TorchFXPythonDecoder.from_exported_program`` runs)."""
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder
    from openvino.frontend.pytorch.torchdynamo.export_decompositions import ops_to_not_decompose
    from torch.export.decomp_utils import CustomDecompTable

    if TorchFXPythonDecoder._decomp_table is None:
        table = CustomDecompTable()
        for op in ops_to_not_decompose():
            with contextlib.suppress(KeyError):  # an op the installed torch no longer decomposes
                table.pop(op)
        TorchFXPythonDecoder._decomp_table = table
    # torch's retrace annotates the node meta "custom" dict it carries over (a decomposition that calls a
    # torch.compiler.disable'd function adds "_torchdynamo_disable*" keys), and that dict is the caller's own
    # node's: each node reads a copy while it runs, its own dict restored after (the caller's program unchanged)
    originals = {n: n.meta["custom"] for n in ep.graph.nodes if isinstance(n.meta.get("custom"), dict)}
    try:
        for node, custom in originals.items():
            node.meta["custom"] = copy.deepcopy(custom)
        return ep.run_decompositions(TorchFXPythonDecoder._decomp_table)
    finally:
        for node, custom in originals.items():
            node.meta["custom"] = custom


def _placeholder_val(ep: ExportedProgram, name: str) -> Any:
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name)
    return node.meta.get("val")


def _static(size: Any) -> int | None:
    if isinstance(size, int):
        return size
    expr = size.node.expr if isinstance(size, torch.SymInt) else None
    return int(expr) if expr is not None and expr.is_number else None


def ov_message(exc: BaseException) -> str:
    """OpenVINO's messages open with 'Exception from src/...' lines: the first line that says something."""
    lines = [ln.strip().removeprefix("-- ") for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(_PREAMBLE)]
    return (useful or lines or [type(exc).__name__])[0][:300]


# the lines OpenVINO opens its messages with, before the one naming the cause
_PREAMBLE = ("Exception from", "Check '", "FrontEnd API failed", "Model wasn't fully converted", "Summary:")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """OpenVINO's frontend logs a warning with a traceback (on the root logger) for every op of its keep-list
    that the installed torch no longer decomposes: noise for the user, dropped for the conversion only."""
    if os.environ.get("PRECAST_VERBOSE"):
        yield
        return
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def shared_tensors(ov_model: Any, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The tensors of ``module`` (the GraphModule OpenVINO converted) whose memory ``ov_model``'s constants
    point into: OpenVINO's frontend shares a weight's memory with torch instead of copying it, and neither the
    ``openvino.Model`` nor the compiled model keeps the tensor alive. The compiled model holds these, and only
    these (a weight OpenVINO copied is not held twice): without them, a caller who drops the program leaves
    OpenVINO reading freed memory (a segmentation fault on the next call)."""
    pointers = []
    for op in ov_model.get_ordered_ops():
        # (sub-byte types, u4/nf4..., have no numpy view and are never torch's memory)
        if op.get_type_name() == "Constant" and op.get_byte_size() and op.get_element_type().bitwidth >= 8:
            pointers.append(op.get_tensor_view().data.ctypes.data)
    pointers.sort()
    held = []
    seen: set[int] = set()
    # parameters, buffers, and the plain tensor attributes an unlifted program's constants become
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        start = t.data_ptr()
        if start in seen or not t.numel():
            continue
        end = start + t.numel() * t.element_size()
        i = bisect.bisect_left(pointers, start)
        if i < len(pointers) and pointers[i] < end:
            held.append(t)
            seen.add(start)
    return tuple(held)
