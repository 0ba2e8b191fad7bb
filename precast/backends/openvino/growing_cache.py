"""The KV cache in the form OpenVINO's CPU plugin fuses with attention: transformers' static cache as a growing one.

A static cache (transformers' ``StaticCache``, the export recipe's) holds ``L`` slots; each call writes its keys and
values at ``cache_position`` (``index_copy_``) and attends over all ``L`` slots, the unwritten ones masked. Carried
as it is (``kv_state``), OpenVINO scatters into the whole ``[B, H, L, D]`` variable, repeats it to every
query head and converts and transposes all of it on every decode step: on the 0.246 B decoder of
``precast bench --llm`` (L = 512, 256 tokens live) about 185 MiB of extra memory traffic per token, 59.8 ms
against OpenVINO's own export's 45-54 ms (Intel Xeon, AVX512-BF16, no AMX, 1 thread).

OpenVINO's CPU plugin has a fused kernel for exactly one form of cache (its ``StatefulSDPAFusion``:
``ReadValue -> [Convert] -> Gather(beam_idx) -> Concat(past, new) -> [repeat_kv] -> ScaledDotProductAttention``,
the ``Concat`` also feeding the variable's ``Assign``), which appends the step's keys and values in place, in the
precision ``KV_CACHE_PRECISION`` says, and attends over the live positions only: what optimum-intel's exports
hold. ``grow_caches`` rewrites the program's cache into that form where it is provably the same computation:

- every cache is written once, by ``index_copy(cache, 2, idx, new)``, into a zero-initialised ``[B, H, L, D]``
  buffer, and read only through ``repeat_kv``'s view chain (checked by running it against
  ``repeat_interleave``) as the key or value of a ``scaled_dot_product_attention`` with an explicit mask;
- the write positions come from one integer input (``cache_position``) and, evaluated on sample inputs, are the
  run ``cache_position[0] + arange(seq)``; the masks, evaluated likewise, mask every slot at or past
  ``cache_position[0] + seq`` (a slot not yet written never counts): so dropping those slots, the growing
  cache's only difference, changes nothing.

The rewrite: the cache input is the past (``[B, H, ?, D]``), gathered by a ``beam_idx`` input (int32 ``[B]``,
``arange(B)`` for plain decoding; optimum-intel's IRs take the same input); its new value is
``cat([past, new], 2)``; every mask is sliced to the cache's live length. The model (``OpenVINOModel``) keeps the
contract the static cache had: each call's ``cache_position`` continues the live positions or starts over at an
earlier one (0: a new conversation; earlier: the cache is cut back there, as the static cache's slots past it
are overwritten or masked); a gap, which the static cache would fill with stale slots, is refused in one line.

A program that does not fit (another cache layout, a sliding-window cache, attention written out as matmuls, a
non-zero initial cache) keeps the static form, which is correct but slower; ``Growing.reason`` says why.

Input: the GraphModule of ``kv_state.stateful_module`` and its cache names. Output: ``Growing`` (and the
module rewritten in place when it fits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
# repeat_kv (transformers): x[:, :, None].expand(B, H, n, L, D).reshape(B, H * n, L, D), decomposed
_CHAIN = {
    aten.unsqueeze.default,
    aten.expand.default,
    aten.clone.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
}
BEAM_INPUT = "beam_idx"


@dataclasses.dataclass
class Growing:
    """How the caches are held: ``grown`` True when rewritten into OpenVINO's fused form, else ``reason``."""

    grown: bool = False
    reason: str = ""
    positions: str = ""  # the user input holding the write positions (cache_position)
    length: int = 0  # the static cache's length: the program's limit, kept
    batch: int = 0
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # cache -> [B, H, L, D]


def grow_caches(module: torch.fx.GraphModule, names: list[str], initial: dict[str, torch.Tensor]) -> Growing:
    """Rewrite ``module``'s caches into the growing form where it fits (see the module docstring); the module is
    changed only when every check passes."""
    try:
        growth = _analyse(module, names, initial)
    except _NoFit as why:
        return Growing(reason=str(why))
    _rewrite(module, growth)
    return growth.growing


class _NoFit(Exception):
    """Why a program keeps its static cache (a note, not an error)."""


@dataclasses.dataclass
class _Growth:
    """What ``_analyse`` found where every check passed: the caches' growing form (``growing``), and the nodes
    ``_rewrite`` changes: each cache's write, its reads through repeat_kv, the attentions reading them."""

    growing: Growing
    writes: list[torch.fx.Node]  # index_copy per cache, in ``names`` order
    chains: list[tuple[torch.fx.Node, int, torch.fx.Node, int]]  # (write, n_rep, sdpa, arg) per read
    sdpas: list[torch.fx.Node]


def _analyse(module: torch.fx.GraphModule, names: list[str], initial: dict[str, torch.Tensor]) -> _Growth:
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    users_in = placeholders[: len(placeholders) - len(names)]
    caches = placeholders[len(placeholders) - len(names) :]
    output = graph.output_node()
    growing = Growing()
    writes, chains, sdpas = [], [], []
    for name, cache in zip(names, caches, strict=True):
        start = initial[name]
        if start.dim() != 4 or bool((start != 0).any()):
            raise _NoFit(f"cache {name} is not a zero-initialised [B, H, L, D] buffer")
        growing.shapes[name] = tuple(start.shape)
        readers = list(cache.users)
        write = readers[0] if len(readers) == 1 else None
        if write is None or write.target is not aten.index_copy.default or write.args[0] is not cache:
            raise _NoFit(f"cache {name} is not written once by index_copy (read or written otherwise)")
        if write.args[1] not in (2, -2):
            raise _NoFit(f"cache {name} is written along dim {write.args[1]}, not the sequence dim 2")
        writes.append(write)
        for user in write.users:
            if user is output:
                continue
            chains.append(_chain_to_attention(write, user, tuple(start.shape)))
    lengths = {s[2] for s in growing.shapes.values()}
    batches = {s[0] for s in growing.shapes.values()}
    if len(lengths) != 1 or len(batches) != 1:
        raise _NoFit("the caches differ in length or batch (a hybrid cache)")
    growing.length, growing.batch = lengths.pop(), batches.pop()
    read = {(w, a) for w, _, _, a in chains}
    for _, _, sdpa, _ in chains:
        if sdpa not in sdpas:
            sdpas.append(sdpa)
    for sdpa in sdpas:
        _check_attention(sdpa, {c[3] for c in chains if c[2] is sdpa}, growing.length)
    if len(read) != len(chains):
        raise _NoFit("a cache feeds the same attention twice")
    growing.positions = _positions_input(writes, users_in)
    _check_by_evaluation(module, users_in, growing, writes, [_mask(s) for s in sdpas])
    growing.grown = True
    return _Growth(growing, writes, chains, sdpas)


def _chain_to_attention(
    write: torch.fx.Node, first: torch.fx.Node, shape: tuple[int, ...]
) -> tuple[torch.fx.Node, int, torch.fx.Node, int]:
    """(write, n_rep, attention, 1 or 2): the cache read through repeat_kv as an attention's key or value."""
    path, node = [], first
    while node.target in _CHAIN:
        path.append(node)
        if len(node.users) != 1:
            raise _NoFit(f"{node.name} (a view of a cache) has {len(node.users)} readers")
        node = next(iter(node.users))
    if node.target is not SDPA:
        raise _NoFit(f"a cache is read by {node.name} ({node.target}), not by scaled_dot_product_attention")
    last = path[-1] if path else write
    arg = [i for i in (1, 2) if len(node.args) > i and node.args[i] is last]
    if len(arg) != 1 or any(a is last for i, a in enumerate(node.args) if i not in (1, 2)):
        raise _NoFit(f"a cache reaches {node.name} other than as its key or value")
    B, H, L, D = shape
    out = last.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1] % H:
        raise _NoFit(f"{last.name}: the cache's view has no [B, heads, L, D] shape")
    n_rep = int(out.shape[1]) // H
    # the view chain is repeat_kv: run it on a small tensor of the cache's shape, against repeat_interleave
    x = torch.arange(B * H * L * D, dtype=torch.float32).reshape(B, H, L, D)
    env = {write: x}
    try:
        for n in path:
            args = torch.fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
    except (KeyError, RuntimeError, TypeError) as exc:
        raise _NoFit(f"{last.name}: the cache's view chain did not run ({exc})") from exc
    if not torch.equal(env[last], x.repeat_interleave(n_rep, dim=1)):
        raise _NoFit(f"{last.name}: the cache's view is not repeat_kv")
    return write, n_rep, node, arg[0]


def _mask(sdpa: torch.fx.Node) -> Any:
    return sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")


def _check_attention(sdpa: torch.fx.Node, args: set[int], length: int) -> None:
    if args != {1, 2}:
        raise _NoFit(f"{sdpa.name}: only one of key and value is a cache")
    extra = dict(zip(("dropout_p", "is_causal", "scale", "enable_gqa"), sdpa.args[4:], strict=False))
    extra.update(sdpa.kwargs)
    if extra.get("dropout_p", 0.0) or extra.get("is_causal", False) or extra.get("enable_gqa", False):
        raise _NoFit(f"{sdpa.name}: attention with dropout, is_causal or enable_gqa")
    mask = _mask(sdpa)
    val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.shape[-1] != length:
        raise _NoFit(f"{sdpa.name}: no attention mask over the cache's {length} slots")


def _positions_input(writes: list[torch.fx.Node], users_in: list[torch.fx.Node]) -> str:
    from precast.runtime.positions import value_sources

    names = {n.name for n in users_in}
    found = set()
    for w in writes:
        sources = value_sources(w.args[2]) & names
        if len(sources) != 1:
            raise _NoFit(f"{w.name}: the write positions do not come from one input")
        found |= sources
    if len(found) != 1:
        raise _NoFit("the caches are written at positions from different inputs")
    return found.pop()


def _check_by_evaluation(
    module: torch.fx.GraphModule,
    users_in: list[torch.fx.Node],
    growing: Growing,
    writes: list[torch.fx.Node],
    masks: list[torch.fx.Node],
) -> None:
    """Evaluate the write positions and the masks on sample positions: the positions are the run
    ``start + arange(seq)`` and every mask masks each slot at or past ``start + seq``."""
    pos = next(n for n in users_in if n.name == growing.positions)
    pval = pos.meta.get("val")
    if not isinstance(pval, torch.Tensor) or pval.dim() != 1 or pval.dtype.is_floating_point:
        raise _NoFit(f"{growing.positions} is not a 1-D integer tensor")
    seq = pval.shape[0]
    targets = [w.args[2] for w in writes] + list(dict.fromkeys(masks))
    needed = _ancestors(targets)
    if any(n.op == "placeholder" and n not in users_in for n in needed):
        raise _NoFit("the write positions or the masks read a cache")
    L = growing.length
    for start, q in ((0, 1), (0, 3), (2, 2), (5, 1), (L - 1, 1)):
        if start + q > L or q < 1:
            continue
        env: dict[torch.fx.Node, Any] = {}
        for n in users_in:
            if n in needed:
                env[n] = _sample(n, seq, q, start, n is pos)
        for n in module.graph.nodes:
            if n in needed and n.op != "placeholder":
                env[n] = _run(module, n, env)
        for w in writes:
            got = env[w.args[2]]
            if not torch.equal(got.reshape(-1), torch.arange(start, start + q, dtype=got.dtype)):
                raise _NoFit(f"{w.name}: the write positions are not cache_position[0] + arange(seq)")
        for m in dict.fromkeys(masks):
            value = env[m]
            tail = value[..., start + q :]
            masked = ~tail if tail.dtype == torch.bool else tail <= torch.finfo(tail.dtype).min / 2
            if not bool(masked.all()):
                raise _NoFit(f"{m.name}: the mask lets a query see a slot past the positions written")
            if value.dtype == torch.bool and not bool(value[..., : start + q].any(-1).all()):
                raise _NoFit(f"{m.name}: the mask hides every slot from a query")


def _ancestors(targets: list[Any]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [t for t in targets if isinstance(t, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _sample(node: torch.fx.Node, seq: Any, q: int, start: int, is_positions: bool) -> torch.Tensor:
    if is_positions:
        return torch.arange(start, start + q, dtype=node.meta["val"].dtype)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise _NoFit(f"input {node.name} is not a tensor")
    shape = []
    for s in val.shape:
        if isinstance(s, int):
            shape.append(s)
        elif isinstance(seq, torch.SymInt) and str(s) == str(seq):
            shape.append(q)
        else:
            raise _NoFit(f"input {node.name} has a dynamic size other than the sequence")
    return torch.zeros(shape, dtype=val.dtype)


def _run(module: torch.fx.GraphModule, node: torch.fx.Node, env: dict) -> Any:
    if node.op == "get_attr":
        return getattr(module, str(node.target))
    if node.op != "call_function":
        raise _NoFit(f"{node.name}: a {node.op} among the positions' inputs")
    args = torch.fx.node.map_arg(node.args, lambda a: env[a])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env[a])
    try:
        return node.target(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        raise _NoFit(f"{node.name} did not run on sample positions ({exc})") from exc


def _rewrite(module: torch.fx.GraphModule, growth: _Growth) -> None:
    graph = module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_user = placeholders[len(placeholders) - len(growth.writes) - 1]
    taken = {n.name for n in graph.nodes}
    name = BEAM_INPUT if BEAM_INPUT not in taken else f"{BEAM_INPUT}_precast"
    with graph.inserting_after(last_user):
        beam = graph.placeholder(name)
    beam.meta["val"] = torch.zeros(growth.growing.batch, dtype=torch.int32)
    grown: dict[torch.fx.Node, torch.fx.Node] = {}
    for write in growth.writes:
        cache, _, _, new = write.args[:4]
        with graph.inserting_before(write):
            past = graph.call_function(aten.index_select.default, (cache, 0, beam))
            cat = graph.call_function(aten.cat.default, ([past, new], 2))
        cat.meta = {k: v for k, v in write.meta.items() if k != "val"}
        grown[write] = cat
    shapes = dict(zip(growth.writes, growth.growing.shapes.values(), strict=True))  # names' order, both
    for write, n_rep, sdpa, arg in growth.chains:
        cat = grown[write]
        B, H, _, D = shapes[write]
        read = cat
        if n_rep > 1:
            with graph.inserting_before(sdpa):
                wide = graph.call_function(aten.unsqueeze.default, (cat, 2))
                wide = graph.call_function(aten.expand.default, (wide, [-1, -1, n_rep, -1, -1]))
                wide = graph.call_function(aten.clone.default, (wide,))
                read = graph.call_function(aten.view.default, (wide, [B, H * n_rep, -1, D]))
        sdpa.update_arg(arg, read)
    for write, cat in grown.items():
        write.replace_all_uses_with(cat)
        graph.erase_node(write)
    # the live length after the write, the last position + 1 (the positions are consecutive and continue the
    # cache: checked before every call): read from the cache's shape instead, OpenVINO would read the shape of
    # a variable, which keeps it from fusing that attention under the bf16 hint
    positions = next(n for n in placeholders if n.name == growth.growing.positions)
    body = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(body):
        last = graph.call_function(aten.select.int, (positions, 0, -1))
        live = graph.call_function(aten.add.Tensor, (last, 1))
    sliced: dict[torch.fx.Node, torch.fx.Node] = {}
    for sdpa in growth.sdpas:
        mask = _mask(sdpa)
        if mask not in sliced:
            with graph.inserting_before(sdpa):
                sliced[mask] = graph.call_function(aten.slice.Tensor, (mask, -1, 0, live))
                if mask.meta["val"].dtype == torch.bool:
                    sliced[mask] = _additive(graph, sliced[mask], sdpa.args[0].meta["val"].dtype)
        if len(sdpa.args) > 3:
            sdpa.update_arg(3, sliced[mask])
        else:
            sdpa.update_kwarg("attn_mask", sliced[mask])
    graph.eliminate_dead_code()
    graph.lint()
    module.recompile()


def _additive(graph: torch.fx.Graph, mask: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """A boolean mask as the additive one OpenVINO's fused attention takes at full speed (with a boolean mask
    its kernel ran 2.3x slower on the 0.246 B decoder: 9% of the step against 4%): 0 where a query sees a slot,
    the dtype's lowest value where it does not, whose exponential after the softmax's max is 0, as -inf's is
    (every query sees at least one slot: checked on sample positions)."""
    low = torch.finfo(dtype).min
    ones = graph.call_function(aten._to_copy.default, (mask,), {"dtype": dtype})
    hidden = graph.call_function(aten.sub.Tensor, (ones, 1.0))  # 0 seen, -1 hidden
    return graph.call_function(aten.mul.Tensor, (hidden, -low))
