"""The rules policy's op taxonomy: which ops are compute (cast to the rule's dtype), which follow their inputs' dtype
(views, index and data movement, comparisons, exact selections, casts), which write in place, and the casts a
decision puts on an op's floating inputs.

Input: an op node and its (fake) arguments. Output: its kind, its casts.
"""

from __future__ import annotations

import torch

from precast.ir.graph import tensor_args

# GEMM_OPS (precast.policy.op_families): what low precision is for; the fallback never moves these
# ops that follow their inputs' dtype: shape/index/data movement, comparisons, exact selections, casts
FOLLOW_OPS = frozenset(
    {
        "clone",
        "contiguous",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "hstack",
        "vstack",
        "index",
        "index_select",
        "gather",
        "take",
        "take_along_dim",
        "flip",
        "roll",
        "repeat",
        "tile",
        "constant_pad_nd",
        "pad",
        "_to_copy",
        "to",
        "type_as",
        "copy",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "where",
        "masked_fill",
        "masked_select",
        "masked_scatter",
        "scatter",
        "index_put",
        "index_copy",
        "index_fill",
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "reshape",
        "flatten",
        "unflatten",
        "repeat_interleave",
        "tril",
        "triu",
        "diag",
        "diagonal_copy",
        "max",
        "min",
        "amax",
        "amin",
        "maximum",
        "minimum",
        "sort",
        "topk",
        "kthvalue",
        "median",
        "argsort",
        "relu",
        "abs",
        "neg",
        "sign",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "isnan",
        "isinf",
        "isfinite",
        "isneginf",
        "isposinf",
        "logical_and",
        "logical_or",
        "logical_not",
        "logical_xor",
        "argmax",
        "argmin",
        "any",
        "all",
        "nonzero",
        "searchsorted",
        "bucketize",
        "bitwise_and",
        "bitwise_or",
        "bitwise_not",
        "lift_fresh_copy",
        "detach",
        "scalar_tensor",
        "sym_size",
        "sym_numel",
        "sym_stride",
        "_assert_tensor_metadata",
        "_assert_scalar",
        "_assert_async",
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "eye",
        "one_hot",
        "unfold",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "narrow",
        "select_scatter",
        "slice_scatter",
        "diagonal_scatter",
        "as_strided_scatter",
        "fill",
        "zero",
    }
)


REDUCE_DIM_OPS = frozenset(
    {
        "sum",
        "mean",
        "nansum",
        "nanmean",
        "cumsum",
        "cumprod",
        "logcumsumexp",
        "softmax",
        "log_softmax",
        "_softmax",
        "_log_softmax",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "norm",
        "linalg_vector_norm",
        "frobenius_norm",
        "logsumexp",
        "prod",
    }
)


NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})

# Ops whose kernels compute in float32 whatever low dtype they are given (ATen WeightNorm.cpp keeps the norm in
# float for half/bf16 on CPU and CUDA, and torch 2.15's decomposition spells that out as an upcast of ``v``):
# lowering their inputs saves nothing and turns a weight stored low into a run-time upcast on every call.
FP32_KERNEL_OPS = frozenset({"_weight_norm", "_weight_norm_interface"})


MATMUL_INNER = {
    "linear": ("w", 1),
    "mm": ("a", 0),
    "bmm": ("a", 0),
    "matmul": ("a", 0),
    "addmm": ("a", 1),
    "baddbmm": ("a", 1),
    "addbmm": ("a", 1),
    "addmv": ("a", 1),
    "mv": ("a", 0),
    "dot": ("a", 0),
}


def op_name(target: object) -> str:
    """``softmax`` for ``aten.softmax.int``; '' for non-ATen targets."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    return ""


def mutates(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def op_kind(node: torch.fx.Node, args: tuple, kwargs: dict) -> str:
    """'compute', 'follow' or 'inplace' (see the module docstring)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "follow"
    if mutates(target):
        return "inplace"
    schema = target._schema
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return "follow"  # a view
    name = op_name(target)
    if name in FOLLOW_OPS or name.rstrip("_") in FOLLOW_OPS:
        return "follow"
    if not any(t.is_floating_point() and t.dtype != torch.float64 for _, t in tensor_args(args, kwargs)):
        return "follow"
    return "compute"


def recorded_kind(node: torch.fx.Node) -> str:
    """``op_kind`` of a node on the fake values the program recorded for its arguments."""

    def val(a: object) -> object:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    return op_kind(node, args, torch.fx.node.map_aggregate(node.kwargs, val))


def casts_for(node: torch.fx.Node, args: tuple, kwargs: dict, target: torch.dtype) -> dict:
    """Casts that bring every floating (not float64) tensor argument to ``target``; mutated arguments never."""
    schema = getattr(node.target, "_schema", None)
    written = set()
    if schema is not None:
        written = {
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        }
        written |= {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return {
        path: target
        for path, t in tensor_args(args, kwargs)
        if t.is_floating_point() and t.dtype not in (torch.float64, target) and path[1] not in written
    }
