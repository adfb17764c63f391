"""The warp-specialized e4m3 projection for sm_90 (``kernels.sm90.linear``) on CPU tensors through
``tests/gluon_shim.py`` (Gluon has no interpreter): the whole persistent kernel (the loader and the
two consumer partitions in threads, the weight slice and the ring of ``x`` tiles handed over by
mbarriers, tensor maps over the whole input, weight and output) against the float64 product; every
output element stored once, rows past T and columns past N never. What the shim does not model is
in its docstring; the kernel's GPU test is in ``tests/test_fp8_modules.py``."""
from __future__ import annotations

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


def _run(x, w, b, y, block_n, lanes):
    rows, in_dim = x.shape
    slices, _ = ws.grid(rows, w.shape[0], block_n, 10 ** 6)
    return gs.launch(
        ws._linear_ws_kernel, (slices * lanes,), X=x, W=w, B=b if b is not None else w, Y=y, rows=rows, lanes=lanes,
        stride_xt=x.stride(0), stride_wn=w.stride(0), stride_yt=y.stride(0), IN_DIM=in_dim, OUT_DIM=w.shape[0],
        HAS_BIAS=b is not None, BLOCK_N=block_n, STAGES=ws.stages(in_dim, block_n), CHUNK=ws.chunk(in_dim),
        PINGPONG=ws.PINGPONG, BIAS_ONCE=ws.BIAS_ONCE)


@pytest.mark.parametrize("options", [dict(), dict(CHUNKED=False), dict(PINGPONG=False),
                                     dict(PINGPONG=False, BIAS_ONCE=False, CHUNKED=False)],
                         ids=["defaults", "whole-tiles", "no-pingpong", "no-pingpong-bias-per-tile-whole-tiles"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_projection_against_float64(monkeypatch, case, options):
    """Float32 out (the product, bias and saturation exactly): within float32 sums of float64;
    each element written once, and only inside the ``[T, N]`` output. ``x`` copied and multiplied
    in 64-channel chunks (``CHUNKED``) or in whole tiles; the consumers' products in turns
    (``PINGPONG``); the bias loaded once (``BIAS_ONCE``)."""
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
