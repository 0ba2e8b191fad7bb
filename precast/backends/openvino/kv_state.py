"""A program that writes a KV cache, on OpenVINO: the cache as OpenVINO state (ReadValue/Assign variables).

OpenVINO's frontend converts a program's buffers to constants (``ExportedProgram.module()`` unlifts them), so a
cache write would be lost and every call would restart from the exported cache. Instead:

1. ``carried_state`` (``precast/passes/caches.py``) sorts the buffers the program writes: a **cache** (written
   only by stores: ``index_copy_``, ``index_put_``, a slice scatter, at positions from an input) is carried as
   state; a buffer **overwritten** whole before any read on every call (transformers' ``cumulative_length``,
   set from ``cache_position`` then advanced) carries nothing from one call to the next and becomes a constant;
   anything else (a running statistic, a step counter) is refused with one line.
2. ``stateful_module``: the decomposed program as a GraphModule taking the user inputs, then each cache as an
   explicit input (in the dtype precast stored it in, ``cache_dtype``), and returning the user outputs, then
   each cache's new value (the program's ``BUFFER_MUTATION`` output); every other constant a ``get_attr``.
3. ``make_stateful``: after ``openvino.convert_model``, each cache's Parameter/Result pair becomes one variable
   (id: the buffer's name), read by a ``ReadValue`` where the program reads the cache and written by an
   ``Assign`` of its new value, as ``apply_make_stateful_transformation`` does for optimum-intel's decoders. The
   variable starts from the program's buffer: a ``ReadValue`` without an initial value where the buffer is all
   zeros (OpenVINO's defined start, zeros; the recipe's caches), else with the buffer as its initial value
   (a ``Constant``), so the IR saved and reloaded in plain OpenVINO starts from the program's cache too, and
   ``infer_request.reset_state()`` returns to it.

4. ``GrowingState``: where ``growing_cache`` rewrote the caches into OpenVINO's fused growing form, the live positions
   and the static cache's contract, checked before every call; the state read back as the static buffers; the
   caches' dtype as the precision OpenVINO's fused attention keeps them in (``cache_precision``).

Tensors cross between torch and OpenVINO here (``ov_tensor``, ``to_torch``: a call's inputs and outputs, the
variables' values), through ``precast.runtime.arrays``.

Input: an ExportedProgram decomposed with OpenVINO's table. Output: the GraphModule to convert and the state
names; then the stateful ``openvino.Model``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from precast.errors import PrecastError
from precast.ir.program import Program, written_targets
from precast.runtime import arrays

if TYPE_CHECKING:
    from precast.backends.openvino.growing_cache import Growing


def carried(ep: ExportedProgram, what: str) -> dict[str, str]:
    """FQN -> "cache" / "overwritten" for each buffer ``ep`` writes (empty: no state); a written buffer that is
    neither is one PrecastError line naming the op and what to do."""
    if not written_targets(ep):
        return {}
    from precast.passes.caches import carried_state

    try:
        return carried_state(Program(ep))
    except PrecastError as exc:
        raise PrecastError(
            f"{what}: {exc}; OpenVINO carries a KV cache (a buffer written only by stores) from call to call, "
            "not such state: serve this program with precast.compile (AOTInductor) or ExecuTorch",
            code=exc.code,
            node=exc.node,
        ) from exc


def stateful_module(ep: ExportedProgram, state: dict[str, str]) -> tuple[torch.fx.GraphModule, list[str]]:
    """``ep`` (decomposed, functional) as a GraphModule: user inputs then one input per cache; user outputs then
    each cache's new value. Every other constant (weights, the overwritten buffers) is a ``get_attr``. Returns
    the module and the caches' FQNs in the order of their inputs and outputs."""
    sig = ep.graph_signature
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    specs = dict(zip(placeholders, sig.input_specs, strict=True))
    caches = [n for n in placeholders if state.get(specs[n].target) == "cache"]
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in [p for p in placeholders if specs[p].kind == InputKind.USER_INPUT] + caches:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for i, n in enumerate(p for p in placeholders if p not in env):
        target = specs[n].target
        value = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
        attr = f"_precast_constant_{i}"
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        root.register_buffer(attr, value)
        env[n] = graph.create_node("get_attr", attr, name=n.name)
        env[n].meta = dict(n.meta)
    output = None
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            output = n
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    assert output is not None
    values = list(output.args[0])
    user = [
        env[v] if isinstance(v, torch.fx.Node) else v
        for v, s in zip(values, sig.output_specs, strict=True)
        if s.kind == OutputKind.USER_OUTPUT
    ]
    by_target = {
        s.target: v
        for v, s in zip(values, sig.output_specs, strict=True)
        if s.kind == OutputKind.BUFFER_MUTATION
    }
    names = [specs[n].target for n in caches]
    graph.output(tuple(user + [env[by_target[name]] for name in names]))
    return torch.fx.GraphModule(root, graph), names


def make_stateful(
    model: Any, names: list[str], initial: dict[str, torch.Tensor], users: int, *, growing: bool = False
) -> Any:
    """``model`` (converted from ``stateful_module``: ``users`` user outputs, then one per cache) with each
    cache's Parameter/Result pair made one variable named after the cache, started from ``initial[name]``.
    ``growing`` (``growing_cache``): the caches grow along dim 2 and start empty (the ``beam_idx`` input stays)."""
    import openvino as ov
    from openvino.op.util import Variable, VariableInfo

    params = list(model.get_parameters())
    results = list(model.get_results())
    first_cache = len(params) - len(names)
    if first_cache < 0 or len(results) != users + len(names):
        raise PrecastError(
            f"precast.compile(backend='openvino'): the converted model has {len(params)} inputs and "
            f"{len(results)} outputs, not the program's inputs and {len(names)} cache(s)"
        )
    sinks = []
    for name, param, result in zip(names, params[first_cache:], results[users:], strict=True):
        info = VariableInfo()
        info.variable_id = name
        info.data_type = param.get_element_type()
        info.data_shape = param.get_partial_shape()
        variable = Variable(info)
        start = initial[name]
        if growing:  # empty along the sequence: the live positions are all the variable holds
            shape = list(start.shape)
            shape[2] = 0
            init = ov.op.Constant(ov_tensor(torch.zeros(shape, dtype=start.dtype), shared=False))
            read = ov.op.read_value(init, variable)
        elif bool((start == 0).all()):  # OpenVINO starts (and resets) an uninitialised variable at zeros
            read = ov.op.read_value(variable)
        else:
            init = ov.op.Constant(ov_tensor(start, shared=False))
            read = ov.op.read_value(init, variable)
        read.set_friendly_name(f"{name}/ReadValue")
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(read.output(0))
        value = result.input_value(0)
        # Assign takes a node (its first output): a value that is not one is passed through a no-op Convert
        node = value.get_node() if value.get_index() == 0 else ov.op.Convert(value, value.get_element_type())
        assign = ov.op.assign(node, variable)
        assign.set_friendly_name(f"{name}/Assign")
        sinks.append(assign)
    return ov.Model(results[:users], sinks, params[:first_cache], model.get_friendly_name())


def cache_precision(model: Any) -> str:
    """The dtype precast stored the caches in (``cache_dtype``), as OpenVINO's ``KV_CACHE_PRECISION``: its fused
    attention keeps the cache in that precision, not the variable's (its default on x86 is u8, quantised)."""
    kinds = {
        op.get_output_element_type(0).get_type_name()
        for op in model.get_ordered_ops()
        if op.get_type_name() == "ReadValue"
    }
    return kinds.pop() if len(kinds) == 1 else "f32"  # caches of several dtypes: none rounded further


def state_values(request: Any) -> dict[str, torch.Tensor]:
    """The variables an infer request holds, by name, as torch tensors (copies). Before its first inference (and
    after ``reset_state``) OpenVINO reports zeros for a variable whose initial value it has not evaluated yet:
    ``initial_values`` says what that inference will start from."""
    return {s.name: to_torch(s.state) for s in request.query_state()}


def initial_values(model: Any) -> dict[str, torch.Tensor]:
    """What each variable of ``model`` starts from: its ``ReadValue``'s initial constant, or zeros."""
    out = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "ReadValue":
            continue
        attrs = op.get_attributes()  # variable_id, variable_type (f32, bf16, ...), variable_shape
        if op.get_input_size():
            out[attrs["variable_id"]] = to_torch(op.input_value(0).get_node().get_tensor_view())
        else:
            dtype = _TORCH_DTYPES[str(attrs["variable_type"])]
            out[attrs["variable_id"]] = torch.zeros([int(d) for d in attrs["variable_shape"]], dtype=dtype)
    return out


_TORCH_DTYPES = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i64": torch.int64,
    "i32": torch.int32,
    "boolean": torch.bool,
}


# ---- tensors in and out (through numpy: ``precast.runtime.arrays``) ----------------------------------------
def ov_tensor(t: torch.Tensor, *, shared: bool) -> Any:
    """``t`` as an ``openvino.Tensor`` of its dtype: over torch's memory (``shared``: the caller keeps ``t``
    alive while OpenVINO reads it, an input of one call) or over a copy (an initial value OpenVINO keeps)."""
    import openvino as ov

    data = arrays.to_numpy(t, copy=not shared)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: hand OpenVINO the bits
        return ov.Tensor(data, list(t.shape), ov.Type.bf16)
    return ov.Tensor(data, shared_memory=True) if shared else ov.Tensor(data)


def to_torch(tensor: Any) -> torch.Tensor:
    """A copy (the infer request reuses its output buffers) as a torch tensor of the same dtype (a bf16
    tensor's data comes as 2-byte values: its bits, reinterpreted)."""
    return arrays.to_torch(tensor.data, bfloat16=str(tensor.element_type.get_type_name()) == "bf16")


class GrowingState:
    """The live positions of caches held in OpenVINO's growing form (``growing_cache.py``), and the contract the
    program's static cache had: a call's positions (``cache_position``) are consecutive and start at the live
    length (continue), at 0 (a new conversation) or in between (the cache is cut back there); a gap past the live
    length is refused in one line, before OpenVINO runs."""

    def __init__(self, growing: Growing, position_index: int, initial: dict[str, torch.Tensor]):
        self.growing = growing
        self.dtypes = {name: t.dtype for name, t in initial.items()}  # each variable's (empty at the start)
        self.position_index = position_index  # in the program's flat user inputs
        self.beam = ov_tensor(torch.arange(growing.batch, dtype=torch.int32), shared=False)
        self.live = 0

    def begin(self, request: Any, positions: Any) -> int:
        """Check ``positions``, bring the variables to their start; returns the live length after the call."""
        values = positions.reshape(-1).tolist()
        start = values[0]
        if values != list(range(start, start + len(values))):
            raise PrecastError(
                f"compiled program: input {self.growing.positions!r}: positions {values[:6]}"
                f"{'...' if len(values) > 6 else ''} are not consecutive; OpenVINO holds this cache as a growing "
                "one (its fused attention), written at consecutive positions: pass cache_position[0] + "
                "arange(seq)"
            )
        if start > self.live:
            raise PrecastError(
                f"compiled program: input {self.growing.positions!r}: position {start} leaves a gap after the "
                f"{self.live} position(s) the cache holds; continue at {self.live}, or start over at an earlier "
                "position (0, or reset(), for a new conversation)"
            )
        if start == 0 and self.live:
            request.reset_state()
        elif start < self.live:
            self.cut(request, start)
        return start + len(values)

    def cut(self, request: Any, length: int) -> None:
        """Keep the first ``length`` positions of every cache."""
        import openvino as ov

        for s in request.query_state():
            held = s.state
            data = held.data[:, :, :length].copy()
            s.state = ov.Tensor(data, list(data.shape), held.element_type)

    def static_view(self, request: Any, started: bool) -> dict[str, torch.Tensor]:
        """The caches as the program's static buffers: the live positions, zeros past them."""
        out = {}
        held = state_values(request) if started and self.live else {}
        for name, shape in self.growing.shapes.items():
            full = torch.zeros(shape, dtype=self.dtypes[name])
            if name in held:
                full[:, :, : held[name].shape[2]] = held[name]
            out[name] = full
        return out
