"""A program whose constants hold no values (converted with streamed weights, or exported without them) made
runnable: ``stand_in`` with each value-less constant a zero broadcast to its shape (no memory; for the device
check, which needs kernels to run, not values), ``with_weights`` with the values read from the weight files.

Input: an ExportedProgram (and a folder of shards or one file). Output: a copy of the program (the input's
constants untouched); one line (PrecastError) when the files do not fit the program.
"""

from __future__ import annotations

import copy
import os

import torch
from torch.export import ExportedProgram

from precast.errors import NAMES_SHOWN, PrecastError, name_list
from precast.ir.fake import has_data
from precast.weights.files import WeightFiles, streamed_targets


def stand_in(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with each value-less constant a zero of its dtype broadcast to its shape: runnable, no memory."""

    def zero(v: torch.Tensor) -> torch.Tensor:
        z = torch.zeros((), dtype=v.dtype).expand(v.shape)
        return torch.nn.Parameter(z, requires_grad=False) if isinstance(v, torch.nn.Parameter) else z

    out = copy.copy(ep)
    out._state_dict = {k: v if has_data(v) else zero(v) for k, v in ep.state_dict.items()}
    out._constants = {
        k: v if not isinstance(v, torch.Tensor) or has_data(v) else zero(v) for k, v in ep.constants.items()
    }
    return out


def with_weights(ep: ExportedProgram, weights: str | os.PathLike) -> ExportedProgram:
    """``ep`` (converted with streamed weights, or exported without them) with its value-less constants read
    from ``weights`` (a folder of shards or one file, names as the program stores them, dtypes and shapes
    checked): a program that runs eagerly (``.module()``), saves with its weights, or goes to another backend."""
    files = WeightFiles(weights)
    targets = streamed_targets(ep)
    files.match(targets)
    missing, problems = [], []
    values: dict[str, torch.Tensor] = {}
    for name in targets:
        v = {**ep.state_dict, **ep.constants}[name]
        if name not in files:
            missing.append(name)
            continue
        shape, dtype = files.shape_dtype(name)
        if shape != tuple(v.shape) or dtype != v.dtype:
            problems.append(
                f"{name} is {dtype} {list(shape)} in the files, {v.dtype} {list(v.shape)} in the program"
            )
            continue
        t = files.read(name)
        values[name] = torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t
    if missing:
        problems.insert(0, f"missing {len(missing)}: {name_list(missing)}")
    if problems:
        another = "these files belong to another model; " if len(missing) * 2 > len(targets) else ""
        more = f" ... ({len(problems)} problems in all)" if len(problems) > NAMES_SHOWN else ""
        raise PrecastError(
            f"weights {files.path}: {another}pass the folder precast.convert wrote for this program: "
            f"{'; '.join(problems[:NAMES_SHOWN])}{more}"
        )
    out = copy.copy(ep)
    out._state_dict = {k: values.get(k, v) for k, v in ep.state_dict.items()}
    out._constants = {k: values.get(k, v) for k, v in ep.constants.items()}
    return out
