"""Classify: walk the graph in order with fake tensors and give every op a Decision (``node.meta["precast"]``).

Decisions depend on the dtypes that reach an op, which depend on the decisions upstream (autocast casts only
eligible arguments, ``promote`` looks at the actual dtypes), so classification propagates fake values as it
goes, as eager autocast would see them at run time. Order of authority: the program's own autocast regions,
then the policy (``precast.policy.compose``).

Composite ops that eager autocast would decompose (a CompositeImplicitAutograd op with no autocast kernel, such
as ``einsum`` or ``lstm``, runs its decomposition *under* autocast, so the ``bmm`` inside it is cast) are
decomposed here one level at a time, only when their decomposition reaches an op that autocast casts. Ops that
autocast leaves alone stay as the user wrote them.

Input: a Program with regions inlined, a policy (decider). Output: ``node.meta["precast"]``
Decisions, fake values for every node, ``ClassifyResult`` (decided, decomposed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from precast.dtypes import dtype_name
from precast.errors import PrecastError, where
from precast.ir import op_families
from precast.ir.diagnostics import DiagnosticLog, add, from_error, raise_errors
from precast.ir.fake import FakeState, fake_cast, fake_state, foreign, node_signature
from precast.ir.fake_run import MISSING, arg_name, fake_run_error, remember_run, run_fake, same_fake
from precast.ir.graph import ASSERT_METADATA, tensor_args
from precast.ir.mutation import AliasInfo, analyze
from precast.ir.program import Program
from precast.passes.caches import cache_reads, held_cache
from precast.passes.decompose import (
    TRACED_META,
    should_decompose,
    splice_decomposition,
    trace_decomposition,
)
from precast.policy.base import Decision, Policy, apply_decision
from precast.policy.compose import decide
from precast.policy.writes import WRITE_CAST_META, arg_at, cast_written_values

# Ops whose eager kernels require every floating tensor argument to have one dtype (no type promotion).
# FakeTensor does not check this, so a low-precision activation meeting an fp32 weight would only fail at run
# time; precast checks it at conversion.
SAME_DTYPE_OPS = frozenset(f"aten::{name}" for name in op_families.SAME_DTYPE_OPS)
# composites whose kernel is their decomposition: whether mixed dtypes fail depends on the ops it reaches
COMPOSITE_SAME_DTYPE = frozenset({"aten::einsum"})


@dataclass
class ClassifyResult:
    decided: int = 0
    decomposed: list[str] | None = None


@dataclass
class _Walk:
    """One classify walk: the program and its policy, the fake values so far (``env``), and the result."""

    program: Program
    policy: Policy | None
    on_error: Callable | None
    state: FakeState
    # caches held in a low dtype (cache_dtype=): their readers see the program's dtype (passes/caches.py)
    alias: AliasInfo | None
    env: dict[torch.fx.Node, object] = field(default_factory=dict)
    result: ClassifyResult = field(default_factory=lambda: ClassifyResult(decomposed=[]))

    def load(self, a: object) -> object:
        """An argument's fake value (a node's, from ``env``; anything else as it is)."""
        return self.env[a] if isinstance(a, torch.fx.Node) else a


def classify(
    program: Program,
    policy: Policy | None,
    on_error: Callable | None = None,
) -> ClassifyResult:
    """``on_error(err, node)``, when given, receives the ``dtype-mismatch`` and ``composite-not-traced`` errors
    instead of raising them here (precast.ir.diagnostics records them, and re-raises unless the user allowed the
    code; an allowed ``composite-not-traced`` keeps the composite op as written)."""
    graph = program.graph
    walk = _Walk(
        program,
        policy,
        on_error,
        fake_state(program),
        analyze(graph, program.input_spec, program.output_specs) if program.retyped else None,
    )
    node = next(iter(graph.nodes))
    while node.op != "output":
        if node.op == "placeholder":
            walk.env[node] = node.meta["val"]
        elif node.op == "get_attr":
            walk.env[node] = getattr(program.gm, node.target)
        elif node.op == "call_function":
            first = _classify_call(walk, node)
            if first is not None:  # decomposed: its first new node is walked next
                node = first
                continue
        node = node.next
    _store_vals(graph, walk.env)
    return walk.result


def _classify_call(walk: _Walk, node: torch.fx.Node) -> torch.fx.Node | None:
    """Decide one op and compute its fake value; or splice in its decomposition and return its first node."""
    args = torch.fx.node.map_aggregate(node.args, walk.load)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, walk.load)
    decompose = should_decompose(node, args, kwargs, walk.policy)
    if decompose:
        first = splice_decomposition(walk.program, node, args, kwargs, walk.state, walk.policy, walk.on_error)
        if first is not None:
            walk.result.decomposed.append(f"{node.name} ({node.target})")
            return first
    traced = node.meta.get(TRACED_META)
    decision, args, kwargs = _decide(walk, node, args, kwargs, traced)
    decision, args = _dtype_updates(node, args, kwargs, decision, walk.program.retyped)
    # a composite kept as written (the trace changed nothing, or failed and the user allowed it): export
    # recorded its value as autocast computed it, which need not be what it computes as written
    recorded = (
        _recorded(node, decision, walk.env, walk.state, walk.program.retyped)
        if traced is None and not decompose
        else MISSING
    )
    if recorded is MISSING:
        walk.env[node] = _run(node, args, kwargs, decision, walk.state, walk.on_error)
    else:
        _check_dtypes(node, node.target, args, kwargs, walk.on_error, walk.state)
        walk.env[node] = recorded
        remember_run(walk.state, node, node.target, args, kwargs, recorded)
    _store_decision(walk, node, decision)
    return None


def _decide(
    walk: _Walk, node: torch.fx.Node, args: tuple, kwargs: dict, traced: Decision | None
) -> tuple[Decision | None, tuple, dict]:
    """The op's decision (the traced one, else the policy's), with the reads of held caches cast back first;
    and the arguments as those casts leave them."""
    program = walk.program
    restore = cache_reads(node, args, kwargs, program, walk.alias) if walk.alias is not None else {}
    if restore:
        read = Decision(None, "none", "cache-read", "", casts=restore)
        _, args, kwargs = apply_decision(
            node.target, args, kwargs, read, lambda v, d: fake_cast(walk.state, v, d)
        )
    # nodes traced under autocast already hold eager's casts: deciding again would cast twice
    decision = copy.copy(traced) if traced is not None else decide(node, args, kwargs, walk.policy)
    if restore:
        decision = _with_cache_reads(
            decision, restore, program, cache_names(node, restore, program, walk.alias)
        )
    return decision, args, kwargs


def _dtype_updates(
    node: torch.fx.Node, args: tuple, kwargs: dict, decision: Decision | None, retyped: dict
) -> tuple[Decision | None, tuple]:
    """The decision with the casts of values written into tensors of another dtype, and export's dtype
    assertions kept true for the dtype that now flows; and the arguments the assertion now takes."""
    # a value written into a tensor arrives in its dtype (a KV cache's index_copy_): precast/policy/writes.py
    decision, write = cast_written_values(node, args, kwargs, decision, retyped)
    if write is not None:
        node.meta[WRITE_CAST_META] = write
    else:
        node.meta.pop(WRITE_CAST_META, None)
    # export's runtime check of a `.to()` input: keep it true for the dtype that now flows
    if node.target is ASSERT_METADATA and len(node.args) > 3:
        # run_decompositions() records dtype positionally (a, size, stride, dtype): a keyword here
        node.kwargs = {**node.kwargs, "dtype": node.args[3]}
        node.args = node.args[:3]
        args = args[:3]
    if (
        node.target is ASSERT_METADATA
        and isinstance(args[0], torch.Tensor)
        and node.kwargs.get("dtype") not in (None, args[0].dtype)
    ):
        decision = Decision(None, "none", "assert", "export's dtype check, updated to the new dtype")
        decision.kwarg_updates = {"dtype": args[0].dtype}
    return decision, args


def _store_decision(walk: _Walk, node: torch.fx.Node, decision: Decision | None) -> None:
    """The op's decision on ``node.meta["precast"]`` (an op no rule decided: unchanged), its dtype filled in."""
    if decision is None and isinstance(node.target, torch._ops.OpOverload):
        decision = _unchanged(node, walk.env[node])
    if decision is not None:
        if decision.dtype is None:
            decision.dtype = _float_dtype(walk.env[node])
        node.meta["precast"] = decision
        walk.result.decided += 1


def cache_names(node: torch.fx.Node, restore: dict, program: Program, alias: Any) -> list[torch.fx.Node]:
    """The placeholders of the held caches ``node`` reads through the arguments in ``restore``, once each."""
    found = (held_cache(arg_at(node, path), program, alias) for path in restore)
    return list(dict.fromkeys(c for c in found if c is not None))


def _with_cache_reads(
    decision: Decision | None, restore: dict, program: Program, caches: list[torch.fx.Node]
) -> Decision:
    """The decision with the held caches' reads cast back to the program's dtype first (the decision's own cast
    of the same argument, to the dtype it computes in, replaces that cast: one cast from the cache). Its reason
    names each cache and the dtype it is held in after conversion, and the one the program gave it."""
    note = "; ".join(
        f"reads cache {c.name}, held in {dtype_name(getattr(c.meta.get('val'), 'dtype', None))} (the program gave it "
        f"{dtype_name(program.retyped[c])})"
        for c in caches
    )
    if decision is None:
        return Decision(None, "none", "cache-read", note, casts=dict(restore))
    return replace(decision, casts={**restore, **decision.casts}, reason=f"{decision.reason}; {note}")


def _store_vals(graph: torch.fx.Graph, env: dict) -> None:
    """Give every op the value it will have once its decision is applied: the check after insert_casts then
    recomputes only the nodes insert_casts rewrote and finds the same values, instead of re-propagating
    everything downstream of a cast. Done after the walk: ``_recorded`` compares inputs with the values export
    recorded."""
    for node in graph.nodes:
        if node.op == "call_function" and node in env and node.meta.get("val", MISSING) is not env[node]:
            node.meta["val"] = env[node]


def _recorded(
    node: torch.fx.Node, decision: Decision | None, env: dict, state: FakeState, retyped: dict
) -> object:
    """The node's own fake value when running it again would only recompute it, else ``MISSING``.

    That holds when the decision changes nothing (no casts, dtype kwargs or redispatch), every input's value is
    the value recorded for that input or has its exact metadata (``same_fake``: an op's fake output depends
    on nothing else), and the node's value was computed from its current arguments (unchanged signature).
    Most of a program outside autocast regions is so, and so is most of a region export traced under
    autocast; a fake run (symbolic sizes rebuilt through sympy) is the main cost of classify. In-place ops
    still run: they may change their input's metadata."""
    if decision is not None and (decision.casts or decision.kwarg_updates or decision.new_target is not None):
        return MISSING
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return MISSING
    val = node.meta.get("val", MISSING)
    if val is MISSING or foreign(val, state.mode):
        return MISSING
    if (
        decision is not None
        and decision.dtype is not None
        and _float_dtype(val) not in (None, decision.dtype)
    ):
        return MISSING  # recorded under another precision (traced under autocast, now pinned to fp32)
    for a in node.all_input_nodes:
        if (
            a in retyped
        ):  # a cache held in another dtype (cache_dtype=): the recorded value is not its reader's
            return MISSING
        if a.op != "get_attr" and not same_fake(env.get(a, MISSING), a.meta.get("val", MISSING)):
            return MISSING
    if state.signatures.get(node) != node_signature(node):
        return MISSING
    return val


def _float_dtype(value: object) -> torch.dtype | None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return None


def _unchanged(node: torch.fx.Node, out: object) -> Decision:
    return Decision(_float_dtype(out), "none", "follow", "not cast: runs in the dtype of its inputs")


def _run(node, args, kwargs, decision, state: FakeState, on_error=None):
    target, args, kwargs = apply_decision(
        node.target, args, kwargs, decision, lambda v, d: fake_cast(state, v, d)
    )
    _check_dtypes(node, target, args, kwargs, on_error, state)
    try:
        return run_fake(state, node, target, args, kwargs)
    except PrecastError:
        raise
    except Exception as exc:
        raise fake_run_error(node, target, args, kwargs, exc) from exc


def _check_dtypes(
    node, target, args: tuple, kwargs: dict, on_error=None, state: FakeState | None = None
) -> None:
    """The dtype check FakeTensor does not make (also for an op whose recorded value is reused)."""
    if isinstance(target, torch._ops.OpOverload) and target._schema.name in SAME_DTYPE_OPS:
        try:
            check_same_dtype(node, args, kwargs)
        except PrecastError as err:
            if target._schema.name in COMPOSITE_SAME_DTYPE and state is not None:
                # einsum's kernel is its decomposition: "bi,i->bi" is a mul (it promotes), "bi,i->b" a bmm
                # (one dtype): the inputs fail only if an op of its decomposition requires one dtype
                inner = composite_mismatch(target, args, kwargs, state.mode)
                if inner is None:
                    return
            if on_error is None:
                raise
            on_error(err, node)


def composite_mismatch(target, args: tuple, kwargs: dict, mode) -> str | None:
    """The first op of ``target``'s decomposition (traced as eager runs it, no autocast) whose kernel requires
    one dtype and gets several, or None (then the composite runs on these dtypes)."""
    try:
        traced = trace_decomposition(target, args, kwargs, mode)
    except RuntimeError as exc:  # a meta kernel of the decomposition refused the dtypes: the mismatch is real
        return f"its decomposition fails: {str(exc).splitlines()[0]}"
    for n in traced.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if n.target._schema.name not in SAME_DTYPE_OPS:
            continue
        vals = [a.meta.get("val") for a in n.all_input_nodes]
        dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()}
        if len(dtypes) > 1:
            return n.name
    return None


def check_same_dtype(node: torch.fx.Node, args: tuple, kwargs: dict) -> None:
    floats = [(p, t) for p, t in tensor_args(args, kwargs) if t.is_floating_point()]
    dtypes = {t.dtype for _, t in floats}
    if len(dtypes) <= 1:
        return
    inputs = ", ".join(f"{arg_name(node, p)} {dtype_name(t.dtype)}" for p, t in floats)
    low = sorted((d for d in dtypes if d != torch.float32), key=str)
    fix = (
        "cast the activation back with `.float()` where it leaves the autocast region, or move this op inside "
        "the region"
        if low and torch.float32 in dtypes
        else "cast its inputs to one dtype"
    )
    raise PrecastError(
        f"{where(node)}: {node.target._schema.name.removeprefix('aten::')} would fail at run time: its inputs have "
        f"different dtypes ({inputs}); {fix}",
        code="dtype-mismatch",
        node=node.name,
    )


# ---- errors raised while classifying ------------------------------------------------------------------


def classify_error_handler(rep: DiagnosticLog) -> Callable[[PrecastError], None]:
    """For ``classify(on_error=...)``: records the error as a diagnostic; re-raises unless allowed."""

    def handle(err: PrecastError, node: torch.fx.Node | None = None) -> None:
        d = add(rep, from_error(err, node))
        if d.severity == "error":
            raise_errors(rep)

    return handle
