"""The reference backend against the independent float64 oracle (tests/oracle.py).

Tolerances (relative Frobenius error, ``rel_err``):
  * float64: < 1e-10 for the output and all three gradients.
  * float32: < 2e-5; < 2e-3 with rotary at positions in the thousands (the contract computes
    rotary angles in float32, whose spacing near 4096 is ~5e-4 rad).
  * float16 / bfloat16: the reference computes in float32 and rounds once, so its error must be
    (a) within 1.25x the error of just rounding the float64 oracle to the dtype (forward),
    (b) within 2x the error of the naive same-dtype torch computation (the oracle's loops run in
        that dtype), and (c) under a fixed bound: 1e-3 for float16, 8e-3 for bfloat16.
"""
from __future__ import annotations

import math

import pytest
import torch

import blockattn_layers
import blockattn_layers.reference as reference
from blockattn_layers import block_attention, jagged_attention
from tests.oracle import make_jagged, offsets_from_lengths, oracle_attention, rel_err

LENGTHS = [0, 1, 63, 64, 65, 130]  # T = 323: empty, single, and block multiples +-1
T_ALL = sum(LENGTHS)
BLOCKS = [16, 32, 64, 100, None]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
HALF_BOUND = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

pytestmark = pytest.mark.usefixtures("single_thread")


def ref(q, k, v, offsets, block_size, **kw):
    return block_attention(q, k, v, offsets, block_size, backend="reference", **kw)


def grad_out(shape, seed=99):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def forward_backward(fn, q, k, v, g):
    """Output and (dq, dk, dv) of ``fn(q, k, v)`` for upstream gradient ``g``."""
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    return out, grads


def compare_to_oracle(lengths, H, H_kv, D, dtype, block_size, tol, seed=0, offsets_dtype=torch.int64, **kw):
    q, k, v, offsets = make_jagged(lengths, H, H_kv, D, dtype, seed, offsets_dtype=offsets_dtype,
                                   requires_grad=True)
    g = grad_out(q.shape, seed + 1)
    out, grads = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    exp, exp_grads = forward_backward(lambda a, b, c: oracle_attention(a, b, c, offsets, block_size, **kw),
                                      q, k, v, g)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    errs = {"out": rel_err(out, exp)}
    for name, a, b in zip(("dq", "dk", "dv"), grads, exp_grads):
        assert a.shape == b.shape and a.dtype == dtype, name
        errs[name] = rel_err(a, b)
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"errors above {tol}: {bad}"
    return out, grads


# ----------------------------------------------------------------------------- basic matrix
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", BLOCKS)
def test_matches_oracle(dtype, causal, block_size):
    compare_to_oracle(LENGTHS, 4, 2, 16, dtype, block_size, TOL[dtype], causal=causal)


@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (4, 1), (3, 1)])
@pytest.mark.parametrize("block_size", [32, None])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(H, H_kv, block_size, causal):
    compare_to_oracle([5, 0, 40, 33], H, H_kv, 8, torch.float64, block_size, 1e-10, seed=3, causal=causal)


@pytest.mark.parametrize("lengths", [[1], [0, 0, 1, 0], [63], [64], [65], [130], [1] * 17, [64, 64, 64]])
@pytest.mark.parametrize("block_size", [1, 16, 64, None])
def test_length_patterns(lengths, block_size):
    compare_to_oracle(lengths, 2, 1, 8, torch.float64, block_size, 1e-10, seed=len(lengths), causal=True)


@pytest.mark.parametrize("D", [1, 3, 32])
def test_head_dims(D):
    compare_to_oracle([10, 21], 2, 2, D, torch.float64, 8, 1e-10, seed=D)


@pytest.mark.parametrize("scale", [0.5, 2.0, -0.3])
def test_explicit_scale(scale):
    compare_to_oracle([20, 13], 2, 1, 8, torch.float64, 16, 1e-10, scale=scale, causal=True)


def test_scale_zero_is_block_mean_of_v():
    q, k, v, offsets = make_jagged([5, 7], 2, 1, 4, torch.float64, 0)
    out = ref(q, k, v, offsets, 4, scale=0.0)
    blocks = [(0, 4), (4, 5), (5, 9), (9, 12)]
    for lo, hi in blocks:
        torch.testing.assert_close(out[lo:hi], v[lo:hi].mean(0, keepdim=True).expand(hi - lo, 2, 4),
                                   rtol=1e-12, atol=1e-12)


def test_block_size_one_returns_v():
    q, k, v, offsets = make_jagged([3, 0, 9], 4, 2, 8, torch.float32, 0)
    out = ref(q, k, v, offsets, 1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), rtol=0, atol=0)


def test_large_logits_are_stable():
    q, k, v, offsets = make_jagged([40, 70], 2, 1, 16, torch.float64, 5, std=30.0, requires_grad=True)
    g = grad_out(q.shape)
    out, grads = forward_backward(lambda a, b, c: ref(a, b, c, offsets, 32, causal=True), q, k, v, g)
    exp, exp_grads = forward_backward(lambda a, b, c: oracle_attention(a, b, c, offsets, 32, causal=True),
                                      q, k, v, g)
    assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in grads)
    assert rel_err(out, exp) < 1e-10
    for a, b in zip(grads, exp_grads):
        assert rel_err(a, b) < 1e-9


def test_blocks_do_not_leak():
    """Changing one block's k/v changes only that block's outputs (and no other sequence's)."""
    q, k, v, offsets = make_jagged([20, 30], 2, 2, 8, torch.float64, 0)
    out = ref(q, k, v, offsets, 8)
    k2, v2 = k.clone(), v.clone()
    k2[28:36] += 1.0  # sequence 1, block [20+8, 20+16)
    v2[28:36] -= 2.0
    out2 = ref(q, k2, v2, offsets, 8)
    changed = (out2 != out).any(-1).any(-1)
    expected = torch.zeros(50, dtype=torch.bool)
    expected[28:36] = True
    assert torch.equal(changed, expected)


# ----------------------------------------------------------------------------- rotary
def _positions(kind):
    g = torch.Generator().manual_seed(11)
    if kind == "int64":
        return torch.randint(0, 300, (T_ALL,), generator=g)
    if kind == "int32":
        return torch.randint(0, 300, (T_ALL,), generator=g, dtype=torch.int32)
    if kind == "float64_small":
        return torch.rand(T_ALL, generator=g, dtype=torch.float64) * 200
    if kind == "int64_thousands":
        return torch.randint(1000, 9000, (T_ALL,), generator=g)
    if kind == "timestamps64":
        return 1000.0 + torch.rand(T_ALL, generator=g, dtype=torch.float64) * 5000
    if kind == "timestamps32":
        return (1000.0 + torch.rand(T_ALL, generator=g, dtype=torch.float64) * 5000).float()
    raise AssertionError(kind)


ROTARY_OPTIONS = {
    "default": dict(rope_theta=10000.0),
    "theta500_partial8": dict(rope_theta=500.0, rotary_dim=8),
    "theta500_partial8_interleaved": dict(rope_theta=500.0, rotary_dim=8, rotary_interleaved=True),
    "interleaved_full": dict(rope_theta=10000.0, rotary_interleaved=True),
    "small_theta_rd2": dict(rope_theta=3.0, rotary_dim=2),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("option", list(ROTARY_OPTIONS))
@pytest.mark.parametrize("block_size,causal", [(16, False), (64, True), (None, True)])
def test_rotary_default_positions(dtype, option, block_size, causal):
    compare_to_oracle(LENGTHS, 4, 2, 16, dtype, block_size, TOL[dtype], causal=causal, **ROTARY_OPTIONS[option])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["int64", "int32", "float64_small", "int64_thousands", "timestamps64", "timestamps32"])
@pytest.mark.parametrize("option", ["default", "theta500_partial8_interleaved"])
@pytest.mark.parametrize("block_size", [16, None])
def test_rotary_given_positions(dtype, kind, option, block_size):
    tol = TOL[dtype]
    if dtype == torch.float32 and ("thousands" in kind or "timestamps" in kind):
        tol = 2e-3
    compare_to_oracle(LENGTHS, 4, 2, 16, dtype, block_size, tol, causal=True, positions=_positions(kind),
                      **ROTARY_OPTIONS[option])


def test_default_positions_are_sequence_indices_not_block_indices():
    lengths = [5, 40, 0, 23]
    q, k, v, offsets = make_jagged(lengths, 2, 1, 8, torch.float64, 0)
    in_seq = torch.cat([torch.arange(n) for n in lengths])
    kw = dict(rope_theta=100.0, causal=True)
    default = ref(q, k, v, offsets, 16, **kw)
    torch.testing.assert_close(default, ref(q, k, v, offsets, 16, positions=in_seq, **kw), rtol=0, atol=0)
    # Rotary attention is relative, so per-block shifts of the positions are invisible inside a
    # block; the oracle (sequence indices) and the exact match above pin the definition.
    assert rel_err(default, oracle_attention(q, k, v, offsets, 16, **kw)) < 1e-10


def test_rotary_at_position_zero_is_identity():
    q, k, v, offsets = make_jagged([10, 30], 2, 2, 8, torch.float64, 0)
    zero = torch.zeros(40, dtype=torch.int64)
    torch.testing.assert_close(ref(q, k, v, offsets, 16, rope_theta=10.0, positions=zero),
                               ref(q, k, v, offsets, 16), rtol=0, atol=0)


def test_rotary_is_relative():
    """Shifting every position by the same amount leaves attention unchanged (float64)."""
    q, k, v, offsets = make_jagged([10, 30], 2, 2, 8, torch.float64, 0)
    pos = torch.arange(40, dtype=torch.float64)
    a = ref(q, k, v, offsets, 16, rope_theta=10.0, rotary_dim=6, positions=pos)
    b = ref(q, k, v, offsets, 16, rope_theta=10.0, rotary_dim=6, positions=pos + 1234.0)
    assert rel_err(a, b) < 1e-10
    assert rel_err(a, ref(q, k, v, offsets, 16)) > 1e-3  # rotary did something


def test_rotary_does_not_rotate_v_or_pass_through_channels():
    """With q = k = 0 the output is the block mean of v, whatever the rotation."""
    _, _, v, offsets = make_jagged([6, 9], 2, 2, 4, torch.float64, 0)
    z = torch.zeros_like(v)
    out = ref(z, z, v, offsets, None, rope_theta=10.0, positions=torch.arange(15) * 7)
    expect = torch.cat([v[:6].mean(0, keepdim=True).expand(6, 2, 4), v[6:].mean(0, keepdim=True).expand(9, 2, 4)])
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 64, None])
@pytest.mark.parametrize("option", ["plain", "causal_rotary", "timestamps_partial_interleaved"])
def test_half_precision(dtype, block_size, option):
    kw = {
        "plain": {},
        "causal_rotary": dict(causal=True, rope_theta=10000.0),
        "timestamps_partial_interleaved": dict(rope_theta=100.0, rotary_dim=8, rotary_interleaved=True,
                                               positions=_positions("timestamps32")),
    }[option]
    q, k, v, offsets = make_jagged(LENGTHS, 4, 2, 16, dtype, 1, requires_grad=True)
    g = grad_out(q.shape)
    out, grads = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    exact, exact_grads = forward_backward(lambda a, b, c: oracle_attention(a, b, c, offsets, block_size, **kw),
                                          q, k, v, g)
    naive, naive_grads = forward_backward(
        lambda a, b, c: oracle_attention(a, b, c, offsets, block_size, compute_dtype=dtype, **kw), q, k, v, g)
    assert out.dtype == dtype and all(x.dtype == dtype for x in grads)
    err = rel_err(out, exact)
    assert err <= 1.25 * rel_err(exact.to(dtype), exact)
    assert err <= 2 * rel_err(naive, exact)
    assert err < HALF_BOUND[dtype]
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, exact_grads, naive_grads):
        e = rel_err(a, b)
        assert e <= 2 * rel_err(c, b), name
        assert e < HALF_BOUND[dtype], name


# ----------------------------------------------------------------------------- argument forms
@pytest.mark.parametrize("block_size", [16, None])
def test_int32_and_int64_offsets_agree(block_size):
    q, k, v, offsets = make_jagged(LENGTHS, 4, 2, 16, torch.float32, 0, requires_grad=True)
    g = grad_out(q.shape)
    kw = dict(causal=True, rope_theta=1000.0)
    out64, g64 = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    out32, g32 = forward_backward(lambda a, b, c: ref(a, b, c, offsets.int(), block_size, **kw), q, k, v, g)
    assert torch.equal(out32, out64)
    for a, b in zip(g32, g64):
        assert torch.equal(a, b)
    compare_to_oracle(LENGTHS, 4, 2, 16, torch.float64, block_size, 1e-10, offsets_dtype=torch.int32, **kw)


def _non_contiguous(x: torch.Tensor, how: str) -> torch.Tensor:
    T, H, D = x.shape
    if how == "slice":  # every other channel of a wider tensor, every other row of a taller one
        big = torch.zeros(2 * T, H, 2 * D, dtype=x.dtype)
        big[::2, :, ::2] = x
        y = big[::2, :, ::2]
    elif how == "transposed":  # heads-major storage [H, T, D] viewed as [T, H, D]
        y = x.transpose(0, 1).contiguous().transpose(0, 1)
    else:  # channel-major storage
        y = x.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert not y.is_contiguous() and torch.equal(y, x)
    return y


@pytest.mark.parametrize("how", ["slice", "transposed", "channel_major"])
@pytest.mark.parametrize("block_size", [16, None])
def test_non_contiguous_inputs(how, block_size):
    q, k, v, offsets = make_jagged([7, 0, 33, 20], 4, 2, 8, torch.float64, 2)
    kw = dict(causal=True, rope_theta=100.0, rotary_dim=4, rotary_interleaved=True)
    qn, kn, vn = (_non_contiguous(x, how).requires_grad_() for x in (q, k, v))
    qc, kc, vc = (x.clone().requires_grad_() for x in (q, k, v))
    g = grad_out(q.shape)
    gn = _non_contiguous(g, how)  # a non-contiguous upstream gradient too
    out_n = ref(qn, kn, vn, offsets, block_size, **kw)
    grads_n = torch.autograd.grad(out_n, (qn, kn, vn), gn)
    out_c, grads_c = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), qc, kc, vc, g)
    torch.testing.assert_close(out_n, out_c, rtol=1e-13, atol=1e-13)
    for a, b in zip(grads_n, grads_c):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert rel_err(out_n, oracle_attention(q, k, v, offsets, block_size, **kw)) < 1e-10


def test_non_contiguous_offsets_and_positions():
    q, k, v, offsets = make_jagged([7, 0, 33], 2, 1, 8, torch.float64, 2)
    offs_nc = torch.stack([offsets, offsets * 100], 1)[:, 0]
    pos_nc = torch.stack([torch.arange(40.0, dtype=torch.float64), torch.zeros(40, dtype=torch.float64)], 1)[:, 0]
    assert not offs_nc.is_contiguous() and not pos_nc.is_contiguous()
    out = ref(q, k, v, offs_nc, 8, rope_theta=50.0, positions=pos_nc)
    torch.testing.assert_close(out, ref(q, k, v, offsets, 8, rope_theta=50.0, positions=pos_nc.contiguous()),
                               rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [16, 100, None])
def test_cpu_offsets_and_max_seqlen(block_size):
    q, k, v, offsets = make_jagged(LENGTHS, 4, 2, 16, torch.float64, 4, requires_grad=True)
    g = grad_out(q.shape)
    kw = dict(causal=True, rope_theta=10000.0)
    base, base_g = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    for extra in (dict(cpu_offsets=offsets.clone()), dict(max_seqlen=130), dict(max_seqlen=500),
                  dict(cpu_offsets=offsets.int(), max_seqlen=130), dict(cpu_offsets=offsets.clone(), validate=True)):
        out, grads = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw, **extra), q, k, v, g)
        torch.testing.assert_close(out, base, rtol=0, atol=0, msg=str(extra))
        for a, b in zip(grads, base_g):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=str(extra))


def test_auto_backend_is_reference_on_cpu():
    q, k, v, offsets = make_jagged([7, 20], 2, 1, 8, torch.float32, 0)
    torch.testing.assert_close(block_attention(q, k, v, offsets, 8), ref(q, k, v, offsets, 8), rtol=0, atol=0)
    torch.testing.assert_close(block_attention(q, k, v, offsets, 8, backend=blockattn_layers.Backend.REFERENCE),
                               ref(q, k, v, offsets, 8), rtol=0, atol=0)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, rope_theta=100.0, rotary_dim=4, scale=0.7)])
def test_jagged_attention_is_full_block_attention(kw):
    q, k, v, offsets = make_jagged(LENGTHS, 4, 1, 8, torch.float64, 6, requires_grad=True)
    g = grad_out(q.shape)
    a, ga = forward_backward(lambda x, y, z: jagged_attention(x, y, z, offsets, **kw), q, k, v, g)
    b, gb = forward_backward(lambda x, y, z: block_attention(x, y, z, offsets, None, **kw), q, k, v, g)
    assert torch.equal(a, b)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    # and a block size covering every sequence is the same attention
    torch.testing.assert_close(block_attention(q, k, v, offsets, 130, **kw), a, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="block_size"):
        jagged_attention(q, k, v, offsets, block_size=16)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_inputs_are_not_modified(requires_grad, dtype):
    q, k, v, offsets = make_jagged([7, 0, 33], 4, 2, 8, dtype, 3, requires_grad=requires_grad)
    pos = torch.arange(40, dtype=torch.float64) * 3.5
    cpu_offsets = offsets.clone().int()
    saved = [x.detach().clone() for x in (q, k, v, offsets, pos, cpu_offsets)]
    for block_size in (16, None):
        out = ref(q, k, v, offsets, block_size, causal=True, rope_theta=100.0, positions=pos,
                  cpu_offsets=cpu_offsets, max_seqlen=33)
        if requires_grad:
            g = torch.ones_like(out)
            g_saved = g.clone()
            out.backward(g)
            assert torch.equal(g, g_saved)
        out.detach().add_(1.0)  # the output must not alias an input
    for x, s in zip((q, k, v, offsets, pos, cpu_offsets), saved):
        assert torch.equal(x.detach(), s)


# ----------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64], ids=str)
def test_empty(lengths, block_size, offsets_dtype):
    q, k, v, offsets = make_jagged(lengths, 4, 2, 8, torch.float32, 0, offsets_dtype=offsets_dtype,
                                   requires_grad=True)
    assert q.shape[0] == 0 and offsets.numel() == len(lengths) + 1
    out = ref(q, k, v, offsets, block_size, causal=True, rope_theta=10.0)
    assert out.shape == (0, 4, 8) and out.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    out2 = ref(q, k, v, offsets, block_size, cpu_offsets=offsets.clone(), max_seqlen=0)
    assert out2.shape == (0, 4, 8)


# ----------------------------------------------------------------------------- planning paths
def _no_host(monkeypatch):
    calls = []

    def no_host(offsets, cpu_offsets):
        calls.append(1)
        return None

    monkeypatch.setattr(reference, "_host_offsets", no_host)
    return calls


@pytest.mark.parametrize("block_size,extra", [
    (1, {}), (16, {}), (64, {}), (100, {}), (10 ** 7, {}),
    (None, {"max_seqlen": 130}), (None, {"max_seqlen": 1000}), (None, {}),
])
@pytest.mark.parametrize("lengths", [LENGTHS, [0, 0, 5], [128, 1]])
def test_sync_free_device_plan(monkeypatch, block_size, extra, lengths):
    """Without host offsets the grouping is an upper bound with empty blocks; results are the same."""
    q, k, v, offsets = make_jagged(lengths, 4, 2, 8, torch.float64, 8, requires_grad=True)
    kw = dict(causal=True, rope_theta=10000.0, rotary_dim=4, **extra)
    g = grad_out(q.shape)
    host, host_g = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    calls = _no_host(monkeypatch)
    dev, dev_g = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    assert len(calls) == 2  # forward and backward both prepared without host offsets
    torch.testing.assert_close(dev, host, rtol=1e-13, atol=1e-14)
    for a, b in zip(dev_g, host_g):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
    oracle_kw = {name: val for name, val in kw.items() if name != "max_seqlen"}
    assert rel_err(dev, oracle_attention(q, k, v, offsets, block_size, **oracle_kw)) < 1e-10


def test_sync_free_attention_forward_direct(monkeypatch):
    """``reference.attention_forward`` itself, device grouping vs host grouping, float32 and float16."""
    for dtype in (torch.float32, torch.float16):
        q, k, v, offsets = make_jagged(LENGTHS, 2, 1, 8, dtype, 9)
        args = (q, k, v, offsets, 32, 0.4, True, 100.0, None, 8, True)
        host = reference.attention_forward(*args)
        with monkeypatch.context() as m:
            m.setattr(reference, "_host_offsets", lambda o, c: None)
            dev = reference.attention_forward(*args)
        torch.testing.assert_close(dev, host, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths", [LENGTHS, [0], [0, 0], [3], [1] * 9, [16, 16, 0, 17]])
@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 1000])
def test_device_plan_covers_exactly_the_host_blocks(lengths, block_size):
    offsets = offsets_from_lengths(lengths)
    T, B = sum(lengths), len(lengths)
    host_groups = reference._blocks_host(offsets, block_size, offsets.device)
    dev_groups = reference._blocks_device(offsets, T, block_size)
    want = set()
    for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for s in range(lo, hi, block_size):
            want.add((s, min(s + block_size, hi) - s))
    got_host = {(s, n) for g in host_groups for s, n in zip(g.starts.tolist(), g.lengths.tolist())}
    assert got_host == want
    dev_pairs = [(s, n) for g in dev_groups for s, n in zip(g.starts.tolist(), g.lengths.tolist())]
    assert {p for p in dev_pairs if p[1] > 0} == want
    assert len([p for p in dev_pairs if p[1] > 0]) == len(want)  # no block twice
    assert len(dev_pairs) <= -(-T // block_size) + B  # the documented grid bound
    for g in dev_groups:
        assert g.tile >= int(g.lengths.max()) and g.tile <= max(T, 1)
        assert bool((g.starts >= 0).all()) and bool((g.starts < max(T, 1)).all())
    # the host grouping of full attention covers every non-empty sequence once, tiles >= lengths
    seqs = reference.group_blocks(offsets, T, None)
    got = sorted((s, n) for g in seqs for s, n in zip(g.starts.tolist(), g.lengths.tolist()))
    assert got == sorted((lo, hi - lo) for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()) if hi > lo)
    assert all(g.tile >= int(g.lengths.max()) for g in seqs)


@pytest.mark.parametrize("budget", [1, 4 * 16 * 16 * 3, 5000])
@pytest.mark.parametrize("block_size", [16, 100, None])
def test_memory_chunking(monkeypatch, budget, block_size):
    """A small SCORE_BUDGET runs many chunks and gives the same results."""
    q, k, v, offsets = make_jagged(LENGTHS, 4, 2, 8, torch.float64, 10, requires_grad=True)
    kw = dict(causal=True, rope_theta=1000.0)
    g = grad_out(q.shape)
    base, base_g = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    chunks = []
    real_chunk = reference._chunk

    def counting_chunk(starts, lengths, tile, total):
        chunks.append(starts.numel())
        assert starts.numel() == 1 or starts.numel() * 4 * tile * tile <= budget
        return real_chunk(starts, lengths, tile, total)

    monkeypatch.setattr(reference, "SCORE_BUDGET", budget)
    monkeypatch.setattr(reference, "_chunk", counting_chunk)
    out, grads = forward_backward(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), q, k, v, g)
    n_units = sum(g_.starts.numel() for g_ in reference.group_blocks(offsets, T_ALL, block_size))
    assert len(chunks) > 2 and sum(chunks) == 2 * n_units  # forward + backward, every block once each
    torch.testing.assert_close(out, base, rtol=1e-13, atol=1e-14)
    for a, b in zip(grads, base_g):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


# ----------------------------------------------------------------------------- gradcheck, opcheck
@pytest.mark.parametrize("block_size", [3, None])
@pytest.mark.parametrize("kw", [
    {},
    dict(causal=True, rope_theta=10.0),
    dict(causal=True, rope_theta=10.0, rotary_dim=2, rotary_interleaved=True, positions=torch.tensor(
        [5.5, 100.25, 0.0, 7.0, 1.0, 3000.0, 2.0, 9.0, 4.0])),
])
def test_gradcheck(block_size, kw):
    q, k, v, offsets = make_jagged([4, 0, 5], 4, 2, 4, torch.float64, 12, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ref(a, b, c, offsets, block_size, **kw), (q, k, v),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_mqa_full():
    q, k, v, offsets = make_jagged([6, 1], 3, 1, 4, torch.float64, 13, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: jagged_attention(a, b, c, offsets, causal=True, rope_theta=2.0, scale=0.9), (q, k, v))


OPCHECK_CASES = {
    "block_causal_rotary_gqa": ([3, 0, 7, 20], torch.float64, (4, 0.3, True, 100.0, None, 4, True), False),
    "full_cpu_offsets_max_seqlen": ([3, 0, 7, 20], torch.float64, (0, 0.3, False, None, None, 0, False), True),
    "half_int32_positions": ([5, 11], torch.float16, (4, 0.5, True, 50.0, "pos", 8, False), False),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck_reference_fwd(case):
    lengths, dtype, scalars, host = OPCHECK_CASES[case]
    q, k, v, offsets = make_jagged(lengths, 4, 2, 8, dtype, 14, requires_grad=True)
    block, scale, causal, theta, pos, rd, inter = scalars
    if pos == "pos":
        pos = torch.arange(q.shape[0], dtype=torch.float32) * 10
        offsets = offsets.int()
    cpu_offsets, max_seqlen = (offsets.clone(), max(lengths)) if host else (None, None)
    args = (q, k, v, offsets, block, scale, causal, theta, pos, rd, inter, cpu_offsets, max_seqlen, "reference")
    torch.library.opcheck(torch.ops.blockattn.attention_fwd.default, args)


def test_opcheck_non_contiguous():
    """The fake (meta) implementation must report the real output's contiguous strides."""
    q, k, v, offsets = make_jagged([3, 0, 7, 20], 4, 2, 8, torch.float64, 15)
    qn, kn, vn = (_non_contiguous(x, "channel_major").requires_grad_() for x in (q, k, v))
    args = (qn, kn, vn, offsets, 4, 0.3, True, 100.0, None, 4, True, None, None, "auto")
    torch.library.opcheck(torch.ops.blockattn.attention_fwd.default, args)
    # the backward op has no autograd of its own (no double backward): check it on plain tensors
    g = _non_contiguous(torch.randn(30, 4, 8, dtype=torch.float64), "transposed")
    plain = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    torch.library.opcheck(torch.ops.blockattn.attention_bwd.default, (g, *plain[:3], None, None, *plain[3:]))


# ----------------------------------------------------------------------------- the oracle itself
def test_oracle_rotary_by_hand():
    """Hand-computed rotations pin the oracle to DESIGN.md's formulas."""
    from tests.oracle import oracle_rotate

    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0]]], dtype=torch.float64)  # T=1, h=1, D=5
    theta, pos = 100.0, 0.7
    a0, a1 = pos, pos * theta ** -0.5  # inv_freq_i = theta ** (-2 i / rotary_dim), rotary_dim = 4
    c0, s0, c1, s1 = math.cos(a0), math.sin(a0), math.cos(a1), math.sin(a1)
    half = oracle_rotate(x, [pos], theta, 4, interleaved=False)[0, 0]
    expect = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 1 * s0 + 3 * c0, 2 * s1 + 4 * c1, 5.0]  # pairs (0,2), (1,3)
    torch.testing.assert_close(half, torch.tensor(expect, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    inter = oracle_rotate(x, [pos], theta, 4, interleaved=True)[0, 0]
    expect = [1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1, 5.0]  # pairs (0,1), (2,3)
    torch.testing.assert_close(inter, torch.tensor(expect, dtype=torch.float64), rtol=1e-15, atol=1e-15)


def test_oracle_by_hand():
    """Two tokens, one head, D=1: softmax weights computed by hand; causal and block_size=1."""
    q = torch.tensor([[[1.0]], [[2.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.5]], [[-1.0]]], dtype=torch.float64)
    v = torch.tensor([[[10.0]], [[20.0]]], dtype=torch.float64)
    offsets = torch.tensor([0, 2])
    out = oracle_attention(q, k, v, offsets, None)
    for t in range(2):
        w = [math.exp(q[t, 0, 0].item() * k[j, 0, 0].item()) for j in range(2)]
        assert out[t, 0, 0].item() == pytest.approx((10 * w[0] + 20 * w[1]) / sum(w), rel=1e-14)
    causal = oracle_attention(q, k, v, offsets, None, causal=True)
    assert causal[0, 0, 0].item() == 10.0
    torch.testing.assert_close(oracle_attention(q, k, v, offsets, 1), v, rtol=0, atol=0)
    assert oracle_attention(q, k, v, torch.tensor([0, 1, 2]), None).flatten().tolist() == [10.0, 20.0]


def test_autocast_runs_attention_in_the_autocast_dtype():
    q, k, v, offsets = make_jagged([5, 0, 70], 4, 2, 16, torch.float32, seed=3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_attention(q, k, v, offsets, block_size=32, causal=True, rope_theta=100.0)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()
    want = oracle_attention(q.double(), k.double(), v.double(), offsets, 32, causal=True, rope_theta=100.0)
    assert rel_err(out, want) < 2e-2
