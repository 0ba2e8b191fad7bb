"""``precast.convert``'s options by concern, as typed records: the weights' storage (``WeightOptions``), the
caches (``CacheOptions``), the program's inputs and outputs (``IOOptions``) and verification
(``VerifyOptions``); the rules' options live on ``precast.RulesPolicy`` (the policy object).

``options_of`` turns ``convert``'s arguments into the one flat ``ConvertOptions`` record the pipeline checks
(``pipeline/options.py``), and reads the keywords of the release before (``weight_format=``, ``cache_dtype=``,
``keep_io_types=``, ``exclude_nodes=``, ...) as shortcuts that warn, each naming its new home: kept one release.

Input: ``convert``'s arguments. Output: ``ConvertOptions``, or a one-line ``PrecastError`` (a record of the
wrong type, a concern given twice), or a ``TypeError`` for a keyword ``convert`` never took.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from precast.errors import PrecastError
from precast.pipeline.options import ConvertOptions, cache_dtype_of
from precast.policy.resolve import RULE_OPTIONS


@dataclass(frozen=True)
class WeightOptions:
    """How the program's weights are stored, and where they come from when they are not in memory.

    ``format``: linear/embedding weights in 8 or 4 bits (``"int8"``, ``"int8-asym"``, ``"int4"``, glob rules
    ``{"lm_head*": "int8", "*": "int4"}``, or a ``precast.WeightBudget``; docs/weight_formats.md), passed to the
    conversion as given. ``files``: safetensors files (a file or a folder) of a program exported without its
    weights, streamed one tensor at a time; ``out``: the folder the converted weights are written to (needed
    with ``files``; docs/streaming.md). ``data``: calibration batches (a list of input tuples) the int4 weights are
    fitted on (data-aware int4: GPTQ with each group's step and zero point searched against its inputs'
    importance, ``precast.quant.fit``; None: round-to-nearest, data-free). A ``precast.Budget`` takes its data
    itself (``Budget(data=...)``, fitted the same way by default)."""

    format: Any = None
    files: str | os.PathLike | None = None
    out: str | os.PathLike | None = None
    data: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("files", "out"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise PrecastError(
                    f"WeightOptions({name}={value!r}): give a path (str or os.PathLike) or None"
                )


@dataclass(frozen=True)
class CacheOptions:
    """The caches the program stores into (an LLM's KV cache): ``dtype`` ("bf16", "fp16", "fp32" or a torch
    dtype) holds them in that dtype; None leaves them as the program gives them (docs/llm_export.md)."""

    dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        try:
            cache_dtype_of(self.dtype)
        except PrecastError as exc:
            raise PrecastError(
                f"CacheOptions(dtype={self.dtype!r}): give 'bf16', 'fp16', 'fp32' or a torch dtype"
            ) from exc


@dataclass(frozen=True)
class IOOptions:
    """The converted program's inputs and outputs. ``keep_types``: outputs cast back to the program's dtypes
    (True), left in the dtype that computes them (False), or the policy's default (None). ``dynamic_shapes``:
    ``torch.export``'s, when precast exports a module."""

    keep_types: bool | None = None
    dynamic_shapes: Any = None

    def __post_init__(self) -> None:
        if self.keep_types is not None and not isinstance(self.keep_types, bool):
            raise PrecastError(
                f"IOOptions(keep_types={self.keep_types!r}): give True, False or None (the policy's)"
            )


@dataclass(frozen=True)
class VerifyOptions:
    """Verification: with ``enabled`` the converted program runs against its reference (eager autocast, or the
    unconverted program) on the example inputs, and the report says how far apart they are.
    ``convert(verify=False)`` is short for ``verify=VerifyOptions(enabled=False)``."""

    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise PrecastError(f"VerifyOptions(enabled={self.enabled!r}): give True or False")


# the keywords of the release before, by concern: old name -> (record keyword, the record's field)
SHORTCUTS = {
    "weight_format": ("weights", "format"),
    "weights_out": ("weights", "out"),
    "cache_dtype": ("cache", "dtype"),
    "keep_io_types": ("io", "keep_types"),
    "dynamic_shapes": ("io", "dynamic_shapes"),
}
RECORDS = {"weights": WeightOptions, "cache": CacheOptions, "io": IOOptions, "verify": VerifyOptions}


def options_of(given: Mapping[str, Any], shortcuts: Mapping[str, Any]) -> ConvertOptions:
    """The flat record the pipeline checks, from ``convert``'s arguments (``given``: policy, dtype, device_type,
    weights, cache, io, verify, allow, plan) and the keywords of the release before (``shortcuts``; each warns
    once, naming where it lives now; one given beside its record is refused in one line)."""
    unknown = sorted(set(shortcuts) - set(SHORTCUTS) - set(RULE_OPTIONS))
    if unknown:
        raise TypeError(f"convert() got an unexpected keyword argument {unknown[0]!r}")
    records = {name: _record(name, given[name]) for name in RECORDS}
    fields: dict[str, dict[str, Any]] = {name: {} for name in RECORDS}
    if isinstance(given["weights"], (str, os.PathLike)):  # weights=PATH: the streamed files, as before
        _deprecated("weights=PATH", "weights=precast.WeightOptions(files=PATH, out=...)")
        fields["weights"]["files"] = given["weights"]
    for old, value in shortcuts.items():
        if old in RULE_OPTIONS:
            owner = "AutoPolicy" if given["policy"] == "auto" else "RulesPolicy"
            _deprecated(f"{old}=", f"policy=precast.{owner}({old}=...): it is the policy's option")
            continue
        name, field = SHORTCUTS[old]
        if records[name] is not None:
            raise PrecastError(
                f"{old}= and {name}={records[name]!r} both given: give {name}=precast.{RECORDS[name].__name__}"
                f"({field}=...) alone"
            )
        _deprecated(f"{old}=", f"{name}=precast.{RECORDS[name].__name__}({field}=...)")
        fields[name][field] = value
    weights, cache, io, verify = (
        records[name] or _built(name, fields[name], shortcuts)
        for name in ("weights", "cache", "io", "verify")
    )
    rules = {k: v for k, v in shortcuts.items() if k in RULE_OPTIONS}
    return ConvertOptions.from_keywords(
        {
            **{k: given[k] for k in ("policy", "dtype", "device_type", "allow", "plan")},
            **rules,
            "keep_io_types": io.keep_types,
            "dynamic_shapes": io.dynamic_shapes,
            "verify": verify.enabled,
            "cache_dtype": cache.dtype,
            "weights": weights.files,
            "weights_out": weights.out,
            "weight_format": weights.format,
            "weight_data": weights.data,
        }
    )


def _built(name: str, fields: dict[str, Any], shortcuts: Mapping[str, Any]) -> Any:
    """The record ``name`` from the keywords of the release before; a bad value refused in the user's words
    (``cache_dtype='int8': give ...``, not the record's)."""
    try:
        return RECORDS[name](**fields)
    except PrecastError as exc:
        olds = [old for old, (record, _) in SHORTCUTS.items() if record == name and old in shortcuts]
        said = ", ".join(f"{old}={shortcuts[old]!r}" for old in olds) or f"{name}="
        raise PrecastError(f"{said}: {str(exc).split(': ', 1)[-1]}") from exc


def _record(name: str, value: Any) -> Any:
    """``convert``'s ``name=`` as its record, or None when not given as one (None, or a shortcut: a path for
    ``weights``, a bool for ``verify``); anything else is refused in one line."""
    kind = RECORDS[name]
    if name == "verify":  # never None: verify=None skipped verification before, it means nothing now
        if isinstance(value, bool):
            return VerifyOptions(enabled=value)
        if isinstance(value, kind):
            return value
        raise PrecastError(f"verify={value!r}: give True, False or a precast.VerifyOptions(...)")
    if value is None or isinstance(value, kind):
        return value
    if name == "weights" and isinstance(value, (str, os.PathLike)):
        return None
    shortcut = " (or the streamed weights' path)" if name == "weights" else ""
    raise PrecastError(f"{name}={value!r}: give a precast.{kind.__name__}(...){shortcut} or None")


def _deprecated(old: str, new: str) -> None:
    """One warning for a keyword of the release before, pointing at the user's call of ``convert``."""
    warnings.warn(
        f"convert({old}) is deprecated and goes in the next release: give {new}", FutureWarning, stacklevel=4
    )
