"""``clamp(x @ w.T + b, +-448)`` written as e4m3: the fp8 serving path's QKV projection.

``x [T, E]`` and ``w [N, E]`` in bfloat16 or float16, ``b [N]`` float32 (or None); the output
``[T, N]`` is ``torch.float8_e4m3fn``, saturated at e4m3's largest finite value (or, for tests,
any dtype: Triton's interpreter rounds float32 to e4m3 wrongly where rounding up carries into the
exponent, 7.9 to 4.0, so the CPU tests check the product, bias and clamp in float32 and the GPU
tests the e4m3 store). The caller folds
each output column's factor into ``w`` and ``b`` (``modules.fp8.FP8QKVProjection``), so the
e4m3 values are q, k and v over their descales. The 16-bit input is read once, as the 16-bit
projection would read it, and the products accumulate in float32: no pass quantizes ``x``, and
no 16-bit q, k or v is written or read back. One program per ``BLOCK_M x BLOCK_N`` output tile;
the ``N // BLOCK_N`` tiles of one row band are consecutive programs, so the band of ``x`` they
share is read from L2 after the first.

At the ranking models' widths (E = 256, N = 768, T = 2.37M; H200, 2026-12-02) this product is
far from its memory floor: 2.40-2.44 ms against 0.71 ms; cuBLAS's bf16 GEMM takes 1.7-1.9 ms and
cuBLAS's e4m3 GEMM on pre-quantized rows (``torch._scaled_mm``, row-wise factors) 1.89-1.90 ms.
Measured and dropped: one program per row band holding the band's whole input row (2.73-3.62 ms
over five tile shapes), and quantizing each input row to e4m3 in the kernel for e4m3 tensor
cores (2.13 ms with the MMAs' reduced-precision sums, 2.98 ms with float32 sums every 32
channels, and twice the sub-layer's error).

On sm_90 the warp-specialized Gluon kernel (``sm90.linear``: weights resident in shared memory,
copies by TMA on their own warp, two consumer warpgroups) takes the e4m3 projections it admits
where its GPU tests passed (``sm90.linear.VERIFIED_ON``: sm_90) or unverified kernels are allowed:
1.41-1.45 ms for the projection above on an H100, against this module's Triton kernel's 2.39-2.47
(2026-12-06). Only that kernel rotates pairs in its epilogue (:func:`rotates_pairs`)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .block.variants import gluon_import_error, taken_on
from .common.launch import Launcher
from .common.meta import needs_int64

# The generations whose GPU tests this kernel passed (the H200, 2026-12-01); elsewhere (compile-checked
# only) CUDA takes it only with ``variants.allow_unverified`` / BLOCKATTN_UNVERIFIED_KERNELS=1.
VERIFIED_ON = frozenset({9})
E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value
_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["rows"])
def _linear_e4m3_kernel(
    X, W, B, Y, rows, stride_xt, stride_wn, stride_yt,
    IN_DIM: tl.constexpr, OUT_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n_tiles: tl.constexpr = (OUT_DIM + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    band, col_tile = pid // n_tiles, pid % n_tiles
    offs_m = tl.arange(0, BLOCK_M)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        band = band.to(tl.int64)
    row = band * BLOCK_M + offs_m
    col = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = row < rows, col < OUT_DIM
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, IN_DIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < IN_DIM
        x = tl.load(X + row[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + col[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + col, mask=col_ok, other=0.0)[None, :]
    y = tl.minimum(tl.maximum(acc, -E4M3_MAX), E4M3_MAX).to(Y.dtype.element_ty)
    tl.store(Y + row[:, None] * stride_yt + col[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


launch = Launcher(_linear_e4m3_kernel)


def linear_meta(in_dim: int, out_dim: int, has_bias: bool, int64: bool) -> dict:
    """Constexprs and launch options: 128 x 128 output tiles (narrower for fewer columns), the
    input dimension in steps of 64 through three stages."""
    block_n = 128 if out_dim >= 128 else max(16, triton.next_power_of_2(out_dim))
    block_k = 64 if in_dim >= 64 else max(16, triton.next_power_of_2(in_dim))
    return dict(IN_DIM=in_dim, OUT_DIM=out_dim, HAS_BIAS=has_bias, INT64=int64, BLOCK_M=128, BLOCK_N=block_n,
                BLOCK_K=block_k, num_warps=8, num_stages=3)


def linear_e4m3(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype = torch.float8_e4m3fn, rotary=None) -> torch.Tensor:
    """``clamp(x @ weight.T + bias, -448, 448)`` as e4m3 ``[T, N]`` (module docstring): ``x [T, E]``
    with unit column stride, ``weight [N, E]`` contiguous in ``x``'s dtype, ``bias`` float32 ``[N]``.
    ``rotary`` (``sm90.linear.PairRotary``, where :func:`rotates_pairs` says so): its columns' pairs
    rotated before the saturation."""
    total, in_dim = x.shape
    out_dim = weight.shape[0]
    y = torch.empty((total, out_dim), dtype=out_dtype, device=x.device)
    if rotary is not None and not rotates_pairs(x, weight, rotary.head_dim):
        raise ValueError("linear_e4m3: rotary in the projection needs the sm_90 kernel and heads within its "
                         "column slices (rotates_pairs)")
    if total == 0:
        return y
    if _ws_taken(x, weight, out_dtype):
        from .sm90.linear import linear_ws

        linear_ws(x, weight, bias, y, rotary=rotary)
    else:
        linear_triton(x, weight, bias, y)
    return y


def rotates_pairs(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`linear_e4m3` can rotate pairs of adjacent columns in heads of ``head_dim``
    (``sm90.linear.PairRotary``): its sm_90 kernel takes the projection and no head straddles two of
    the kernel's column slices (``head_dim`` even and dividing them)."""
    if not _ws_taken(x, weight, torch.float8_e4m3fn):
        return False
    from .sm90.linear import BLOCK_N

    return head_dim % 2 == 0 and BLOCK_N % head_dim == 0


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor) -> None:
    """:func:`linear_e4m3` into ``y`` (``[T, N]``, T > 0) by this module's Triton kernel."""
    total, in_dim = x.shape
    out_dim = weight.shape[0]
    meta = linear_meta(in_dim, out_dim, bias is not None, needs_int64(x, y))
    programs = triton.cdiv(total, meta["BLOCK_M"]) * triton.cdiv(out_dim, meta["BLOCK_N"])
    args = (x, weight, bias if bias is not None else weight, y, total, x.stride(0), weight.stride(0), y.stride(0))
    launch((programs,), args, meta, x)


def _ws_taken(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the warp-specialized sm_90 kernel (``sm90.linear``) takes the projection: e4m3 out,
    it admits the tensors, and it is verified on this GPU generation or unverified kernels are allowed."""
    if not x.is_cuda or out_dtype != torch.float8_e4m3fn or gluon_import_error() is not None:
        return False
    from .sm90 import linear as ws

    return not ws.linear_ws_reasons(x, weight) and taken_on(x.device, ws.VERIFIED_ON)


def linear_e4m3_reasons(x: torch.Tensor, weight: torch.Tensor) -> list:
    """Why :func:`linear_e4m3` cannot take these tensors (empty: it can)."""
    reasons = []
    if x.dtype not in _TORCH_TO_TL:
        reasons.append(f"a bfloat16 or float16 input (got {x.dtype})")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        reasons.append("an sm_89 or newer GPU (e4m3 conversions)")
    if not taken_on(x.device, VERIFIED_ON):
        reasons.append("no hardware run recorded on this GPU generation: taken only with BLOCKATTN_UNVERIFIED_KERNELS=1")
    if x.dim() != 2 or x.stride(-1) != 1:
        reasons.append("a [T, E] input with unit column stride")
    if weight.dtype != x.dtype or not weight.is_contiguous():
        reasons.append("a contiguous weight in the input's dtype")
    return reasons
