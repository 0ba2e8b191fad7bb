"""Running ops on fake values: the conversion's fake runs, each checked to leave every dynamic dimension of the
program's inputs as it was, reused when its inputs are indistinguishable from the last run's; and the error an op
that fails on fake values becomes.

The private fake mode the runs use is ``precast.ir.fake.fake_state``.

Input: a ``FakeState``, a node, its target and fake arguments. Output: the op's fake result; a ``PrecastError``
naming the node when the run narrowed a dynamic dimension or the op cannot run on these values.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from precast.dtypes import dtype_name
from precast.errors import PrecastError, first_line, where
from precast.ir import op_families
from precast.ir.fake import FakeState
from precast.ir.graph import tensor_args


def check_dynamic(state: FakeState, node: torch.fx.Node) -> None:
    """Raise if running ``node`` on fake values specialized or narrowed a dynamic dimension of the program's
    inputs (eager would then reject other sizes: "Guard failed: x.size()[0] == 2")."""
    env = state.mode.shape_env
    if env is None or not state.symbols:
        return
    if len(env.replacements) == state.replacements and all(
        env.var_to_range.get(sym) == rng for sym, (_, rng) in state.symbols.items()
    ):
        return
    for sym, (name, rng) in list(state.symbols.items()):
        now = env.replacements.get(sym, sym)
        new = env.var_to_range.get(sym)
        if now == sym and _zero_one_assumption(rng, new):
            # the lower bound raised to 2 is torch.export's own 0/1 specialization (export traces sizes >= 2 and
            # still accepts 1 at run time, per the program's range_constraints): what export itself assumed
            # while tracing this op, not a narrowing by precast (a program loaded from a file starts at 1)
            state.symbols[sym] = (name, new)
            continue
        if now != sym or new != rng:
            fixed = now if now != sym else env.var_to_range.get(sym)
            op = str(node.target)
            raise PrecastError(
                f"{where(node)}: computing {op} on the program's fake values fixed the dynamic dimension "
                f"{name} ({sym}, range {rng}) to {fixed}; precast must not narrow a dynamic shape: please "
                "report it with this program (convert with static shapes meanwhile)",
                code="dynamic-dim-specialized",
                node=node.name,
            )
    state.replacements = len(env.replacements)  # only new, unrelated (unbacked) symbols were replaced


def _zero_one_assumption(old: object, new: object) -> bool:
    """``new`` is ``old`` with its lower bound raised from 0 or 1 to 2, the upper bound unchanged."""
    if old is None or new is None:
        return False
    return int(old.lower) <= 1 and int(new.lower) == 2 and old.upper == new.upper


def _oblivious_backend_choice(target: object) -> contextlib.AbstractContextManager:
    """Fake convolution picks a backend to guess the output's memory format, comparing the batch with
    thresholds (``_select_conv_backend``); on a dynamic batch that adds a guard export never added, narrowing
    the batch range (VR[2, 64] -> VR[2, 15]). The choice only shapes strides, never values: decide it without
    guards (size-oblivious)."""
    name = target._schema.name.split("::")[-1] if isinstance(target, torch._ops.OpOverload) else ""
    if name in op_families.CONV_OPS:
        return torch.fx.experimental._config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


def run_fake(state: FakeState, node: torch.fx.Node, target, args: tuple, kwargs: dict) -> object:
    """Run ``target`` on fake values as export does (Python dispatcher on: symbolic-aware decompositions, no
    C++ composite reading concrete sizes), then check that no dynamic dimension was specialized. A node run
    again on inputs no op can tell from its last run's (same objects, or ``same_fake``) returns that run's
    result (``FakeState.runs``): the checks after insert_casts and fold recompute on the cast values classify
    used, or on folded constants of the same metadata."""
    if target is operator.getitem:
        return target(*args)
    memo = _memoizable(target)
    if memo and state.reuse_runs:
        last = state.runs.get(node)
        if last is not None and last[0] is target and _same_args(last[1], (args, kwargs)):
            return last[2]
    # no autograd: a conversion's fake runs compute dtypes and shapes for inference, and an op autograd refuses
    # (a Parameter passed as batch_norm's running_var) runs without it, as the program itself does
    with state.mode, enable_python_dispatcher(), _oblivious_backend_choice(target), torch.no_grad():
        out = target(*args, **kwargs)
    check_dynamic(state, node)
    if memo:
        state.runs[node] = (target, (args, kwargs), out)
    return out


def remember_run(
    state: FakeState, node: torch.fx.Node, target, args: tuple, kwargs: dict, out: object
) -> None:
    """Record ``out`` as what ``node`` computes from these inputs (a cast node given the value classify
    already computed for that cast)."""
    if _memoizable(target):
        state.runs[node] = (target, (args, kwargs), out)


def _memoizable(target: object) -> bool:
    """Aten ops that write nothing (an in-place or out= op may change its inputs' metadata: always run)."""
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def _same_args(a: object, b: object) -> bool:
    """Arguments an op cannot tell apart: same structure (lists and tuples alike: FX hands them over as
    immutable lists), fake values by ``same_fake``, real tensors (constants) by identity, anything else by
    type and value."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_args(a[k], b[k]) for k in a)
    sym = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, sym) or isinstance(b, sym):  # `==` on symbolic values would add a guard
        return same_fake(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


MISSING = object()  # "no value recorded" (None is a value)


def same_fake(a: object, b: object) -> bool:
    """The same object, or fake values an op that writes nothing computes the same metadata from: same
    structure, and tensors of the same dtype, device, sizes, strides, storage offset and layout (symbolic sizes
    by expression: ``==`` on SymInts would add a guard). ``requires_grad`` is not compared: it does not change
    an output's metadata, and export records values without it."""
    if a is b:
        return a is not MISSING
    if isinstance(a, FakeTensor) and isinstance(b, FakeTensor):
        return (
            a.dtype == b.dtype
            and a.device == b.device
            and a.layout == b.layout
            and a.dim() == b.dim()
            and all(_same_int(p, q) for p, q in zip(a.shape, b.shape, strict=True))
            and all(_same_int(p, q) for p, q in zip(a.stride(), b.stride(), strict=True))
            and _same_int(a.storage_offset(), b.storage_offset())
            and a.is_conj() == b.is_conj()
            and a.is_neg() == b.is_neg()
        )
    if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        return all(same_fake(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not isinstance(a, bool) and not isinstance(b, bool) and _same_int(a, b)
    return False


def _same_int(p: object, q: object) -> bool:
    pe = p.node.expr if isinstance(p, torch.SymInt) else p
    qe = q.node.expr if isinstance(q, torch.SymInt) else q
    return bool(pe == qe)


def fake_run_error(node: torch.fx.Node, target, args: tuple, kwargs: dict, exc: Exception) -> PrecastError:
    """The error for an op that fails on fake values: ``dtype-mismatch`` only when its floating inputs have
    different dtypes (what the program would hit at run time); anything else is ``fake-run-failed``."""
    floats = {t.dtype for _, t in tensor_args(args, kwargs) if t.is_floating_point()}
    if len(floats) > 1:
        return PrecastError(
            f"{where(node)}: {first_line(exc)}; inputs {_dtypes(args, kwargs)}. "
            "This op would fail at run time with these dtypes: cast its inputs to one dtype (e.g. `.float()`) "
            "or move it inside the autocast region",
            code="dtype-mismatch",
            node=node.name,
        )
    op = str(target)
    return PrecastError(
        f"{where(node)}: {op} fails on the program's fake values with inputs {_dtypes(args, kwargs)}: "
        f"{first_line(exc)}; check that the program runs as exported (ep.module()), else report it",
        code="fake-run-failed",
        node=node.name,
    )


def arg_name(node: torch.fx.Node, path: tuple) -> str:
    if path[0] == "kwargs":
        return str(path[1])
    schema_args = getattr(node.target, "_schema", None)
    if schema_args is not None and path[1] < len(schema_args.arguments):
        name = schema_args.arguments[path[1]].name
        return name if len(path) == 2 else f"{name}[{path[2]}]"
    return f"arg{path[1]}"


def _dtypes(args, kwargs) -> str:
    return "(" + ", ".join(dtype_name(t.dtype) or "?" for _, t in tensor_args(args, kwargs)) + ")"
