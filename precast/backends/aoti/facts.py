"""What one ``precast.compile`` knows, each fact computed once and handed down (``backends/aoti/compiler.py`` makes
them; ``build.py`` builds the entry from them and ``load.py`` loads it).

- ``ProgramFacts``: about the caller's program: its tensor constants, those holding no data (streamed weights),
  the device its constants run on, the constants its code writes (a KV cache), its stored constants' sources.
- ``CompileJob``: the compile's decisions: the cache folder and key, the final inductor configs, the form, the
  int weights' plan, the thread count, the attention's precision.

Input: the program and the compile's options. Output: two frozen records.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.backends.aoti.attention import AttentionPlan
from precast.backends.aoti.forms import Form
from precast.backends.aoti.int_weights import IntPlan
from precast.backends.aoti.package_cache import StoredConstant, stored_constants
from precast.ir.program import written_targets


@dataclass(frozen=True)
class ProgramFacts:
    """The caller's program as one compile reads it (the program itself is never changed)."""

    ep: ExportedProgram
    constants: dict[
        str, torch.Tensor
    ]  # the tensor constants by stored name (``weights.sources.tensor_constants``)
    fake: list[str]  # the constants without data (fake or meta: streamed weights), sorted
    device: str  # where the constants live at run time (``compiler._check_fake``)

    @functools.cached_property
    def written(self) -> frozenset[str]:
        """The constants the program's code writes (a KV cache): copied for the loader, the model's state."""
        return frozenset(written_targets(self.ep))

    @functools.cached_property
    def stored(self) -> dict[str, StoredConstant]:
        """The stored constants' sources, shapes and devices (``device`` for streamed weights: they have none)."""
        return stored_constants(self.ep, self.device if self.fake else None)


@dataclass(frozen=True)
class CompileJob:
    """One compile's decisions: where its entry lives and what it is compiled with."""

    root: Path  # the cache folder
    key: str  # the entry's key (``package_cache.cache_key``)
    configs: dict[str, Any]  # the final inductor configs
    dynamic: bool  # dim 0 of the inputs re-exported dynamic
    form: Form  # what the configs compile (``forms.as_configured``)
    ints: IntPlan  # the int8 / int4 weights a low-bit kernel reads
    threads: int  # the intra-op thread count the package is compiled for and runs at (``cpp.threads``)
    attention: AttentionPlan = AttentionPlan()  # the 16-bit attentions computed in fp32 (``attention.py``)

    @property
    def entry(self) -> Path:
        return self.root / "aoti" / self.key

    @property
    def options(self) -> str:
        """The in-process memo's key for these options (the program is the memo's other key)."""
        return json.dumps(
            {
                "configs": self.configs,
                "dynamic": self.dynamic,
                "root": str(self.root),
                "form": self.form.name,
            },
            sort_keys=True,
            default=str,
        )
