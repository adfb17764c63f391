"""Launch plans of the block kernels: constexprs, tile rows, grid and register caps per variant
(no ``@triton.jit`` code)."""
from __future__ import annotations

from typing import Optional

import torch

from blockattn_layers.runtime.caches import HostCache

from ..common.meta import device_major, input_precision, max_shared_memory, num_warps, sm_count, static_meta, tile_extent
from .variants import Variant

# Register caps (ptxas ``maxnreg``) of the simple block kernels. The forward's rotary kv-head loop
# (D <= 64, see ``block.fwd``) needs 128 to fit 4 programs per SM on every generation (tiles of
# up to 64 rows). The others
# were measured on the H200 (sm_90, bf16, 64-row tiles, prod shapes, one query head per kv head)
# and apply there, keyed (backward, BLOCK_D, rotary):
# - rotary forward, D = 128: 104 (110 without; 8 bytes spilled): 1.319 -> 1.283 ms (96: 1.49 ms);
# - rotary backward, D = 64: 128 (140 without at the time, 128 since dV is stored early; 3 -> 4
#   programs per SM): 2.774 -> 2.673 ms;
# - plain backward, D = 128: 168 (180 without; 4 bytes spilled; 2 -> 3 programs per SM, which
#   shared memory allows): 2.582 -> 2.397 ms;
# - plain forward, D = 64: 72 (80 without; 16 bytes spilled; 6 -> 7 programs per SM): 1.199 ->
#   1.184 ms (64: 1.519 ms).
HEAD_LOOP_MAXNREG = 128
# The hopper kernels' caps at 64-row tiles (128-row ones: the two caps after this one, else
# ptxas's choice), keyed as ``_SM90_MAXNREG`` (one query head per kv head); none measured faster (H200, prod shapes: 168 and 128 on the backward, ms, uncapped -> capped: D128
# 2.042 -> 2.042 / 2.086, D64 2.245 -> 2.244 / 2.243, rotary D128 2.523 -> 2.534 / 2.533, rotary
# D64 2.450 -> 2.463 / 2.571). Their rotary kv-head loop takes ``HEAD_LOOP_MAXNREG`` (168 without,
# no spills at 128: rotary D64 forward 1.186 -> 1.164 ms). The rotary D128 backward, its gradients
# rotated back 32 rows at a time from shared memory (``sm90.block._unrotate_store``), needs 178
# registers uncapped and 168 with 16 bytes spilled: 3 programs per SM instead of 2.
HOPPER_MAXNREG: dict = {(True, 128, True): 168}
# The hopper forward of grouped query heads on 128-row tiles of D <= 64 (the group's loop in one
# program): ptxas takes 138-201 registers at D64 or with causal or rotary, one 8-warp program per
# SM; capped at 128 (no spills at D32, 4-96 bytes at D64), two. H200, bf16, grid lengths, ms
# uncapped -> capped (session 24): 8x2 D32 1.385 -> 1.123, causal 1.514 -> 1.120, rotary 1.666 ->
# 1.187; 8x2 D64 1.789 -> 1.237, causal 1.788 -> 1.402; 4x1 D64 0.919 -> 0.755.
HOPPER_GROUP_LOOP_MAXNREG = 128
# The hopper backward of one query head per kv head on 128-row tiles of D32, and of D64 with rotary:
# ptxas takes 170-189 registers, one 8-warp program per SM; capped at 128 (156-240 bytes spilled),
# two. H200, bf16, grid lengths, 2x2 heads, ms uncapped -> capped (session 24): D32 0.836 -> 0.723,
# causal 0.868 -> 0.833, rotary 0.959 -> 0.802; D64 rotary 1.185 -> 1.089; D64 without rotary
# 0.996 -> 1.013 and causal 1.018 -> 1.028 (slower: not capped).
HOPPER_TILE128_BWD_MAXNREG = 128
# The hopper forward of grouped query heads with rotary at D128 (its angles computed for each head,
# each head's output stored by halves through its q tiles: ``sm90.block._rotary_group_fwd_d128``),
# keyed by tile rows: 172 registers and 64 KB of shared memory at 64 rows, capped at 168 (no
# spills) 3 programs per SM instead of 2; 215 at 128 rows, capped at 128 (156 bytes spilled) 2
# instead of 1. H200, bf16, grid lengths, ms before -> after (session 25): block 64 4x1 0.873 ->
# 0.744, causal 0.872 -> 0.755, 8x2 1.741 -> 1.596; block 128 4x1 1.443 -> 1.194.
HOPPER_ROTARY_GROUP_FWD_MAXNREG = {64: 168, 128: 128}
# The hopper rotary forward of one query head per kv head on 128-row tiles: 139-248 registers (the
# kv-head loop at D32 / D64), one 8-warp program per SM; capped at 128 (0-112 bytes spilled), two.
# H200, bf16, grid lengths, 2x2 heads, ms uncapped -> capped (session 25): D32 0.389 -> 0.285, D64
# 0.500 -> 0.412, D128 0.967 -> 0.700; D64 causal 0.525 -> 0.580 (slower: not capped).
HOPPER_TILE128_ROTARY_FWD_MAXNREG = 128
# The hopper forward that also stores the logsumexp on 128-row tiles of D 65-128 without rotary (grouped query
# heads there save it for the flash backward with dQ stored): ptxas sm_90 takes 157-186 registers against the
# forward's 122 without it, one 8-warp program per SM instead of two (H100, bf16, block 128 D128, grid lengths, ms
# with / without the store: 8x2 3.37 / 2.10, 4x1 1.68 / 1.06); capped at 128: 0-32 bytes spilled, two. With
# the logsumexp stored from the scores' row layout (session 55): 154-171 uncapped, 0-24 bytes spilled at 128.
HOPPER_TILE128_LSE_FWD_MAXNREG = 128
# Whether the hopper forward takes 128-row tiles of head dims 144-256 without rotary in 64-channel chunks
# (``sm90.chunked``: 96 KB of shared memory against 192 KB whole, so two programs share an SM), capped at
# ``HOPPER_CHUNKED_FWD_MAXNREG`` registers so that both fit (ptxas sm_90, D256: 114-126 registers, no spills).
# H100, bf16, grid lengths, block 128, D256, forward ms chunked / whole (hopper forced; session 61): 8x2 3.642 /
# 4.966, causal 3.648 / 5.155; 4x1 1.820 / 2.429, causal 1.827 / 2.489 (1.02x the floor; simple, which auto took
# for grouped query heads there, 5.42-5.56 and 2.71-2.74); 2x2 1.442 / 1.432, causal 1.441 / 1.439 (the same).
CHUNKED_WIDE_FWD = True
HOPPER_CHUNKED_FWD_MAXNREG = 128
# The hopper forward of grouped query heads on 64-row tiles (the group's loop in one program), keyed
# (BLOCK_D, causal, rotary; with rotary at D128 ``HOPPER_ROTARY_GROUP_FWD_MAXNREG`` applies). ptxas sm_90,
# bf16, without rotary: D32 80 registers (6 programs of 4 warps per SM), causal 96 (5); D64 94 (5), causal 102
# (4). Causal D32 capped at 80: 73 registers, no spills, 6 programs.
# H100, bf16, grid lengths, block 64, one process per setting, forward ms uncapped / capped (2026-12-06):
# D32 causal 4x1 0.2732, 0.2723 / 0.2445; 8x2 0.5419, 0.5420 / 0.5003 (1.21x -> 1.09x floor); not taken:
# causal D64 at 96 (93 registers, 5 programs) 0.4712 / 0.4747 (4x1) and 0.9662 / 0.9716 (8x2); D64 without
# causal at 80 (36 B spilled, 6 programs) 0.4742 / 0.4948 and 0.9713 / 1.0061.
# With rotary (every form: split halves, interleaved pairs, partial; ptxas, 4 query heads per kv head): D32 causal
# 109 registers (4 programs) -> 80 at 80 (0-16 B spilled, 6); D64 128-142 (3-4) -> 116-124 at 128, no spills (4).
# H100, bf16, grid lengths, split rotary, one process per setting, forward ms uncapped / capped (2026-12-06):
# D32 causal 4x1 0.314 / 0.283, 8x2 0.625 / 0.554; D64 4x1 0.474 / 0.474, causal 0.490 / 0.475; 8x2 0.973 /
# 0.972, causal 0.989 / 0.972. 4x1, interleaved: D32 causal 0.369 / 0.333, D64 0.599 / 0.536, causal 0.596 /
# 0.541; partial (half the channels): D32 causal 0.339 / 0.311, D64 0.494 / 0.495, causal 0.506 / 0.494.
HOPPER_GROUP_FWD_MAXNREG = {(32, True, False): 80, (32, True, True): 80, (64, False, True): 128, (64, True, True): 128}
# hopper_packed (tiles of blocks of up to 32 tokens), keyed (backward, BLOCK_D, rotary), one query head per kv
# head: the D128 backward needs 172 registers (its NaN check and the tile's row vectors; hopper's
# needs 158), 2 programs per SM where 168 fits 3 beside 72 KB of shared memory.
# The D32 backward without rotary: 97 registers (4 programs) -> 96 at 96 (8 B spilled, 5). H100, bf16, grid
# lengths, 2x2 heads, one process per setting, two runs each, backward ms uncapped / capped (2026-12-06): blocks of
# 32 0.416, 0.416 / 0.400, 0.400; causal blocks of 16 0.472, 0.472 / 0.430, 0.430; of 32 0.420, 0.419 / 0.402,
# 0.402. With rotary: 115-118 registers (4) -> 96 at 96 (28-36 B spilled, 5); split halves, blocks of 16 / 32
# (session 50): 0.567 -> 0.456 (32), causal 0.642 -> 0.516, 0.574 -> 0.458; interleaved 0.700 -> 0.572, 0.621 ->
# 0.520, causal 0.701 -> 0.567, 0.633 -> 0.522.
PACKED_HOPPER_MAXNREG: dict = {(True, 128, False): 168, (True, 128, True): 168, (True, 32, False): 96,
                               (True, 32, True): 96}
# hopper_packed's forward of grouped query heads, keyed (BLOCK_D, causal, SLOT, rotary). ptxas sm_90,
# bf16, 4 query heads per kv head, registers uncapped -> capped (no spills), programs of 4 warps per SM: D32 88
# / 96 causal (5) -> 72 / 80 at 80 (7 / 6); D64 105 / 117 (4) -> 96 / 95 at 96 (5); D128 causal 174 (2) -> 161
# at 168 (3). H100, bf16, grid lengths, one process per setting, forward ms uncapped (two processes) / capped
# (2026-12-06): D32 blocks of 16 4x1 0.290, 0.290 / 0.276, causal 0.322, 0.324 / 0.280, 8x2 0.575, 0.576 /
# 0.541, causal 0.638, 0.631 / 0.555; blocks of 32 4x1 0.267, 0.268 / 0.254, causal 0.295, 0.295 / 0.263, 8x2
# 0.528, 0.529 / 0.505, causal 0.586, 0.583 / 0.518; D64 causal blocks of 16 4x1 0.500, 0.502 / 0.474, 8x2
# 1.000, 1.004 / 0.971. Not taken: D64 without causal (0.4735 / 0.4744 at blocks of 16) and at blocks of 32
# (0.470-0.471 / 0.474-0.475 4x1), D128 causal at 168 (0.917 / 0.923 4x1 at blocks of 32, 1.833 / 1.854 8x2).
# With rotary (every form; ptxas, 4 query heads per kv head): D32 101-116 registers (4 programs) -> 93-96 at 96, no
# spills (5); D64 147-162 (3) -> 128 at 128, 0-16 B spilled (4). H100, bf16, grid lengths, split rotary, one
# process per setting, forward ms uncapped / capped (2026-12-06): D32 blocks of 16 4x1 0.368 / 0.340, causal
# 0.428 / 0.347, 8x2 causal 0.849 / 0.692; blocks of 32 4x1 0.337 / 0.313, causal 0.339 / 0.319, 8x2 0.668 /
# 0.618, causal 0.672 / 0.629; D64 blocks of 16 4x1 0.566 / 0.511, causal 0.699 / 0.522, 8x2 1.127 / 1.022,
# causal 1.389 / 1.034; blocks of 32 4x1 0.532 / 0.486, causal 0.536 / 0.488, 8x2 1.060 / 0.979, causal 1.066 /
# 0.986. 4x1, blocks of 16 / 32, interleaved: D32 0.430 / 0.409 -> 0.385 / 0.373, causal 0.507 / 0.417 -> 0.396 /
# 0.380; D64 0.672 / 0.641 -> 0.591 / 0.566, causal 0.698 / 0.648 -> 0.611 / 0.574; partial: D32 0.402 / 0.368 ->
# 0.375 / 0.344, causal 0.457 / 0.371 -> 0.381 / 0.348; D64 0.585 / 0.555 -> 0.537 / 0.505, causal 0.731 / 0.559
# -> 0.538 / 0.514.
PACKED_HOPPER_GROUP_FWD_MAXNREG = {
    (32, False, 16, False): 80, (32, True, 16, False): 80, (32, False, 32, False): 80, (32, True, 32, False): 80,
    (64, True, 16, False): 96,
    **{(dim, causal, slot, True): {32: 96, 64: 128}[dim] for dim in (32, 64) for causal in (False, True)
       for slot in (16, 32)},
}
# The backwards of grouped query heads, hopper's on 64-row tiles keyed (BLOCK_D, causal, rotary), hopper_packed's
# keyed (BLOCK_D, causal, SLOT, rotary). H100, bf16, 4x1, grid lengths, one process per setting (session 49: two
# of each; session 50: one uncapped, two capped), backward ms uncapped / capped (ptxas sm_90: registers uncapped ->
# capped, programs per SM):
# - hopper D32 causal without rotary at 160 (179, 2 -> 3), block 64: 0.682, 0.681 / 0.545, 0.545 (session 49);
# - hopper D32 split rotary at 168 (219-234, 2 -> 3; 120-156 B spilled), block 64: 0.696 / 0.643, 0.646, causal
#   0.695 / 0.643, 0.640 (session 50);
# - hopper_packed D32 split rotary at 168 (248-255, 2 -> 3; 104-180 B), blocks of 16: 0.881 / 0.757, 0.752, causal
#   0.888 / 0.750, 0.756; of 32: 0.828 / 0.724, 0.724, causal 0.817 / 0.728, 0.728 (session 50);
# - hopper_packed D32 without rotary at 160 (193-205, 2 -> 3): uncapped slower than simple, capped faster (see
#   ``variants._hopper_packed_auto_reasons``; session 50).
# Slower capped (session 50): hopper D32 without causal at 128 (164, 3 -> 4, 96 B spilled): 0.550 -> 0.578, 0.579;
# hopper D64 at 168 (239-247, 2 -> 3, 188-208 B): 0.770 -> 0.985, 0.986, causal 0.771 -> 0.949, 0.949.
HOPPER_GROUP_BWD_MAXNREG: dict = {(32, True, False): 160, (32, False, True): 168, (32, True, True): 168}
PACKED_HOPPER_GROUP_BWD_MAXNREG: dict = {(32, causal, slot, rotary): 168 if rotary else 160
                                         for causal in (False, True) for slot in (16, 32) for rotary in (False, True)}
_SM90_MAXNREG = {
    (False, 128, True): 104, (True, 64, True): 128, (True, 128, False): 168, (False, 64, False): 72,
}
# Launch options, beside the kernels' own constexprs, that a plan may hold.
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def head_loop(meta: dict, variant: str) -> bool:
    """Whether a forward launch loops over the kv heads in each program (``HEAD_LOOP``): rotary at
    D <= 64, simple kernels, or hopper ones with one query head per kv head."""
    return (meta["ROT_DIM"] > 0 and meta["BLOCK_D"] <= 64
            and (variant == "simple" or (variant == "hopper" and meta["GROUPS"] == 1)))


def max_registers(meta: dict, variant: Variant, backward: bool, major: int, itemsize: int,
                  stores_lse: bool = False) -> Optional[int]:
    """The ``maxnreg`` launch option of a block kernel, or None for ptxas's own choice (``stores_lse``: the
    forward that also stores the logsumexp)."""
    if variant.maxnreg is not None:
        return variant.maxnreg
    if variant.name == "hopper_packed":
        if meta["GROUPS"] == 1:
            return PACKED_HOPPER_MAXNREG.get((backward, meta["BLOCK_D"], meta["ROT_DIM"] > 0))
        if not backward:
            key = (meta["BLOCK_D"], bool(meta["IS_CAUSAL"]), meta["SLOT"], meta["ROT_DIM"] > 0)
            return PACKED_HOPPER_GROUP_FWD_MAXNREG.get(key)
        return PACKED_HOPPER_GROUP_BWD_MAXNREG.get((meta["BLOCK_D"], bool(meta["IS_CAUSAL"]), meta["SLOT"],
                                                    meta["ROT_DIM"] > 0))
    if variant.name == "hopper":
        rotary_fwd = not backward and meta["ROT_DIM"] > 0
        if rotary_fwd and meta["GROUPS"] > 1 and meta["BLOCK_D"] == 128:
            return HOPPER_ROTARY_GROUP_FWD_MAXNREG[meta["BLOCK_M"]]
        if meta["BLOCK_M"] != 64:
            if chunked_channels(meta, variant, backward):
                return HOPPER_CHUNKED_FWD_MAXNREG
            if rotary_fwd and meta["GROUPS"] == 1 and meta["BLOCK_D"] <= 128:
                slower = meta["BLOCK_D"] == 64 and meta["IS_CAUSAL"]
                return None if slower else HOPPER_TILE128_ROTARY_FWD_MAXNREG
            if stores_lse and not backward and meta["BLOCK_D"] == 128 and meta["ROT_DIM"] == 0:
                return HOPPER_TILE128_LSE_FWD_MAXNREG
            if meta["BLOCK_D"] > 64:
                return None
            if backward:
                capped = meta["GROUPS"] == 1 and (meta["BLOCK_D"] == 32 or meta["ROT_DIM"] > 0)
                return HOPPER_TILE128_BWD_MAXNREG if capped else None
            return HOPPER_GROUP_LOOP_MAXNREG if meta["GROUPS"] > 1 else None
        if not backward and head_loop(meta, variant.name):
            return HEAD_LOOP_MAXNREG
        if not backward and meta["GROUPS"] > 1:
            return HOPPER_GROUP_FWD_MAXNREG.get((meta["BLOCK_D"], bool(meta["IS_CAUSAL"]), meta["ROT_DIM"] > 0))
        if backward and meta["GROUPS"] > 1:
            return HOPPER_GROUP_BWD_MAXNREG.get((meta["BLOCK_D"], bool(meta["IS_CAUSAL"]), meta["ROT_DIM"] > 0))
        return HOPPER_MAXNREG.get((backward, meta["BLOCK_D"], meta["ROT_DIM"] > 0)) if meta["GROUPS"] == 1 else None
    if not backward and head_loop(meta, variant.name):
        # (At 128-row tiles the scores alone take 128 registers: capped, the loop spilled and ran
        # 9-11x its floor on the H200 grid, D32 / D64 with grouped-query heads.)
        return HEAD_LOOP_MAXNREG if meta["BLOCK_M"] <= 64 else None
    if major != 9 or variant.name != "simple" or meta["BLOCK_M"] != 64 or itemsize != 2 or meta["GROUPS"] != 1:
        return None
    return _SM90_MAXNREG.get((backward, meta["BLOCK_D"], meta["ROT_DIM"] > 0))


def split_groups(meta: dict, variant: Variant, backward: bool) -> bool:
    """Whether a hopper forward of grouped query heads runs one program per query head
    (``SPLIT_GROUPS``; the group's programs adjacent in launch order, so its k and v come from L2
    after the first read) instead of one per kv head looping over its group. H200, bf16, 8x2 heads,
    grid lengths, causal no, ms (split / grouped): faster at 128-row tiles of D 96-128 without rotary
    (D96 2.056 / 2.435, D128 2.059 / 2.577) and at D256 with 64-row tiles (3.384 / 3.693); slower
    everywhere else, 1.1-2x at blocks of 16 and 32 (each program's fixed costs, k rotated once per
    query head)."""
    if backward or meta["GROUPS"] == 1 or meta["HEAD_LOOP"] or variant.name != "hopper":
        return False
    return meta["BLOCK_D"] == 256 or (meta["BLOCK_M"] == 128 and meta["BLOCK_D"] == 128 and meta["ROT_DIM"] == 0)


def chunked_channels(meta: dict, variant: Variant, backward: bool) -> bool:
    """Whether a hopper forward runs its 128-row tiles in 64-channel chunks (``CHUNKED``, ``sm90.chunked``):
    head dims 144-256 (256-wide tiles) without rotary, one query head per program (grouped query heads
    split, :func:`split_groups`), while ``CHUNKED_WIDE_FWD`` is set."""
    return (CHUNKED_WIDE_FWD and variant.name == "hopper" and not backward and meta["BLOCK_M"] == 128
            and meta["BLOCK_D"] == 256 and meta["ROT_DIM"] == 0 and not meta.get("SLOT") and not meta.get("HEAD_LOOP"))


def group_sums_in_launch(variant: Variant, rot: int) -> bool:
    """Whether a backward launched one query head per program (``Variant.group_partials``) on a
    kernel that can (``Variant.sums_in_launch``: ``sm90.wide``, whose launch then always takes a
    block's programs adjacent) sums the group's dK and dV in the launch (``sm90.group_sums``) rather
    than by the pass after it: without rotary. H200, bf16, grid lengths, ``hopper_wide``, ms (head-
    major order with the pass after / adjacent with the pass after / adjacent with the sums in the
    launch; the first and last in one process, each twice, bitwise the same gradients; the middle in
    another): D256 4x1 7.78 / 7.40 / 7.35, 8x2 17.05 / 15.64 / 14.91; split rotary 4x1 9.00 / 8.47 /
    9.80, 8x2 20.85 / 19.53 / 21.46; interleaved 4x1 10.02 / 9.50 / 10.27, 8x2 22.29 / 20.94 /
    24.84; D192 4x1 6.61 / - / 6.73, causal 6.63 / - / 6.47. (Not from spills: ptxas, D256 with the
    adjacent order, bytes spilled without / with the sums: 392 / 600, split rotary 464 / 580; not
    profiled further.)"""
    return variant.sums_in_launch and rot == 0


def overlap_products(meta: dict, variant: Variant, backward: bool) -> bool:
    """Whether a hopper backward of grouped query heads without rotary on 64-row tiles of D <= 64
    keeps each head's independent products in flight together (``OVERLAP``). H200, bf16, grid
    lengths, heads 8x2 and 4x1, causal or not, one process (ms, overlapped / serial): block 64
    faster at all 8 points (D64 8x2 1.658 / 1.716, D32 8x2 1.216 / 1.305); hopper_packed (blocks of
    16 and 32) slower at 8 of 16 (D32 8x2 block 32 1.897 / 1.760), so only ``hopper``."""
    return (backward and meta["GROUPS"] > 1 and meta["ROT_DIM"] == 0 and meta["BLOCK_M"] == 64
            and meta["BLOCK_D"] <= 64 and variant.name == "hopper")


def simple_backward_warps(meta: dict) -> int:
    """Warps of the simple kernels' backward. With grouped query heads, 8 on tiles of 64 and 128
    rows, where the dK and dV accumulators live across the group's loop beside k and v (H200, bf16,
    grid lengths, ms, 4 -> 8 warps: block 64 D96 rotary 4x1 5.89 -> 3.25, 8x2 11.95 -> 6.63; block
    128 D32 4x1 2.08 -> 1.45, rotary 2.90 -> 1.79; D64 4x1 3.77 -> 1.84, causal 3.29 -> 1.91), and on
    32-row tiles of D256 with rotary (4x1 7.31 -> 6.05); else ``common.meta.num_warps``'s (4 on the
    other 16- and 32-row tiles: 8 were 1.1-3x slower at every D 32-256 measured; one query head per
    kv head: 8 no faster, block 64 D96 rotary 2x2 1.75 / 1.74, block 128 D64 1.38 / 1.41)."""
    if meta["GROUPS"] > 1 and (meta["BLOCK_M"] >= 64 or (meta["BLOCK_M"] == 32 and meta["BLOCK_D"] >= 256
                                                          and meta["ROT_DIM"] > 0)):
        return max(8, meta["num_warps"])
    return meta["num_warps"]


def keys_backward_options(meta: dict, dtype: torch.dtype, on_cuda: bool) -> dict:
    """Launch options of the ``keys`` backward (``block.bwd_keys``): one warpgroup per 64 key rows
    (its products but dQ's have the keys as their M side), and on a GPU the loop over (query head,
    query tile) pipelined two deep on 16-bit tiles (the next tile's q and dO copies in flight)."""
    stages = 2 if dtype.itemsize == 2 and on_cuda else 1
    return dict(num_warps=meta["BLOCK_M"] // 16, num_stages=stages)


# float32 tiles of at most this many elements (``BLOCK_M x BLOCK_D``) fit a program's shared memory,
# forward and backward. Larger ones did not on the H200 with IEEE products either, whose layout
# conversions stage there (Triton 3.6; backward 64 x 256 272 KB with grouped-query heads, 128 x 128
# 320 KB, forward 128 x 256 384 KB with rotary and grouped-query heads; limit 227 KB): the op layer
# runs those blocks on the flash kernels (``ops.library.float32_tile_fits``, the same bound).
FLOAT32_TILE_MAX = 64 * 128


def float32_tile_fits(block_size: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the block kernels' tile of a call fits as far as float32 goes (16-bit dtypes always)."""
    return dtype != torch.float32 or tile_extent(block_size) * tile_extent(head_dim) <= FLOAT32_TILE_MAX


def tf32_tiles_fit(block_m: int, block_d: int, backward: bool, max_shared: int) -> bool:
    """Whether the Triton block kernels' float32 tiles fit a program's shared memory with TF32
    products, which stage their operands there: 3 (forward) or 7 (backward) tiles of ``block_m x
    block_d`` 4-byte values (compile_check, sm_90, Triton 3.6: forward 64 x 128 98 KB, 128 x 256 393
    KB; backward 64 x 128 229 KB, 128 x 128 and 64 x 256 459 KB, over the H200's 227 KB, where the
    launch fails). IEEE products stage layout conversions there instead, which fit the tiles
    ``float32_tile_fits`` admits."""
    return (7 if backward else 3) * block_m * block_d * 4 <= max_shared


def grid_heads(meta: dict, loop: bool, kv_heads: int) -> int:
    """The forward grid's second axis: one where it loops over the kv heads (``loop``, the plan's
    ``HEAD_LOOP``), the query heads where it runs one program per query head (``split_groups``),
    else the kv heads."""
    if loop:
        return 1
    return kv_heads * meta.get("SPLIT_GROUPS", 1)


def blocks_per_program(slot: int) -> int:
    """Blocks per program: with blocks packed ``slot`` rows each into 64-row tiles, a tile's; else 1."""
    return 64 // slot if slot else 1


def block_grid(programs: int, kv_heads: int, device: torch.device, backward: bool, variant: Variant,
               block_d: int, slot: int = 0) -> tuple:
    """Grid of the block kernels: ``(programs, kv_heads)`` (with blocks packed ``slot`` rows each
    into 64-row tiles, one program per tile), or the resident programs of a persistent variant."""
    if slot:
        return (-(-programs // blocks_per_program(slot)), kv_heads)
    if not variant.persistent:
        return (programs, kv_heads)
    per_sm = variant.programs_per_sm[backward, block_d > 64]
    return (min(programs * kv_heads, sm_count(device) * per_sm),)


# key -> (meta, head_loop, key): a handful of entries per model (dtype, head shape, block size, flags).
_PLANS = HostCache("block_plans")


def block_plan(
    q: torch.Tensor, k: torch.Tensor, block_size: int, rot: int, interleaved: bool, has_pos: bool,
    causal: bool, backward: bool, inline_seqs: int, int64: bool, variant: Variant, launcher, stores_lse: bool = False,
) -> tuple:
    """``(meta, head_loop, key)`` of a block-kernel launch, built once per ``key`` (``stores_lse``: the
    forward that also stores the logsumexp, ``launcher`` its kernel's).

    ``meta``: the constexprs of ``launcher``'s kernel and the launch options (``rot`` is the
    rotary dim, 0 without rotary); ``head_loop``: the forward's ``HEAD_LOOP`` (a grid of one kv
    head); ``key``: every input that ``meta`` depends on, hashable, which the launcher takes as
    its cache key in place of ``meta``. ``meta`` is shared between calls: read it, don't change
    it. Building it for each call cost about a third of the launch's host time, which small
    batches pay for.
    """
    key = (q.dtype, q.device, q.shape[2], q.shape[1] // k.shape[1], block_size, rot, interleaved, has_pos,
           causal, backward, inline_seqs, int64, input_precision(q.dtype), variant.name, stores_lse)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _build(key, variant, launcher))
    return plan


def _build(key: tuple, variant: Variant, launcher) -> tuple:
    (dtype, device, head_dim, groups, block_size, rot, interleaved, has_pos, causal, backward, inline_seqs,
     int64, precision, _, stores_lse) = key
    on_cuda = device.type == "cuda"
    meta = dict(static_meta(block_size, head_dim, rot, interleaved, has_pos, causal, on_cuda, precision, backward))
    meta.update(INT64=int64, GROUPS=groups, INLINE_SEQS=inline_seqs)
    if variant.block_m is not None:
        meta["BLOCK_M"] = variant.block_m
    if variant.warpgroup_tiles:
        meta["BLOCK_M"] = max(64, meta["BLOCK_M"])
        meta["num_warps"] = meta["BLOCK_M"] // 16
    meta["SLOT"] = 0
    if variant.packs_blocks:
        meta.update(SLOT=meta["BLOCK_M"], BLOCK_M=64, num_warps=num_warps(64, meta["BLOCK_D"], backward))
    major = device_major(device) if on_cuda else 9
    if meta["PRECISION"] == "tf32" and dtype == torch.float32 and not tf32_tiles_fit(
            meta["BLOCK_M"], meta["BLOCK_D"], backward, max_shared_memory(device)):
        # TF32 is allowed, not asked for: where its tiles do not fit, the exact products.
        meta["PRECISION"] = "ieee"
    loop = not backward and head_loop(meta, variant.name)
    meta["HEAD_LOOP"] = loop
    if variant.num_warps is not None:
        meta["num_warps"] = variant.num_warps
    elif backward and variant.name == "simple":
        meta["num_warps"] = simple_backward_warps(meta)
    elif backward and variant.name == "keys":
        meta.update(keys_backward_options(meta, dtype, on_cuda))
    regs = max_registers(meta, variant, backward, major, dtype.itemsize, stores_lse)
    if regs:
        meta["maxnreg"] = regs
    taken = set(launcher.constexpr_names()) | set(_LAUNCH_OPTIONS)
    # A launch of one query head per program sets these (``block.bwd``).
    if "GROUP_PROGRAMS" in taken:
        meta["GROUP_PROGRAMS"] = 0
    if "GROUP_SUMS" in taken:
        meta["GROUP_SUMS"] = False
    if "OVERLAP" in taken:
        meta["OVERLAP"] = overlap_products(meta, variant, backward)
    if "SPLIT_GROUPS" in taken:
        meta["SPLIT_GROUPS"] = 1
        if split_groups(meta, variant, backward):
            meta.update(SPLIT_GROUPS=groups, GROUPS=1)
    if "CHUNKED" in taken:
        meta["CHUNKED"] = chunked_channels(meta, variant, backward)
    return {name: value for name, value in meta.items() if name in taken}, loop, key
