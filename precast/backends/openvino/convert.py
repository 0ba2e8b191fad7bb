"""``openvino.convert_model`` of a program: the OpenVINO model and the decomposed GraphModule it translated (whose
node names the OpenVINO ops carry and whose nodes carry precast's decisions), the caches as OpenVINO variables
where the program writes them (``kv_state``), attention scales kept exact (``precision``), the
rotary embedding in the form OpenVINO fuses (``fusions``); and
OpenVINO's messages cut to the line that names the cause. Compiling and running is ``backends/openvino/model.py``.

Input: an ExportedProgram (checked by ``compile_openvino``). Output: (openvino.Model, torch.fx.GraphModule), or a
one-line PrecastError naming the op OpenVINO cannot convert.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.openvino.fusions import fold_scalar_casts, rotation_reads_promoted
from precast.backends.openvino.growing_cache import Growing, grow_caches
from precast.backends.openvino.kv_state import make_stateful, stateful_module
from precast.backends.openvino.precision import exact_attention_scales
from precast.backends.openvino.weight_forms import compressible_weights
from precast.errors import PrecastError
from precast.optional import require
from precast.progress import loggers_held_back, verbose

EXTRA = "pip install 'precast[openvino]' (openvino==2026.4.1)"


def require_openvino() -> Any:
    """The ``openvino`` module, or a one-line PrecastError naming the extra to install."""
    require("openvino", message=f"OpenVINO is not installed ({{cause}}); {EXTRA}")
    import openvino

    return openvino


def convert(
    ep: ExportedProgram, state: dict[str, str] | None = None
) -> tuple[Any, torch.fx.GraphModule, Growing | None]:
    """``openvino.convert_model`` of ``ep``, the decomposed GraphModule it translated (whose node names the
    OpenVINO ops carry, and whose nodes carry precast's decisions: ``plan_check`` reads both), and how the
    caches are held (None: no state).

    Each user input keeps its static sizes; a symbolic size is a dynamic OpenVINO dimension. ``state`` (from
    ``kv_state.carried``): the caches become OpenVINO variables (``kv_state``), in the growing form
    OpenVINO fuses with attention where the program fits it (``growing_cache``)."""
    ov = require_openvino()
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    inputs = _inputs(ov, ep, state or {})
    try:
        with _quiet(), torch.no_grad():
            if state:
                decoder = _stateful_decoder(TorchFXPythonDecoder, ov, ep, state, inputs)
            else:
                decoder = _decoder(TorchFXPythonDecoder, ep)
            model = ov.convert_model(decoder, input=inputs.shapes)
            fold_scalar_casts(model)
    except Exception as exc:  # noqa: BLE001 - the frontend raises OpConversionFailure, RuntimeError, ...
        raise _conversion_failed(exc) from exc
    if inputs.names:
        users = len(ep.graph_signature.user_outputs)
        model = make_stateful(model, inputs.names, inputs.initial, users, growing=inputs.grown)
    exact_attention_scales(model, decoder.pt_module)
    return model, decoder.pt_module, inputs.growing


@dataclasses.dataclass
class _Inputs:
    """The inputs of the module OpenVINO translates: each one's OpenVINO shape and torch dtype (the user
    inputs, then ``beam_idx`` where the caches grow, then the caches), and the caches carried as variables."""

    shapes: list[Any]
    dtypes: list[torch.dtype]
    names: list[str] = dataclasses.field(default_factory=list)  # the caches, in input (and output) order
    initial: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # each cache's starting value
    growing: Growing | None = None

    @property
    def grown(self) -> bool:
        return bool(self.growing and self.growing.grown)


def _inputs(ov: Any, ep: ExportedProgram, state: dict[str, str]) -> _Inputs:
    """The user inputs' and caches' shapes (a symbolic size: a dynamic dimension) and dtypes; one PrecastError
    line for an input that is not a tensor."""
    caches = [name for name, kind in state.items() if kind == "cache"]
    kinds = (torch.export.graph_signature.InputKind.USER_INPUT,)
    inputs = _Inputs([], [])
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
        inputs.shapes.append(ov.PartialShape(dims))
        inputs.dtypes.append(val.dtype)
    return inputs


def _stateful_decoder(
    decoder_class: type, ov: Any, ep: ExportedProgram, state: dict[str, str], inputs: _Inputs
) -> Any:
    """The decoder (``decoder_class``: ``TorchFXPythonDecoder``) of the program with its caches as explicit
    inputs and outputs (``stateful_module``), grown where they fit (``grow_caches``), the rotations and stored
    weights in the forms OpenVINO fuses and keeps compressed."""
    module, inputs.names = stateful_module(_decomposed(ep), state)
    inputs.initial = {n: ep.state_dict[n] if n in ep.state_dict else ep.constants[n] for n in inputs.names}
    inputs.growing = grow_caches(module, inputs.names, inputs.initial)
    if inputs.grown:
        _add_beam(ov, inputs)
    rotation_reads_promoted(module)
    compressible_weights(module)  # int8/int4 weights in the forms OpenVINO keeps compressed
    # each input's type stated: the frontend would read a held cache's (cache_dtype) from the
    # tensor metadata export wrote before precast retyped it
    return decoder_class(module, input_shapes=inputs.shapes, input_types=inputs.dtypes, dynamic_shapes=True)


def _add_beam(ov: Any, inputs: _Inputs) -> None:
    """The grown caches' inputs: ``beam_idx`` (int32 ``[batch]``) after the user inputs, then each cache,
    dynamic along the sequence (dim 2)."""
    assert inputs.growing is not None
    users = len(inputs.shapes) - len(inputs.names)
    grown = [
        ov.PartialShape([d if i != 2 else -1 for i, d in enumerate(inputs.growing.shapes[n])])
        for n in inputs.names
    ]
    inputs.shapes = inputs.shapes[:users] + [ov.PartialShape([-1])] + grown
    inputs.dtypes = inputs.dtypes[:users] + [torch.int32] + inputs.dtypes[users:]


def _decoder(decoder_class: type, ep: ExportedProgram) -> Any:
    """The decoder (``decoder_class``) of a stateless program: what
    ``TorchFXPythonDecoder.from_exported_program`` does, the rotations and stored weights rewritten
    between."""
    module = _decomposed(ep).module()
    rotation_reads_promoted(module)
    compressible_weights(module)
    return decoder_class(module, dynamic_shapes=True)


def _conversion_failed(exc: BaseException) -> PrecastError:
    """The frontend's failure as one line: its cause, and the route that works (another policy for oneDNN's
    RNN kernel, AOTInductor for any other op)."""
    cause = ov_message(exc)
    route = (
        "convert with policy='rules', which keeps the recurrent layer as aten.lstm in float32 (policy "
        "'torch' takes autocast's oneDNN-only RNN kernel)"
        if "mkldnn_rnn_layer" in cause
        else "keep that op out of the program, or serve it with precast.compile (AOTInductor)"
    )
    return PrecastError(
        f"precast.compile(backend='openvino'): openvino.convert_model failed: {cause}; {route}"
    )


def _decomposed(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` decomposed with OpenVINO's own table (what ``TorchFXPythonDecoder.from_exported_program`` runs)."""
    # torch's retrace annotates the node meta "custom" dict it carries over (a decomposition that calls a
    # torch.compiler.disable'd function adds "_torchdynamo_disable*" keys), and that dict is the caller's own
    # node's: each node reads a copy while it runs, its own dict restored after (the caller's program unchanged)
    originals = {n: n.meta["custom"] for n in ep.graph.nodes if isinstance(n.meta.get("custom"), dict)}
    try:
        for node, custom in originals.items():
            node.meta["custom"] = copy.deepcopy(custom)
        return ep.run_decompositions(_decomposition_table())
    finally:
        for node, custom in originals.items():
            node.meta["custom"] = custom


@functools.cache
def _decomposition_table() -> Any:
    """The table ``TorchFXPythonDecoder.from_exported_program`` builds (torch's default, less the ops OpenVINO
    converts whole), built once by precast from the same public parts instead of read from or written into the
    decoder's private class attribute (``_decomp_table``)."""
    from openvino.frontend.pytorch.torchdynamo.export_decompositions import ops_to_not_decompose
    from torch.export.decomp_utils import CustomDecompTable

    table = CustomDecompTable()
    for op in ops_to_not_decompose():
        with contextlib.suppress(KeyError):  # an op the installed torch no longer decomposes
            table.pop(op)
    return table


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
    """OpenVINO's own log records below ERROR held back while a program converts (``PRECAST_VERBOSE=1`` shows
    them): its frontend's modules log on the ``openvino`` loggers, its ``convert_model`` (ovc) on the root
    logger. Only those: the process's other loggers, and the root logger's records from other code, are left
    alone. The deprecation notices torch gives OpenVINO's frontend while it reads the program (torch 2.13's
    pytree ``FutureWarning`` on ``isinstance(treespec, LeafSpec)``) are held back too: they concern OpenVINO's
    code, not the caller's, and a caller's ``warnings.simplefilter("error")`` made them a conversion failure."""
    if verbose():
        yield
        return
    import openvino

    root = _RecordsFrom(os.path.dirname(openvino.__file__))
    logging.root.addFilter(root)
    try:
        with loggers_held_back(("openvino",)), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logging.root.removeFilter(root)


class _RecordsFrom(logging.Filter):
    """Drops the records below ERROR logged from the files under ``folder`` (a filter on one logger: the
    records logged on that logger itself)."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = os.path.join(folder, "")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.pathname.startswith(self.folder)


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
