"""A compiled OpenVINO model saved in the form it runs, and opened again without converting the program.

``precast.compile(program, backend="openvino")`` converts the program (``openvino.convert_model``: tens of seconds
for an LLM), makes the form its precision hint needs (``precision.prepare``), compiles it and checks the compiled
model against precast's plan. ``save_form`` writes that *prepared* form as OpenVINO IR, plus a record of everything
the compile decided or found (the hint and compile options, the plan check, the compressed-weight check, how the
caches are held, the OpenVINO version and what OpenVINO reports of the CPU); ``open_form`` compiles the IR
with the same options and hands back the same ``OpenVINOModel``, with nothing converted.

A saved form is valid where it was made for: the same OpenVINO version and the same CPU capabilities OpenVINO
reports (native bf16, fp16 kernels: they decide the hint and the form). ``stale_reason`` says, in words, why a
form is not valid here (the caller rebuilds it from the program and says so).

Input: an ``OpenVINOModel`` and a path; a path and a record. Output: the IR and its record; an ``OpenVINOModel``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch.utils._pytree as pytree

from precast.backends.openvino.compressed import StoredWeight, WeightCheck
from precast.backends.openvino.convert import ov_message, require_openvino
from precast.backends.openvino.growing_cache import Growing
from precast.backends.openvino.ir_files import save_ir
from precast.backends.openvino.plan_check import LayerPrecision, PlanCheck
from precast.backends.openvino.precision import native_bf16, native_fp16, restore_marks
from precast.errors import PrecastError
from precast.runtime.records import record_mismatch
from precast.runtime.signature import ProgramSignature

RECORD_VERSION = 1


def cpu_facts(core: Any) -> dict[str, Any]:
    """What OpenVINO reports of this CPU that decides a saved form: its version, native bf16, fp16 kernels."""
    import openvino as ov

    return {"openvino": ov.get_version(), "native_bf16": native_bf16(core), "native_fp16": native_fp16(core)}


def save_form(model: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Write ``model``'s compiled form (an ``OpenVINOModel``) as IR at ``path`` (``.xml`` + ``.bin``); returns the
    record ``open_form`` needs (JSON-able)."""
    import openvino as ov

    if model.form_model is None:
        raise PrecastError("save_form: this OpenVINOModel keeps no compiled form (it was opened from one)")
    files = save_ir(model.form_model, path)
    return {
        "version": RECORD_VERSION,
        "made_on": cpu_facts(ov.Core()),
        "config": dict(model.config),
        "plan": dataclasses.asdict(model.plan),
        "weights": dataclasses.asdict(model.weights),
        "growing": dataclasses.asdict(model.growing) if model.growing is not None else None,
        "cache_form": model.cache_form,
        "dynamic_quantization": model.dynamic_quantization,
        "bin_bytes": files["bin_bytes"],
        # what a call needs of the program: opening the form reads no program (a decoder's graph takes seconds)
        "signature": model.signature.to_dict(),
        "out_spec": pytree.treespec_dumps(model._out_spec) if model._out_spec is not None else None,
    }


def stale_reason(record: dict[str, Any], core: Any) -> str:
    """Why the form ``record`` describes is not valid on this machine ("" when it is)."""
    stale = record_mismatch(record, RECORD_VERSION, ("config", "plan", "weights", "signature", "made_on"))
    if stale:
        return stale
    made, here = record.get("made_on") or {}, cpu_facts(core)
    if made.get("openvino") != here["openvino"]:
        return f"made with OpenVINO {made.get('openvino')}, this is {here['openvino']}"
    for fact, what in (("native_bf16", "native bf16"), ("native_fp16", "fp16 kernels")):
        if bool(made.get(fact)) != here[fact]:
            return f"made on a CPU {'with' if made.get(fact) else 'without'} {what}, this one differs"
    return ""


def open_form(xml: str | os.PathLike, record: dict[str, Any], *, threads: int | None = None) -> Any:
    """The ``OpenVINOModel`` of a form ``save_form`` wrote: the IR read (its weights mapped from the ``.bin``) and
    compiled with the recorded options; its signature and output structure from the record (no program read).
    Check ``stale_reason`` first."""
    from precast.backends.openvino.compiled import OpenVINOModel

    ov = require_openvino()
    started = time.perf_counter()
    core = ov.Core()
    config = dict(record["config"])
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    try:
        ov_model = core.read_model(str(xml))
        # the string marks the IR does not keep: the bf16 and f32 forms read bf16 weights as compressed weights
        # (without the mark OpenVINO folds each into an f32 copy), the bf16 form keeps biases apart
        restore_marks(ov_model)
        compiled = core.compile_model(ov_model, "CPU", config)
    except RuntimeError as exc:
        raise PrecastError(f"{xml}: OpenVINO cannot read or compile it: {ov_message(exc)}") from exc
    out_spec = record.get("out_spec")
    return OpenVINOModel(
        ov_model,
        compiled,
        None,
        _plan(record["plan"]),
        growing=Growing(**record["growing"]) if record.get("growing") else None,
        precision_hint=record["plan"].get("hint"),
        threads=threads,
        compile_seconds=time.perf_counter() - started,
        weight_check=_weight_check(record["weights"]),
        dynamic_quantization=bool(record.get("dynamic_quantization")),
        config=config,
        form_model=None,
        signature=ProgramSignature.from_dict(record["signature"]),
        out_spec=pytree.treespec_loads(out_spec) if out_spec is not None else None,
    )


def _plan(data: dict[str, Any]) -> PlanCheck:
    def layer(d: dict[str, Any]) -> LayerPrecision:
        return LayerPrecision(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    fields = {f.name for f in dataclasses.fields(PlanCheck)}
    plain = {k: v for k, v in data.items() if k in fields and k not in ("layers", "lowered")}
    return PlanCheck(
        layers=[layer(d) for d in data.get("layers", [])],
        lowered=[layer(d) for d in data.get("lowered", [])],
        **plain,
    )


def _weight_check(data: dict[str, Any]) -> WeightCheck:
    def stored(d: dict[str, Any]) -> StoredWeight:
        return StoredWeight(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    reads = [stored(d) for d in data.get("stored", [])]
    # the uncompressed reads are some of the stored ones (WeightCheck tells them apart by identity)
    off = [next(r for r in reads if r == stored(d)) for d in data.get("uncompressed", [])]
    return WeightCheck(
        stored=reads,
        layers=dict(data.get("layers", {})),
        uncompressed=off,
        unaccounted=int(data.get("unaccounted", 0)),
        activations=str(data.get("activations", "")),
    )


def bin_of(xml: str | os.PathLike) -> Path:
    """The ``.bin`` beside an IR's ``.xml``."""
    return Path(xml).with_suffix(".bin")


def save(model: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``precast.save`` of an ``OpenVINOModel``: ``save_form``, with a line saying what was written."""
    record = save_form(model, path)
    shapes = [i.get_partial_shape() for i in model.ov_model.inputs]
    dynamic = all(s.rank.get_length() == 0 or s[0].is_dynamic for s in shapes)
    batch = "dynamic batch" if dynamic else "static shapes"
    if model.state_names:  # a KV cache held as OpenVINO variables
        batch += f", {len(model.state_names)} cache(s) held as state between calls ({model.cache_form})"
    summary = f"{bin_of(path).name} beside it, {record['bin_bytes'] / 2**20:.2f} MB, {batch}; plan: {model.plan.summary()}"
    return {**record, "facts": {"summary": summary}}


def load(xml: str | os.PathLike, record: dict[str, Any], *, threads: int | None = None) -> Any:
    """``precast.load`` of a form ``save`` wrote: ``open_form`` where it is valid here, else one line saying why
    (``stale_reason``) and what to do."""
    ov = require_openvino()
    why = stale_reason(record, ov.Core())
    if why:
        raise PrecastError(
            f"{xml}: its OpenVINO form is not valid here ({why}); compile the program again here"
        )
    return open_form(xml, record, threads=threads)
