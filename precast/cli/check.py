"""precast check FILE.pt2 [--inputs FILE.pt]: error of the converted program against its float32 reference.

The float32 reference of a converted program is the same graph with precision taken out of it:

- every low-precision constant gets its original dtype back (``precast.constant_sources``): the original
  float32 value when the program still holds it, else the stored low-precision value widened (the original
  float32 weights are not in the file, so weight rounding is *not* part of the measured error);
- every dtype argument naming bfloat16/float16 names float32 instead: casts to a low dtype become casts to
  float32 (an integer mask cast to bf16 inside a region still becomes floating), and tensors a region creates
  in a low dtype (``torch.zeros(..., dtype=torch.bfloat16)``, T5's position bias) are created in float32;
  export's dtype asserts go.

So the metrics measure what running activations in low precision costs, on the same graph and weights.

Input: a saved program and optional inputs. Output: error metrics per output (table or JSON), exit status.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from precast.cli.flags import TRUST_PICKLE, add_command, flag
from precast.errors import PrecastError, first_line
from precast.ir.program import strip_dtype_asserts
from precast.metrics import compare_outputs

LOW = (torch.bfloat16, torch.float16)


ARGUMENTS = (
    flag("program", help="a program saved with torch.export.save"),
    TRUST_PICKLE,
    flag(
        "--inputs",
        default=None,
        help="inputs saved with torch.save: a tensor, a tuple, (args, kwargs), or a dict keyed by the forward's "
        "argument names",
    ),
    flag("--json", action="store_true", help="print the metrics as JSON"),
)


def add_parser(sub: Any) -> None:
    """``precast check``: the flags of ``ARGUMENTS``, run by ``run``; the module docstring is its description."""
    add_command(
        sub,
        "check",
        ARGUMENTS,
        run=run,
        help="compare a converted program against its float32 reference (max abs/rel error, cosine, bitwise)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def fp32_reference(ep: torch.export.ExportedProgram) -> torch.nn.Module:
    """The converted program's float32 reference (see the module docstring)."""
    module = strip_dtype_asserts(ep.module())
    for fqn, value in _fp32_constants(ep).items():
        _set_attr(module, fqn, value)
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target not in REINTERPRET:
            node.args = _widen(node.args)
            node.kwargs = _widen(node.kwargs)
    module.recompile()
    return module


# ops whose dtype argument reinterprets bits rather than converting values: never widened
REINTERPRET = (torch.ops.aten.view.dtype,)


def _widen(value):
    """``value`` (node arguments) with every low floating dtype replaced by float32."""
    if isinstance(value, torch.dtype):
        return torch.float32 if value in LOW else value
    if isinstance(value, (list, tuple)):
        return type(value)(_widen(v) for v in value)
    if isinstance(value, dict):
        return {k: _widen(v) for k, v in value.items()}
    return value


def _fp32_constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """FQN -> float32 value for every low-precision constant: its original when the program still holds it (a
    weight read both in fp32 and in a region), else the stored value widened."""
    from precast.ir.program import constant_sources

    values = {**ep.state_dict, **ep.constants}
    sources = constant_sources(ep)
    out = {}
    for fqn, value in values.items():
        if not isinstance(value, torch.Tensor) or value.dtype not in LOW:
            continue
        src = sources.get(fqn)
        want = src.original_dtype if src is not None and src.original_dtype not in LOW else torch.float32
        original = values.get(src.original) if src is not None else None
        if isinstance(original, torch.Tensor) and original.dtype == want:
            value = original
        out[fqn] = value.detach().to(want)
    return out


def _set_attr(module: torch.nn.Module, fqn: str, value: torch.Tensor) -> None:
    *path, name = fqn.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    if isinstance(getattr(owner, name, None), torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    setattr(owner, name, value)


def load_inputs(path: str | None, ep) -> tuple[tuple, dict]:
    """(args, kwargs) for the program: the example inputs it carries, or a file saved with torch.save holding a
    tensor, a tuple, (args, kwargs), or a dict keyed by the forward's own argument names (``{"X": t}``) or by
    export's lowercased ones."""
    from precast.ir.inputs import bind_inputs
    from precast.pipeline.load import load_saved

    if path is None:
        if ep.example_inputs is None:
            raise PrecastError(
                "the program carries no example inputs; pass --inputs FILE.pt (saved with torch.save)"
            )
        return bind_inputs(ep, ep.example_inputs, "the program's example inputs")
    value = load_saved(path, "--inputs", f"save the inputs with torch.save((x,), '{Path(path).name}')")
    return bind_inputs(ep, value, f"--inputs {path}")


def _run(path: str, what: str, module: torch.nn.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)``; a failure is one line naming the program, which run failed and the error."""
    try:
        return module(*args, **kwargs)
    except Exception as exc:
        raise PrecastError(
            f"{path}: running {what} on these inputs failed with {type(exc).__name__}: {first_line(exc)}"
        ) from exc


def run(args: argparse.Namespace) -> int:
    from precast.ir.inputs import flat_user_inputs
    from precast.paths import check_input_file
    from precast.pipeline.load import check_program_file, load_program

    check_program_file(args.program)  # both files checked before the (slow) load
    if args.inputs is not None:  # missing, a folder, a FIFO or a device: one line, nothing opened
        check_input_file(args.inputs, "save the inputs with torch.save((x,), PATH)", "--inputs")
    ep = load_program(args.program, trust_pickle=args.trust_pickle)
    inputs, kwargs = load_inputs(args.inputs, ep)
    flat_user_inputs(ep, inputs, kwargs, f"--inputs {args.inputs}" if args.inputs else "the example inputs")
    with torch.no_grad():
        got = _run(args.program, "the program", ep.module(), inputs, kwargs)
        want = _run(args.program, "its float32 reference", fp32_reference(ep), inputs, kwargs)
    rows = compare_outputs(got, want)
    if args.json:
        clean = [
            {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in r.items()}
            for r in rows
        ]
        print(json.dumps({"reference": "float32", "outputs": clean}, indent=2))
        return 0
    print(f"{'output':<8} {'dtype':<9} {'max abs':>10} {'max rel':>10} {'cosine':>10}  bitwise")
    for i, r in enumerate(rows):
        print(
            f"{i:<8} {r['dtype']:<9} {r['max_abs']:>10.3g} {r['max_rel']:>10.3g} {r['cosine']:>10.6f}  "
            f"{'yes' if r['bitwise'] else 'no'}"
        )
    return 0
