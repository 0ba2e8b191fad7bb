"""Exporting a model whose weights are not in memory, for ``precast.convert(..., weights=DIR)``.

``empty_parameters()`` builds a model with its parameters on the meta device and its buffers real (what
accelerate's ``init_empty_weights`` does): the weights cost no memory, while the buffers a model computes at
construction (a rotary table, which no weight file holds) keep their values. ``export_weightless(model, args)``
exports it with ``torch.export`` under a ``FakeTensorMode``: each parameter (meta or real) stands in as a fake
tensor on the inputs' device, the inputs are fake too, and the program's parameters come out as meta tensors,
so ``torch.export.save`` writes a file of kilobytes. The caller's module gets its own parameters back.

Input: an ``nn.Module`` (parameters on meta or real), example inputs. Output: an ExportedProgram whose
parameters (and meta buffers, if the files hold them) are meta tensors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from precast.errors import PrecastError, first_line
from precast.ir.fake import has_data
from precast.threads import TORCH_LOCK
from precast.weights.files import as_meta


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Inside: every parameter a module registers is moved to the meta device as it is registered (buffers
    stay where they are made). One parameter is allocated at a time, then dropped."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            self._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def export_weightless(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export.export`` of ``model`` with fake parameters: see the module docstring."""
    kwargs = dict(kwargs or {})
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors if t.device.type != "meta"}
    if len(devices) > 1:
        raise PrecastError(
            f"export_weightless: the inputs live on several devices ({sorted(map(str, devices))})"
        )
    device = devices.pop() if devices else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved: list[tuple[dict, str, torch.Tensor]] = []  # (the module's store, name, the caller's value)
    with TORCH_LOCK:
        try:
            with mode:
                for module in model.modules():
                    for name, p in list(module._parameters.items()):
                        if p is None:
                            continue
                        saved.append((module._parameters, name, p))
                        fake = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
                        module._parameters[name] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
                for module in model.modules():
                    for name, b in list(module._buffers.items()):
                        if b is not None and not has_data(b):
                            saved.append((module._buffers, name, b))
                            module._buffers[name] = torch.empty_strided(
                                b.shape, b.stride(), dtype=b.dtype, device=device
                            )
                fake_args, fake_kwargs = pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: mode.from_tensor(t.to(device) if t.device.type == "meta" else t),
                    (args, kwargs),
                )
            try:
                ep = torch.export.export(
                    model, tuple(fake_args), fake_kwargs, dynamic_shapes=dynamic_shapes, strict=strict
                )
            except Exception as exc:
                raise PrecastError(f"export_weightless: torch.export failed: {first_line(exc)}") from exc
        finally:
            for store, name, value in saved:
                store[name] = value
    out = copy.copy(ep)
    out._state_dict = {k: _meta(v) for k, v in ep.state_dict.items()}
    out._constants = {k: _meta(v) if isinstance(v, torch.Tensor) else v for k, v in ep.constants.items()}
    # the caller's own inputs (small: token ids) stay the program's example inputs, as torch.export keeps them
    real = all(has_data(t) for t in tensors)
    out._example_inputs = (tuple(args), kwargs) if real else None
    return out


def _meta(v: torch.Tensor) -> torch.Tensor:
    return v if has_data(v) else as_meta(v, requires_grad=False)
