"""Which compiled form ``precast.compile`` picks for the CPU it runs on (``mode="auto"``, the default).

A decoder step at batch 1 is a chain of matrix-vector products: its speed is how fast each kernel streams its
weight. Which kernel streams a 16-bit weight fastest depends on the CPU (measured: docs/benchmarks/llm_decode.md):

- ``gemm-template``: Inductor's C++ GEMM template (``max_autotune``, C++ backend). It packs each weight into a
  blocked VNNI copy; its bf16 / fp16 micro-kernel is AMX (``amx_bf16`` / ``amx_fp16`` tiles). Without AMX it is
  fp32 FMA on converted values: the slowest 16-bit form there (issue 34), so it is chosen only with AMX.
- ``onednn-packed``: freezing's CPU linear fusion. Each 16-bit linear becomes ``mkldnn._linear_pointwise`` on a
  weight reordered into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``); oneDNN runs its
  AVX512-BF16 / AVX512-FP16 kernels on it. The blocked copies are recomputed from the weights at load
  (``packed.record_folded_constants``), so weights stay reloadable. Chosen where oneDNN has the 16-bit ISA and
  no AMX template applies.
- ``default``: ATen ``mm`` on weights as stored (Inductor's defaults). For fp32 programs (MKL's packed fp32
  linear measured slower at M=1) and CPUs without a 16-bit ISA.

The choice is a function of the program's matmul weight dtypes and the CPU's reported capabilities
(``torch.cpu.get_capabilities()``, and ``torch.cpu._init_amx()``: the OS lets the process use AMX tiles); it is
recorded on the compiled model (``CompiledModel.form``) and in the cache key (a package built for AMX is never
served to a CPU without it: the configs and the CPU's flags are both in the key).

Input: a program, the capabilities. Output: a ``Form`` (name, inductor configs, why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from precast.cpu import capabilities as cpu_capabilities

# form -> the inductor configs it compiles with (precast adds its constant layout: aoti.compile_configs)
FORM_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "gemm-template": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    "onednn-packed": {"freezing": True},
}
# the capability each 16-bit dtype needs for a form, per form: (form, {dtype: [capabilities all required]})
RULES: tuple[tuple[str, dict[torch.dtype, tuple[str, ...]]], ...] = (
    ("gemm-template", {torch.bfloat16: ("amx_tile", "amx_bf16"), torch.float16: ("amx_tile", "amx_fp16")}),
    ("onednn-packed", {torch.bfloat16: ("avx512_bf16",), torch.float16: ("avx512_fp16",)}),
)
LOW = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    configs: dict[str, Any]
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "why": self.why}


def matmul_weight_bytes(ep: ExportedProgram) -> dict[torch.dtype, int]:
    """Bytes of the 2-d floating constants the program's matmuls / linears read, by dtype (a decode step
    streams these)."""
    from precast.weights.sources import tensor_constants

    constants = tensor_constants(ep)
    by_input = {**ep.graph_signature.inputs_to_parameters, **ep.graph_signature.inputs_to_buffers}
    by_input.update(ep.graph_signature.inputs_to_lifted_tensor_constants)
    ops = {
        torch.ops.aten.linear.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.matmul.default,
    }
    out: dict[torch.dtype, int] = {}
    seen: set[str] = set()
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        for arg in node.args:
            while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and len(arg.args) >= 1:
                if arg.target not in (torch.ops.aten.t.default, torch.ops.aten.permute.default):
                    break
                arg = arg.args[0]
            if not isinstance(arg, torch.fx.Node) or arg.op != "placeholder" or arg.name not in by_input:
                continue
            name = by_input[arg.name]
            value = constants.get(name)
            if name in seen or value is None or value.dim() != 2 or not value.is_floating_point():
                continue
            seen.add(name)
            out[value.dtype] = out.get(value.dtype, 0) + value.numel() * value.element_size()
    return out


def choose_form(ep: ExportedProgram, caps: Mapping[str, Any] | None = None, device: str = "cpu") -> Form:
    """The form ``mode="auto"`` compiles ``ep`` in on this CPU (``caps``: ``cpu_capabilities()`` by default)."""
    if device != "cpu":
        return Form("default", {}, f"device {device}: Inductor's defaults")
    weights = matmul_weight_bytes(ep)
    total = sum(weights.values())
    low = {d: n for d, n in weights.items() if d in LOW}
    if not total or sum(low.values()) * 2 < total:
        return Form(
            "default",
            {},
            "most matmul weight bytes are fp32 (or there are none): ATen's fp32 GEMV is the fastest measured form",
        )
    dtype = max(low, key=lambda d: low[d])
    caps = cpu_capabilities() if caps is None else caps
    name = str(dtype).removeprefix("torch.")
    for form, needs in RULES:
        required = needs.get(dtype, ())
        if required and all(caps.get(c) for c in required):
            return Form(
                form,
                dict(FORM_CONFIGS[form]),
                f"{name} matmul weights; the CPU reports {', '.join(required)}",
            )
    missing = ", ".join(sorted({c for _, needs in RULES for c in needs.get(dtype, ()) if not caps.get(c)}))
    return Form("default", {}, f"{name} matmul weights; the CPU lacks {missing}: ATen's kernels")
