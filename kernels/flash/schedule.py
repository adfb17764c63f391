"""Tile scheduling and ``@triton.jit`` helpers shared by the multi-tile ("jagged flash") kernels.

Scheduling without host sync: every block (``block_size`` tokens of a sequence, or the whole
sequence for full attention) is cut into row tiles of ``TILE`` rows. One kernel writes the
tile prefix sums ``cum [B+1]`` (``cum[i]`` = tiles of the sequences before slot ``i``), a
second one fills a table ``[4, slots]`` of ``(block start token, block length, first row of
the block in its sequence, first row of the tile in its block)``: each slot finds its
sequence by a branch-free binary search over ``cum``. Kernels launch one program per slot of
an upper bound on the tile count (``cdiv(T, TILE) + cdiv(T, block) + B``, from shapes alone)
and exit on slots of length 0; with a host copy of the offsets the grid is exact.

Balance: for full attention the sequences can be visited longest first (an ``argsort`` of
the lengths on the device, no sync); inside a sequence the tiles are visited last first
(``LATE_FIRST``: causal query tiles near the end see the most keys) or first first (causal
key tiles near the start see the most queries), so the heaviest programs start earliest.

q and k tiles are held as rotary pair tiles ``a``, ``b`` and pass-through tile ``p`` (see
``common.split``, whose helpers load, multiply and store them, ``common.rotary`` and ``common.tiles``);
helpers return dummy zero tiles for the parts a call does not have (``ROT_DIM == 0`` or
``ROT_DIM == HEAD_DIM``), which the constexpr branches never use.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..common.meta import major_of
from ..common.launch import Launcher
from ..common.rotary import rotary_sin_cos
from ..common.schedule import search_prefix
from ..common.split import load_split
from ..common.tiles import add_cols, block_positions, load_cols, pair_cols, pass_cols

_PREFIX_CHUNK = 1024
_TABLE_CHUNK = 256


@triton.jit
def _tiles_of(length, block_size, TILE: tl.constexpr):
    """Row tiles of a sequence of ``length`` tokens cut into blocks of ``block_size``."""
    per_block = (block_size + TILE - 1) // TILE
    return (length // block_size) * per_block + ((length % block_size) + TILE - 1) // TILE


@triton.jit(do_not_specialize=["num_seqs", "block_size"])
def _tile_prefix_kernel(
    Offsets, Perm, Cum, num_seqs, block_size,
    TILE: tl.constexpr, CHUNK: tl.constexpr, HAS_PERM: tl.constexpr, SORT: tl.constexpr,
):
    block_size = block_size.to(tl.int64)
    carry = tl.zeros((), dtype=tl.int64)
    tl.store(Cum, carry)
    if SORT:
        # ``num_seqs <= CHUNK``: write ``Perm``, the sequences longest first (ties in batch order),
        # by sorting ``length * CHUNK + (CHUNK - 1 - index)`` in decreasing order.
        i = tl.arange(0, CHUNK)
        m = i < num_seqs
        length = tl.load(Offsets + i + 1, mask=m, other=0).to(tl.int64) - tl.load(Offsets + i, mask=m, other=0)
        key = tl.sort(tl.where(m, length * CHUNK + (CHUNK - 1 - i), -1), descending=True)
        tl.store(Perm + i, (CHUNK - 1 - key % CHUNK).to(Perm.dtype.element_ty), mask=m)
        n = tl.where(m, _tiles_of(key // CHUNK, block_size, TILE), 0)
        tl.store(Cum + 1 + i, tl.cumsum(n, 0), mask=m)
        return
    for lo in range(0, num_seqs, CHUNK):
        i = lo + tl.arange(0, CHUNK)
        m = i < num_seqs
        if HAS_PERM:
            seq = tl.load(Perm + i, mask=m, other=0)
        else:
            seq = i
        start = tl.load(Offsets + seq, mask=m, other=0).to(tl.int64)
        end = tl.load(Offsets + seq + 1, mask=m, other=0).to(tl.int64)
        n = _tiles_of(end - start, block_size, TILE)
        tl.store(Cum + 1 + i, tl.cumsum(n, 0) + carry, mask=m)
        carry += tl.sum(n, 0)


@triton.jit(do_not_specialize=["num_seqs", "slots", "search_top", "search_steps", "block_size"])
def _tile_table_kernel(
    Offsets, Perm, Cum, Table, num_seqs, slots, search_top, search_steps, block_size,
    TILE: tl.constexpr, CHUNK: tl.constexpr, HAS_PERM: tl.constexpr, LATE_FIRST: tl.constexpr,
):
    block_size = block_size.to(tl.int64)
    b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_table = b < slots
    b64 = b.to(tl.int64)
    i = search_prefix(Cum, b64, in_table, num_seqs, search_top, search_steps)
    real = in_table & (i < num_seqs)
    i = tl.minimum(i, num_seqs - 1)
    if HAS_PERM:
        seq = tl.load(Perm + i, mask=real, other=0)
    else:
        seq = i
    seq_start = tl.load(Offsets + seq, mask=real, other=0).to(tl.int64)
    seq_len = tl.load(Offsets + seq + 1, mask=real, other=0).to(tl.int64) - seq_start
    lo = tl.load(Cum + i, mask=real, other=0)
    j = b64 - lo
    if LATE_FIRST:
        j = tl.load(Cum + i + 1, mask=real, other=0) - lo - 1 - j
    per_block = (block_size + TILE - 1) // TILE
    first_row = (j // per_block) * block_size
    block_len = tl.where(real, tl.minimum(seq_len - first_row, block_size), 0)
    tile_row = (j % per_block) * TILE
    ty = Table.dtype.element_ty
    tl.store(Table + b, (seq_start + first_row).to(ty), mask=in_table)
    tl.store(Table + slots + b, block_len.to(ty), mask=in_table)
    tl.store(Table + 2 * slots + b, first_row.to(ty), mask=in_table)
    tl.store(Table + 3 * slots + b, tile_row.to(ty), mask=in_table)


class FlashSchedule:
    """Device tile tables ``[4, programs]`` of one (offsets, block, tile) triple and the grid size.

    ``block_size == 0`` means full attention (each sequence is one block). ``longest_first``
    visits sequences in decreasing length (worth it only for full attention).
    """

    def __init__(self, offsets: torch.Tensor, total: int, block_size: int, tile: int,
                 cpu_offsets: Optional[torch.Tensor], longest_first: bool):
        self.offsets = offsets
        self.num_seqs = offsets.numel() - 1
        self.tile = tile
        # Full attention: one block as long as the whole batch covers every sequence.
        self.block = block_size if block_size > 0 else max(total, 1)
        if cpu_offsets is not None:
            lengths = (cpu_offsets[1:] - cpu_offsets[:-1]).to(torch.int64)
            per_block = -(-self.block // tile)
            tiles = (lengths // self.block) * per_block + (lengths % self.block + tile - 1) // tile
            self.programs = int(tiles.sum())
        else:
            self.programs = min(total, triton.cdiv(total, tile) + triton.cdiv(total, self.block) + self.num_seqs)
        self.dtype = torch.int32 if total < 2**31 else torch.int64
        self.perm = None
        self.cum = None
        if self.programs == 0:
            return
        # Longest first: sorted inside the prefix kernel up to one chunk of sequences (a
        # device argsort costs 50-65 us of host time per call on the H200's host).
        sort = longest_first and 1 < self.num_seqs <= _PREFIX_CHUNK
        if sort:
            self.perm = offsets.new_empty(self.num_seqs, dtype=torch.int32)
        elif longest_first and self.num_seqs > 1:
            self.perm = torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True)
        self.cum = offsets.new_empty(self.num_seqs + 1, dtype=torch.int64)
        # (Sorting: a power-of-two width from 16 on, at most 7 kernel variants.)
        chunk = max(16, triton.next_power_of_2(self.num_seqs)) if sort else _PREFIX_CHUNK
        _launch_prefix(
            (1,), (offsets, self.perm if self.perm is not None else offsets, self.cum, self.num_seqs, self.block),
            dict(TILE=tile, CHUNK=chunk, HAS_PERM=self.perm is not None and not sort, SORT=sort), offsets,
        )

    def table(self, late_first: bool) -> torch.Tensor:
        """The table with the tiles of each sequence last first (``late_first``) or first first."""
        table = self.offsets.new_empty((4, max(self.programs, 1)), dtype=self.dtype)
        if self.programs == 0:
            return table
        _launch_table(
            (triton.cdiv(self.programs, _TABLE_CHUNK),),
            (self.offsets, self.perm if self.perm is not None else self.offsets, self.cum, table,
             self.num_seqs, self.programs, 1 << (self.num_seqs.bit_length() - 1), self.num_seqs.bit_length(),
             self.block),
            dict(TILE=self.tile, CHUNK=_TABLE_CHUNK, HAS_PERM=self.perm is not None, LATE_FIRST=late_first),
            self.offsets,
        )
        return table


_launch_prefix = Launcher(_tile_prefix_kernel)
_launch_table = Launcher(_tile_table_kernel)


def flash_tiles(head_dim: int, device_type: str, itemsize: int = 2, major: int = 9, block_size: int = 0,
                rotary: bool = False) -> dict:
    """Tile rows per pass: ``fwd`` (query tile, key tile), ``dkv`` (key tile, query tile),
    ``dkv_fast`` (the same, for the fast backward's dK/dV pass), ``dq`` (query tile, key tile) for
    a GPU of compute capability ``major``, blocks of ``block_size`` rows (0: full attention) and
    ``rotary`` on or off; FA2-style starting points, the dK/dV tiles, the forward's short-block
    tiles and the tiles of head dims over 128 on sm_90 measured on the H200; 64-row tiles under
    the interpreter so that edge lengths (63, 64, 65) cross tile borders.
    """
    if device_type != "cuda":
        return dict(fwd=(64, 64), dkv=(64, 64), dq=(64, 64), dkv_fast=(64, 64))
    if head_dim <= 128:
        # dK/dV over 64-row query tiles and dQ of 64-row query tiles: right and fastest on the
        # H200 (measured; seed3 backward 5.03 -> 4.23 ms with the 64-row dQ tiles); sm_100
        # (major 10+) cannot pipeline that loop in Triton 3.6, so it keeps 32-row inner tiles.
        if major >= 10:
            if itemsize > 2 and head_dim > 64:
                # float32 at D 65-128: the 16-bit tiles' forward, dQ and fast dK/dV passes take
                # 246-328 KB of shared memory (compile_check); these take 164-197 KB.
                return dict(fwd=(128, 32), dkv=(128, 32), dq=(64, 32), dkv_fast=(64, 32))
            return dict(fwd=(128, 64), dkv=(128, 32), dq=(128, 32), dkv_fast=(128, 32))
        # Blocks of at most 512 rows have few key tiles per query tile; 32-row key tiles give the
        # forward's 3-stage pipeline more of them (H200, bf16 D128: block 256 2.61 -> 2.11 ms,
        # block 512 3.59 -> 3.34 ms; full attention keeps 64-row key tiles).
        short = major == 9 and 0 < block_size <= 512
        # The fast backward's dK/dV pass adds dQ's terms once per key tile, so it takes 128-row
        # key tiles at D > 64 in 16-bit types (H200, seed3 backward 8.11 -> 5.66 ms against 64-row
        # ones; float32 ones would need 361 KB of shared memory).
        fast = (128, 64) if major == 9 and head_dim > 64 and itemsize == 2 else (64, 64)
        if itemsize > 2 and head_dim > 64:
            # float32 at D 65-128: 128 x 64 forward tiles in 3 stages take 262 KB of shared memory
            # on sm_90 (328 KB on sm_100), the fast dK/dV pass over 64-row query tiles 230-247 KB:
            # over the 227 KB a program gets (compile_check); 32-row key / query tiles fit (164 KB).
            return dict(fwd=(128, 32), dkv=(64, 64), dq=(64, 64), dkv_fast=(64, 32))
        return dict(fwd=(128, 32) if short else (128, 64), dkv=(64, 64), dq=(64, 64), dkv_fast=fast)
    if itemsize > 2:
        # float32 at D > 128: 64-row tiles need more shared memory than sm_90 has.
        return dict(fwd=(32, 32), dkv=(32, 32), dq=(32, 32), dkv_fast=(32, 32))
    if major == 9:
        # H200, bf16 D256 (8 warps; forward 3 stages, backward 2), forward / deterministic backward
        # ms from (64, 32) tiles everywhere: block 128 2x2 heads 2.68 -> 1.71 / 13.1 -> 7.2, 4x1
        # 4.91 -> 3.72 / 22.2 -> 12.0; block 256 3.88 -> 2.19 / 21.5 -> 10.5; full attention (seed3
        # lengths, 4 heads) 3.20 -> 1.38 / 17.2 -> 7.9. Rotary keeps 32-row query tiles in the
        # dK/dV pass (block 128: 11.0 ms against 12.8 with 64), the fast pass 32-row ones (64 with
        # its tensor-map dQ sums need 271 KB of shared memory).
        return dict(fwd=(128, 32), dkv=(64, 32) if rotary else (64, 64), dq=(64, 64), dkv_fast=(64, 32))
    return dict(fwd=(64, 32), dkv=(64, 32), dq=(64, 32), dkv_fast=(64, 32))


# False: pointer loads everywhere (the tests run both kinds of loads); ``BLOCKATTN_TENSOR_MAPS=0``
# in the environment sets it at import.
TENSOR_MAPS = os.environ.get("BLOCKATTN_TENSOR_MAPS", "1") != "0"


def tma_loads(*tensors: torch.Tensor, rope_theta: Optional[float]) -> bool:
    """Whether the whole tiles of the kernels' inner loops can come through tensor-map (TMA) loads
    from these ``[T, H, D]`` tensors: sm_90+ (or the interpreter), no rotary, ``D`` a power of
    two (a tile is one head's row), each tensor's rows ``H * D`` contiguous elements at 16-byte
    aligned addresses and strides (callers also require 32-bit offsets). Only whole tiles (all
    rows inside the block) are loaded so; the masked tiles keep pointer loads, which read nothing
    past a block. Measured on the H200 (seed3, bf16 D128): backward 4.18 -> 3.72 ms, forward
    unchanged, results bitwise equal to the pointer loads."""
    q = tensors[0]
    if not TENSOR_MAPS or rope_theta is not None or major_of(q) < 9:
        return False
    dim = q.shape[-1]
    if dim < 16 or dim & (dim - 1):
        return False
    size = q.element_size()
    return all(t.stride(2) == 1 and t.stride(1) == dim and (t.stride(0) * size) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)


def row_tiles(x: torch.Tensor, rows: int, tma: bool):
    """A tensor descriptor of ``x`` as ``[T, H * D]`` in tiles of ``rows`` rows and one head, or
    ``x`` itself where the kernel takes pointer loads."""
    if not tma:
        return x
    total, heads, dim = x.shape
    return TensorDescriptor(x, [total, heads * dim], [x.stride(0), 1], [rows, dim])


@triton.jit
def tile_of_program(Table, slots, slot):
    """``(block start, block length, first row of the block, first row of the tile)``; length 0: none."""
    start = tl.load(Table + slot)
    length = tl.load(Table + slots + slot)
    first_row = tl.load(Table + 2 * slots + slot)
    tile_row = tl.load(Table + 3 * slots + slot)
    return start, length, first_row, tile_row


@triton.jit
def program_rows(Table, slots, kv_heads, BLOCK: tl.constexpr):
    """This program's kv head and tile: ``(hk, start, n, first_row, tile_row, offs, ok, rows)``
    (:func:`tile_of_program`'s four, then the rows ``offs`` of the tile in its block, ``ok`` where
    inside it, and their token indices ``rows``); the programs go through the tile table once per
    kv head. ``n == 0``: no tile."""
    pid = tl.program_id(0)
    start, n, first_row, tile_row = tile_of_program(Table, slots, pid // kv_heads)
    offs = tile_row + tl.arange(0, BLOCK)
    return pid % kv_heads, start, n, first_row, tile_row, offs, offs < n, start + offs


@triton.jit
def tile_sin_cos(
    Pos, block_start, first_row, offs, ok, log2_theta,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    """Rotary ``(sin, cos)`` ``[BLOCK, BLOCK_R]`` of rows ``offs`` of a block (zeros without rotary)."""
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        pos = block_positions(Pos, block_start, first_row, offs, ok, HAS_POS)
        sin, cos = rotary_sin_cos(pos, offs_r, log2_theta, ROT_DIM, FAST_TRIG)
    else:
        sin = tl.zeros((BLOCK, BLOCK_R), dtype=tl.float32)
        cos = tl.zeros((BLOCK, BLOCK_R), dtype=tl.float32)
    return sin, cos


@triton.jit
def load_row_tiles(
    x_ptr, y_ptr, XD, YD, head, start, r0, offs, ok, offs_d, d_ok, Pos, first_row, log2_theta,
    stride_xt, stride_xd, stride_yt, stride_yd,
    TENSOR_MAPS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
    FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
):
    """The loop tiles of rows ``r0 + [0, BLOCK)`` of a block from token ``start``: x (q or k, of
    ``head``) as rotated ``(a, b, p)`` tiles and y (dO or v) whole; through the tensor maps ``XD``,
    ``YD`` when ``TENSOR_MAPS`` (whole tiles, plain heads: ``a`` and ``b`` are ``p``), else by
    pointers from ``x_ptr``, ``y_ptr`` (rows ``offs``, zeros where not ``ok``)."""
    if TENSOR_MAPS:
        row = (start + r0).to(tl.int32)
        p = XD.load([row, head * HEAD_DIM])
        a = p
        b = p
        y = YD.load([row, head * HEAD_DIM])
    else:
        rows = start + offs
        sin, cos = tile_sin_cos(Pos, start, first_row, offs, ok, log2_theta,
                                BLOCK, BLOCK_R, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG)
        a, b, p = load_split(x_ptr, rows, ok, sin, cos, stride_xt, stride_xd,
                             BLOCK, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
        y = load_cols(y_ptr, rows, ok, offs_d, d_ok, stride_yt, stride_yd, INT64)
    return a, b, p, y


@triton.jit
def add_split(
    ptr, a, b, p, rows, ok, stride_t,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, INT64: tl.constexpr,
):
    """Atomically add a gradient held as ``(a, b, p)`` to float32 rows at its own columns (not rotated back)."""
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        add_cols(ptr, a, rows, ok, cols_a, r_ok, stride_t, 1, INT64)
        add_cols(ptr, b, rows, ok, cols_b, r_ok, stride_t, 1, INT64)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
        add_cols(ptr, p, rows, ok, cols_p, p_ok, stride_t, 1, INT64)


@triton.jit
def load_acc_split(
    ptr, rows, ok, stride_t,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INT64: tl.constexpr,
):
    """Float32 rows accumulated by :func:`add_split`, as its ``(a, b, p)`` tiles."""
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        a = load_cols(ptr, rows, ok, cols_a, r_ok, stride_t, 1, INT64)
        b = load_cols(ptr, rows, ok, cols_b, r_ok, stride_t, 1, INT64)
    else:
        a = tl.zeros((BLOCK, BLOCK_R), dtype=tl.float32)
        b = tl.zeros((BLOCK, BLOCK_R), dtype=tl.float32)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
        p = load_cols(ptr, rows, ok, cols_p, p_ok, stride_t, 1, INT64)
    else:
        p = tl.zeros((BLOCK, BLOCK_P), dtype=tl.float32)
    return a, b, p


@triton.jit
def allowed(offs_m, offs_n, n_ok, IS_CAUSAL: tl.constexpr):
    """Mask of the keys each query row may attend to inside its block (``[1, N]`` or ``[M, N]``)."""
    ok = n_ok[None, :]
    if IS_CAUSAL:
        ok = ok & (offs_m[:, None] >= offs_n[None, :])
    return ok
