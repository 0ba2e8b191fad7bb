"""Caches in low precision (``cache_dtype=``): the floating tensors a program stores into and reads back, a KV
cache above all, held in a low dtype (transformers' ``cache_dtype``, vLLM's ``kv_cache_dtype``).

A cache is a floating buffer (or a constant the export lifted) that the program writes only by *storing* into
it: ``index_copy_``, ``index_put_``, ``copy_``, a scatter, ``fill_``/``zero_`` (a reset), into itself or a view of it.
Anything that reads it and writes back a function of the old value (``add_``, a batch norm's running statistics,
a step counter) is state, not a cache: rounding it to a low dtype at every update compounds, so ``cache_dtype=`` is
refused there with one line.

The stage stores each cache in the low dtype (the program's own copy; the caller's tensor is untouched) and records
it in ``Program.retyped``. The rest follows from the rules every stage already keeps:
- a value stored into it arrives in its dtype: the write cast (``precast/policy/writes.py``);
- a reader sees the value as the program gave it, rounded through the cache's dtype: classify casts a cache read
  back to the program's dtype before the policy decides (``restore_reads``), and a reader that computes in the
  low dtype anyway (attention under autocast) reads it with no cast at all (``simplify`` drops the cast pair).

Input: a Program (before classify), the cache dtype. Output: ``HeldCaches`` (names, bytes before/after).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from precast.dtypes import dtype_name
from precast.errors import PrecastError, where
from precast.ir.graph import ArgPath, tensor_args
from precast.ir.mutation import MUTATION_OUTPUTS, AliasInfo, aliased_input, analyze, written_args
from precast.ir.program import Program
from precast.policy.writes import SAME_DTYPE_WRITES, arg_at

# in-place ops that replace the destination's values without reading them (a store), besides SAME_DTYPE_WRITES
STORES = SAME_DTYPE_WRITES | {"aten::copy_", "aten::fill_", "aten::zero_", "aten::copy"}
# functional stores a functionalized program records (the result replaces the destination's values)
FUNCTIONAL_STORES = frozenset(
    {
        "aten::slice_scatter",
        "aten::select_scatter",
        "aten::diagonal_scatter",
        "aten::as_strided_scatter",
        "aten::fill",
        "aten::zeros_like",
    }
)


@dataclass
class HeldCaches:
    """The caches ``hold_caches`` stored in ``dtype``, by the program's name for each (its placeholder, the name
    every node reason uses: ``b_static_cache_layers_0_keys``): (dtype the program gave it, bytes before, after)."""

    dtype: torch.dtype | None = None
    caches: dict[str, tuple[torch.dtype, int, int]] = field(default_factory=dict)

    @property
    def bytes_before(self) -> int:
        return sum(b for _, b, _ in self.caches.values())

    @property
    def bytes_after(self) -> int:
        return sum(a for _, _, a in self.caches.values())

    def to_json(self) -> dict:
        """The report's ``cache``: the held dtype, each cache's name and dtypes and bytes before / after holding."""
        return {
            "dtype": dtype_name(self.dtype),
            "caches": [
                {
                    "name": name,
                    "dtype_before": dtype_name(before),
                    "dtype_after": dtype_name(self.dtype),
                    "bytes_before": b,
                    "bytes_after": a,
                }
                for name, (before, b, a) in self.caches.items()
            ],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }


def hold_caches(program: Program, dtype: torch.dtype) -> HeldCaches:
    """Store every cache of ``program`` in ``dtype`` (see the module docstring); refuse a written floating
    buffer that is not a cache, or a program with no cache at all, with one line."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise PrecastError(f"cache_dtype={dtype}: give torch.bfloat16, torch.float16 or torch.float32")
    alias = analyze(program.graph, program.input_spec, program.output_specs)
    held = HeldCaches(dtype)
    found = []
    for node, spec in program.input_spec.items():
        if spec.kind not in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) or not alias.written(node):
            continue
        value = program.constant_value(node)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        not_store = _first_non_store(program, node, alias)
        if not_store is not None:
            raise PrecastError(
                f"cache_dtype={dtype_name(dtype)}: {spec.target} is not a cache the program fully owns: "
                f"{where(not_store)} updates it from its own value ({not_store.target}), and rounding such state "
                "at every update compounds; leave cache_dtype unset for this program (or keep the state in a "
                "separate fp32 buffer)",
                code="cache-not-owned",
                node=not_store.name,
            )
        found.append((node, spec.target, value))
    if not found:
        raise PrecastError(
            f"cache_dtype={dtype_name(dtype)}: the program writes no floating buffer it could hold as a cache (no "
            "KV cache: export the model with its static cache, e.g. transformers.integrations.executorch); "
            "leave cache_dtype unset"
        )
    for node, target, value in found:
        if value.dtype == dtype:  # already held so: said in the report, nothing to change
            n = value.numel() * value.element_size()
            held.caches[node.name] = (value.dtype, n, n)
            continue
        low = value.detach().to(dtype)
        for store in (program.state_dict, program.constants):
            if target in store:
                store[target] = low
        program.retyped[node] = value.dtype
        fake = node.meta.get("val")
        if isinstance(fake, torch.Tensor):
            node.meta["val"] = fake.to(dtype)
        held.caches[node.name] = (
            value.dtype,
            value.numel() * value.element_size(),
            low.numel() * low.element_size(),
        )
    program.fake_state = None  # placeholders changed: the private fake values are rebuilt from them
    return held


# ops that replace every element of their destination (the old values are not read)
FULL_STORES = frozenset(
    {"aten::copy_", "aten::fill_", "aten::zero_", "aten::copy", "aten::fill", "aten::zeros_like"}
)


def carried_state(program: Program) -> dict[str, str]:
    """The buffers ``program`` writes from call to call that an engine may carry as state, by FQN: ``"cache"``
    (written only by stores: a KV cache) or ``"overwritten"`` (every call replaces its whole value before reading
    it: transformers' ``cumulative_length``, set from ``cache_position``). Anything else (a running statistic, a
    step counter: read and written back as a function of its old value) is one PrecastError line naming the op."""
    alias = analyze(program.graph, program.input_spec, program.output_specs)
    out = {}
    for node, spec in program.input_spec.items():
        if spec.kind not in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) or not alias.written(node):
            continue
        if _overwritten_first(program, node, alias):
            out[spec.target] = "overwritten"
            continue
        not_store = _first_non_store(program, node, alias)
        if not_store is not None:
            raise PrecastError(
                f"{spec.target} is state, not a cache: {where(not_store)} updates it from its own value "
                f"({not_store.target}), so each call depends on every call before it",
                code="cache-not-owned",
                node=not_store.name,
            )
        out[spec.target] = "cache"
    return out


def _overwritten_first(program: Program, placeholder: torch.fx.Node, alias: AliasInfo) -> bool:
    """Whether the first op touching ``placeholder``'s storage replaces all of it (its old value never read)."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if any(
            isinstance(a, torch.fx.Node) and alias.root_of(a) is placeholder for a in node.all_input_nodes
        ):
            return (
                _name(node) in FULL_STORES
                and _first_tensor(node) is placeholder
                and not any(a is placeholder for a in node.all_input_nodes[1:])
            )
    return False


def _first_non_store(program: Program, placeholder: torch.fx.Node, alias: AliasInfo) -> torch.fx.Node | None:
    """The first op that writes ``placeholder``'s storage by anything but a store, or None."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        writes = [a for a in written_args(node) if alias.root_of(a) is placeholder]
        if writes and (_name(node) not in STORES or writes[0] is not _first_tensor(node)):
            return node
    # a functional program: the value a mutation output gives the buffer must come from a store into it
    names = {spec.target: n for n, spec in program.input_spec.items()}
    out = program.graph.output_node().args[0]
    for spec, arg in zip(program.output_specs, out, strict=False):
        if spec.kind in MUTATION_OUTPUTS and names.get(spec.target) is placeholder:
            producer = arg
            while isinstance(producer, torch.fx.Node) and producer.target is operator.getitem:
                producer = producer.args[0]
            if not (
                isinstance(producer, torch.fx.Node)
                and (_name(producer) in STORES or _name(producer) in FUNCTIONAL_STORES)
                and _stores_into(producer, placeholder, alias)
            ):
                return producer if isinstance(producer, torch.fx.Node) else placeholder
    return None


def _stores_into(node: torch.fx.Node, placeholder: torch.fx.Node, alias: AliasInfo) -> bool:
    """A functional store whose destination is the placeholder (or an earlier store into it)."""
    first = _first_tensor(node)
    while isinstance(first, torch.fx.Node) and first is not placeholder:
        if alias.root_of(first) is placeholder:
            return True
        if _name(first) in FUNCTIONAL_STORES or _name(first) in STORES:
            first = _first_tensor(first)
        else:
            return False
    return first is placeholder


def _first_tensor(node: torch.fx.Node) -> object:
    return node.args[0] if node.args else None


def _name(node: torch.fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else None


def cache_reads(
    node: torch.fx.Node, args: tuple, kwargs: dict, program: Program, alias: AliasInfo
) -> dict[ArgPath, torch.dtype]:
    """Casts giving each argument of ``node`` that reads a held cache the dtype the program gave it. None for a
    view of the cache, nor for the destination of a store (in place, or the functional form whose result becomes
    the cache's next value): those are the cache."""
    if not program.retyped or aliased_input(node) is not None:
        return {}
    written = set(written_args(node))
    store = _name(node) in STORES or _name(node) in FUNCTIONAL_STORES
    out = {}
    for path, value in tensor_args(args, kwargs):
        arg = arg_at(node, path)
        if not isinstance(arg, torch.fx.Node) or arg in written or (store and path == ("args", 0)):
            continue
        original = _held(arg, program, alias)
        recorded = program.retyped.get(arg, _recorded_dtype(arg))
        if original is not None and value.dtype != original and recorded == original:
            out[path] = original
    return out


def _held(arg: torch.fx.Node, program: Program, alias: AliasInfo) -> torch.dtype | None:
    """The dtype the program gave the held cache ``arg`` is (a view of, or a functional store's next value of)."""
    cache = held_cache(arg, program, alias)
    return program.retyped[cache] if cache is not None else None


def held_cache(arg: torch.fx.Node, program: Program, alias: AliasInfo) -> torch.fx.Node | None:
    """The placeholder of the held cache ``arg`` is (a view of, or a functional store's next value of), or None."""
    while True:
        root = alias.root_of(arg)
        if root in program.retyped:
            return root
        name = _name(root)
        first = _first_tensor(root)
        if name in FUNCTIONAL_STORES | SAME_DTYPE_WRITES and isinstance(first, torch.fx.Node):
            arg = first
            continue
        return None


def _recorded_dtype(arg: torch.fx.Node) -> torch.dtype | None:
    val = arg.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None
