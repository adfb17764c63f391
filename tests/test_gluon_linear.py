"""The warp-specialized e4m3 projection for sm_90 (``kernels.sm90.linear``) on CPU tensors through
``tests/gluon_shim.py`` (Gluon has no interpreter): the whole persistent kernel (the loader and the
two consumer partitions in threads, the weight slice and the ring of ``x`` tiles handed over by
mbarriers, tensor maps over the whole input, weight and output) against the float64 product; every
output element stored once, rows past T and columns past N never. What the shim does not model is
in its docstring; the kernel's GPU test is in ``tests/test_fp8_modules.py``."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = pytest.mark.usefixtures("single_thread")

from blockattn_layers.kernels.sm90 import linear as ws  # noqa: E402
from tests import gluon_shim as gs  # noqa: E402

# (rows, input width, outputs, bias, output columns per program, lanes): T past a tile, ring slots reused by both
# consumers (several tiles per program), a last slice past N (208, 400 outputs), E 64 / 128 / 256,
# fewer rows than one tile, a program with one tile (its second consumer idle).
CASES = [
    (300, 256, 768, True, 256, 2),
    (300, 256, 768, True, 128, 1),
    (40, 64, 208, False, 128, 1),
    (130, 128, 400, True, 256, 3),
    (257, 128, 256, True, 256, 1),
]


def _inputs(rows, width, out, bias, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(rows + width + out)
    x = torch.randn(rows, width, generator=g).to(dtype)
    w = (torch.randn(out, width, generator=g) * 200 / width ** 0.5).to(dtype)  # a few percent saturate
    b = torch.randn(out, generator=g) * 3 if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    return x, w, b, want.clamp(-448, 448)


def _run(x, w, b, y, block_n, lanes, rotary=None):
    rows, in_dim = x.shape
    slices, _ = ws.grid(rows, w.shape[0], block_n, 10 ** 6)
    rotation = dict(Pos=w, log2_theta=0.0, HEAD_DIM=64, ROT_DIM=64, ROT_END=0) if rotary is None else dict(
        Pos=rotary.positions, log2_theta=math.log2(rotary.theta), HEAD_DIM=rotary.head_dim,
        ROT_DIM=rotary.rotary_dim, ROT_END=rotary.columns)
    return gs.launch(
        ws._linear_ws_kernel, (slices * lanes,), X=x, W=w, B=b if b is not None else w, Y=y, rows=rows, lanes=lanes,
        stride_xt=x.stride(0), stride_wn=w.stride(0), stride_yt=y.stride(0), IN_DIM=in_dim, OUT_DIM=w.shape[0],
        HAS_BIAS=b is not None, BLOCK_N=block_n, STAGES=ws.stages(in_dim, block_n), CHUNK=ws.chunk(in_dim),
        PINGPONG=ws.PINGPONG, BIAS_ONCE=ws.BIAS_ONCE, THREAD_RELEASE=ws.THREAD_RELEASE, **rotation)


def rotate_pairs_reference(y, rotary):
    """float64 ``y [T, N]`` with ``ws.PairRotary``'s rotation of its first ``columns`` columns (the
    angles rounded to float32, as every rotary kernel here computes them)."""
    y = y.clone()
    d, r = rotary.head_dim, rotary.rotary_dim
    part = y[:, :rotary.columns].unflatten(1, (-1, d))
    pairs = part[..., :r].unflatten(-1, (r // 2, 2))
    inv_freq = (float(rotary.theta) ** (-2 * torch.arange(r // 2, dtype=torch.float64) / r)).float()
    angle = (rotary.positions.float()[:, None, None] * inv_freq).double()  # float32 angles, as the kernels
    a, b = pairs[..., 0].clone(), pairs[..., 1].clone()
    pairs[..., 0] = a * angle.cos() - b * angle.sin()
    pairs[..., 1] = a * angle.sin() + b * angle.cos()
    return y


@pytest.mark.parametrize("options", [dict(), dict(CHUNKED=False), dict(PINGPONG=False),
                                     dict(PINGPONG=False, BIAS_ONCE=False, CHUNKED=False), dict(THREAD_RELEASE=True),
                                     dict(THREAD_RELEASE=True, CHUNKED=False)],
                         ids=["defaults", "whole-tiles", "no-pingpong", "no-pingpong-bias-per-tile-whole-tiles",
                              "thread-release", "thread-release-whole-tiles"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_projection_against_float64(monkeypatch, case, options):
    """Float32 out (the product, bias and saturation exactly): within float32 sums of float64;
    each element written once, and only inside the ``[T, N]`` output. ``x`` copied and multiplied
    in 64-channel chunks (``CHUNKED``) or in whole tiles; the consumers' products in turns
    (``PINGPONG``); the bias loaded once (``BIAS_ONCE``); each chunk's slot released by every consumer thread
    (``THREAD_RELEASE``)."""
    for name, value in options.items():
        monkeypatch.setattr(ws, name, value)
    rows, width, out, bias, block_n, lanes = case
    x, w, b, want = _inputs(rows, width, out, bias)
    y = torch.full((rows + 3, out + 16), float("nan"))
    run = _run(x, w, b, y[:rows, :out], block_n, lanes)
    assert (want.abs() == 448).any()
    assert (y[:rows, :out].double() - want).abs().max() < 1e-3
    writes = run.writes("Y")
    assert (writes[:rows, :out] == 1).all()
    assert y[rows:].isnan().all() and y[:, out:].isnan().all()


# (rows, heads, kv heads, head dim, rotary dim, output columns per program, lanes): heads within one slice
# (D 128, 2 / 2 heads: q, k and v each a 256-column slice), q / k / v columns sharing a slice (8 / 2 heads of
# 32: k and v in slice 1), partial rotary (D 64, 32 rotated channels) in 128-column slices.
ROTARY_CASES = [
    (300, 2, 2, 128, 128, 256, 2),
    (200, 8, 2, 32, 32, 256, 1),
    (130, 4, 2, 64, 32, 128, 2),
]


@pytest.mark.parametrize("case", ROTARY_CASES, ids=str)
def test_projection_with_rotary_pairs(case):
    """Rotary in the epilogue (``ws.PairRotary``): q's and k's columns rotated in adjacent pairs at
    float positions up to 5000, v's untouched; within float32 sums of float64 plus the approximate sine's
    error; every element written once."""
    rows, heads, kv_heads, dim, rot, block_n, lanes = case
    out = (heads + 2 * kv_heads) * dim
    x, w, b, _ = _inputs(rows, 64, out, True)
    w = w / 50  # no saturation: the rotation mixes a pair's values
    positions = (torch.arange(rows, dtype=torch.float32) * 37.25) % 5000
    rotary = ws.PairRotary(positions, 10000.0, dim, rot, (heads + kv_heads) * dim)
    want = rotate_pairs_reference(x.double() @ w.double().t() + b.double(), rotary)
    assert want.abs().max() < 448
    y = torch.full((rows, out), float("nan"))
    run = _run(x, w, b, y, block_n, lanes, rotary)
    # float32 angles up to 5000 rad, reduced into [-pi, pi] in float32: a few of their ulps (2.4e-4 each)
    err = (y.double() - want).abs().max() / want.abs().max()
    assert err < 6 * 5000 * 2 ** -24, err
    plain = x.double() @ w.double().t() + b.double()
    assert not torch.allclose(y[:, :rotary.columns].double(), plain[:, :rotary.columns], atol=1e-2)
    assert (y[:, rotary.columns:].double() - plain[:, rotary.columns:]).abs().max() < 1e-3
    assert (run.writes("Y") == 1).all()


def test_projection_in_e4m3():
    """e4m3 out: torch's rounding of the float32 result, or its neighbour where float32 sums of
    another order round the other way."""
    x, w, b, want = _inputs(300, 256, 768, True, torch.float16)
    y = torch.zeros(300, 768, dtype=torch.float8_e4m3fn)
    _run(x, w, b, y, 256, 2)
    exact = want.float().to(torch.float8_e4m3fn).double()
    step = (want.abs().clamp(min=2 ** -6).log2().floor() - 3).exp2()  # e4m3's spacing at each value
    got = y.double()
    assert ((got - exact).abs() <= step).all()
    assert (got != exact).double().mean() < 0.01
    assert got.abs().max() == 448


def test_slots_and_lanes():
    """Ring slots fit beside the weights (two per consumer pair at least), and the grid puts about
    one program on each SM without more lanes than row tiles."""
    assert ws.stages(256, 256) == 2 and ws.stages(256, 128) == 4 and ws.stages(64, 128) == ws.MAX_STAGES
    for in_dim in (64, 128, 256):
        for block_n in (128, 256):
            slots = ws.stages(in_dim, block_n)
            assert slots & (slots - 1) == 0  # Gluon's shared memory shapes are powers of two
            assert ws.shared_bytes(in_dim, block_n, ws.stages(in_dim, block_n)) <= 227 * 1024
    assert ws.grid(2_370_000, 768, 256, 132) == (3, 44)
    assert ws.grid(2_370_000, 768, 128, 132) == (6, 22)
    assert ws.grid(100, 768, 256, 132) == (3, 2)
    assert ws.grid(100, 4096, 128, 16) == (32, 1)


def test_reasons_name_what_the_kernel_needs():
    x = torch.zeros(8, 96, dtype=torch.bfloat16)
    w = torch.zeros(200, 96, dtype=torch.float16)
    reasons = " / ".join(ws.linear_ws_reasons(x, w))
    for needed in ("an sm_90 GPU", "float16 input and weight", "input width of 64, 128 or 256 (got 96)",
                   "multiple of 16 outputs (got 200)"):
        assert needed in reasons
    wide = torch.zeros(8, 192, dtype=torch.bfloat16)
    assert "input width of 64, 128 or 256 (got 192)" in " / ".join(ws.linear_ws_reasons(wide, wide))


@pytest.mark.parametrize("rotary", [dict(), dict(rotary_dim=16), dict(rotary_interleaved=True), "positions"],
                         ids=["split", "partial", "interleaved", "float-positions"])
def test_a_converted_rotary_layer_rotating_in_the_projection(monkeypatch, rotary):
    """A converted ``RotaryBlockAttention`` whose projection rotates q and k (``FP8QKVProjection.rotated``
    with ``ROTARY_IN_PROJECTION`` on, the kernel run through the shim; grouped-query heads, causal): its
    output is the float64 layer's
    within e4m3 precision, as the same layer's with rotary in attention is, and the two agree."""
    import copy

    import blockattn_layers as bl
    from blockattn_layers.modules import fp8 as fp8_modules

    kwargs = {} if rotary == "positions" else rotary
    torch.manual_seed(0)
    layer = bl.RotaryBlockAttention(64, 4, num_kv_heads=2, block_size=16, causal=True, **kwargs).eval()
    lengths = [0, 1, 15, 16, 40, 3, 90]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    values = torch.randn(int(offsets[-1]), 64)
    positions = torch.rand(values.shape[0]) * 300 if rotary == "positions" else None
    with torch.no_grad():
        want = copy.deepcopy(layer).double()(values.double(), offsets, positions)
        served = bl.to_fp8_inference(copy.deepcopy(layer).bfloat16(), [(values.bfloat16(), offsets, positions)])
        in_attention = served(values.bfloat16(), offsets, positions)
        projections = []

        def shim_linear(x, w, b, rotary=None):
            projections.append(rotary)
            y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float8_e4m3fn)
            _run(x, w, b, y, 128, 2, rotary)
            return y

        monkeypatch.setattr(fp8_modules, "rotates_pairs", lambda x, weight, head_dim: True)
        monkeypatch.setattr(fp8_modules, "linear_e4m3", shim_linear)
        assert torch.equal(served(values.bfloat16(), offsets, positions), in_attention)  # off by default
        assert projections == []
        monkeypatch.setattr(fp8_modules, "ROTARY_IN_PROJECTION", True)
        in_projection = served(values.bfloat16(), offsets, positions)
    assert len(projections) == 1 and projections[0].columns == (4 + 2) * 16
    err_attention = rel(in_attention, want)
    err_projection = rel(in_projection, want)
    assert err_attention < 0.08 and err_projection < 0.08 and err_projection < 1.5 * err_attention
    assert rel(in_projection, in_attention) < 0.08


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())
