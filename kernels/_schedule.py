"""Sync-free scheduling of (block, head) programs over jagged sequences.

Two small kernels turn ``offsets [B+1]`` into a device-side block table without any host
sync: ``cum [B+1]`` holds block prefix sums (``cum[s]`` = blocks in sequences before ``s``),
then each table slot ``b`` finds its sequence by a branch-free binary search over ``cum``
and records ``(start token, length, position of the first row in its sequence)``.
The attention kernels launch one program per slot of an upper bound on the block count
(``min(T, cdiv(T, block) + B)``, known from shapes alone) and exit on slots of length 0.
With a host copy of the offsets the grid is exact instead.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_PREFIX_CHUNK = 1024
_TABLE_CHUNK = 256


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
def block_of_program(Table, slots, pid):
    """``(start, length, first_row)`` of this program's block; length 0 means no block."""
    start = tl.load(Table + pid)
    length = tl.load(Table + slots + pid)
    first_row = tl.load(Table + 2 * slots + pid)
    return start, length, first_row


class Schedule:
    """The device block table ``[3, programs]`` of one (offsets, block_size) pair and its grid size."""

    def __init__(self, offsets: torch.Tensor, total: int, block_size: int, cpu_offsets: Optional[torch.Tensor]):
        num_seqs = offsets.numel() - 1
        if cpu_offsets is not None:
            lengths = (cpu_offsets[1:] - cpu_offsets[:-1]).to(torch.int64)
            self.programs = int(((lengths + block_size - 1) // block_size).sum())
        else:
            self.programs = min(total, triton.cdiv(total, block_size) + num_seqs)
        dtype = torch.int32 if total < 2**31 else torch.int64
        self.table = torch.empty((3, max(self.programs, 1)), dtype=dtype, device=offsets.device)
        if self.programs == 0:
            return
        cum = torch.empty(num_seqs + 1, dtype=dtype, device=offsets.device)
        _block_prefix_kernel[(1,)](offsets, cum, num_seqs, BLOCK_SIZE=block_size, CHUNK=_PREFIX_CHUNK)
        _block_table_kernel[(triton.cdiv(self.programs, _TABLE_CHUNK),)](
            offsets, cum, self.table, num_seqs, self.programs,
            1 << (num_seqs.bit_length() - 1), num_seqs.bit_length(),
            BLOCK_SIZE=block_size, CHUNK=_TABLE_CHUNK,
        )
