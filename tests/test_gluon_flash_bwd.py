"""The warp-specialized Gluon flash backward's dK/dV pass (``kernels.sm90.flash_bwd``) on CPU
tensors through ``tests/gluon_shim.py`` (Gluon has no interpreter): the whole kernel (loader and
two consumer partitions in threads, the q / dO ring, the shared dS tiles the two consumers meet
on, the ``cp.async`` copies of lse and delta, tensor maps over each block's rows) on the flash
tile table of 128-row key tiles, against the float64 reference gradients: dK and dV stored once
each and nothing outside the tensors, dQ's float32 sums added once per key tile. What the shim does
not model (timing, warps within a partition, layouts) is in its docstring."""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tests next to Triton's interpreter (the tile table runs there)"),
    pytest.mark.usefixtures("single_thread"),
]

from blockattn_layers import reference  # noqa: E402
from blockattn_layers.kernels.common.meta import LOG2E  # noqa: E402
from blockattn_layers.kernels.flash.schedule import FlashSchedule  # noqa: E402
from blockattn_layers.kernels.sm90 import flash_bwd  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402
from tests.oracle import offsets_from_lengths, rel_err  # noqa: E402

# (lengths, heads, kv heads, head dim, block size (0: full attention), causal)
CASES = {
    "full-d64": ([0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 5], 2, 2, 64, 0, False),
    "full-gqa-causal-d128": ([1, 200, 0, 64, 257], 4, 1, 128, 0, True),
    "blocks256-causal-d64": ([300, 5, 513, 0], 2, 1, 64, 256, True),
    "blocks192-gqa-d128": ([191, 192, 193, 400], 4, 2, 128, 192, False),
    "blocks128-gqa-d128": ([1, 127, 128, 129, 0, 300, 64], 4, 1, 128, 128, False),
    "blocks100-causal-d128": ([99, 100, 101, 0, 250, 1], 2, 2, 128, 100, True),
    "blocks64-gqa-causal-d128": ([63, 64, 65, 130, 0, 1], 4, 2, 128, 64, True),
    "blocks128-gqa-causal-d64": ([1, 127, 128, 129, 0, 300, 64], 4, 1, 64, 128, True),
    "blocks48-d64": ([47, 48, 49, 0, 100, 1], 2, 2, 64, 48, False),
    "blocks128-gqa-d96": ([1, 127, 128, 129, 0, 300, 64], 4, 1, 96, 128, False),
    "blocks100-gqa-causal-d96": ([99, 100, 101, 0, 250, 1], 4, 2, 96, 100, True),
}
# The cases the kernel also runs adding dQ's terms to float32 sums (D 96 only with dQ stored: PADDED_HEAD_DIMS).
SUMMED = [name for name, case in CASES.items() if case[3] not in flash_bwd.PADDED_HEAD_DIMS]


def _inputs(lengths, heads, kv_heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, do = (torch.randn(total, heads, dim, generator=g).to(torch.float16) for _ in range(2))
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(torch.float16) for _ in range(2))
    return q, k, v, do


def _run(q, k, v, do, offsets, block_size, causal, deterministic=False, writer=False, early_p=False, with_dq=True,
         block_m=flash_bwd.TILE_M, rows_by_loader=False, thread_release=False, dq_lag=False, stagger=False,
         dq_store=False, delta_in_kernel=False, unrotate=None):
    """``(dq, dk, dv, run, counters)`` of the kernel given float64 reference ``o`` and ``lse``
    (``writer``: dQ's adds by the writer partition, ``DQ_WRITER``; ``early_p``: ``P_BESIDE_DP``;
    ``with_dq``: ``WITH_DQ``; ``block_m``: query rows per step, ``BLOCK_M``; ``rows_by_loader``: lse and delta
    copied by the loader, ``ROWS_BY_LOADER``; ``thread_release``: slots released by every consumer thread,
    ``THREAD_RELEASE``; ``dq_lag``: each step's dQ product the step before's, ``DQ_LAG``; ``stagger``:
    ``STAGGER``; ``dq_store``: dQ itself stored, ``DQ_STORE``, and returned as the first element;
    ``delta_in_kernel``: the delta rows computed from O in the kernel, ``DELTA_IN_KERNEL``, the delta tensor NaN;
    ``unrotate``: ``(rope_theta, positions, rotary_dim, interleaved)``, dQ and dK rotated back, ``ROT_DIM``, q and
    k in the paired-chunk order where ``pair_chunk``, ``PAIR_CHUNK``)."""
    total, heads, dim = q.shape
    kv_heads = k.shape[1]
    scale = dim ** -0.5
    d = [x.double() for x in (q, k, v)]
    o, lse = reference.attention_forward_lse(*d, offsets, block_size or None, scale, causal)
    delta = (do.double() * o).sum(-1).t().contiguous().float()
    if delta_in_kernel:
        delta = torch.full_like(delta, float("nan"))  # never read
    out = o.to(q.dtype)
    sched = FlashSchedule(offsets, total, block_size, flash_bwd.TILE_N, None, longest_first=block_size == 0)
    table = flash_bwd.key_tile_table(sched, causal, deterministic)
    theta, positions, rot, interleaved = unrotate or (1.0, None, 0, False)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    sums = torch.full_like(q, float("nan")) if dq_store else torch.zeros(q.shape)
    counters = torch.zeros((heads, total, 2), dtype=torch.int32)
    run = gs.launch(
        flash_bwd._flash_bwd_ws_kernel, (sched.programs * kv_heads,), Q=q, K=k, V=v, DO=do, DK=dk, DV=dv, DQA=sums,
        Sem=counters, stride_sh=2 * total, DETERMINISTIC=deterministic, Lse=lse, Delta=delta, O=out,
        stride_ot=out.stride(0), DELTA_IN_KERNEL=delta_in_kernel,
        Table=table, Pos=table if positions is None else positions, log2_theta=math.log2(theta), ROT_DIM=rot,
        INTERLEAVED=interleaved, HAS_POS=positions is not None, PAIR_CHUNK=flash_bwd.pair_chunk(dim, rot, interleaved),
        slots=sched.programs, heads=heads,
        kv_heads=kv_heads, qk_scale=scale * LOG2E, scale=scale, stride_qt=q.stride(0), stride_kt=k.stride(0),
        stride_vt=v.stride(0), stride_dot=do.stride(0), stride_dkt=dk.stride(0), stride_dvt=dv.stride(0),
        stride_lh=lse.stride(0), stride_qat=sums.stride(0), stride_qah=sums.stride(1),
        HEAD_DIM=flash_bwd.tile_head_dim(dim), DIM=dim,
        GROUPS=heads // kv_heads, BLOCK_M=block_m, BLOCK_N=flash_bwd.TILE_N,
        DQ_COLS=flash_bwd.dq_cols(dim), IS_CAUSAL=causal, DQ_WRITER=writer, P_BESIDE_DP=early_p, WITH_DQ=with_dq,
        ROWS_BY_LOADER=rows_by_loader, THREAD_RELEASE=thread_release, DQ_LAG=dq_lag, STAGGER=stagger,
        LEAN_WRITER=dq_lag, DQ_STORE=dq_store,
    )
    return sums if dq_store else sums * scale, dk, dv, run, counters


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
@pytest.mark.parametrize("name", SUMMED + [f"writer-{c}" for c in SUMMED]
                         + ["p-beside-dp-full-d64", "p-beside-dp-full-gqa-causal-d128"]
                         + [f"rows-by-loader-{c}" for c in ("writer-full-d64", "writer-full-gqa-causal-d128",
                                                             "blocks256-causal-d64")]
                         + [f"thread-release-{c}" for c in ("rows-by-loader-writer-full-gqa-causal-d128",
                                                            "writer-full-d64")]
                         + ["dq-lag-writer-full-gqa-causal-d128", "dq-lag-writer-blocks192-gqa-d128",
                            "dq-lag2-writer-full-gqa-causal-d128",
                            "stagger-writer-full-gqa-causal-d128",
                            "stagger-thread-release-rows-by-loader-writer-blocks192-gqa-d128"])
def test_flash_ws_backward_matches_the_reference(monkeypatch, name, deterministic):
    """Gradients against float64; each dK, dV element stored once; dQ's sums added once per key tile
    meeting the row (twice at D 64); ``DETERMINISTIC``: every query tile's counters end at the adds it
    got, and no key tile waits for a count that never comes (the shim's programs run one at a time,
    first key tiles first, so each turn must already have come). ``writer-``: the adds by
    the writer partition (``DQ_WRITER``), by TMA reduce-adds: ordered, one per element and key tile
    whatever D (at D 64 the warpgroups' terms summed first), counted in slot 0; in any order each
    warpgroup's tile; ``p-beside-dp-``: P computed while dP's product runs (``P_BESIDE_DP``);
    ``rows-by-loader-``: lse and delta copied by the loader into the ring's slots (``ROWS_BY_LOADER``);
    ``thread-release-``: the ring's slots released by every consumer thread (``THREAD_RELEASE``); ``dq-lag-``:
    each step's dQ product the step before's (``DQ_LAG``; ``dq-lag2-``: in two dS^T slots, not three; the
    shim's order of turns never lets a warpgroup overwrite a slot the other has yet to read, so a missing
    ``ds_free`` wait passes here);
    ``stagger-``: that, warpgroup 1 starting after warpgroup 0's first dS^T half (``STAGGER``)."""
    stagger = name.startswith("stagger-")
    name = name[len("stagger-"):] if stagger else name
    if name.startswith("dq-lag2-"):
        monkeypatch.setattr(flash_bwd, "DS_LAG_SLOTS", 2)
        name = "dq-lag-" + name[len("dq-lag2-"):]
    dq_lag = stagger or name.startswith("dq-lag-")
    name = name[len("dq-lag-"):] if name.startswith("dq-lag-") else name
    thread_release = name.startswith("thread-release-")
    name = name[len("thread-release-"):] if thread_release else name
    rows_by_loader = name.startswith("rows-by-loader-")
    name = name[len("rows-by-loader-"):] if rows_by_loader else name
    early_p = name.startswith("p-beside-dp-")
    name = name[len("p-beside-dp-"):] if early_p else name
    writer = name.startswith("writer-")
    name = name[len("writer-"):] if writer else name
    lengths, heads, kv_heads, dim, block_size, causal = CASES[name]
    q, k, v, do = _inputs(lengths, heads, kv_heads, dim, len(lengths) + dim)
    offsets = offsets_from_lengths(lengths)
    dq, dk, dv, run, counters = _run(q, k, v, do, offsets, block_size, causal, deterministic, writer, early_p,
                                     rows_by_loader=rows_by_loader, thread_release=thread_release, dq_lag=dq_lag,
                                     stagger=stagger)
    want = reference.attention_backward(do.double(), *(x.double() for x in (q, k, v)), offsets, block_size or None,
                                        dim ** -0.5, causal)
    for got, ref in zip((dq, dk, dv), want):
        assert rel_err(got, ref) < 5e-3
    assert torch.equal(run.writes("DK"), torch.ones_like(dk, dtype=torch.int64))
    assert torch.equal(run.writes("DV"), torch.ones_like(dv, dtype=torch.int64))
    # dQ: per element, one add per key tile of the row's unit meeting it (causal: key tiles at or
    # before the row's own), from each warpgroup where each adds every column over its own keys.
    unit = torch.zeros(q.shape[0], dtype=torch.int64)
    starts = offsets.tolist()
    for b in range(len(lengths)):
        lo, hi = starts[b], starts[b + 1]
        size = block_size or max(hi - lo, 1)
        for u0 in range(lo, hi, size):
            u1 = min(u0 + size, hi)
            rows = torch.arange(u1 - u0)
            tiles = -(-(u1 - u0) // flash_bwd.TILE_N)
            unit[u0:u1] = rows // flash_bwd.TILE_N + 1 if causal else tiles
    # The writer sums the two terms first only in order; in any order it adds each tile by TMA.
    per_tile = 2 if flash_bwd.dq_cols(dim) == dim and not (writer and deterministic) else 1
    want_adds = (unit * per_tile)[:, None, None].expand(q.shape)
    assert torch.equal(run.writes("DQA").long(), want_adds)
    if deterministic:
        # Each query tile's counters (at its first row): its adds, per column half at D 128.
        first_rows = torch.zeros(q.shape[0], dtype=torch.bool)
        for b in range(len(lengths)):
            lo, hi = starts[b], starts[b + 1]
            size = block_size or max(hi - lo, 1)
            for u0 in range(lo, hi, size):
                first_rows[u0:min(u0 + size, hi):flash_bwd.TILE_M] = True
        want = torch.zeros_like(counters)
        halves = 2 if per_tile == 1 and not writer else 1
        want[:, first_rows, :halves] = (unit[first_rows].to(torch.int32) * per_tile)[None, :, None]
        assert torch.equal(counters, want)
    else:
        assert not counters.any()


@pytest.mark.parametrize("form", ["consumers-copy-rows", "loader-copies-rows", "delta-in-kernel",
                                  "delta-in-kernel-loader-copies-rows"])
@pytest.mark.parametrize("name", ["blocks128-gqa-d128", "blocks100-causal-d128", "blocks64-gqa-causal-d128",
                                  "blocks128-gqa-causal-d64", "blocks48-d64", "blocks128-gqa-d96",
                                  "blocks100-gqa-causal-d96"])
def test_flash_ws_backward_stores_dq_where_one_key_tile_holds_the_block(name, form):
    """``DQ_STORE`` (blocks of up to 128 tokens): dQ, dK and dV against float64, every element of each stored
    exactly once (dQ at D 128 in two 64-column halves, one per warpgroup; at D 64 the two warpgroups' terms
    summed by the writer; at D 96 in 128-wide tiles, ``PADDED_HEAD_DIMS``, the second half's 32 columns), no counter
    touched; with the lse and delta rows by the loader and the slots released by every thread too;
    ``delta-in-kernel``: the delta rows computed from O's tiles in the ring (``DELTA_IN_KERNEL``; the delta tensor
    NaN, never read)."""
    lengths, heads, kv_heads, dim, block_size, causal = CASES[name]
    q, k, v, do = _inputs(lengths, heads, kv_heads, dim, 5)
    offsets = offsets_from_lengths(lengths)
    by_loader = form.endswith("loader-copies-rows")
    dq, dk, dv, run, counters = _run(q, k, v, do, offsets, block_size, causal, writer=dim == 64,
                                     rows_by_loader=by_loader, thread_release=by_loader, dq_store=True,
                                     delta_in_kernel=form.startswith("delta-in-kernel"))
    want = reference.attention_backward(do.double(), *(x.double() for x in (q, k, v)), offsets, block_size,
                                        dim ** -0.5, causal)
    for got, ref in zip((dq, dk, dv), want):
        assert rel_err(got, ref) < 5e-3
    for name_, x in (("DQA", dq), ("DK", dk), ("DV", dv)):
        assert torch.equal(run.writes(name_), torch.ones_like(x, dtype=torch.int64))
    assert not counters.any()


@pytest.mark.parametrize("name,rotary", [
    (name, rotary) for name in ("blocks128-gqa-d128", "blocks100-causal-d128")
    for rotary in ("interleaved", "interleaved-partial-int-positions", "split-partial",
                   "split-quarter-float-positions", "split-paired", "split-paired-int-positions")
] + [("blocks128-gqa-d96", "interleaved"), ("blocks100-gqa-causal-d96", "split-partial-int-positions"),
     ("blocks100-gqa-causal-d96", "interleaved-partial-int-positions"), ("blocks128-gqa-d96", "split-paired"),
     ("blocks100-gqa-causal-d96", "split-paired-int-positions"), ("blocks128-gqa-d96", "split-paired-r48"),
     ("blocks100-gqa-causal-d96", "split-paired-r48-int-positions"), ("blocks128-gqa-d96", "split-paired-r80"),
     ("blocks100-causal-d128", "split-paired-r96"), ("blocks128-gqa-d128", "split-paired-r48-int-positions"),
     ("blocks128-gqa-d128", "split-paired-r112")])
def test_flash_ws_backward_rotates_dq_and_dk_back_where_it_stores_dq(name, rotary):
    """``ROT_DIM`` (``UNROTATE``): on q and k rotated beforehand (as the rotation pass writes them), dQ and dK come
    out rotated back by the kernel, against the float64 gradients of the rotary call (interleaved pairs over every
    channel or 32; split halves over 64 or 32 channels, each pair inside a consumer's dQ column half; positions
    given as ints or floats, or each row's index in its sequence, blocks ragged; split halves over every channel on
    q and k in the paired-chunk order, ``PAIR_CHUNK``, dQ and dK out in their own order, at D 96 in chunks of 16
    whose halves' boxes in the padded tiles reach past the head's 48 channels a half; ``-rN``: over N channels in
    chunks of 8 or 16, the pass-through channels among a consumer's rotary ones stored apart, ``pass_piece``, at the
    start or the end of the tile, behind a rotary half or under the padding); the rows by the loader,
    thread releases and, without causal masks, the delta rows in the kernel, as the defaults run it."""
    lengths, heads, kv_heads, dim, block_size, causal = CASES[name]
    q, k, v, do = _inputs(lengths, heads, kv_heads, dim, 11)
    offsets = offsets_from_lengths(lengths)
    rot = {"interleaved": dim, "interleaved-partial-int-positions": 32, "split-partial": 64,
           "split-partial-int-positions": 64, "split-quarter-float-positions": 32, "split-paired": dim,
           "split-paired-int-positions": dim}.get(rotary) or int(rotary.split("-r")[1].split("-")[0])
    interleaved = rotary.startswith("interleaved")
    positions = None
    if rotary.endswith("int-positions"):
        positions = torch.randint(0, 3000, (q.shape[0],), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    elif rotary.endswith("float-positions"):
        positions = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(4)) * 3000
    assert flash_bwd.unrotates(block_size, dim, rot, interleaved)
    theta = 500.0
    qr, kr, _ = reference._rotated_inputs(q, k, offsets, theta, positions, rot, interleaved, torch.float64)
    chunk = flash_bwd.pair_chunk(dim, rot, interleaved)
    want_chunk = {128: 32, 96: 16}[dim] if rot == dim else {48: 8, 80: 8, 96: 16, 112: 8}.get(rot)
    assert chunk == (want_chunk if rotary.startswith("split-paired") else 0)
    qr, kr = reference.paired_chunks(qr, chunk, rot), reference.paired_chunks(kr, chunk, rot)
    dq, dk, dv, run, _ = _run(qr.to(q.dtype), kr.to(k.dtype), v, do, offsets, block_size, causal,
                              rows_by_loader=True, thread_release=True, dq_store=True,
                              delta_in_kernel=not causal, unrotate=(theta, positions, rot, interleaved))
    want = reference.attention_backward(do.double(), *(x.double() for x in (q, k, v)), offsets, block_size,
                                        dim ** -0.5, causal, theta, positions, rot, interleaved)
    for got, ref in zip((dq, dk, dv), want):
        assert rel_err(got, ref) < 5e-3
    for name_, x in (("DQA", dq), ("DK", dk), ("DV", dv)):
        assert torch.equal(run.writes(name_), torch.ones_like(x, dtype=torch.int64))


def test_unrotates_where_each_pair_lies_in_one_dq_column_half(monkeypatch):
    """``unrotates``: D 128 with dQ stored (blocks of up to 128 tokens), interleaved pairs over any channels, split
    halves over channels dividing 64, or over every channel in the paired-chunk order (``pair_chunk``, while
    ``PAIRED_SPLIT``; at D 96 in 128-wide tiles in chunks of 16, while ``PADDED_PAIRED_SPLIT``), or over part of the
    channels in chunks of 8 or 16 where the pass-through channels among a consumer's rotary ones are 16 or 32 wide
    (48, 96 or 112 of 128 channels, 48 or 80 of 96, while ``PAIRED_PARTIAL``); not D 64 (the writer sums the
    halves), split halves over 80 of 128 channels (48 pass-through ones in consumer 1), full attention, or with
    ``UNROTATE`` off."""
    assert flash_bwd.unrotates(128, 128, 128, True) and flash_bwd.unrotates(100, 128, 32, True)
    assert flash_bwd.unrotates(128, 128, 64, False) and flash_bwd.unrotates(65, 128, 16, False)
    assert flash_bwd.unrotates(128, 128, 128, False) and flash_bwd.pair_chunk(128, 128, False) == 32
    assert flash_bwd.unrotates(128, 128, 48, False) and flash_bwd.pair_chunk(128, 48, False) == 8
    assert flash_bwd.unrotates(128, 128, 96, False) and flash_bwd.pair_chunk(128, 96, False) == 16
    assert flash_bwd.pair_chunk(128, 112, False) == 8 and flash_bwd.pass_piece(1, 64, 112, 128) == (48, 16)
    assert not flash_bwd.unrotates(128, 128, 80, False) and flash_bwd.pair_chunk(128, 80, False) == 0
    assert flash_bwd.pair_chunk(128, 64, False) == flash_bwd.pair_chunk(128, 128, True) == 0
    assert not flash_bwd.unrotates(128, 64, 64, True) and not flash_bwd.unrotates(0, 128, 64, True)
    assert not flash_bwd.unrotates(256, 128, 64, True) and not flash_bwd.unrotates(128, 128, 0, True)
    assert flash_bwd.unrotates(128, 96, 96, False) and flash_bwd.pair_chunk(96, 96, False) == 16
    assert flash_bwd.unrotates(100, 96, 64, False) and flash_bwd.unrotates(128, 96, 96, True)
    assert flash_bwd.unrotates(128, 96, 48, False) and flash_bwd.pair_chunk(96, 48, False) == 8
    assert flash_bwd.pass_piece(0, 64, 48, 96) == (48, 16) and flash_bwd.pass_piece(1, 64, 48, 96) == (0, 0)
    assert flash_bwd.pair_chunk(96, 80, False) == 8 and flash_bwd.pass_piece(1, 64, 80, 96) == (16, 16)
    monkeypatch.setattr(flash_bwd, "PAIRED_PARTIAL", False)
    assert not flash_bwd.unrotates(128, 96, 48, False) and flash_bwd.pair_chunk(128, 96, False) == 0
    assert flash_bwd.pair_chunk(96, 96, False) == 16
    monkeypatch.setattr(flash_bwd, "PADDED_PAIRED_SPLIT", False)
    assert not flash_bwd.unrotates(128, 96, 96, False) and flash_bwd.pair_chunk(96, 96, False) == 0
    assert flash_bwd.pair_chunk(128, 128, False) == 32
    monkeypatch.setattr(flash_bwd, "PAIRED_SPLIT", False)
    assert not flash_bwd.unrotates(128, 128, 128, False) and flash_bwd.pair_chunk(128, 128, False) == 0
    monkeypatch.setattr(flash_bwd, "UNROTATE", False)
    assert not flash_bwd.unrotates(128, 128, 128, True)


def test_flash_ws_backward_stores_dq_only_where_one_key_tile_holds_the_block():
    """``stores_dq``: on blocks of up to ``TILE_N`` tokens at the head dims of ``DQ_STORE_HEAD_DIMS`` (D 128 by
    default), where :func:`taken` then hands the call to the kernel in both modes."""
    assert flash_bwd.stores_dq(128, 128) and flash_bwd.stores_dq(16, 128) and not flash_bwd.stores_dq(64, 64)
    assert not flash_bwd.stores_dq(0, 128) and not flash_bwd.stores_dq(129, 128)
    assert flash_bwd.taken(True, 100, 128) and flash_bwd.taken(False, 128, 128)
    assert not flash_bwd.taken(True, 64, 64) and not flash_bwd.taken(True, 256, 128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash_bwd, "DQ_STORE_HEAD_DIMS", frozenset({64, 128}))
        assert flash_bwd.stores_dq(64, 64) and flash_bwd.taken(True, 64, 64) and not flash_bwd.stores_dq(65, 96)
        mp.setattr(flash_bwd, "DQ_STORE_HEAD_DIMS", frozenset())
        assert not flash_bwd.stores_dq(128, 128) and not flash_bwd.taken(True, 128, 128)


def test_flash_ws_backward_computes_delta_for_grouped_heads_without_causal_masks():
    """``computes_delta``: where the kernel stores dQ, by default for grouped query heads without causal
    masks (measured faster there, slower with them or one query head per kv head); ``DELTA_IN_KERNEL`` True /
    False sets it wherever dQ is stored / nowhere."""
    assert flash_bwd.DELTA_IN_KERNEL is None
    assert flash_bwd.computes_delta(128, 128, False, 4) and flash_bwd.computes_delta(100, 128, False, 2)
    assert not flash_bwd.computes_delta(128, 128, True, 4) and not flash_bwd.computes_delta(128, 128, False, 1)
    assert not flash_bwd.computes_delta(256, 128, False, 4) and not flash_bwd.computes_delta(128, 64, False, 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash_bwd, "DELTA_IN_KERNEL", True)
        assert flash_bwd.computes_delta(128, 128, True, 1) and not flash_bwd.computes_delta(0, 128, False, 4)
        mp.setattr(flash_bwd, "DELTA_IN_KERNEL", False)
        assert not flash_bwd.computes_delta(128, 128, False, 4)


@pytest.mark.parametrize("rows_by_loader", [False, True], ids=["consumers-copy-rows", "loader-copies-rows"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
@pytest.mark.parametrize("writer", [False, True], ids=["consumers-add", "writer-adds"])
@pytest.mark.parametrize("dim", [64, 128])
def test_flash_ws_backward_keeps_non_finite_values_in_their_sequence(dim, writer, deterministic, rows_by_loader):
    """Tensor maps over each block's own rows (the writer's dQ map, in any order or in order, too)
    and lse / delta copies masked at the block's end (by the consumers, or by the loader,
    ``ROWS_BY_LOADER``): a NaN sequence leaves its neighbours' gradients finite."""
    lengths = [130, 70, 200]
    q, k, v, do = _inputs(lengths, 2, 2, dim, 3)
    offsets = offsets_from_lengths(lengths)
    for x in (q, k, v, do):
        x[130:200] = float("nan")
    dq, dk, dv, _, _ = _run(q, k, v, do, offsets, 0, False, deterministic, writer, rows_by_loader=rows_by_loader)
    for g in (dq, dk, dv):
        assert torch.isfinite(g[:130]).all() and torch.isfinite(g[200:]).all() and torch.isnan(g[130:200]).all()


@pytest.mark.parametrize("delta_in_kernel", [False, True], ids=["delta-pass", "delta-in-kernel"])
def test_flash_ws_backward_at_padded_head_dims_keeps_each_head_apart(delta_in_kernel):
    """D 96 in 128-wide tiles (``PADDED_HEAD_DIMS``): a tile's channels past the head's read as zeros, not the next
    head's, so NaN in one head's q, k, v and dO (the next head's first channels, where a flat tensor map's box would
    reach) leaves every other head's gradients finite and right, and no element past a head's 96 channels is
    written."""
    lengths, heads, kv_heads, dim, block_size, causal = CASES["blocks128-gqa-d96"]
    q, k, v, do = _inputs(lengths, heads, kv_heads, dim, 7)
    offsets = offsets_from_lengths(lengths)
    want = reference.attention_backward(do.double(), *(x.double() for x in (q, k, v)), offsets, block_size,
                                        dim ** -0.5, causal)
    q, do = q.clone(), do.clone()
    q[:, 1], do[:, 1] = float("nan"), float("nan")
    dq, dk, dv, run, _ = _run(q, k, v, do, offsets, block_size, causal, rows_by_loader=True, thread_release=True,
                              dq_store=True, delta_in_kernel=delta_in_kernel)
    kept = [0, 2, 3]
    assert rel_err(dq[:, kept], want[0][:, kept]) < 5e-3
    assert torch.isnan(dq[:, 1]).all()
    for name_, x in (("DQA", dq), ("DK", dk), ("DV", dv)):
        assert torch.equal(run.writes(name_), torch.ones_like(x, dtype=torch.int64))


@pytest.mark.parametrize("block_m", [64, 128], ids=["m64", "m128"])
@pytest.mark.parametrize("writer,rows_by_loader", [(False, False), (True, False), (True, True)],
                         ids=["consumers", "writer", "writer-loader-copies-rows"])
@pytest.mark.parametrize("name", ["full-gqa-causal-d128", "blocks256-causal-d64", "full-d64"])
def test_flash_ws_backward_without_dq_computes_dk_and_dv_only(name, writer, rows_by_loader, block_m):
    """``WITH_DQ`` off (the deterministic backward's dK/dV pass beside the Triton dQ pass): dK and dV
    against float64, each stored once, nothing added to dQ's sums, no counter touched, and no writer
    partition waiting for terms that never come (lse and delta copied by the loader too: 128-row steps)."""
    lengths, heads, kv_heads, dim, block_size, causal = CASES[name]
    q, k, v, do = _inputs(lengths, heads, kv_heads, dim, 11)
    offsets = offsets_from_lengths(lengths)
    _, dk, dv, run, counters = _run(q, k, v, do, offsets, block_size, causal, False, writer, with_dq=False,
                                    block_m=block_m, rows_by_loader=rows_by_loader)
    want = reference.attention_backward(do.double(), *(x.double() for x in (q, k, v)), offsets, block_size or None,
                                        dim ** -0.5, causal)
    for got, ref in zip((dk, dv), want[1:]):
        assert rel_err(got, ref) < 5e-3
    assert torch.equal(run.writes("DK"), torch.ones_like(dk, dtype=torch.int64))
    assert torch.equal(run.writes("DV"), torch.ones_like(dv, dtype=torch.int64))
    assert not run.writes("DQA").any() and not counters.any()


def test_query_steps_start_at_the_diagonal_when_causal():
    """``query_steps``: every 64-row query tile of the block, or (causal) those from the key tile's
    first row on; a key tile inside the block always meets one."""
    fn = gs.function(flash_bwd.query_steps)
    for n, tile_row in ((1, 0), (64, 0), (65, 0), (300, 128), (300, 256), (257, 256)):
        first, steps = (int(x) for x in fn(gs.scalar(n), gs.scalar(tile_row), 64, False))
        assert (first, steps) == (0, -(-n // 64))
        first, steps = (int(x) for x in fn(gs.scalar(n), gs.scalar(tile_row), 64, True))
        assert first == tile_row // 64 and first + steps == -(-n // 64) and steps >= 1



@pytest.mark.parametrize("offset,width", [(0, 16), (16, 16), (32, 16), (48, 16), (0, 32), (32, 32)])
def test_column_piece_takes_the_columns_at_its_offset(offset, width):
    """``_column_piece``: a tile's columns ``offset ..`` of a half or a quarter of its width, as the pass-through
    channels among a consumer's rotary ones go out (``pass_piece``)."""
    fn = gs.function(flash_bwd._column_piece)
    x = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64)
    assert torch.equal(torch.as_tensor(fn(gs.tensor(x), 8, 64, offset, width)), x[:, offset:offset + width])
