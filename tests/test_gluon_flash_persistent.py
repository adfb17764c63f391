"""The persistent warp-specialized Gluon flash forward (``kernels.sm90.flash_persistent``) on CPU
tensors through ``tests/gluon_shim.py``: the whole kernel (loader and two consumer partitions in
threads, two query buffers and the key ring handed over by mbarriers across items, tensor maps over
the whole row views, the ragged last key tile's v rows zeroed by the loader) on few programs that
take many items each, against the float64 reference, output and logsumexp, each output element
stored once; a NaN sequence kept to itself. What the shim does not model is in its docstring."""
from __future__ import annotations

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
from blockattn_layers.kernels.sm90 import flash_fwd, flash_persistent  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402
from tests.oracle import offsets_from_lengths, rel_err  # noqa: E402

# (lengths, heads, kv_heads, dim, block_size, causal, programs): blocks ending inside a key tile
# (ragged last tiles, some of one row), zero-length sequences, a query half past its block, GQA,
# causal, blocks of 256; few programs, so each takes many items and the query buffers and the ring wrap.
CASES = {
    "full-d64": ([0, 1, 127, 128, 129, 300, 0, 5], 2, 2, 64, 0, False, 3),
    "full-gqa-causal-d128": ([1, 200, 0, 64, 257], 4, 1, 128, 0, True, 2),
    "blocks256-causal-d64": ([300, 5, 513, 0], 2, 1, 64, 256, True, 5),
    "one-program": ([70, 129, 1, 200], 2, 2, 64, 0, False, 1),
}


def _run(q, k, v, offsets, block_size, causal, programs, overlap=False, tile_m=flash_fwd.TILE_M,
         tile_n=flash_fwd.TILE_N, pingpong=False, split_kv=False, shift_last=False, early_release=False,
         share_kv=False, thread_release=False):
    total, heads, dim = q.shape
    sched = FlashSchedule(offsets, total, block_size, tile_m, None, longest_first=block_size == 0)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((heads, total), float("nan"))
    run = gs.launch(
        flash_persistent._flash_fwd_persistent_kernel, (programs,), Q=q, K=k, V=v, O=o, Lse=lse,
        Table=sched.table(late_first=True), slots=sched.programs, heads=heads, kv_heads=k.shape[1],
        items=sched.programs * heads, total=total, qk_scale=dim ** -0.5 * LOG2E, stride_qt=q.stride(0),
        stride_kt=k.stride(0), stride_vt=v.stride(0), stride_ot=o.stride(0), stride_lh=lse.stride(0),
        HEAD_DIM=dim, GROUPS=heads // k.shape[1], BLOCK_M=tile_m, BLOCK_N=tile_n,
        IS_CAUSAL=causal, OVERLAP=overlap, PINGPONG=pingpong, SPLIT_KV=split_kv, SHIFT_LAST=shift_last,
        EARLY_RELEASE=early_release, SHARE_KV=share_kv, THREAD_RELEASE=thread_release,
    )
    return o, lse, run


def _inputs(lengths, heads, kv_heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g).to(torch.float16) for h in (heads, kv_heads, kv_heads))
    return q, k, v, offsets_from_lengths(lengths)


@pytest.mark.parametrize("overlap,tile_m,tile_n,pingpong,split_kv", [
    (False, 128, 128, False, False), (True, 128, 128, False, False), (False, 192, 128, False, False),
    (True, 192, 128, False, False), (False, 192, 64, False, False), (False, 128, 128, True, False),
    (False, 192, 128, True, False), (False, 128, 128, False, True), (True, 128, 128, False, True),
    (False, 192, 128, False, True), (False, 128, 128, False, "shift"), (False, 128, 128, False, "shift-joint"),
    (False, 192, 128, False, "shift"), (False, 128, 128, False, "early"), (True, 128, 128, False, "early")],
    ids=["serial", "overlap", "m192-serial", "m192-overlap", "m192-n64", "pingpong", "m192-pingpong", "split-kv",
         "overlap-split-kv", "m192-split-kv", "split-kv-shift-last", "shift-last",
         "m192-split-kv-shift-last", "early-release", "overlap-split-kv-early-release"])
@pytest.mark.parametrize("name", list(CASES))
def test_persistent_forward_matches_the_reference(name, overlap, tile_m, tile_n, pingpong, split_kv):
    """Output and logsumexp against the float64 reference, each output element stored once: two consumer
    warpgroups per 128-row item or three per 192-row item (``THREE_CONSUMER_HEAD_DIMS``; 64-row key tiles
    as at D 128), serial or overlapped loops, the serial one's products in turns (``PINGPONG``), k and v
    on barriers of their own (``SPLIT_KV``; "shift": and a block's last key tile its last keys, ``SHIFT_LAST``,
    "shift-joint": the same on one barrier pair; "early": and the previous item's query buffer released after the
    first ``Q K^T``, ``EARLY_RELEASE``)."""
    lengths, heads, kv_heads, dim, block_size, causal, programs = CASES[name]
    q, k, v, offsets = _inputs(lengths, heads, kv_heads, dim, seed=len(lengths) + dim)
    o, lse, run = _run(q, k, v, offsets, block_size, causal, programs, overlap, tile_m, tile_n, pingpong,
                       split_kv in (True, "shift", "early"), split_kv in ("shift", "shift-joint"), split_kv == "early")
    d = [x.double() for x in (q, k, v)]
    want = reference.attention_forward(*d, offsets, block_size or None, dim ** -0.5, causal, None, None, 0, False)
    assert rel_err(o, want) < 3e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))
    assert torch.equal(run.writes("Lse"), torch.ones_like(lse, dtype=torch.int64))
    # The logsumexp of the first sequence with a ragged block, row by row.
    qf, kf = d[0], d[1].repeat_interleave(heads // kv_heads, 1)
    starts = offsets.tolist()
    b = next(i for i, n in enumerate(lengths) if n % 128)
    lo, hi = starts[b], starts[b + 1]
    unit = block_size or hi - lo
    u1 = min(lo + unit, hi)
    s = torch.einsum("qhd,khd->hqk", qf[lo:u1], kf[lo:u1]) * dim ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(u1 - lo, u1 - lo, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse[:, lo:u1].double(), torch.logsumexp(s, -1), atol=2e-3)


@pytest.mark.parametrize("overlap,tile_m,split_kv", [(True, 128, True), (False, 128, False), (False, 192, True)],
                         ids=["overlap-split-kv", "serial", "m192-split-kv"])
@pytest.mark.parametrize("name", ["full-gqa-causal-d128", "blocks256-causal-d64", "one-program"])
def test_slots_released_by_every_thread_match_the_reference(name, overlap, tile_m, split_kv):
    """``THREAD_RELEASE``: the consumers' threads hand key and value slots back one by one (the rings count
    128 arrivals a consumer, two or three consumers): output and logsumexp against the float64 reference."""
    lengths, heads, kv_heads, dim, block_size, causal, programs = CASES[name]
    q, k, v, offsets = _inputs(lengths, heads, kv_heads, dim, seed=len(lengths) + dim)
    o, lse, run = _run(q, k, v, offsets, block_size, causal, programs, overlap, tile_m, split_kv=split_kv,
                       thread_release=True)
    d = [x.double() for x in (q, k, v)]
    want = reference.attention_forward(*d, offsets, block_size or None, dim ** -0.5, causal, None, None, 0, False)
    assert rel_err(o, want) < 3e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))


# Blocks of one key tile with grouped query heads (lengths, heads, kv_heads, dim, block_size, causal, programs):
# ragged blocks, a block of one row, zero-length sequences; program ranges that split a block's query heads.
SHARED_KV_CASES = {
    "blocks128-gqa-d64": ([300, 5, 129, 0, 128, 1, 64, 250], 4, 1, 64, 128, False, 3),
    "blocks64-gqa-causal-d128": ([70, 3, 128, 65, 0, 200], 8, 2, 128, 64, True, 5),
}


@pytest.mark.parametrize("split_kv,early_release", [(False, False), (True, False), (True, True)],
                         ids=["joint", "split-kv", "split-kv-early-release"])
@pytest.mark.parametrize("name", list(SHARED_KV_CASES))
def test_items_sharing_their_key_tile_match_the_reference(name, split_kv, early_release):
    """``SHARE_KV``: each program's contiguous range of items, a block's query heads of one kv head reading the
    key tile the first of them copied (a ragged tile's v rows zeroed once): output and logsumexp against the
    float64 reference, each element stored once, with k and v on one barrier pair or their own."""
    lengths, heads, kv_heads, dim, block_size, causal, programs = SHARED_KV_CASES[name]
    q, k, v, offsets = _inputs(lengths, heads, kv_heads, dim, seed=dim + heads)
    o, lse, run = _run(q, k, v, offsets, block_size, causal, programs, split_kv=split_kv,
                       early_release=early_release, share_kv=True)
    d = [x.double() for x in (q, k, v)]
    want = reference.attention_forward(*d, offsets, block_size, dim ** -0.5, causal, None, None, 0, False)
    assert rel_err(o, want) < 3e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))
    assert torch.equal(run.writes("Lse"), torch.ones_like(lse, dtype=torch.int64))


@pytest.mark.parametrize("overlap,tile_m,split_kv", [(False, 128, False), (True, 128, False), (False, 192, False),
                                                     (False, 128, True), (True, 128, True), (False, 128, "shift"),
                                                     (False, 128, "shift-joint")],
                         ids=["serial", "overlap", "m192", "split-kv", "overlap-split-kv", "split-kv-shift-last",
                              "shift-last"])
def test_persistent_forward_keeps_non_finite_values_in_their_sequence(overlap, tile_m, split_kv):
    """Tensor maps over all rows: the ragged last key tile of a block holds the next sequence's rows;
    their scores are masked and their v rows zeroed, so a NaN sequence leaves its neighbours finite."""
    lengths = [130, 70, 200]
    q, k, v, offsets = _inputs(lengths, 2, 2, 64, seed=3)
    for x in (q, k, v):
        x[130:200] = float("nan")
    o, _, _ = _run(q, k, v, offsets, 0, False, 2, overlap, tile_m, split_kv=split_kv in (True, "shift"),
                   shift_last=split_kv in ("shift", "shift-joint"))
    assert torch.isfinite(o[:130]).all() and torch.isfinite(o[200:]).all() and torch.isnan(o[130:200]).all()


def test_the_persistent_kernel_is_taken_by_default_where_verified(monkeypatch):
    """``flash_attention_fwd_ws`` hands its calls over while ``TAKEN`` is set (the default) on the GPU
    generations its tests passed on (sm_90), off CUDA (the shim / interpreter), or anywhere with
    unverified kernels allowed; never with ``TAKEN`` cleared, nor while the consumer loop asks for
    ping-pong (only the per-tile kernel has it)."""
    from blockattn_layers.kernels.block import variants

    cpu = torch.device("cpu")
    assert flash_persistent.TAKEN == [True] and flash_persistent.taken(cpu)
    assert flash_persistent.VERIFIED_ON == frozenset({9})
    monkeypatch.setattr(flash_fwd, "CONSUMER_LOOP", "overlap")
    assert flash_persistent.taken(cpu)
    monkeypatch.setattr(flash_fwd, "CONSUMER_LOOP", "pingpong")
    assert not flash_persistent.taken(cpu)
    monkeypatch.setattr(flash_fwd, "CONSUMER_LOOP", "serial")
    monkeypatch.setattr(flash_persistent, "TAKEN", [False])
    assert not flash_persistent.taken(cpu)
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    assert not flash_persistent.taken(cpu)
