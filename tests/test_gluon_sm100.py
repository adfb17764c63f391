"""CPU tests of the Blackwell (sm_100) Gluon kernels (``kernels/sm100/block.py``), run through
``tests/gluon_shim.py`` (Gluon has no interpreter, and no sm_100 GPU is lent here).

The whole kernels, forward and backward, on persistent grids of a few programs (each with several
tiles, so the shared-memory rings and the two tensor-memory O buffers wrap), against
``reference.attention_forward`` / ``attention_backward``: jagged batches with every edge length
(0, 1, 63, 64, 65, 127, 128, 129, 200) at 64- and 128-row tiles, GQA, rotary with implicit and
given positions, causal, both schedules (the in-kernel scan and the block table). Every element
of O, dQ, dK, dV is stored exactly once (no row of another block, no empty slot stores), and the
shim checks the mbarriers: arrivals and TMA bytes balance in every phase (a barrier invalidated
mid-phase raises, more bytes than announced raise, a missing arrival deadlocks and fails), every
barrier initialized is invalidated, and tcgen05 products read operands of one dtype into tensor
memory (NaN until written, so a first product with ``use_acc=True`` would show).

What the shim does not model (timing, races inside a program, layouts, the tensor-memory
instruction shapes) is in its docstring: these tests check the kernels' logic, not the hardware.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tests next to Triton's interpreter (no sm_100 GPU runs these here)"),
    pytest.mark.usefixtures("single_thread"),
]

from blockattn_layers import reference  # noqa: E402
from blockattn_layers.kernels.common.schedule import Schedule  # noqa: E402
from blockattn_layers.kernels.sm100 import block as sm100  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402

LOG2E = 1.4426950408889634
FWD, BWD = sm100._sm100_fwd_kernel, sm100._sm100_bwd_kernel
EDGES = [0, 1, 63, 64, 65, 127, 128, 129, 200]


def _offsets(lengths, dtype=torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=dtype)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(dtype)
    return out


def _strides(**tensors) -> dict:
    return {f"stride_{name}{axis}": s for name, t in tensors.items() for axis, s in zip("thd", t.stride())}


def _sentinel(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert not torch.isnan(got).any(), f"{name}: NaN (an element never stored)"
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    assert err < (4e-3 if got.dtype == torch.float16 else 2.5e-2), f"{name}: relative error {err:.2e}"


class _Case:
    """Inputs of one launch in the block kernels' contract, and the reference's arguments."""

    def __init__(self, lengths, heads, kv_heads, dim, rotary, has_pos, causal, block_size, block_m,
                 dtype=torch.float16, offsets_dtype=torch.int32, seed=0):
        g = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        self.offsets = _offsets(lengths, offsets_dtype)
        self.q, self.k, self.v, self.do = (
            torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
        self.sched = Schedule(self.offsets, total, block_size, None)
        pos = torch.randint(0, 5000, (total,), generator=g, dtype=torch.int32) if has_pos else None
        scale, theta = dim ** -0.5, 10000.0
        self.values = dict(
            Q=self.q, K=self.k, V=self.v, DO=self.do, Sched=self.sched.table,
            Pos=pos if has_pos else self.sched.table, slots=self.sched.programs, num_seqs=self.sched.num_seqs,
            block_size=block_size, scale=scale, qk_scale=scale * LOG2E, log2_theta=math.log2(theta) if rotary else 0.0,
            kv_heads=kv_heads, GROUPS=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=dim,
            ROT_DIM=dim if rotary else 0, HAS_POS=has_pos, IS_CAUSAL=causal, INLINE_SEQS=self.sched.inline_seqs,
        )
        self.reference = (self.offsets, block_size, scale, causal, theta if rotary else None, pos, dim if rotary else 0,
                          False)

    def forward(self, grid) -> None:
        o = _sentinel(self.q.shape, self.q.dtype)
        run = gs.launch(FWD, grid, **self.values, O=o, **_strides(q=self.q, k=self.k, v=self.v, o=o))
        assert torch.equal(run.writes("O"), torch.ones(o.shape, dtype=torch.int32)), "O: not stored exactly once"
        _assert_close(o, reference.attention_forward(self.q, self.k, self.v, *self.reference), "O")

    def backward(self, grid) -> None:
        dq, dk, dv = (_sentinel(x.shape, x.dtype) for x in (self.q, self.k, self.v))
        strides = _strides(q=self.q, k=self.k, v=self.v, do=self.do, dq=dq, dk=dk, dv=dv)
        run = gs.launch(BWD, grid, **self.values, DQ=dq, DK=dk, DV=dv, **strides)
        want = reference.attention_backward(self.do, self.q, self.k, self.v, *self.reference)
        for name, got, ref in zip(("DQ", "DK", "DV"), (dq, dk, dv), want):
            assert torch.equal(run.writes(name), torch.ones(got.shape, dtype=torch.int32)), \
                f"{name}: not stored exactly once"
            _assert_close(got, ref, name)


# Blocks of 128 rows on 128-row tiles cover 0, 1, 63, 64, 65, 127 (ragged) and 128 (full, TMA);
# blocks of 64 on 64-row tiles make the 64 / 128 / 129 / 200 lengths' full blocks.
CASES = {
    # name: (lengths, heads, kv_heads, dim, rotary, has_pos, causal, block_size, block_m), keywords
    "b128_d64": ((EDGES, 2, 2, 64, False, False, False, 128, 128), {}),
    "b128_d128_gqa_causal": ((EDGES, 4, 2, 128, False, False, True, 128, 128), {}),
    "b128_d128_rope": ((EDGES, 2, 2, 128, True, False, False, 128, 128), {}),
    "b128_d64_rope_pos_causal_gqa_int64_offsets": ((EDGES, 4, 2, 64, True, True, True, 128, 128),
                                                   dict(offsets_dtype=torch.int64)),
    "b64_d128_rope_gqa": ((EDGES, 4, 2, 128, True, False, True, 64, 64), {}),
    "b64_d64_mqa_bf16": ((EDGES, 3, 1, 64, False, False, False, 64, 64), dict(dtype=torch.bfloat16)),
    "b100_d64_rope_pos": ((EDGES, 2, 2, 64, True, True, False, 100, 128), {}),
    "b128_d64_rope_table": (([0] * 510 + [129, 128, 1, 200], 2, 1, 64, True, False, True, 128, 128), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sm100_kernels(name):
    """Forward and backward of the sm_100 kernels, whole, on a persistent grid of 3 programs:
    the loader's TMA boxes (full blocks) and bare arrivals (ragged ones), the default partition's
    masked copies, in-place rotary and softmax, the MMA warp's products into tensor memory, the
    epilogue's TMA and masked stores; results match the reference, each element stored once."""
    args, keywords = CASES[name]
    case = _Case(*args, **keywords)
    case.forward((3,))
    case.backward((3,))


def test_sm100_one_program_and_many():
    """One program takes every tile (the rings wrap many times); more programs than tiles leave
    some with none."""
    case = _Case([65, 128, 0, 3], 2, 2, 64, False, False, False, 128, 128)
    case.forward((1,))
    case.backward((1,))
    tiles = case.sched.programs * 2
    case.forward((tiles + 3,))
    case.backward((tiles + 3,))


def test_stages_fit():
    """The rings' stages: 3 in the forward and 2 + 2 in the backward where they fit in shared
    memory, fewer at 128-row tiles of D = 128."""
    assert sm100.fwd_stages(128, 64) == 3 and sm100.fwd_stages(64, 128) == 3 and sm100.fwd_stages(64, 64) == 3
    assert sm100.fwd_stages(128, 128) == 2
    assert sm100.bwd_stages(64, 64) == (2, 2) and sm100.bwd_stages(128, 64) == (2, 2)
    assert sm100.bwd_stages(128, 128) == (1, 2) and sm100.bwd_stages(64, 128) == (2, 2)
