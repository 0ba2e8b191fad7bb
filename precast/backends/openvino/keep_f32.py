"""The ops precast's plan keeps fp32, marked so that OpenVINO's CPU plugin keeps them in f32 under its bf16 hint.

Under the bf16 hint OpenVINO's CPU plugin lowers every f32 node it may (``Graph::EnforceInferencePrecision``), the
ones precast kept fp32 included (RMSNorm's multiplies, rotary adds, a Linear the plan excludes). A node whose
conversion to f16 is disabled keeps its original precision (intel_cpu ``Node::keepOrigPrecision``), so:

- ``keep_plan_fp32`` gives each op ``fp32_ops`` finds the runtime-info key of OpenVINO's DisableFP16Compression
  (``precise``, ``KEEP_PRECISION``), then sends the model through OpenVINO's IR in memory (``through_ir``): its
  writer stores the key as ``DisablePrecisionConversion`` and its reader makes that the typed attribute the plugin
  reads (OpenVINO 2026.4.1; the typed key set from Python holds a string, which the plugin refuses, "Bad as").
- **A bias the plugin would fuse.** The marks are not copied when a transformation replaces a node: the plugin's
  ``FullyConnectedBiasFusion`` makes a new FullyConnected of a marked MatMul and its marked ``Add`` of a constant
  bias, unmarked, which the bf16 hint then lowers (measured: ``Linear(64, 64)`` kept fp32 by the plan ran bf16,
  the reason ``auto`` fell back to the f32 hint for any plan-fp32 Linear with a bias). The fusion needs the bias
  to be a Constant: ``_bias_apart`` reads it through a Reshape (to ``[1, N]`` or ``[N]``: the same values,
  broadcast the same way), itself marked, and marked not to be constant-folded after the IR round trip (the
  marks OpenVINO's frontend gives a weight's decompression; the plugin then computes it once, when it compiles).
  The FullyConnected then keeps its mark and runs f32, its bias added in f32 by an element-wise layer of its own
  (tested on the plugin's runtime model).

The plan check (``plan_check.check_plan``) still holds every layer to precast's decision: a mark the plugin loses
another way shows there.

Input: an ``openvino.Model`` converted from precast's program and the decomposed GraphModule it was converted
from. Output: the model to compile under the bf16 hint, and how many ops were marked.
"""

from __future__ import annotations

from typing import Any

# The runtime-info keys OpenVINO's frontend sets on the cast of a weight it keeps compressed (its
# ``disable_constant_folding`` and ``mark_as_decompression``, which its Python API does not expose; the plugin
# tests for the keys alone): such a node is not constant-folded by the transformations, and computed once, when
# the plugin compiles.
COMPRESSED_CAST = ("DisableConstantFolding_0", "decompression_0")
# The runtime-info key of OpenVINO's DisableFP16Compression ("precise", version 0); see the module docstring.
KEEP_PRECISION = "precise_0"
# the friendly-name suffix of the Reshape a kept bias is read through (``_bias_apart``)
BIAS_APART = "/precast_bias_kept_f32"
# ops that only move or reinterpret data (or are casts, constants, the model's ends): never marked
_NOT_COMPUTE = frozenset(
    {
        "Parameter",
        "Result",
        "Constant",
        "Convert",
        "Reshape",
        "Transpose",
        "Gather",
        "Concat",
        "ShapeOf",
        "Squeeze",
        "Unsqueeze",
        "Broadcast",
        "StridedSlice",
        "Slice",
        "Split",
        "VariadicSplit",
        "ReadValue",
        "Assign",
        "Tile",
        "Range",
    }
)


def fp32_ops(model: Any, graph_module: Any) -> list[Any]:
    """The computing ops of ``model`` (named ``<fx node>/...`` by OpenVINO's frontend) that run an FX node the
    plan decided fp32, or an undecided one the program computes in fp32 (what ``plan_check.check_plan`` holds
    each layer to), with an f32 output. Empty for a program without precast's decisions: no plan to keep."""
    import openvino as ov

    from precast.backends.openvino.plan_check import computed_dtypes, planned_dtypes

    planned, computed = planned_dtypes(graph_module), computed_dtypes(graph_module)
    if not planned:
        return []
    found = []
    for op in model.get_ordered_ops():
        fx = op.get_friendly_name().split("/", 1)[0]
        if (op.get_type_name() in _NOT_COMPUTE and not _from_integers(op)) or op.get_output_size() == 0:
            continue
        dtype = planned[fx][0] if fx in planned else computed.get(fx)
        if dtype == "fp32" and op.get_output_element_type(0) == ov.Type.f32:
            found.append(op)
    return found


def _from_integers(op: Any) -> bool:
    """``op`` converts integers to a float (an int8-asym embedding's gathered rows and zero points): marked with
    the ops reading it, or the plugin makes it bf16 (exact) and the element-wise layer that dequantizes then
    reports bf16 where the plan computes fp32."""
    return op.get_type_name() == "Convert" and op.get_input_element_type(0).is_integral_number()


def keep_plan_fp32(model: Any, graph_module: Any) -> tuple[Any, int]:
    """Each op ``fp32_ops`` finds marked ``KEEP_PRECISION``, each constant bias of a marked MatMul read apart
    (``_bias_apart``), through OpenVINO's IR (see the module docstring). Returns the model to compile (the one
    given when there is nothing to mark) and how many ops were marked. ``model`` itself is left unmarked (it is
    what ``save`` writes)."""
    if not fp32_ops(model, graph_module):
        return model, 0
    copy = model.clone()
    ops_ = fp32_ops(copy, graph_module)
    for op in ops_:
        op.get_rt_info()[KEEP_PRECISION] = ""
    apart = _bias_apart(copy)
    made = through_ir(copy)
    if apart:
        for op in made.get_ordered_ops():
            if op.get_friendly_name().endswith(BIAS_APART):
                info = op.get_rt_info()
                for key in COMPRESSED_CAST:  # not constant-folded, as a weight's decompression
                    info[key] = ""
    return made, len(ops_)


def _bias_apart(model: Any) -> int:
    """Each marked ``Add`` of a marked MatMul and a Constant reads the constant through a marked Reshape (see the
    module docstring): to ``[N]`` where it is ``[..., 1, N]``, else ``[1, N]``. Returns how many."""
    import numpy as np
    import openvino.opset13 as ops

    found = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Add" or not _is_marked(op):
            continue
        sources = [op.input_value(i).get_node() for i in range(2)]
        kinds = [s.get_type_name() for s in sources]
        if sorted(kinds) != ["Constant", "MatMul"] or not _is_marked(sources[kinds.index("MatMul")]):
            continue
        port = kinds.index("Constant")
        bias = op.input_value(port)
        shape = list(bias.get_shape())
        if not shape or any(d != 1 for d in shape[:-1]):
            continue
        to = [shape[-1]] if len(shape) > 1 else [1, shape[-1]]
        apart = ops.reshape(bias, ops.constant(np.array(to, np.int64)), False)
        apart.set_friendly_name(op.get_friendly_name().split("/", 1)[0] + BIAS_APART)
        apart.get_rt_info()[KEEP_PRECISION] = ""
        op.input(port).replace_source_output(apart.output(0))
        found += 1
    if found:
        model.validate_nodes_and_infer_types()
    return found


def _is_marked(op: Any) -> bool:
    return KEEP_PRECISION in op.get_rt_info()


def through_ir(model: Any) -> Any:
    """``model`` written as OpenVINO IR and read back: runtime info OpenVINO's IR writer knows becomes the typed
    attribute its reader makes (``KEEP_PRECISION``). The weights are read back mapped from the file (a copy into
    memory took 4x as long), which stays mapped after the temporary folder is removed (where a system refuses to
    remove a mapped file, the folder is left to the system's temporary-file cleanup)."""
    import tempfile
    from pathlib import Path

    import openvino as ov

    with tempfile.TemporaryDirectory(prefix="precast-ov-", ignore_cleanup_errors=True) as folder:
        xml = Path(folder) / "model.xml"
        ov.save_model(model, str(xml), compress_to_fp16=False)
        return ov.Core().read_model(str(xml))
