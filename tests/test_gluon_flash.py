"""The warp-specialized Gluon flash forward (``kernels.sm90.flash_fwd``) on CPU
tensors through ``tests/gluon_shim.py`` (Gluon has no interpreter): the whole kernel (loader and
two consumer partitions in threads, the mbarrier ring, tensor maps over each block's rows) on
the flash tile table, against the float64 reference, output and logsumexp, each output element
stored once and none outside the tensor. What the shim does not model is in its docstring."""
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
from blockattn_layers.kernels.sm90 import flash_fwd  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402
from tests.oracle import offsets_from_lengths, rel_err  # noqa: E402

CASES = {
    "full-d64": (([0, 1, 127, 128, 129, 300, 0, 5], 2, 2, 64, 0, False), {}),
    "full-gqa-causal-d128": (([1, 200, 0, 64, 257], 4, 1, 128, 0, True), {}),
    "blocks256-causal-d64": (([300, 5, 513, 0], 2, 1, 64, 256, True), {}),
}


def _run(lengths, heads, kv_heads, dim, block_size, causal, overlap=False, pingpong=False):
    g = torch.Generator().manual_seed(len(lengths) + dim)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g).to(torch.float16) for h in (heads, kv_heads, kv_heads))
    offsets = offsets_from_lengths(lengths)
    sched = FlashSchedule(offsets, total, block_size, flash_fwd.TILE_M, None, longest_first=block_size == 0)
    table = sched.table(late_first=True)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((heads, total), float("nan"))
    run = gs.launch(
        flash_fwd._flash_fwd_ws_kernel, (sched.programs * heads,), Q=q, K=k, V=v, O=o, Lse=lse, Table=table,
        slots=sched.programs, heads=heads, kv_heads=kv_heads, qk_scale=dim ** -0.5 * LOG2E,
        stride_qt=q.stride(0), stride_kt=k.stride(0), stride_vt=v.stride(0), stride_ot=o.stride(0),
        stride_lh=lse.stride(0), HEAD_DIM=dim, GROUPS=heads // kv_heads, BLOCK_M=flash_fwd.TILE_M,
        BLOCK_N=flash_fwd.TILE_N, IS_CAUSAL=causal, OVERLAP=overlap, PINGPONG=pingpong,
    )
    return q, k, v, offsets, o, lse, run


@pytest.mark.parametrize("overlap,pingpong", [(False, False), (True, False), (True, True)],
                         ids=["serial", "overlap", "pingpong"])
@pytest.mark.parametrize("name", list(CASES))
def test_flash_ws_forward_matches_the_reference(name, overlap, pingpong):
    """The consumer loops: one product after the other; ``OVERLAP`` (the next key tile's ``Q K^T``
    and this one's ``P V`` issued together, the next softmax under ``P V``: the asynchrony is not
    modelled, the order is); ``PINGPONG`` (the warpgroups' turns on their mbarriers: a wrong phase
    deadlocks the shim's threads)."""
    (lengths, heads, kv_heads, dim, block_size, causal), _ = CASES[name]
    q, k, v, offsets, o, lse, run = _run(lengths, heads, kv_heads, dim, block_size, causal, overlap, pingpong)
    d = [x.double() for x in (q, k, v)]
    want = reference.attention_forward(*d, offsets, block_size or None, dim ** -0.5, causal, None, None, 0, False)
    assert rel_err(o, want) < 3e-3
    assert torch.equal(run.writes("O"), torch.ones_like(o, dtype=torch.int64))
    # lse: the natural-log logsumexp of each row's scaled scores inside its unit.
    qf, kf = d[0], d[1].repeat_interleave(heads // kv_heads, 1)
    starts = offsets.tolist()
    for b in range(len(lengths)):
        lo, hi = starts[b], starts[b + 1]
        unit = block_size or max(hi - lo, 1)
        for u0 in range(lo, hi, unit):
            u1 = min(u0 + unit, hi)
            s = torch.einsum("qhd,khd->hqk", qf[u0:u1], kf[u0:u1]) * dim ** -0.5
            if causal:
                s = s.masked_fill(torch.ones(u1 - u0, u1 - u0, dtype=torch.bool).triu(1), float("-inf"))
            assert torch.allclose(lse[:, u0:u1].double(), torch.logsumexp(s, -1), atol=2e-3)


def test_flash_ws_forward_keeps_non_finite_values_in_their_sequence():
    """Tensor maps over each block's own rows: a NaN sequence leaves its neighbours' output finite
    (a key tile at a block's end is zero-filled, not read from the next sequence)."""
    lengths = [130, 70, 200]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(400, 2, 64, generator=g).to(torch.float16) for _ in range(3))
    for x in (q, k, v):
        x[130:200] = float("nan")
    offsets = offsets_from_lengths(lengths)
    sched = FlashSchedule(offsets, 400, 0, flash_fwd.TILE_M, None, longest_first=True)
    o = torch.zeros_like(q)
    lse = torch.zeros(2, 400)
    gs.launch(flash_fwd._flash_fwd_ws_kernel, (sched.programs * 2,), Q=q, K=k, V=v, O=o, Lse=lse,
              Table=sched.table(late_first=True), slots=sched.programs, heads=2, kv_heads=2, qk_scale=0.18,
              stride_qt=q.stride(0), stride_kt=k.stride(0), stride_vt=v.stride(0), stride_ot=o.stride(0),
              stride_lh=lse.stride(0), HEAD_DIM=64, GROUPS=1, BLOCK_M=flash_fwd.TILE_M, BLOCK_N=flash_fwd.TILE_N,
              IS_CAUSAL=False, OVERLAP=False, PINGPONG=False)
    assert torch.isfinite(o[:130]).all() and torch.isfinite(o[200:]).all() and torch.isnan(o[130:200]).all()


def test_the_backend_takes_it_where_measured_faster_else_only_when_unverified_kernels_are_allowed(monkeypatch):
    """``triton_flash`` runs the Gluon forward at D 128 and D 64 (full attention and blocks over 128 rows);
    at other head dims only with ``BLOCKATTN_UNVERIFIED_KERNELS=1``; never inside ``gluon_forward(False)``."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.ops.backends import triton_flash

    monkeypatch.setattr(variants, "gluon_import_error", lambda: None)
    monkeypatch.setattr(variants, "_UNVERIFIED", [False])
    assert triton_flash.gluon_forward_taken(0, 128) and triton_flash.gluon_forward_taken(256, 128)
    assert triton_flash.gluon_forward_taken(0, 64) and triton_flash.gluon_forward_taken(512, 64)
    assert not triton_flash.gluon_forward_taken(0, 96)
    with triton_flash.gluon_forward(False):
        assert not triton_flash.gluon_forward_taken(0, 128) and not triton_flash.gluon_forward_taken(512, 64)
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    assert triton_flash.gluon_forward_taken(256, 128) and triton_flash.gluon_forward_taken(0, 96)
    monkeypatch.setattr(variants, "gluon_import_error", lambda: "no gluon")
    assert not triton_flash.gluon_forward_taken(0, 128)
    cpu = torch.device("cpu")
    assert flash_fwd.flash_ws_call_reasons(cpu, torch.bfloat16, 96, 1e4) == [
        "an sm_90 GPU", "head dim 64 or 128 (got 96)", "no rotary"]
