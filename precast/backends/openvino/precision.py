"""Which precision hint OpenVINO compiles precast's program with, and the form the program takes under each, so that
OpenVINO runs precast's plan as accurately as it can.

Measured on OpenVINO 2026.4.1's CPU plugin (2-core AMD EPYC with avx512_bf16), all-MiniLM-L6-v2 batch 8 x 128
(cosine vs the fp32 model; OpenVINO's own default: 0.99998620, eager autocast's plan in torch: 0.99998417):

- **``hints_to_try``.** With ``precision_hint="auto"`` (the default), a program whose plan lowers ops to bf16, on
  a CPU whose OpenVINO default is bf16 (native bf16), is compiled with the bf16 hint first, the ops the plan keeps
  fp32 marked to keep their precision (``keep_f32.keep_plan_fp32``: left alone, OpenVINO lowers them, keeping
  only the graph's tail after the last Linear/convolution in fp32); OpenVINO's fused RMS and RoPE layers, which
  lose those marks but compute in f32 inside, are accepted where the plan rounds their output to bf16 next
  (``fused_kernels``: listed in ``plan.accepted``, not overrides). If the plan check (``plan_check.check_plan``)
  still finds a layer not running precast's dtype, the program is compiled again with the f32 hint, which runs
  every dtype the graph states but fp16 (in f32). Measured on an AVX512-BF16 EPYC (OpenVINO 2026.4.1): a bf16
  Llama plan (0.246 B) now keeps the bf16 hint under ``auto`` (it fell back to f32, 65 overridden layers, all
  RMS/RoPE), with bf16, int8 and int8-asym weights. ``hint_reason`` says why the first hint was chosen; on a
  CPU without native bf16 (plain AVX2) it is f32, where OpenVINO runs bf16 matmuls and convolutions in fp32.
  An fp16-only plan likewise tries the f16 hint first where OpenVINO lists ``FP16`` among the CPU's capabilities
  (AVX512-FP16 or AVX2-VNNI-2: measured on an Intel Xeon with AMX and AVX512-FP16, the zoo MLP's fp16 plan runs
  every layer in fp16, bitwise the converted program's output); the f16 hint lowers fp32 ops too.
- **Under the bf16 hint: lowered by OpenVINO** (``lowered_by_openvino``). precast's casts to bf16 are read
  through (each bf16 value as the f32 value it was cast from) and bf16 weights through exact casts to f32, so
  OpenVINO lowers the graph itself: each bf16 layer rounds its inputs (correctly) and keeps its fused epilogue in
  fp32, where the plan as written rounds every layer's output. A matmul's or convolution's bf16 weight is read
  through a cast marked as a decompression, as OpenVINO's frontend marks a compressed weight, so the plugin keeps
  the bf16 weight instead of folding an f32 copy of it (the same layers and values in less memory). The plan check
  still holds each layer to precast's decision. MiniLM: 0.99998620 at OpenVINO's default speed (0.99998569 with
  precast's casts as written). Where the f32 typing does not type-check (an op made in bf16 other than by a
  cast), the casts stay as written and only the attention gets f32 inputs (``attention_in_f32``): OpenVINO
  decomposes a bf16 ``ScaledDotProductAttention`` in bf16, rounding the scores before the softmax, where torch's
  CPU kernel (what autocast and precast's plan mean by attention in bf16) keeps scores and softmax in fp32.
- **Under the bf16 hint, a decoder with OpenVINO's fused KV cache** keeps precast's casts as written (the fused
  attention holds the cache in bf16 and keeps scores and softmax in f32, as torch's kernel does), but each matmul
  of a bf16 weight reads it through a cast marked as a decompression, its activation through an exact cast to f32
  and its result cast back (``weights_read_compressed``): a bf16 FullyConnected on the same bf16 weight, as
  OpenVINO runs its own exports' compressed weights. Read directly, the 0.246 B decoder's decode step ran
  1.2-2.5% slower (four paired comparisons in two one-process runs, AVX512-BF16 Zen 4; the same resident memory).
- **The attention's ``scale=``** (``exact_attention_scales``, at conversion): OpenVINO's frontend stores it in the
  query's dtype, for bf16 attention a bf16 constant (1/sqrt(32) as 0.1767578): the softmax's temperature off by
  up to 2**-9 in every layer. precast stores the exact f32 value behind a cast, which the bf16-hint forms read
  directly. This and the form above together close MiniLM's gap to OpenVINO's default.
- **Under the f32 hint a ``Convert`` layer f32 -> bf16 does not round to nearest** (``round_to_nearest``). It
  rounds up only when the last kept bit is 1 (a quarter of random values come out one bf16 ulp away from torch's
  ``.to(torch.bfloat16)``; tested bitwise). A cast OpenVINO fuses into an element-wise ``Subgraph`` rounds
  correctly; one it runs as a layer of its own (with a dynamic batch, or after a layer norm) does not: the plan
  as written ran at 0.999979 instead of 0.999984. Veltkamp's split in front of each such cast, ``c = x * 65537;
  hi = c - (c - x)``, is ``x`` rounded to bf16's 8 significant bits, to nearest (ties to even, tested) in f32
  arithmetic, so the cast that follows is exact; where ``x * 65537`` would overflow (|x| > 5.2e33) the value is
  converted as it is (``Select``). About 4% of MiniLM's time. Never under the bf16 hint, which would lower the
  split's own arithmetic.
- **Under the f32 hint each bf16 weight is read as a compressed weight** (``weights_read_compressed``, before the
  splits, which then round the casts it adds back to bf16): the matmul reads its activation and its bf16 weight
  through exact casts to f32 and its result, bias added, is rounded to bf16 once, as torch's bf16 ``linear``
  rounds it. Read directly, a bf16 weight is widened at compile time into an f32 copy on a CPU without native bf16
  (OpenVINO computes bf16 layers in f32 there, their bf16 results unrounded: measured up to 44 bf16 steps from
  eager's where outputs cancel), and this form is bitwise eager's on the test's MLP. The 0.246 B decoder's default
  call on AVX2 code paths (``ONEDNN_MAX_CPU_ISA=AVX2 OV_CPU_MAX_ISA=AVX2`` on a Zen 4) went from 0.94-0.95x to
  1.18x / 1.28x (1 / 2 threads) the decode speed of OpenVINO's own export, at 0.60x the resident memory, and its
  SmolLM2-135M KL divergence from 0.00092 to 0.00072 (the plan in torch: 0.00073; ``docs/backends.md``). Where the
  CPU has native bf16 and the f32 hint is asked for or fallen back to, the step took 0.96x the time.

A form written as IR and read back loses the string marks that keep a bf16 weight's cast and a kept bias unfolded
(``restore_marks`` puts them back: call it on a saved form read with ``read_model``).

Input: an ``openvino.Model`` converted from precast's program. Output: a copy made for the hint, and its form.
"""

from __future__ import annotations

from typing import Any

from precast.backends.openvino.keep_f32 import BIAS_APART, COMPRESSED_CAST, keep_plan_fp32

HINTS = (
    "auto",
    "f32",
    "bf16",
    "f16",
    None,
)  # None: OpenVINO's own default (bf16 where native), no correction
VELTKAMP = 65537.0  # 2**16 + 1: splits an f32 significand (24 bits) into bf16's 8 bits and the 16 below
SPLIT_LIMIT = 3.4e38 / VELTKAMP  # beyond this x * 65537 overflows: those values are converted as they are
# The ops whose weight (input 1) the CPU plugin reads as a bf16 decompression, in the layer it runs (tested: the
# same layers and outputs as with the weight folded to f32); a GroupConvolution reads its weight through a Reshape.
COMPRESSED_READERS = ("MatMul", "Convolution")


def native_bf16(core: Any) -> bool:
    """Whether OpenVINO's CPU plugin infers in bf16 by default here (a CPU with native bf16 arithmetic)."""
    hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    return str(getattr(hint, "get_type_name", lambda: hint)()) == "bf16"


def native_fp16(core: Any) -> bool:
    """Whether OpenVINO's CPU plugin has fp16 kernels here: it lists ``FP16`` among the CPU's
    ``OPTIMIZATION_CAPABILITIES`` exactly where oneDNN reports avx512_core_fp16 or avx2_vnni_2 (its
    ``hasHardwareSupport(f16)``), the condition under which it runs fp16 at all."""
    return "FP16" in [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def hints_to_try(precision_hint: str | None, planned: set[str], core: Any) -> list[str | None]:
    """The hints to compile with, in order (the first whose plan check finds no override is kept).

    A plan with one low dtype tries that dtype's hint first where the CPU runs it natively: bf16 where OpenVINO's
    default is bf16, fp16 where OpenVINO reports fp16 kernels. Under the f32 hint OpenVINO converts every fp16
    op to f32 (its f16 kernels run only under the f16 hint), so an fp16 plan keeps its dtypes only under the f16
    hint, which in turn lowers the ops precast kept fp32: a plan with fp16 and fp32 layers, or with fp16 and
    bf16, has no hint that honours every layer, and the f32 hint (fp16 layers run in fp32, each warned) is kept.
    """
    if precision_hint != "auto":
        return [precision_hint]
    if "bf16" in planned and "fp16" not in planned and native_bf16(core):
        return ["bf16", "f32"]
    if "fp16" in planned and "bf16" not in planned and native_fp16(core):
        return ["f16", "f32"]
    return ["f32"]


def hint_reason(precision_hint: str | None, planned: set[str], core: Any) -> str:
    """Why ``hints_to_try`` chose its first hint, from what OpenVINO reports about this CPU (its default inference
    precision: bf16 exactly where the CPU has native bf16; ``FP16`` among its capabilities)."""
    if precision_hint != "auto":
        return f"precision_hint={precision_hint!r} given"
    low = planned & {"bf16", "fp16"}
    if not low:
        return "no bf16/fp16 op in the plan: f32"
    if low == {"bf16", "fp16"}:
        return "the plan mixes bf16 and fp16, which no one OpenVINO hint runs: f32"
    if low == {"bf16"}:
        if native_bf16(core):
            return (
                "native bf16 (OpenVINO's default here): the bf16 hint, the plan's fp32 ops kept in f32 (or run in "
                "OpenVINO's fused f32 RMS/RoPE kernels where the plan rounds their output next: plan.accepted)"
            )
        return (
            "no native bf16 on this CPU (OpenVINO's default here is f32; its bf16 would be emulated): the f32 "
            "hint, each bf16 weight read as a compressed weight and each cast to bf16 rounded to nearest in f32 "
            "arithmetic (OpenVINO computes the bf16 layers in f32 on these values)"
        )
    if native_fp16(core):
        return "fp16 kernels here (FP16 in OpenVINO's capabilities): the f16 hint"
    return "no fp16 kernels on this CPU (no FP16 in OpenVINO's capabilities): f32, the fp16 ops run in f32"


def prepare(
    model: Any, hint: str | None, fused_cache: bool = False, graph_module: Any = None
) -> tuple[Any, str]:
    """A copy of ``model`` made for ``hint`` (the model itself is kept as converted: it is what ``save`` writes),
    and the form it takes: "as written" (no hint, or f16: OpenVINO's casts to fp16 round to nearest, ties to even,
    tested), "casts rounded to nearest" (f32), "lowered by OpenVINO"
    (bf16: ``lowered_by_openvino``) or, where that form does not type-check, "casts as written, attention in
    f32" (bf16: ``attention_in_f32``). Under the bf16 hint, with ``graph_module`` (the decomposed program OpenVINO
    converted), the ops the plan keeps in fp32 are marked to stay in f32 (``keep_plan_fp32``)."""
    if hint == "f32":
        model = model.clone()
        read = weights_read_compressed(model)  # first: the casts it adds back to bf16 are rounded too
        round_to_nearest(model)
        return model, "casts rounded to nearest" + (
            f"; {read} bf16 weight read(s) as compressed weights" if read else ""
        )
    if hint != "bf16":
        return model, "as written"
    # marked first: the IR round trip that types the marks drops the string marks the bf16 forms set
    marked, kept = keep_plan_fp32(model, graph_module) if graph_module is not None else (model, 0)
    made, form = _bf16_form(marked, fused_cache)
    return made, form + (f"; {kept} fp32 op(s) of the plan kept in f32" if kept else "")


def _bf16_form(model: Any, fused_cache: bool) -> tuple[Any, str]:
    """A copy of ``model`` for the bf16 hint, and its form (see ``prepare``)."""
    if fused_cache:
        # caches in OpenVINO's growing form (growing_cache): the casts as written, so that every bf16 weight stays
        # one bf16 constant (read through casts to f32, OpenVINO folds each into an f32 copy: +780 MiB on the
        # 0.246 B decoder) and the attention stays the bf16 ScaledDotProductAttention OpenVINO fuses with the
        # cache, whose kernel keeps the scores and the softmax in f32 as torch's does
        made = model.clone()
        read = weights_read_compressed(made)
        return made, "casts as written, attention fused with the KV cache" + (
            f"; {read} bf16 weight read(s) as compressed weights" if read else ""
        )
    lowered = model.clone()
    try:
        lowered_by_openvino(lowered)
        return lowered, "lowered by OpenVINO"
    except (
        RuntimeError
    ) as exc:  # an op made in bf16 other than by a cast (a bf16 arange...): said in the form
        model = model.clone()
        attention_in_f32(model)
        return (
            model,
            f"casts as written, attention in f32 (f32 typing failed: {str(exc).splitlines()[0][:120]})",
        )


def lowered_by_openvino(model: Any) -> int:
    """Under the bf16 hint: every bf16 value precast's casts make is read as the f32 value it was cast from, and
    every bf16 constant through an exact cast to f32, so the graph computes in f32 and OpenVINO's bf16 hint
    lowers it, rounding where its own bf16 layers round (their inputs, correctly; their fused epilogues stay f32).
    The plan check then holds each layer to precast's decision: an op precast kept fp32 that OpenVINO lowers, or
    a bf16 op it leaves in f32, is an override and the model is compiled with the f32 hint instead. Measured on
    MiniLM: OpenVINO's default's cosine to the last digit (0.99998620, against 0.99998569 with precast's casts
    as written). Returns how many casts were bypassed."""
    import openvino as ov
    import openvino.opset13 as ops

    outputs = {id(r): (r, r.get_input_element_type(0)) for r in model.get_results()}  # the program's dtypes
    bypassed = 0
    for op in list(model.get_ordered_ops()):
        if _is_f32_to_bf16(op):
            readers = [
                r for r in op.output(0).get_target_inputs() if r.get_node().get_type_name() != "Result"
            ]
            for reader in readers:
                reader.replace_source_output(op.input_value(0))
            bypassed += bool(readers)
        elif op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.bf16:
            readers = list(op.output(0).get_target_inputs())
            up = ops.convert(op.output(0), "f32")
            if all(_reads_compressed(r) for r in readers):
                _kept_compressed(up)
            for reader in readers:
                reader.replace_source_output(up.output(0))
    model.validate_nodes_and_infer_types()
    for result, dtype in outputs.values():  # each output keeps the dtype the program gives it
        if result.get_input_element_type(0) != dtype:
            result.input(0).replace_source_output(ops.convert(result.input_value(0), dtype).output(0))
    model.validate_nodes_and_infer_types()
    return bypassed


def weights_read_compressed(model: Any) -> int:
    """Every MatMul of a bf16 activation and a bf16 constant weight reads both through exact casts to f32, the
    weight's marked as a decompression (``_kept_compressed``), and its f32 result (with a Linear's own bias,
    added before the one rounding as torch's bf16 ``linear`` adds it: ``_with_bias``) is cast back to bf16 for its
    readers. A weight with other readers (a tied embedding's Gather) keeps
    them on the constant itself: only the matmul reads the cast. Returns how many matmuls were rewritten.

    - Under the bf16 hint, in the casts-as-written form: OpenVINO lowers the casts away and runs a bf16
      FullyConnected on the same bf16 weight, its output rounded to bf16 as before (within one bf16 step: the
      kernel's accumulation order may differ), and the 0.246 B decoder's decode step runs 1.2-2.5% faster than with
      the weight read directly (AVX512-BF16 Zen 4, OpenVINO 2026.4.1; the same resident memory).
    - Under the f32 hint (then ``round_to_nearest`` rounds the casts back, so the output is rounded to bf16 as the
      plan says): an f32 FullyConnected that reads the bf16 weight and widens it in the kernel, where a bf16 weight
      read directly is widened once at compile time into an f32 copy of it on a CPU without native bf16 (twice
      the bytes each token streams). The 0.246 B decoder's decode step: 0.78x the time with the weights read
      directly on AVX2 code paths (a Zen 4 with ``ONEDNN_MAX_CPU_ISA=AVX2 OV_CPU_MAX_ISA=AVX2``), 0.96x where the
      CPU has native bf16 (1 thread; ``docs/backends.md`` names the script).
    """
    import openvino as ov
    import openvino.opset13 as ops

    rewritten = 0
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() != "MatMul" or op.input_value(1).get_node().get_type_name() != "Constant":
            continue
        if op.get_input_element_type(0) != ov.Type.bf16 or op.get_input_element_type(1) != ov.Type.bf16:
            continue
        weight = ops.convert(op.input_value(1), "f32")
        _kept_compressed(weight)
        op.input(1).replace_source_output(weight.output(0))
        op.input(0).replace_source_output(ops.convert(op.input_value(0), "f32").output(0))
        op.validate_and_infer_types()
        last = _with_bias(op)
        readers = list(last.output(0).get_target_inputs())
        back = ops.convert(last.output(0), "bf16")
        for reader in readers:
            reader.replace_source_output(back.output(0))
        rewritten += 1
    if rewritten:
        model.validate_nodes_and_infer_types()
    return rewritten


def _with_bias(matmul: Any) -> Any:
    """The op whose output a rewritten matmul's result is cast back from: the matmul itself, or its one reader
    where that is the same aten op's ``Add`` of a bf16 constant (a Linear's bias: OpenVINO's frontend names both
    ``<fx node>/aten.linear.default/...``; then added in f32 too). A separate ``aten.add`` of a constant is the
    program's own add, which torch runs on the rounded product: left after the cast back. The bias is read through
    an exact cast to f32 (unmarked: OpenVINO folds it, and fuses the add into the FullyConnected)."""
    import openvino as ov
    import openvino.opset13 as ops

    readers = list(matmul.output(0).get_target_inputs())
    if len(readers) != 1 or readers[0].get_node().get_type_name() != "Add":
        return matmul
    add = readers[0].get_node()
    if add.get_friendly_name().rsplit("/", 1)[0] != matmul.get_friendly_name().rsplit("/", 1)[0]:
        return matmul
    other = add.input(1 - readers[0].get_index())
    if (
        other.get_source_output().get_node().get_type_name() != "Constant"
        or other.get_element_type() != ov.Type.bf16
    ):
        return matmul
    other.replace_source_output(ops.convert(other.get_source_output(), "f32").output(0))
    add.validate_and_infer_types()
    return add


def _reads_compressed(reader: Any) -> bool:
    """``reader`` is the weight input of an op OpenVINO's CPU plugin reads a compressed weight in."""
    return reader.get_node().get_type_name() in COMPRESSED_READERS and reader.get_index() == 1


def _kept_compressed(up: Any) -> None:
    """Mark ``up`` (an exact cast of a bf16 weight to f32) the way OpenVINO's own frontend marks the cast of a
    weight it keeps compressed: a decompression, not to be constant-folded. The CPU plugin then reads the bf16
    weight in its FullyConnected / Convolution layer instead of folding the cast into an f32 copy of it (measured:
    0.61x the memory for 16 Linear(1024, 1024), 0.78x for all-MiniLM-L6-v2, the same layers, speed and outputs,
    bitwise: ``docs/benchmarks/ov_weight_memory.md``). Only where those ops are all the weight's readers: a marked
    cast feeding another op stops OpenVINO fusing it (a layer norm's scale) or folding it (a constant subgraph,
    which then runs on every call: tested)."""
    info = up.get_rt_info()
    for key in COMPRESSED_CAST:
        info[key] = ""


def restore_marks(model: Any) -> int:
    """The string runtime-info marks an IR round trip drops, put back on a compiled form read from OpenVINO IR (a
    saved ``prepare`` result): without them OpenVINO constant-folds what they protect, so a kept bias's Reshape
    (``keep_f32.BIAS_APART``) folds into the FullyConnected it was kept apart from (which then loses its f32 mark
    and runs bf16: tested), and a bf16 weight's exact cast into an f32 copy (``_kept_compressed``). The typed
    ``DisablePrecisionConversion`` marks survive the IR. Returns how many nodes were marked again."""
    import openvino as ov

    marked = 0
    for op in model.get_ordered_ops():
        apart = op.get_friendly_name().endswith(BIAS_APART)
        weight = (
            op.get_type_name() == "Convert"
            and op.get_input_element_type(0) == ov.Type.bf16
            and op.get_output_element_type(0) == ov.Type.f32
            and op.input_value(0).get_node().get_type_name() == "Constant"
            and all(_reads_compressed(r) for r in op.output(0).get_target_inputs())
        )
        if apart or weight:
            _kept_compressed(op)
            marked += 1
    return marked


def _is_f32_to_bf16(op: Any) -> bool:
    import openvino as ov

    return (
        op.get_type_name() == "Convert"
        and op.get_input_element_type(0) == ov.Type.f32
        and op.get_output_element_type(0) == ov.Type.bf16
    )


def round_to_nearest(model: Any) -> int:
    """Veltkamp's split in front of every Convert f32 -> bf16 (see the module docstring); returns how many."""
    import numpy as np  # comes with openvino (an extra); precast's core runs without numpy
    import openvino.opset13 as ops

    converts = [op for op in model.get_ordered_ops() if _is_f32_to_bf16(op)]
    for op in converts:
        x = op.input_value(0)
        c = ops.multiply(x, ops.constant(np.float32(VELTKAMP)))
        hi = ops.subtract(c, ops.subtract(c, x))
        small = ops.less(ops.abs(x), ops.constant(np.float32(SPLIT_LIMIT)))
        op.input(0).replace_source_output(ops.select(small, hi, x).output(0))
    if converts:
        model.validate_nodes_and_infer_types()
    return len(converts)


def exact_attention_scales(model: Any, graph_module: Any) -> int:
    """OpenVINO's frontend turns ``scaled_dot_product_attention``'s ``scale=`` (a Python float: torch's kernel
    multiplies by it in fp32) into a constant of the query's dtype, for a bf16 attention a bf16 constant: the
    softmax's temperature off by up to 2**-9 in every layer (MiniLM: 1/sqrt(32) = 0.1767767 stored as 0.1767578).
    Each such constant becomes the exact f32 value cast to the query's dtype, which ``attention_in_f32`` reads
    through; under the f32 hint OpenVINO folds the cast (as before). Returns how many."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    nodes = {n.name: n for n in graph_module.graph.nodes}
    fixed = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "ScaledDotProductAttention" or op.get_input_size() < 5:
            continue
        const = op.input_value(4).get_node()
        node = nodes.get(op.get_friendly_name().split("/", 1)[0])
        scale = node.kwargs.get("scale") if node is not None else None
        low = const.get_output_element_type(0)
        if const.get_type_name() != "Constant" or low not in (ov.Type.bf16, ov.Type.f16):
            continue
        if not isinstance(scale, float):
            continue
        exact = ops.constant(np.array(scale, dtype=np.float32).reshape(const.get_output_shape(0)))
        op.input(4).replace_source_output(ops.convert(exact, low).output(0))
        fixed += 1
    if fixed:
        model.validate_nodes_and_infer_types()
    return fixed


def attention_in_f32(model: Any) -> int:
    """Every ScaledDotProductAttention with bf16 inputs given f32 inputs and its output cast back to bf16 (see the
    module docstring); returns how many."""
    import openvino as ov
    import openvino.opset13 as ops

    found = [
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() == "ScaledDotProductAttention" and op.get_output_element_type(0) == ov.Type.bf16
    ]
    for op in found:
        readers = list(op.output(0).get_target_inputs())
        for i in range(op.get_input_size()):
            if op.get_input_element_type(i) == ov.Type.bf16:
                source = op.input_value(i)
                node = source.get_node()
                if node.get_type_name() == "Convert" and node.get_input_element_type(0) == ov.Type.f32:
                    op.input(i).replace_source_output(node.input_value(0))  # the exact f32 value itself
                else:
                    op.input(i).replace_source_output(ops.convert(source, "f32").output(0))
        op.validate_and_infer_types()
        back = ops.convert(op.output(0), "bf16")
        for reader in readers:
            reader.replace_source_output(back.output(0))
    if found:
        model.validate_nodes_and_infer_types()
    return len(found)
