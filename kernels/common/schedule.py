"""Sync-free scheduling of (block, head) programs over jagged sequences.

Two small kernels turn ``offsets [B+1]`` into a device-side block table without any host
sync: ``cum [B+1]`` holds block prefix sums (``cum[s]`` = blocks in sequences before ``s``),
then each table slot ``b`` finds its sequence by a branch-free binary search over ``cum``
and records ``(start token, length, position of the first row in its sequence)``.
The attention kernels launch one program per slot of an upper bound on the block count
(``min(T, cdiv(T, block) + B)``, known from shapes alone) and exit on slots of length 0.
With a host copy of the offsets the grid is exact instead.

Batches of at most ``INLINE_MAX_SEQS`` sequences skip both kernels: every attention program
derives its block from ``offsets`` itself (a prefix sum over at most that many lengths in
registers). That saves two launches and two allocations per call, which is most of the
host time of a small batch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import Launcher

_PREFIX_CHUNK = 1024
_TABLE_CHUNK = 256
# Batches of at most this many sequences use the in-kernel schedule (a power of two: the
# kernels' scan width).
INLINE_MAX_SEQS = 512


@triton.jit(do_not_specialize=["num_seqs"])
def _block_prefix_kernel(Offsets, Cum, num_seqs, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    carry = tl.zeros((), dtype=Cum.dtype.element_ty)
    tl.store(Cum, carry)
    for lo in range(0, num_seqs, CHUNK):
        i = lo + tl.arange(0, CHUNK)
        m = i < num_seqs
        start = tl.load(Offsets + i, mask=m, other=0)
        end = tl.load(Offsets + i + 1, mask=m, other=0)
        n = ((end - start + BLOCK_SIZE - 1) // BLOCK_SIZE).to(Cum.dtype.element_ty)
        tl.store(Cum + 1 + i, tl.cumsum(n, 0) + carry, mask=m)
        carry += tl.sum(n, 0)


@triton.jit
def search_prefix(Cum, b, mask, num_seqs, search_top, search_steps):
    """For each slot ``b``: the largest ``s <= num_seqs`` with ``cum[s] <= b`` (branch-free).

    Empty sequences share their neighbour's prefix sum and so are skipped; ``s == num_seqs``
    means ``b`` is past the last unit. ``search_top`` is the highest power of two
    ``<= num_seqs`` and ``search_steps`` its bit length.
    """
    s = b * 0
    for i in range(search_steps):
        cand = s + (search_top >> i)
        c = tl.load(Cum + tl.minimum(cand, num_seqs), mask=mask, other=0)
        s = tl.where((cand <= num_seqs) & (c <= b), cand, s)
    return s


@triton.jit(do_not_specialize=["num_seqs", "slots", "search_top", "search_steps"])
def _block_table_kernel(
    Offsets, Cum, Table, num_seqs, slots, search_top, search_steps,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
):
    b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_table = b < slots
    s = search_prefix(Cum, b, in_table, num_seqs, search_top, search_steps)
    real = in_table & (s < num_seqs)
    s = tl.minimum(s, num_seqs - 1)
    seq_start = tl.load(Offsets + s, mask=real, other=0)
    seq_end = tl.load(Offsets + s + 1, mask=real, other=0)
    first_row = (b - tl.load(Cum + s, mask=real, other=0)).to(seq_start.dtype) * BLOCK_SIZE
    length = tl.where(real, tl.minimum(seq_end - seq_start - first_row, BLOCK_SIZE), 0)
    tl.store(Table + b, (seq_start + first_row).to(Table.dtype.element_ty), mask=in_table)
    tl.store(Table + slots + b, length.to(Table.dtype.element_ty), mask=in_table)
    tl.store(Table + 2 * slots + b, first_row.to(Table.dtype.element_ty), mask=in_table)


@triton.jit
def _inline_counts(Offsets, num_seqs, block_size, SEQS: tl.constexpr):
    """``(seq_start, seq_end, blocks, cum)`` of all ``num_seqs <= SEQS`` sequences: their bounds,
    block counts and the counts' inclusive prefix sums."""
    i = tl.arange(0, SEQS)
    m = i < num_seqs
    seq_start = tl.load(Offsets + i, mask=m, other=0)
    seq_end = tl.load(Offsets + i + 1, mask=m, other=0)
    blocks = (seq_end - seq_start + block_size - 1) // block_size
    return seq_start, seq_end, blocks, tl.cumsum(blocks, 0)


@triton.jit
def _inline_block(Offsets, num_seqs, block_size, b, SEQS: tl.constexpr):
    """Block ``b`` found from ``offsets`` directly: prefix sums of the block counts of all
    ``num_seqs <= SEQS`` sequences, then the sequence whose range holds ``b``."""
    seq_start, seq_end, blocks, cum = _inline_counts(Offsets, num_seqs, block_size, SEQS)
    return _inline_pick(seq_start, seq_end, blocks, cum, num_seqs, block_size, b, SEQS)


@triton.jit
def _inline_pick(seq_start, seq_end, blocks, cum, num_seqs, block_size, b, SEQS: tl.constexpr):
    """``(start, length, first_row)`` of block ``b`` from ``_inline_counts``."""
    i = tl.arange(0, SEQS)
    before = cum <= b
    s = tl.sum(before.to(tl.int32), 0)
    first_row = (b - tl.sum(tl.where(before, blocks, 0), 0)) * block_size
    this = i == s
    start = tl.sum(tl.where(this, seq_start, 0), 0) + first_row
    end = tl.sum(tl.where(this, seq_end, 0), 0)
    length = tl.where(s < num_seqs, tl.minimum(end - start, block_size), 0)
    return start, length, first_row


@triton.jit
def block_of_program(Sched, slots, num_seqs, block_size, pid, INLINE_SEQS: tl.constexpr):
    """``(start, length, first_row)`` of this program's block; length 0 means no block.

    ``Sched`` is the block table, or the offsets themselves when ``INLINE_SEQS > 0``.
    """
    if INLINE_SEQS > 0:
        return _inline_block(Sched, num_seqs, block_size, pid, INLINE_SEQS)
    else:
        start = tl.load(Sched + pid)
        length = tl.load(Sched + slots + pid)
        first_row = tl.load(Sched + 2 * slots + pid)
        return start, length, first_row


@triton.jit
def packed_rows(Sched, slots, num_seqs, block_size, pid, BLOCK_M: tl.constexpr, INLINE_SEQS: tl.constexpr,
                SLOT: tl.constexpr):
    """A tile of ``BLOCK_M // SLOT`` blocks (table slots ``pid * BLOCK_M // SLOT`` on), ``SLOT``
    rows each: ``(rows, row_ok, prow, n)``, per tile row its token, whether it is one, and its
    index in its sequence; ``n`` the tokens of all the tile's blocks (0: nothing to do)."""
    PACK: tl.constexpr = BLOCK_M // SLOT
    offs_m = tl.arange(0, BLOCK_M)
    slot = offs_m // SLOT
    local = offs_m % SLOT
    row_start = offs_m * 0
    row_n = offs_m * 0
    row_first = offs_m * 0
    n = 0
    if INLINE_SEQS > 0:  # one scan of the offsets for all the tile's blocks
        seq_start, seq_end, blocks, cum = _inline_counts(Sched, num_seqs, block_size, INLINE_SEQS)
    for j in tl.static_range(PACK):
        b = pid * PACK + j
        if INLINE_SEQS > 0:
            start, length, first_row = _inline_pick(seq_start, seq_end, blocks, cum, num_seqs, block_size, b,
                                                    INLINE_SEQS)
        else:
            start, length, first_row = block_of_program(Sched, slots, num_seqs, block_size, tl.minimum(b, slots - 1),
                                                        INLINE_SEQS)
            length = tl.where(b < slots, length, 0)
        row_start = tl.where(slot == j, start, row_start)
        row_n = tl.where(slot == j, length, row_n)
        row_first = tl.where(slot == j, first_row, row_first)
        n += length
    return row_start + local, local < row_n, row_first + local, n


@triton.jit
def tile_of_program(Sched, slots, num_seqs, block_size, pid, BLOCK_M: tl.constexpr, INLINE_SEQS: tl.constexpr,
                    SLOT: tl.constexpr):
    """``(start, n, first_row, packed)`` of this program's tile: its block (``block_of_program``;
    ``packed`` unused), or with ``SLOT`` a tile of blocks (``packed_rows``'s ``(rows, row_ok,
    prow)``, ``n`` their tokens; ``start`` and ``first_row`` unused)."""
    if SLOT == 0:
        start, n, first_row = block_of_program(Sched, slots, num_seqs, block_size, pid, INLINE_SEQS)
        return start, n, first_row, (0, 0, 0)
    else:
        rows, row_ok, prow, n = packed_rows(Sched, slots, num_seqs, block_size, pid, BLOCK_M, INLINE_SEQS, SLOT)
        return 0, n, 0, (rows, row_ok, prow)


@triton.jit
def tile_rows(start, n, packed, BLOCK_M: tl.constexpr, SLOT: tl.constexpr):
    """``(offs_m, rows, row_ok, prow)`` of a non-empty tile from ``tile_of_program``: each tile
    row's token, whether it is one, and its index in its sequence (``offs_m`` for one block)."""
    offs_m = tl.arange(0, BLOCK_M)
    if SLOT == 0:
        row_ok = offs_m < n
        rows = start + offs_m
        return offs_m, rows, row_ok, offs_m
    else:
        return offs_m, packed[0], packed[1], packed[2]


class Schedule:
    """Where each program of one (offsets, block_size) pair finds its block, and the grid size.

    ``table`` is the device block table ``[3, programs]``, or ``offsets`` itself when
    ``inline_seqs`` (the power of two the kernels scan, 0 for the table) is set.
    """

    __slots__ = ("num_seqs", "programs", "inline_seqs", "table")

    def __init__(self, offsets: torch.Tensor, total: int, block_size: int, cpu_offsets: Optional[torch.Tensor]):
        num_seqs = offsets.numel() - 1
        self.num_seqs = num_seqs
        if cpu_offsets is not None:
            lengths = (cpu_offsets[1:] - cpu_offsets[:-1]).to(torch.int64)
            self.programs = int(((lengths + block_size - 1) // block_size).sum())
        else:
            # (Plain integer math: triton.cdiv is a constexpr function, slow in host code.)
            self.programs = min(total, -(-total // block_size) + num_seqs)
        if num_seqs <= INLINE_MAX_SEQS:
            # One scan width for every small batch: a bucket per batch size would compile
            # the attention kernels again whenever a batch crosses a power of two.
            self.inline_seqs = INLINE_MAX_SEQS
            self.table = offsets
            return
        self.inline_seqs = 0
        dtype = torch.int32 if total < 2**31 else torch.int64
        self.table = offsets.new_empty((3, max(self.programs, 1)), dtype=dtype)
        if self.programs == 0:
            return
        cum = offsets.new_empty(num_seqs + 1, dtype=dtype)
        _launch_prefix((1,), (offsets, cum, num_seqs), dict(BLOCK_SIZE=block_size, CHUNK=_PREFIX_CHUNK), offsets)
        _launch_table(
            (triton.cdiv(self.programs, _TABLE_CHUNK),),
            (offsets, cum, self.table, num_seqs, self.programs, 1 << (num_seqs.bit_length() - 1),
             num_seqs.bit_length()),
            dict(BLOCK_SIZE=block_size, CHUNK=_TABLE_CHUNK), offsets,
        )


_launch_prefix = Launcher(_block_prefix_kernel)
_launch_table = Launcher(_block_table_kernel)
