"""Constants kept outside the AOTInductor package: where their values come from, and which the code never reads.

``precast.compile`` builds packages without their weights (``aot_inductor.package_constants_in_so=False``) and
hands the loader tensors precast owns with ``user_managed=True``: the loader keeps their pointers, so a process
holds each weight once (with the weights inside the .so, the loader copied them out and the .so pages stayed
resident: about twice). Their values come from the program itself, or for a program whose constants are fake or
meta (converted with streamed weights) from safetensors files: one file, or a directory of shards with a
transformers-style ``model.safetensors.index.json``. safetensors never runs code; each file's header is checked
against its size by the safetensors reader, and names, shapes and dtypes against the program before native code
sees a tensor.

Input: a program, a path, a package. Output: ``SafetensorsSource`` (tensors read one at a time), the program's
constants by stored name, placeholders to compile a fake-weight program, and the constants its code never reads.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.export import ExportedProgram

from precast.errors import NAMES_SHOWN, PrecastError, name_list
from precast.ir.fake import lacks_data
from precast.weights.files import WeightFiles

# the reader is precast.weights.files' (conversion streams the same files): one file or a folder of shards, headers
# checked by the safetensors library, an index naming only files inside its folder, tensors read one at a time
SafetensorsSource = WeightFiles


def tensor_constants(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """The program's tensor constants (parameters, buffers, lifted constants) by stored name."""
    return {k: v for k, v in {**ep.state_dict, **ep.constants}.items() if isinstance(v, torch.Tensor)}


def check_stored(source: SafetensorsSource, program: Mapping[str, torch.Tensor], needed: set[str], what: str):
    """One line naming the missing, unexpected and mismatched names of ``source`` against the program's
    constants (stored names, stored dtypes; each list bounded, ``name_list``), the hint first; ``needed``: the
    names the compiled code reads."""
    missing = sorted(needed - set(source))
    unexpected = sorted(set(source) - set(program))
    mismatched = []
    for name in sorted(set(source) & set(program)):
        shape, dtype = source.meta(name)
        want = program[name]
        if shape != tuple(want.shape) or dtype != want.dtype:
            mismatched.append(
                f"{name} is {dtype} {list(shape)}, the program stores {want.dtype} {list(want.shape)}"
            )
    problems = (
        ([f"missing {len(missing)}: {name_list(missing)}"] if missing else [])
        + ([f"unexpected {len(unexpected)}: {name_list(unexpected)}"] if unexpected else [])
        + ([f"{len(mismatched)} mismatched: {'; '.join(mismatched[:NAMES_SHOWN])}"] if mismatched else [])
    )
    if problems:
        shared = len(set(source) & set(needed))
        hint = (
            f"these files belong to another model (only {shared} of the {len(needed)} constants the code reads "
            "are in them); pass"
            if needed and shared * 2 < len(needed)
            else "pass"
        )
        raise PrecastError(
            f"{what}: {source.path} does not match the program's constants: {hint} the weights written by the "
            f"conversion of this program (stored names and dtypes); {'; '.join(problems)}"
        )


def with_placeholders(ep: ExportedProgram, device: str) -> ExportedProgram:
    """A copy of ``ep`` whose fake/meta constants are uninitialized tensors on ``device`` (same shape, stride and
    dtype). A compile whose constants stay outside the package reads their metadata, not their values; the pages
    of an untouched ``torch.empty`` are never made resident."""

    def real(v: object) -> object:
        if not lacks_data(v):
            return v
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t

    state = {k: real(v) for k, v in ep.state_dict.items()}
    constants = {k: real(v) for k, v in ep.constants.items()}
    out = ep._update(ep.graph_module, ep.graph_signature, state_dict=state, constants=constants)
    out.example_inputs = ep.example_inputs
    return out


_INFO = re.compile(r'constants_info_\[(\d+)\]\.(name|original_fqn) = "([^"]*)";')


def package_constants(package: Path) -> tuple[list[str], list[str]] | None:
    """``(every constant the package's code declares, those it never reads)``, by original FQN, from the
    generated wrapper source in the package; None when the package has no single wrapper source to read.

    A constant is unread when its C name occurs only in its ``constants_info_`` entry and its
    ``auto& NAME = constants_->at(i);`` binding (max-autotune's GEMM template reads a packed copy instead)."""
    with zipfile.ZipFile(package) as z:
        wrappers = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        if len(wrappers) != 1:
            return None
        text = z.read(wrappers[0]).decode("utf-8", "replace")
    info: dict[str, dict[str, str]] = {}
    for idx, field, value in _INFO.findall(text):
        info.setdefault(idx, {})[field] = value
    if not info or any(set(d) != {"name", "original_fqn"} for d in info.values()):
        return None
    every, unread = [], []
    for idx, d in sorted(info.items(), key=lambda kv: int(kv[0])):
        every.append(d["original_fqn"])
        cname = re.escape(d["name"])
        binding = re.compile(rf"auto& {cname} = constants_->at\({idx}\);")
        uses = [
            line
            for line in re.findall(rf"^.*\b{cname}\b.*$", text, flags=re.M)
            if not _INFO.search(line) and not binding.search(line)
        ]
        if not uses:
            unread.append(d["original_fqn"])
    return every, unread
