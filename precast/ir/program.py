"""ExportedProgram surgery: a mutable view of a program's graph, signature and constants.

Passes change the graph; this module keeps the graph signature, state_dict and constants in step with it, and
builds a fresh, standard ``ExportedProgram`` at the end. It also records where each stored constant came from
(original name and dtype), which ``CompiledModel.load_weights`` and the report read back.

Input: an ExportedProgram. Output: a private ``Program`` to rewrite, and back to an ExportedProgram.
"""

from __future__ import annotations

import copy
import json
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)

from precast.dtypes import absmax, long_name
from precast.errors import PrecastError
from precast.ir.mutation import written_constant_targets

CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
# key under node.meta["custom"] (serialized by torch.export.save) where precast keeps its records
META_KEY = "precast"


@dataclass(frozen=True)
class ConstantSource:
    """Where a stored constant came from: ``stored`` (FQN in the converted program) holds
    ``original``'s value cast from ``original_dtype`` to ``dtype``, or, with ``derive``, one part of its
    quantized form (``precast.quant.graph.stored_value`` recomputes either from the original)."""

    stored: str
    original: str
    original_dtype: torch.dtype
    dtype: torch.dtype
    # a quantized weight's part (``precast.quant.formats.derive_tag``: "int8-bf16.q", ...), None for a cast
    derive: str | None = None


class Program:
    """A program under conversion. Owns a deep copy of the graph module; never mutates the input program."""

    def __init__(
        self, ep: ExportedProgram, cache_dtype: torch.dtype | None = None, weight_rules: object | None = None
    ):
        self.source = ep
        # cache_dtype=: the dtype lower() stores the program's caches in (precast/passes/caches.py)
        self.cache_dtype = cache_dtype
        # weight_format=: which weights lower() stores in 8/4 bits (precast/passes/quantize.WeightRules)
        self.weight_rules = weight_rules
        self.gm: torch.fx.GraphModule = copy.deepcopy(ep.graph_module)
        self.graph = self.gm.graph
        # fx copies node.meta shallowly: the dicts precast writes into (custom meta) must be its own
        for module in self.gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    if "custom" in node.meta:
                        node.meta["custom"] = copy.deepcopy(node.meta["custom"])
        self.state_dict: dict[str, torch.Tensor] = dict(ep.state_dict)
        self.constants: dict[str, object] = dict(ep.constants)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        specs = ep.graph_signature.input_specs
        assert len(placeholders) == len(specs), "graph and signature disagree"
        self.input_spec: dict[torch.fx.Node, InputSpec] = dict(zip(placeholders, specs, strict=True))
        self.output_specs: list[OutputSpec] = list(ep.graph_signature.output_specs)
        # stored FQN -> ConstantSource, for constants precast created by casting
        self.sources: dict[str, ConstantSource] = {}
        # placeholders whose stored dtype the conversion changed (cache_dtype=) -> the dtype the program gave them
        self.retyped: dict[torch.fx.Node, torch.dtype] = {}
        # the conversion's private fake mode and shape env (precast.classify.fake_state), made on first use
        self.fake_state: object | None = None
        # weights streamed from files (``precast.weights.files.WeightFiles``): the constants holding no values
        # are read from there, one at a time, by the few rules that read values (init_max)
        self.weights: object | None = None
        # constants the program writes: the conversion (and the program it returns) owns copies of them, so
        # no forward precast runs, and no call of the converted program, changes the caller's state
        self.written: set[str] = written_constant_targets(self.graph, self.input_spec, self.output_specs)
        for store in (self.state_dict, self.constants):
            for name in self.written & set(store):
                store[name] = _private_copy(store[name])
        # constant tensor id -> (weak reference, version, absmax): each weight read once for its range
        self._absmax: dict[int, tuple[weakref.ref, int, float]] = {}

    # ---- constants -------------------------------------------------------------------------------------
    def constant_target(self, node: torch.fx.Node) -> str | None:
        spec = self.input_spec.get(node)
        if spec is None or spec.kind not in CONSTANT_KINDS:
            return None
        return spec.target

    def constant_value(self, node: torch.fx.Node) -> torch.Tensor | None:
        target = self.constant_target(node)
        if target is None:
            return None
        spec = self.input_spec[node]
        if spec.kind == InputKind.CONSTANT_TENSOR or (spec.kind == InputKind.BUFFER and not spec.persistent):
            return self.constants.get(target)  # type: ignore[return-value]
        return self.state_dict.get(target)

    def absmax(self, value: torch.Tensor) -> float:
        """``precast.dtypes.absmax(value)``, computed once per tensor and version: the rules' init_max and the
        fold's clamp check both need it for every weight (measured: a third of policy rules' conversion time
        on a 0.2 B Llama when each read all the weights itself)."""
        if value.is_inference():  # no version counter to tell a write by: never memoized
            return absmax(value)
        entry = self._absmax.get(id(value))
        if entry is not None and entry[0]() is value and entry[1] == value._version:
            return entry[2]
        result = absmax(value)
        self._absmax[id(value)] = (weakref.ref(value), value._version, result)
        return result

    def original_of(self, target: str) -> ConstantSource | None:
        return self.sources.get(target)

    def _free_name(self, wanted: str) -> str:
        name, i = wanted, 1
        while name in self.state_dict or name in self.constants:
            i += 1
            name = f"{wanted}_{i}"
        return name

    def add_constant_like(
        self,
        like: torch.fx.Node,
        value: torch.Tensor,
        suffix: str,
        *,
        kind: InputKind | None = None,
        val: torch.Tensor | None = None,
        base: str | None = None,
    ) -> torch.fx.Node:
        """A new constant placeholder of the same kind as ``like`` (a constant placeholder; ``kind``: another),
        holding ``value``, named ``base`` (else ``like``'s target) + ``suffix``. Its fake value is ``like``'s in
        ``value``'s dtype, or ``val`` (another shape).

        Inserted right after ``like`` so placeholders stay grouped by kind, as export orders them.
        """
        like_spec = self.input_spec[like]
        spec = (
            like_spec if kind is None else InputSpec(kind, like_spec.arg, like_spec.target, persistent=True)
        )
        target = self._free_name(f"{base or spec.target}{suffix}")
        anchor = like
        if (
            kind is not None
        ):  # after the last placeholder of that kind (export's order: parameters, buffers, ...)
            order = [InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR]
            before = set(order[: order.index(kind) + 1]) if kind in order else {kind}
            for n in self.graph.nodes:
                if n.op == "placeholder" and n in self.input_spec and self.input_spec[n].kind in before:
                    anchor = n
        with self.graph.inserting_after(anchor):
            node = self.graph.placeholder(self._free_node_name(like.name + suffix.replace(".", "_")))
        fake = like.meta["val"]
        if val is not None:
            node.meta["val"] = val
        else:
            node.meta["val"] = fake.to(value.dtype) if isinstance(fake, torch.Tensor) else value
        node.meta["tensor_meta"] = None
        if spec.kind == InputKind.PARAMETER:
            self.state_dict[target] = torch.nn.Parameter(value, requires_grad=False)
        elif spec.kind == InputKind.BUFFER and spec.persistent:
            self.state_dict[target] = value
        else:
            self.constants[target] = value
        self.input_spec[node] = InputSpec(
            kind=spec.kind, arg=TensorArgument(name=node.name), target=target, persistent=spec.persistent
        )
        return node

    def _free_node_name(self, wanted: str) -> str:
        # FX's own record of the names it has handed out (create_node checks the same set): no scan per call
        names = self.graph._graph_namespace._used_names
        name, i = wanted, 1
        while name in names:
            i += 1
            name = f"{wanted}_{i}"
        return name

    def rename_constant(self, node: torch.fx.Node, new_target: str) -> None:
        spec = self.input_spec[node]
        for store in (self.state_dict, self.constants):
            if spec.target in store:
                store[new_target] = store.pop(spec.target)
        self.input_spec[node] = InputSpec(
            kind=spec.kind, arg=spec.arg, target=new_target, persistent=spec.persistent
        )

    def remove_unused_constants(self, keep: set[torch.fx.Node] = frozenset()) -> list[str]:
        """Drop constant placeholders nothing reads any more (except ``keep``); returns their FQNs."""
        dropped = []
        for node in list(self.graph.nodes):
            if (
                node.op == "placeholder"
                and not node.users
                and node not in keep
                and self.constant_target(node) is not None
            ):
                spec = self.input_spec.pop(node)
                self.state_dict.pop(spec.target, None)
                self.constants.pop(spec.target, None)
                self.graph.erase_node(node)
                dropped.append(spec.target)
        return dropped

    # ---- output ----------------------------------------------------------------------------------------
    def to_exported_program(self) -> ExportedProgram:
        """A standard ExportedProgram from the current graph (placeholders and outputs re-synced by position)."""
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        input_specs = []
        for n in placeholders:
            spec = self.input_spec[n]
            arg = TensorArgument(name=n.name) if isinstance(spec.arg, TensorArgument) else spec.arg
            input_specs.append(
                InputSpec(kind=spec.kind, arg=arg, target=spec.target, persistent=spec.persistent)
            )
        out_args = self.graph.output_node().args[0]
        output_specs = []
        for spec, arg in zip(self.output_specs, out_args, strict=True):
            new_arg = TensorArgument(name=arg.name) if isinstance(spec.arg, TensorArgument) else spec.arg
            output_specs.append(OutputSpec(kind=spec.kind, arg=new_arg, target=spec.target))
        sig = ExportGraphSignature(input_specs=input_specs, output_specs=output_specs)
        used = {s.target for s in input_specs if s.kind in CONSTANT_KINDS}
        state_dict = {k: v for k, v in self.state_dict.items() if k in used}
        constants = {k: v for k, v in self.constants.items() if k in used or not isinstance(v, torch.Tensor)}
        self._record_sources()
        src = self.source
        with warnings.catch_warnings():
            # torch 2.13's own LeafSpec deprecation fires when its TreeSpecs are deep-copied: not the user's
            # concern, and it would print once per conversion
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
            module_call_graph = copy.deepcopy(src.module_call_graph)
        return ExportedProgram(
            root=self.gm,
            graph=self.graph,
            graph_signature=sig,
            state_dict=state_dict,
            range_constraints=copy.copy(src.range_constraints),
            module_call_graph=module_call_graph,
            example_inputs=src.example_inputs,
            constants=constants,
            verifiers=list(src.verifiers),
        )

    def _record_sources(self) -> None:
        """Write the constant sources onto the nodes that read each constant (custom meta survives save/load,
        placeholder meta does not), so ``constant_sources`` can rebuild them from any saved program."""
        by_target = {spec.target: node for node, spec in self.input_spec.items()}
        for stored, src in self.sources.items():
            node = by_target.get(stored)
            if node is None:
                continue
            record = [
                src.original,
                long_name(src.original_dtype),
                long_name(src.dtype),
            ]
            if src.derive is not None:
                record.append(src.derive)
            for user in _readers(node):
                custom = user.meta.setdefault("custom", {})
                entry = custom.setdefault(META_KEY, {})
                entry.setdefault("constants", {})[stored] = record


def _private_copy(value: object) -> object:
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def strip_dtype_asserts(module: torch.nn.Module) -> torch.nn.Module:
    """Remove export's ``_assert_tensor_metadata`` checks from ``module``'s graphs (region subgraphs too): they
    pin the dtypes seen at export, which a reference run under autocast or in float32 legitimately changes.

    ``ExportedProgram.module()`` shares the region subgraph modules with the program it came from: each of those
    is replaced by a copy before its checks are removed, so the program keeps its own (measured on torch 2.13:
    stripping in place changed what the next conversion of the caller's program produced)."""
    assert_op = torch.ops.aten._assert_tensor_metadata.default
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        if not any(n.op == "call_function" and n.target is assert_op for n in sub.graph.nodes):
            continue
        if name:  # a submodule: a private copy in its parent (the root is ``module()``'s own)
            parent_name, _, attr = name.rpartition(".")
            sub = torch.fx.GraphModule(sub, copy.deepcopy(sub.graph))
            setattr(module.get_submodule(parent_name), attr, sub)
        for node in list(sub.graph.nodes):
            if node.op == "call_function" and node.target is assert_op:
                sub.graph.erase_node(node)
        sub.recompile()
    return module


def written_targets(ep: ExportedProgram) -> set[str]:
    """FQNs of the constants ``ep`` writes (in place, inside regions too, or through mutation outputs)."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    specs = dict(zip(placeholders, ep.graph_signature.input_specs, strict=True))
    return written_constant_targets(ep.graph, specs, list(ep.graph_signature.output_specs))


def private_state(ep: ExportedProgram) -> ExportedProgram:
    """The same program with its own copies of the constants it writes (read-only weights stay shared):
    running it leaves ``ep``'s state alone. For the forwards precast runs itself (verification, calibration)."""
    written = written_targets(ep)
    if not written:
        return ep
    out = copy.copy(ep)
    out._state_dict = {k: _private_copy(v) if k in written else v for k, v in ep.state_dict.items()}
    out._constants = {k: _private_copy(v) if k in written else v for k, v in ep.constants.items()}
    return out


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """call_function nodes reading ``node`` (the placeholder's own meta is not serialized)."""
    return [u for u in node.users if u.op == "call_function"]


def constant_sources(ep: ExportedProgram) -> dict[str, ConstantSource]:
    """For a program precast converted (in memory or loaded from disk): stored FQN -> where it came from.

    Constants precast did not create map to themselves (same name, same dtype).
    """
    found: dict[str, ConstantSource] = {}
    for node in ep.graph.nodes:
        entry = (node.meta.get("custom") or {}).get(META_KEY) or {}
        for stored, (original, odt, dt, *derive) in (entry.get("constants") or {}).items():
            found[stored] = ConstantSource(
                stored, original, getattr(torch, odt), getattr(torch, dt), derive[0] if derive else None
            )
    for spec in ep.graph_signature.input_specs:
        if spec.kind in CONSTANT_KINDS and spec.target not in found:
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if isinstance(value, torch.Tensor):
                found[spec.target] = ConstantSource(spec.target, spec.target, value.dtype, value.dtype)
    return found


def node_records(ep: ExportedProgram) -> dict[str, dict]:
    """node name -> precast's JSON record for that node (decision), from custom meta."""
    out = {}
    for node in ep.graph.nodes:
        entry = (node.meta.get("custom") or {}).get(META_KEY)
        if entry and "decision" in entry:
            out[node.name] = entry["decision"]
    return out


def dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True)


def program_devices(
    ep: ExportedProgram, counts: Callable[[torch.Tensor], bool] | None = None
) -> tuple[list[str], list[str]]:
    """The device types of the program's tensor constants (state_dict, then constants; those ``counts`` accepts,
    else all: a streamed weight at ``meta`` or at its FakeTensor's device) and of its tensor inputs, each in the
    program's order: the one reading of the program's device, from which each caller takes its own."""
    constants = [
        v.device.type
        for v in list(ep.state_dict.values()) + list(ep.constants.values())
        if isinstance(v, torch.Tensor) and (counts is None or counts(v))
    ]
    inputs = [
        n.meta["val"].device.type
        for n in ep.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    return constants, inputs


def program_device_type(ep: ExportedProgram) -> str:
    """Device type of the program's floating constants (else its inputs); error if they disagree."""
    # meta: streamed weights, on no device yet (a FakeTensor counts at its device)
    constants, inputs = program_devices(ep, lambda v: v.is_floating_point() and v.device.type != "meta")
    devices = set(constants) or set(inputs)
    if len(devices) > 1:
        raise PrecastError(
            f"the program's floating parameters live on several device types ({', '.join(sorted(devices))}); pass "
            "device_type='cuda' or 'cpu' to say which autocast table to apply"
        )
    return devices.pop() if devices else "cpu"
