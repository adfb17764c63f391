"""CPU tests of the sm_90 Gluon kernels (``hopper`` and the experimental ``hopper_ws``), run through
``tests/gluon_shim.py`` (Gluon has no interpreter).

The logic the Gluon code restates from the Triton helpers is compared with those helpers (run by
Triton's interpreter) and with PyTorch or plain-Python oracles:

- ``_block_of`` (both schedules) with ``common.schedule.block_of_program`` and a Python list of
  blocks; ``persistent.tile_range`` with the ``persistent_range`` arithmetic and its partition properties;
- ``sm90.rotary``: ``_reduced`` with ``common.rotary._reduced`` (and its range), ``sin_cos`` /
  ``sin_cos_rows`` with ``common.rotary.block_sin_cos`` and ``reference.rotary_angles``,
  ``rotate_in_place`` with ``reference.apply_rotary``;
- ``_probs`` with ``common.tiles.block_probs`` and a torch softmax;
- ``_unrotate_store`` with ``reference.apply_rotary(inverse=True)`` (also of partial rotary and
  padded head dims), and the stores' row masks;
- the whole kernels, forward and backward, against ``reference.attention_forward`` /
  ``attention_backward``, every output element written exactly once.

What the shim does not model (timing, layouts, the approximations' accuracy) is in its docstring.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tests next to Triton's interpreter; on a GPU the kernels run in test_triton_gpu.py"),
    pytest.mark.usefixtures("single_thread"),
]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from blockattn_layers import reference  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402

# ----------------------------------------------------------------------------- code under test
# The one place that names the kernel modules (update it when they move).
from blockattn_layers.kernels.common import rotary as triton_rotary  # noqa: E402
from blockattn_layers.kernels.common import schedule as triton_schedule  # noqa: E402
from blockattn_layers.kernels.common import tiles as triton_tiles  # noqa: E402
from blockattn_layers.kernels.common.meta import tile_extent  # noqa: E402
from blockattn_layers.kernels.experimental import sm90_ws  # noqa: E402
from blockattn_layers.kernels.sm90 import persistent  # noqa: E402
from blockattn_layers.kernels.sm90 import block as sm90_block  # noqa: E402
from blockattn_layers.kernels.sm90 import chunked  # noqa: E402
from blockattn_layers.kernels.sm90 import rotary as sm90_rotary  # noqa: E402
from blockattn_layers.kernels.sm90 import wide as sm90_wide  # noqa: E402

Schedule = triton_schedule.Schedule
INLINE_MAX_SEQS = triton_schedule.INLINE_MAX_SEQS
block_of_program = triton_schedule.block_of_program
triton_reduced = triton_rotary._reduced
block_sin_cos = triton_rotary.block_sin_cos
block_positions = triton_tiles.block_positions
block_probs = triton_tiles.block_probs

block_of = gs.function(sm90_block._block_of)
probs = gs.function(sm90_block._probs)
probs_lse = gs.function(sm90_block._probs_lse)
store_via = gs.function(sm90_block._store_via)
store_halves_tile_via = gs.function(sm90_block._store_halves_tile_via)
unrotate_store = gs.function(sm90_block._unrotate_store)
reduced = gs.function(sm90_rotary._reduced)
sin_cos = gs.function(sm90_rotary.sin_cos)
sin_cos_rows = gs.function(sm90_rotary.sin_cos_rows)
half_channels = gs.function(sm90_rotary.half_channels)
rotate_in_place = gs.function(sm90_rotary.rotate_in_place)
tile_range = gs.function(persistent.tile_range)
HOPPER_FWD, HOPPER_BWD = sm90_block._hopper_fwd_kernel, sm90_block._hopper_bwd_kernel
HOPPER_FWD_LSE = sm90_block._hopper_fwd_lse_kernel
WS_FWD, WS_BWD = sm90_ws._hopper_ws_fwd_kernel, sm90_ws._hopper_ws_bwd_kernel
WIDE_BWD = sm90_wide._hopper_wide_bwd_kernel

LOG2E = 1.4426950408889634
BLOCK_M = 64  # the rows of every hopper tile (one warpgroup's wgmma)
LAYOUT = gs.Layout("any")  # layouts are inert in the shim


def _offsets(lengths, dtype=torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=dtype)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(dtype)
    return out


def _rng_lengths(count: int, seed: int, longest: int = 300) -> list:
    """Lengths drawn around block-size edges (0, 1, multiples of 32 and 64 and their neighbours)."""
    rng = random.Random(seed)
    edges = [0, 0, 1, 2, 31, 32, 33, 49, 50, 51, 63, 64, 65, 127, 128, 129]
    return [rng.choice(edges) if rng.random() < 0.7 else rng.randrange(longest) for _ in range(count)]


# ----------------------------------------------------------------------------- block schedule
def _oracle_blocks(lengths, block_size: int) -> list:
    """``(start, length, first_row)`` of every block, in schedule order (sequence, then row)."""
    blocks, start = [], 0
    for n in lengths:
        for first in range(0, n, block_size):
            blocks.append((start + first, min(block_size, n - first), first))
        start += n
    return blocks


@triton.jit
def _block_of_triton(Sched, Pids, Out, slots, num_seqs, block_size, INLINE_SEQS: tl.constexpr):
    i = tl.program_id(0)
    count = tl.num_programs(0)
    start, length, first_row = block_of_program(Sched, slots, num_seqs, block_size, tl.load(Pids + i), INLINE_SEQS)
    tl.store(Out + i, start)
    tl.store(Out + count + i, length)
    tl.store(Out + 2 * count + i, first_row)


def _gluon_blocks(sched, slots: int, num_seqs: int, block_size: int, programs: int, inline_seqs: int,
                  warps: int = 4) -> torch.Tensor:
    """``[3, programs]`` (start, length, first_row) of programs ``0 .. programs`` by ``_block_of``."""
    ptr = gs.pointer(sched, "Sched")
    rows = [block_of(ptr, slots, num_seqs, block_size, pid, inline_seqs, warps) for pid in range(programs)]
    return torch.tensor([[int(v) for v in row] for row in rows], dtype=torch.int64).t()


def _triton_blocks(sched, slots: int, num_seqs: int, block_size: int, pids: torch.Tensor, inline_seqs: int):
    """``[3, len(pids)]`` (start, length, first_row) of programs ``pids`` by ``block_of_program``."""
    out = torch.zeros(3, pids.numel(), dtype=torch.int64)
    _block_of_triton[(pids.numel(),)](sched, pids, out, slots, num_seqs, block_size, inline_seqs)
    return out


def _some_pids(programs: int, blocks: int, count: int = 48) -> torch.Tensor:
    """Every program of a small launch; else the first and last ones, those around the last real
    block, and a spread between (the Triton interpreter takes ~4 ms a program)."""
    if programs <= count:
        return torch.arange(programs, dtype=torch.int32)
    picks = set(range(8)) | set(range(programs - 4, programs))
    picks |= set(range(max(blocks - 4, 0), min(blocks + 4, programs)))
    picks |= set(random.Random(programs).sample(range(programs), count - len(picks)))
    return torch.tensor(sorted(picks), dtype=torch.int32)


def _check_blocks(sched, lengths, block_size: int, slots: int, programs: int, inline_seqs: int,
                  warps: int = 4) -> None:
    """``_block_of`` of every program: the Python block list (length 0 past the last block) and,
    on a sample of them, ``block_of_program`` exactly (padding slots included)."""
    got = _gluon_blocks(sched, slots, len(lengths), block_size, programs, inline_seqs, warps)
    want = _oracle_blocks(lengths, block_size)
    assert programs >= len(want)
    assert got[:, :len(want)].t().tolist() == [list(b) for b in want]
    assert (got[1, len(want):] == 0).all(), "slots past the last block must have length 0"
    pids = _some_pids(programs, len(want))
    assert torch.equal(got[:, pids.long()], _triton_blocks(sched, slots, len(lengths), block_size, pids, inline_seqs))


BLOCK_LAYOUTS = {
    "one_empty": [0],
    "one_token": [1],
    "one_block": [64],
    "block_plus_one": [65],
    "all_empty": [0, 0, 0],
    "edges": [0, 1, 63, 64, 65, 130, 0, 5],
    "empty_between": [128, 0, 129, 1, 0, 0, 200],
    "random_24": _rng_lengths(24, seed=1, longest=200),
    "random_120": _rng_lengths(120, seed=2, longest=90),
}


@pytest.mark.parametrize("block_size", [64, 50, 16])
@pytest.mark.parametrize("layout", list(BLOCK_LAYOUTS), ids=str)
def test_block_of_inline(layout, block_size):
    """In-kernel schedule (``INLINE_SEQS``, B <= 512), int32 and int64 offsets: every program of the
    launch (``Schedule``'s upper bound on the block count, and 2 past it)."""
    lengths = BLOCK_LAYOUTS[layout]
    for dtype in (torch.int32, torch.int64):
        offsets = _offsets(lengths, dtype)
        sched = Schedule(offsets, sum(lengths), block_size, None)
        assert sched.inline_seqs == INLINE_MAX_SEQS and sched.table is offsets
        _check_blocks(offsets, lengths, block_size, sched.programs, sched.programs + 2, sched.inline_seqs)


@pytest.mark.parametrize("seqs", [1, 8, 32, INLINE_MAX_SEQS])
def test_block_of_inline_full_scan(seqs):
    """Batches of exactly ``INLINE_SEQS`` sequences: the scan's full width, no masked lane past the
    last sequence (the production width too: 512 sequences, nonempty ones spread over it). One
    case with the ws loader's one warp (the scan's layout)."""
    if seqs == INLINE_MAX_SEQS:
        lengths = [0, 0, 0, 1] * (seqs // 4 - 1) + [0, 0, 1, 70]
    else:
        lengths = _rng_lengths(seqs, seed=seqs, longest=200)
    programs = min(sum(lengths), -(-sum(lengths) // 64) + len(lengths)) + 1
    _check_blocks(_offsets(lengths), lengths, 64, programs, programs, seqs, warps=1 if seqs == 8 else 4)


def test_block_of_table():
    """More than ``INLINE_MAX_SEQS`` sequences: the block table that ``Schedule`` builds, read by
    ``_block_of`` as ``block_of_program`` reads it; and a table built here with spare slots, so the
    rows' stride is the ``slots`` argument and not the block count."""
    lengths = _rng_lengths(INLINE_MAX_SEQS + 40, seed=3, longest=70)
    offsets = _offsets(lengths)
    sched = Schedule(offsets, sum(lengths), 64, None)
    assert sched.inline_seqs == 0 and sched.table.shape == (3, sched.programs)
    _check_blocks(sched.table, lengths, 64, sched.programs, sched.programs, 0)

    blocks = _oracle_blocks(lengths, 64)
    slots = len(blocks) + 7
    table = torch.zeros(3, slots, dtype=torch.int32)
    table[:, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).t()
    table[0, len(blocks):] = 12345  # (a start that no real block has)
    assert torch.equal(_gluon_blocks(table, slots, len(lengths), 64, slots, 0), table.long())


# ----------------------------------------------------------------------------- persistent tile ranges
@pytest.mark.parametrize("slots,kv_heads,programs", [
    (0, 1, 4), (1, 1, 4), (3, 2, 8), (5, 3, 5), (1000, 3, 7), (997, 8, 264), (2**24, 8, 264), (2**27 - 3, 15, 132),
])
def test_tile_range(slots, kv_heads, programs):
    """``_tile_range``: program p's tiles ``[p T / P, (p + 1) T / P)`` of the ``T = slots * kv_heads``
    (``persistent_range``: 64-bit products, the bounds int32), so the ranges tile ``[0, T)`` in
    order with sizes that differ by at most one. The last cases need the 64-bit products (p T
    passes 2**31)."""
    tiles = slots * kv_heads
    bounds = []
    for p in range(programs):
        with gs.program((p,), (programs,)):
            lo, hi = tile_range(slots, kv_heads)
        assert lo.dtype == hi.dtype == torch.int32
        assert (int(lo), int(hi)) == (p * tiles // programs, (p + 1) * tiles // programs), f"program {p}"
        bounds.append((int(lo), int(hi)))
    assert bounds[0][0] == 0 and bounds[-1][1] == tiles
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


# ----------------------------------------------------------------------------- rotary
@triton.jit
def _reduced_triton(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, triton_reduced(tl.load(X + i)))


def _angles(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1.0, 4.0, 100.0, 1e4, 3e5])
    x = torch.randn(1024, generator=g, dtype=torch.float64) * scales.repeat(1024 // 5 + 1)[:1024]
    x[:8] = torch.tensor([0.0, math.pi, -math.pi, 3 * math.pi, 2 * math.pi, -7.5, 1e5 + 0.5, -2e5])
    return x.float()


def test_reduced():
    """``_reduced`` lands in [-pi, pi] (what sin/cos.approx need), keeps the angle modulo 2 pi,
    and is ``common.rotary._reduced`` bit for bit."""
    x = _angles(0)
    got = reduced(x)
    want = torch.empty_like(x)
    _reduced_triton[(1,)](x, want, x.numel())
    assert torch.equal(got, want)
    ulp = torch.abs(x.double()) * 2**-23 * 4 + 1e-6  # float32 rounding of the products
    assert (got.double().abs() <= math.pi + ulp).all()
    turns = (x.double() - got.double()) / (2 * math.pi)
    assert ((turns - turns.round()).abs() * 2 * math.pi <= ulp).all()


@triton.jit
def _sin_cos_triton(Pos, Sin, Cos, start, n, first_row, log2_theta, BLOCK: tl.constexpr, HALF: tl.constexpr,
                    HAS_POS: tl.constexpr):
    offs_m = tl.arange(0, BLOCK)
    offs_r = tl.arange(0, HALF)
    pos = block_positions(Pos, start, first_row, offs_m, offs_m < n, HAS_POS)
    sin, cos = block_sin_cos(pos, first_row, offs_m, offs_r, log2_theta, 2 * HALF, HAS_POS, False, True)
    idx = offs_m[:, None] * HALF + offs_r[None, :]
    tl.store(Sin + idx, sin)
    tl.store(Cos + idx, cos)


def _positions(kind: str, count: int, top: int = 100_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "int":
        return torch.randint(0, top, (count,), generator=g, dtype=torch.int32)
    return (torch.rand(count, generator=g) * 3000 + 0.25).float()


ROTARY_CASES = [
    # (HAS_POS, positions kind, first_row, n, HALF, theta)
    (False, None, 0, 64, 64, 10000.0),
    (False, None, 64, 37, 32, 10000.0),
    (False, None, 4096, 64, 64, 500000.0),
    (False, None, 123456, 1, 32, 10000.0),
    (True, "int", 0, 64, 64, 10000.0),
    (True, "int", 0, 37, 32, 500000.0),
    (True, "float", 0, 50, 64, 10000.0),
]


@pytest.mark.parametrize("has_pos,kind,first_row,n,half,theta", ROTARY_CASES, ids=str)
def test_sin_cos(has_pos, kind, first_row, n, half, theta):
    """``sin_cos`` of a block's rows: as ``block_sin_cos`` (``PER_COLUMN``, exact trig) computes them
    for the rows of the block (all 64 for implicit positions), within float32 rounding of the
    angles of ``reference.rotary_angles`` (float64 here), and with the angles handed to
    ``sin/cos.approx`` in the range they are accurate in: [-pi, pi] at given positions, at most
    ``BLOCK_M`` radians past it at implicit ones (one reduction per column)."""
    start = 9
    pos = _positions(kind, start + BLOCK_M) if has_pos else torch.zeros(1, dtype=torch.int32)
    log2_theta = math.log2(theta)
    with gs.record_asm() as asm:
        sin, cos = sin_cos(gs.pointer(pos), start, n, first_row, log2_theta, BLOCK_M, half, half, has_pos, LAYOUT)
    assert sin.shape == cos.shape == (BLOCK_M, half) and sin.dtype == torch.float32

    if has_pos:
        at = pos[start:start + n].double()
    else:
        at = torch.arange(first_row, first_row + BLOCK_M, dtype=torch.float64)
    # float32 angles: a few ulps of the largest (exp2 differs by an ulp between torch and numpy).
    atol = 2e-6 + 8 * float(at.abs().max() + BLOCK_M) * 2**-24
    rows = slice(0, n) if has_pos else slice(None)
    want_sin, want_cos = torch.empty(BLOCK_M, half), torch.empty(BLOCK_M, half)
    _sin_cos_triton[(1,)](pos, want_sin, want_cos, start, n, first_row, log2_theta, BLOCK_M, half, has_pos)
    torch.testing.assert_close(sin[rows], want_sin[rows], rtol=0, atol=atol)
    torch.testing.assert_close(cos[rows], want_cos[rows], rtol=0, atol=atol)

    angles = reference.rotary_angles(at, theta, 2 * half, torch.float64)
    torch.testing.assert_close(sin[rows].double(), angles.sin(), rtol=0, atol=atol)
    torch.testing.assert_close(cos[rows].double(), angles.cos(), rtol=0, atol=atol)

    assert [name.split()[0] for name, _ in asm] == ["sin.approx.f32", "cos.approx.f32"]
    angle = asm[0][1]
    upper = math.pi + atol + (0 if has_pos else BLOCK_M)
    assert float(angle.min()) >= -math.pi - atol and float(angle.max()) <= upper


@pytest.mark.parametrize("has_pos", [False, True])
def test_sin_cos_rows(has_pos):
    """``sin_cos_rows(ROW0, ROWS)`` are rows ``ROW0 .. ROW0 + ROWS`` of ``sin_cos``, exactly (the
    backward's unrotation takes them 32 rows at a time)."""
    pos = gs.pointer(_positions("int", 200))
    whole = sin_cos(pos, 11, 50, 4160, math.log2(10000.0), BLOCK_M, 64, 24, has_pos, LAYOUT)
    for row0 in (0, 32):
        part = sin_cos_rows(pos, 11, 50, 4160, math.log2(10000.0), row0, 32, 64, 24, has_pos, LAYOUT)
        for got, want in zip(part, whole):
            assert torch.equal(got, want[row0:row0 + 32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("half", [32, 64])
def test_rotate_in_place(half, dtype):
    """``rotate_in_place`` of a tile's shared halves at ``sin_cos``'s angles is
    ``reference.apply_rotary`` of the row (split halves), rounded to the tile's dtype once."""
    g = torch.Generator().manual_seed(half)
    x = torch.randn(BLOCK_M, 2 * half, generator=g).to(dtype)
    first_row = 300
    no_pos = gs.pointer(torch.zeros(1, dtype=torch.int32))
    sin, cos = sin_cos(no_pos, 0, BLOCK_M, first_row, math.log2(10000.0), BLOCK_M, half, half, False, LAYOUT)
    a, b = x[:, :half].clone(), x[:, half:].clone()
    rotate_in_place(gs.shared(a), gs.shared(b), sin, cos, LAYOUT)
    angles = reference.rotary_angles(torch.arange(first_row, first_row + BLOCK_M), 10000.0, 2 * half, torch.float32)
    want = reference.apply_rotary(x.float()[:, None, :], angles, 2 * half, False)[:, 0].to(dtype)
    tol = dict(rtol=0, atol=4e-3) if dtype == torch.float16 else dict(rtol=0, atol=3e-2)
    torch.testing.assert_close(torch.cat([a, b], 1), want, **tol)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("has_pos", [False, True])
@pytest.mark.parametrize("head_dim,rot_dim,half", [(128, 64, 64), (96, 96, 64), (80, 48, 64), (48, 16, 32),
                                                   (64, 64, 32)])
def test_half_tiles_rotate_as_reference(head_dim, rot_dim, half, has_pos, interleaved):
    """A row tile split into the half tiles a and b by ``half_channels`` (columns past ``head_dim /
    2`` masked, as the kernels' copies do), rotated in place at ``sin_cos``'s angles of
    ``rot_dim / 2`` pairs, and put back by the same map, is ``reference.apply_rotary`` of the row
    with ``rotary_dim = rot_dim`` (split halves; pass-through channels unchanged): every channel is
    held once, the pairs meet in one column and the pass-through columns rotate by 0."""
    g = torch.Generator().manual_seed(head_dim + rot_dim)
    x = torch.randn(BLOCK_M, head_dim, generator=g)
    cols_a, cols_b = (c.long() for c in half_channels(torch.arange(half, dtype=torch.int32), head_dim, rot_dim, interleaved))
    held = head_dim // 2
    assert sorted(torch.cat([cols_a[:held], cols_b[:held]]).tolist()) == list(range(head_dim))
    a, b = torch.zeros(BLOCK_M, half), torch.zeros(BLOCK_M, half)
    a[:, :held], b[:, :held] = x[:, cols_a[:held]], x[:, cols_b[:held]]
    pos = _positions("int", BLOCK_M, 500)
    sin, cos = sin_cos(gs.pointer(pos), 0, BLOCK_M, 17, math.log2(10000.0), BLOCK_M, half, rot_dim // 2, has_pos,
                       LAYOUT)
    rotate_in_place(gs.shared(a), gs.shared(b), sin, cos, LAYOUT)
    got = torch.empty_like(x)
    got[:, cols_a[:held]], got[:, cols_b[:held]] = a[:, :held], b[:, :held]
    at = pos.double() if has_pos else torch.arange(17, 17 + BLOCK_M, dtype=torch.float64)
    angles = reference.rotary_angles(at, 10000.0, rot_dim, torch.float64)
    want = reference.apply_rotary(x.double()[:, None, :], angles, rot_dim, interleaved)[:, 0]
    # (float32 angles: a few ulps of the largest, times the largest channel.)
    atol = (2e-6 + 8 * float(at.max()) * 2**-24) * float(x.abs().max())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)
    assert torch.equal(got[:, rot_dim:], x[:, rot_dim:])


# ----------------------------------------------------------------------------- softmax
@triton.jit
def _probs_triton(S, P, n, qk_scale, BLOCK: tl.constexpr, IS_CAUSAL: tl.constexpr, RECIP: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = offs[:, None] * BLOCK + offs[None, :]
    tl.store(P + idx, block_probs(tl.load(S + idx), offs, offs < n, qk_scale, IS_CAUSAL, RECIP))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 7, 63, 64])
def test_probs(n, causal):
    """``_probs``: ``p * inv`` is the softmax (base 2, ``qk_scale`` = scale * log2 e) of the scores
    over the block's ``n`` keys (and the causal triangle), for every row (rows past ``n`` too:
    their outputs are masked at the store) as a torch softmax and ``block_probs`` have it; ``p``
    is 1 at each row's maximum and 0 off the mask, ``inv`` its rows' reciprocal sums."""
    g = torch.Generator().manual_seed(n)
    s = torch.randn(BLOCK_M, BLOCK_M, generator=g) * 4
    scale = 0.125
    p, inv = probs(s, n, scale * LOG2E, causal, BLOCK_M, LAYOUT)
    rows, cols = torch.arange(BLOCK_M)[:, None], torch.arange(BLOCK_M)[None, :]
    valid = ((cols < n) & ((rows >= cols) if causal else True)).expand(BLOCK_M, BLOCK_M)
    want = torch.softmax((s.double() * scale).masked_fill(~valid, float("-inf")), dim=1)
    torch.testing.assert_close((p * inv[:, None]).double(), want, rtol=0, atol=2e-6)
    assert (p[~valid] == 0).all()
    assert torch.equal(p.max(dim=1).values, torch.ones(BLOCK_M))
    torch.testing.assert_close(inv, 1.0 / p.sum(1), rtol=1e-6, atol=0)
    for recip in (False, True):
        triton_p = torch.empty(BLOCK_M, BLOCK_M)
        _probs_triton[(1,)](s, triton_p, n, scale * LOG2E, BLOCK_M, causal, recip)
        torch.testing.assert_close(p * inv[:, None], triton_p, rtol=0, atol=1e-6)
    # ``_probs_lse``: the same, and each row's natural-log logsumexp of the scaled scores.
    p_lse, inv_lse, lse = probs_lse(s, n, scale * LOG2E, causal, BLOCK_M, LAYOUT)
    assert torch.equal(p_lse, p) and torch.equal(inv_lse, inv)
    want_lse = torch.logsumexp((s.double() * scale).masked_fill(~valid, float("-inf")), dim=1)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- stores
def _sentinel(shape, dtype=torch.float16) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _assert_only_rows(out: torch.Tensor, writes: torch.Tensor, head: int, start: int, n: int, want) -> None:
    """``out[start:start+n, head]`` is ``want``, written once each; nothing else was written."""
    expected = torch.zeros_like(writes)
    expected[start:start + n, head] = 1
    assert torch.equal(writes, expected)
    torch.testing.assert_close(out[start:start + n, head].float(), want.float(), rtol=0, atol=2e-3)
    assert out.isnan().sum() == out.numel() - n * out.shape[-1]


@pytest.mark.parametrize("start,n", [(0, 64), (70, 1), (5, 37)])
def test_store_via(start, n):
    """``_store_via`` and ``_store_halves_tile_via`` (the head's column halves) store a tile's first
    ``n`` rows to rows ``start .. start + n`` of one head (through the shared buffer), and nothing else."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(BLOCK_M, 128, generator=g)
    for halves in (False, True):
        out = _sentinel((200, 3, 128))
        memory = gs.Memory(out, "O")
        ptr = gs.Pointer(memory) + 2 * out.stride(1)
        buf = gs.shared(_sentinel((BLOCK_M, 128)))
        if halves:
            store_halves_tile_via(buf, ptr, x[:, :64], x[:, 64:], start, n, 0, 0, out.stride(0), BLOCK_M, 128, 128,
                                  128, False, 4, 0)
        else:
            store_via(buf, ptr, x, start, n, out.stride(0), BLOCK_M, 128)
        _assert_only_rows(out, memory.writes_as_tensor(), 2, start, n, x[:n])


@pytest.mark.parametrize("head_dim,rot_dim,interleaved", [(128, 128, False), (128, 64, False), (96, 96, False),
                                                          (80, 48, False), (128, 128, True), (96, 64, True)])
@pytest.mark.parametrize("has_pos", [False, True])
@pytest.mark.parametrize("start,n,first_row", [(0, 64, 0), (70, 1, 4096), (5, 37, 64)])
def test_unrotate_store(start, n, first_row, has_pos, head_dim, rot_dim, interleaved):
    """``_unrotate_store`` (the rotary backward of 128-wide tiles, one query head per kv head): rows
    ``start .. start + n`` of the head get ``reference.apply_rotary(inverse=True)`` of the float32
    half tiles (their channels as ``half_channels`` maps them) times ``scale`` (at the block's
    positions, 32 rows at a time), and nothing else is written: no padding column."""
    half, scale = 64, 0.0884
    g = torch.Generator().manual_seed(start + n)
    a, b = torch.randn(BLOCK_M, half, generator=g), torch.randn(BLOCK_M, half, generator=g)
    pos = _positions("int", 200, top=5000)
    out = _sentinel((200, 2, head_dim))
    memory = gs.Memory(out, "DQ")
    ptr = gs.Pointer(memory) + out.stride(1)
    bufs = [gs.shared(_sentinel((BLOCK_M, 2 * half))) for _ in range(2)]
    unrotate_store(*bufs, a, b, ptr, gs.pointer(pos), start, n, first_row, math.log2(10000.0), scale, out.stride(0),
                   BLOCK_M, half, head_dim, rot_dim, interleaved, has_pos, 4)
    at = pos[start:start + n] if has_pos else torch.arange(first_row, first_row + n)
    angles = reference.rotary_angles(at, 10000.0, rot_dim, torch.float64)
    held = head_dim // 2
    cols_a, cols_b = (c.long()[:held] for c in half_channels(torch.arange(half, dtype=torch.int32), head_dim, rot_dim, interleaved))
    grad = torch.empty(BLOCK_M, head_dim)
    grad[:, cols_a], grad[:, cols_b] = a[:, :held], b[:, :held]
    want = reference.apply_rotary(grad[:n].double()[:, None, :], angles, rot_dim, interleaved, inverse=True)[:, 0]
    want = want * scale
    _assert_only_rows(out, memory.writes_as_tensor(), 1, start, n, want)


# ----------------------------------------------------------------------------- whole kernels
def _strides(**tensors) -> dict:
    return {f"stride_{name}{axis}": s for name, t in tensors.items() for axis, s in zip("thd", t.stride())}


class _Case:
    """Inputs of one kernel launch, in the launchers' contract (``sm90.block`` docstring), and the
    reference's arguments."""

    def __init__(self, lengths, heads, kv_heads, dim, rotary, has_pos, causal, block_size=64, dtype=torch.float16,
                 offsets_dtype=torch.int32, seed=0, int64=False, rot_dim=None, interleaved=False):
        g = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        self.offsets = _offsets(lengths, offsets_dtype)
        self.q, self.k, self.v, self.do = (
            torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
        self.sched = Schedule(self.offsets, total, block_size, None)
        pos = torch.randint(0, 5000, (total,), generator=g, dtype=torch.int32) if has_pos else None
        scale, theta = dim ** -0.5, 10000.0
        rot = (rot_dim or dim) if rotary else 0
        self.kv_heads = kv_heads
        self.values = dict(
            Q=self.q, K=self.k, V=self.v, DO=self.do, Sched=self.sched.table,
            Pos=pos if has_pos else self.sched.table, slots=self.sched.programs, num_seqs=self.sched.num_seqs,
            block_size=block_size, scale=scale, qk_scale=scale * LOG2E, log2_theta=math.log2(theta) if rotary else 0.0,
            kv_heads=kv_heads, GROUPS=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=max(BLOCK_M, tile_extent(block_size)),
            BLOCK_D=tile_extent(dim), ROT_DIM=rot, INTERLEAVED=interleaved, HAS_POS=has_pos, IS_CAUSAL=causal,
            INLINE_SEQS=self.sched.inline_seqs, INT64=int64, SLOT=0, SPLIT_GROUPS=1, OVERLAP=False, GROUP_PROGRAMS=0,
            CHUNKED=False,
        )
        self.reference = (self.offsets, block_size, scale, causal, theta if rotary else None, pos, rot, interleaved)

    def pack(self, block_size: int) -> int:
        """Launch as tiles of blocks (the ``hopper_packed`` variant): 64-row tiles of ``SLOT``-row
        blocks; returns the tiles' count (the grid's first extent)."""
        slot = tile_extent(block_size)
        self.values.update(SLOT=slot, BLOCK_M=BLOCK_M)
        return -(-self.sched.programs // (BLOCK_M // slot))

    def run_forward(self, kernel, grid, **constexprs):
        """``(o, launch)`` of the forward kernel on this case's inputs."""
        o = _sentinel(self.q.shape, self.q.dtype)
        run = gs.launch(kernel, grid, **dict(self.values, **constexprs), O=o,
                        **_strides(q=self.q, k=self.k, v=self.v, o=o))
        return o, run

    def forward_lse(self, grid, **constexprs):
        """The forward that also stores the logsumexp: o and lse as the reference has them, each
        element written once."""
        o = _sentinel(self.q.shape, self.q.dtype)
        lse = _sentinel((self.q.shape[1], self.q.shape[0]), torch.float32)
        run = gs.launch(HOPPER_FWD_LSE, grid, **dict(self.values, **constexprs), O=o, Lse=lse, stride_lh=lse.stride(0),
                        **_strides(q=self.q, k=self.k, v=self.v, o=o))
        assert torch.equal(run.writes("O"), torch.ones(o.shape, dtype=torch.int32))
        assert torch.equal(run.writes("Lse"), torch.ones(lse.shape, dtype=torch.int32))
        want, want_lse = reference.attention_forward_lse(self.q, self.k, self.v, *self.reference)
        _assert_close(o, want)
        # (With rotary the scores are of q and k rotated and rounded to their 16-bit dtype, as in
        # every rotary kernel: the logsumexp carries that rounding.)
        atol = 2e-5 if not self.values["ROT_DIM"] else 4e-3 if self.q.dtype == torch.float16 else 3e-2
        torch.testing.assert_close(lse, want_lse.float(), rtol=0, atol=atol)

    def run_backward(self, kernel, grid, **extra):
        """``((dq, dk, dv), launch)`` of the backward kernel on this case's inputs (``extra``: the
        kernel's own further arguments)."""
        dq, dk, dv = (_sentinel(x.shape, x.dtype) for x in (self.q, self.k, self.v))
        strides = _strides(q=self.q, k=self.k, v=self.v, do=self.do, dq=dq, dk=dk, dv=dv)
        return (dq, dk, dv), gs.launch(kernel, grid, **self.values, DQ=dq, DK=dk, DV=dv, **strides, **extra)

    def forward(self, kernel, grid, **constexprs):
        o, run = self.run_forward(kernel, grid, **constexprs)
        assert torch.equal(run.writes("O"), torch.ones(o.shape, dtype=torch.int32))
        want = reference.attention_forward(self.q, self.k, self.v, *self.reference)
        _assert_close(o, want)

    def backward(self, kernel, grid, **extra):
        grads, run = self.run_backward(kernel, grid, **extra)
        want = reference.attention_backward(self.do, self.q, self.k, self.v, *self.reference)
        for name, got, ref in zip(("DQ", "DK", "DV"), grads, want):
            assert torch.equal(run.writes(name), torch.ones(got.shape, dtype=torch.int32)), name
            _assert_close(got, ref, name)


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str = "O") -> None:
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < (3e-3 if got.dtype == torch.float16 else 2e-2), f"{name}: relative error {err:.2e}"


EDGE_LENGTHS = [0, 1, 63, 64, 65, 130, 0, 5]
KERNEL_CASES = {
    # name: (_Case arguments, keywords)
    "d64": ((EDGE_LENGTHS, 2, 2, 64, False, False, False), {}),
    "d128_gqa_causal": ((EDGE_LENGTHS, 4, 2, 128, False, False, True), {}),
    "d64_block32_mqa": ((EDGE_LENGTHS, 3, 1, 64, False, False, True), dict(block_size=32)),
    "d128_rope": ((EDGE_LENGTHS, 2, 2, 128, True, False, False), {}),
    "d128_rope_pos_causal_int64_offsets": ((EDGE_LENGTHS, 2, 2, 128, True, True, True),
                                           dict(offsets_dtype=torch.int64)),
    "d64_rope_causal": ((EDGE_LENGTHS, 2, 2, 64, True, False, True), {}),
    "d128_rope_gqa_pos": ((EDGE_LENGTHS, 4, 2, 128, True, True, False), {}),
    "d64_rope_gqa_block50_bf16": ((EDGE_LENGTHS, 4, 2, 64, True, False, True),
                                  dict(block_size=50, dtype=torch.bfloat16)),
    "d64_rope_table": (([0] * 510 + [65, 64, 1, 70], 1, 1, 64, True, False, True), {}),
    # 128-row tiles of two warpgroups; head dims padded to a power of two, or 32 / 256 wide; int64 rows.
    "d128_block128_causal": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 128, False, False, True), dict(block_size=128)),
    "d64_block100_rope_gqa": (([0, 1, 99, 100, 101, 250], 4, 2, 64, True, True, False), dict(block_size=100)),
    "d128_block128_rope": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 128, True, False, False), dict(block_size=128)),
    "d96_padded_gqa": ((EDGE_LENGTHS, 4, 2, 96, False, False, True), {}),
    "d80_padded_block128": (([3, 128, 200], 1, 1, 80, False, False, False), dict(block_size=128)),
    "d32_rope_causal": ((EDGE_LENGTHS, 2, 2, 32, True, False, True), {}),
    "d256": ((EDGE_LENGTHS, 1, 1, 256, False, False, False), {}),
    "d256_mqa_block16": ((EDGE_LENGTHS, 2, 1, 256, False, False, True), dict(block_size=16)),
    "d128_int64_rope_pos": ((EDGE_LENGTHS, 2, 2, 128, True, True, False), dict(int64=True)),
    # Grouped query heads at 128-row tiles (P read back for dS; rotary D128: dQ parked).
    "d128_block128_gqa_causal": (([0, 1, 127, 128, 129, 300, 5], 4, 2, 128, False, False, True), dict(block_size=128)),
    "d128_block128_rope_gqa_pos": (([0, 1, 127, 128, 129, 300, 5], 4, 1, 128, True, True, False),
                                   dict(block_size=128)),
    # Rotary on half tiles that are not the head's column halves (``rotary.half_channels``): padded
    # head dims (D96: pairs of 48 in 64-column half tiles) and partial rotary_dim (pass-through
    # channels at angle 0), through each way the backward rotates its gradients back.
    "d96_rope": ((EDGE_LENGTHS, 2, 2, 96, True, False, True), {}),
    "d96_rope_gqa_pos": ((EDGE_LENGTHS, 4, 2, 96, True, True, False), {}),
    "d128_partial64_rope_causal": ((EDGE_LENGTHS, 2, 2, 128, True, False, True), dict(rot_dim=64)),
    "d128_partial32_rope_gqa_block128": (([0, 1, 127, 128, 129, 300, 5], 4, 2, 128, True, True, False),
                                         dict(block_size=128, rot_dim=32)),
    "d64_partial32_rope_gqa": ((EDGE_LENGTHS, 4, 2, 64, True, False, True), dict(rot_dim=32)),
    "d48_rope_pos": ((EDGE_LENGTHS, 2, 2, 48, True, True, False), {}),
    "d80_partial48_rope_block128": (([3, 128, 0, 200, 1], 2, 2, 80, True, False, True),
                                    dict(block_size=128, rot_dim=48)),
    # Interleaved pairs (x[2i], x[2i+1]): gathered into the half tiles through registers.
    "d128_interleaved_rope": ((EDGE_LENGTHS, 2, 2, 128, True, False, True), dict(interleaved=True)),
    "d64_interleaved_rope_gqa_pos": ((EDGE_LENGTHS, 4, 2, 64, True, True, False), dict(interleaved=True)),
    "d96_interleaved64_rope_gqa_block128": (([0, 1, 127, 128, 129, 300, 5], 4, 2, 96, True, False, True),
                                            dict(block_size=128, rot_dim=64, interleaved=True)),
    "d128_interleaved_rope_gqa": ((EDGE_LENGTHS, 4, 2, 128, True, True, False), dict(interleaved=True)),
    # Rotary at D 144-256 on 64-row tiles: half tiles 128 wide rotated by 32-row chunks, the
    # gradients rotated back through the dead v and dO tiles.
    "d256_rope_causal": ((EDGE_LENGTHS, 2, 2, 256, True, False, True), {}),
    "d176_partial96_interleaved_rope_pos_block40": ((EDGE_LENGTHS, 1, 1, 176, True, True, False),
                                                    dict(block_size=40, rot_dim=96, interleaved=True)),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_hopper_kernels(name):
    """The ``hopper`` forward and backward kernels, whole, on jagged batches with empty, 1-row,
    ragged and full blocks: ``reference.attention_forward`` / ``attention_backward`` within half
    precision, every element of O, dQ, dK, dV stored exactly once (no row of another block, no
    padding slot stores). The forward also runs its kv-head loop (``HEAD_LOOP``: rotary, one query
    head per kv head); the rotary D128 backward with one query head per kv head rotates back
    through shared memory (``_unrotate_store``), the others in registers."""
    args, keywords = KERNEL_CASES[name]
    case = _Case(*args, **keywords)
    programs, kv_heads = case.sched.programs, case.kv_heads
    case.forward(HOPPER_FWD, (programs, kv_heads), HEAD_LOOP=False)
    if case.values["ROT_DIM"] and case.values["GROUPS"] == 1:
        case.forward(HOPPER_FWD, (programs, 1), HEAD_LOOP=True)
    case.backward(HOPPER_BWD, (programs, kv_heads))


WIDE_KERNEL_CASES = {
    # name: (_Case arguments, keywords): blocks of 65-128 rows at D > 128, one query head per kv head.
    "d256_block128": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, False, False, False), dict(block_size=128)),
    "d192_block100_causal_bf16": (([0, 1, 99, 100, 101, 250], 1, 1, 192, False, False, True),
                                  dict(block_size=100, dtype=torch.bfloat16)),
    "d144_block65_int64": (([3, 65, 0, 66, 130, 1], 1, 1, 144, False, False, True), dict(block_size=65, int64=True)),
    # Rotary: q and k as half tiles rotated in place, dK and dQ parked in float32 and rotated back.
    "d256_rope_block128_causal": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, True, False, True),
                                  dict(block_size=128)),
    "d192_rope_pos_block100_bf16": (([0, 1, 99, 100, 101, 250], 1, 1, 192, True, True, False),
                                    dict(block_size=100, dtype=torch.bfloat16)),
    "d256_partial128_interleaved_block128": (([3, 128, 0, 200], 1, 1, 256, True, False, False),
                                             dict(block_size=128, rot_dim=128, interleaved=True)),
    "d144_partial64_rope_pos_block65_int64": (([3, 65, 0, 66, 130, 1], 1, 1, 144, True, True, True),
                                              dict(block_size=65, rot_dim=64, int64=True)),
}


@pytest.mark.parametrize("name", list(WIDE_KERNEL_CASES))
def test_hopper_wide_backward_kernel(name):
    """The ``hopper_wide`` backward (``sm90.wide``: v by column halves through the tile that then holds P
    and dS, each gradient stored through a dead tile; with rotary in each form, the gradients rotated
    back from float32 parked in dead tiles), whole: ``reference.attention_backward`` within half
    precision, every element of dQ, dK, dV stored exactly once, channels past the head not read as
    data (tiles padded to 256)."""
    args, keywords = WIDE_KERNEL_CASES[name]
    case = _Case(*args, **keywords)
    unused = torch.zeros(1, dtype=torch.int32)  # no sums over a group here (``GROUP_SUMS`` 0)
    case.backward(WIDE_BWD, (case.sched.programs, case.kv_heads), Counts=unused, DK_SUM=unused, DV_SUM=unused,
                  stride_dkst=0, stride_dvst=0, GROUP_SUMS=False)


class _ShimLauncher:
    """A stand-in for a variant's backward launcher: the Gluon kernel run by the shim, its
    positional arguments named by the kernel's parameters; every launch recorded (``launches``: grid,
    k's head stride, dK's shape; ``runs``: the arguments and the shim's ``Launch``)."""

    def __init__(self, launcher):
        self.real, self.launches, self.runs = launcher, [], []

    def constexpr_names(self) -> list:
        return self.real.constexpr_names()

    def __call__(self, grid, args, meta, q, meta_key=None):
        names = [p.name for p in self.real.kernel.params if not p.is_constexpr]
        values = dict(zip(names, args), **meta)
        self.launches.append((tuple(grid), values["K"].stride(1), values["DK"].shape))
        self.runs.append((values, gs.launch(self.real.kernel, grid, **values)))


GROUPED_BY_HEAD_CASES = {
    # name: (variant, heads, kv_heads, dim, block, rotary, causal, dtype)
    "wide_gqa_d256_block128_causal": ("hopper_wide", 4, 2, 256, 128, False, True, torch.float16),
    "wide_mqa_d192_rope_block100_bf16": ("hopper_wide", 3, 1, 192, 100, True, False, torch.bfloat16),
    "wide_gqa3_d192_block100": ("hopper_wide", 6, 2, 192, 100, False, False, torch.float16),
    "heads_gqa_d96_rope_block128_causal": ("hopper_heads", 4, 2, 96, 128, True, True, torch.float16),
    "heads_mqa_d128_rope_block100_bf16": ("hopper_heads", 2, 1, 128, 100, True, False, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(GROUPED_BY_HEAD_CASES))
def test_backward_of_grouped_heads_one_by_one(monkeypatch, name):
    """``hopper_wide``'s and ``hopper_heads``' backward of grouped query heads as ``block.bwd``
    launches it (``Variant.group_partials``): kv head by kv head, k and v repeated by a zero head
    stride, each query head's dK and dV summed over the group (without rotary by ``hopper_wide``'s kernel
    itself, ``sm90.group_sums``, by the last of a block's programs to arrive; else by ``common.head_sums``
    under the interpreter), the Gluon kernel through the shim: dq, dk, dv as
    ``reference.attention_backward`` has them."""
    from blockattn_layers.kernels.block import bwd, variants

    kind, heads, kv_heads, dim, block, rotary, causal, dtype = GROUPED_BY_HEAD_CASES[name]
    lengths = [0, 1, block - 1, block, block + 1, 2 * block + 3, 5]
    case = _Case(lengths, heads, kv_heads, dim, rotary, False, causal, block_size=block, dtype=dtype)
    if kind == "hopper_wide":
        launcher = _ShimLauncher(sm90_wide.launch_bwd)
        variant = variants.HOPPER_WIDE._replace(kernels=lambda: (None, launcher), verified_on=None)
        if not rotary:  # the kernel sums the group (``plan.group_sums_in_launch``)
            monkeypatch.setattr(bwd, "sum_head_groups", None)
    else:  # (its launches are hopper's: ``Variant.kernels_of``)
        launcher = _ShimLauncher(sm90_block.launch_bwd)
        monkeypatch.setitem(variants.VARIANTS, "hopper",
                            variants.HOPPER._replace(kernels=lambda: (None, launcher)))
        variant = variants.HOPPER_HEADS._replace(verified_on=None)
    offsets, _, scale, _, theta, pos, rot, interleaved = case.reference
    got = bwd.block_attention_bwd(case.do, case.q, case.k, case.v, offsets, block, scale, causal, theta, pos, rot,
                                  interleaved, None, variant)
    groups = heads // kv_heads
    assert launcher.launches == [((case.sched.programs, groups), 0, (case.q.shape[0], groups, dim))] * kv_heads
    want = reference.attention_backward(case.do, case.q, case.k, case.v, *case.reference)
    for label, g, ref in zip(("DQ", "DK", "DV"), got, want):
        _assert_close(g, ref, label)
    assert all(values["GROUP_PROGRAMS"] == groups for values, _ in launcher.runs)
    if kind == "hopper_wide" and not rotary:
        # One arrival per program at its block's counter, one sum by the last: every row of each kv
        # head's dK and dV written once.
        blocks = sum(-(-n // block) for n in lengths)
        for values, run in launcher.runs:
            assert values["GROUP_SUMS"]
            counts = values["Counts"]
            assert int((counts == groups).sum()) == blocks and int((counts != 0).sum()) == blocks
            for name in ("DK_SUM", "DV_SUM"):
                assert torch.equal(run.writes(name), torch.ones(values[name].shape, dtype=torch.int32)), name


def test_in_launch_group_sums_are_self_checked(monkeypatch):
    """Where ``hopper_wide`` runs unverified (self-checked at first use, ``block.self_check``), the sums
    it makes in the launch are compared too, not only its partials: sums gone wrong disable it with a
    warning naming them, and the gradients are the simple kernels' partials summed after."""
    from blockattn_layers.kernels.block import bwd, self_check, variants

    monkeypatch.setattr(self_check, "_DISABLED", {})
    monkeypatch.setattr(self_check, "_PASSED", set())
    block, heads, kv_heads, dim = 100, 4, 2, 192
    case = _Case([0, 1, block + 1, 5], heads, kv_heads, dim, False, False, False, block_size=block)
    launcher = _ShimLauncher(sm90_wide.launch_bwd)

    def wrong_sums(grid, args, meta, q, meta_key=None):
        launcher(grid, args, meta, q, meta_key)
        values = launcher.runs[-1][0]
        assert values["GROUP_SUMS"]
        values["DK_SUM"].add_(1.0)  # the partials stay right

    wrong_sums.constexpr_names = launcher.constexpr_names
    variant = variants.HOPPER_WIDE._replace(kernels=lambda: (None, wrong_sums), verified_on=frozenset())
    offsets, _, scale, _, theta, pos, rot, interleaved = case.reference
    with pytest.warns(RuntimeWarning, match="dk sums"):
        got = bwd.block_attention_bwd(case.do, case.q, case.k, case.v, offsets, block, scale, False, theta, pos, rot,
                                      interleaved, None, variant)
    want = reference.attention_backward(case.do, case.q, case.k, case.v, *case.reference)
    for label, g, ref in zip(("DQ", "DK", "DV"), got, want):
        _assert_close(g, ref, label)


WIDE_ROTARY_FORWARD_CASES = {
    # name: (_Case arguments, keywords, SPLIT_GROUPS): rotary at D 144-256, half tiles 128 wide
    # rotated 32 rows at a time (``rotary.rotate_rows_in_place``).
    "d256_rope_block128_causal": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, True, False, True),
                                  dict(block_size=128), 1),
    "d192_rope_pos_gqa_split_bf16": ((EDGE_LENGTHS, 4, 2, 192, True, True, False), dict(dtype=torch.bfloat16), 2),
    "d256_interleaved128_block100": (([0, 1, 99, 100, 101, 250], 1, 1, 256, True, False, False),
                                     dict(block_size=100, rot_dim=128, interleaved=True), 1),
}


@pytest.mark.parametrize("name", list(WIDE_ROTARY_FORWARD_CASES))
def test_hopper_rotary_forward_of_wide_heads(name):
    """The hopper forward with rotary at head dims over 128 (its half tiles rotated by 32-row
    chunks), whole, with and without the logsumexp: as ``reference.attention_forward`` /
    ``attention_forward_lse`` have it, every element stored once; one program per kv head or per
    query head (``SPLIT_GROUPS``)."""
    args, keywords, split = WIDE_ROTARY_FORWARD_CASES[name]
    case = _Case(*args, **keywords)
    heads = (case.q.shape[1], dict(GROUPS=1, SPLIT_GROUPS=split)) if split > 1 else (case.kv_heads, {})
    case.forward(HOPPER_FWD, (case.sched.programs, heads[0]), HEAD_LOOP=False, **heads[1])
    case.forward_lse((case.sched.programs, heads[0]), HEAD_LOOP=False, **heads[1])


LSE_KERNEL_CASES = {
    # name: (_Case arguments, keywords, SPLIT_GROUPS); blocks over 64 at D > 128, where the forward
    # with gradients stores the logsumexp for the flash backward.
    "d256_block128_causal": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, False, False, True), dict(block_size=128), 1),
    "d144_block100_mqa": (([0, 1, 99, 100, 101, 250], 3, 1, 144, False, False, False), dict(block_size=100), 1),
    "d192_block128_gqa_split": (([3, 128, 0, 200], 4, 2, 192, False, False, True), dict(block_size=128), 2),
    # Grouped query heads at D 128 (their backward runs the flash kernel with dQ stored), as the launch splits
    # them: lse stored from the scores' rows, blocks of 1-128 rows and empty ones.
    "d128_block128_gqa_split": (([0, 1, 65, 127, 128, 129, 300, 5], 8, 2, 128, False, False, False),
                                dict(block_size=128), 4),
    "d128_block100_mqa_split_causal": (([1, 99, 100, 101, 0, 250], 4, 1, 128, False, False, True),
                                       dict(block_size=100), 4),
}


@pytest.mark.parametrize("name", list(LSE_KERNEL_CASES))
def test_hopper_forward_lse_kernel(name):
    """The hopper forward that also stores each query row's logsumexp (``_hopper_fwd_lse_kernel``),
    whole: o and lse as ``reference.attention_forward_lse`` has them, every element of each stored
    once, one program per kv head and its query heads or per query head (``SPLIT_GROUPS``)."""
    args, keywords, split = LSE_KERNEL_CASES[name]
    case = _Case(*args, **keywords)
    if split > 1:
        case.forward_lse((case.sched.programs, case.q.shape[1]), HEAD_LOOP=False, GROUPS=1, SPLIT_GROUPS=split)
    else:
        case.forward_lse((case.sched.programs, case.kv_heads), HEAD_LOOP=False)


CHUNKED_CASES = {
    # name: (_Case arguments, keywords, query heads per program's kv head split over programs): 128-row tiles
    # of head dims 144-256 in 64-channel chunks (``sm90.chunked``), four chunks or three (D 144-192).
    "d256_block128": (([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, False, False, False), dict(block_size=128), 1),
    "d192_block100_causal_bf16": (([0, 1, 99, 100, 101, 250], 1, 1, 192, False, False, True),
                                  dict(block_size=100, dtype=torch.bfloat16), 1),
    "d144_block65_causal_int64": (([3, 65, 0, 66, 130, 1], 1, 1, 144, False, False, True),
                                  dict(block_size=65, int64=True), 1),
    "d208_block128_gqa": (([1, 127, 128, 0, 250], 4, 2, 208, False, False, False), dict(block_size=128), 2),
    "d256_block128_mqa_causal": (([1, 127, 128, 0, 250], 4, 1, 256, False, False, True), dict(block_size=128), 4),
}


@pytest.mark.parametrize("name", list(CHUNKED_CASES))
def test_hopper_chunked_forward(name):
    """The hopper forward of 128-row tiles of wide heads in 64-channel chunks (``CHUNKED``), whole, with and
    without the logsumexp: ``reference.attention_forward(_lse)`` within half precision, every element of O
    (and lse) stored once, one program per query head (``SPLIT_GROUPS`` where the heads are grouped). The
    shim lands each ``cp.async`` group only at its wait, so a wait that leaves a chunk's copy in flight reads
    the ring's NaN fill."""
    args, keywords, split = CHUNKED_CASES[name]
    case = _Case(*args, **keywords)
    assert case.values["BLOCK_M"] == 128 and case.values["BLOCK_D"] == 256
    grid = (case.sched.programs, case.q.shape[1])
    chunked = dict(HEAD_LOOP=False, GROUPS=1, SPLIT_GROUPS=split, CHUNKED=True)
    case.forward(HOPPER_FWD, grid, **chunked)
    case.forward_lse(grid, **chunked)


@pytest.mark.parametrize("head_dim", [144, 192, 208, 256])
def test_chunked_ring_schedule(head_dim):
    """``sm90.chunked``'s ring: v's chunk ``j`` is copied once the product of score chunk ``NCH - 3 + j // 2``
    is done, into that product's pair (the shim lands copies only at their waits, so it cannot see a copy
    overwriting a pair a later score chunk still reads: this checks the slots against the schedule)."""
    nch = chunked.chunk_count(head_dim)
    assert nch == -(-head_dim // 64)
    slots = [chunked.v_slot(head_dim, j) for j in range(nch)]
    assert len(set(slots)) == nch
    for j, slot in enumerate(slots):
        issued_after = nch - 3 + j // 2
        assert slot // 2 == issued_after % 3
        assert not any(c % 3 == slot // 2 for c in range(issued_after + 1, nch)), "a later score chunk's pair"
    assert sum(chunked.chunk_cols(head_dim, j) for j in range(nch)) == head_dim


def test_hopper_chunked_forward_keeps_nan_in_its_block():
    """A NaN in one block's v (and an infinity in another's q) reaches no other block's output: rows past a
    block are zero-filled in every chunk's copy."""
    case = _Case([0, 1, 127, 128, 129, 300, 5], 2, 2, 256, False, False, False, block_size=128)
    case.v[130, 1, 200] = float("nan")  # block [128, 256) of the fourth sequence, kv head 1
    case.q[5, 0, 3] = float("inf")  # the third sequence's first block, head 0
    o, _ = case.run_forward(HOPPER_FWD, (case.sched.programs, 2), HEAD_LOOP=False, CHUNKED=True)
    bad = ~torch.isfinite(o.float())
    rows = torch.nonzero(bad.any(dim=2).any(dim=1)).flatten().tolist()
    assert set(rows) <= set(range(128, 256)) | {5}, rows
    assert bad[128:256, 1].any() and not bad[:128, 1].any() and not bad[256:, 1].any()


PACKED_LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 0, 64, 65, 7, 130, 5]
PACKED_KERNEL_CASES = {
    # name: (_Case arguments, keywords); blocks of up to 32 tokens, 2 or 4 to a 64-row tile.
    "d64_block16": ((PACKED_LENGTHS, 2, 2, 64, False, False, False), dict(block_size=16)),
    "d128_block32_gqa_causal": ((PACKED_LENGTHS, 4, 2, 128, False, False, True), dict(block_size=32)),
    "d96_block20_mqa_causal_bf16": ((PACKED_LENGTHS, 3, 1, 96, False, False, True),
                                    dict(block_size=20, dtype=torch.bfloat16)),
    "d32_block5_table_int64": (([0] * 510 + [3, 5, 6, 1, 11, 0, 40], 2, 1, 32, False, False, False),
                               dict(block_size=5, offsets_dtype=torch.int64, int64=True)),
    "d256_block16": ((PACKED_LENGTHS, 1, 1, 256, False, False, False), dict(block_size=16)),
    "d128_block3_gqa": (([0, 1, 3, 70], 8, 2, 128, False, False, True), dict(block_size=3)),
    # Rotary at each row's position in its sequence, or at given positions.
    "d64_rope_block16_causal": ((PACKED_LENGTHS, 2, 2, 64, True, False, True), dict(block_size=16)),
    "d32_rope_pos_gqa_block32_int64": ((PACKED_LENGTHS, 4, 2, 32, True, True, False),
                                       dict(block_size=32, offsets_dtype=torch.int64, int64=True)),
    "d64_rope_pos_table_block20": (([0] * 510 + [3, 20, 21, 1, 45, 0, 64], 2, 1, 64, True, True, True),
                                   dict(block_size=20)),
    "d128_rope_gqa_block16_forward": ((PACKED_LENGTHS, 4, 2, 128, True, False, True), dict(block_size=16)),
    "d48_partial16_rope_block16_causal": ((PACKED_LENGTHS, 2, 2, 48, True, False, True),
                                          dict(block_size=16, rot_dim=16)),
    "d96_rope_pos_gqa_block32_forward": ((PACKED_LENGTHS, 4, 2, 96, True, True, False), dict(block_size=32)),
    "d64_interleaved32_rope_block16_causal": ((PACKED_LENGTHS, 2, 2, 64, True, False, True),
                                              dict(block_size=16, rot_dim=32, interleaved=True)),
    "d128_rope_block16_causal": ((PACKED_LENGTHS, 2, 2, 128, True, False, True), dict(block_size=16)),
    "d96_partial64_rope_pos_gqa_block32": ((PACKED_LENGTHS, 4, 1, 96, True, True, False),
                                           dict(block_size=32, rot_dim=64)),
}


@pytest.mark.parametrize("name", list(PACKED_KERNEL_CASES))
def test_hopper_packed_kernels(name):
    """The hopper kernels on 64-row tiles of several blocks (``SLOT`` > 0: ``hopper_packed``), whole:
    each block's rows attend to their own block only (``reference.attention_forward`` /
    ``attention_backward``), empty slots past the last block and empty sequences write nothing, and
    every element of O, dQ, dK, dV is stored exactly once (no tile is done again block by block:
    its inputs are finite). Rotary rows at their own positions (``sin_cos_at``), their gradients
    rotated back in registers at every width."""
    args, keywords = PACKED_KERNEL_CASES[name]
    case = _Case(*args, **keywords)
    tiles = case.pack(keywords["block_size"])
    case.forward(HOPPER_FWD, (tiles, case.kv_heads), HEAD_LOOP=False)
    if not name.endswith("_forward"):
        case.backward(HOPPER_BWD, (tiles, case.kv_heads))


@pytest.mark.parametrize("block_size,token", [(16, 20), (32, 40), (16, 3)])
def test_hopper_packed_nan_stays_in_its_block(block_size, token):
    """A NaN in one token's q, k, v and dO of a tile of blocks: the tile is done again block by block
    (forward: its first head's output is not finite; backward: its raw scores or dO V^T are not),
    so the other blocks' outputs and gradients are bitwise those of the clean inputs, and the NaN's
    block has NaN. Checked to fail without the block-by-block passes."""
    lengths = [3, 2 * block_size + 9, 0, 1, block_size + 1]
    first = {20: 3 + 16, 40: 3 + 32, 3: 3}[token]
    results = []
    for poison in (False, True):
        case = _Case(lengths, 4, 2, 64, False, False, True, block_size=block_size, seed=3)
        if poison:
            for x in (case.q, case.k, case.v, case.do):
                x[token] = float("nan")
        tiles = case.pack(block_size)
        o, _ = case.run_forward(HOPPER_FWD, (tiles, case.kv_heads), HEAD_LOOP=False)
        grads, _ = case.run_backward(HOPPER_BWD, (tiles, case.kv_heads))
        results.append((o, *grads))
    block = torch.zeros(sum(lengths), dtype=torch.bool)
    block[first:first + block_size] = True
    for name, clean, poisoned in zip(("O", "DQ", "DK", "DV"), *results):
        assert torch.equal(clean[~block], poisoned[~block]), name
        assert poisoned[block].isnan().any(), name
        assert not clean.isnan().any(), name


WS_CASES = {
    "d64": ((EDGE_LENGTHS, 2, 2, 64, False, False, False), {}),
    "d128_causal": ((EDGE_LENGTHS, 2, 2, 128, False, False, True), {}),
    "d128_rope": ((EDGE_LENGTHS, 2, 2, 128, True, False, True), {}),
    "d64_rope_pos_int64_offsets": ((EDGE_LENGTHS, 2, 2, 64, True, True, False), dict(offsets_dtype=torch.int64)),
    "d64_table": (([0] * 510 + [64, 1, 130, 5], 1, 1, 64, False, False, False), {}),
}


@pytest.mark.parametrize("name", list(WS_CASES))
def test_hopper_ws_kernels(name):
    """The experimental ``hopper_ws`` kernels, whole, on a persistent grid of 3 programs (each
    with several tiles, so the 2-stage ring wraps): the loader's TMA boxes for full blocks and
    bare arrivals for the others, the compute partition's masked copies, the TMA and masked
    stores; the mbarriers' arrivals and bytes balance, every barrier is invalidated
    (``persistent.drop_ring``), and the results match the reference, each element stored once."""
    args, keywords = WS_CASES[name]
    case = _Case(*args, **keywords)
    case.forward(WS_FWD, (3,))
    case.backward(WS_BWD, (3,))


@pytest.mark.parametrize("block_size,slot", [(100, False), (64, False), (16, True)])
def test_hopper_grouped_query_layouts(block_size, slot):
    """Grouped-query heads as the plan may launch them: the forward with one program per query head
    (``SPLIT_GROUPS``, ``GROUPS`` 1, the grid over the query heads and taken in launch order as
    (tile, head)), and the backward with each head's products in flight together (``OVERLAP``; 64-row
    tiles of D <= 64 without rotary): the float64 reference within half precision, every element
    stored exactly once."""
    case = _Case([0, 1, 5, block_size, block_size + 3, 2 * block_size + 7, 0, 40], 8, 2, 64, False, False, True,
                 block_size=block_size, seed=5)
    grid = case.pack(block_size) if slot else case.sched.programs
    groups = case.values["GROUPS"]
    case.values.update(SPLIT_GROUPS=groups, GROUPS=1)
    case.forward(HOPPER_FWD, (grid, case.kv_heads * groups), HEAD_LOOP=False)
    case.values.update(SPLIT_GROUPS=1, GROUPS=groups, OVERLAP=True)
    case.backward(HOPPER_BWD, (grid, case.kv_heads))


def test_the_shim_keeps_an_asynchronous_product_pending_until_its_wait():
    """The shim's model of asynchronous ``warpgroup_mma`` that these kernels' order of waits rests
    on: products complete oldest first, a wait leaving ``num_outstanding`` products in flight hands
    those back still pending, and a pending product cannot be used except as an accumulator."""
    mma, wait = gs.warpgroup_mma_functions()
    a = gs.shared(torch.eye(4, dtype=torch.float16))
    b = gs.shared(torch.arange(16, dtype=torch.float16).reshape(4, 4))
    zero = torch.zeros(4, 4)
    first = mma(a, b, zero, use_acc=False, is_async=True)
    second = mma(a, b, zero, use_acc=False, is_async=True)
    chained = mma(a, b, second, is_async=True)  # accumulates on the pending one: allowed
    done, still = wait(num_outstanding=1, deps=(first, chained))
    assert torch.equal(done, b.data.float())
    assert isinstance(still, gs.PendingProduct)
    with pytest.raises((TypeError, RuntimeError)):
        torch.exp2(still)
    assert torch.equal(wait(num_outstanding=0, deps=(still,)), 2 * b.data.float())
