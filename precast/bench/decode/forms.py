"""The decode forms ``precast bench --llm`` and the source checkout's decode script build: one
``Variant`` per form, each built by its own builder from one shared ``Build`` (the fp32 model, its programs).

- ``EAGER``, ``HAND``, ``PRECAST``, ``OPENVINO``, ``WEIGHTS``, ``VARIANTS``: the forms' names (``WEIGHTS``:
  int8/int4 weights and a mixed int4/int8 plan, ``q4_k_m_rules``, outside ``DEFAULT_VARIANTS``);
  ``BF16_HAND_FORMS`` and ``FP32_FORMS`` the hand-cast bf16 and fp32 ones (the ratios' references).
- ``build_variants``: every asked form built (compiled packages reused from a work folder); a form that fails
  carries its error (a row of the table, not the end of the run).
- ``convert_llm``, ``check_reload``: precast's conversion of the decoder and its ``load_weights`` check.

Input: form names, a shape, a work folder. Output: ``Variant`` objects (a callable, bytes, what a fresh process
needs to measure its memory).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from precast.bench.decode.model import Shape, export_decoder, llama, read_bytes, wrapped
from precast.quant.presets import q4_k_m_rules

EAGER = ("eager_fp32", "eager_autocast", "eager_bf16")
HAND = ("aoti_fp32", "aoti_fp32_frozen", "aoti_bf16", "aoti_bf16_frozen", "aoti_bf16_autotune")
PRECAST = (
    "precast_torch",
    "precast_torch_default",
    "precast_auto",
    "precast_torch_autotune",
    "precast_auto_autotune",
)
OPENVINO = ("precast_openvino", "openvino_anchor", "openvino_anchor_inprocess")
# weights stored in 8/4 bits (issue 41): precast's plan with weight_format= on AOTInductor (the default form) and
# OpenVINO (the default call), and OpenVINO's own export with optimum-cli --weight-format int8; not in the default
# table (benchmarks/llm_decode_weights.py runs them beside their bf16 forms)
WEIGHTS = (
    "precast_torch_int8",
    "precast_torch_int8a",
    "precast_torch_int4",
    "precast_torch_q4km",
    "precast_openvino_int8",
    "precast_openvino_int8a",
    "precast_openvino_int4",
    "precast_openvino_q4km",
    "openvino_anchor_int8",
    "openvino_anchor_int4",
)
_FORMAT_OF = {
    "int8": "int8",
    "int8a": "int8-asym",
    "int4": "int4",
}  # a form's name's last part -> weight format
# ..._q4km: a mixed int4/int8 plan, llama.cpp's Q4_K_M choice of which tensors get more bits (q4_k_m_rules)
MIXED = "q4km"
DEFAULT_VARIANTS = EAGER + HAND + PRECAST + OPENVINO
VARIANTS = DEFAULT_VARIANTS + WEIGHTS
# max-autotune with Inductor's C++ GEMM template alone: choosing between it and ATen by timing both at compile
# time is a coin toss on a loaded machine (measured: ATen's mm "0.23 ms" against the template's "20 ms" for one
# shape, 13 ms against 32 ms for another), so the autotune forms take the template wherever it applies
CPP_GEMM = {"max_autotune_gemm_backends": "CPP"}
FP32_FORMS = ("eager_fp32", "aoti_fp32", "aoti_fp32_frozen")
BF16_HAND_FORMS = ("eager_bf16", "aoti_bf16", "aoti_bf16_frozen", "aoti_bf16_autotune")
ANCHOR = "openvino_anchor"


@dataclasses.dataclass
class Variant:
    name: str
    run: Callable[..., Any] | None  # run(input_ids=, cache_position=) -> logits
    package: Path | None = None  # a compiled package (for the fresh-process memory), None for eager
    # precast's packages hold no weights: the fresh process loads the converted program and precast.compile's it
    compile_spec: dict[str, Any] | None = None
    stored_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # weights / cache bytes held
    read_bytes: int = 0  # bytes a decode step reads (every weight but the embedding table, + the whole cache)
    reloadable: str = ""  # "yes" / "no" / why
    compile_s: float | None = None
    error: str | None = None
    note: str = ""
    anchors: dict[int, Any] | None = None  # openvino_anchor: its process per thread count
    rss_mb: float | None = None  # measured by the variant's own fresh process (the anchor)


@dataclasses.dataclass
class Build:
    """What the builders share: the shape, the fp32 model and the programs the asked forms need."""

    shape: Shape
    work: Path
    cache_dir: str | None
    threads: tuple[int, ...]
    anchor: str | None
    fp32: torch.nn.Module
    ep32: torch.export.ExportedProgram | None
    bf16: torch.nn.Module | None
    ep16: torch.export.ExportedProgram | None
    variants: dict[str, Variant]

    @property
    def tag(self) -> str:
        return f"{self.shape.tag()}-torch{torch.__version__}"


def state_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    return {**ep.state_dict, **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def call(model: Any) -> Callable[..., Any]:
    def run(input_ids: torch.Tensor, cache_position: torch.Tensor) -> Any:
        return model(input_ids=input_ids, cache_position=cache_position)

    return run


def aoti(ep: torch.export.ExportedProgram, path: Path, configs: dict[str, Any]) -> tuple[Any, float]:
    """AOTInductor's package of ``ep`` at ``path`` (compiled there once, reused after) and the seconds it took."""
    import torch._inductor

    started = time.perf_counter()
    if not path.exists():
        tmp = path.with_suffix(".tmp.pt2")
        with torch.no_grad():  # freezing applies only under no_grad
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=configs)
        os.replace(tmp, path)
    return torch._inductor.aoti_load_package(str(path)), time.perf_counter() - started


def save_program(ep: torch.export.ExportedProgram, path: Path) -> Path:
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp.pt2")
        torch.export.save(ep, str(tmp))
        os.replace(tmp, path)
    return path


# ---- builders, one per kind of form ----------------------------------------------------------------------------
def build_eager(b: Build, v: Variant) -> None:
    if v.name == "eager_autocast":
        m = wrapped(llama(b.shape), b.shape).model

        def run(input_ids, cache_position, m=m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(input_ids=input_ids, cache_position=cache_position)

        v.run = run
    else:
        m = wrapped(b.fp32 if v.name == "eager_fp32" else b.bf16, b.shape).model
        v.run = call(m)
    v.reloadable = "yes (module)"
    v.stored_bytes, v.read_bytes = read_bytes(module_state(m))


def build_hand(b: Build, v: Variant) -> None:
    """AOTInductor on the fp32 or the hand-cast bf16 program: as compiled, frozen, or max-autotune."""
    ep = b.ep32 if "fp32" in v.name else b.ep16
    assert ep is not None
    configs: dict[str, Any] = {"freezing": True} if v.name.endswith("frozen") else {}
    if v.name.endswith("autotune"):
        configs = {"max_autotune": True, **CPP_GEMM}
    v.package = b.work / f"{v.name}-{b.tag}.pt2"
    model, v.compile_s = aoti(ep, v.package, configs)
    v.run = call(model)
    v.reloadable = {"freezing": "no (frozen)", "max_autotune": "no (packed copies)"}.get(
        next(iter(configs), ""), "yes (load_constants)"
    )
    v.stored_bytes, v.read_bytes = read_bytes(state_of(ep))


def weight_format_of(name: str, layers: int | None = None) -> str | dict[str, str] | None:
    """The ``weight_format=`` a form's name ends with (``precast_torch_int8`` -> ``int8``, ``..._int8a`` ->
    ``int8-asym``; ``..._q4km`` -> ``q4_k_m_rules(layers)``), or None."""
    last = name.rsplit("_", 1)[1]
    if last == MIXED:
        if layers is None:
            raise ValueError(f"{name}: the mixed plan's rules need the decoder's layer count")
        return q4_k_m_rules(layers)
    return _FORMAT_OF.get(last)


def weight_label(fmt: str | dict[str, str] | None) -> str | None:
    """How a form's note names its weight format (a mixed plan by what it holds)."""
    if isinstance(fmt, dict):
        return f"int4 + {sum(1 for f in fmt.values() if f == 'int8')} int8 rules (llama.cpp's Q4_K_M choice)"
    return fmt


def build_precast(b: Build, v: Variant) -> None:
    """precast.convert (policy torch or auto, bf16, cache bf16; the weight format the name ends with) then
    precast.compile: no options (the form this CPU implies), Inductor's defaults, or max-autotune with the C++ GEMM
    template."""
    import precast

    assert b.ep32 is not None
    fmt = weight_format_of(v.name, b.shape.layers)
    res = convert_llm(b.ep32, v.name.split("_")[1], fmt)
    v.note = res.note
    mode = {"autotune": "max-autotune", "default": "default"}.get(v.name.rsplit("_", 1)[1], "auto")
    configs = CPP_GEMM if mode == "max-autotune" else None
    started = time.perf_counter()
    options = dict(cache_dir=b.cache_dir, dynamic=False, mode=mode, inductor_configs=configs)
    models = {t: precast.compile(res.program, threads=t, **options) for t in b.threads}  # a package per count
    v.compile_s, cm = (time.perf_counter() - started) / len(models), models[b.threads[0]]
    runs = {t: call(m) for t, m in models.items()}
    v.package, v.run = cm.package_path, lambda *a, **k: runs[torch.get_num_threads()](*a, **k)
    if mode == "auto":  # each count's package has the form measured at that count
        forms = "; ".join(
            f"at {t} thread(s) form {m.form['name']}: {m.form['why']}" for t, m in models.items()
        )
        v.note = (v.note + "; " if v.note else "") + forms
    if fmt:
        v.note = (v.note + "; " if v.note else "") + f"weights {weight_label(fmt)}"
    program = save_program(res.program, b.work / f"{v.name}-{b.tag}.program.pt2")
    v.compile_spec = {
        "program": str(program),
        "cache_dir": b.cache_dir,
        "mode": mode,
        "inductor_configs": configs,
        "threads": b.threads[0],
    }
    v.stored_bytes, v.read_bytes = read_bytes(state_of(res.program))
    v.reloadable = check_reload(cm, {k: t.detach().clone() for k, t in b.ep32.state_dict.items()})


def build_precast_openvino(b: Build, v: Variant) -> None:
    """precast's plan on OpenVINO, the KV cache as OpenVINO state: one compiled model per thread count (OpenVINO
    fixes its threads at compile time)."""
    import precast

    assert b.ep32 is not None
    fmt = weight_format_of(v.name, b.shape.layers)
    res = convert_llm(b.ep32, "torch", fmt)
    started = time.perf_counter()
    models = {
        t: precast.compile(res.program, backend="openvino", threads=t)  # the default call
        for t in b.threads
    }
    v.compile_s = (time.perf_counter() - started) / len(models)

    def run(input_ids, cache_position, models=models):
        return models[torch.get_num_threads()](input_ids=input_ids, cache_position=cache_position)

    v.run, v.reloadable = run, "-"
    v.note = "default call, cache bf16" + (f", weights {weight_label(fmt)}" if fmt else "")
    program = save_program(res.program, b.work / f"{v.name}-{b.tag}.program.pt2")
    v.compile_spec = {"program": str(program), "backend": "openvino"}
    v.stored_bytes, v.read_bytes = read_bytes(state_of(res.program))


BUILDERS: dict[str, Callable[[Build, Variant], None]] = {
    **dict.fromkeys(EAGER, build_eager),
    **dict.fromkeys(HAND, build_hand),
    **dict.fromkeys(PRECAST, build_precast),
    "precast_torch_int8": build_precast,
    "precast_torch_int8a": build_precast,
    "precast_torch_int4": build_precast,
    "precast_torch_q4km": build_precast,
    "precast_openvino": build_precast_openvino,
    "precast_openvino_int8": build_precast_openvino,
    "precast_openvino_int8a": build_precast_openvino,
    "precast_openvino_int4": build_precast_openvino,
    "precast_openvino_q4km": build_precast_openvino,
}
# OpenVINO's own export (ANCHOR_FORMS) is built by the source checkout's anchor harness, which adds its builders
# here (``register``): the optimum-intel environment it needs is no part of the package
ANCHOR_FORMS = (ANCHOR, "openvino_anchor_int8", "openvino_anchor_int4", "openvino_anchor_inprocess")


def register(builders: dict[str, Callable[[Build, Variant], None]]) -> None:
    """More forms' builders (the anchor harness's); a name the table lists already is refused."""
    taken = sorted(set(builders) & set(BUILDERS))
    if taken:
        raise ValueError(f"decode forms {taken} have builders already")
    BUILDERS.update(builders)


def builder(name: str) -> Callable[[Build, Variant], None]:
    """The builder of form ``name``; an anchor form nobody registered is one line saying where it comes from."""
    if name not in BUILDERS:
        where = "the source checkout's anchor harness builds it" if name in ANCHOR_FORMS else "no such form"
        raise RuntimeError(f"{name}: {where}")
    return BUILDERS[name]


def build_variants(
    names: tuple[str, ...],
    shape: Shape,
    work: Path,
    cache_dir: str | None,
    log: Callable[[str], None],
    threads: tuple[int, ...] = (1, 2),
    anchor: str | None = None,
) -> tuple[dict[str, Variant], dict[str, torch.Tensor]]:
    """Every asked form built (compiled packages reused from ``work`` when the shape matches); a form that fails
    carries its error. Also returns the fp32 state dict by original name (for load_weights)."""
    fp32 = llama(shape)
    fp32_state = {k: v.detach().clone() for k, v in fp32.state_dict().items()}
    need_bf16_ep = any(n.startswith("aoti_bf16") for n in names)
    t0 = time.perf_counter()
    bf16 = llama(shape, torch.bfloat16) if need_bf16_ep or "eager_bf16" in names else None
    b = Build(
        shape,
        work,
        cache_dir,
        tuple(threads),
        anchor,
        fp32,
        export_decoder(fp32, shape) if any(n.startswith(("aoti_fp32", "precast")) for n in names) else None,
        bf16,
        export_decoder(bf16, shape) if need_bf16_ep and bf16 is not None else None,
        {},
    )
    log(f"exported in {time.perf_counter() - t0:.1f}s")
    for name in names:
        log(f"building {name}")
        v = Variant(name, None)
        try:
            builder(name)(b, v)
        except Exception as exc:  # noqa: BLE001 - one form failing is a row of the table, not the end of the run
            v.run, v.error = (
                None,
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
            )
            log(f"  {name} failed: {v.error}")
            if os.environ.get("LLM_DECODE_DEBUG"):
                import traceback

                traceback.print_exc()
        b.variants[name] = v
    return b.variants, fp32_state


@dataclasses.dataclass
class Converted:
    program: torch.export.ExportedProgram
    note: str


def convert_llm(
    ep: torch.export.ExportedProgram, policy: str, weight_format: str | dict[str, str] | None = None
) -> Converted:
    """``precast.convert(ep, policy=..., dtype=bf16, cache=CacheOptions(dtype=bf16), weights=WeightOptions(...))``."""
    import precast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = precast.convert(
            ep,
            policy=policy,
            dtype=torch.bfloat16,
            cache=precast.CacheOptions(dtype=torch.bfloat16),
            weights=precast.WeightOptions(format=weight_format),
        )
    note = ""
    if policy == "auto":
        mms = [r for r in res.report.nodes if r.op.split(".")[-2:][0] in ("mm", "addmm", "bmm", "linear")]
        low = sum(1 for r in mms if r.dtype and "bf" in r.dtype)
        note = f"auto: {low} of {len(mms)} matmuls bf16"
    return Converted(res.program, note)


def check_reload(cm: Any, fp32_state: dict[str, torch.Tensor]) -> str:
    """load_weights by original names: other weights (every matmul weight halved) must move the logits, and the
    original ones must bring them back bit for bit; 'yes' when both hold, else what failed."""
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])
    other = {k: v * 0.5 if k.endswith("proj.weight") or "lm_head" in k else v for k, v in fp32_state.items()}
    with torch.no_grad():
        before = cm(input_ids=ids, cache_position=pos).clone()
        try:
            cm.load_weights(other)
            moved = not torch.equal(cm(input_ids=ids, cache_position=pos), before)
            cm.load_weights(fp32_state)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return f"no ({str(exc)[:120]})"
        back = torch.equal(cm(input_ids=ids, cache_position=pos), before)
    return "yes" if moved and back else f"no (new weights moved the logits: {moved}; restored: {back})"
