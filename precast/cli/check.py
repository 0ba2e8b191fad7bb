"""precast check FILE.pt2/DIR [--inputs FILE.pt] [--tokenizer tokenizer.json] [--text FILE] [--tokens N]: error of
the converted program against its float32 reference.

The float32 reference of a converted program is the same graph with precision taken out of it:

- every low-precision constant gets its original dtype back (``precast.constant_sources``): the original
  float32 value when the program still holds it, else the stored low-precision value widened (the original
  float32 weights are not in the file, so weight rounding is *not* part of the measured error);
- every dtype argument naming bfloat16/float16 names float32 instead: casts to a low dtype become casts to
  float32 (an integer mask cast to bf16 inside a region still becomes floating), and tensors a region creates
  in a low dtype (``torch.zeros(..., dtype=torch.bfloat16)``, T5's position bias) are created in float32;
  export's dtype asserts go.

So the metrics measure what running activations in low precision costs, on the same graph and weights.

A decoder exported with transformers' recipe (or the folder ``precast export-llm`` wrote) is also measured on
text, with the numbers an LLM is judged by: KLD (nats/token), top-1 agreement and perplexity against the same
float32 reference, on ``--tokens`` tokens of ``--text`` (default: Python's own documentation, ``pydoc_data``)
tokenized with ``--tokenizer`` (default: the folder's tokenizer.json). For a folder, the accuracy export-llm
measured against the original fp32 weights (its export.json) is printed too: that one includes the weights'
rounding.

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
from precast.report.model import accuracy_line

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
    flag(
        "--tokenizer",
        default=None,
        metavar="tokenizer.json",
        help="a decoder: the tokenizer its text is read with (default: the export-llm folder's)",
    ),
    flag(
        "--text",
        default=None,
        metavar="FILE",
        help="a decoder: plain text to measure KLD/top-1/perplexity on (default: Python's documentation)",
    ),
    flag(
        "--tokens",
        type=int,
        default=512,
        metavar="N",
        help="a decoder: tokens of text measured on (default 512; 0: none)",
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
        help="compare a converted program against its float32 reference (max abs/rel error, cosine, bitwise; "
        "for a decoder: KLD, top-1 agreement, perplexity on text)",
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
    from precast.paths import check_input_file
    from precast.pipeline.load import check_program_file

    folder, recorded = _read_folder(args)
    check_program_file(args.program)  # every file checked before the (slow) load
    if args.inputs is not None:  # missing, a folder, a FIFO or a device: one line, nothing opened
        check_input_file(args.inputs, "save the inputs with torch.save((x,), PATH)", "--inputs")
    _check_text_flags(args)
    ep = _load(args, folder)
    text, note = _on_text(args, ep)
    rows = _compare(args, ep) if text is None or args.inputs or ep.example_inputs is not None else []
    if args.json:
        clean = [
            {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in r.items()}
            for r in rows
        ]
        body = {"reference": "float32", "outputs": clean}
        if text is not None or note or recorded:
            body.update(text=text, text_note=note, recorded=recorded)
        print(json.dumps(body, indent=2))
        return 0
    if rows:
        print(f"{'output':<8} {'dtype':<9} {'max abs':>10} {'max rel':>10} {'cosine':>10}  bitwise")
    for i, r in enumerate(rows):
        print(
            f"{i:<8} {r['dtype']:<9} {r['max_abs']:>10.3g} {r['max_rel']:>10.3g} {r['cosine']:>10.6f}  "
            f"{'yes' if r['bitwise'] else 'no'}"
        )
    if text is not None:
        print(f"on text: {accuracy_line(text)}")
    elif note:
        print(note)
    if recorded:
        print(f"recorded by export-llm: {accuracy_line(recorded)}")
    return 0


def _compare(args: argparse.Namespace, ep: torch.export.ExportedProgram) -> list[dict]:
    """The metrics per output on --inputs or the program's example inputs (a decoder measured on text and
    saved without example inputs, as export-llm's weightless program.pt2: none)."""
    from precast.ir.inputs import flat_user_inputs

    inputs, kwargs = load_inputs(args.inputs, ep)
    flat_user_inputs(ep, inputs, kwargs, f"--inputs {args.inputs}" if args.inputs else "the example inputs")
    with torch.no_grad():
        got = _run(args.program, "the program", ep.module(), inputs, kwargs)
        want = _run(args.program, "its float32 reference", fp32_reference(ep), inputs, kwargs)
    return compare_outputs(got, want)


def _read_folder(args: argparse.Namespace) -> tuple[Any, dict | None]:
    """A folder ``precast export-llm`` wrote as PROGRAM: its program (and tokenizer, unless --tokenizer) into
    ``args``; (the folder read, or None for a program file; the accuracy its export.json recorded, or None)."""
    if not Path(args.program).is_dir():
        return None, None
    from precast.llm.folder import open_folder

    folder = open_folder(args.program)
    args.program = str(folder.program)
    if args.tokenizer is None and folder.tokenizer is not None:
        args.tokenizer = str(folder.tokenizer)
    recorded = folder.manifest.get("accuracy")
    return folder, (recorded if isinstance(recorded, dict) and _is_record(recorded) else None)


def _load(args: argparse.Namespace, folder: Any) -> torch.export.ExportedProgram:
    """The program: a folder's with its weights (wherever the folder holds them: the OpenVINO IR's binary for
    one written with --backend openvino), else the file."""
    from precast.pipeline.load import load_program

    if folder is None:
        return load_program(args.program, trust_pickle=args.trust_pickle)
    from precast.llm.folder import folder_program

    return folder_program(folder, trust_pickle=args.trust_pickle)


def _is_record(record: dict) -> bool:
    """An accuracy record as precast.llm.accuracy writes it (a hand-edited one is not printed)."""
    numbers = ("kld", "top1", "top1_se", "ppl", "reference_ppl", "seconds")
    return all(isinstance(record.get(k), (int, float)) for k in numbers) and isinstance(
        record.get("positions"), int
    )


def _check_text_flags(args: argparse.Namespace) -> None:
    """--tokens, --text and --tokenizer checked before the program loads (one line each)."""
    from precast.paths import check_input_file

    if args.tokens < 0:
        raise PrecastError(f"--tokens {args.tokens}: give a number >= 0 (0: not measured on text)")
    if args.text is not None:
        check_input_file(args.text, "give a plain text file", "--text")
    if args.tokenizer is not None:
        check_input_file(args.tokenizer, "give a tokenizer.json", "--tokenizer")


def _on_text(args: argparse.Namespace, ep: torch.export.ExportedProgram) -> tuple[dict | None, str]:
    """(the decoder's accuracy on text against its float32 reference, or None; a line saying why not, or "")."""
    from precast.ir.program import private_state
    from precast.llm import accuracy

    if not args.tokens:
        return None, ""
    if accuracy.decoder_convention(ep) is None:
        if args.text is None:
            return None, ""
        return None, (
            f"--text: not measured: {args.program} is not a decoder of transformers' recipe (token ids and the "
            "positions of a static KV cache it writes)"
        )
    if args.tokenizer is None:
        return None, (
            "a decoder: give --tokenizer tokenizer.json (or the folder export-llm wrote) to measure KLD, top-1 "
            "agreement and perplexity on text"
        )
    from precast.llm.checkpoint import read_text

    text = read_text(args.text, "--text") if args.text is not None else None
    agreement = accuracy.on_held_out_text(
        fp32_reference(private_state(ep)),
        ep,
        _read_tokenizer(args.tokenizer),
        tokens=args.tokens,
        text=text,
        name=f"--text {Path(args.text).name}" if args.text else "the text",
        reference_name="its float32 reference (the weights as stored)",
    )
    return agreement.record(), ""


def _read_tokenizer(path: str) -> Any:
    """--tokenizer's tokenizer.json (the ``tokenizers`` library); one line when it is not one."""
    from precast.llm.folder import read_tokenizer

    return read_tokenizer(path, "--tokenizer")
