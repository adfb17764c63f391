"""The multi-tile ("jagged flash") Triton kernels on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest when no GPU is present): forward and the three
gradients against the float64 oracle, full attention and blocks of 256, GQA, causal, rotary,
odd tile borders, NaN-poisoned memory, tensor-map against pointer loads, determinism, opcheck
and dispatch. A ``gpu`` test checks bf16/fp16/fp32 on CUDA against the float64 reference.
(``tests/test_compile_check.py`` compiles the kernels for sm_80, sm_90 and sm_100.)

fp32 and fp16 only: bf16 arithmetic is wrong in the interpreter; bf16 needs the GPU.
The interpreter runs the 64-row tiles it uses by default, so lengths 63, 64, 65, 130 and 200
cross tile borders; one test drives the launchers with 16/32-row tiles on blocks of 40.
"""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockattn_layers as bl
from blockattn_layers.ops.backends.triton_block import interpreter_active
from blockattn_layers.kernels.flash import schedule as flash_common
from blockattn_layers.kernels.flash.bwd import flash_attention_bwd
from blockattn_layers.kernels.flash.fwd import flash_attention_fwd
from blockattn_layers.kernels.flash.schedule import FlashSchedule, tma_loads

from tests.oracle import (clean_and_poisoned, offsets_from_lengths, oracle_attention, rel_err, rotary_positions,
                          tf32_products)

interpret_only = pytest.mark.skipif(
    not interpreter_active(), reason="CPU interpreter tests; the GPU tests cover the kernels on a GPU"
)
pytestmark = pytest.mark.usefixtures("single_thread")

FULL_LENGTHS = [0, 1, 63, 64, 65, 200]
BLOCK_LENGTHS = [1, 0, 65, 300]
ROTARY_LENGTHS = [1, 65, 130]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _inputs(lengths, heads, kv_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return tuple(torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))


def _oracle(q, k, v, offsets, block_size, grad_out, **kw):
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = oracle_attention(qd, kd, vd, offsets, block_size, **kw)
    return want, torch.autograd.grad(want, (qd, kd, vd), grad_out.double())


def _assert_close(out, grads, want, want_grads, tol):
    assert rel_err(out, want) < tol
    for name, got, ref in zip("qkv", grads, want_grads):
        assert got.dtype == out.dtype and rel_err(got, ref) < 2 * tol, f"d{name}"


def _check(lengths, heads, kv_heads, dim, dtype, block_size, seed=0, tol=None, **kw):
    q, k, v = _inputs(lengths, heads, kv_heads, dim, dtype, seed)
    offsets = offsets_from_lengths(lengths)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, block_size, backend="triton_flash", **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    assert out.dtype == dtype and out.shape == q.shape
    _assert_close(out, grads, *_oracle(q, k, v, offsets, block_size, grad_out, **kw), tol or TOL[dtype])


@interpret_only
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), max_size=12),
    block_size=st.sampled_from([0, 1, 7, 40, 64, 256]),
    tile=st.sampled_from([16, 64]),
    exact=st.booleans(),
    late_first=st.booleans(),
)
def test_tile_table_covers_every_row_once(lengths, block_size, tile, exact, late_first):
    """Every token is a row of exactly one tile, inside its own block; other slots are empty."""
    offsets = offsets_from_lengths(lengths)
    total = sum(lengths)
    sched = FlashSchedule(offsets, total, block_size, tile, offsets.clone() if exact else None, block_size == 0)
    blocks = [[min(block_size or n, n - f) for f in range(0, n, block_size or max(n, 1))] for n in lengths]
    assert sched.programs <= total
    assert not exact or sched.programs == sum(-(-b // tile) for seq in blocks for b in seq)
    start, length, first_row, tile_row = sched.table(late_first).tolist() if sched.programs else ([],) * 4
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    seen = torch.zeros(total, dtype=torch.int64)
    for s, n, f, r in zip(start, length, first_row, tile_row):
        if n == 0:
            continue
        seq = int(seq_of[s])
        assert s - f == offsets[seq] and 0 < n <= (block_size or lengths[seq]) and f + n <= lengths[seq]
        assert 0 <= r < n and r % tile == 0
        seen[s + r:s + min(r + tile, n)] += 1
    assert torch.equal(seen, torch.ones(total, dtype=torch.int64))


@interpret_only
@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), max_size=12), chunk=st.sampled_from([1024, 4]))
def test_full_attention_visits_longest_first(lengths, chunk):
    """Full attention's table lists sequences longest first, ties in batch order: sorted inside
    the prefix kernel up to one chunk of sequences, by a device argsort past it."""
    from blockattn_layers.kernels.flash import schedule as _flash_common

    offsets = offsets_from_lengths(lengths)
    old = _flash_common._PREFIX_CHUNK
    _flash_common._PREFIX_CHUNK = chunk
    try:
        sched = FlashSchedule(offsets, sum(lengths), 0, 16, None, True)
        table = sched.table(False)[:2].tolist() if sched.programs else ([], [])
    finally:
        _flash_common._PREFIX_CHUNK = old
    seq_of = {int(offsets[i]): i for i in range(len(lengths)) if lengths[i]}
    visited = []
    for s, n in zip(*table):
        if n and seq_of[s] not in visited:
            visited.append(seq_of[s])
    expected = sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: (-lengths[i], i))
    assert visited == expected


@interpret_only
@pytest.mark.parametrize(
    "lengths,block_size,heads,kv_heads,dim,causal,dtype",
    [
        (FULL_LENGTHS, None, 2, 2, 32, False, torch.float32),
        (FULL_LENGTHS, None, 4, 2, 16, True, torch.float16),
        (BLOCK_LENGTHS, 256, 2, 1, 24, True, torch.float32),
        (BLOCK_LENGTHS, 256, 2, 2, 32, False, torch.float16),
    ],
    ids=["full-fp32", "full-gqa-causal-fp16", "b256-mqa-causal-d24-fp32", "b256-fp16"],
)
def test_matches_oracle(lengths, block_size, heads, kv_heads, dim, causal, dtype):
    _check(lengths, heads, kv_heads, dim, dtype, block_size, causal=causal)


@interpret_only
@pytest.mark.parametrize(
    "rotary",
    [
        dict(rope_theta=10000.0, causal=True),
        dict(rope_theta=500.0, rotary_dim=16, rotary_interleaved=True),
        dict(rope_theta=10000.0, rotary_dim=16, positions="int"),
        dict(rope_theta=10000.0, rotary_interleaved=True, causal=True, positions="float"),
    ],
    ids=["half-causal", "interleaved-partial", "partial-int-positions", "interleaved-float-positions"],
)
def test_rotary(rotary):
    rotary = dict(rotary)
    total = sum(ROTARY_LENGTHS)
    positions, tol = rotary_positions(rotary.pop("positions", None), total)
    if positions is not None:
        rotary["positions"] = positions
    _check(ROTARY_LENGTHS, 2, 1, 32, torch.float32, None, tol=tol, **rotary)


@interpret_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_small_tiles_on_unaligned_blocks_and_cpu_offsets(causal):
    """Blocks of 40 rows on 16-row query / 32-row key tiles (dK/dV: 32-row key / 16-row query tiles)."""
    lengths = [1, 40, 0, 97]
    q, k, v = _inputs(lengths, 2, 1, 16, torch.float32, 7)
    offsets = offsets_from_lengths(lengths)
    args = (offsets, 40, 0.3, causal, 300.0, None, 8, True)
    out, lse = flash_attention_fwd(q, k, v, *args, None, tiles=(16, 32))
    exact, _ = flash_attention_fwd(q, k, v, *args, offsets.clone(), tiles=(16, 32))
    assert torch.equal(out, exact)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    grads = flash_attention_bwd(grad_out, q, k, v, out, lse, *args, None, tiles=dict(dkv=(32, 16), dq=(16, 32)))
    want, want_grads = _oracle(q, k, v, offsets, 40, grad_out, scale=0.3, causal=causal, rope_theta=300.0,
                               rotary_dim=8, rotary_interleaved=True)
    _assert_close(out, grads, want, want_grads, TOL[torch.float32])


@interpret_only
def test_lse_is_the_logsumexp_of_scaled_scores():
    lengths = [100, 0, 37]
    q, k, v = _inputs(lengths, 2, 1, 16, torch.float32, 11)
    offsets = offsets_from_lengths(lengths)
    _, lse = flash_attention_fwd(q, k, v, offsets, 0, 0.25, False, None, None, 0, False, None)
    want = torch.cat([
        torch.logsumexp(torch.einsum("thd,sd->hts", q[a:b].double(), k[a:b, 0].double()) * 0.25, -1)
        for a, b in ((0, 100), (100, 137))
    ], dim=1)
    assert lse.dtype == torch.float32 and lse.shape == (2, 137)
    assert rel_err(lse, want) < 1e-6


@interpret_only
def test_nan_poisoned_memory_noncontiguous_int32_offsets():
    lengths = [3, 0, 130]
    total = sum(lengths)
    poison = torch.full((total + 64, 2, 3, 32), float("nan"))
    poison[:total] = torch.randn(total, 2, 3, 32, generator=torch.Generator().manual_seed(9))
    q, k, v = poison[:total, :, 0], poison[:total, :, 1], poison[:total, :, 2]
    assert not q.is_contiguous()
    offsets = offsets_from_lengths(lengths, torch.int32)
    qs, ks, vs = q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
    out = bl.block_attention(qs, ks, vs, offsets, None, scale=0.2, backend="triton_flash")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    _assert_close(out, grads, *_oracle(q, k, v, offsets, None, grad_out, scale=0.2), TOL[torch.float32])


@interpret_only
@pytest.mark.parametrize("block_size,causal", [(None, True), (256, False)], ids=["full-causal", "b256"])
def test_tensor_map_and_pointer_loads_agree(monkeypatch, block_size, causal):
    """Plain heads take tensor-map loads of whole loop tiles; turned off, pointer loads. With GQA
    the dK/dV pass adds the heads' partial last tiles in another order, so equal to rounding."""
    q, k, v = _inputs(BLOCK_LENGTHS + [64, 63], 4, 2, 32, torch.float32, 12)
    offsets = offsets_from_lengths(BLOCK_LENGTHS + [64, 63])
    assert tma_loads(q, k, v, rope_theta=None)
    runs = []
    for maps in (True, False):
        monkeypatch.setattr(flash_common, "TENSOR_MAPS", maps)
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        out = bl.block_attention(qs, ks, vs, offsets, block_size, causal=causal, backend="triton_flash")
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
        runs.append((out, *torch.autograd.grad(out, (qs, ks, vs), grad_out)))
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(*runs))
    _assert_close(runs[0][0], runs[0][1:], *_oracle(q, k, v, offsets, block_size, grad_out, causal=causal),
                  TOL[torch.float32])


def test_tensor_maps_off_by_environment():
    """``BLOCKATTN_TENSOR_MAPS=0`` turns the tensor-map loads off at import; by default they are on."""
    code = ("import torch; from blockattn_layers.kernels.flash.schedule import tma_loads; "
            "x = torch.zeros(8, 2, 32); print(tma_loads(x, x, x, rope_theta=None))")
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, BLOCKATTN_TENSOR_MAPS=value)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and result.stdout.split() == [want], result.stderr[-2000:]


@interpret_only
@pytest.mark.parametrize("fast,causal", [(False, False), (True, True)], ids=["deterministic", "fast-causal"])
def test_non_finite_values_stay_in_their_sequence(monkeypatch, fast, causal):
    """A NaN in one sequence leaves its neighbours' outputs and gradients finite: no tile reads
    rows past its block (tensor-map loads take whole tiles only), and the fast backward's atomic
    adds (its Triton form, ``TRITON_FAST_TAKEN``) touch only the rows of the key tile's own block."""
    from blockattn_layers.kernels.flash import bwd

    monkeypatch.setattr(bwd, "TRITON_FAST_TAKEN", [fast])
    lengths = [70, 65, 100]
    q, k, v = _inputs(lengths, 2, 2, 32, torch.float32, 14)
    for x in (q, k, v):
        x[70:135] = float("nan")
    offsets = offsets_from_lengths(lengths)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, None, causal=causal, backend="triton_flash")
    with bl.fast_backward(fast):
        grads = torch.autograd.grad(out, (qs, ks, vs), torch.ones_like(out))
    for x in (out, *grads):
        assert torch.isfinite(x[:70]).all() and torch.isfinite(x[135:]).all()
        assert torch.isnan(x[70:135]).all()


@interpret_only
def test_backward_bitwise_deterministic():
    q, k, v = (x.requires_grad_() for x in _inputs(ROTARY_LENGTHS, 2, 1, 16, torch.float32, 5))
    offsets = offsets_from_lengths(ROTARY_LENGTHS)
    out = bl.block_attention(q, k, v, offsets, None, causal=True, backend="triton_flash")
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


FAST_CASES = [
    dict(lengths=FULL_LENGTHS, heads=2, kv_heads=2, dim=32, dtype=torch.float32, block_size=None),
    dict(lengths=FULL_LENGTHS, heads=4, kv_heads=2, dim=16, dtype=torch.float16, block_size=None, causal=True),
    dict(lengths=BLOCK_LENGTHS, heads=2, kv_heads=1, dim=24, dtype=torch.float32, block_size=256, causal=True),
    dict(lengths=ROTARY_LENGTHS, heads=2, kv_heads=1, dim=32, dtype=torch.float32, block_size=None,
         rope_theta=500.0, rotary_dim=16, rotary_interleaved=True, causal=True),
]


@interpret_only
@pytest.mark.parametrize("case", FAST_CASES, ids=["full-fp32", "full-gqa-causal-fp16", "b256-mqa-causal-d24",
                                                  "rotary-interleaved-partial-gqa-causal"])
def test_fast_backward_matches_oracle_and_the_deterministic_backward(monkeypatch, case):
    """The fast backward's Triton form (dQ by atomic adds in the dK/dV pass) runs under
    ``fast_backward()`` with ``TRITON_FAST_TAKEN`` set and matches the float64 oracle; its gradients
    agree with the deterministic backward's to rounding (its dK/dV pass takes the scores transposed,
    so not bit for bit)."""
    from blockattn_layers.kernels.flash import bwd

    monkeypatch.setattr(bwd, "TRITON_FAST_TAKEN", [True])
    case = dict(case)
    lengths, heads, kv_heads, dim, dtype = (case.pop(n) for n in ("lengths", "heads", "kv_heads", "dim", "dtype"))
    fast = []
    real = bwd._fast_bwd
    monkeypatch.setattr(bwd, "_fast_bwd", lambda *a: fast.append(1) or real(*a))
    with bl.fast_backward():
        _check(lengths, heads, kv_heads, dim, dtype, seed=3, **case)
    assert fast == [1]
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, heads, kv_heads, dim, dtype, 3))
    offsets = offsets_from_lengths(lengths)
    out = bl.block_attention(q, k, v, offsets, backend="triton_flash", **case)
    g = torch.randn_like(out)
    with bl.fast_backward():
        fast_grads = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert fast == [1, 1]
    assert all(rel_err(a, b.double()) < TOL[dtype] for a, b in zip(fast_grads, grads))


@interpret_only
@pytest.mark.parametrize("case", FAST_CASES[1:3], ids=["full-gqa-causal-fp16", "b256-mqa-causal-d24"])
def test_fast_backward_runs_the_deterministic_one_where_no_one_pass_form_is_taken(monkeypatch, case):
    """By default (``TRITON_FAST_TAKEN`` off) a fast backward that the Gluon kernel does not take (here: off
    sm_90) is the deterministic backward, measured faster than the Triton one-pass form: no atomic-add
    pass runs and the gradients are bitwise the deterministic ones."""
    from blockattn_layers.kernels.flash import bwd

    assert bwd.TRITON_FAST_TAKEN == [False] and not bwd.fast_form_taken(False) and bwd.fast_form_taken(True)
    case = dict(case)
    lengths, heads, kv_heads, dim, dtype = (case.pop(n) for n in ("lengths", "heads", "kv_heads", "dim", "dtype"))
    fast = []
    real = bwd._fast_bwd
    monkeypatch.setattr(bwd, "_fast_bwd", lambda *a: fast.append(1) or real(*a))
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, heads, kv_heads, dim, dtype, 4))
    out = bl.block_attention(q, k, v, offsets_from_lengths(lengths), backend="triton_flash", **case)
    g = torch.randn_like(out)
    with bl.fast_backward():
        fast_grads = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert fast == []
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, grads))


@interpret_only
def test_opcheck_forward_op():
    lengths = [5, 0, 33]
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, 2, 1, 16, torch.float32, 6))
    args = (q, k, v, offsets_from_lengths(lengths), 0, 0.25, True, 1000.0, None, 16, False, None, None,
            "triton_flash")
    torch.library.opcheck(torch.ops.blockattn.attention_fwd.default, args)


@interpret_only
def test_torch_compile_fullgraph():
    """The autograd entry traces to the registered ops (fakes included) without graph breaks."""
    lengths = [5, 0, 33]
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, 2, 1, 16, torch.float32, 12))
    offsets = offsets_from_lengths(lengths)

    def loss(q, k, v, offsets):
        return (bl.block_attention(q, k, v, offsets, None, causal=True, backend="triton_flash") ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, offsets), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v, offsets), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(got, want))

@interpret_only
def test_dispatch_auto_on_cuda_and_refuses_small_blocks(monkeypatch):
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="triton_flash.*block_size 64 <= 128"):
        bl.block_attention(q, q, q, torch.tensor([0, 4]), block_size=64, backend="triton_flash")
    full = ("cpu", None, torch.bfloat16, 128, 8, 8, None, True, True)
    assert bl.dispatch.select_backend("auto", bl.AttentionRequest(*full)).name == "reference"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for block, name in ((None, "triton_flash"), (512, "triton_flash"), (128, "triton")):
        req = bl.AttentionRequest("cuda", (9, 0), torch.bfloat16, 128, 8, 8, block, True, True)
        assert bl.dispatch.select_backend("auto", req).name == name
    old = bl.AttentionRequest("cuda", (7, 5), torch.bfloat16, 128, 8, 8, None, True, True)
    assert bl.dispatch.select_backend("auto", old).name == "reference"
    req = bl.AttentionRequest("cpu", None, torch.float32, 16, 2, 2, None, False, False)
    assert bl.explain(req)["triton_flash"] == []



GPU_LENGTHS = [0, 1, 127, 128, 129, 700, 0, 1500, 33]
GPU_CASES = [
    dict(heads=4, kv_heads=2, dim=128, block_size=None, causal=True),
    dict(heads=4, kv_heads=4, dim=64, block_size=None),
    dict(heads=4, kv_heads=1, dim=128, block_size=512, rope_theta=10000.0),
    dict(heads=2, kv_heads=2, dim=80, block_size=256, causal=True),
    dict(heads=2, kv_heads=2, dim=256, block_size=None, rope_theta=500.0, rotary_dim=64, rotary_interleaved=True),
    dict(heads=2, kv_heads=1, dim=256, block_size=256, causal=True),
    dict(heads=4, kv_heads=2, dim=192, block_size=384),
]


def _gpu_inputs(case: dict, dtype, seed: int):
    """``(call keywords, head dim, q, k, v, offsets)`` of a GPU case on GPU_LENGTHS."""
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(GPU_LENGTHS)
    q, k, v = (torch.randn(total, h, dim, device="cuda", generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return case, dim, q, k, v, offsets_from_lengths(GPU_LENGTHS, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["deterministic", "fast", "triton_fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gpu_matches_float64_reference(monkeypatch, case, dtype, mode):
    """Error within 2x (forward) / 3x (gradients) of the naive same-dtype error, with a floor, in
    both backwards; the deterministic one gives the same bits twice, the fast one the deterministic
    dK and dV up to rounding: as chosen (the Gluon one-pass kernel or the deterministic backward),
    and in its Triton form (atomic dQ, ``TRITON_FAST_TAKEN``) where the Gluon kernel does not take it."""
    from blockattn_layers import reference
    from blockattn_layers.kernels.flash import bwd

    monkeypatch.setattr(bwd, "TRITON_FAST_TAKEN", [mode == "triton_fast"])
    case, dim, q, k, v, offsets = _gpu_inputs(case, dtype, 0)
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, backend="triton_flash", **case)
    grad_out = torch.randn_like(out)
    with bl.fast_backward(mode != "deterministic"):
        grads = torch.autograd.grad(out, (qs, ks, vs), grad_out, retain_graph=True)
    again = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    if mode == "deterministic":
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "backward not bitwise deterministic"
    else:
        assert all(rel_err(a, b.double()) < 1e-2 for a, b in zip(grads[1:], again[1:]))
    rot = case.get("rotary_dim", dim) if "rope_theta" in case else 0
    args = (case["block_size"], dim ** -0.5, case.get("causal", False), case.get("rope_theta"), None, rot,
            case.get("rotary_interleaved", False))
    d = [x.double() for x in (q, k, v)]
    oracle = reference.attention_forward(*d, offsets, *args)
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *args)
    naive = reference.attention_forward(q, k, v, offsets, *args, dtype=dtype)
    naive_grads = reference.attention_backward(grad_out, q, k, v, offsets, *args, dtype=dtype)
    floor = {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert torch.isfinite(out).all()
    assert rel_err(out, oracle) <= max(2 * rel_err(naive, oracle), floor)
    for name, got, ref, base in zip("qkv", grads, oracle_grads, naive_grads):
        assert torch.isfinite(got).all() and rel_err(got, ref) <= max(3 * rel_err(base, ref), 1.5 * floor), f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["deterministic", "fast"])
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[2]], ids=["full-causal-gqa", "block512-rotary"])
def test_gpu_float32_with_tf32_products(case, mode):
    """float32 with TF32 products allowed (``torch.backends.cuda.matmul.allow_tf32``), D128: the
    kernels' tensor-core tiles, whose 16-bit sizes needed more shared memory than an H200 program
    gets, launch and match the float64 reference within twice the error of the same-precision
    naive computation (a floor of 4e-3)."""
    from blockattn_layers import reference

    case, dim, q, k, v, offsets = _gpu_inputs(case, torch.float32, 4)
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    rot = case.get("rotary_dim", dim) if "rope_theta" in case else 0
    args = (case["block_size"], dim ** -0.5, case.get("causal", False), case.get("rope_theta"), None, rot, False)
    with tf32_products():
        out = bl.block_attention(qs, ks, vs, offsets, backend="triton_flash", **case)
        grad_out = torch.randn_like(out)
        with bl.fast_backward(mode == "fast"):
            grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
        naive = reference.attention_forward(q, k, v, offsets, *args)
        naive_grads = reference.attention_backward(grad_out, q, k, v, offsets, *args)
    d = [x.double() for x in (q, k, v)]
    oracle = reference.attention_forward(*d, offsets, *args)
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *args)
    assert rel_err(out, oracle) <= max(2 * rel_err(naive, oracle), 4e-3)
    for name, got, ref, base in zip("qkv", grads, oracle_grads, naive_grads):
        assert rel_err(got, ref) <= max(3 * rel_err(base, ref), 6e-3), f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:2] + GPU_CASES[5:6], ids=["full-gqa-causal-d128", "full-d64", "b256-d256"])
def test_gpu_tensor_maps_match_pointer_loads(monkeypatch, case):
    """Plain heads on sm_90+ take tensor-map loads; the pointer loads give the same forward bits and
    gradients equal to rounding (GQA adds the dK/dV pass's partial tiles in another order)."""
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(sum(GPU_LENGTHS), h, dim, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    offsets = offsets_from_lengths(GPU_LENGTHS, device="cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor maps need sm_90+")
    assert tma_loads(q, k, v, rope_theta=None)
    grad_out = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    runs = []
    for maps in (True, False):
        monkeypatch.setattr(flash_common, "TENSOR_MAPS", maps)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = bl.block_attention(*leaves, offsets, backend="triton_flash", **case)
        runs.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(rel_err(a, b) < 1e-2 for a, b in zip(runs[0][1:], runs[1][1:]))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c["dim"] in (64, 128) and "rope_theta" not in c]
                         + [dict(heads=8, kv_heads=2, dim=128, block_size=512),
                            dict(heads=8, kv_heads=2, dim=64, block_size=None, causal=True),
                            dict(heads=8, kv_heads=2, dim=64, block_size=256),
                            dict(heads=8, kv_heads=2, dim=128, block_size=200, causal=True)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("overlap,pingpong,persistent", [(False, False, False), (True, False, False),
                                                         (True, True, False), (False, False, True),
                                                         (True, False, True), (False, False, "m192"),
                                                         (False, False, "pingpong"), (False, False, "split_kv"),
                                                         (True, False, "split_kv"), (False, False, "default"),
                                                         (False, False, "shift_last"),
                                                         (False, False, "early_release"),
                                                         (False, False, "thread_release")],
                         ids=["serial", "overlap", "pingpong", "persistent", "persistent_overlap",
                              "persistent_m192", "persistent_pingpong", "persistent_split_kv",
                              "persistent_overlap_split_kv", "persistent_default", "persistent_shift_last",
                              "persistent_early_release", "persistent_thread_release"])
def test_gpu_gluon_forward_matches_float64_reference(monkeypatch, case, dtype, overlap, pingpong, persistent):
    """The warp-specialized Gluon forward (every call it admits with unverified kernels allowed),
    its consumers' products one after the other, overlapped (``OVERLAP``) or in ping-pong, or its
    persistent form (``sm90.flash_persistent``, 128-row items; "m192": 192-row items, three consumer
    warpgroups, at full attention with D 64, as taken by default, and D 128, a candidate; "pingpong": the
    serial loop's products in turns, on the default items; "split_kv": k and v on barriers of their own;
    "default": the items and consumer loops taken by default (a block's ragged last key tile its last keys at
    blocks of up to 256 tokens), the others one loop everywhere; "shift_last": the defaults with that last key
    tile in every serial loop, full attention too; "early_release": the
    defaults with the previous item's query buffer released after the first ``Q K^T``; "thread_release": the
    defaults with key and value slots released by every consumer thread's own arrival): output
    within 2x the naive same-dtype error of the float64 oracle, logsumexp as the Triton forward's, and
    the backward on its output and logsumexp as accurate as on the Triton forward's."""
    from blockattn_layers import reference
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90 import flash_fwd as ws
    from blockattn_layers.kernels.sm90 import flash_persistent

    monkeypatch.setattr(flash_persistent, "TAKEN", [bool(persistent)])
    monkeypatch.setattr(flash_persistent, "THREE_CONSUMER_HEAD_DIMS",
                        frozenset({64, 128} if persistent == "m192"
                                  else {64} if persistent in ("pingpong", "default", "shift_last", "early_release",
                                                              "thread_release")
                                  else ()))
    monkeypatch.setattr(flash_persistent, "PINGPONG", persistent == "pingpong")
    if persistent == "shift_last":
        monkeypatch.setattr(flash_persistent, "SHIFT_LAST_BLOCKS", (0, 1 << 62))
    monkeypatch.setattr(flash_persistent, "EARLY_RELEASE", persistent == "early_release")
    monkeypatch.setattr(flash_persistent, "THREAD_RELEASE", persistent == "thread_release")
    if persistent not in ("default", "shift_last", "early_release", "thread_release"):  # one loop everywhere (split_kv: k, v on barriers of their own)
        monkeypatch.setattr(flash_persistent, "LOOPS", {key: (False, persistent == "split_kv")
                                                        for key in flash_persistent.LOOPS})
    launches = []
    launch = flash_persistent.launch
    monkeypatch.setattr(flash_persistent, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))

    case, dim, q, k, v, offsets = _gpu_inputs(case, dtype, 2)
    block, causal = case["block_size"] or 0, case.get("causal", False)
    calls = []
    real = ws.flash_attention_fwd_ws
    monkeypatch.setattr(ws, "flash_attention_fwd_ws", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    monkeypatch.setattr(ws, "overlap_taken", lambda: overlap)
    monkeypatch.setattr(ws, "pingpong_taken", lambda: pingpong)
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, backend="triton_flash", **case)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    assert calls == [1] and launches == ([1] if persistent else [])
    _, lse = real(q, k, v, offsets, block, dim ** -0.5, causal)
    _, want_lse = flash_attention_fwd(q, k, v, offsets, block, dim ** -0.5, causal, None, None, 0, False, None)
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=0)
    args = (case["block_size"], dim ** -0.5, causal, None, None, 0, False)
    d = [x.double() for x in (q, k, v)]
    oracle = reference.attention_forward(*d, offsets, *args)
    naive = reference.attention_forward(q, k, v, offsets, *args, dtype=dtype)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert torch.isfinite(out).all() and rel_err(out, oracle) <= max(2 * rel_err(naive, oracle), floor)
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *args)
    naive_grads = reference.attention_backward(grad_out, q, k, v, offsets, *args, dtype=dtype)
    for name, got, ref, base in zip("qkv", grads, oracle_grads, naive_grads):
        assert rel_err(got, ref) <= max(3 * rel_err(base, ref), 1.5 * floor), f"d{name}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c["dim"] in (64, 128) and "rope_theta" not in c]
                         + [dict(heads=8, kv_heads=2, dim=128, block_size=512, causal=True),
                            dict(heads=2, kv_heads=2, dim=64, block_size=192),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, consumer_adds=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=None, consumer_adds=True),
                            dict(heads=2, kv_heads=2, dim=128, block_size=384, consumer_adds=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, p_beside_dp=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=None, p_beside_dp=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, dkdv_only=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=384, dkdv_only=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=None, dkdv_only=True),
                            dict(heads=8, kv_heads=2, dim=64, block_size=None, causal=True, dkdv_only=True),
                            dict(heads=8, kv_heads=2, dim=64, block_size=None, causal=True, dkdv_only=True,
                                 narrow=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, rows_by_loader=True),
                            dict(heads=2, kv_heads=2, dim=128, block_size=384, rows_by_loader=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=None, rows_by_loader=True),
                            dict(heads=8, kv_heads=2, dim=64, block_size=None, causal=True, dkdv_only=True,
                                 rows_by_loader=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, rows_by_loader=True,
                                 thread_release=True),
                            dict(heads=2, kv_heads=2, dim=128, block_size=384, rows_by_loader=True,
                                 thread_release=True),
                            dict(heads=4, kv_heads=4, dim=64, block_size=None, thread_release=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, rows_by_loader=True,
                                 thread_release=True, dq_lag=True),
                            dict(heads=2, kv_heads=2, dim=128, block_size=384, dq_lag=True),
                            dict(heads=4, kv_heads=4, dim=128, block_size=None, rows_by_loader=True,
                                 thread_release=True, dq_lag=True, stagger=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, dq_lag=True,
                                 stagger=True),
                            dict(heads=8, kv_heads=2, dim=128, block_size=None, causal=True, lean_writer=True),
                            dict(heads=2, kv_heads=2, dim=128, block_size=384, lean_writer=True)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gpu_gluon_backward_matches_float64_reference(monkeypatch, case, dtype, fast):
    """The fast or deterministic backward with its dK/dV pass by the warp-specialized Gluon kernel
    (``sm90.flash_bwd``, ``TAKEN`` set): gradients within 3x the naive same-dtype error of the float64
    oracle (with a floor); the deterministic one bitwise the same twice. dQ's adds by the writer
    partition (``DQ_WRITER``, the default), ``consumer_adds``: by the consumers; ``p_beside_dp``: P
    computed while dP's product runs (``P_BESIDE_DP``); ``rows_by_loader``: each step's lse and delta copied
    by the loader warp (``ROWS_BY_LOADER``); ``thread_release``: the ring's slots released by every consumer
    thread (``THREAD_RELEASE``); ``dq_lag``: each step's dQ product the step before's (``DQ_LAG``);
    ``stagger``: warpgroup 1 half a step behind (``STAGGER``); ``lean_writer``: the writer warp on fewer
    registers (``LEAN_WRITER``, which ``dq_lag`` takes too); ``dkdv_only``: the deterministic backward with
    the kernel computing dK and dV only, beside the Triton dQ pass (``DKDV_ONLY_TAKEN``, with
    ``ORDERED_HEAD_DIMS`` emptied; the fast one as ``FAST_TAKEN`` takes it), at D 64 over 128 query
    rows a step (``DKDV_ONLY_WIDE_HEAD_DIMS``), ``narrow``: over 64. The deterministic one otherwise has the writer add
    dQ's terms in order by TMA reduce-adds."""
    from blockattn_layers import reference
    from blockattn_layers.kernels.sm90 import flash_bwd

    case = dict(case)
    dkdv_only = case.pop("dkdv_only", False)
    if case.pop("narrow", False):
        monkeypatch.setattr(flash_bwd, "DKDV_ONLY_WIDE_HEAD_DIMS", frozenset())
    monkeypatch.setattr(flash_bwd, "DQ_WRITER", not case.pop("consumer_adds", False))
    if case.pop("p_beside_dp", False):
        monkeypatch.setattr(flash_bwd, "P_BESIDE_DP", True)
    if case.pop("rows_by_loader", False):
        monkeypatch.setattr(flash_bwd, "ROWS_BY_LOADER", True)
    if case.pop("thread_release", False):
        monkeypatch.setattr(flash_bwd, "THREAD_RELEASE", True)
    if case.pop("dq_lag", False):
        monkeypatch.setattr(flash_bwd, "DQ_LAG", True)
        monkeypatch.setattr(flash_bwd, "LEAN_WRITER", True)
    if case.pop("lean_writer", False):
        monkeypatch.setattr(flash_bwd, "LEAN_WRITER", True)
    if case.pop("stagger", False):
        monkeypatch.setattr(flash_bwd, "STAGGER", True)
    launches = []
    launch = flash_bwd.launch_bwd
    monkeypatch.setattr(flash_bwd, "launch_bwd", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    case, dim, q, k, v, offsets = _gpu_inputs(case, dtype, 5)
    causal = case.get("causal", False)
    grad_out = torch.randn_like(q)
    monkeypatch.setattr(flash_bwd, "TAKEN", [not dkdv_only])
    monkeypatch.setattr(flash_bwd, "DKDV_ONLY_TAKEN", [dkdv_only])
    if dkdv_only:
        monkeypatch.setattr(flash_bwd, "ORDERED_HEAD_DIMS", frozenset())
    runs = []
    for _ in range(1 if fast else 2):
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        with bl.fast_backward(fast):
            out = bl.block_attention(qs, ks, vs, offsets, backend="triton_flash", **case)
            runs.append(torch.autograd.grad(out, (qs, ks, vs), grad_out))
    assert launches == [1] * len(runs)
    grads = runs[0]
    if not fast:
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    args = (case["block_size"], dim ** -0.5, causal, None, None, 0, False)
    d = [x.double() for x in (q, k, v)]
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *args)
    naive_grads = reference.attention_backward(grad_out, q, k, v, offsets, *args, dtype=dtype)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    for name, got, ref, base in zip("qkv", grads, oracle_grads, naive_grads):
        assert torch.isfinite(got).all(), f"d{name}"
        assert rel_err(got, ref) <= max(3 * rel_err(base, ref), 1.5 * floor), f"d{name}"


def _nan_sequence_inputs(dim: int):
    """``(offsets, q, k, v, keep)``: bf16 CUDA inputs of ragged sequences (4 query heads, 2 kv
    heads) whose second sequence is NaN, and the rows outside it."""
    lengths = [130, 70, 300, 1, 257]
    offsets = offsets_from_lengths(lengths, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(sum(lengths), h, dim, device="cuda", generator=g, dtype=torch.bfloat16) for h in (4, 2, 2))
    for x in (q, k, v):
        x[130:200] = float("nan")
    keep = torch.ones(sum(lengths), dtype=torch.bool, device="cuda")
    keep[130:200] = False
    return offsets, q, k, v, keep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("writer,fast,dkdv_only,rows_by_loader", [
    (False, False, False, False), (True, False, False, False), (True, True, False, False), (True, False, True, False),
    (True, False, "narrow", False), (True, True, False, True), (True, False, True, True),
    (True, True, False, "thread_release"), (True, True, False, "dq_lag")],
    ids=["consumers-add", "writer-adds", "writer-tma-adds", "dkdv-only", "dkdv-only-narrow", "rows-by-loader",
         "dkdv-only-rows-by-loader", "rows-by-loader-thread-release", "dq-lag"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_gluon_backward_keeps_a_nan_in_its_sequence(monkeypatch, dim, writer, fast, dkdv_only, rows_by_loader):
    """The Gluon dK/dV pass's tensor maps span each block's rows and its lse / delta copies stop at
    the block's end: a NaN sequence between ragged ones has NaN gradients, every other row finite
    gradients equal to the Triton deterministic backward's within bf16 rounding (``writer``: dQ's
    adds by the writer partition, in order by TMA reduce-adds over a tensor map of each block's
    rows; ``fast``: the fast backward, the writer's TMA reduce-adds in any order; ``dkdv_only``: the
    deterministic backward with the kernel computing dK and dV only, beside the Triton dQ pass, over 128
    query rows a step at D 64; ``"narrow"``: over 64; ``rows_by_loader``: lse and delta copied by the loader,
    masked at the block's end; ``"thread_release"``: that, and the ring's slots released by every consumer
    thread; ``"dq_lag"``: that, and each step's dQ product the step before's, warpgroup 1 half a step behind)."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    monkeypatch.setattr(flash_bwd, "ROWS_BY_LOADER", bool(rows_by_loader))
    monkeypatch.setattr(flash_bwd, "THREAD_RELEASE", rows_by_loader in ("thread_release", "dq_lag"))
    monkeypatch.setattr(flash_bwd, "DQ_LAG", rows_by_loader == "dq_lag")
    monkeypatch.setattr(flash_bwd, "STAGGER", rows_by_loader == "dq_lag")
    monkeypatch.setattr(flash_bwd, "LEAN_WRITER", rows_by_loader == "dq_lag")
    if dkdv_only == "narrow":
        monkeypatch.setattr(flash_bwd, "DKDV_ONLY_WIDE_HEAD_DIMS", frozenset())

    monkeypatch.setattr(flash_bwd, "DQ_WRITER", writer)
    monkeypatch.setattr(flash_bwd, "FAST_TAKEN", [False])
    monkeypatch.setattr(flash_bwd, "DKDV_ONLY_HEAD_DIMS", frozenset())
    monkeypatch.setattr(flash_bwd, "ORDERED_HEAD_DIMS", frozenset())

    offsets, q, k, v, keep = _nan_sequence_inputs(dim)
    grad_out = torch.randn_like(q)
    runs = []
    for gluon in (True, False):
        monkeypatch.setattr(flash_bwd, "TAKEN", [gluon and not dkdv_only])
        monkeypatch.setattr(flash_bwd, "DKDV_ONLY_TAKEN", [gluon and dkdv_only])
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with bl.fast_backward(fast and gluon):
            out = bl.block_attention(*leaves, offsets, block_size=None, backend="triton_flash", causal=True)
            runs.append(torch.autograd.grad(out, leaves, grad_out))
    for got, want in zip(*runs):
        assert torch.isnan(got[~keep]).all() and torch.isfinite(got[keep]).all()
        assert rel_err(got[keep], want[keep]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", ["dq-store", "dq-store-rows-by-loader", "dq-store-delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size,heads,kv_heads,causal", [(128, 8, 2, False), (100, 2, 2, True),
                                                              (64, 4, 1, True), (16, 2, 2, False)])
def test_gpu_gluon_backward_stores_dq_at_blocks_of_one_key_tile(monkeypatch, block_size, heads, kv_heads, causal,
                                                                 dim, dtype, form):
    """``DQ_STORE`` (``sm90.flash_bwd``): at blocks one 128-row key tile holds whole the Gluon dK/dV pass stores
    dQ itself (D 128: each consumer its column half; D 64: the writer the warpgroups' terms' sum; no float32
    sums, no cast pass launched), in both modes: gradients within 3x the naive same-dtype error of the float64
    oracle (ragged, zero-length and length-1 sequences), the same bits twice, and a NaN sequence's gradients
    NaN, every other row's finite (``dq-store-rows-by-loader``: with the rows by the loader and thread releases;
    ``dq-store-delta``: the delta rows computed in the kernel, ``DELTA_IN_KERNEL``, no delta pass launched)."""
    from blockattn_layers import reference
    from blockattn_layers.kernels.flash import bwd
    from blockattn_layers.kernels.flash.fwd import flash_attention_fwd
    from blockattn_layers.kernels.sm90 import flash_bwd

    monkeypatch.setattr(flash_bwd, "TAKEN", [True])
    monkeypatch.setattr(flash_bwd, "DQ_STORE_HEAD_DIMS", frozenset({64, 128}))
    by_loader = form == "dq-store-rows-by-loader"
    monkeypatch.setattr(flash_bwd, "ROWS_BY_LOADER", by_loader)
    monkeypatch.setattr(flash_bwd, "THREAD_RELEASE", by_loader)
    monkeypatch.setattr(flash_bwd, "DELTA_IN_KERNEL", form == "dq-store-delta")
    passes = []
    store, delta = bwd._launch_dq_store, bwd._launch_delta
    monkeypatch.setattr(bwd, "_launch_dq_store", lambda *a, **kw: passes.append("cast") or store(*a, **kw))
    monkeypatch.setattr(bwd, "_launch_delta", lambda *a, **kw: passes.append("delta") or delta(*a, **kw))

    scale = dim ** -0.5
    case = dict(heads=heads, kv_heads=kv_heads, dim=dim)
    _, _, q, k, v, offsets = _gpu_inputs(case, dtype, 13)
    args = (offsets, block_size, scale, causal, None, None, 0, False, None)
    out, lse = flash_attention_fwd(q, k, v, *args)
    grad_out = torch.randn_like(q)
    runs = [bwd.flash_attention_bwd(grad_out, q, k, v, out, lse, *args, deterministic=det) for det in (False, True)]
    assert passes == ([] if form == "dq-store-delta" else ["delta", "delta"])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref_args = (block_size, scale, causal, None, None, 0, False)
    oracle = reference.attention_backward(grad_out.double(), *(x.double() for x in (q, k, v)), offsets, *ref_args)
    naive = reference.attention_backward(grad_out, q, k, v, offsets, *ref_args, dtype=dtype)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    for name, got, ref, base in zip("qkv", runs[0], oracle, naive):
        assert torch.isfinite(got).all(), f"d{name}"
        assert rel_err(got, ref) <= max(3 * rel_err(base, ref), 1.5 * floor), f"d{name}"
    nan_offsets, nq, nk, nv, keep = _nan_sequence_inputs(dim)
    nq, nk, nv = (x.to(dtype) for x in (nq, nk, nv))
    nargs = (nan_offsets, block_size, scale, causal, None, None, 0, False, None)
    nout, nlse = flash_attention_fwd(nq, nk, nv, *nargs)
    for got in bwd.flash_attention_bwd(torch.randn_like(nq), nq, nk, nv, nout, nlse, *nargs, deterministic=False):
        assert torch.isnan(got[~keep]).all() and torch.isfinite(got[keep]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_default_backward_repeats_bitwise_on_long_sequences(dim, causal):
    """The default (deterministic) backward at full attention, on sequences spanning up to 17 key
    tiles that add to each query tile's dQ (on sm_90 the Gluon kernel's ordered TMA adds at D 128,
    its dK/dV pass beside the Triton dQ pass at D 64): five backwards, the same bits each time, and
    within 3x the naive bf16 error of the float64 oracle."""
    from blockattn_layers import reference

    lengths = [2100, 1, 0, 1999, 700, 1300]
    offsets = offsets_from_lengths(lengths, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(sum(lengths), h, dim, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (4, 2, 2))
    grad_out = torch.randn_like(q)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = bl.block_attention(*leaves, offsets, block_size=None, backend="triton_flash", causal=causal)
    runs = [torch.autograd.grad(out, leaves, grad_out, retain_graph=True) for _ in range(5)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    args = (None, dim ** -0.5, causal, None, None, 0, False)
    d = [x.detach().double() for x in (q, k, v)]
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *args)
    naive_grads = reference.attention_backward(grad_out, *(x.detach() for x in (q, k, v)), offsets, *args,
                                               dtype=torch.bfloat16)
    for name, got, ref, base in zip("qkv", runs[0], oracle_grads, naive_grads):
        assert rel_err(got, ref) <= max(3 * rel_err(base, ref), 2.25e-2), f"d{name}"
    del oracle_grads, naive_grads, d
    torch.cuda.empty_cache()  # the float64 oracle's blocks: other tests share the GPU (pytest -n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("split_kv, shift_last", [(False, False), (True, False), (True, True), (False, True)],
                         ids=["joint-kv", "split-kv", "split-kv-shift-last", "joint-kv-shift-last"])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_persistent_gluon_forward_keeps_a_nan_in_its_sequence(monkeypatch, dim, split_kv, shift_last):
    """The persistent Gluon forward's tensor maps span all rows: a block's ragged last key tile holds
    the next sequence's rows, whose v rows the loader zeroes. A NaN sequence between ragged ones is
    NaN and every other row finite and equal to the Triton forward's within bf16 rounding; on two
    programs, so each takes many items; k and v on one barrier pair or their own (``SPLIT_KV``), the last
    key tile of a sequence of at least 128 rows its last keys (``SHIFT_LAST_BLOCKS`` taking full attention) or
    not."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90 import flash_persistent

    monkeypatch.setattr(flash_persistent, "TAKEN", [True])
    monkeypatch.setattr(flash_persistent, "LOOPS", {key: (False, split_kv) for key in flash_persistent.LOOPS})
    monkeypatch.setattr(flash_persistent, "SHIFT_LAST_BLOCKS", (0, 1 << 62) if shift_last else (1, 0))
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    monkeypatch.setattr(flash_persistent, "sm_count", lambda device: 2)
    offsets, q, k, v, keep = _nan_sequence_inputs(dim)
    out = bl.block_attention(q, k, v, offsets, block_size=None, backend="triton_flash", causal=False)
    assert torch.isnan(out[~keep]).all() and torch.isfinite(out[keep]).all()
    want, _ = flash_attention_fwd(q, k, v, offsets, 0, dim ** -0.5, False, None, None, 0, False, None)
    assert rel_err(out[keep], want[keep]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("options", ["default", "early_release", "share_kv", "share_kv_split", "thread_release"])
@pytest.mark.parametrize("case", [dict(heads=8, kv_heads=2, dim=128, block_size=128),
                                  dict(heads=4, kv_heads=1, dim=64, block_size=128, causal=True),
                                  dict(heads=8, kv_heads=2, dim=64, block_size=64),
                                  dict(heads=2, kv_heads=2, dim=128, block_size=100, causal=True)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gpu_persistent_forward_at_one_tile_blocks(monkeypatch, case, options):
    """The persistent Gluon forward called directly on blocks of one key tile (the op layer gives it blocks over
    128 tokens only): output within 2x the naive bf16 error of the float64 oracle, and a NaN sequence kept to its
    own rows; with the previous item's query buffer released after the first ``Q K^T`` (``EARLY_RELEASE``), and
    a block's grouped query heads reusing one copy of its key tile (``SHARE_KV``, on one barrier pair or
    ``SPLIT_KV``), or slots released by every consumer thread (``THREAD_RELEASE``, without the others), on all
    SMs and on two programs (ranges that split a block's heads)."""
    from blockattn_layers import reference
    from blockattn_layers.kernels.sm90 import flash_persistent

    monkeypatch.setattr(flash_persistent, "EARLY_RELEASE", options.startswith(("early_release", "share_kv")))
    monkeypatch.setattr(flash_persistent, "SHARE_KV", options.startswith("share_kv"))
    monkeypatch.setattr(flash_persistent, "THREAD_RELEASE", options == "thread_release")
    if options == "share_kv_split":
        monkeypatch.setattr(flash_persistent, "LOOPS", {key: (False, True) for key in flash_persistent.LOOPS})
    case, dim, q, k, v, offsets = _gpu_inputs(case, torch.bfloat16, 3)
    block, causal = case["block_size"], case.get("causal", False)
    args = (block, dim ** -0.5, causal, None, None, 0, False)
    oracle = reference.attention_forward(*(x.double() for x in (q, k, v)), offsets, *args)
    naive = reference.attention_forward(q, k, v, offsets, *args, dtype=torch.bfloat16)
    for programs in (None, 2):
        if programs:
            monkeypatch.setattr(flash_persistent, "sm_count", lambda device: programs)
        out, _ = flash_persistent.flash_attention_fwd_persistent(q, k, v, offsets, block, dim ** -0.5, causal)
        assert torch.isfinite(out).all() and rel_err(out, oracle) <= max(2 * rel_err(naive, oracle), 1.5e-2)
    first, last = int(offsets[2]), int(offsets[3])
    for x in (q, k, v):
        x[first:last] = float("nan")
    out, _ = flash_persistent.flash_attention_fwd_persistent(q, k, v, offsets, block, dim ** -0.5, causal)
    keep = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    keep[first:last] = False
    assert torch.isnan(out[~keep]).all() and torch.isfinite(out[keep]).all()
    assert rel_err(out[keep], oracle[keep]) <= max(2 * rel_err(naive, oracle), 1.5e-2)
    del oracle, naive
    torch.cuda.empty_cache()


@interpret_only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("block_size", [None, 200], ids=["full", "block200"])
def test_a_nan_stays_in_its_unit(block_size):
    """A NaN in one token's q, k, v and output gradient reaches only its own unit (its sequence, or
    its block of 200) in the output and the three gradients: every other row is bitwise that of
    the clean call. GQA, causal, rotary; the 130-token sequence spans three 64-row tiles."""
    lengths = [3, 70, 0, 1, 130, 5]
    total = sum(lengths)
    offsets = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(5)
    q, k, v, grad_out = (torch.randn(total, h, 32, generator=g) for h in (4, 2, 2, 4))
    first = 3 + 70 + 1
    token = first + 10
    unit = torch.zeros(total, dtype=torch.bool)
    unit[first:first + 130] = True

    def attention(q, k, v):
        return bl.block_attention(q, k, v, offsets, block_size, causal=True, rope_theta=1e4, backend="triton_flash")

    clean, poisoned = clean_and_poisoned(attention, q, k, v, grad_out, token)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a[~unit], b[~unit])
        assert torch.isnan(b[unit]).any()
