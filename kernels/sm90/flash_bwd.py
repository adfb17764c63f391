"""Warp-specialized flash-attention backward for Hopper (sm_90) in Gluon: the dK/dV pass that also
adds dQ's terms to float32 sums, as FlashAttention-3 orders it (``flash.bwd``'s three-pass
backward), by TMA reduce-adds in any order or (``DETERMINISTIC``) in a fixed one.

One program per 128-row key tile of a block and kv head (the flash tile table, a block's first
tiles first: under causal masks those visit the most query tiles; see ``_turn`` for the ordered
causal adds), looping over the group's query heads and, per head, the block's 64-row query tiles
(128-row ones in the pass without dQ's terms at D 64, ``DKDV_ONLY_WIDE_HEAD_DIMS``; causal: from the
diagonal on). Three partitions (four with the dQ writer) share the program's shared memory:

- a one-warp loader: the key tile's k and v once, then each step's query tile q and dO into a
  ring of ``STAGES`` slots, all by TMA over tensor maps of the block's own rows (rows past the
  block read as zeros, as in ``flash_fwd``);
- two consumer warpgroups, one per 64-row half of the key tile. Per step, on transposed scores
  (rows are keys, so each warpgroup's accumulators are its own dK and dV rows):
  ``S^T = K_w Q^T`` and ``dP^T = V_w dO^T`` by wgmma from shared memory, ``P^T = exp2(S^T c -
  lse)``, ``dS^T = P^T (dP^T - delta)`` (padding query rows have zero q, dO, lse and delta: their
  columns add nothing), then ``dV_w += P^T dO`` and ``dK_w += dS^T Q`` with ``P^T`` and ``dS^T`` from registers.
  Each warpgroup stores its ``dS^T`` half into a shared ``[128, 64]`` tile (two, alternating by
  step). At D 128, once both halves are there (the ``ds_ready`` mbarrier), warpgroup ``w`` computes
  ``dQ[:, cols_w] = dS K[:, cols_w]`` over all 128 keys for its half of the head's columns (a whole
  128-byte swizzle block of the shared k tile): one term per sum element and key tile. At D 64
  (half would split a swizzle block) each warpgroup computes ``dS_w K_w`` over its own 64 keys,
  every column, with no wait.
- ``DQ_WRITER`` (the default): the consumers store their float32 dQ terms into a shared
  ``[2, 64, DQ_COLS]`` tile and go on; a one-warp writer partition adds them to the sums: in any
  order by two TMA reduce-adds (``tma_add``) over a tensor map of the block's rows (rows past the
  block dropped), or, ``DETERMINISTIC``, by the same adds (at D 64 the two terms summed first) after
  the query tile's counter has counted the key tiles that come before this one (``_turn``), each
  waited for until written, then counting this one, so the float32 sums, and dQ, are bitwise the
  same run to run. Without the writer each consumer adds its term itself by ``atomic_add``
  (ordered: per column half, or per warpgroup at D 64).
- ``DQ_STORE`` (blocks one key tile holds whole, ``DQ_STORE_HEAD_DIMS``): a query row's dQ is then this program's term
  alone, so at D 128 each consumer scales its column half, casts it and stores it by TMA (``_store_dq``, no
  writer), at D 64 the writer stores the two terms' sum so: no float32 sums, no cast pass after.

Padding key rows (a block ending inside the key tile) read zero k and v: their ``dS`` meets a zero
k row in ``dS K``, and their dK, dV rows lie past the tensor maps' rows, where TMA stores drop
them. After the last step both warpgroups meet (``done``), and each stages its dK (times the
softmax scale) and dV rows in the dead k and v tiles for the TMA store.

The delta pass before and the pass that scales and casts the sums into dQ after are
``flash.bwd``'s. Admitted calls (``flash_ws_bwd_reasons``): those of ``flash_fwd``'s kernel
(sm_90, bf16 / fp16, D 64 / 128, no rotary, rows of ``H * D`` contiguous elements, 32-bit
offsets), and D 96 in 128-wide tiles where it stores dQ (``PADDED_HEAD_DIMS``, ``head_dims``), dO of q's
layout too. Its GPU tests pass (``VERIFIED_ON``). The fast backward takes it at
full attention with D 128 (``FAST_TAKEN``, ``FAST_HEAD_DIMS``; H100, bf16, seed3: 3.11 ms against
the Triton fast backward's 5.07 and the deterministic one's 3.84); elsewhere the fast backward is
the deterministic one (``flash.bwd.fast_form_taken``). The deterministic backward takes it whole,
its writer's ordered TMA adds, at full attention with D 128 (``ORDERED_HEAD_DIMS``; seed3: 3.24 ms
against 3.75); at full attention with D 64 (``DKDV_ONLY_HEAD_DIMS``) it keeps the Triton dQ pass and
takes this kernel as its dK/dV pass without dQ's terms (``WITH_DQ`` off; 4.27 ms against 4.66, 4.02
since its steps are 128 query rows);
elsewhere the Triton passes.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..block.variants import taken_on
from ..common.launch import Launcher
from ..common.meta import LOG2E
from .block import _acc_layout, _smem_layout
from .flash_fwd import _release, block_map, flash_ws_reasons, table_tile
from .persistent import drop_ring, init_ring
from .rotary import unrotate_pairs
from .tma_add import after_turn, async_add_shared_to_global, wait_adds_done

# The generations whose GPU tests this kernel passed (an H100, 2026-12-05: tests/test_triton_flash_interpret.py,
# both modes, causal, GQA, blocks of 192 / 512, a NaN sequence).
VERIFIED_ON = frozenset({9})
# Whether ``flash.bwd`` hands the dK/dV pass of the calls it admits to this kernel: in both backwards
# (``TAKEN``, the benchmark's rows), or in the fast one (``FAST_TAKEN``: its writer form, TMA
# reduce-adds in any order, measured faster than the Triton backwards at full attention, H100,
# 2026-12-05: seed3 3.11 ms against the Triton fast 5.07 and deterministic 3.84).
TAKEN = [False]
FAST_TAKEN = [True]
# Where the fast backward takes this kernel (its writer's TMA reduce-adds in any order) while ``FAST_TAKEN``
# is set: full attention with these head dims. Elsewhere the deterministic backward measured as fast or
# faster and runs in its place (``flash.bwd.fast_form_taken``; H100, bf16, 2026-12-05, ms, fast /
# deterministic: seed3_d64 4.37 / 4.29, 4.34 / 4.18; blocks of 256 8.78 / 7.27, 8.87 / 7.39; blocks of
# 512 10.8 / 10.6, 10.7 / 10.7).
FAST_HEAD_DIMS = frozenset({128})
# Where the deterministic backward takes this kernel whole, dQ's terms added in a fixed order by the
# writer's TMA reduce-adds: at full attention with the head dims of ``ORDERED_HEAD_DIMS``, measured
# faster there than either two-pass form (H100, bf16, D 128, 2026-12-05, ms: seed3 3.24 against 3.65
# with the dK/dV-only kernel beside the Triton dQ pass and 3.75 by the Triton passes; causal 2.02 /
# 2.10 / 2.09; GQA 3.15 / 3.47 / 3.48; prod_full 36.9 / 41.6 / 41.7). Slower at D 64 (seed3_d64: 6.17
# against 4.27 / 4.66) and on blocks of 256 (9.28 against 7.92 / 7.39).
ORDERED_HEAD_DIMS = frozenset({128})
# Where the deterministic backward's dK/dV pass is this kernel without dQ's terms (``WITH_DQ`` off;
# the Triton dQ pass computes dQ and delta, as without this kernel): at full attention with the head
# dims of ``DKDV_ONLY_HEAD_DIMS``, measured faster there (H100, bf16, 2026-12-05: seed3_d64 4.27 ms
# against the Triton passes' 4.66; at D 128 3.65 / 3.75, where the one-pass form is faster still; on
# blocks of 256 slower, 7.92 / 7.39, at 512 even), or on every call it admits while
# ``DKDV_ONLY_TAKEN`` is set (the benchmark's ``triton_flash[gluon_dkdv_bwd]`` row).
DKDV_ONLY_HEAD_DIMS = frozenset({64})
DKDV_ONLY_TAKEN = [False]
# Head dims at which the pass without dQ's terms steps over 128 query rows at a time (``BLOCK_M``; else
# ``TILE_M``): each step's products twice as long against its waits and barriers, the scores 64 more
# registers a thread (ptxas: no spill at D 64). Measured faster at D 64 (H100, bf16, 2026-12-06, backward
# ms against 64-row steps: seed3_d64 4.015 / 4.172, its GQA 3.941 / 4.196, causal 2.423 / 2.457; the pass
# alone 2.331 / 2.582 beside the Triton dQ pass's 1.52), so taken there. ``triton_flash[gluon_dkdv_m64]``
# times the 64-row steps.
DKDV_ONLY_WIDE_HEAD_DIMS = frozenset({64})

STAGES = gl.constexpr(2)
LOADER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
# Whether dQ's adds leave the consumers (``DQ_WRITER``): each consumer stores its float32 dQ term into
# a shared tile and goes on; a one-warp writer partition adds the tiles to the sums, in any order by
# TMA reduce-adds (FlashAttention-3's dQ warp), or in a fixed order by the same adds after the turns'
# waits. Measured faster than the consumers' own adds in both modes (H100, seed3: fast 3.11 against
# 5.38 ms; deterministic 6.64 against 5.01 with the writer's earlier per-thread ordered adds, 3.24 with
# its TMA ones).
DQ_WRITER = True
# Whether a consumer computes P while dP^T's product still runs (``P_BESIDE_DP``: waits for the scores'
# product alone first, as FlashAttention-3 orders its step), or waits for both. A candidate to time
# (``triton_flash[gluon_fast_bwd_p_beside_dp]``).
P_BESIDE_DP = False
# Whether the loader warp copies each step's lse and delta rows (``ROWS_BY_LOADER``: by ``cp.async`` into the
# step's ring slot, which its ready barrier then waits for too, as FlashAttention-3's producer loads them beside
# q and dO) instead of each consumer warpgroup copying its own ahead (a copy wait and a warpgroup barrier every
# step: ncu of the fast backward, seed3, H100, session 50, has 31 % of the consumers' cycles between issues
# waiting at barriers). Taken with ``THREAD_RELEASE`` (below; timings there).
ROWS_BY_LOADER = True
# Whether the consumers hand the ring's slots back by every thread's own arrival (``THREAD_RELEASE``:
# ``persistent.release_slot``'s ``BY_THREADS``, the ring counting each consumer's 128 threads) instead of a
# warpgroup barrier and one elected arrival: one of the six warpgroup barriers of a step less. Without
# ``ROWS_BY_LOADER`` a thread's arrival also waits for its copies of the next step's rows. GPU tests pass (H100,
# 2026-12-07). H100, bf16, backward ms, both on / both off (``triton_flash[gluon_fast_bwd_consumer_rows]``,
# ``[gluon_bwd_consumer_rows]``), session 56, one run: fast seed3 3.008 / 3.151, causal 1.872 / 1.957, GQA 2.885 /
# 2.979, prod_full 33.5 / 34.7 (3.2-4.5 % faster); deterministic seed3 3.205 / 3.225, causal 1.929 / 2.011, GQA
# 3.116 / 3.104, prod_full 35.9 / 36.5. Sessions 53 and 54 had the fast seed3 3-4 % faster too.
THREAD_RELEASE = True
# Whether each step's dQ product is the previous step's (``DQ_LAG``, D 128 with the writer): a consumer stores its
# dS^T half of step ``it`` into a slot of ``DS_LAG_SLOTS`` and issues dQ's product of step ``it - 1``, whose halves
# both warpgroups stored a step before, so the warpgroups no longer wait for each other mid-step (the ``ds_ready``
# meeting: ncu of the fast backward, seed3, H100, session 50, 31 % of the consumers' issue gaps at barriers); a
# slot is written again once both warpgroups' products on it are done (``ds_free``). ``STAGGER`` (with
# ``DQ_LAG``): warpgroup 1 starts once warpgroup 0 has stored its first dS^T half, so that one warpgroup's
# exponentials may run beside the other's products. GPU tests pass (H100, 2026-12-07). H100, bf16, seed3, fast
# backward ms, the default / ``DQ_LAG`` / with ``STAGGER`` (two runs): 3.089, 3.114 / 3.033, 3.066 / 3.071: 1-2 %,
# the stagger nothing more; not taken (``triton_flash[gluon_fast_bwd_dq_lag]``, ``[gluon_fast_bwd_stagger]``).
DQ_LAG = False
STAGGER = False
DS_LAG_SLOTS = gl.constexpr(3)
WRITER_REGS = gl.constexpr(40)  # its warp shares a warpgroup with the loader: what it takes, consumer 1 gives
# Whether the writer warp runs on ``LEAN_WRITER_REGS`` where it only issues TMA adds (D 128: no sum of two terms),
# so that consumer 1 keeps as many registers as consumer 0 (``LEAN_WRITER``): sm_90 ptxas, D 128, spills 12 -> 4 B,
# causal GQA 108 -> 40; with the rows by the loader and thread releases 44 -> 4, 76 -> 8 (the writer itself none).
# GPU tests pass (H100, 2026-12-07); seed3 fast backward 3.064 ms against 3.089 (one run, 1 %). On session 56's
# defaults (rows by the loader, thread releases), H100, backward ms with / without it, two runs: fast seed3 2.991,
# 3.022 / 3.052, 3.037; causal 1.854, 1.852 / 1.883, 1.893; GQA 2.887, 2.870 / 2.918, 2.924; prod_full 33.6 / 33.8;
# deterministic seed3 3.170, 3.179 / 3.218, 3.207; causal 1.935, 1.935 / 1.939, 1.931; GQA 3.096, 3.095 / 3.140,
# 3.156 (0-2 %): taken (session 58 candidate; ``triton_flash[..._full_writer]`` rows keep the writer on
# ``WRITER_REGS``).
LEAN_WRITER = True
LEAN_WRITER_REGS = gl.constexpr(24)
# The head dims at which dQ is stored, not summed, where one key tile holds a whole block (``DQ_STORE``: blocks of up
# to ``TILE_N`` tokens; :func:`stores_dq`): each query row's dQ is then this program's term alone. At D 128 each
# warpgroup's term (its column half over all the block's keys) is the row's whole dQ for those columns: the consumer
# scales it, casts it to dQ's dtype and stores it by TMA through a shared tile of its own (two, alternating by
# step), with no writer partition; at D 64 (each term over the warpgroup's own keys, every column) the writer sums
# the two and stores the sum so. No float32 sums to zero, add to and cast back in a pass after; the same in both
# modes (no adds, so no order), so :func:`taken` hands such calls to this kernel in both. Session 43 had the flash
# backward at blocks of 128 slower than the block kernels, its sums and passes moving 2-3x the floor's bytes. Its GPU
# tests pass (H100, 2026-12-07: blocks of 16 / 64 / 100 / 128, GQA, causal, D 64 / 128, bf16 / fp16, every form).
# H100, bf16, grid lengths, block 128, backward ms, the block kernels / this kernel with float32 sums / with
# ``DQ_STORE``: D 128 4x1 3.33 / 5.56 / 2.66, causal 3.40 / - / 2.69, 8x2 6.60 / - / 5.26, causal 6.76 / - / 5.35
# (1.25-1.26x the block kernels; again 2026-12-07: 3.32 / - / 2.65, 6.57 / - / 5.23); D 128 2x2 1.41 / 3.77 / 2.38,
# D 64 2x2 0.92 / 2.43 / 1.85, D 64 4x1 1.59 / 3.20 / 1.97 (slower: two steps a program, or D 64). So D 128: the
# ``triton`` backend runs the backward of grouped query heads on blocks of 65-128 tokens at D 128 without rotary
# here (the op saves out and lse for them: ``ops.library.saves_lse``; through the op, forward + backward, 1.14-1.15x
# the block kernels'). ``flash_kernels[gluon_fast_bwd_dq_store]`` times it at D 64 too. D 96 since session 58, in
# 128-wide tiles (``PADDED_HEAD_DIMS``): H100, bf16, block 128, through the op, backward ms 8x2 4.67 against the
# block kernels' 6.32, 4x1 2.37 against 3.09, interleaved rotary 5.28 against 9.80 (BENCHMARKS.md session 58).
DQ_STORE_HEAD_DIMS = frozenset({96, 128})
# Head dims the kernel takes in 128-wide tiles where it stores dQ (``DQ_STORE``; ``HEAD_DIM`` the tiles' width,
# ``DIM`` the head's): each tensor map is the block's ``[n, heads, DIM]`` view in boxes of one head
# (``_head_map``), so a tile's channels past ``DIM`` read as zeros (no other head's values, NaN included, reach the
# products) and dQ's, dK's and dV's are dropped by their TMA stores; the products run at 128 channels.
PADDED_HEAD_DIMS = frozenset({96})
# Whether, with ``DQ_STORE``, the program computes each step's delta rows itself (``DELTA_IN_KERNEL``: the loader
# copies the step's O rows into the ring beside q and dO, each consumer sums ``O * dO`` over the head's channels into
# a row vector of its own), so that no delta pass reads O and dO before the kernel: at blocks one key tile holds whole
# each (query head, row) meets one program, so nothing is computed twice. The ring's slots grow by O's tile (32 KB
# more at D 128), so the consumers' dQ staging tiles go from two to one each (``tma.store_wait(0)`` before each
# store). GPU tests pass (H100, 2026-12-07). H100, bf16, block 128, backward ms with / without it: D 128 4x1 2.56 /
# 2.66-2.67, 8x2 5.08 / 5.26, causal 4x1 2.75 / 2.69, causal 8x2 5.46 / 5.35, 2x2 2.43 / 2.38, D 64 1.93-2.00 /
# 1.85-1.97: a gain only without causal masks at grouped heads. So ``None`` (the default): computed in the kernel
# for grouped query heads without causal masks, where the kernel stores dQ; True / False: wherever it stores dQ /
# nowhere (the benchmark's ``flash_kernels[gluon_fast_bwd_dq_store_delta]`` and ``[..._dq_store]`` rows, the tests).
DELTA_IN_KERNEL: Optional[bool] = None
# Whether, with ``DQ_STORE``, the kernel rotates dQ and dK back itself for a rotary backward whose caller rotated q and
# k (``UNROTATE``: the ``triton`` backend's rotation pass, ``kernels.block.rotation.rotated_backward``, then skips its
# second pass, which reads and writes dq and dk again: at 8x2 heads 20 of the pass's 40 head-units of ``T x D``):
# each consumer rotates its dQ columns (``unrotate_pairs``, float32, before the cast) and its dK rows, where each
# rotary pair lies in one consumer's column half (:func:`unrotates`: interleaved, or split halves over at most 64
# channels). GPU tests pass (H100, 2026-12-07). H100, bf16, block 128, D 128, grid lengths, backward ms through the
# op, on / off (two runs each, within 0.1 %): interleaved 8x2 7.32 / 8.62, causal 7.70 / 9.00, 4x1 3.66 / 4.32, causal
# 3.88 / 4.50; partial (rotary_dim 64) 8x2 7.16 / 7.88, causal 7.49 / 8.24, 4x1 3.59 / 3.95, causal 3.78 / 4.12
# (1.10-1.18x).
UNROTATE = True
# Whether split halves over every channel (each pair spanning both dQ column halves) are rotated back in the kernel
# too, on q and k whose caller wrote them in the paired-chunk order (:func:`pair_chunk`): each consumer's dQ columns
# then hold chunks of both halves, stored apart (``_store_dq_chunks``), and dK's chunks go back in order in
# registers. GPU tests pass (H100, 2026-12-07). H100, bf16, block 128, D 128, grid lengths, split halves: the op's
# path (rotation pass on paired copies, this kernel) backward 8x2 7.18 ms, 4x1 3.62, against 8.61 / 4.30 on
# ``hopper_heads``; with the copies saved by the forward 5.37 / 2.73 (BENCHMARKS.md session 57).
PAIRED_SPLIT = True
# Whether D 96 (``PADDED_HEAD_DIMS``) takes split halves over every channel in the paired-chunk order too, in chunks
# of 16 (:func:`pair_chunk`): consumer 0's 64 columns hold ``[a_0, b_0, a_1, b_1]``, consumer 1's ``[a_2, b_2]`` and
# the padding. Each consumer stores its columns of each half apart (``_store_dq_chunks``), and each warpgroup dK's
# column halves the same way from the dead k tile (``_store_dk_cols``), through maps of the ``[n, heads, 2, 48]``
# view (``_halves_map``) whose 48-channel rows drop what a box holds past them. GPU tests pass (H100, 2026-12-07).
# H100, bf16, block 128, grid lengths, with ``triton_block.COPIES_ROTATED_BACK_BY_PASS``: backward 5.25 ms at 8x2
# (2.66 at 4x1) against 7.70 (3.89) with the rotation pass's second half (BENCHMARKS.md session 60).
PADDED_PAIRED_SPLIT = True
# Whether split halves over part of the channels whose pairs no consumer's dQ columns hold whole in their own order
# (``rotary_dim`` not dividing :func:`dq_cols`: 48 or 80 of 96 channels, 48, 96 or 112 of 128) are rotated back in
# the kernel too, on q and k whose rotary channels the caller wrote in the paired-chunk order (:func:`pair_chunk`:
# chunks of 8 or 16), the channels past them in place. Each half of a tile's columns (a consumer's dQ, each column
# half of a warpgroup's dK) stores its rotary chunks by half through a map of the ``[n, heads, 2, rotary_dim / 2]``
# view, whose rows drop what a box holds past them, and its pass-through columns (:func:`pass_piece`) through a
# head map of their own width. GPU tests pass (H100, 2026-12-07: 48 and 80 of 96 channels, 48, 96 and 112 of 128).
# H100, bf16, block 128, D 96, rotary_dim 48, grid lengths, backward ms on / off (the pass's second half): 8x2 5.48 /
# 5.90, causal 5.57 / 6.06, 4x1 2.75 / 2.94, causal 2.80 / 3.01 (1.07-1.09x; BENCHMARKS.md session 60).
PAIRED_PARTIAL = True
HALF_N = gl.constexpr(64)  # key rows per consumer warpgroup
TILE_N = 128  # key rows per program: two consumer warpgroups of 64
TILE_M = 64  # query rows per step
_LOG2E = gl.constexpr(LOG2E)


@gluon.jit
def query_steps(n, tile_row, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(first, steps)``: the first query tile a key tile from row ``tile_row`` meets and how many
    it meets per query head (causal: the tiles from the diagonal on; never zero for a key tile
    inside the block)."""
    first = 0
    if IS_CAUSAL:
        first = tile_row // BLOCK_M
    return first, (n + BLOCK_M - 1) // BLOCK_M - first


@gluon.jit
def _head_map(ptr, start, n, heads, stride_t, BOX_ROWS: gl.constexpr, BOX_COLS: gl.constexpr,
              HEAD_DIM: gl.constexpr, DIM: gl.constexpr):
    """Tensor map of the block's rows ``[start, start + n)`` of a ``[T, heads, DIM]`` tensor (rows ``stride_t``
    apart), boxes ``BOX_COLS`` channels wide: where ``DIM == HEAD_DIM`` the ``[n, heads * HEAD_DIM]`` view
    (``block_map``'s), else (``DIM`` channels padded to ``HEAD_DIM`` in the tiles) the ``[n, heads, DIM]`` view in
    ``[BOX_ROWS, 1, BOX_COLS]`` boxes of one head, whose channels past ``DIM`` read as zeros and are dropped on
    store, as rows past ``n`` are (:func:`_copy_in`, :func:`_copy_out`)."""
    if DIM == HEAD_DIM:  # (each head's row as HEAD_DIM // BOX_COLS pieces of BOX_COLS columns)
        desc = block_map(ptr, start, n, heads * (HEAD_DIM // BOX_COLS), stride_t, BOX_ROWS, BOX_COLS)
    else:
        desc = tma.make_tensor_descriptor(ptr + start * stride_t, [n, heads, DIM], [stride_t, DIM, 1],
                                          [BOX_ROWS, 1, BOX_COLS], _smem_layout(BOX_COLS, 3))
    return desc


@gluon.jit
def _copy_in(desc, row, head, col, bar, tile, HEAD_DIM: gl.constexpr, DIM: gl.constexpr):
    """TMA copy of head ``head``'s box at ``[row, col]`` (channels ``col ..``) of a :func:`_head_map` into the
    shared ``tile``, counted on ``bar``."""
    if DIM == HEAD_DIM:
        tma.async_copy_global_to_shared(desc, [row, head * HEAD_DIM + col], bar, tile)
    else:
        tma.async_copy_global_to_shared(desc, [row, head, col], bar, tile.reshape([tile.shape[0], 1, tile.shape[1]]))


@gluon.jit
def _key_rows_box(kv_s, w, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Warpgroup ``w``'s ``HALF_N`` rows of the shared ``[BLOCK_N, HEAD_DIM]`` key (or value) tile as a
    ``[HALF_N, 1, HEAD_DIM]`` box of one head (:func:`_head_map`)."""
    return kv_s.reshape([BLOCK_N, 1, HEAD_DIM]).slice(w * HALF_N, HALF_N)


@gluon.jit
def _copy_out(desc, row, head, col, tile, HEAD_DIM: gl.constexpr, DIM: gl.constexpr):
    """TMA store of the shared ``tile`` into head ``head``'s box at ``[row, col]`` of a :func:`_head_map`."""
    if DIM == HEAD_DIM:
        tma.async_copy_shared_to_global(desc, [row, head * HEAD_DIM + col], tile)
    else:
        tma.async_copy_shared_to_global(desc, [row, head, col], tile.reshape([tile.shape[0], 1, tile.shape[1]]))


@gluon.jit
def _loader(k_s, v_s, q_s, do_s, lse_s, delta_s, kv_bar, ready, empty, Q, K, V, DO, Lse, Delta, start, n, tile_row,
            hk, heads, kv_heads, first, steps, stride_qt, stride_kt, stride_vt, stride_dot, stride_lh,
            GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            ROWS_BY_LOADER: gl.constexpr, o_s, O, stride_ot, DELTA_IN_KERNEL: gl.constexpr, DIM: gl.constexpr):
    """Loader partition: the key tile's k and v, then each step's q and dO into the ring
    (``ROWS_BY_LOADER``: and its lse and delta rows, into ``lse_s`` / ``delta_s``'s slot of the step;
    ``DELTA_IN_KERNEL``: its O rows into ``o_s``'s slot too, and no delta rows); ``DIM`` < ``HEAD_DIM``: each
    tile's channels past ``DIM`` zeros (:func:`_head_map`)."""
    k_map = _head_map(K, start, n, kv_heads, stride_kt, BLOCK_N, HEAD_DIM, HEAD_DIM, DIM)
    v_map = _head_map(V, start, n, kv_heads, stride_vt, BLOCK_N, HEAD_DIM, HEAD_DIM, DIM)
    q_map = _head_map(Q, start, n, heads, stride_qt, BLOCK_M, HEAD_DIM, HEAD_DIM, DIM)
    do_map = _head_map(DO, start, n, heads, stride_dot, BLOCK_M, HEAD_DIM, HEAD_DIM, DIM)
    if DELTA_IN_KERNEL:
        o_map = _head_map(O, start, n, heads, stride_ot, BLOCK_M, HEAD_DIM, HEAD_DIM, DIM)
    nbytes: gl.constexpr = HEAD_DIM * k_s.dtype.primitive_bitwidth // 8
    TILES: gl.constexpr = 3 if DELTA_IN_KERNEL else 2
    mbarrier.expect(kv_bar, 2 * BLOCK_N * nbytes)
    _copy_in(k_map, tile_row, hk, 0, kv_bar, k_s, HEAD_DIM, DIM)
    _copy_in(v_map, tile_row, hk, 0, kv_bar, v_s, HEAD_DIM, DIM)
    for it in range(GROUPS * steps):
        h = hk * GROUPS + it // steps
        row = (first + it % steps) * BLOCK_M
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        if ROWS_BY_LOADER:
            # Before the expect's arrival: the slot's phase cannot complete before these copies land.
            _load_rows(lse_s.index(s), delta_s.index(s), Lse, Delta, h * stride_lh + start + row, n - row, BLOCK_M,
                       not DELTA_IN_KERNEL)
            async_copy.mbarrier_arrive(bar)
        mbarrier.expect(bar, TILES * BLOCK_M * nbytes)
        _copy_in(q_map, row, h, 0, bar, q_s.index(s), HEAD_DIM, DIM)
        _copy_in(do_map, row, h, 0, bar, do_s.index(s), HEAD_DIM, DIM)
        if DELTA_IN_KERNEL:
            _copy_in(o_map, row, h, 0, bar, o_s.index(s), HEAD_DIM, DIM)


@gluon.jit
def _probs(st, lse, keys, cols, qk_scale, masked, IS_CAUSAL: gl.constexpr):
    """``P^T`` of one step from its transposed scores (float32) and ``lse`` of its query columns
    (log2 units; zero past the block, where q and dO are zero too, so those columns add nothing);
    causal, where ``masked``, the columns left of each key row are zero."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if IS_CAUSAL:
        if masked:
            pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
    return pt


@gluon.jit
def _add_dq(DQA, dq, start, n, row, h, col0, stride_qat, stride_qah, Sem, stride_sh, turn, slot,
            BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """Add the ``[BLOCK_M, DQ_COLS]`` dQ term of query rows ``row ..`` (of the block), head ``h``,
    columns ``col0 ..`` to the float32 sums. ``DETERMINISTIC``: in a fixed order, first waiting until
    the query tile's counter ``slot`` (``Sem [H, T, 2]``, int32, zeroed) has counted ``turn`` adds
    before this one, then counting this one."""
    acc_q: gl.constexpr = _acc_layout(DQ_COLS)
    rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_q))
    cols = col0 + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, acc_q))
    ptrs = DQA + gl.expand_dims((start + rows) * stride_qat, 1) + h * stride_qah + gl.expand_dims(cols, 0)
    if DETERMINISTIC:
        counter = Sem + h * stride_sh + (start + row) * 2 + slot
        while gl.atomic_add(counter, 0, sem="acquire", scope="gpu") != turn:
            pass
    gl.atomic_add(ptrs, dq, mask=gl.expand_dims(rows < n, 1), sem="relaxed")
    if DETERMINISTIC:
        gl.thread_barrier()  # every thread's adds are issued before the count
        gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.constexpr_function
def _dq_layout():
    """Shared layout of the float32 dQ tiles (``DQ_WRITER``), as TMA reads them."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


@gluon.jit
def _dq_writer(dq_s, dq_full, dq_free, DQA, Sem, start, n, tile_row, hk, heads, first, steps, stride_qat, stride_qah,
               stride_sh, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               DQ_COLS: gl.constexpr, IS_CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, out_s, scale,
               DQ_STORE: gl.constexpr):
    """Writer partition (``DQ_WRITER``, one warp): each step's dQ terms from ``dq_s`` (``[2, BLOCK_M,
    DQ_COLS]`` float32: the warpgroups' column halves, or, where ``DQ_COLS == HEAD_DIM``, their terms
    over their own keys) added to the float32 sums; the tile is free again (``dq_free``) once read.
    In any order: by TMA reduce-adds of the two tiles over a tensor map of the block's rows (rows past
    the block dropped), as FlashAttention-3's dQ warp adds. ``DETERMINISTIC``: by the same TMA
    reduce-adds (the two terms summed into the first tile first where each covers every column),
    after the query tile's counter (slot 0) has counted the key tiles before this one in ``_turn``'s
    order, each waited for until its writes are done (``tma_add.wait_adds_done``), then counting
    this one, as FlashAttention-3's deterministic dQ warp orders its adds. ``DQ_STORE`` (where each term covers
    every column): the two terms' sum, scaled and cast, stored by TMA through ``out_s`` into ``DQA``, dQ itself."""
    CHUNK: gl.constexpr = 8  # rows: one period of the tile's 128-byte swizzle
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // DQ_COLS, DQ_COLS // 4], [1, 1], [1, 0])
    token = gl.zeros([32], gl.int32, gl.BlockedLayout([1], [32], [1], [0]))  # one register per lane
    if DQ_STORE:
        out_map = block_map(DQA, start, n, heads, stride_qat, BLOCK_M, HEAD_DIM)
    else:
        dq_map = tma.make_tensor_descriptor(DQA + start * stride_qat, [n, heads * HEAD_DIM], [stride_qat, 1],
                                            [BLOCK_M, DQ_COLS], _dq_layout())
    for it in range(GROUPS * steps):
        h = hk * GROUPS + it // steps
        row = (first + it % steps) * BLOCK_M
        mbarrier.wait(dq_full, it & 1)
        if DQ_STORE:
            tma.store_wait(0)  # the step before's store has read out_s
            gl.thread_barrier()
            for r in gl.static_range(0, BLOCK_M, CHUNK):
                both = dq_s.index(0).slice(r, CHUNK).load(layout) + dq_s.index(1).slice(r, CHUNK).load(layout)
                out_s.slice(r, CHUNK).store((both * scale).to(out_s.dtype))
            fence_async_shared()
            gl.thread_barrier()  # out_s written, dq_s read
            mbarrier.arrive(dq_free)
            tma.async_copy_shared_to_global(out_map, [row, h * HEAD_DIM], out_s)
        else:
            if DETERMINISTIC and DQ_COLS == HEAD_DIM:
                # Both terms cover every column: their sum, added once (before the turn comes).
                for r in gl.static_range(0, BLOCK_M, CHUNK):
                    both = dq_s.index(0).slice(r, CHUNK).load(layout) + dq_s.index(1).slice(r, CHUNK).load(layout)
                    dq_s.index(0).slice(r, CHUNK).store(both)
                fence_async_shared()
                gl.thread_barrier()  # the sum is in shared memory for the TMA add
            if DETERMINISTIC:
                counter = Sem + h * stride_sh + (start + row) * 2
                turn = _turn(row, tile_row, BLOCK_M, BLOCK_N, IS_CAUSAL)
                while gl.atomic_add(counter, 0, sem="acquire", scope="gpu") != turn:
                    pass
                after_turn(token)
                async_add_shared_to_global(dq_map, [row, h * HEAD_DIM], dq_s.index(0))
                if DQ_COLS != HEAD_DIM:
                    async_add_shared_to_global(dq_map, [row, h * HEAD_DIM + DQ_COLS], dq_s.index(1))
                wait_adds_done(token)
                gl.thread_barrier()  # the adds' writes are done before the tile goes back and the count
                mbarrier.arrive(dq_free)
                gl.atomic_add(counter, 1, sem="release", scope="gpu")
            else:
                second_col = h * HEAD_DIM + (0 if DQ_COLS == HEAD_DIM else DQ_COLS)
                async_add_shared_to_global(dq_map, [row, h * HEAD_DIM], dq_s.index(0))
                async_add_shared_to_global(dq_map, [row, second_col], dq_s.index(1))
                tma.store_wait(0)  # both tiles read
                mbarrier.arrive(dq_free)
    if DQ_STORE:
        tma.store_wait(0)


@gluon.jit
def _turn(row, tile_row, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """How many of the block's key tiles add to query tile ``row ..``'s dQ before the key tile at
    ``tile_row`` (``DETERMINISTIC``; per column half, or per warpgroup where each adds every column).

    In the order the key tiles reach the query tile when they start together: without a causal
    mask all visit the query tiles first to last, so key tile order (and tiles are launched first
    to last); causal, key tile ``j`` starts at its diagonal and meets query tile ``i`` at step
    ``i - 2 j``, so the later key tiles come first (and are launched first: the tile a program
    waits for is running or done)."""
    j = tile_row // BLOCK_N
    if IS_CAUSAL:
        return (row + BLOCK_M - 1) // BLOCK_N - j
    return j


@gluon.jit
def _dq_term(ds16, ds_tile, ds_ready, phase, k_s, w, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
             DQ_COLS: gl.constexpr):
    """Store this warpgroup's ``dS^T`` rows into ``ds_tile`` and issue its dQ term (asynchronous):
    ``DQ_COLS == HEAD_DIM``: over its own 64 keys, every column; else, once the other warpgroup's
    rows are there too (``ds_ready``), over all 128 keys, its ``DQ_COLS`` columns."""
    zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, _acc_layout(DQ_COLS))
    ds_tile.slice(w * HALF_N, HALF_N).store(ds16)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's dS^T rows are in shared memory
    if DQ_COLS == HEAD_DIM:
        return warpgroup_mma(ds_tile.slice(w * HALF_N, HALF_N).permute((1, 0)), k_s.slice(w * HALF_N, HALF_N), zero,
                             use_acc=False, is_async=True)
    mbarrier.arrive(ds_ready)
    mbarrier.wait(ds_ready, phase & 1)
    return warpgroup_mma(ds_tile.permute((1, 0)), k_s.slice(w * DQ_COLS, DQ_COLS, dim=1), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _store_ds_lagged(ds16, ds_s, ds_ready, ds_free, it, w: gl.constexpr):
    """``DQ_LAG``: store this warpgroup's ``dS^T`` rows of step ``it`` into slot ``it % DS_LAG_SLOTS``, once
    both warpgroups' dQ products of the slot's previous step are done (``ds_free``), and count them in
    (``ds_ready``)."""
    d = it % DS_LAG_SLOTS
    mbarrier.wait(ds_free.index(d), ((it // DS_LAG_SLOTS) & 1) ^ 1)
    ds_s.index(d).slice(w * HALF_N, HALF_N).store(ds16)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's dS^T rows are in shared memory
    mbarrier.arrive(ds_ready.index(d))


@gluon.jit
def _lagged_dq(ds_s, ds_ready, j, wait, k_s, w: gl.constexpr, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr):
    """``DQ_LAG``: issue step ``j``'s dQ term (asynchronous; ``j`` from -1 on) over all 128 keys, this
    warpgroup's ``DQ_COLS`` columns, once both warpgroups' ``dS^T`` halves of the step are in (``ds_ready``;
    without ``wait`` at once)."""
    d = (j + DS_LAG_SLOTS) % DS_LAG_SLOTS
    mbarrier.wait(ds_ready.index(d), (j // DS_LAG_SLOTS) & 1, pred=wait)
    zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, _acc_layout(DQ_COLS))
    return warpgroup_mma(ds_s.index(d).permute((1, 0)), k_s.slice(w * DQ_COLS, DQ_COLS, dim=1), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _give_dq(dq, dq_s, dq_full, dq_free, j, w: gl.constexpr):
    """``DQ_WRITER``: hand step ``j``'s dQ term (its product done) to the writer through ``dq_s.index(w)`` once
    the writer has read step ``j - 1``'s."""
    mbarrier.wait(dq_free, (j & 1) ^ 1)
    dq_s.index(w).store(dq)
    fence_async_shared()  # the writer's TMA adds read it
    gl.thread_barrier()  # the whole warpgroup's term is in shared memory
    mbarrier.arrive(dq_full)


@gluon.constexpr_function
def _dq_store_tiles(delta_in_kernel):
    """``DQ_STORE`` at D 128: each consumer's dQ staging tiles, two alternating by step, or one where O's tiles in
    the ring (``DELTA_IN_KERNEL``) leave no room for a second."""
    return 1 if delta_in_kernel else 2


@gluon.jit
def _store_dq(dq, tile, dq_map, row, h, col, PENDING: gl.constexpr, HEAD_DIM: gl.constexpr, DIM: gl.constexpr):
    """``DQ_STORE``: this warpgroup's finished dQ columns (scaled, float32) to head ``h``'s columns ``col ..`` of
    ``dq_map`` (a :func:`_head_map`) at ``row`` through the shared ``tile``, once at most ``PENDING`` of its stores
    are still reading (its tiles alternating by step: the tile's store of the step before last has read it); rows
    past the block and channels past ``DIM`` dropped."""
    tma.store_wait(PENDING)
    gl.thread_barrier()  # the issuing thread's wait is everyone's before the tile is written again
    tile.store(dq.to(tile.dtype))
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's rows are in shared memory for the TMA store
    _copy_out(dq_map, row, h, col, tile, HEAD_DIM, DIM)


@gluon.jit
def _pair_halves(x, ROWS: gl.constexpr, COLS: gl.constexpr, CHUNK: gl.constexpr):
    """``(a, b)``, each ``[ROWS, COLS / 2]``: the chunks of the first and of the second rotary half among ``x``'s
    columns in the paired-chunk order (``[a_i, b_i, a_i+1, b_i+1, ..]``, ``CHUNK`` columns each), each half's chunks
    in their order."""
    a, b = gl.split(gl.permute(gl.reshape(x, [ROWS, COLS // (2 * CHUNK), 2, CHUNK]), [0, 1, 3, 2]))
    return gl.reshape(a, [ROWS, COLS // 2]), gl.reshape(b, [ROWS, COLS // 2])


@gluon.jit
def _halves_map(ptr, start, n, heads, stride_t, BOX_ROWS: gl.constexpr, BOX_COLS: gl.constexpr,
                HEAD_DIM: gl.constexpr, DIM: gl.constexpr, ROT_DIM: gl.constexpr):
    """Tensor map of the two rotary halves of each head (split halves over ``ROT_DIM`` of its ``DIM`` channels), boxes
    ``BOX_COLS`` channels of one half wide: where they are the head's halves in unpadded tiles (``ROT_DIM == DIM ==
    HEAD_DIM``) :func:`_head_map`'s flat view of ``2 * heads`` half-heads, else the ``[n, heads, 2, ROT_DIM / 2]``
    view in ``[BOX_ROWS, 1, 1, BOX_COLS]`` boxes, whose channels past a half's ``ROT_DIM / 2`` are dropped on store
    (:func:`_copy_half_out`)."""
    if ROT_DIM == HEAD_DIM:
        desc = _head_map(ptr, start, n, 2 * heads, stride_t, BOX_ROWS, BOX_COLS, HEAD_DIM // 2, HEAD_DIM // 2)
    else:
        desc = tma.make_tensor_descriptor(ptr + start * stride_t, [n, heads, 2, ROT_DIM // 2],
                                          [stride_t, DIM, ROT_DIM // 2, 1], [BOX_ROWS, 1, 1, BOX_COLS],
                                          _smem_layout(BOX_COLS, 4))
    return desc


@gluon.jit
def _copy_half_out(desc, row, head, half: gl.constexpr, col, tile, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr):
    """TMA store of the shared ``tile`` into rotary half ``half`` of head ``head`` at ``[row, col]`` of a
    :func:`_halves_map`."""
    if ROT_DIM == HEAD_DIM:
        _copy_out(desc, row, 2 * head + half, col, tile, HEAD_DIM // 2, HEAD_DIM // 2)
    else:
        tma.async_copy_shared_to_global(desc, [row, head, half, col],
                                        tile.reshape([tile.shape[0], 1, 1, tile.shape[1]]))


@gluon.constexpr_function
def _pass_offset(u, cols, rotary_dim, head_dim):
    """The offset of :func:`pass_piece` (constexprs)."""
    return pass_piece(u, cols, rotary_dim, head_dim)[0]


@gluon.constexpr_function
def _pass_width(u, cols, rotary_dim, head_dim):
    """The width of :func:`pass_piece` (constexprs)."""
    return pass_piece(u, cols, rotary_dim, head_dim)[1]


@gluon.constexpr_function
def _piece_cols(cols, rotary_dim, head_dim, tile_dim):
    """The widest :func:`pass_piece` of a tile's column halves (0 where there is none)."""
    return max(pass_piece(u, cols, rotary_dim, head_dim)[1] for u in range(tile_dim // cols))


@gluon.jit
def _column_piece(x, ROWS: gl.constexpr, COLS: gl.constexpr, OFFSET: gl.constexpr, WIDTH: gl.constexpr):
    """``x [ROWS, COLS]``'s columns from ``OFFSET`` as ``[ROWS, WIDTH]``, ``WIDTH`` a half or a quarter of ``COLS``
    dividing ``OFFSET``: a reshape, a permute and splits, which move no data in the wgmma accumulator layouts (a
    thread holds columns ``8 j + 2 t + {0, 1}`` for every ``j``)."""
    gl.static_assert((COLS == 2 * WIDTH or COLS == 4 * WIDTH) and OFFSET % WIDTH == 0,
                     "a half or a quarter of the columns")
    pieces = gl.permute(gl.reshape(x, [ROWS, COLS // WIDTH, WIDTH]), [0, 2, 1])
    if COLS == 2 * WIDTH:
        first, second = gl.split(pieces)
        if OFFSET == 0:
            piece = first
        else:
            piece = second
    else:
        even, odd = gl.split(gl.reshape(pieces, [ROWS, WIDTH, 2, 2]))  # (by the piece's index mod 2)
        if (OFFSET // WIDTH) % 2 == 1:
            pair = odd
        else:
            pair = even
        first, second = gl.split(pair)
        if OFFSET // WIDTH >= 2:
            piece = second
        else:
            piece = first
    return piece


@gluon.jit
def _store_dq_chunks(dq, tile_a, tile_b, tile_p, dq_map, piece_map, row, h, col, PENDING: gl.constexpr,
                     BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr, CHUNK: gl.constexpr, HEAD_DIM: gl.constexpr,
                     DIM: gl.constexpr, ROT_DIM: gl.constexpr, PIECE_OFF: gl.constexpr, PIECE_W: gl.constexpr):
    """``DQ_STORE`` with ``PAIR_CHUNK``: this warpgroup's finished ``DQ_COLS`` dQ columns in the paired-chunk order
    (chunks of ``CHUNK``), each rotary half's chunks to head ``h``'s half at channel ``col`` of it (``dq_map``, a
    :func:`_halves_map`) through its shared tile, and (``PIECE_W``) the pass-through columns from ``PIECE_OFF``
    (:func:`pass_piece`) to channels ``ROT_DIM ..`` of ``piece_map`` (a :func:`_head_map`) through ``tile_p``, once
    at most ``PENDING`` of the stores are still reading (as :func:`_store_dq`)."""
    a, b = _pair_halves(dq, BLOCK_M, DQ_COLS, CHUNK)
    if PIECE_W > 0:
        p = _column_piece(dq, BLOCK_M, DQ_COLS, PIECE_OFF, PIECE_W)
    tma.store_wait(PENDING)
    gl.thread_barrier()  # the issuing thread's wait is everyone's before the tiles are written again
    tile_a.store(a.to(tile_a.dtype))
    tile_b.store(b.to(tile_b.dtype))
    if PIECE_W > 0:
        tile_p.store(p.to(tile_p.dtype))
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's rows are in shared memory for the TMA stores
    _copy_half_out(dq_map, row, h, 0, col, tile_a, HEAD_DIM, ROT_DIM)
    _copy_half_out(dq_map, row, h, 1, col, tile_b, HEAD_DIM, ROT_DIM)
    if PIECE_W > 0:
        _copy_out(piece_map, row, h, ROT_DIM, tile_p, HEAD_DIM, DIM)


@gluon.jit
def _stage_dk_cols(x, u: gl.constexpr, w: gl.constexpr, quarters, halves, pieces, ROWS: gl.constexpr,
                   COLS: gl.constexpr, CHUNK: gl.constexpr, DIM: gl.constexpr, ROT_DIM: gl.constexpr):
    """Warpgroup ``w``'s dK columns ``u * COLS ..`` (``x``, float32) into its shared tiles for :func:`_store_dk_cols`:
    where they hold rotary chunks (paired, chunks of ``CHUNK``) each rotary half's into a ``quarters`` tile and the
    pass-through ones among them (:func:`pass_piece`) into its ``pieces`` tile, else all of them into a ``halves``
    tile."""
    dtype: gl.constexpr = quarters.dtype
    PIECE_W: gl.constexpr = _pass_width(u, COLS, ROT_DIM, DIM)
    if u * COLS < ROT_DIM:
        a, b = _pair_halves(x, ROWS, COLS, CHUNK)
        quarters.index(4 * w + 2 * u).store(a.to(dtype))
        quarters.index(4 * w + 2 * u + 1).store(b.to(dtype))
        if PIECE_W > 0:
            p = _column_piece(x, ROWS, COLS, _pass_offset(u, COLS, ROT_DIM, DIM), PIECE_W)
            pieces.index(w).store(p.to(dtype))
    else:
        halves.index(2 * w + u).store(x.to(dtype))


@gluon.jit
def _store_dk_cols(dk_map, DK, start, n, kv_heads, stride_dkt, key0, hk, u: gl.constexpr, w: gl.constexpr, quarters,
                   halves, pieces, ROWS: gl.constexpr, COLS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   DIM: gl.constexpr, ROT_DIM: gl.constexpr):
    """TMA stores of the tiles :func:`_stage_dk_cols` wrote for warpgroup ``w``'s dK columns ``u * COLS ..`` at its key
    rows ``key0 ..`` of kv head ``hk``: the rotary halves' through ``dk_map`` (a :func:`_halves_map`), the
    pass-through ones through a map of their width, whole columns through one of ``COLS``; channels past ``DIM``
    dropped."""
    PIECE_W: gl.constexpr = _pass_width(u, COLS, ROT_DIM, DIM)
    if u * COLS < ROT_DIM:
        _copy_half_out(dk_map, key0, hk, 0, u * (COLS // 2), quarters.index(4 * w + 2 * u), HEAD_DIM, ROT_DIM)
        _copy_half_out(dk_map, key0, hk, 1, u * (COLS // 2), quarters.index(4 * w + 2 * u + 1), HEAD_DIM, ROT_DIM)
        if PIECE_W > 0:
            piece_map = _head_map(DK, start, n, kv_heads, stride_dkt, ROWS, PIECE_W, HEAD_DIM, DIM)
            _copy_out(piece_map, key0, hk, ROT_DIM, pieces.index(w), HEAD_DIM, DIM)
    else:
        whole_map = _head_map(DK, start, n, kv_heads, stride_dkt, ROWS, COLS, HEAD_DIM, DIM)
        _copy_out(whole_map, key0, hk, u * COLS, halves.index(2 * w + u), HEAD_DIM, DIM)


@gluon.jit
def _hand_dq(dq, dq_s, dq_full, dq_free, ds_free, j, w: gl.constexpr):
    """``DQ_LAG``: ``_give_dq``, then give step ``j``'s ``dS^T`` slot back (the barrier there followed this
    warpgroup's product on it)."""
    _give_dq(dq, dq_s, dq_full, dq_free, j, w)
    mbarrier.arrive(ds_free.index(j % DS_LAG_SLOTS))


@gluon.jit
def _fetch_rows(lse_s, delta_s, Lse, Delta, it, hk, first, steps, start, n, stride_lh, GROUPS: gl.constexpr,
                BLOCK_M: gl.constexpr, WITH_DELTA: gl.constexpr):
    """Start copying ``lse`` and (``WITH_DELTA``) ``delta`` of step ``it``'s query rows into slot ``it % 2`` by
    ``cp.async`` (one commit group; rows past the block, and every row of a step past the last,
    read as zeros: those query rows' q and dO are zero, so their columns add nothing)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    cols = (first + it % steps) * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    off = (hk * GROUPS + it // steps) * stride_lh + start + cols
    ok = (cols < n) & (it < GROUPS * steps)
    async_copy.async_copy_global_to_shared(lse_s.index(it % 2), Lse + off, mask=ok)
    if WITH_DELTA:
        async_copy.async_copy_global_to_shared(delta_s.index(it % 2), Delta + off, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _load_rows(lse_s, delta_s, Lse, Delta, off, rows_left, BLOCK_M: gl.constexpr, WITH_DELTA: gl.constexpr):
    """Copy ``lse`` and (``WITH_DELTA``) ``delta`` of a step's ``BLOCK_M`` query rows (from element ``off``; rows
    from ``rows_left`` on, past the block, read as zeros) into ``lse_s`` / ``delta_s`` by ``cp.async``, by one
    warp (``ROWS_BY_LOADER``)."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    rows = gl.arange(0, BLOCK_M, layout=layout)
    ok = rows < rows_left
    async_copy.async_copy_global_to_shared(lse_s, Lse + off + rows, mask=ok)
    if WITH_DELTA:
        async_copy.async_copy_global_to_shared(delta_s, Delta + off + rows, mask=ok)


@gluon.jit
def _step_delta(o_t, do_t, dl_s, out_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``DELTA_IN_KERNEL``: ``rowsum(O * dO)`` (float32) of a step's query rows from their shared tiles, 8 rows at a
    time through this warpgroup's row vector ``dl_s``, in ``out_layout`` (the step's later warpgroup barriers, the
    dS^T tile's and the dQ store's, keep the next step's writes after every warp's read of this one)."""
    CHUNK: gl.constexpr = 8
    layout: gl.constexpr = gl.BlockedLayout([1, HEAD_DIM // 16], [2, 16], [4, 1], [1, 0])
    for r in gl.static_range(0, BLOCK_M, CHUNK):
        o = o_t.slice(r, CHUNK).load(layout).to(gl.float32)
        do = do_t.slice(r, CHUNK).load(layout).to(gl.float32)
        dl_s.slice(r, CHUNK).store(gl.sum(o * do, axis=1))
    gl.thread_barrier()  # every chunk's sums are in
    return dl_s.load(out_layout)


@gluon.jit
def _positions(Pos, start, n, first_row, row0, ROWS: gl.constexpr, HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """Rotary positions (float32, ``LAYOUT``) of the block's rows ``row0 ..``: given (``Pos`` per token), or
    each row's index in its sequence (the block's ``first_row`` onwards), as the rotation pass takes them."""
    rows = row0 + gl.arange(0, ROWS, layout=LAYOUT)
    if HAS_POS:
        return gl.load(Pos + start + rows, mask=rows < n, other=0).to(gl.float32)
    return (first_row + rows).to(gl.float32)


@gluon.jit
def _consumer(w, k_s, v_s, q_s, do_s, ds_s, dq_s, dq_p, rows_s, rows_d, kv_bar, ready, empty, ds_ready, dq_full,
              dq_free, done, DK, DV, DQA, Sem, Lse, Delta, start, n, tile_row, hk, kv_heads, first, steps, qk_scale,
              scale, stride_dkt, stride_dvt, stride_lh, stride_qat, stride_qah, stride_sh, GROUPS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_COLS: gl.constexpr,
              IS_CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, DQ_WRITER: gl.constexpr,
              P_BESIDE_DP: gl.constexpr, WITH_DQ: gl.constexpr, ROWS_BY_LOADER: gl.constexpr,
              THREAD_RELEASE: gl.constexpr, DQ_LAG: gl.constexpr, STAGGER: gl.constexpr, ds_free, lead,
              DQ_STORE: gl.constexpr, o_s, dl_s, DELTA_IN_KERNEL: gl.constexpr, Pos, first_row, log2_theta,
              ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, PAIR_CHUNK: gl.constexpr,
              DIM: gl.constexpr):
    """Consumer partition (one warpgroup): key rows ``tile_row + 64 * w`` onwards (module docstring);
    ``DQ_WRITER``: its dQ term goes to ``dq_s.index(w)`` for the writer partition; ``P_BESIDE_DP``:
    ``P^T`` computed while ``dP^T``'s product runs; without ``WITH_DQ`` no dQ term at all;
    ``ROWS_BY_LOADER``: the step's lse and delta rows in ``rows_s`` / ``rows_d``'s slot of the step,
    copied by the loader (shared by both warpgroups), else copied by this warpgroup one step ahead;
    ``THREAD_RELEASE``: each thread hands the step's slot back itself; ``DQ_LAG``: the dQ product of the step
    before (``_lagged_dq``), dS^T in ``ds_s``'s ``DS_LAG_SLOTS`` slots (``ds_free``); ``STAGGER``: warpgroup 1
    starts once warpgroup 0's first dS^T half is in (``lead``); ``DQ_STORE``: its dQ columns stored into
    ``DQA`` (dQ itself, rows of ``stride_qat``) through its ``_dq_store_tiles`` tiles of ``dq_s``, in turn (the
    pass-through columns among rotary ones in paired chunks, :func:`pass_piece`, through those of ``dq_p``);
    ``DELTA_IN_KERNEL``: the step's delta rows from its O and dO tiles (``_step_delta``); ``ROT_DIM`` (with
    ``DQ_STORE``, q and k rotated by the caller): dQ's columns and dK rotated back before their stores
    (``unrotate_pairs``), the rows at ``Pos`` or at their index in the sequence (``first_row`` + row); ``DIM`` <
    ``HEAD_DIM`` (with ``DQ_STORE``): the head's ``DIM`` channels padded with zeros in the tiles, dQ, dK and dV
    stored without the padding (:func:`_head_map`)."""
    dtype: gl.constexpr = k_s.dtype
    acc_s: gl.constexpr = _acc_layout(BLOCK_M)
    acc_d: gl.constexpr = _acc_layout(HEAD_DIM)
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    key0 = tile_row + w * HALF_N
    keys = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, acc_s))
    k_w = k_s.slice(w * HALF_N, HALF_N)
    v_w = v_s.slice(w * HALF_N, HALF_N)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_d)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_d)
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, acc_s)
    # With paired chunks, this consumer's columns that hold rotary chunks go out by rotary half (in boxes of half its
    # columns), and the pass-through ones among them (PIECE_W) apart; columns past the rotary dim whole.
    PAIRED_COLS: gl.constexpr = PAIR_CHUNK > 0 and w * DQ_COLS < ROT_DIM
    PIECE_OFF: gl.constexpr = _pass_offset(w, DQ_COLS, ROT_DIM, DIM) if PAIR_CHUNK > 0 else 0
    PIECE_W: gl.constexpr = _pass_width(w, DQ_COLS, ROT_DIM, DIM) if PAIR_CHUNK > 0 else 0
    if DQ_STORE and PAIRED_COLS:
        dq_map = _halves_map(DQA, start, n, kv_heads * GROUPS, stride_qat, BLOCK_M, DQ_COLS // 2, HEAD_DIM, DIM,
                             ROT_DIM)
    elif DQ_STORE:
        dq_map = _head_map(DQA, start, n, kv_heads * GROUPS, stride_qat, BLOCK_M, DQ_COLS, HEAD_DIM, DIM)
    if DQ_STORE and PIECE_W > 0:
        piece_map = _head_map(DQA, start, n, kv_heads * GROUPS, stride_qat, BLOCK_M, PIECE_W, HEAD_DIM, DIM)
    elif DQ_STORE:
        piece_map = dq_map
    if not ROWS_BY_LOADER:
        _fetch_rows(rows_s, rows_d, Lse, Delta, 0, hk, first, steps, start, n, stride_lh, GROUPS, BLOCK_M,
                    not DELTA_IN_KERNEL)
    mbarrier.wait(kv_bar, 0)
    if STAGGER and w == 1:
        mbarrier.wait(lead, 0)
    for it in range(GROUPS * steps):
        h = hk * GROUPS + it // steps
        row = (first + it % steps) * BLOCK_M
        s = it % STAGES
        b = it % 2  # with ROWS_BY_LOADER also the step's ring slot (STAGES is 2), where the loader put its rows
        if not ROWS_BY_LOADER:
            _fetch_rows(rows_s, rows_d, Lse, Delta, it + 1, hk, first, steps, start, n, stride_lh, GROUPS, BLOCK_M,
                        not DELTA_IN_KERNEL)
            async_copy.wait_group(1)
            gl.thread_barrier()  # step it's rows, copied by every thread of the warpgroup, have landed
        cols = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_s))
        q = q_s.index(s)
        do = do_s.index(s)
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        st = warpgroup_mma(k_w, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_w, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if P_BESIDE_DP:
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        else:
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        lse = rows_s.index(b).load(gl.SliceLayout(0, acc_s)) * _LOG2E
        # Only the first two query tiles from the diagonal hold columns left of a key row.
        pt = _probs(st, lse, keys, cols, qk_scale, row < tile_row + BLOCK_N, IS_CAUSAL)
        if P_BESIDE_DP:
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        if DELTA_IN_KERNEL:
            delta = _step_delta(o_s.index(s), do, dl_s, gl.SliceLayout(0, acc_s), BLOCK_M, HEAD_DIM)
        else:
            delta = rows_d.index(b).load(gl.SliceLayout(0, acc_s))
        ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        p16 = gl.convert_layout(pt.to(dtype), a_s)
        dv = warpgroup_mma(p16, do, dv, is_async=True)
        if DQ_LAG:
            _store_ds_lagged(ds16, ds_s, ds_ready, ds_free, it, w)
            if STAGGER and w == 0:
                mbarrier.arrive(lead, pred=it == 0)
            # Step it - 1's dQ term (at the first step a product of a slot no step has written yet, dropped:
            # one product a program, where a branch here would move the loop's accumulators into other
            # registers and spill).
            dq = _lagged_dq(ds_s, ds_ready, it - 1, it > 0, k_s, w, BLOCK_M, DQ_COLS)
        elif WITH_DQ:
            dq = _dq_term(ds16, ds_s.index(b), ds_ready.index(b), it // 2, k_s, w, BLOCK_M, HEAD_DIM, DQ_COLS)
        ds_a = gl.convert_layout(ds16, a_s)
        dk = warpgroup_mma(ds_a, q, dk, is_async=True)
        if not WITH_DQ:
            dv, p16, dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dv, p16, dk, ds_a))
        elif DQ_LAG:
            # Step it - 1's dQ term goes out while dK's product runs.
            dv, dq, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p16))
            if it > 0:
                _hand_dq(dq, dq_s, dq_full, dq_free, ds_free, it - 1, w)
            dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_a))
        elif DQ_STORE and not DQ_WRITER:
            # dQ's columns go out while dK's product runs.
            dv, dq, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p16))
            TILES: gl.constexpr = _dq_store_tiles(DELTA_IN_KERNEL)
            dq = dq * scale
            if ROT_DIM > 0:
                acc_q: gl.constexpr = _acc_layout(DQ_COLS)
                pos = _positions(Pos, start, n, first_row, row, BLOCK_M, HAS_POS, gl.SliceLayout(1, acc_q))
                dq = unrotate_pairs(dq, pos, w * DQ_COLS, log2_theta, BLOCK_M, DQ_COLS, ROT_DIM, INTERLEAVED,
                                    PAIR_CHUNK, acc_q)
            if PAIRED_COLS:
                tile = 2 * (TILES * w + it % TILES)
                _store_dq_chunks(dq, dq_s.index(tile), dq_s.index(tile + 1), dq_p.index(it % TILES), dq_map,
                                 piece_map, row, h, w * (DQ_COLS // 2), (2 + (PIECE_W > 0)) * (TILES - 1), BLOCK_M,
                                 DQ_COLS, PAIR_CHUNK, HEAD_DIM, DIM, ROT_DIM, PIECE_OFF, PIECE_W)
            elif PAIR_CHUNK > 0:  # (the tiles of the rotary halves' columns as whole ones)
                whole = dq_s._reinterpret(dtype, [dq_s.shape[0] // 2, BLOCK_M, DQ_COLS], _smem_layout(DQ_COLS))
                _store_dq(dq, whole.index(TILES * w + it % TILES), dq_map, row, h, w * DQ_COLS, TILES - 1, HEAD_DIM,
                          DIM)
            else:
                _store_dq(dq, dq_s.index(TILES * w + it % TILES), dq_map, row, h, w * DQ_COLS, TILES - 1, HEAD_DIM,
                          DIM)
            dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_a))
        elif DQ_WRITER:
            # dQ's term goes out while dK's product runs (products complete in the order issued).
            dv, dq, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p16))
            _give_dq(dq, dq_s, dq_full, dq_free, it, w)
            dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_a))
        else:
            dv, dq, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p16))
            turn = _turn(row, tile_row, BLOCK_M, BLOCK_N, IS_CAUSAL)
            if DQ_COLS == HEAD_DIM:
                _add_dq(DQA, dq, start, n, row, h, 0, stride_qat, stride_qah, Sem, stride_sh, 2 * turn + w, 0,
                        BLOCK_M, DQ_COLS, DETERMINISTIC)
            else:
                _add_dq(DQA, dq, start, n, row, h, w * DQ_COLS, stride_qat, stride_qah, Sem, stride_sh, turn, w,
                        BLOCK_M, DQ_COLS, DETERMINISTIC)
            dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_a))
        _release(empty, s, THREAD_RELEASE)
    async_copy.wait_group(0)  # the copies past the last step (all masked) are done too
    # Both warpgroups are done with k and v (each one's dQ products read every key row), and with the ring.
    gl.thread_barrier()
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    if DQ_LAG:
        # The last step's dQ product still reads k: dK and dV go out through ring slots (the same
        # [64, D] tiles), so that they leave registers before it.
        dk_t = q_s.index(w)
        dv_t = do_s.index(w)
    else:
        dk_t = k_w
        dv_t = v_w
    dk = dk * scale
    # With paired chunks in padded tiles or over part of the channels, dK goes out by column half (_store_dk_cols).
    SPLIT_DK: gl.constexpr = PAIR_CHUNK > 0 and (DIM < HEAD_DIM or ROT_DIM < DIM)
    if ROT_DIM > 0:
        pos = _positions(Pos, start, n, first_row, key0, HALF_N, HAS_POS, gl.SliceLayout(1, acc_d))
        dk = unrotate_pairs(dk, pos, 0, log2_theta, HALF_N, HEAD_DIM, ROT_DIM, INTERLEAVED, PAIR_CHUNK, acc_d)
        if PAIR_CHUNK > 0 and not SPLIT_DK:  # channels back in order: [a_0, b_0, a_1, ..] -> [a_0, a_1, .., b_0, ..]
            dk = gl.reshape(dk, [HALF_N, HEAD_DIM // (2 * PAIR_CHUNK), 2, PAIR_CHUNK])
            dk = gl.convert_layout(gl.reshape(gl.permute(dk, [0, 2, 1, 3]), [HALF_N, HEAD_DIM]), acc_d)
    if SPLIT_DK:
        # dK's column halves go out as a consumer's dQ columns do (_store_dq_chunks), from this warpgroup's 64 rows of
        # the dead k tile (as two 64-wide tiles, or four 32-wide ones by rotary half) and, for the pass-through
        # columns among rotary ones, a tile of the dead q ring.
        quarters = k_s._reinterpret(dtype, [8, HALF_N, DQ_COLS // 2], _smem_layout(DQ_COLS // 2))
        halves = k_s._reinterpret(dtype, [4, HALF_N, DQ_COLS], _smem_layout(DQ_COLS))
        PIECES: gl.constexpr = _piece_cols(DQ_COLS, ROT_DIM, DIM, HEAD_DIM)
        if PIECES > 0:
            pieces = q_s._reinterpret(dtype, [STAGES * BLOCK_M * HEAD_DIM // (HALF_N * PIECES), HALF_N, PIECES],
                                      _smem_layout(PIECES))
        else:
            pieces = quarters
        dk_lo, dk_hi = _pair_halves(dk, HALF_N, HEAD_DIM, DQ_COLS)
        _stage_dk_cols(dk_lo, 0, w, quarters, halves, pieces, HALF_N, DQ_COLS, PAIR_CHUNK, DIM, ROT_DIM)
        _stage_dk_cols(dk_hi, 1, w, quarters, halves, pieces, HALF_N, DQ_COLS, PAIR_CHUNK, DIM, ROT_DIM)
    else:
        dk_t.store(dk.to(dtype))
    dv_t.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    dv_map = _head_map(DV, start, n, kv_heads, stride_dvt, HALF_N, HEAD_DIM, HEAD_DIM, DIM)
    if SPLIT_DK:
        dk_map = _halves_map(DK, start, n, kv_heads, stride_dkt, HALF_N, DQ_COLS // 2, HEAD_DIM, DIM, ROT_DIM)
        _store_dk_cols(dk_map, DK, start, n, kv_heads, stride_dkt, key0, hk, 0, w, quarters, halves, pieces, HALF_N,
                       DQ_COLS, HEAD_DIM, DIM, ROT_DIM)
        _store_dk_cols(dk_map, DK, start, n, kv_heads, stride_dkt, key0, hk, 1, w, quarters, halves, pieces, HALF_N,
                       DQ_COLS, HEAD_DIM, DIM, ROT_DIM)
    else:
        dk_map = _head_map(DK, start, n, kv_heads, stride_dkt, HALF_N, HEAD_DIM, HEAD_DIM, DIM)
    if DIM == HEAD_DIM:
        if not SPLIT_DK:
            _copy_out(dk_map, key0, hk, 0, dk_t, HEAD_DIM, DIM)
        _copy_out(dv_map, key0, hk, 0, dv_t, HEAD_DIM, DIM)
    else:  # (dK, dV in the dead k, v tiles: a slice of a box, as a box of a slice is not Gluon's)
        if not SPLIT_DK:
            tma.async_copy_shared_to_global(dk_map, [key0, hk, 0], _key_rows_box(k_s, w, BLOCK_N, HEAD_DIM))
        tma.async_copy_shared_to_global(dv_map, [key0, hk, 0], _key_rows_box(v_s, w, BLOCK_N, HEAD_DIM))
    if DQ_LAG:
        last = GROUPS * steps - 1
        dq = _lagged_dq(ds_s, ds_ready, last, True, k_s, w, BLOCK_M, DQ_COLS)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        _hand_dq(dq, dq_s, dq_full, dq_free, ds_free, last, w)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["slots", "heads", "kv_heads", "qk_scale", "scale", "stride_lh", "stride_sh",
                              "log2_theta"])
def _flash_bwd_ws_kernel(
    Q, K, V, DO, DK, DV, DQA, Sem, Lse, Delta, O, Table, Pos, log2_theta, slots, heads, kv_heads, qk_scale, scale,
    stride_qt,
    stride_kt, stride_vt, stride_dot, stride_dkt, stride_dvt, stride_lh, stride_qat, stride_qah, stride_sh, stride_ot,
    HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    DQ_COLS: gl.constexpr, IS_CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, DQ_WRITER: gl.constexpr,
    P_BESIDE_DP: gl.constexpr, WITH_DQ: gl.constexpr, ROWS_BY_LOADER: gl.constexpr, THREAD_RELEASE: gl.constexpr,
    DQ_LAG: gl.constexpr, STAGGER: gl.constexpr, LEAN_WRITER: gl.constexpr, DQ_STORE: gl.constexpr,
    DELTA_IN_KERNEL: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr,
    PAIR_CHUNK: gl.constexpr, DIM: gl.constexpr,
):
    start, n, tile_row, hk = table_tile(Table, slots, kv_heads)
    if n > 0:
        if DIM != HEAD_DIM:
            gl.static_assert(DIM < HEAD_DIM and DQ_STORE and not DQ_WRITER,
                             "DIM < HEAD_DIM: dQ's column halves stored by the consumers")
        first_row = 0
        if ROT_DIM > 0:
            gl.static_assert(DQ_STORE and not DQ_WRITER, "ROT_DIM: dQ's column halves stored by the consumers")
            first_row = gl.load(Table + 2 * slots + gl.program_id(0) // kv_heads)
        if PAIR_CHUNK > 0:
            gl.static_assert(ROT_DIM <= DIM and not INTERLEAVED and DQ_COLS % (2 * PAIR_CHUNK) == 0
                             and (ROT_DIM // 2) % PAIR_CHUNK == 0,
                             "PAIR_CHUNK: split halves, each consumer's dQ columns whole pairs of chunks")
        dtype: gl.constexpr = Q.dtype.element_ty
        layout: gl.constexpr = _smem_layout(HEAD_DIM)
        k_s = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], layout)
        v_s = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], layout)
        q_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
        do_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
        if DQ_LAG:
            gl.static_assert(DQ_WRITER and WITH_DQ and DQ_COLS < HEAD_DIM, "DQ_LAG: D 128's writer form")
        if STAGGER:
            gl.static_assert(DQ_LAG, "STAGGER needs DQ_LAG")
        if LEAN_WRITER:
            gl.static_assert(DQ_COLS < HEAD_DIM, "LEAN_WRITER: a writer that only issues TMA adds")
        DS_SLOTS: gl.constexpr = DS_LAG_SLOTS if DQ_LAG else 2
        ds_s = gl.allocate_shared_memory(dtype, [DS_SLOTS, BLOCK_N, BLOCK_M], _smem_layout(BLOCK_M))
        if DQ_STORE:
            gl.static_assert(WITH_DQ and not DQ_LAG and not DETERMINISTIC, "DQ_STORE: no adds to order")
            gl.static_assert(DQ_WRITER == (DQ_COLS == HEAD_DIM),
                             "DQ_STORE: column halves stored by the consumers, else the terms' sum by the writer")
            if DQ_WRITER:
                dq_store_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], _smem_layout(HEAD_DIM))
            else:
                STORE_TILES: gl.constexpr = 2 * _dq_store_tiles(DELTA_IN_KERNEL)
                if PAIR_CHUNK > 0:  # (each tile as its two rotary halves' tiles, stored apart)
                    dq_store_s = gl.allocate_shared_memory(dtype, [2 * STORE_TILES, BLOCK_M, DQ_COLS // 2],
                                                           _smem_layout(DQ_COLS // 2))
                else:
                    dq_store_s = gl.allocate_shared_memory(dtype, [STORE_TILES, BLOCK_M, DQ_COLS],
                                                           _smem_layout(DQ_COLS))
        else:
            dq_store_s = ds_s
        # The pass-through columns among one consumer's rotary ones (paired chunks over part of the channels), a tile
        # per dQ staging tile of that consumer.
        PIECES: gl.constexpr = _piece_cols(DQ_COLS, ROT_DIM, DIM, HEAD_DIM) if PAIR_CHUNK > 0 else 0
        if DQ_STORE and not DQ_WRITER and PIECES > 0:
            dq_piece_s = gl.allocate_shared_memory(dtype, [_dq_store_tiles(DELTA_IN_KERNEL), BLOCK_M, PIECES],
                                                   _smem_layout(PIECES))
        else:
            dq_piece_s = dq_store_s
        if DELTA_IN_KERNEL:
            gl.static_assert(DQ_STORE, "DELTA_IN_KERNEL: where one key tile holds the block (DQ_STORE)")
            o_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
            dl_0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            dl_1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        else:
            o_s = q_s
            dl_0 = ds_s
            dl_1 = ds_s
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        # Per consumer, two slots; ROWS_BY_LOADER: one copy in the ring's slots, both consumers read it.
        gl.static_assert(not ROWS_BY_LOADER or STAGES == 2, "the rows' slots are the ring's")
        lse_0 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], rows_layout)
        if ROWS_BY_LOADER:
            lse_1 = lse_0
        else:
            lse_1 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], rows_layout)
        delta_0 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], rows_layout)
        if ROWS_BY_LOADER:
            delta_1 = delta_0
        else:
            delta_1 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], rows_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
        if DQ_LAG:
            ds_free = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
            lead = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        else:
            ds_free = ds_ready
            lead = ds_ready
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        if DQ_WRITER and WITH_DQ:
            dq_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], _dq_layout())
            dq_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            dq_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(dq_full.index(0), count=2)
            mbarrier.init(dq_free.index(0), count=1)
        mbarrier.init(kv_bar.index(0), count=1)
        for d in gl.static_range(DS_SLOTS):
            mbarrier.init(ds_ready.index(d), count=2)
            if DQ_LAG:
                mbarrier.init(ds_free.index(d), count=2)
        if DQ_LAG:
            mbarrier.init(lead.index(0), count=1)
        mbarrier.init(done.index(0), count=2)
        init_ring(ready, empty, STAGES, 2, THREAD_RELEASE)  # a slot is free once both consumers are done with it
        first, steps = query_steps(n, tile_row, BLOCK_M, IS_CAUSAL)
        if DQ_WRITER and WITH_DQ:
            gl.warp_specialize([
                (_consumer, (0, k_s, v_s, q_s, do_s, ds_s, dq_s, dq_s, lse_0, delta_0, kv_bar.index(0), ready, empty,
                             ds_ready, dq_full.index(0), dq_free.index(0), done.index(0), DK, DV, DQA, Sem, Lse, Delta,
                             start, n, tile_row, hk, kv_heads, first, steps, qk_scale, scale, stride_dkt, stride_dvt,
                             stride_lh, stride_qat, stride_qah, stride_sh, GROUPS, BLOCK_M, BLOCK_N, HEAD_DIM,
                             DQ_COLS, IS_CAUSAL, DETERMINISTIC, DQ_WRITER, P_BESIDE_DP, WITH_DQ, ROWS_BY_LOADER,
                             THREAD_RELEASE, DQ_LAG, STAGGER, ds_free, lead.index(0), False, o_s, dl_0,
                             DELTA_IN_KERNEL, Pos, first_row, log2_theta, ROT_DIM, INTERLEAVED, HAS_POS,
                             PAIR_CHUNK, DIM)),
                (_consumer, (1, k_s, v_s, q_s, do_s, ds_s, dq_s, dq_s, lse_1, delta_1, kv_bar.index(0), ready, empty,
                             ds_ready, dq_full.index(0), dq_free.index(0), done.index(0), DK, DV, DQA, Sem, Lse, Delta,
                             start, n, tile_row, hk, kv_heads, first, steps, qk_scale, scale, stride_dkt, stride_dvt,
                             stride_lh, stride_qat, stride_qah, stride_sh, GROUPS, BLOCK_M, BLOCK_N, HEAD_DIM,
                             DQ_COLS, IS_CAUSAL, DETERMINISTIC, DQ_WRITER, P_BESIDE_DP, WITH_DQ, ROWS_BY_LOADER,
                             THREAD_RELEASE, DQ_LAG, STAGGER, ds_free, lead.index(0), False, o_s, dl_1,
                             DELTA_IN_KERNEL, Pos, first_row, log2_theta, ROT_DIM, INTERLEAVED, HAS_POS,
                             PAIR_CHUNK, DIM)),
                (_loader, (k_s, v_s, q_s, do_s, lse_0, delta_0, kv_bar.index(0), ready, empty, Q, K, V, DO, Lse,
                           Delta, start, n, tile_row, hk, heads, kv_heads, first, steps, stride_qt, stride_kt,
                           stride_vt, stride_dot, stride_lh, GROUPS, BLOCK_M, BLOCK_N, HEAD_DIM, ROWS_BY_LOADER, o_s,
                           O, stride_ot, DELTA_IN_KERNEL, DIM)),
                (_dq_writer, (dq_s, dq_full.index(0), dq_free.index(0), DQA, Sem, start, n, tile_row, hk, heads, first,
                              steps, stride_qat, stride_qah, stride_sh, GROUPS, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_COLS,
                              IS_CAUSAL, DETERMINISTIC, dq_store_s, scale, DQ_STORE)),
            ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LEAN_WRITER_REGS if LEAN_WRITER else WRITER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (0, k_s, v_s, q_s, do_s, ds_s, dq_store_s, dq_piece_s, lse_0, delta_0, kv_bar.index(0),
                             ready, empty, ds_ready, done.index(0), done.index(0), done.index(0), DK, DV, DQA, Sem, Lse,
                             Delta, start, n, tile_row, hk, kv_heads, first, steps, qk_scale, scale, stride_dkt,
                             stride_dvt, stride_lh, stride_qat, stride_qah, stride_sh, GROUPS, BLOCK_M, BLOCK_N,
                             HEAD_DIM, DQ_COLS, IS_CAUSAL, DETERMINISTIC, DQ_WRITER, P_BESIDE_DP, WITH_DQ,
                             ROWS_BY_LOADER, THREAD_RELEASE, DQ_LAG, STAGGER, ds_free, lead.index(0), DQ_STORE, o_s,
                             dl_0, DELTA_IN_KERNEL, Pos, first_row, log2_theta, ROT_DIM, INTERLEAVED, HAS_POS,
                             PAIR_CHUNK, DIM)),
                (_consumer, (1, k_s, v_s, q_s, do_s, ds_s, dq_store_s, dq_piece_s, lse_1, delta_1, kv_bar.index(0),
                             ready, empty, ds_ready, done.index(0), done.index(0), done.index(0), DK, DV, DQA, Sem, Lse,
                             Delta, start, n, tile_row, hk, kv_heads, first, steps, qk_scale, scale, stride_dkt,
                             stride_dvt, stride_lh, stride_qat, stride_qah, stride_sh, GROUPS, BLOCK_M, BLOCK_N,
                             HEAD_DIM, DQ_COLS, IS_CAUSAL, DETERMINISTIC, DQ_WRITER, P_BESIDE_DP, WITH_DQ,
                             ROWS_BY_LOADER, THREAD_RELEASE, DQ_LAG, STAGGER, ds_free, lead.index(0), DQ_STORE, o_s,
                             dl_1, DELTA_IN_KERNEL, Pos, first_row, log2_theta, ROT_DIM, INTERLEAVED, HAS_POS,
                             PAIR_CHUNK, DIM)),
                (_loader, (k_s, v_s, q_s, do_s, lse_0, delta_0, kv_bar.index(0), ready, empty, Q, K, V, DO, Lse,
                           Delta, start, n, tile_row, hk, heads, kv_heads, first, steps, stride_qt, stride_kt,
                           stride_vt, stride_dot, stride_lh, GROUPS, BLOCK_M, BLOCK_N, HEAD_DIM, ROWS_BY_LOADER, o_s,
                           O, stride_ot, DELTA_IN_KERNEL, DIM)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        mbarrier.invalidate(kv_bar.index(0))
        for d in gl.static_range(DS_SLOTS):
            mbarrier.invalidate(ds_ready.index(d))
            if DQ_LAG:
                mbarrier.invalidate(ds_free.index(d))
        if DQ_LAG:
            mbarrier.invalidate(lead.index(0))
        mbarrier.invalidate(done.index(0))
        if DQ_WRITER and WITH_DQ:
            mbarrier.invalidate(dq_full.index(0))
            mbarrier.invalidate(dq_free.index(0))
        drop_ring(ready, empty, STAGES)


launch_bwd = Launcher(_flash_bwd_ws_kernel, scratch=True)


def tile_head_dim(head_dim: int) -> int:
    """The width of the kernel's tiles of a head (``HEAD_DIM``): 128 for the head dims of ``PADDED_HEAD_DIMS``
    (``DIM`` the head's own), else the head dim."""
    return 128 if head_dim in PADDED_HEAD_DIMS else head_dim


def head_dims(block_size: int) -> tuple:
    """The head dims the kernel admits for calls of ``block_size`` (0: full attention): 64 and 128, and where it
    stores dQ (blocks one key tile holds whole, :func:`stores_dq`) those of ``PADDED_HEAD_DIMS`` too."""
    padded = tuple(d for d in sorted(PADDED_HEAD_DIMS) if stores_dq(block_size, d))
    return tuple(sorted((64, 128) + padded))


def dq_cols(head_dim: int) -> int:
    """dQ columns per consumer warpgroup: half the tile's (:func:`tile_head_dim`) from D 128 on (each half a whole
    64-column, 128-byte swizzle block of the shared k tile), else all of them (each warpgroup over its own
    keys)."""
    width = tile_head_dim(head_dim)
    return width // 2 if width >= 128 else width


def taken(deterministic: bool, block_size: int, head_dim: int) -> bool:
    """Whether the switches hand the dK/dV pass of a backward of this mode and these facts
    (``block_size`` 0: full attention) to this kernel with dQ's terms: ``TAKEN`` (both modes),
    ``FAST_TAKEN`` (the fast one at full attention with the head dims of ``FAST_HEAD_DIMS``),
    ``ORDERED_HEAD_DIMS`` (the deterministic one at full attention), :func:`stores_dq` (both modes)."""
    if stores_dq(block_size, head_dim):
        return True
    if deterministic:
        return TAKEN[0] or (block_size == 0 and head_dim in ORDERED_HEAD_DIMS)
    return TAKEN[0] or (FAST_TAKEN[0] and block_size == 0 and head_dim in FAST_HEAD_DIMS)


def dkdv_only(deterministic: bool, block_size: int, head_dim: int) -> bool:
    """Whether the deterministic backward's dK/dV pass of a call of these facts (``block_size`` 0:
    full attention) is this kernel without dQ's terms, where :func:`taken` does not hand it the
    whole pass: at full attention with a head dim of ``DKDV_ONLY_HEAD_DIMS``, or everywhere while
    ``DKDV_ONLY_TAKEN`` is set."""
    where = DKDV_ONLY_TAKEN[0] or (block_size == 0 and head_dim in DKDV_ONLY_HEAD_DIMS)
    return deterministic and where and not taken(deterministic, block_size, head_dim)


def runs(deterministic: bool, block_size: int, head_dim: int) -> bool:
    """Whether the switches hand the dK/dV pass of a backward of this mode and these facts to this
    kernel at all: adding dQ's terms (:func:`taken`) or without them (:func:`dkdv_only`)."""
    return taken(deterministic, block_size, head_dim) or dkdv_only(deterministic, block_size, head_dim)


def computes_delta(block_size: int, head_dim: int, causal: bool, groups: int) -> bool:
    """Whether the kernel computes the delta rows itself, where :func:`stores_dq`: ``DELTA_IN_KERNEL`` where
    set, else for ``groups`` > 1 query heads per kv head without ``causal`` masks (measured faster there)."""
    if not stores_dq(block_size, head_dim):
        return False
    return (groups > 1 and not causal) if DELTA_IN_KERNEL is None else DELTA_IN_KERNEL


def pair_chunk(head_dim: int, rotary_dim: int, interleaved: bool) -> int:
    """The channel chunk of the paired-chunk order (``reference.paired_chunks`` over ``rotary_dim`` channels) in
    which the kernel takes q and k rotated by split halves whose pairs no consumer's dQ columns (:func:`dq_cols`)
    hold whole in their own order: the largest power of two dividing both half a column half and half the rotary
    dim, so that each consumer's columns hold whole pairs of chunks (``PAIR_CHUNK``: 32 at D 128 over every channel;
    16 at D 96 over every channel, in 128-wide tiles, while ``PADDED_PAIRED_SPLIT``; 8 or 16 over part of the
    channels where :func:`pass_piece` stores the rest, while ``PAIRED_PARTIAL``); 0 for every other rotary form
    (interleaved pairs, split halves over channels dividing the column half), or while ``PAIRED_SPLIT`` is off."""
    cols = dq_cols(head_dim)
    if not PAIRED_SPLIT or interleaved or rotary_dim <= 0 or cols == head_dim or cols % rotary_dim == 0:
        return 0
    if rotary_dim == head_dim:
        if head_dim in PADDED_HEAD_DIMS and not PADDED_PAIRED_SPLIT:
            return 0
    elif not PAIRED_PARTIAL or rotary_dim % 16 or any(width not in (0, 16, 32) or width and offset % width
                                   for offset, width in (pass_piece(u, cols, rotary_dim, head_dim)
                                                         for u in range(tile_head_dim(head_dim) // cols))):
        return 0
    return math.gcd(cols // 2, rotary_dim // 2)


@gluon.constexpr_function
def pass_piece(u: int, cols: int, rotary_dim: int, head_dim: int) -> tuple:
    """``(offset, width)`` of the pass-through channels among the ``cols`` tile columns from ``u * cols`` that hold
    rotary chunks too (``PAIR_CHUNK`` over ``rotary_dim`` of ``head_dim`` channels): the channels from
    ``rotary_dim`` to the head's end or the columns' end, stored in their order; ``(0, 0)`` where the columns hold
    no rotary channel (stored whole) or no pass-through one."""
    lo, hi = u * cols, (u + 1) * cols
    if rotary_dim <= lo or rotary_dim >= min(hi, head_dim):
        return 0, 0
    return rotary_dim - lo, min(hi, head_dim) - rotary_dim


def unrotates(block_size: int, head_dim: int, rotary_dim: int, interleaved: bool) -> bool:
    """Whether the kernel, where it stores dQ, rotates dQ and dK back itself (``ROT_DIM``) for a backward on q and k
    its caller rotated (``UNROTATE`` on): where the consumers store dQ's column halves (:func:`dq_cols`) and each
    rotary pair lies inside one half (interleaved pairs; split halves over ``rotary_dim`` channels dividing the
    half), or q and k come in the paired-chunk order (other split halves, :func:`pair_chunk`)."""
    if not UNROTATE or not stores_dq(block_size, head_dim) or dq_cols(head_dim) == head_dim or rotary_dim <= 0:
        return False
    return interleaved or dq_cols(head_dim) % rotary_dim == 0 or pair_chunk(head_dim, rotary_dim, interleaved) > 0


def stores_dq(block_size: int, head_dim: int) -> bool:
    """Whether the kernel stores dQ itself (``DQ_STORE``) for a call of these facts (``block_size`` 0: full
    attention): on blocks one key tile holds whole, at the head dims of ``DQ_STORE_HEAD_DIMS``."""
    return 0 < block_size <= TILE_N and head_dim in DQ_STORE_HEAD_DIMS


def query_rows(head_dim: int, with_dq: bool) -> int:
    """Query rows per step (``BLOCK_M``): 128 in the pass without dQ's terms at the head dims of
    ``DKDV_ONLY_WIDE_HEAD_DIMS``, else ``TILE_M``."""
    return 128 if not with_dq and head_dim in DKDV_ONLY_WIDE_HEAD_DIMS else TILE_M


def flash_ws_bwd_reasons(do, q, k, v, rope_theta, block_size: int = 0) -> list:
    """Why the warp-specialized dK/dV pass cannot take a backward call of ``block_size`` (0: full attention; empty:
    it can)."""
    reasons = flash_ws_reasons(q, k, v, rope_theta, head_dims(block_size))
    if not taken_on(q.device, VERIFIED_ON):
        reasons.append("a GPU its tests passed on (unverified kernels allowed)")
    if do.dtype != q.dtype or do.stride() != q.stride() or do.data_ptr() % 16:
        reasons.append("dO of q's dtype and layout")
    return reasons


def key_tile_table(sched, causal: bool, deterministic: bool) -> torch.Tensor:
    """The tile table of the kernel's key tiles: causal with ordered adds, a block's later key tiles
    first (``_turn``); else its first ones, which under a causal mask visit the most query tiles."""
    return sched.table(late_first=causal and deterministic)


def dkdv_pass_ws(do, q, k, v, lse, delta, dk, dv, dq_sums, sched, scale: float, causal: bool,
                 deterministic: bool = False, dq=None, o=None, unrotate=None) -> None:
    """The dK/dV pass by this kernel: dK, dV written and dQ's terms added to ``dq_sums`` (float32
    ``[T, H, D]``, zeroed), in a fixed order where ``deterministic``; ``dq_sums=None``: no dQ term
    (``WITH_DQ`` off: a dQ pass of its own computes dQ). ``dq`` (q's shape and dtype, with ``dq_sums``
    None; where :func:`stores_dq`): dQ itself stored there (``DQ_STORE``); ``o`` (the forward's output, q's
    layout; with ``dq``, where :func:`computes_delta`): the delta rows computed from it (``DELTA_IN_KERNEL``),
    ``delta`` not read. ``unrotate`` (with ``dq``, where :func:`unrotates`): ``(rope_theta, positions,
    rotary_dim, interleaved)`` of the rotation the caller applied to q and k, which the kernel applies back to dQ
    and dK (``ROT_DIM``); where :func:`pair_chunk` is not 0, q and k come with their channels in that paired-chunk
    order (``reference.paired_chunks``), and dQ and dK go out in their own order. ``sched``: the flash schedule of ``TILE_N``-row key tiles."""
    total, heads, dim = q.shape
    kv_heads = k.shape[1]
    store = dq is not None
    with_dq = dq_sums is not None or store
    ordered = deterministic and with_dq and not store
    table = key_tile_table(sched, causal, ordered)
    counters = torch.zeros((heads, total, 2), dtype=torch.int32, device=q.device) if ordered else table
    sums = dq if store else dq_sums if with_dq else dk
    lag = DQ_LAG and DQ_WRITER and with_dq and dq_cols(dim) < dim and not store
    if dim in PADDED_HEAD_DIMS and not store:
        raise ValueError(f"D {dim}: the kernel pads the head's channels only where it stores dQ (stores_dq)")
    meta = dict(HEAD_DIM=tile_head_dim(dim), DIM=dim, GROUPS=heads // kv_heads, BLOCK_M=query_rows(dim, with_dq),
                BLOCK_N=TILE_N, DQ_COLS=dq_cols(dim), IS_CAUSAL=causal, DETERMINISTIC=ordered,
                DQ_WRITER=dq_cols(dim) == dim if store else DQ_WRITER,
                P_BESIDE_DP=P_BESIDE_DP, WITH_DQ=with_dq, ROWS_BY_LOADER=ROWS_BY_LOADER,
                THREAD_RELEASE=THREAD_RELEASE, DQ_LAG=lag,
                STAGGER=STAGGER and lag, LEAN_WRITER=LEAN_WRITER and dq_cols(dim) < dim and not store,
                DQ_STORE=store, DELTA_IN_KERNEL=o is not None, ROT_DIM=0, INTERLEAVED=False, HAS_POS=False,
                PAIR_CHUNK=0, num_warps=4)
    rope_theta, positions = 1.0, None
    if unrotate is not None:
        rope_theta, positions, rot, interleaved = unrotate
        if not store or not unrotates(TILE_N, dim, rot, interleaved):
            raise ValueError("dQ and dK are rotated back in the kernel only where it stores dQ's column halves and "
                             "each rotary pair lies in one (sm90.flash_bwd.unrotates)")
        meta.update(ROT_DIM=rot, INTERLEAVED=interleaved, HAS_POS=positions is not None,
                    PAIR_CHUNK=pair_chunk(dim, rot, interleaved))
    if o is not None and (not store or o.dtype != q.dtype or o.stride(2) != 1 or o.stride(1) != dim):
        raise ValueError("the delta rows are computed in the kernel only with dQ stored, from O of q's dtype and "
                         "rows of H * D contiguous elements")
    o = q if o is None else o  # (read only with DELTA_IN_KERNEL)
    args = (q, k, v, do, dk, dv, sums, counters, lse, delta, o, table, positions if positions is not None else table,
            math.log2(rope_theta), sched.programs, heads, kv_heads, scale * LOG2E, scale, q.stride(0), k.stride(0), v.stride(0), do.stride(0), dk.stride(0), dv.stride(0), lse.stride(0),
            sums.stride(0), sums.stride(1), 2 * total, o.stride(0))
    launch_bwd((sched.programs * kv_heads,), args, meta, q)
