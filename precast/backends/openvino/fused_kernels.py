"""OpenVINO's fused CPU kernels that compute in f32 whatever precision they read and write: where precast's plan
keeps their ops fp32 and rounds their output to bf16 next, the layer is accepted rather than an override.

Under the bf16 hint OpenVINO's CPU plugin fuses a Llama decoder's RMSNorm (``RMSFusion``) and rotary embedding
(``RoPEFusion*``) into one ``RMS`` / ``RoPE`` layer each. The fused node loses the marks that keep a node in f32
(``keep_f32``; the marks are not copyable, and there is no switch for these fusions on the CPU), so it runs in its
input's precision: ``runtimePrecision`` bf16, where precast decided fp32 (a bf16 plan of a 0.246 B Llama: 33 RMS
and 32 RoPE layers; the reason ``precision_hint="auto"`` used to fall back to the f32 hint, 0.91-0.97x OpenVINO's
own bf16 speed). What those kernels compute (OpenVINO 2026.4's intel_cpu ``rope.cpp``, ``rms_norm`` kernel; the
runtime model's input types checked here, per layer):

- ``RoPE``: reads ``x`` in bf16 and ``cos`` / ``sin`` in f32, computes ``x * cos + rotate_half(x) * sin`` in f32,
  writes bf16. Where the plan reads ``x`` in bf16 (a bf16 projection's output, promoted exactly) and casts the
  fp32 result to bf16 next (for a bf16 attention or a bf16 KV cache), that is the plan's arithmetic up to the
  order of f32 roundings (a fused multiply-add): the plan's values, to within one f32 rounding before the bf16
  one.
- ``RMS``: reads ``x`` in bf16, accumulates the mean square and scales in f32, writes bf16. The plan reads ``x``
  in fp32 (the residual stream) and casts the fp32 result to bf16 next (for the bf16 projections): the fused layer
  adds one bf16 rounding of ``x`` on entry (relative error <= 2**-9 per element, the size of the rounding the
  plan makes on its output).

``accepted`` says which and why for one layer: only these kernels, only where every value the layer hands on is
cast to the layer's output precision next in the program (through views), and says whether an input arrives
rounded from an f32 producer (a ``Reorder`` from f32). Their effect on a real model's next-token distribution is
measured in ``docs/backends.md`` (SmolLM2-135M: KL divergence and top-1 agreement against fp32, the default
call's bf16 form beside the f32 form). ``PlanCheck.accepted`` lists the layers; ``model.plan.summary()`` counts
them, in one line, with no warning.

Input: a runtime-model op, its layer's precision record, the decomposed program's nodes. Output: the reason the
layer is accepted, or "".
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# the fused layers whose kernels compute in f32 with low-precision inputs and outputs, and what they read in f32
F32_KERNELS = {
    "RoPE": "computes in f32 (cos and sin read in f32)",
    "RMS": "accumulates and scales in f32",
}
# the ports that must be f32 in the runtime model for the description to hold
_F32_PORTS = {"RoPE": (1, 2), "RMS": ()}
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
# ops that only view or move a value between the layer and the cast that rounds it
_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
    aten.clone.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.select.int,
}
_CASTS = {aten._to_copy.default, aten.to.dtype}


def accepted(
    op: Any, layer_type: str, runtime: tuple[str, ...], names: list[str], nodes: dict[str, Any]
) -> str:
    """Why the runtime layer ``op`` (of ``layer_type``, computing in ``runtime``, running the decomposed program's
    nodes ``names``) is accepted where it overrides an fp32 decision (see the module docstring), or ""."""
    import openvino as ov

    low = [r for r in runtime if r in _LOW]
    if layer_type not in F32_KERNELS or len(low) != 1 or not names:
        return ""
    if any(
        op.get_input_size() <= p or op.get_input_element_type(p) != ov.Type.f32
        for p in _F32_PORTS[layer_type]
    ):
        return ""
    if not rounded_next(names, nodes, _LOW[low[0]], scaled=layer_type == "RMS"):
        return ""
    why = f"OpenVINO's fused {layer_type} kernel {F32_KERNELS[layer_type]}; the plan casts its output to {low[0]} next"
    entered = rounded_on_entry(op)
    if entered:
        why += f"; {entered} input(s) rounded to {low[0]} on entry (the plan reads them in fp32)"
    return why


def rounded_next(names: list[str], nodes: dict[str, Any], dtype: torch.dtype, scaled: bool = False) -> bool:
    """Every value the nodes ``names`` hand to a node outside them is cast to ``dtype`` next (through views; with
    ``scaled``, through a multiply by a weight too: the RMS kernel's ``* gamma``, which the runtime layer does not
    name). Export's dtype assertions, which compute nothing, are left aside."""
    inside = set(names)
    for name in names:
        node = nodes.get(name)
        if node is None:
            return False
        for user in node.users:
            if user.name not in inside and not _cast_next(user, dtype, scaled):
                return False
    return True


def _cast_next(node: Any, dtype: torch.dtype, scaled: bool) -> bool:
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op != "call_function":
            return False
        if n.target is aten._assert_tensor_metadata.default:
            continue
        if n.target in _CASTS and n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None) == dtype:
            continue
        weighted = n.target is aten.mul.Tensor and any(
            isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in n.args
        )
        if n.target not in _VIEWS and not (scaled and weighted):
            return False
        todo += list(n.users)
    return True


def rounded_on_entry(op: Any) -> int:
    """How many of ``op``'s low-precision inputs the plugin made by rounding an f32 value (a ``Reorder`` from
    f32, followed back through other Reorders)."""
    import openvino as ov

    count = 0
    for i in range(op.get_input_size()):
        if op.get_input_element_type(i) not in (ov.Type.bf16, ov.Type.f16):
            continue
        source = op.input_value(i)
        while _layer_type(source.get_node()) == "Reorder" and source.get_node().get_input_size():
            if source.get_node().get_input_element_type(0) == ov.Type.f32:
                count += 1
                break
            source = source.get_node().input_value(0)
    return count


def _layer_type(op: Any) -> str:
    info = op.get_rt_info()
    return info["layerType"].astype(str) if "layerType" in info else ""


def summary(layers: list[Any]) -> str:
    """One line for the accepted layers (``PlanCheck.accepted``): how many of each type, and what they do."""
    if not layers:
        return ""
    kinds: dict[str, int] = {}
    for layer in layers:
        kinds[layer.layer_type] = kinds.get(layer.layer_type, 0) + 1
    counted = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    entered = sum("on entry" in layer.accepted for layer in layers)
    return (
        f"accepted {len(layers)} fused layer(s) ({counted}) that run ops the plan keeps fp32 in OpenVINO's f32 "
        f"kernels, their output rounded where the plan rounds it next"
        + (f"; {entered} of them read an input rounded on entry" if entered else "")
        + " (plan.accepted)"
    )
