"""Persistent warp-specialized flash-attention forward for Hopper (sm_90) in Gluon: the partitions
and serial consumer loop of ``flash_fwd``, on one program per SM that takes query tiles in turn.

``flash_fwd`` runs one program per (128-row query tile, query head): each program makes its
tensor maps, waits for its first copies, and stores and exits before the next program on its SM
starts (one fits per SM), so every tile pays that start and end with the tensor cores idle. Here
``min(#SMs, items)`` programs take the items (query tile, query head; the flash tile table's order,
longest sequences first, heads fastest) ``p, p + P, ...``:

- tensor maps over the whole ``[T, H * D]`` row views, made once per partition;
- a one-warp loader copies each item's query tile (two 64-row halves) into one of two query
  buffers (the next item's copies in flight during this one's loop; a buffer is refilled once
  both consumers have released it) and its key tiles' k and v into a ring of ``STAGES`` slots,
  the ring's phases running on across items, k and v on one barrier pair per slot or, with
  ``SPLIT_KV``, each on its own (k freed after the ``Q K^T`` products, v after the ``P V`` ones).
  A block's last key tile, where the block ends inside it, holds the next block's rows: the loader
  waits for that tile's v itself and zeroes its rows past the block before handing it over (the
  scores of those keys are masked, and a NaN or infinity in the next block must not reach this one
  through ``0 * x``);
- two consumer warpgroups (three on 192-row items at full attention with the head dims of
  ``THREE_CONSUMER_HEAD_DIMS``: D 64), one per 64-row part of the query tile, run ``flash_fwd``'s
  serial or overlapped loop per item (``OVERLAP``; which loop and barriers, by head dim and full
  attention or blocks: ``LOOPS``); the output leaves through the dead query part by a TMA store
  where the part lies inside the block, else by masked stores; a consumer releases an item's query
  buffer once its store has had the next item's first key tile to land.

Admitted calls as ``flash_fwd``'s (``flash_ws_reasons``). Taken where ``VERIFIED_ON`` says (or with
unverified kernels allowed) while ``TAKEN`` is set, as it is by default; the benchmark's
``triton_flash[gluon_tiles]`` row clears it to time ``flash_fwd``'s one program per tile beside it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..common.launch import Launcher
from ..common.meta import LOG2E, sm_count
from . import flash_fwd
from .block import _acc_layout, _row_layout, _smem_layout, _store_via
from .flash_fwd import (
    _LN2, CONSUMER_REGS, HALF_M, LOADER_REGS, OVERLAP_CONSUMER_REGS, OVERLAP_LOADER_REGS, STAGES, TILE_M, TILE_N,
    _online_softmax, _release, key_tiles, last_tile_row, outputs_and_table,
)
from .persistent import await_turn, bounded_row_map, drop_ring, drop_turns, init_ring, init_turns, pass_turn

# The generations whose GPU tests this kernel passed (an H100, 2026-12-05: tests/test_triton_flash_interpret.py,
# causal, GQA, blocks of 512, ragged, zero-length and length-1 sequences, a NaN sequence on two programs).
VERIFIED_ON = frozenset({9})
# Whether ``flash_fwd.flash_attention_fwd_ws`` hands its calls to this kernel where it may run
# (``VERIFIED_ON`` or unverified kernels allowed). H100, bf16, D 128, one process, forward ms,
# ``flash_fwd``'s one program per tile / this kernel: seed3 1.136 / 1.083, seed3 causal 0.705 /
# 0.640, seed3 GQA 8 / 2 heads 1.124 / 1.047, prod_full 13.0 / 12.3.
TAKEN = [True]
# Query rows per item at full attention with these head dims: 192 (three consumer warpgroups,
# FlashAttention-3's tile at D 64, where a key tile's softmax is long beside its products and a third
# warpgroup keeps the tensor cores busier), else 128. H100, bf16, seed3_d64, 2026-12-06, forward ms,
# 128-row / 192-row items: H16 1.427, 1.414 / 1.242, 1.242; causal 0.826, 0.839 / 0.813, 0.827; 16 query
# heads on 4 kv heads 1.397, 1.398 / 1.237, 1.238. Blocks keep 128-row items (a 256-token block would
# take 384 rows of 192-row items).
THREE_CONSUMER_HEAD_DIMS = frozenset({64})
# Three consumer warpgroups and the loader's: 3 x 128 x 160 + 128 x 24 registers fit the SM's 65,536.
THREE_CONSUMER_REGS = gl.constexpr(160)
# Key rows per ring slot on 192-row items, by head dim: 128 at D 64; 64 at D 128, where a [64, 128]
# score tile beside the [64, 128] accumulator would not fit 160 registers (ptxas sm_90 with 64-row key
# tiles: 28 B spilled). D 128 on 192-row items is a candidate, not in ``THREE_CONSUMER_HEAD_DIMS`` until
# timed (the benchmark's ``triton_flash[gluon_m192]`` row adds it).
THREE_CONSUMER_KEY_ROWS = {64: TILE_N, 128: 64}
# In the serial loop the consumer warpgroups issue their products in turns, round robin (each ``Q K^T`` and
# each ``P V`` waits for the previous consumer's to have been issued, on the ``turn`` barriers), so one's
# softmax runs under the others' products instead of the warpgroups drifting into their softmax at once
# (FlashAttention-3's inter-warpgroup ping-pong; the e4m3 projection's consumers gained 1.09-1.15x from the
# same order). Measured slower, so off (the benchmark's ``triton_flash[gluon_pingpong]`` row sets it): H100,
# bf16, 2026-12-06, forward ms without / with: seed3 1.093 / 1.090, seed3_d64 1.292 / 1.339, its causal
# 0.842 / 0.880, its GQA 1.260 / 1.328, causal seed3 0.660 / 0.670, GQA seed3 1.040 / 1.066, prod_full
# 12.5 / 12.6, blocks of 256 2.000 / 2.146 (D 128) and 2.169 / 2.264 (D 64), of 512 2.814 / 2.837 and
# 3.505 / 3.632. GPU tests passed (``persistent_pingpong``).
PINGPONG = False
# The consumer loop per (head dim, full attention): ``(OVERLAP, SPLIT_KV)``. ``OVERLAP``: the overlapped loop
# (key tile j + 1's ``Q K^T`` issued with tile j's ``P V``, its softmax while ``P V`` runs), else the
# serial one. ``SPLIT_KV``: a key tile's k and v on barriers of their own, the slot's k released once the
# ``Q K^T`` products are done with it and its v once the ``P V`` products are (FlashAttention-3's separate
# k and v pipelines), else one barrier pair for both. With one pair, two slots and the overlapped loop
# holding tile j's v and tile j + 1's k at once, tile j + 2's copies could start only after both
# consumers' tile-j ``P V``: the overlapped loop starved (it measured slower than the serial one in
# sessions 17 and 44). H100, bf16, 2026-12-06, one process, forward ms, serial / serial split / overlap /
# overlap split: seed3 D128 1.076 / 1.016 / 1.206 / 0.998; its causal 0.657 / 0.655 / 0.760 / 0.605; its
# GQA 8 / 2 1.034 / 1.026 / 1.121 / 0.970; prod_full 12.1 / 12.2 / 13.3 / 11.6; blocks of 256, D128 H2
# 2.142 / 2.283 / 1.977 / 2.313; D64 (192-row items at full attention): seed3_d64 1.233 / 1.208 / 1.298 /
# 1.390, its causal 0.824 / 0.805 / 0.922 / 0.955, 16 / 4 kv heads 1.213 / 1.202 / 1.260 / 1.303; blocks
# of 256, D64 H4 2.153 / 2.078 / 2.329 / 2.326. At blocks with D128 the loop stays serial on one pair: the
# overlapped one on one pair was faster at 256 (1.977-1.988 against 2.059-2.142 over three runs) but slower at
# 512 (2.924 against 2.784). The benchmark's ``triton_flash[gluon_*]`` rows set it per row.
LOOPS = {(128, True): (True, True), (64, True): (False, True),
         (128, False): (False, False), (64, False): (False, True)}


# A block's last key tile, where the block ends inside it, copied from the block's last ``BLOCK_N`` keys
# (the columns already seen masked) instead of from past the block's end, where the next block's rows
# are: the loader no longer waits for that tile's v to land to zero those rows (one copy's latency per
# item, during which it issues nothing); only a block shorter than a tile still goes that way. Taken for
# blocks of ``SHIFT_LAST_BLOCKS[0]``-``[1]`` tokens (full attention is block size 0), serial loops only (in
# the overlapped one at D 128 ptxas spills 324-332 B with it, 8 B without). H100, bf16, prod lengths,
# 2026-12-06, two runs in one process each, forward ms without / with: blocks of 192 D128 H2 2.385, 2.355
# / 2.199, 2.283; D64 H4 2.979, 2.988 / 2.772, 2.775; blocks of 256 D128 2.037, 2.081 / 1.805, 1.789; D64
# 2.185, 2.188 / 2.149, 2.156; blocks of 384 D128 2.270, 2.261 / 2.355, 2.318; D64 2.852, 2.842 / 2.851,
# 2.849; blocks of 512 D128 2.883, 2.845 / 2.859, 2.924; D64 3.562, 3.502 / 3.532, 3.536; full attention,
# seed3_d64 (192-row items) 1.252 / 1.326, its causal 0.786 / 0.832, its 4 kv heads 1.219 / 1.310. The
# benchmark's ``triton_flash[gluon_shift_last]`` row takes it on every call.
SHIFT_LAST_BLOCKS = (1, 256)
# A consumer gives the previous item's query buffer (where that item's output was staged for its TMA store) back
# to the loader once this item's first ``Q K^T`` is done, instead of after the first key tile's ``P V``. On an
# item of one key tile (blocks of up to 128 tokens) the later release left the loader to start the next item's
# query copies only as this item's products ended, so their latency showed between items. A candidate, off
# until timed (the benchmark's ``triton_flash[gluon_early_release]`` row).
EARLY_RELEASE = False
# On items of one key tile (blocks of up to ``TILE_N`` tokens) with grouped query heads, a program takes a block's
# query heads of one kv head one after the other (runs of ``GROUPS`` items, the runs dealt out as single items
# are), and an item whose key tile is the previous item's reuses that ring slot: the loader copies k and v once
# per (block, kv head), not once per query head from L2, and the consumers neither wait for nor release the slot
# in between. Serial loops only. A candidate, off until timed (the benchmark's ``flash_kernels[gluon_share_kv]``
# row). Its first form gave each program a contiguous range of items (every program in another region of
# memory at once) and was slower everywhere: H100, bf16, grid lengths, blocks of 128, with ``EARLY_RELEASE``,
# forward ms without / with: D128 4x1 1.087 / 1.456, 8x2 2.098 / 2.918; D64 4x1 0.680 / 1.068, 8x2 1.345 / 2.115.
SHARE_KV = False
# The consumers hand key and value slots back by every thread's own arrival (``persistent.release_slot``'s
# ``BY_THREADS``: the rings count each consumer's 128 threads) instead of a warpgroup barrier and one elected
# thread's arrival: two warpgroup barriers less per key tile (sm_90 PTX of the D 128 overlapped loop: 48 -> 38 in
# all). A candidate, off until timed (the benchmark's ``triton_flash[gluon_thread_release]`` row).
THREAD_RELEASE = False


def consumer_loop(head_dim: int, block_size: int) -> tuple:
    """``(OVERLAP, SPLIT_KV)`` of a call (``LOOPS``; blocks ``0``: full attention); ``flash_fwd.CONSUMER_LOOP``
    set to "overlap" overlaps everywhere."""
    overlap, split_kv = LOOPS[(head_dim, block_size == 0)]
    return overlap or flash_fwd.overlap_taken(), split_kv


def shift_last_taken(block_size: int) -> bool:
    """Whether a call's blocks of ``block_size`` tokens (0: full attention) take ``SHIFT_LAST`` (``SHIFT_LAST_BLOCKS``;
    serial loops only)."""
    lo, hi = SHIFT_LAST_BLOCKS
    return lo <= block_size <= hi


@gluon.jit
def _item_count(items, GROUPS: gl.constexpr, SHARE_KV: gl.constexpr):
    """How many items this program takes (``_program_item``)."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if SHARE_KV:
        return (items // GROUPS - pid + programs - 1) // programs * GROUPS
    else:
        return (items - pid + programs - 1) // programs


@gluon.jit
def _program_item(i, GROUPS: gl.constexpr, SHARE_KV: gl.constexpr):
    """This program's item ``i``: program ``p`` of ``P`` takes items ``p, p + P, ...``, or with ``SHARE_KV`` the
    runs of ``GROUPS`` items (a block's query heads of one kv head) ``p, p + P, ...``, one run after the other."""
    if SHARE_KV:
        return (gl.program_id(0) + i // GROUPS * gl.num_programs(0)) * GROUPS + i % GROUPS
    else:
        return gl.program_id(0) + i * gl.num_programs(0)


@gluon.jit
def _shares_kv(i, h, tiles, GROUPS: gl.constexpr, SHARE_KV: gl.constexpr):
    """1 where this program's item ``i`` (query head ``h``, ``tiles`` key tiles) takes the key tile of its item
    ``i - 1`` (``SHARE_KV``: one key tile, the same block and kv head), else 0."""
    if SHARE_KV:
        return ((i > 0) & (h % GROUPS != 0) & (tiles == 1)).to(gl.int32)
    else:
        return i * 0


@gluon.jit
def _wait_unless(bar, phase, shared, SHARE_KV: gl.constexpr):
    """Wait for ``bar``'s ``phase`` unless the item reuses the previous item's key tile (``shared``)."""
    if SHARE_KV:
        if shared == 0:
            mbarrier.wait(bar, phase)
    else:
        mbarrier.wait(bar, phase)


@gluon.jit
def _release_unless(empty, s, keep, SHARE_KV: gl.constexpr, BY_THREADS: gl.constexpr):
    """Release slot ``s`` on ``empty`` unless the next item reuses its key tile (``keep``)."""
    if SHARE_KV:
        if keep == 0:
            _release(empty, s, BY_THREADS)
    else:
        _release(empty, s, BY_THREADS)


@gluon.jit
def _item(Table, slots, heads, item, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(start, n, tile_row, h, tiles, unmasked)`` of ``item``: its block's first token and length, the
    query tile's first row in the block, the query head, and its key tiles (``flash_fwd.key_tiles``)."""
    slot = item // heads
    start = gl.load(Table + slot)
    n = gl.load(Table + slots + slot)
    tile_row = gl.load(Table + 3 * slots + slot)
    tiles, unmasked = key_tiles(n, tile_row, BLOCK_M, BLOCK_N, IS_CAUSAL)
    return start, n, tile_row, item % heads, tiles, unmasked


@gluon.jit
def _zero_rows_from(tile, rem, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero the rows ``rem ..`` of the ``[BLOCK_N, HEAD_DIM]`` shared tile, 8 rows at a time (one warp)."""
    layout: gl.constexpr = _row_layout(HEAD_DIM, 1)
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(BLOCK_N // 8):
        if (c + 1) * 8 > rem:
            chunk = tile.slice(c * 8, 8, 0)
            x = chunk.load(layout)
            chunk.store(gl.where(gl.expand_dims(rows + c * 8 < rem, 1), x, 0.0))


@gluon.jit
def _copy_kv(k_map, v_map, coord, bar, k_tile, v_tile, BLOCK_N: gl.constexpr, NBYTES: gl.constexpr):
    """A key tile's k and v into ``k_tile``, ``v_tile`` by TMA, their bytes announced on ``bar``."""
    mbarrier.expect(bar, 2 * BLOCK_N * NBYTES)
    tma.async_copy_global_to_shared(k_map, coord, bar, k_tile)
    tma.async_copy_global_to_shared(v_map, coord, bar, v_tile)


@gluon.jit
def _copy_tile(desc, coord, bar, tile, BLOCK_N: gl.constexpr, NBYTES: gl.constexpr):
    """One ``[BLOCK_N, D]`` tile (k or v) into ``tile`` by TMA, its bytes announced on ``bar``."""
    mbarrier.expect(bar, BLOCK_N * NBYTES)
    tma.async_copy_global_to_shared(desc, coord, bar, tile)


@gluon.jit
def _fix_ragged_v(v_tile, fix, fixes, rem, ready, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A block's ragged last key tile, copied on ``fix``: wait for it, zero its v rows past the block
    (the next block's), and make the slot ready; returns the count of ``fix``'s completed phases."""
    mbarrier.wait(fix, fixes & 1)
    _zero_rows_from(v_tile, rem, BLOCK_N, HEAD_DIM)
    fence_async_shared()
    mbarrier.arrive(ready)
    return fixes + 1


@gluon.jit
def _loader(q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, fix, Q, K, V, Table, slots, heads,
            kv_heads, items, total, stride_qt, stride_kt, stride_vt, HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, SPLIT_KV: gl.constexpr,
            SHIFT_LAST: gl.constexpr, SHARE_KV: gl.constexpr):
    """Loader partition (one warp): per item its query parts into the next query buffer, then its
    key tiles' k and v into the ring (a block's ragged last tile's v through ``fix``, its rows past
    the block zeroed); with ``SPLIT_KV`` k on ``kv_ready`` / ``kv_empty`` and v on ``v_ready`` /
    ``v_empty``; with ``SHIFT_LAST`` a tile past a block of at least ``BLOCK_N`` keys is copied from its
    last ``BLOCK_N`` keys instead, no wait, nothing zeroed (``flash_fwd.last_tile_row``); with ``SHARE_KV``
    no key tile for an item that reuses the previous one's (``_shares_kv``)."""
    q_map = bounded_row_map(Q, total, heads, stride_qt, HALF_M, HEAD_DIM, HEAD_DIM)
    k_map = bounded_row_map(K, total, kv_heads, stride_kt, BLOCK_N, HEAD_DIM, HEAD_DIM)
    v_map = bounded_row_map(V, total, kv_heads, stride_vt, BLOCK_N, HEAD_DIM, HEAD_DIM)
    nbytes: gl.constexpr = HEAD_DIM * q_s.dtype.primitive_bitwidth // 8
    count = _item_count(items, GROUPS, SHARE_KV)
    qi = 0
    it = 0
    fixes = 0
    for i in range(count):
        start, n, tile_row, h, tiles, unmasked = _item(Table, slots, heads, _program_item(i, GROUPS, SHARE_KV),
                                                       BLOCK_M, BLOCK_N, IS_CAUSAL)
        if n > 0:
            b = qi % 2
            mbarrier.wait(q_empty.index(b), ((qi // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(b), BLOCK_M * nbytes)
            for c in gl.static_range(BLOCK_M // HALF_M):
                tma.async_copy_global_to_shared(q_map, [start + tile_row + c * HALF_M, h * HEAD_DIM],
                                                q_ready.index(b), q_s.index(BLOCK_M // HALF_M * b + c))
            col = (h // GROUPS) * HEAD_DIM
            for j in range(tiles * (1 - _shares_kv(i, h, tiles, GROUPS, SHARE_KV))):
                s = it % STAGES
                phase = ((it // STAGES) & 1) ^ 1
                rem = n - j * BLOCK_N
                if SHIFT_LAST:  # a tile past the block's end holds its last keys; only a short block's is fixed
                    coord = [start + last_tile_row(j, n, BLOCK_N), col]
                    ragged = n < BLOCK_N
                else:
                    coord = [start + j * BLOCK_N, col]
                    ragged = rem < BLOCK_N
                mbarrier.wait(kv_empty.index(s), phase)
                if SPLIT_KV:
                    _copy_tile(k_map, coord, kv_ready.index(s), k_s.index(s), BLOCK_N, nbytes)
                    mbarrier.wait(v_empty.index(s), phase)
                    if ragged:
                        _copy_tile(v_map, coord, fix, v_s.index(s), BLOCK_N, nbytes)
                        fixes = _fix_ragged_v(v_s.index(s), fix, fixes, rem, v_ready.index(s), BLOCK_N, HEAD_DIM)
                    else:
                        _copy_tile(v_map, coord, v_ready.index(s), v_s.index(s), BLOCK_N, nbytes)
                elif ragged:
                    _copy_kv(k_map, v_map, coord, fix, k_s.index(s), v_s.index(s), BLOCK_N, nbytes)
                    fixes = _fix_ragged_v(v_s.index(s), fix, fixes, rem, kv_ready.index(s), BLOCK_N, HEAD_DIM)
                else:
                    _copy_kv(k_map, v_map, coord, kv_ready.index(s), k_s.index(s), v_s.index(s), BLOCK_N, nbytes)
                it += 1
            qi += 1


@gluon.jit
def _release_buffer(q_empty, b):
    """The previous item's output store (from query buffer ``b``) has had a key tile's time: the
    buffer goes back to the loader."""
    tma.store_wait(0)
    gl.thread_barrier()
    mbarrier.arrive(q_empty.index(b))


@gluon.jit
def _consumer(half, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse, Table, slots,
              heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
              SPLIT_KV: gl.constexpr, SHIFT_LAST: gl.constexpr, EARLY_RELEASE: gl.constexpr, GROUPS: gl.constexpr,
              SHARE_KV: gl.constexpr, THREAD_RELEASE: gl.constexpr):
    """Consumer partition (one warpgroup): 64-row part ``half`` of each item, ``flash_fwd``'s serial
    loop (with ``PINGPONG`` its products issued in turns with the other consumers', ``persistent.await_turn``),
    or with ``OVERLAP`` its overlapped one (key tile ``j + 1``'s ``Q K^T`` and tile ``j``'s
    ``P V`` issued together, tile ``j + 1``'s softmax while ``P V`` runs); the output through the
    dead half (TMA store inside the block, masked stores past it). With ``SPLIT_KV`` a slot's k is
    released after its ``Q K^T`` and its v (on ``v_ready`` / ``v_empty``) after its ``P V``. The previous item's
    query buffer goes back to the loader after the first key tile's ``P V`` (the overlapped loop: its softmax),
    or with ``EARLY_RELEASE`` its ``Q K^T``. With ``SHARE_KV`` (serial loop) an item that reuses the previous
    item's key tile neither waits for it nor advances the ring, and an item whose key tile the next one reuses
    keeps it."""
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    dtype: gl.constexpr = q_s.dtype
    acc_s: gl.constexpr = _acc_layout(BLOCK_N)
    acc_d: gl.constexpr = _acc_layout(HEAD_DIM)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    o_map = bounded_row_map(O, total, heads, stride_ot, HALF_M, HEAD_DIM, HEAD_DIM)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_s)
    count = _item_count(items, GROUPS, SHARE_KV)
    qi = 0
    it = 0
    g = 0  # products issued (PINGPONG's turns)
    for i in range(count):
        start, n, tile_row, h, tiles, unmasked = _item(Table, slots, heads, _program_item(i, GROUPS, SHARE_KV),
                                                       BLOCK_M, BLOCK_N, IS_CAUSAL)
        shared = _shares_kv(i, h, tiles, GROUPS, SHARE_KV)
        keep = _shares_kv(i + 1, h + 1, tiles, GROUPS, SHARE_KV) * (i + 1 < count).to(gl.int32)
        if n > 0:
            b = qi % 2
            q = q_s.index(BLOCK_M // HALF_M * b + half)
            first = tile_row + half * HALF_M
            rows = first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_s))
            m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, acc_s))
            l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, acc_s))
            acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, acc_d)
            mbarrier.wait(q_ready.index(b), (qi // 2) & 1)
            if OVERLAP:
                s = it % STAGES
                mbarrier.wait(kv_ready.index(s), (it // STAGES) & 1)
                scores = warpgroup_mma(q, k_s.index(s).permute((1, 0)), zero_s, use_acc=False)
                if SPLIT_KV:
                    _release(kv_empty, s, THREAD_RELEASE)
                if EARLY_RELEASE and qi > 0:
                    _release_buffer(q_empty, 1 - b)
                p, alpha, m_i, l_i = _online_softmax(scores, 0, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N,
                                                     IS_CAUSAL, SHIFT_LAST)
                if not EARLY_RELEASE and qi > 0:
                    _release_buffer(q_empty, 1 - b)
                for j in range(tiles - 1):
                    s = it % STAGES
                    t = (it + 1) % STAGES
                    mbarrier.wait(kv_ready.index(t), ((it + 1) // STAGES) & 1)
                    scores = warpgroup_mma(q, k_s.index(t).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    if SPLIT_KV:
                        mbarrier.wait(v_ready.index(s), (it // STAGES) & 1)
                    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc, is_async=True)
                    scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
                    if SPLIT_KV:
                        _release(kv_empty, t, THREAD_RELEASE)
                    p, alpha, m_i, l_i = _online_softmax(scores, j + 1, unmasked, rows, n, m_i, l_i, qk_scale,
                                                         BLOCK_N, IS_CAUSAL, SHIFT_LAST)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _release(v_empty if SPLIT_KV else kv_empty, s, THREAD_RELEASE)
                    it += 1
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_d)), 1)
                s = it % STAGES
                if SPLIT_KV:
                    mbarrier.wait(v_ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc)
                _release(v_empty if SPLIT_KV else kv_empty, s, THREAD_RELEASE)
                it += 1
            else:
                for j in range(tiles):
                    s = (it - shared) % STAGES
                    _wait_unless(kv_ready.index(s), (it // STAGES) & 1, shared, SHARE_KV)
                    if PINGPONG:
                        await_turn(turn, half, g)
                        scores = warpgroup_mma(q, k_s.index(s).permute((1, 0)), zero_s, is_async=True)
                        pass_turn(turn, half, CONSUMERS)
                        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
                        g += 1
                    else:
                        scores = warpgroup_mma(q, k_s.index(s).permute((1, 0)), zero_s)
                    if SPLIT_KV:
                        _release_unless(kv_empty, s, keep, SHARE_KV, THREAD_RELEASE)
                    if EARLY_RELEASE and j == 0 and qi > 0:
                        _release_buffer(q_empty, 1 - b)
                    p, alpha, m_i, l_i = _online_softmax(scores, j, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N,
                                                         IS_CAUSAL, SHIFT_LAST)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_d)), 1)
                    if SPLIT_KV:
                        _wait_unless(v_ready.index(s), (it // STAGES) & 1, shared, SHARE_KV)
                    if PINGPONG:
                        await_turn(turn, half, g)
                        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc, is_async=True)
                        pass_turn(turn, half, CONSUMERS)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                        g += 1
                    else:
                        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc)
                    _release_unless(v_empty if SPLIT_KV else kv_empty, s, keep, SHARE_KV, THREAD_RELEASE)
                    it += 1 - shared
                    if not EARLY_RELEASE and j == 0 and qi > 0:
                        _release_buffer(q_empty, 1 - b)
            o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, acc_d)), 1)
            if first + HALF_M <= n:
                q.store(o.to(dtype))  # the query half is dead: its tile stages the output
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(o_map, [start + first, h * HEAD_DIM], q)
            else:
                _store_via(q, O + h * HEAD_DIM, o, start + first, n - first, stride_ot, HALF_M, HEAD_DIM)
            gl.store(Lse + h * stride_lh + start + rows, (m_i + gl.log2(l_i)) * _LN2, mask=rows < n)
            qi += 1
    tma.store_wait(0)
    gl.thread_barrier()
    if qi > 0:
        mbarrier.arrive(q_empty.index((qi - 1) % 2))


@gluon.jit(do_not_specialize=["slots", "heads", "kv_heads", "items", "total", "qk_scale", "stride_lh"])
def _flash_fwd_persistent_kernel(
    Q, K, V, O, Lse, Table, slots, heads, kv_heads, items, total, qk_scale, stride_qt, stride_kt, stride_vt,
    stride_ot, stride_lh, HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
    SPLIT_KV: gl.constexpr, SHIFT_LAST: gl.constexpr, EARLY_RELEASE: gl.constexpr, SHARE_KV: gl.constexpr,
    THREAD_RELEASE: gl.constexpr,
):
    gl.static_assert((BLOCK_M == 2 * HALF_M) or (BLOCK_M == 3 * HALF_M), "two or three consumer warpgroups")
    gl.static_assert(not (OVERLAP and PINGPONG), "turns in the serial loop only")
    gl.static_assert(not (OVERLAP and SHARE_KV), "key tiles shared by items in the serial loop only")
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    dtype: gl.constexpr = Q.dtype.element_ty
    layout: gl.constexpr = _smem_layout(HEAD_DIM)
    q_s = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, HALF_M, HEAD_DIM], layout)  # two buffers of parts
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # SPLIT_KV's
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    fix = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # PINGPONG's, one per consumer
    init_ring(q_ready, q_empty, 2, CONSUMERS)  # a query buffer is free once every consumer is done with it
    init_ring(kv_ready, kv_empty, STAGES, CONSUMERS, THREAD_RELEASE)
    if SPLIT_KV:
        init_ring(v_ready, v_empty, STAGES, CONSUMERS, THREAD_RELEASE)
    mbarrier.init(fix.index(0), count=1)
    if PINGPONG:
        init_turns(turn, CONSUMERS)
    # One call per consumer count: the Gluon frontend takes the partition and register lists only as literals.
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse,
                         Table, slots, heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM, BLOCK_M, BLOCK_N,
                         IS_CAUSAL, OVERLAP, PINGPONG, SPLIT_KV, SHIFT_LAST, EARLY_RELEASE, GROUPS, SHARE_KV,
                         THREAD_RELEASE)),
            (_consumer, (1, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse,
                         Table, slots, heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM, BLOCK_M, BLOCK_N,
                         IS_CAUSAL, OVERLAP, PINGPONG, SPLIT_KV, SHIFT_LAST, EARLY_RELEASE, GROUPS, SHARE_KV,
                         THREAD_RELEASE)),
            (_consumer, (2, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse,
                         Table, slots, heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM, BLOCK_M, BLOCK_N,
                         IS_CAUSAL, OVERLAP, PINGPONG, SPLIT_KV, SHIFT_LAST, EARLY_RELEASE, GROUPS, SHARE_KV,
                         THREAD_RELEASE)),
            (_loader, (q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, fix.index(0), Q, K, V,
                       Table, slots, heads, kv_heads, items, total, stride_qt, stride_kt, stride_vt, HEAD_DIM, GROUPS,
                       BLOCK_M, BLOCK_N, IS_CAUSAL, SPLIT_KV, SHIFT_LAST, SHARE_KV)),
        ], [4, 4, 1], [THREE_CONSUMER_REGS, THREE_CONSUMER_REGS, OVERLAP_LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse,
                         Table, slots, heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM, BLOCK_M, BLOCK_N,
                         IS_CAUSAL, OVERLAP, PINGPONG, SPLIT_KV, SHIFT_LAST, EARLY_RELEASE, GROUPS, SHARE_KV,
                         THREAD_RELEASE)),
            (_consumer, (1, q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, turn, O, Lse,
                         Table, slots, heads, items, total, qk_scale, stride_ot, stride_lh, HEAD_DIM, BLOCK_M, BLOCK_N,
                         IS_CAUSAL, OVERLAP, PINGPONG, SPLIT_KV, SHIFT_LAST, EARLY_RELEASE, GROUPS, SHARE_KV,
                         THREAD_RELEASE)),
            (_loader, (q_s, k_s, v_s, q_ready, q_empty, kv_ready, kv_empty, v_ready, v_empty, fix.index(0), Q, K, V,
                       Table, slots, heads, kv_heads, items, total, stride_qt, stride_kt, stride_vt, HEAD_DIM, GROUPS,
                       BLOCK_M, BLOCK_N, IS_CAUSAL, SPLIT_KV, SHIFT_LAST, SHARE_KV)),
        ], [4, 1], [OVERLAP_CONSUMER_REGS if OVERLAP else CONSUMER_REGS,
                    OVERLAP_LOADER_REGS if OVERLAP else LOADER_REGS])
    drop_ring(q_ready, q_empty, 2)
    drop_ring(kv_ready, kv_empty, STAGES)
    if SPLIT_KV:
        drop_ring(v_ready, v_empty, STAGES)
    mbarrier.invalidate(fix.index(0))
    if PINGPONG:
        drop_turns(turn, CONSUMERS)


launch = Launcher(_flash_fwd_persistent_kernel, scratch=True)


def taken(device: torch.device) -> bool:
    """Whether ``flash_fwd.flash_attention_fwd_ws`` hands its calls on ``device`` to this kernel (not
    while ``flash_fwd.CONSUMER_LOOP`` asks for ping-pong, which only the per-tile kernel has)."""
    from ..block.variants import taken_on

    return TAKEN[0] and not flash_fwd.pingpong_taken() and taken_on(device, VERIFIED_ON)


def item_tile(head_dim: int, block_size: int) -> tuple:
    """``(query rows per item, key rows per ring slot)``: three 64-row consumer parts at full attention
    (``block_size`` 0) with the head dims of ``THREE_CONSUMER_HEAD_DIMS`` (key rows as
    ``THREE_CONSUMER_KEY_ROWS`` says), else two and ``TILE_N``."""
    if block_size == 0 and head_dim in THREE_CONSUMER_HEAD_DIMS:
        return 3 * HALF_M.value, THREE_CONSUMER_KEY_ROWS[head_dim]
    return TILE_M, TILE_N


def flash_attention_fwd_persistent(q, k, v, offsets, block_size: int, scale: float, causal: bool, cpu_offsets=None):
    """``(o [T, H, D], lse [H, T])`` as ``flash_fwd.flash_attention_fwd_ws`` computes them, by this
    kernel (the caller checks ``flash_fwd.flash_ws_reasons`` first)."""
    total, heads, dim = q.shape
    tile_m, tile_n = item_tile(dim, block_size)
    o, lse, sched, table = outputs_and_table(q, offsets, block_size, cpu_offsets, tile_m)
    if table is None:
        return o, lse
    items = sched.programs * heads
    overlap, split_kv = consumer_loop(dim, block_size)
    overlap = overlap and tile_m == TILE_M  # three consumers' registers do not hold the overlapped loop's tiles
    meta = dict(HEAD_DIM=dim, GROUPS=heads // k.shape[1], BLOCK_M=tile_m, BLOCK_N=tile_n, IS_CAUSAL=causal,
                OVERLAP=overlap, PINGPONG=PINGPONG and not overlap, SPLIT_KV=split_kv,
                SHIFT_LAST=shift_last_taken(block_size) and not overlap, EARLY_RELEASE=EARLY_RELEASE,
                SHARE_KV=SHARE_KV and not overlap and q.shape[1] > k.shape[1] and 0 < block_size <= tile_n,
                THREAD_RELEASE=THREAD_RELEASE, num_warps=4)
    args = (q, k, v, o, lse, table, sched.programs, heads, k.shape[1], items, total, scale * LOG2E,
            q.stride(0), k.stride(0), v.stride(0), o.stride(0), lse.stride(0))
    launch((min(items, sm_count(q.device)),), args, meta, q)
    return o, lse
