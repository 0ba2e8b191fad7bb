"""Eager autocast's per-device op tables, as data, for every torch precast supports (2.13 to 2.15).

Source: ATen ``aten/src/ATen/autocast_mode.cpp`` (the ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``
block of ``KERNEL_CPU`` lines, and the ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` block, which is the
CUDA one) and the ``AT_FORALL_*`` op lists in ``aten/src/ATen/autocast_mode.h``. The lists below are torch
2.13's registrations (``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")``: 127 names,
``"AutocastCUDA"``: 119); ``CHANGES`` holds what later releases register or no longer register, by release, and
``CUDNN_ONLY`` what only a build with cuDNN registers (``cudnn/AutocastRNN.cpp``). None of them is a fallthrough
kernel, so FALLTHROUGH has no entries; the ``_`` catch-all fallthrough is a backend fallback, not a per-op
registration, and is what "not in the table" means.

At run time the table is the installed torch's: every name this file knows, kept where the live dispatcher
registers it (``table(device)``); a name the dispatcher registers and this file does not know
(``unknown_registrations``) has no category, and a conversion whose program uses one says so
(``autocast-category-unknown``) instead of guessing.

Differences from the C++ text worth knowing:

* The macro lists still name Dimname overloads (``prod.dim_Dimname``, ``softmax.Dimname``,
  ``log_softmax.Dimname``, ``cumprod.dimname``, ``cumsum.dimname``, ``sum.dim_DimnameList``,
  ``norm.names_ScalarOpt_dim``, CPU ``index_copy.dimname``). Those schemas do not exist, nothing is
  registered for them, so they are left out.
* The AutocastCUDA table is compiled into the CPU build too, so a CPU-only torch can check it.

Updating on a torch upgrade: run ``pytest tests/policy/test_torch_tables.py`` under the new torch (a CI lane).
The drift test lists every registration name the dispatcher has and the expected table for that release lacks
(and the reverse). Read the new ``autocast_mode.cpp``/``autocast_mode.h`` (or probe the op under autocast, as
``test_every_category_matches_eager`` does) to put each one in its category, add it to ``CHANGES`` under the
release, and fill in APPEND_DTYPE_OVERLOAD / BANNED_MESSAGES for new entries of those kinds.

Input: an op. Output: its autocast category (lower_precision_fp, fp32, promote, banned, ...).
"""

from __future__ import annotations

import enum
import functools

import torch


class Category(str, enum.Enum):
    LOWER_PRECISION_FP = "lower_precision_fp"  # cast eligible float args to the autocast low dtype
    FP32 = "fp32"  # cast eligible float args to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 when the optional dtype arg is None
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload that takes a dtype, with float32
    PROMOTE = "promote"  # cast eligible float args to the widest float type among them
    BANNED = "banned"  # raise, as eager does
    FALLTHROUGH = "fallthrough"  # registered but no cast (none exist in torch 2.13)


DISPATCH_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# ---------------------------------------------------------------------------------------------
# AutocastCPU: explicit KERNEL_CPU(...) lines in autocast_mode.cpp (CPU shares no AT_FORALL list).
# ---------------------------------------------------------------------------------------------

_CPU_LOWER_PRECISION_FP = [  # "lower_precision_fp cast policy"
    "aten::conv1d",
    "aten::conv1d.padding",
    "aten::conv2d",
    "aten::conv2d.padding",
    "aten::conv3d",
    "aten::conv3d.padding",
    "aten::bmm",
    "aten::mm",
    "aten::linalg_vecdot",
    "aten::baddbmm",
    "aten::addmm",
    "aten::_addmm_activation",
    "aten::addbmm",
    "aten::linear",
    "aten::_convolution.deprecated",  # only the deprecated overload on CPU; _convolution.default is not
    "aten::matmul",
    "aten::conv_tbc",
    "aten::mkldnn_rnn_layer",
    "aten::conv_transpose1d",
    "aten::conv_transpose2d.input",
    "aten::conv_transpose3d.input",
    "aten::prelu",
    "aten::scaled_dot_product_attention",
    "aten::_native_multi_head_attention",
]

_CPU_FP32 = [  # "fp32 cast policy"
    "aten::avg_pool3d",
    "aten::binary_cross_entropy",  # fp32 on CPU, banned on CUDA
    "aten::grid_sampler",
    "aten::polar",
    "aten::prod",  # plain fp32 on CPU (input cast), fp32_set_opt_dtype on CUDA
    "aten::prod.dim_int",
    "aten::quantile",
    "aten::quantile.scalar",
    "aten::nanquantile",
    "aten::nanquantile.scalar",
    "aten::stft",
    "aten::stft.center",
    "aten::cdist",
    "aten::grid_sampler_2d",
    "aten::_grid_sampler_2d_cpu_fallback",
    "aten::grid_sampler_3d",
    "aten::trace",
    "aten::view_as_complex",
    "aten::cholesky",
    "aten::cholesky_inverse",
    "aten::cholesky_solve",
    "aten::inverse",
    "aten::lu_solve",
    "aten::orgqr",
    "aten::ormqr",
    "aten::pinverse",
    "aten::max_pool3d",
    "aten::max_unpool2d",
    "aten::max_unpool3d",
    "aten::adaptive_avg_pool3d",
    "aten::reflection_pad1d",
    "aten::reflection_pad2d",
    "aten::replication_pad1d",
    "aten::replication_pad2d",
    "aten::replication_pad3d",
    "aten::mse_loss",
    "aten::cosine_embedding_loss",
    "aten::nll_loss",
    "aten::nll_loss2d",
    "aten::hinge_embedding_loss",
    "aten::poisson_nll_loss",
    "aten::smooth_l1_loss",
    "aten::cross_entropy_loss",
    "aten::l1_loss",
    "aten::huber_loss",
    "aten::margin_ranking_loss",
    "aten::soft_margin_loss",
    "aten::triplet_margin_loss",
    "aten::multi_margin_loss",
    "aten::ctc_loss.IntList",
    "aten::ctc_loss.Tensor",
    "aten::kl_div",
    "aten::multilabel_margin_loss",
    "aten::binary_cross_entropy_with_logits",
    "aten::fft_fft",
    "aten::fft_ifft",
    "aten::fft_fft2",
    "aten::fft_ifft2",
    "aten::fft_fftn",
    "aten::fft_ifftn",
    "aten::fft_rfft",
    "aten::fft_irfft",
    "aten::fft_rfft2",
    "aten::fft_irfft2",
    "aten::fft_rfftn",
    "aten::fft_irfftn",
    "aten::fft_hfft",
    "aten::fft_ihfft",
    "aten::linalg_cond",
    "aten::linalg_cond.p_str",
    "aten::linalg_matrix_rank",
    "aten::linalg_matrix_rank.tol_tensor",
    "aten::linalg_matrix_rank.atol_rtol_tensor",
    "aten::linalg_matrix_rank.atol_rtol_float",
    "aten::linalg_solve",
    "aten::linalg_cholesky",
    "aten::linalg_svdvals",
    "aten::linalg_eigvals",
    "aten::linalg_eigvalsh",
    "aten::linalg_inv",
    "aten::linalg_householder_product",
    "aten::linalg_tensorinv",
    "aten::linalg_tensorsolve",
    "aten::fake_quantize_per_tensor_affine",
    "aten::geqrf",
    "aten::_lu_with_info",
    "aten::qr",
    "aten::svd",
    "aten::triangular_solve",
    "aten::fractional_max_pool2d",
    "aten::fractional_max_pool3d",
    "aten::adaptive_max_pool3d",
    "aten::multilabel_margin_loss_forward",
    "aten::linalg_qr",
    "aten::linalg_cholesky_ex",
    "aten::linalg_svd",
    "aten::linalg_eig",
    "aten::linalg_eigh",
    "aten::linalg_lstsq",
    "aten::linalg_inv_ex",
]

_CPU_PROMOTE = [  # "promote"
    "aten::stack",
    "aten::cat",
    "aten::index_copy",
]

# ---------------------------------------------------------------------------------------------
# AutocastCUDA: the AT_FORALL_* lists from autocast_mode.h expanded with KERNEL_CUDA, plus the
# extra lines in the TORCH_LIBRARY_IMPL(aten, Autocast, m) block of autocast_mode.cpp.
# ---------------------------------------------------------------------------------------------

_CUDA_LOWER_PRECISION_FP = [  # AT_FORALL_LOWER_PRECISION_FP
    "aten::_convolution.deprecated",
    "aten::_convolution",
    "aten::conv1d",
    "aten::conv2d",
    "aten::conv3d",
    "aten::conv_tbc",
    "aten::conv_transpose1d",
    "aten::conv_transpose2d.input",
    "aten::conv_transpose3d.input",
    "aten::convolution",
    "aten::prelu",
    "aten::addmm",
    "aten::addmv",
    "aten::addr",
    "aten::matmul",
    "aten::einsum",
    "aten::mm",
    "aten::mv",
    "aten::linalg_vecdot",
    "aten::linear",
    "aten::addbmm",
    "aten::baddbmm",
    "aten::bmm",
    "aten::chain_matmul",
    "aten::linalg_multi_dot",
    "aten::_thnn_fused_lstm_cell",
    "aten::_thnn_fused_gru_cell",
    "aten::lstm_cell",
    "aten::gru_cell",
    "aten::rnn_tanh_cell",
    "aten::rnn_relu_cell",
    "aten::_scaled_dot_product_flash_attention",
    "aten::scaled_dot_product_attention",
    # Explicit KERNEL_CUDA lines after the macro (CUDA-only kernels, not in the shared list).
    "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose",
]

_CUDA_FP32 = [  # AT_FORALL_FP32
    "aten::acos",
    "aten::asin",
    "aten::cosh",
    "aten::erfinv",
    "aten::exp",
    "aten::expm1",
    "aten::log",
    "aten::log10",
    "aten::log2",
    "aten::log1p",
    "aten::reciprocal",
    "aten::rsqrt",
    "aten::sinh",
    "aten::tan",
    "aten::pow.Tensor_Scalar",
    "aten::pow.Tensor_Tensor",
    "aten::pow.Scalar",
    "aten::softplus",
    "aten::layer_norm",
    "aten::native_layer_norm",
    "aten::rms_norm",
    "aten::group_norm",
    "aten::frobenius_norm.dim",
    "aten::nuclear_norm",
    "aten::nuclear_norm.dim",
    "aten::cosine_similarity",
    "aten::poisson_nll_loss",
    "aten::cosine_embedding_loss",
    "aten::nll_loss",
    "aten::nll_loss2d",
    "aten::hinge_embedding_loss",
    "aten::kl_div",
    "aten::l1_loss",
    "aten::smooth_l1_loss",
    "aten::huber_loss",
    "aten::mse_loss",
    "aten::margin_ranking_loss",
    "aten::multilabel_margin_loss",
    "aten::soft_margin_loss",
    "aten::triplet_margin_loss",
    "aten::multi_margin_loss",
    "aten::binary_cross_entropy_with_logits",
    "aten::dist",
    "aten::pdist",
    "aten::cdist",
    "aten::renorm",
    "aten::logsumexp",
    "aten::upsample_nearest1d",
    "aten::_upsample_nearest_exact1d",
    "aten::upsample_nearest2d",
    "aten::_upsample_nearest_exact2d",
    "aten::upsample_nearest3d",
    "aten::_upsample_nearest_exact3d",
    "aten::upsample_linear1d",
    "aten::upsample_bilinear2d",
    "aten::_upsample_bilinear2d_aa",
    "aten::upsample_trilinear3d",
    "aten::upsample_bicubic2d",
    "aten::_upsample_bicubic2d_aa",
]

_CUDA_FP32_SET_OPT_DTYPE = [  # AT_FORALL_FP32_SET_OPT_DTYPE (Dimname overloads gone in 2.13)
    "aten::prod",
    "aten::prod.dim_int",
    "aten::softmax.int",
    "aten::log_softmax.int",
    "aten::cumprod",
    "aten::cumsum",
    "aten::linalg_vector_norm",
    "aten::linalg_matrix_norm",
    "aten::linalg_matrix_norm.str_ord",
    "aten::sum",
    "aten::sum.dim_IntList",
]

# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: registered overload -> overload eager redispatches to,
# with dtype=float32 appended (only when the first arg is eligible; else its own dtype).
_CUDA_FP32_APPEND_DTYPE = {
    "aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
    "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype",
}

_CUDA_PROMOTE = [  # AT_FORALL_PROMOTE
    "aten::addcdiv",
    "aten::addcmul",
    "aten::atan2",
    "aten::bilinear",
    "aten::cross",
    "aten::dot",
    "aten::vdot",
    "aten::grid_sampler",
    "aten::index_put",
    "aten::tensordot",
    "aten::scatter_add",
]

# binary_cross_entropy_banned() in autocast_mode.cpp, registered by name on CUDA only.
_BCE_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
BANNED_MESSAGES: dict[str, str] = {"aten::binary_cross_entropy": _BCE_BANNED_MESSAGE}


def _build(groups: dict[Category, list[str]]) -> dict[str, Category]:
    table: dict[str, Category] = {}
    for cat, names in groups.items():
        for name in names:
            # A name in two lists would silently take the last category; eager has exactly one kernel.
            if name in table:
                raise ValueError(f"{name} listed as both {table[name].value} and {cat.value}")
            table[name] = cat
    return table


# torch 2.13's registrations, per device.
BASE: dict[str, dict[str, Category]] = {
    "cpu": _build(
        {
            Category.LOWER_PRECISION_FP: _CPU_LOWER_PRECISION_FP,
            Category.FP32: _CPU_FP32,
            Category.PROMOTE: _CPU_PROMOTE,
        }
    ),
    "cuda": _build(
        {
            Category.LOWER_PRECISION_FP: _CUDA_LOWER_PRECISION_FP,
            Category.FP32: _CUDA_FP32,
            Category.FP32_SET_OPT_DTYPE: _CUDA_FP32_SET_OPT_DTYPE,
            Category.FP32_APPEND_DTYPE: list(_CUDA_FP32_APPEND_DTYPE),
            Category.PROMOTE: _CUDA_PROMOTE,
            Category.BANNED: list(BANNED_MESSAGES),
        }
    ),
}

# What later releases changed, by the first release with the change: names they register (with the category,
# read from autocast_mode.cpp and checked by probing the op under autocast) and names they no longer register.
# Measured with the dispatcher of torch 2.13.0, 2.14.1 and 2.15.0.
CHANGES: dict[tuple[int, int], dict[str, tuple[dict[str, Category], tuple[str, ...]]]] = {
    (2, 14): {
        "cpu": ({"aten::linalg_matrix_sqrth": Category.FP32}, ("aten::cholesky", "aten::qr")),
        "cuda": ({"aten::linalg_matrix_sqrth": Category.FP32}, ()),
    },
}

# Registered only by builds with cuDNN (ATen/cudnn/AutocastRNN.cpp, under AT_CUDNN_ENABLED): the weights and
# inputs are cast to the low dtype and the weight buffer re-flattened, so lower_precision_fp in effect. The CPU
# build of torch has no cuDNN and does not register it.
CUDNN_ONLY: dict[str, dict[str, Category]] = {
    "cpu": {},
    "cuda": {"aten::_cudnn_rnn": Category.LOWER_PRECISION_FP},
}

APPEND_DTYPE_OVERLOAD: dict[str, dict[str, str]] = {"cpu": {}, "cuda": dict(_CUDA_FP32_APPEND_DTYPE)}


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.15.0+cu132" -> (2, 15)); the installed torch by default."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def known(device_type: str) -> dict[str, Category]:
    """Every registration name any supported release has on ``device_type``, with its category."""
    table = dict(BASE[device_type])
    for release in sorted(CHANGES):
        table.update(CHANGES[release][device_type][0])
    table.update(CUDNN_ONLY[device_type])
    return table


def expected_table(device_type: str, release: tuple[int, int], cudnn: bool) -> dict[str, Category]:
    """The registrations a release (built with or without cuDNN) has, with their categories."""
    table = dict(BASE[device_type])
    for changed in sorted(CHANGES):
        if changed <= release:
            added, removed = CHANGES[changed][device_type]
            table.update(added)
            for name in removed:
                table.pop(name, None)
    if cudnn:
        table.update(CUDNN_ONLY[device_type])
    return table


def live_registrations(device_type: str) -> frozenset[str]:
    """Names the installed torch registers under the device's autocast dispatch key."""
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"no autocast table for device {device_type!r}; known: {sorted(DISPATCH_KEYS)}")
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(DISPATCH_KEYS[device_type]))


@functools.cache
def table(device_type: str) -> dict[str, Category]:
    """The installed torch's table: every known name the live dispatcher registers (a name this file knows but
    the dispatcher does not is not cast by eager autocast either). Computed once per process; do not mutate."""
    live = live_registrations(device_type)
    return {name: cat for name, cat in known(device_type).items() if name in live}


@functools.cache
def unknown_registrations(device_type: str) -> frozenset[str]:
    """Names the installed torch registers for autocast that no table here has a category for."""
    return live_registrations(device_type) - set(known(device_type))


def registration_name(op: torch._ops.OpOverload) -> str:
    """Name as the dispatcher prints it: "aten::linear" (default overload), "aten::conv1d.padding"."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"expected an OpOverload, got {type(op).__name__}: {op!r}")
    return op.name()


def category(device_type: str, op: torch._ops.OpOverload) -> Category | None:
    """Eager autocast's category for op on device_type under the installed torch; None: autocast falls through
    (or, for a name in ``unknown_registrations``, precast does not know what it does)."""
    if device_type not in DISPATCH_KEYS:
        raise ValueError(f"no autocast table for device {device_type!r}; known: {sorted(DISPATCH_KEYS)}")
    # Graph targets can be HOPs or Python callables; autocast has no kernel for those.
    if not isinstance(op, torch._ops.OpOverload):
        return None
    return table(device_type).get(registration_name(op))


def table_drift(device_type: str) -> tuple[set[str], set[str]]:
    """(registered by the installed torch but not in its expected table, expected but not registered)."""
    live = set(live_registrations(device_type))
    expected = set(expected_table(device_type, torch_release(), bool(torch._C._has_cudnn)))
    return live - expected, expected - live
