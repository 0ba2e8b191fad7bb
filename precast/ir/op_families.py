"""Op families by aten name (no namespace, no overload), shared by the classifier and the rules policy.

Input: none (data). Output: frozensets of aten op names by family.
"""

from __future__ import annotations

CONV_OPS = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "_convolution",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)
MATMUL_OPS = frozenset(
    {
        "linear",
        "mm",
        "addmm",
        "bmm",
        "matmul",
        "baddbmm",
        "addbmm",
        "addmv",
        "mv",
        "dot",
        "einsum",
        "bilinear",
        "tensordot",
    }
)
ATTENTION_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
    }
)
# the matmul / convolution family: what low precision is for
GEMM_OPS = MATMUL_OPS | CONV_OPS | ATTENTION_OPS
# eager kernels that require every floating tensor argument to have one dtype (no type promotion)
SAME_DTYPE_OPS = GEMM_OPS | {
    "vdot",
    "linalg_vecdot",
    "conv_tbc",
    "_addmm_activation",
    "prelu",
    "mkldnn_rnn_layer",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
}
