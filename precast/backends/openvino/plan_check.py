"""Is precast's plan honoured by OpenVINO? Each executed layer's runtime precision against precast's decisions.

After ``compile_model``, OpenVINO's CPU plugin describes what it will execute: ``compiled.get_runtime_model()``
has one op per executed layer, whose rt_info gives the layer type, the precision it runs in
(``runtimePrecision``), its output precisions and the ops of the converted model it executes
(``originalLayersNames``, several when layers were fused). The converted model's ops are named
``<fx node>/<aten op>/<OpenVINO op>`` after the FX node of the decomposed program OpenVINO translated, and each of
those FX nodes carries precast's decision (``node.meta["custom"]["precast"]["decision"]``, copied by
``run_decompositions`` onto every node an op decomposes into). So each layer maps back to the precast nodes it
runs, and its precision can be compared with theirs.

- A layer is **checked** when it executes at least one node precast decided (fp32, bf16 or fp16). Layers that
  only move data (Reshape, Transpose, Gather, Reorder, ...: exact in any dtype), that run only casts, that
  OpenVINO made up (a layout Reorder), or that compute in no floating precision (an integer or boolean layer: a
  comparison building an attention mask, into which OpenVINO fused a decided ``where``) are counted as not
  checked.
- A layer **honours** the plan when every dtype precast decided for its nodes is a precision it runs in: its
  ``runtimePrecision``, or for a fused elementwise ``Subgraph`` (which evaluates each fused op in the type the
  graph gives it) the floating precisions of its inputs and outputs.
- A layer that does not is an **override**: ``check_plan`` returns them, and ``warn_overrides`` emits one
  ``PlanOverrideWarning`` line summing them up (how many, what they run against precast's decision, the first
  one); ``PlanCheck.overridden`` names each.
- A layer that runs no decided node but computes (not only moves data) is an override too when it runs only in a
  low precision while every value its nodes make is fp32 in the program (``LayerPrecision.undecided``): under
  OpenVINO's bf16 hint the plugin lowers ops of its own choosing, decided or not.

Input: an ``openvino.CompiledModel`` and the decomposed GraphModule OpenVINO converted. Output: ``PlanCheck``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from precast.backends.openvino.compressed import decompression_nodes
from precast.backends.openvino.fused_kernels import accepted
from precast.backends.openvino.fused_kernels import summary as fused_summary
from precast.ir.program import META_KEY

# OpenVINO element type names -> precast's dtype names
_OV_DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
_PLANNED = ("fp32", "bf16", "fp16")
# layers that move or copy data without arithmetic: any precision gives the same values
_DATA_MOVEMENT = frozenset(
    {
        "Input",
        "Output",
        "Const",
        "Reorder",
        "Reshape",
        "Transpose",
        "Gather",
        "Concatenation",
        "Split",
        "StridedSlice",
        "Broadcast",
        "ShapeOf",
        "Tile",
        "Convert",
    }
)


class PlanOverrideWarning(UserWarning):
    """OpenVINO runs a layer in a precision other than the one precast decided for its ops."""


class HintFallbackWarning(UserWarning):
    """``precision_hint="auto"`` compiled with the f32 hint because the faster hint overrode the plan."""


@dataclass
class LayerPrecision:
    """One executed layer: what it runs in, and what precast decided for the nodes it executes."""

    layer: str  # the runtime layer's name
    layer_type: str  # OpenVINO CPU plugin's layer type (FullyConnected, MVN, Subgraph, ...)
    runtime: tuple[str, ...]  # the precision(s) it computes in (precast names: fp32, bf16, fp16)
    planned: tuple[str, ...]  # the dtypes precast decided for its nodes
    nodes: tuple[str, ...]  # those nodes, by their names in precast's converted program
    undecided: bool = False  # no decided node: ``planned`` is the dtype the program computes its nodes in
    # why a layer that does not run the planned dtype is accepted (``fused_kernels.accepted``), else ""
    accepted: str = ""

    @property
    def honoured(self) -> bool:
        return set(self.planned) <= set(self.runtime)

    def describe(self) -> str:
        runs = "/".join(self.runtime) or "?"
        what = "the program computes" if self.undecided else "precast decided"
        return (
            f"layer {self.layer!r} ({self.layer_type}) runs {runs} where {what} "
            f"{'/'.join(self.planned)} for {', '.join(self.nodes)}"
        )


@dataclass
class PlanCheck:
    """The comparison of every executed layer with precast's plan (see the module docstring)."""

    layers: list[LayerPrecision] = field(default_factory=list)  # the checked layers
    unchecked: int = 0  # executed layers with no precast decision, or that only move data
    by_runtime: dict[str, int] = field(default_factory=dict)  # checked layers per runtime precision
    # batch norms with a low-precision input and fp32 statistics, which OpenVINO's frontend rounds (see
    # ``rounded_batch_norms``)
    batch_norms: list[str] = field(default_factory=list)
    lowered: list[LayerPrecision] = field(default_factory=list)  # undecided fp32 layers run in low precision
    hint: str | None = None  # the precision hint the model was compiled with (None: OpenVINO's default)
    fallback: str = ""  # why an earlier hint was given up (``precision_hint="auto"``), when it was
    form: str = ""  # how the model was made for its hint (``precision.prepare``)
    reason: str = ""  # why that hint (``precision.hint_reason``): the CPU's capabilities, or the caller

    @property
    def checked(self) -> int:
        return len(self.layers)

    @property
    def overridden(self) -> list[LayerPrecision]:
        found = [layer for layer in self.layers if not layer.honoured] + self.lowered
        return [layer for layer in found if not layer.accepted]

    @property
    def accepted(self) -> list[LayerPrecision]:
        """The layers of OpenVINO's fused f32 kernels accepted where they run a plan-fp32 op (``fused_kernels``)."""
        return [layer for layer in self.layers + self.lowered if layer.accepted]

    def summary(self) -> str:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(self.by_runtime.items()))
        norms = f"; batch norms with rounded statistics: {len(self.batch_norms)}" if self.batch_norms else ""
        fused = f"; {fused_summary(self.accepted)}" if self.accepted else ""
        return (
            f"{self.checked} layers checked ({runs}), overridden: {len(self.overridden)}{norms}{fused}; "
            f"{self.unchecked} layers without a precast decision or moving data only; hint {self.hint or 'default'}"
            + (f" ({self.form})" if self.form else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "overridden": [asdict(layer) for layer in self.overridden],
            "accepted": [asdict(layer) for layer in self.accepted],
            "unchecked": self.unchecked,
            "by_runtime": dict(self.by_runtime),
            "batch_norms": list(self.batch_norms),
            "hint": self.hint,
            "fallback": self.fallback,
            "form": self.form,
            "reason": self.reason,
        }


def planned_dtypes(graph_module: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    """FX node name -> (precast's dtype name, the precast node's name), for nodes precast decided a float
    dtype for (from the decision record a conversion writes into custom meta; it survives saving). The nodes that
    only dequantize an int8/int4 weight are left out (``compressed.decompression_nodes``)."""
    out = {}
    skip = decompression_nodes(graph_module)
    for node in graph_module.graph.nodes:
        if node.name in skip:
            continue
        decision = ((node.meta.get("custom") or {}).get(META_KEY) or {}).get("decision") or {}
        if decision.get("dtype") in _PLANNED:
            out[node.name] = (decision["dtype"], decision.get("name", node.name))
    return out


def computed_dtypes(graph_module: torch.fx.GraphModule) -> dict[str, str]:
    """FX node name -> the dtype name of the floating value it makes (its first tensor), for fp32/bf16/fp16."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    out = {}
    skip = decompression_nodes(graph_module)  # an int8/int4 weight's dequantization: not held to a dtype
    for node in graph_module.graph.nodes:
        if node.name in skip:
            continue
        val = node.meta.get("val")
        first = next(
            (v for v in (val if isinstance(val, (tuple, list)) else (val,)) if isinstance(v, torch.Tensor)),
            None,
        )
        if first is not None and first.dtype in names:
            out[node.name] = names[first.dtype]
    return out


def _rt(info: Any, key: str) -> str:
    value = info.get(key) if hasattr(info, "get") else None
    if value is None:
        try:
            value = info[key]
        except (KeyError, IndexError, RuntimeError):
            return ""
    return value.astype(str) if hasattr(value, "astype") else str(value)


def _runtime(op: Any, layer_type: str, info: Any) -> tuple[str, ...]:
    precision = _OV_DTYPES.get(_rt(info, "runtimePrecision"))
    if precision is None and layer_type == "FullyConnected" and op.get_input_size():
        # a compressed weight (compressed): runtimePrecision is the weight's type (i8, u4), the layer
        # computes in its activation's
        precision = _OV_DTYPES.get(str(op.get_input_element_type(0).get_type_name()))
    if layer_type != "Subgraph":
        return (precision,) if precision else ()
    # a fused elementwise subgraph computes each op in its own type: the precisions at its boundaries
    found = {_OV_DTYPES.get(p.strip()) for p in _rt(info, "outputPrecisions").split(",")}
    found |= {
        _OV_DTYPES.get(str(op.get_input_element_type(i).get_type_name())) for i in range(op.get_input_size())
    }
    found.discard(None)
    return tuple(sorted(found))


def check_plan(compiled: Any, graph_module: torch.fx.GraphModule) -> PlanCheck:
    """Compare each executed layer of ``compiled`` (an ``openvino.CompiledModel``) with the decisions on
    ``graph_module`` (the decomposed program OpenVINO converted)."""
    planned = planned_dtypes(graph_module)
    computed = computed_dtypes(graph_module)
    nodes = {n.name: n for n in graph_module.graph.nodes}
    check = PlanCheck()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer_type = _rt(info, "layerType")
        originals = [n for n in _rt(info, "originalLayersNames").split(",") if "/" in n]
        fx_names = dict.fromkeys(n.split("/", 1)[0] for n in originals)
        decided = [planned[n] for n in fx_names if n in planned]
        if layer_type in _DATA_MOVEMENT or not decided:
            check.unchecked += 1
            made = {computed[n] for n in fx_names if n in computed}
            runtime = _runtime(op, layer_type, info) if layer_type not in _DATA_MOVEMENT else ()
            if made == {"fp32"} and runtime and "fp32" not in runtime:
                names = tuple(fx_names)
                why = accepted(op, layer_type, runtime, list(names), nodes)
                check.lowered.append(
                    LayerPrecision(op.get_friendly_name(), layer_type, runtime, ("fp32",), names, True, why)
                )
            continue
        runtime = _runtime(op, layer_type, info)
        if not runtime:  # computes in no floating precision (a comparison building a mask): nothing to hold
            check.unchecked += 1
            continue
        layer = LayerPrecision(
            layer=op.get_friendly_name(),
            layer_type=layer_type,
            runtime=runtime,
            planned=tuple(sorted({dtype for dtype, _ in decided})),
            nodes=tuple(dict.fromkeys(name for _, name in decided)),
        )
        if not layer.honoured:
            layer.accepted = accepted(op, layer_type, runtime, list(fx_names), nodes)
        check.layers.append(layer)
        for precision in layer.runtime:
            check.by_runtime[precision] = check.by_runtime.get(precision, 0) + 1
    return check


def rounded_batch_norms(graph: torch.fx.Graph) -> list[str]:
    """Batch norms with a bf16/fp16 input and fp32 statistics (autocast's, and so precast's, choice): eager
    computes them in fp32, but OpenVINO's frontend converts the statistics to the input's dtype first (and folds
    them into the preceding convolution's low-precision weights), a per-channel rounding the runtime model does
    not show. Their node names."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or "batch_norm" not in str(node.target) or len(node.args) < 2:
            continue
        x, w = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
        if (
            isinstance(x, torch.Tensor)
            and isinstance(w, torch.Tensor)
            and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == torch.float32
        ):
            out.append(node.name)
    return out


def warn_overrides(check: PlanCheck, stacklevel: int = 3) -> None:
    """At most three lines: one ``PlanOverrideWarning`` summing up the overridden layers (``check.overridden``
    lists each), one naming the batch norms whose fp32 statistics OpenVINO rounds, and one
    ``HintFallbackWarning`` when ``precision_hint="auto"`` gave up a faster hint (``check.fallback``)."""
    if check.batch_norms:
        warnings.warn(
            f"OpenVINO overrides precast's plan: batch norm(s) {', '.join(check.batch_norms)} take a low-precision "
            "input with fp32 statistics (computed in fp32 in eager), which OpenVINO rounds to the input's dtype "
            "and folds into the convolution's low-precision weights; fuse each batch norm into its convolution "
            "before converting (torch.nn.utils.fusion.fuse_conv_bn_eval) to keep that accuracy",
            PlanOverrideWarning,
            stacklevel=stacklevel,
        )
    if check.overridden:
        warnings.warn(override_summary(check), PlanOverrideWarning, stacklevel=stacklevel)
    if check.fallback:
        warnings.warn(
            f"precast.compile(backend='openvino'): {check.fallback} (slower; the plan runs as decided). "
            "model.plan.fallback says the same",
            HintFallbackWarning,
            stacklevel=stacklevel,
        )


def override_summary(check: PlanCheck) -> str:
    """One line for every overridden layer: how many, by what they run and what was decided, the first one."""
    layers = check.overridden
    kinds = Counter(f"{'/'.join(x.runtime)} for {'/'.join(x.planned)}" for x in layers)
    by_kind = ", ".join(f"{n} run {kind}" for kind, n in kinds.most_common())
    if check.hint == "f32" and all(x.runtime == ("fp32",) for x in layers):
        # what the f32 hint overrides is a low dtype OpenVINO has no kernels for here (no native bf16 / no FP16
        # capability) or a mix of dtypes no one hint runs: the layers compute in fp32, closer to fp32, no faster
        return (
            f"OpenVINO computes in fp32 in {len(layers)} layer(s) under the f32 hint ({by_kind}; e.g. "
            f"{layers[0].describe()}): it has no kernels on this CPU for their low dtype, or the plan mixes dtypes "
            "no one OpenVINO hint runs; model.plan.overridden lists them, model.plan.reason says why f32"
        )
    return (
        f"OpenVINO overrides precast's plan in {len(layers)} layer(s) under the {check.hint or 'default'} hint "
        f"({by_kind}; e.g. {layers[0].describe()}); model.plan.overridden lists them; compile with "
        "precision_hint='auto' (the default) or 'f32' to run the program's own dtypes, or keep those ops out of "
        "the low-precision plan"
    )
