"""The warp-specialized e4m3 forward for sm_90 (``kernels.sm90.fp8_fwd``) on CPU tensors through
``tests/gluon_shim.py`` (Gluon has no interpreter): the whole persistent kernel (the loader and the
two consumer partitions in threads, the mbarrier ring, tensor maps over the whole row views)
against the float64 oracle of the descaled inputs; each output element stored once; a NaN
sequence kept to itself although the tiles of a ragged block read the next block's rows. What
the shim does not model is in its docstring; the kernel's GPU tests are in ``tests/test_fp8.py``."""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tests next to Triton's interpreter (the block table runs there)"),
    pytest.mark.usefixtures("single_thread"),
]

import blockattn_layers as bl  # noqa: E402
from blockattn_layers import fp8  # noqa: E402
from blockattn_layers.kernels.common.meta import LOG2E  # noqa: E402
from blockattn_layers.kernels.common.schedule import Schedule  # noqa: E402
from blockattn_layers.kernels.sm90 import fp8_fwd as ws  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402
from tests.oracle import offsets_from_lengths, oracle_attention, rel_err  # noqa: E402

LENGTHS = [0, 1, 63, 64, 65, 130, 0, 5, 40]


def _run(q8, k8, v8, offsets, descales, block_size, causal, programs, cpu_offsets=None, rope_theta=None,
         positions=None, out_tma=False, out_dtype=torch.float16, f16_rotation=False):
    """The kernel on ``programs`` persistent programs; ``descales`` (q, k, v): ``[H_kv]`` or ``[B, H_kv]``;
    ``rope_theta``: rotary over every channel in split halves, at ``positions`` or implicit ones, in
    float16 arithmetic with ``f16_rotation`` (``F16_ROTATION``)."""
    total, heads, dim = q8.shape
    kv_heads = k8.shape[1]
    sched = Schedule(offsets, total, block_size, cpu_offsets)
    o = torch.full((total, heads, dim), float("nan"), dtype=out_dtype)
    num_seqs = len(offsets) - 1
    items = sched.programs * heads
    qd, kd, vd = descales
    rotary = rope_theta is not None
    run = gs.launch(
        ws._fp8_ws_fwd_kernel, (programs,), Q=q8, K=k8, V=v8, O=o, Sched=sched.table, Offsets=offsets,
        Pos=positions if positions is not None else sched.table, QD=qd, KD=kd, VD=vd, slots=sched.programs,
        num_seqs=num_seqs, block_size=block_size, total=total, heads=heads, kv_heads=kv_heads, items=items,
        qk_scale=dim ** -0.5 * LOG2E, log2_theta=math.log2(rope_theta) if rotary else 0.0,
        search_top=1 << (num_seqs.bit_length() - 1),
        search_steps=num_seqs.bit_length(), stride_qt=q8.stride(0), stride_kt=k8.stride(0), stride_vt=v8.stride(0),
        stride_ot=o.stride(0), stride_oh=o.stride(1), HEAD_DIM=dim, GROUPS=heads // kv_heads,
        STAGES=ws.stages(dim, rotary), ROTARY=rotary, HAS_POS=positions is not None, IS_CAUSAL=causal,
        INLINE_SEQS=sched.inline_seqs, OUT_TMA=out_tma, CONSUMERS=ws.CONSUMERS, F16_ROTATION=f16_rotation,
        QD_BATCH=qd.dim() == 2, KD_BATCH=kd.dim() == 2, VD_BATCH=vd.dim() == 2,
    )
    return o, run


def _inputs(lengths, heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g) * torch.logspace(-1, 0.5, heads).view(1, heads, 1)
    k = torch.randn(total, kv_heads, dim, generator=g) * 0.5
    v = torch.randn(total, kv_heads, dim, generator=g) * torch.logspace(-1, 1, kv_heads).view(1, kv_heads, 1)
    return q, k, v, offsets_from_lengths(lengths, torch.int32)


CASES = {
    "d64-b64": (64, 2, 2, 64, False, "head", 3),
    "d128-gqa-causal-b64": (128, 4, 2, 64, True, "sequence_head", 4),
    "d64-b40-gqa-causal": (64, 4, 1, 40, True, "head", 5),
    "d128-b33-sequence-factors": (128, 2, 2, 33, False, "sequence_head", 2),
}


@pytest.mark.parametrize("out_tma", [False, True], ids=["stores", "tma-stores"])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_ws_forward_matches_the_oracle(name, out_tma):
    """Zero-length and length-1 sequences, lengths around the block size, more items than
    programs (each program's items taken in turn by its three consumers), grouped-query heads,
    causal, per-head and per-sequence factors (the block's sequence found by the kernel's search)."""
    dim, heads, kv_heads, block_size, causal, granularity, programs = CASES[name]
    q, k, v, offsets = _inputs(LENGTHS, heads, kv_heads, dim)
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(q, granularity, offsets=offsets, kv_heads=kv_heads),
                                    bl.quantize_fp8(k, granularity, offsets=offsets), bl.quantize_fp8(v, "head"))
    o, run = _run(q8, k8, v8, offsets, (qd, kd, vd), block_size, causal, programs, out_tma=out_tma)
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64)
           for x, d, g in ((q8, qd, heads // kv_heads), (k8, kd, 1), (v8, vd, 1))]
    want = oracle_attention(*deq, offsets, block_size, causal=causal)
    assert rel_err(o, want) < 2e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))


ROTARY_CASES = {
    "d128-implicit-positions": (128, 2, 2, 64, False, None),
    "d64-gqa-causal-float-positions": (64, 4, 2, 40, True, "float"),
    "d128-gqa-int-positions": (128, 4, 1, 64, False, "int"),
}


@pytest.mark.parametrize("f16_rotation", [False, True], ids=["f32-rotation", "f16-rotation"])
@pytest.mark.parametrize("out_tma", [False, True], ids=["stores", "tma-stores"])
@pytest.mark.parametrize("name", list(ROTARY_CASES))
def test_fp8_ws_rotary_forward_matches_the_oracle(name, out_tma, f16_rotation):
    """Rotary over every channel in split halves: the stored q and k rotated in float32 into the
    consumer's 16-bit halves (their factors on the scores, as without rotary), or in float16 into
    float16 halves (``F16_ROTATION``), at implicit positions (each block's rows from its first row in
    its sequence) or given int or float ones; 64-token blocks' outputs by masked or TMA stores."""
    dim, heads, kv_heads, block_size, causal, kind = ROTARY_CASES[name]
    q, k, v, offsets = _inputs(LENGTHS, heads, kv_heads, dim, seed=3)
    total = q.shape[0]
    g = torch.Generator().manual_seed(4)
    positions = {None: None, "int": torch.randint(0, 5000, (total,), generator=g, dtype=torch.int32),
                 "float": torch.rand(total, generator=g) * 3000}[kind]
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x, "sequence_head", offsets=offsets, kv_heads=kv_heads)
                                    for x in (q, k, v))
    o, run = _run(q8, k8, v8, offsets, (qd, kd, vd), block_size, causal, 3, rope_theta=1e4, positions=positions,
                  out_tma=out_tma, f16_rotation=f16_rotation)
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64)
           for x, d, g in ((q8, qd, heads // kv_heads), (k8, kd, 1), (v8, vd, 1))]
    want = oracle_attention(*deq, offsets, block_size, causal=causal, rope_theta=1e4,
                            positions=None if positions is None else positions.double())
    assert rel_err(o, want) < 2e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))


def test_fp8_ws_forward_takes_the_block_table_past_the_inline_scan():
    """Over ``INLINE_MAX_SEQS`` sequences the blocks come from the table, and per-sequence factors
    from the search over 600 offsets."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (600,), generator=g).tolist()
    q, k, v, offsets = _inputs(lengths, 2, 2, 64, seed=1)
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x, "sequence_head", offsets=offsets) for x in (q, k, v))
    o, _ = _run(q8, k8, v8, offsets, (qd, kd, vd), 64, False, 7)
    deq = [fp8.dequantize(x, d, offsets, 1, torch.float64) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
    assert rel_err(o, oracle_attention(*deq, offsets, 64)) < 2e-3


def test_fp8_ws_forward_keeps_non_finite_values_in_their_sequence():
    """The tiles of a ragged block hold the next block's rows (one tensor map over all rows): its
    keys are masked out of the softmax and its values zeroed before ``P V``, so a NaN sequence
    (e4m3 has NaN, no infinity) leaves its neighbours finite."""
    lengths = [40, 64, 30]
    q, k, v, offsets = _inputs(lengths, 2, 2, 64, seed=2)
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x) for x in (q, k, v))
    for x in (q8, k8, v8):
        x[40:104] = float("nan")
    for out_dtype in (torch.float16, torch.bfloat16):
        o, _ = _run(q8, k8, v8, offsets, (qd, kd, vd), 64, False, 2, out_dtype=out_dtype)
        assert torch.isfinite(o[:40]).all() and torch.isfinite(o[104:]).all() and torch.isnan(o[40:104]).all()


def test_fp8_ws_stages_give_each_slot_one_consumer():
    """About ``SLOT_BYTES`` of e4m3 q, k and v tiles in flight, a multiple of the consumers (each
    slot serves one consumer: the form that passed on the H200, ``stages``)."""
    assert ws.stages(64) == 9 and ws.stages(128) == 3 and ws.CONSUMERS == 3
    assert ws.stages(64, rotary=True) == 9 and ws.stages(128, rotary=True) == 3
    for dim in (64, 128):
        for rotary in (False, True):
            ring = ws.stages(dim, rotary) * 3 * ws.BLOCK_M * dim
            assert ring + ws.consumer_tile_bytes(dim, rotary) <= 227 * 1024


def test_fp8_ws_reasons_name_what_the_kernel_needs():
    """Calls it cannot take fall to the Triton fp8 forward, each reason in the user's terms:
    interleaved or partial rotary, other head dims and blocks, float32 output, overlapping rows."""
    q = torch.zeros(10, 2, 64).to(fp8.FP8_DTYPE)
    assert not [r for r in ws.fp8_ws_reasons(q, q, q, 64, 64, False, torch.bfloat16) if "sm_90" not in r]
    reasons = ws.fp8_ws_reasons(q, q, q, 64, 64, True, torch.float32)
    assert any("rotary" in r for r in reasons) and any("16-bit output" in r or "fp16 output" in r for r in reasons)
    assert any("rotary" in r for r in ws.fp8_ws_reasons(q, q, q, 64, 32, False, torch.bfloat16))
    assert any("head dim" in r for r in ws.fp8_ws_reasons(q[..., :32], q[..., :32], q[..., :32], 64, 0, False,
                                                           torch.bfloat16))
    assert any("blocks of" in r for r in ws.fp8_ws_reasons(q, q, q, 128, 0, False, torch.bfloat16))
    row = torch.zeros(1, 2, 64).to(fp8.FP8_DTYPE).expand(10, 2, 64)  # every token the same row
    assert any("overlap" in r for r in ws.fp8_ws_reasons(row, row, row, 64, 0, False, torch.bfloat16))
