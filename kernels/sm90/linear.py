"""Warp-specialized e4m3-output projection for Hopper (sm_90) in Gluon: ``kernels.fp8_linear``'s
``clamp(x @ w.T + b, +-448)`` as e4m3, for the fp8 serving path's QKV projection.

At the ranking models' widths (E = 256 input channels, N = 768 outputs, T = 2.37M rows) the
product is bound by the tensor cores' 16-bit rate (0.93 TFLOP, about 0.95 ms on the H200) more
than by its bytes (0.71 ms). The Triton kernel reaches 2.40 ms: each of its programs copies an
``x`` band and a weight tile and multiplies in turn, and the weight tiles come again from L2 for
every band. Here the copies run on their own and the weights are read once per program:

- ``SLICES * LANES`` persistent programs; program ``p`` owns the ``BLOCK_N``-column slice
  ``p % SLICES`` of the output (its weight rows stay in shared memory for the whole run) and
  the 64-row tiles ``lane, lane + LANES, ...`` (``lane = p // SLICES``): the programs of one lane
  take the same row tiles at about the same time, so each ``x`` tile comes from HBM once and
  from L2 for the other slices;
- a one-warp loader copies the weight slice (``[BLOCK_N, E]``, zero rows past N) and then each
  row tile's ``x`` (``[64, E]``, zero rows past T) by TMA into a ring of ``STAGES`` slots (the
  compiler splits each box into 128-byte-wide copies, the swizzle's width);
- two consumer warpgroups take the program's tiles in turn (consumer ``c`` its tiles ``c, c + 2,
  ...``; each ring slot serves one consumer): per tile one asynchronous ``wgmma`` product
  ``[64, E] x [E, BLOCK_N]`` (m64n256k16 or m64n128k16 steps, float32 sums); the slot released;
  bias, saturation at +-448, the e4m3 cast, and a TMA store from the consumer's own output tile
  (rows past T and columns past N are not written).

The consumers issue their tiles' products in turns (``PINGPONG``), so the other consumer's products run
during one consumer's epilogue. With a ``PairRotary`` the epilogue also rotates q's and k's columns in
adjacent pairs at each row's position before the e4m3 cast (``modules.fp8.ROTARY_IN_PROJECTION``;
measured slower than rotary in attention, so not taken). Admitted calls
(``linear_ws_reasons``): sm_90, 16-bit input, input widths 64-256 in steps of 64, outputs a
multiple of 16, 16-byte aligned rows, fewer than 2**31 rows.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..common.launch import Launcher
from ..common.meta import sm_count
from .block import _acc_layout, _smem_layout
from .fp8_fwd import _e4m3_layout
from .persistent import await_turn, drop_ring, drop_turns, init_ring, init_turns, pass_turn, release_slot
from .rotary import pair_sin_cos

# The generations whose GPU tests this kernel passed (an H100, 2026-12-05: tests/test_fp8_modules.py,
# E 64 / 128 / 256, 129 to 70,001 rows, both slice widths); elsewhere it runs only with
# ``variants.allow_unverified`` / BLOCKATTN_UNVERIFIED_KERNELS=1, the Triton kernel otherwise.
VERIFIED_ON = frozenset({9})
# Output columns per program: 256 (m64n256 products; two ring slots at E 256) or 128 (m64n128,
# four slots). H100, 2.37M rows, 256 -> 768, bf16, one process (``python -m
# blockattn_layers.bench.fp8 --projection``), ms: 256 columns 1.605, 128 columns 1.676, the Triton
# kernel 2.376, cuBLAS's bf16 product (no e4m3 output) 1.988.
BLOCK_N = 256
BLOCK_M = 64  # rows per tile: one consumer warpgroup's wgmma rows
CONSUMERS = gl.constexpr(2)
LOADER_REGS = gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)  # two consumer warpgroups and the loader in 64 K registers
SHARED_BYTES = 227 * 1024  # what one program may take on sm_90
MAX_STAGES = 8
# Input channels per ``x`` copy and product (``CHUNK``, one 128-byte swizzle row of 16-bit values):
# each chunk's slot goes back to the loader once its product is done, so the next tile's copy starts
# while this one multiplies (``CHUNKED``), where with whole ``[64, E]`` tiles a consumer's next tile
# is copied only after its last product (at E 256 with 256-column slices the ring holds one tile per
# consumer). GPU tests passed (H100, 2026-12-06, ``test_warp_specialized_projection_on_the_gpu``);
# 256 -> 768 over prod's 2.37M rows, ``bench.fp8 --projection``, two runs, ms: chunked 1.534 / 1.556,
# whole tiles 1.896 / 1.944 (128-column slices: chunked 1.998 / 2.027, whole 1.694 / 1.688; cuBLAS bf16
# 1.997 / 1.980). Taken.
CHUNK = 64
CHUNKED = True
# ``PINGPONG``: the consumers issue their tiles' products in turns (consumer 0's tile, then 1's, ...;
# each waits on its ``turn`` barrier before its tile's first product and arrives on the other's once its
# last is issued), so one's epilogue runs under the other's products instead of both drifting into their
# epilogues at once (CUTLASS's ping-pong GEMM). ``BIAS_ONCE``: each consumer loads its bias columns into
# registers once (64 registers a thread at 256 columns) instead of per tile. GPU tests passed (H100,
# 2026-12-06); 256 -> 768 over prod's 2.37M rows, ``bench.fp8 --projection``, ms: neither 1.616, ping-pong
# 1.526, bias once 1.528, both 1.407. Taken, both.
PINGPONG = True
BIAS_ONCE = True
# A consumer hands each chunk's slot back by every thread's own arrival (``persistent.release_slot``'s
# ``BY_THREADS``; the ring counts a consumer's 128 threads) instead of a warpgroup barrier and one elected
# arrival: ``IN_DIM // CHUNK`` warpgroup barriers less a tile (four at E 256). A candidate, off until timed
# (``bench.fp8 --projection``'s "gluon 256 columns, thread release").
THREAD_RELEASE = False
E4M3_MAX = gl.constexpr(448.0)


class PairRotary(NamedTuple):
    """Rotary in the projection's epilogue: the first ``columns`` output columns (q's and k's) in
    heads of ``head_dim``, each head's first ``rotary_dim`` channels as adjacent pairs ``(2 i, 2 i + 1)``
    at frequency ``theta ** (-2 i / rotary_dim)``; ``positions`` ``[T]`` (float32 or int32), each row's."""
    positions: torch.Tensor
    theta: float
    head_dim: int
    rotary_dim: int
    columns: int


def chunk(in_dim: int) -> int:
    """Input channels per ``x`` copy and product: ``CHUNK`` where ``CHUNKED``, else all of them."""
    return CHUNK if CHUNKED else in_dim


def shared_bytes(in_dim: int, block_n: int, stages: int) -> int:
    """Shared memory of one program: the weight slice, the ring of ``x`` tiles, the consumers'
    e4m3 output tiles, the ring's, the weights' and the turns' barriers."""
    weights = block_n * in_dim * 2
    ring = stages * BLOCK_M * in_dim * 2
    outputs = CONSUMERS.value * BLOCK_M * block_n
    return weights + ring + outputs + 8 * (2 * stages * (in_dim // chunk(in_dim)) + 1 + CONSUMERS.value)


def stages(in_dim: int, block_n: int) -> int:
    """Ring slots: as many as fit in ``SHARED_BYTES`` beside the weights and output tiles (at most
    ``MAX_STAGES``), a power of two (as Gluon's shared memory shapes must be) and at least the
    consumers: 2 at E 256 with 256-column slices, 4 with 128-column ones."""
    free = SHARED_BYTES - shared_bytes(in_dim, block_n, 0)
    fit = min(free // (BLOCK_M * in_dim * 2 + 16 * (in_dim // chunk(in_dim))), MAX_STAGES)
    return max(1 << (max(fit, 1).bit_length() - 1), CONSUMERS.value)


def grid(rows: int, out_dim: int, block_n: int, num_sms: int) -> tuple:
    """``(slices, lanes)``: the output's column slices, and how many programs share each one's
    row tiles (about one program per SM in all, no more lanes than row tiles)."""
    slices = -(-out_dim // block_n)
    tiles = -(-rows // BLOCK_M)
    return slices, max(1, min(num_sms // slices, tiles))


@gluon.jit
def _rotate_pairs(acc, Pos, row0, rows, col0, log2_theta, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr,
                  ROT_END: gl.constexpr, BLOCK_N: gl.constexpr):
    """``acc [64, BLOCK_N]`` (rows ``row0 ..``, output columns ``col0 ..``) with rotary applied to its
    first ``ROT_END`` output columns (q's and k's) at the rows' positions ``Pos``: in each head of
    ``HEAD_DIM`` columns, columns ``2 i, 2 i + 1`` (``i < ROT_DIM / 2``) are a pair rotated by the angle
    ``position * theta ** (-2 i / ROT_DIM)`` (``rotary.pair_sin_cos``); the other columns pass through.
    The pair sits in one thread's adjacent accumulator registers, so the split into the pairs' first
    and second columns and the join back move no data."""
    acc_l: gl.constexpr = _acc_layout(BLOCK_N)
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
    pair = (cols % HEAD_DIM) // 2
    inv_freq = gl.where((pair < ROT_DIM // 2) & (cols < ROT_END),
                        gl.exp2(pair.to(gl.float32) * (log2_theta * (-2.0 / ROT_DIM))), 0.0)
    offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    pos = gl.load(Pos + offs_m, mask=offs_m < rows, other=0).to(gl.float32)
    angle = gl.expand_dims(pos, 1) * gl.expand_dims(inv_freq, 0)
    angle, _ = gl.split(gl.reshape(angle, [64, BLOCK_N // 2, 2]))
    sin, cos = pair_sin_cos(angle)
    a, b = gl.split(gl.reshape(acc, [64, BLOCK_N // 2, 2]))
    rotated = gl.reshape(gl.join(a * cos - b * sin, a * sin + b * cos), [64, BLOCK_N])
    return gl.convert_layout(rotated, acc_l)


@gluon.jit
def _program_share(rows, lanes, OUT_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """``(col0, lane, count)``: this program's first output column, its lane and how many row
    tiles it takes (``lane, lane + lanes, ...``)."""
    slices: gl.constexpr = (OUT_DIM + BLOCK_N - 1) // BLOCK_N
    pid = gl.program_id(0)
    lane = pid // slices
    tiles = (rows + 63) // 64
    return (pid % slices) * BLOCK_N, lane, (tiles - lane + lanes - 1) // lanes


@gluon.jit
def _loader(x_s, w_s, ready, empty, w_bar, X, W, rows, lanes, stride_xt, stride_wn, IN_DIM: gl.constexpr,
            OUT_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr):
    """Loader partition (one warp): the program's weight slice once (in ``CHUNK``-channel column
    tiles), then each of its row tiles' ``x``, ``CHUNK`` channels at a time, into the next free
    chunk slots (a tile's chunks in slots ``(j % STAGES) * KC ..``)."""
    KC: gl.constexpr = IN_DIM // CHUNK
    col0, lane, count = _program_share(rows, lanes, OUT_DIM, BLOCK_N)
    x_map = tma.make_tensor_descriptor(X, [rows, IN_DIM], [stride_xt, 1], [64, CHUNK], _smem_layout(CHUNK))
    w_map = tma.make_tensor_descriptor(W, [OUT_DIM, IN_DIM], [stride_wn, 1], [BLOCK_N, CHUNK], _smem_layout(CHUNK))
    mbarrier.expect(w_bar, BLOCK_N * IN_DIM * 2)
    for kc in gl.static_range(KC):
        tma.async_copy_global_to_shared(w_map, [col0, kc * CHUNK], w_bar, w_s.index(kc))
    for j in range(count):
        for kc in gl.static_range(KC):
            s = (j % STAGES) * KC + kc
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, 64 * CHUNK * 2)
            tma.async_copy_global_to_shared(x_map, [(lane + j * lanes) * 64, kc * CHUNK], bar, x_s.index(s))


@gluon.jit
def _consumer(c, x_s, w_s, out_s, ready, empty, w_bar, turn, Y, B, Pos, log2_theta, rows, lanes, stride_yt,
              IN_DIM: gl.constexpr, OUT_DIM: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CHUNK: gl.constexpr, PINGPONG: gl.constexpr, BIAS_ONCE: gl.constexpr,
              HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr, ROT_END: gl.constexpr, THREAD_RELEASE: gl.constexpr):
    """Consumer partition ``c`` (one warpgroup): its tiles' products, one asynchronous ``wgmma`` per
    ``CHUNK``-channel chunk, each chunk's slot released once its product is done (the loader copies
    the next tile's chunk while this tile's later ones multiply), and the bias, saturation, e4m3
    cast and store through its output tile (each store waited for before the tile's next use).
    ``PINGPONG``: its tiles' products issued in turn with the other consumer's (``turn``). ``ROT_END``
    over 0: rotary on the first ``ROT_END`` columns after the bias (``_rotate_pairs``). ``THREAD_RELEASE``:
    each thread releases the slots itself (``release_slot``)."""
    KC: gl.constexpr = IN_DIM // CHUNK
    acc_l: gl.constexpr = _acc_layout(BLOCK_N)
    col0, lane, count = _program_share(rows, lanes, OUT_DIM, BLOCK_N)
    y_map = tma.make_tensor_descriptor(Y, [rows, OUT_DIM], [stride_yt, 1], [64, BLOCK_N], _e4m3_layout(BLOCK_N))
    out_s = out_s.index(c)
    zero = gl.zeros([64, BLOCK_N], gl.float32, acc_l)
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
    if HAS_BIAS and BIAS_ONCE:
        bias = gl.expand_dims(gl.load(B + cols, mask=cols < OUT_DIM, other=0.0), 0)
    mbarrier.wait(w_bar, 0)
    for j in range(c, count, CONSUMERS):
        base = (j % STAGES) * KC
        phase = (j // STAGES) & 1
        if PINGPONG:
            await_turn(turn, c, j // CONSUMERS)  # tile j - 1's products (the other consumer's) issued
        acc = zero
        for kc in gl.static_range(KC):
            mbarrier.wait(ready.index(base + kc), phase)
            acc = warpgroup_mma(x_s.index(base + kc), w_s.index(kc).permute((1, 0)), acc, use_acc=kc > 0,
                                is_async=True)
            if PINGPONG and kc == KC - 1:
                pass_turn(turn, c, CONSUMERS)
            if kc > 0:
                acc = warpgroup_mma_wait(1, deps=[acc])  # the previous chunk's product has read its slot
                release_slot(empty.index(base + kc - 1), THREAD_RELEASE)
        acc = warpgroup_mma_wait(0, deps=[acc])
        release_slot(empty.index(base + KC - 1), THREAD_RELEASE)
        if HAS_BIAS:
            if BIAS_ONCE:
                acc = acc + bias
            else:
                acc = acc + gl.expand_dims(gl.load(B + cols, mask=cols < OUT_DIM, other=0.0), 0)
        if ROT_END > 0:
            if col0 < ROT_END:
                acc = _rotate_pairs(acc, Pos, (lane + j * lanes) * 64, rows, col0, log2_theta, HEAD_DIM, ROT_DIM,
                                    ROT_END, BLOCK_N)
        y = gl.minimum(gl.maximum(acc, -E4M3_MAX), E4M3_MAX).to(out_s.dtype)
        tma.store_wait(0)  # this consumer's last store has left its tile
        gl.thread_barrier()
        out_s.store(y)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(y_map, [(lane + j * lanes) * 64, col0], out_s)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["rows", "lanes", "log2_theta"])
def _linear_ws_kernel(X, W, B, Y, Pos, log2_theta, rows, lanes, stride_xt, stride_wn, stride_yt, IN_DIM: gl.constexpr,
                      OUT_DIM: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CHUNK: gl.constexpr, PINGPONG: gl.constexpr, BIAS_ONCE: gl.constexpr, HEAD_DIM: gl.constexpr,
                      ROT_DIM: gl.constexpr, ROT_END: gl.constexpr, THREAD_RELEASE: gl.constexpr):
    gl.static_assert(IN_DIM % CHUNK == 0, "input channels in whole chunks")
    gl.static_assert(STAGES % CONSUMERS == 0, "each ring slot serves one consumer (stages())")
    KC: gl.constexpr = IN_DIM // CHUNK
    x_s = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES * KC, 64, CHUNK], _smem_layout(CHUNK))
    w_s = gl.allocate_shared_memory(W.dtype.element_ty, [KC, BLOCK_N, CHUNK], _smem_layout(CHUNK))
    out_s = gl.allocate_shared_memory(Y.dtype.element_ty, [CONSUMERS, 64, BLOCK_N], _e4m3_layout(BLOCK_N))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES * KC, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES * KC, 1], mbarrier.MBarrierLayout())
    w_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    init_ring(ready, empty, STAGES * KC, 1, THREAD_RELEASE)
    mbarrier.init(w_bar.index(0), count=1)
    if PINGPONG:
        init_turns(turn, CONSUMERS)
    gl.warp_specialize([
        (_consumer, (0, x_s, w_s, out_s, ready, empty, w_bar.index(0), turn, Y, B, Pos, log2_theta, rows, lanes,
                     stride_yt, IN_DIM, OUT_DIM, HAS_BIAS, BLOCK_N, STAGES, CHUNK, PINGPONG, BIAS_ONCE, HEAD_DIM,
                     ROT_DIM, ROT_END, THREAD_RELEASE)),
        (_consumer, (1, x_s, w_s, out_s, ready, empty, w_bar.index(0), turn, Y, B, Pos, log2_theta, rows, lanes,
                     stride_yt, IN_DIM, OUT_DIM, HAS_BIAS, BLOCK_N, STAGES, CHUNK, PINGPONG, BIAS_ONCE, HEAD_DIM,
                     ROT_DIM, ROT_END, THREAD_RELEASE)),
        (_loader, (x_s, w_s, ready, empty, w_bar.index(0), X, W, rows, lanes, stride_xt, stride_wn, IN_DIM,
                   OUT_DIM, BLOCK_N, STAGES, CHUNK)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    drop_ring(ready, empty, STAGES * KC)
    mbarrier.invalidate(w_bar.index(0))
    if PINGPONG:
        drop_turns(turn, CONSUMERS)


launch = Launcher(_linear_ws_kernel, scratch=True)


def linear_ws(x: torch.Tensor, weight: torch.Tensor, bias, y: torch.Tensor, block_n: int = BLOCK_N,
              rotary: Optional[PairRotary] = None) -> None:
    """``y = e4m3(clamp(x @ weight.T + bias))`` by this kernel (``linear_ws_reasons`` empty, T > 0);
    with ``rotary``, its pairs rotated before the saturation (``_rotate_pairs``)."""
    rows, in_dim = x.shape
    out_dim = weight.shape[0]
    slices, lanes = grid(rows, out_dim, block_n, sm_count(x.device))
    meta = dict(IN_DIM=in_dim, OUT_DIM=out_dim, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                STAGES=stages(in_dim, block_n), CHUNK=chunk(in_dim), PINGPONG=PINGPONG,
                BIAS_ONCE=BIAS_ONCE and rotary is None, HEAD_DIM=64, ROT_DIM=64, ROT_END=0,  # ROT_END 0: no rotary
                THREAD_RELEASE=THREAD_RELEASE, num_warps=4)  # with rotary no registers are left for the bias
    pos, log2_theta = weight, 0.0
    if rotary is not None:
        meta.update(HEAD_DIM=rotary.head_dim, ROT_DIM=rotary.rotary_dim, ROT_END=rotary.columns)
        pos, log2_theta = rotary.positions, math.log2(rotary.theta)
    args = (x, weight, bias if bias is not None else weight, y, pos, log2_theta, rows, lanes, x.stride(0),
            weight.stride(0), y.stride(0))
    launch((slices * lanes,), args, meta, x)


def linear_ws_reasons(x: torch.Tensor, weight: torch.Tensor) -> List[str]:
    """Why this kernel cannot take the projection (empty: it can); the Triton kernel takes it then."""
    reasons = []
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        reasons.append("an sm_90 GPU")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        reasons.append("a bfloat16 or float16 input and weight")
    if x.dim() != 2 or x.shape[-1] not in (64, 128, 256):
        reasons.append(f"an input width of 64, 128 or 256 (got {x.shape[-1]})")
    if weight.shape[0] % 16:
        reasons.append(f"a multiple of 16 outputs (got {weight.shape[0]})")
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        reasons.append("16-byte aligned input rows with unit column stride")
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        reasons.append("a contiguous, 16-byte aligned weight")
    if x.shape[0] >= 2**31 - BLOCK_M:
        reasons.append("fewer than 2**31 rows")
    return reasons
