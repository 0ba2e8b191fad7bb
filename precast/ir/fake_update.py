"""Keeping fake values right after a rewrite: the incremental updater every rewriting stage's check uses
(``check_pass``), as Inductor's ``FakeTensorUpdater`` does: only the nodes a stage changed (their target or
arguments differ from when their value was last computed) and, from there, the users whose inputs now have
another dtype, shape or stride.

Input: a ``Program`` after a stage. Output: updated ``node.meta["val"]``; a ``PrecastError`` naming the stage and
node when the graph does not lint or an op no longer runs on its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import disable_fake_tensor_cache

from precast.errors import PrecastError, first_line, where
from precast.ir.fake import FakeState, adopt_vals, fake_state, node_signature
from precast.ir.fake_run import MISSING, fake_run_error, run_fake
from precast.ir.program import Program


def refresh_vals(program: Program) -> None:
    """Recompute every node's fake value after rewriting; a failure names the node. Prefer ``check_pass``
    (incremental) between passes; this is the full re-check: every op's kernel runs again (neither a
    dispatch-cache entry nor ``FakeState.runs`` from classify's run of the same op stands in for it)."""
    state = fake_state(program)
    state.reuse_runs = False
    try:
        with disable_fake_tensor_cache(state.mode):
            update_vals(program, [n for n in program.graph.nodes if n.op == "call_function"])
    finally:
        state.reuse_runs = True


def check_pass(program: Program, pass_name: str) -> None:
    """After a pass: the graph lints and every node the pass changed (and what depends on it) fake-propagates.

    Raises ``PrecastError("internal error in pass NAME: ...")`` naming the node; a dynamic dimension the pass
    would specialize keeps its own code (``dynamic-dim-specialized``)."""
    try:
        program.graph.lint()
    except Exception as exc:
        raise PrecastError(
            f"internal error in pass {pass_name}: the graph does not lint: {first_line(exc)}",
            code="internal-error",
        ) from exc
    try:
        update_vals(program, changed_nodes(program))
    except PrecastError as exc:
        code = exc.code if exc.code == "dynamic-dim-specialized" else "internal-error"
        raise PrecastError(
            f"internal error in pass {pass_name}: {exc}", code=code, node=exc.node, source=exc.source
        ) from exc


def changed_nodes(program: Program) -> list[torch.fx.Node]:
    """Nodes whose target or arguments differ from when their fake value was last computed, or that have
    none (nodes a pass added)."""
    state = fake_state(program)
    adopt_vals(state, program.graph.nodes)
    return [
        n
        for n in program.graph.nodes
        if n.op in ("call_function", "placeholder")
        and (state.signatures.get(n) != node_signature(n) or "val" not in n.meta)
    ]


def update_vals(program: Program, nodes: Iterable[torch.fx.Node]) -> int:
    """Recompute the fake values of ``nodes`` and of every node downstream whose inputs' values changed dtype,
    shape or stride. Returns the number of values that changed."""
    state = fake_state(program)
    dirty = set(nodes)
    changed = 0
    if not dirty:
        return 0
    adopt_vals(state, program.graph.nodes)
    for node in program.graph.nodes:
        if node not in dirty:
            continue
        if node.op == "placeholder":  # a new or re-typed constant: its readers must be recomputed
            dirty.update(node.users)
        elif node.op == "call_function":
            new = _compute(state, program, node)
            old = node.meta.get("val", MISSING)
            if old is MISSING or not same_meta(old, new):
                node.meta["val"] = new
                dirty.update(node.users)
                changed += 1
        state.signatures[node] = node_signature(node)
    return changed


def _compute(state: FakeState, program: Program, node: torch.fx.Node) -> object:
    def load(a: object) -> object:
        if not isinstance(a, torch.fx.Node):
            return a
        if a.op == "get_attr":
            return getattr(program.gm, a.target)
        if "val" not in a.meta:
            raise PrecastError(f"{where(node)}: its input {a.name} has no fake value (computed out of order)")
        return a.meta["val"]

    args = torch.fx.node.map_aggregate(node.args, load)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
    try:
        return run_fake(state, node, node.target, args, kwargs)
    except PrecastError:
        raise
    except Exception as exc:
        err = fake_run_error(node, node.target, args, kwargs, exc)
        raise PrecastError(
            f"the converted program fails shape/dtype checks: {err}", code=err.code, node=node.name
        ) from exc


def same_meta(a: object, b: object) -> bool:
    """Same structure, and tensors with the same dtype, shape and strides (what users of a value depend on)."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.device != y.device or not _same_sizes(x, y):
                return False
        elif type(x) is not type(y) or not _same_scalar(x, y):
            return False
    return True


def _same_sizes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        len(x.shape) == len(y.shape)
        and all(_same_scalar(p, q) for p, q in zip(x.shape, y.shape, strict=True))
        and all(_same_scalar(p, q) for p, q in zip(x.stride(), y.stride(), strict=True))
    )


def _same_scalar(p: object, q: object) -> bool:
    """Symbolic sizes compare by expression: ``==`` on SymInts would add a guard."""
    if isinstance(p, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(
        q, (torch.SymInt, torch.SymFloat, torch.SymBool)
    ):
        pe = p.node.expr if isinstance(p, (torch.SymInt, torch.SymFloat, torch.SymBool)) else p
        qe = q.node.expr if isinstance(q, (torch.SymInt, torch.SymFloat, torch.SymBool)) else q
        return bool(pe == qe)
    return p == q
