"""A program's inputs: binding user batches (tuples, (args, kwargs), dicts keyed by the forward's own argument
names) to the program's placeholders, with one clear error when they do not fit.

Input: an ExportedProgram / Program and a batch. Output: flat placeholder values.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from precast.errors import PrecastError, first_line, name_list
from precast.ir.program import Program


def user_input_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n, spec in program.input_spec.items() if spec.kind == InputKind.USER_INPUT]


def export_name(name: str) -> str:
    """The placeholder name torch.export gives the input argument ``name`` (``placeholder_naming_pass``:
    every character outside [a-zA-Z0-9] becomes '_', then lowercased)."""
    return re.sub(r"[^a-zA-Z0-9]", "_", name).lower()


def input_names(ep: ExportedProgram) -> tuple[list[str], list[str]]:
    """(positional, keyword) argument names of the program's forward as the user wrote them (``X``, not export's
    ``x``): from ``module_call_graph[0].signature.forward_arg_names`` (kept by torch.export.save), else the
    user-input placeholder names when each positional argument is one tensor."""
    in_spec = ep.call_spec.in_spec
    n_pos, keywords = in_spec.child(0).num_children, list(in_spec.child(1).context)
    sig = ep.module_call_graph[0].signature if ep.module_call_graph else None
    names = list(getattr(sig, "forward_arg_names", None) or [])
    if len(names) == n_pos + len(keywords) and names[n_pos:] == keywords:
        return names[:n_pos], keywords
    users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if all(c.is_leaf() for c in in_spec.child(0).children()) and len(users) >= n_pos:
        return users[:n_pos], keywords
    return [f"args[{i}]" for i in range(n_pos)], keywords


def bind_inputs(ep: ExportedProgram, batch: Any, where: str) -> tuple[tuple, dict]:
    """``batch`` as the (args, kwargs) the program's forward takes: keyword inputs named like the forward's own
    arguments (exactly, else by export's sanitizing rule: ``{"x": t}`` for ``X``) fill its positional
    parameters; an unknown name is an error listing the names the program takes."""
    args, kwargs = normalize_inputs(batch)
    if not kwargs or not _args_kwargs_spec(ep):
        return args, kwargs
    positional, keywords = input_names(ep)
    expected = positional + keywords
    given: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = _resolve_name(key, expected, where)
        if name in given or name in positional[: len(args)]:
            raise PrecastError(f"{where}: input '{name}' is given twice ({key!r} names it again)")
        given[name] = value
    if len(args) > len(positional):
        return args, kwargs  # the structure check says what is wrong
    missing = [n for n in positional[len(args) :] if n not in given]
    if missing:
        raise PrecastError(
            f"{where}: no value for input(s) {name_list(missing)}; the program's inputs are "
            f"({', '.join(expected)})"
        )
    args = args + tuple(given.pop(n) for n in positional[len(args) :])
    return args, {k: given[k] for k in keywords if k in given}


def _args_kwargs_spec(ep: ExportedProgram) -> bool:
    """Whether the program's input spec is export's usual (args tuple, kwargs dict) pair."""
    spec = ep.call_spec.in_spec
    return spec is not None and spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict


def _resolve_name(key: Any, expected: list[str], where: str) -> str:
    if key in expected:
        return key
    found = [n for n in expected if isinstance(key, str) and export_name(n) == export_name(key)]
    if len(found) == 1:
        return found[0]
    raise PrecastError(
        f"{where}: no input named {key!r}; the program's inputs are ({', '.join(expected)}) (the forward's "
        "argument names; export's lowercased names are accepted too)"
    )


def user_values(program: Program, ep: ExportedProgram, batch: Any, index: int | str) -> list[Any]:
    """The batch's user inputs, flat in placeholder order, checked against the program's input structure,
    dtypes and static shapes (one PrecastError naming the batch and the input)."""
    where = f"calibration batch {index}" if isinstance(index, int) else index
    user = flat_user_inputs(ep, *bind_inputs(ep, batch, where), where)
    nodes = user_input_nodes(program)
    if len(user) != len(nodes):
        raise PrecastError(
            f"{where}: {len(user)} inputs given, the program takes {len(nodes)} {_signature(ep)}"
        )
    for node, value in zip(nodes, user, strict=True):
        _check_value(node, value, where)
    return user


def flat_user_inputs(ep: ExportedProgram, args: tuple, kwargs: dict, where: str) -> list[Any]:
    """The user inputs flat, after checking their structure against the program's (one clear error)."""
    in_spec = ep.call_spec.in_spec
    user, spec = pytree.tree_flatten((args, kwargs))
    if in_spec is not None and spec != in_spec:
        given = f"{len(args)} positional input(s)" + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        raise PrecastError(
            f"{where}: its structure ({given}) does not match the program's inputs {_signature(ep)}; give the "
            "inputs as a tuple of positional inputs or a dict keyed by argument name, like the example inputs"
        )
    return user


def _check_value(node: torch.fx.Node, value: Any, where: str) -> None:
    want = node.meta.get("val")
    if not isinstance(want, torch.Tensor):
        return
    if not isinstance(value, torch.Tensor):
        raise PrecastError(f"{where}: input '{node.name}' should be a tensor, got {type(value).__name__}")
    if value.dtype != want.dtype or value.dim() != want.dim():
        raise PrecastError(
            f"{where}: input '{node.name}' is {_desc(value)}, the program takes {_desc(want)}; "
            "calibration batches must look like the example inputs"
        )
    for d, (got, exp) in enumerate(zip(value.shape, want.shape, strict=True)):
        if isinstance(exp, int) and got != exp:
            raise PrecastError(
                f"{where}: input '{node.name}' has shape {tuple(value.shape)}, the program was exported with "
                f"static size {exp} in dim {d}; export with dynamic_shapes or give batches of that shape"
            )
    if value.is_floating_point():
        bad = int((~torch.isfinite(value)).sum().item())
        if bad:
            raise PrecastError(
                f"{where}: input '{node.name}' contains {bad} NaN/inf values; calibration data must be finite"
            )


def placeholder_values(program: Program, user: list[Any]) -> list[Any]:
    """Values for every placeholder of ``program.gm``: constants, then ``user``, for one forward (call it again
    for every forward). Constants come from ``program.constant_value`` only (never the caller's program); a
    constant the program writes (``program.written``) is copied once more, so each forward starts from the
    program's state and leaves it as it was: the converted program starts where the caller's did, and the
    tolerance search never measures a moving target."""
    values = iter(user)
    out = []
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        kind = program.input_spec[node].kind
        if kind == InputKind.USER_INPUT:
            out.append(next(values))
        elif kind == InputKind.TOKEN:
            out.append(None)
        else:
            value = program.constant_value(node)
            written = program.constant_target(node) in program.written and isinstance(value, torch.Tensor)
            out.append(value.detach().clone() if written else value)
    return out


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _signature(ep: ExportedProgram) -> str:
    if not _args_kwargs_spec(ep):
        names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        return "(" + ", ".join(names) + ")"
    positional, keywords = input_names(ep)
    return "(" + ", ".join(positional + [f"{k}=" for k in keywords]) + ")"


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) from a tensor, a tuple of args, a dict of kwargs, or an (args, kwargs) pair."""
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        return example_inputs[0], example_inputs[1]
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    raise PrecastError(
        f"example_inputs must be a tensor, a tuple of inputs, a dict of keyword inputs or (args, kwargs); got "
        f"{type(example_inputs).__name__}"
    )


def check_example_inputs(ep: ExportedProgram, example_inputs: Any) -> tuple[tuple, dict] | None:
    """Inputs given beside a program: checked against its signature now (one clear error), used to verify."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, str) or not isinstance(example_inputs, (torch.Tensor, tuple, list, dict)):
        raise PrecastError(
            f"example_inputs: got {type(example_inputs).__name__}; give the program's inputs as a tuple (x,), "
            "a dict of keyword inputs or (args, kwargs)"
        )
    args, kwargs = normalize_inputs(example_inputs)
    try:
        flat = ep._graph_module_flat_inputs(args, kwargs)  # export's own structure and shape checks
    except Exception as exc:
        raise PrecastError(
            f"example_inputs do not match the program's signature ({first_line(exc)}); give inputs like the "
            "ones it was exported with"
        ) from exc
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, flat, strict=True):
        want = node.meta.get("val")
        if isinstance(want, torch.Tensor) and isinstance(value, torch.Tensor) and value.dtype != want.dtype:
            raise PrecastError(
                f"example_inputs: input '{node.name}' is {value.dtype}, the program takes {want.dtype}; give "
                "inputs like the ones it was exported with"
            )
    return args, kwargs
