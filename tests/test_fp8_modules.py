"""FP8 inference of the attention layers (``to_fp8_inference``): calibration, the e4m3 QKV
projection's outputs and factors, the converted layers against the float64 model, and misuse;
the fused projection kernel (``kernels.fp8_linear``) in Triton's interpreter and on the GPU."""
import copy

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import fp8
from blockattn_layers.modules.fp8 import FP8QKVProjection
from blockattn_layers.ops.backends.triton_block import interpreter_active
from tests.oracle import oracle_rotate

LENGTHS = [0, 1, 63, 64, 65, 130, 0, 5]


def _batch(width, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(LENGTHS) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(LENGTHS).cumsum(0)
    return torch.randn(int(offsets[-1]), width, generator=g) * scale, offsets


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


LAYERS = {
    "block": lambda: bl.BlockSelfAttention(64, 4, block_size=16, num_kv_heads=2),
    "rotary_gqa_causal": lambda: bl.RotaryBlockAttention(64, 4, block_size=64, num_kv_heads=1, causal=True),
    "encoder": lambda: bl.JaggedTransformerEncoder(
        bl.JaggedTransformerEncoderLayer(64, 2, 128, dropout=0.0, block_size=32, rope_theta=1e4), 2),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_converted_layers_match_the_float64_model_within_e4m3_precision(name):
    torch.manual_seed(0)
    model = LAYERS[name]().eval()
    values, offsets = _batch(64)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(values.double(), offsets)
        converted = bl.to_fp8_inference(copy.deepcopy(model), [(values, offsets), (_batch(64, seed=1)[0], offsets)])
        got = converted(values, offsets)
        other, _ = _batch(64, seed=2, scale=0.5)  # an unseen batch inside the calibrated range
        err_other = _rel(converted(other, offsets), copy.deepcopy(model).double()(other.double(), offsets))
    layers = [m for m in converted.modules() if isinstance(m, bl.BlockSelfAttention)]
    assert layers and all(isinstance(m.fp8, FP8QKVProjection) for m in layers)
    assert got.dtype == values.dtype and got.shape == values.shape
    assert _rel(got, want) < 0.08 and err_other < 0.08


def test_the_projection_emits_e4m3_q_k_v_with_a_factor_per_kind_and_kv_head():
    """The projection's e4m3 q, k, v x their descales are the float model's q, k, v within e4m3's
    precision, per kv head (each kv head's group has its own factor); the weight keeps the
    layer's dtype (the 16-bit input is not quantized)."""
    torch.manual_seed(0)
    layer = bl.BlockSelfAttention(64, 4, block_size=64, num_kv_heads=2).eval()
    with torch.no_grad():
        layer.in_proj.weight[:16] *= 30.0  # q's first kv-head group: a 30x larger range
    values, offsets = _batch(64)
    bl.to_fp8_inference(layer, [(values, offsets)])
    with torch.no_grad():
        q8, k8, v8, qd, kd, vd = layer.fp8(values)
        q, k, v = layer._qkv(values)
    assert layer.fp8.weight.dtype == layer.in_proj.weight.dtype
    assert all(x.dtype == torch.float8_e4m3fn for x in (q8, k8, v8)) and qd.shape == kd.shape == vd.shape == (2,)
    assert qd[0] > 10 * qd[1]
    for x8, d, x, groups in ((q8, qd, q, 2), (k8, kd, k, 1), (v8, vd, v, 1)):
        back = fp8.dequantize(x8, d, offsets, groups, torch.float64)
        for h in range(2):
            part = slice(h * groups, (h + 1) * groups)
            assert _rel(back[:, part], x[:, part]) < 0.06
            assert back[:, part].abs().max() <= x[:, part].abs().max() * 1.07  # calibrated: no overshoot


LINEAR_CASES = [(300, 256, 768, True), (5, 48, 40, False), (129, 64, 130, True), (0, 32, 16, True)]


def _linear_inputs(total, width, out, bias, dtype, device="cpu"):
    g = torch.Generator().manual_seed(total + width)
    x = torch.randn(total, width, generator=g).to(dtype)
    w = (torch.randn(out, width, generator=g) * 200 / width ** 0.5).to(dtype)  # about 3% of the outputs saturate
    b = torch.randn(out, generator=g) * 3 if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    return [t if t is None else t.to(device) for t in (x, w, b)], want.clamp(-448, 448)


@pytest.mark.skipif(not interpreter_active(), reason="CPU interpreter test; the GPU test below covers the kernel")
@pytest.mark.parametrize("case", LINEAR_CASES, ids=str)
def test_fused_projection_kernel_in_the_interpreter(case):
    """The kernel's product, bias and saturation (written in float32: the interpreter's e4m3
    rounding is wrong where rounding up carries into the exponent), against float64, fp16 inputs."""
    from blockattn_layers.kernels.fp8_linear import linear_e4m3

    (x, w, b), want = _linear_inputs(*case, torch.float16)
    got = linear_e4m3(x, w, b, torch.float32)
    assert got.shape == want.shape and got.dtype == torch.float32
    if case[0]:
        assert (want.abs() == 448).any()
        assert (got.double() - want).abs().max() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an sm_89 or newer GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=str)
def test_fused_projection_kernel_on_the_gpu(monkeypatch, case, dtype):
    """e4m3 out (``_e4m3_close``); the layer's projection
    takes the kernel: by default where a hardware run is recorded (``fp8_linear.VERIFIED_ON``),
    elsewhere with unverified kernels allowed."""
    from blockattn_layers.kernels import fp8_linear
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.fp8_linear import VERIFIED_ON, linear_e4m3, linear_e4m3_reasons

    monkeypatch.setattr(fp8_linear, "_ws_taken", lambda *args: False)  # this kernel, not sm90.linear
    x = torch.zeros(1, 64, dtype=dtype, device="cuda")
    monkeypatch.setattr(variants, "_UNVERIFIED", [False])
    reasons = linear_e4m3_reasons(x, x)
    if torch.cuda.get_device_capability()[0] in VERIFIED_ON:
        assert reasons == []
    else:
        assert any("BLOCKATTN_UNVERIFIED_KERNELS" in r for r in reasons)
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    assert linear_e4m3_reasons(x, x) == []

    (x, w, b), want = _linear_inputs(*case, dtype, device="cuda")
    got = linear_e4m3(x, w, b).cpu()
    assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape
    if case[0]:
        _e4m3_close(got, want)
        assert got.double().abs().max() == 448


def _e4m3_close(got, want):
    """Every element of ``got`` (e4m3) is ``want`` (float64) rounded to e4m3 or, at a rounding tie or
    within float32 sums of one, its neighbour on the e4m3 grid."""
    exact = want.float().to(torch.float8_e4m3fn).double()
    step = (want.abs().clamp(min=2 ** -6).log2().floor() - 3).exp2()  # e4m3's spacing at each value
    assert ((got.double() - exact).abs() <= step).all()
    assert (got.double() != exact).double().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("options", [dict(), dict(CHUNKED=False), dict(PINGPONG=False),
                                     dict(PINGPONG=False, BIAS_ONCE=False), dict(THREAD_RELEASE=True)],
                         ids=["defaults", "whole-tiles", "no-pingpong", "no-pingpong-bias-per-tile",
                              "thread-release"])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("case", [(300, 256, 768, True), (129, 64, 208, False), (70_001, 256, 768, True),
                                  (1000, 128, 400, True)], ids=str)
def test_warp_specialized_projection_on_the_gpu(monkeypatch, case, block_n, options, dtype):
    """The Gluon projection (``sm90.linear``) against float64, as the Triton kernel's test, its ``x``
    in whole tiles or 64-channel chunks (``CHUNKED``), the consumers' products in turns (``PINGPONG``),
    the bias loaded once (``BIAS_ONCE``), the chunks' slots released by every consumer thread
    (``THREAD_RELEASE``); with unverified kernels allowed ``linear_e4m3`` takes it for
    the projections it admits."""
    from blockattn_layers.kernels import fp8_linear
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90 import linear as ws

    for name, value in options.items():
        monkeypatch.setattr(ws, name, value)
    (x, w, b), want = _linear_inputs(*case, dtype, device="cuda")
    assert ws.linear_ws_reasons(x, w) == []
    y = torch.full((case[0], case[2]), float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    ws.linear_ws(x, w, b, y, block_n)
    got = y.cpu()
    _e4m3_close(got, want)
    assert got.double().abs().max() == 448
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    taken = []
    monkeypatch.setattr(ws, "linear_ws", lambda *args, **kwargs: taken.append(args) or args[3].copy_(got))
    assert torch.equal(fp8_linear.linear_e4m3(x, w, b).cpu().view(torch.uint8), got.view(torch.uint8))
    assert len(taken) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("layout", [(2, 2, 128, 128), (4, 4, 64, 64), (8, 2, 32, 32), (4, 2, 64, 32)], ids=str)
def test_warp_specialized_projection_with_rotary_on_the_gpu(layout, block_n):
    """Rotary in the Gluon projection's epilogue (``sm90.linear.PairRotary``: q's and k's channels in
    adjacent pairs, at each row's position within its sequence, up to 9869): against float64 products
    rotated by the float64 oracle (interleaved pairs) and saturated, within one e4m3 step; v's columns
    as without rotary."""
    from blockattn_layers.kernels.sm90 import linear as ws

    heads, kv_heads, dim, rot = layout
    out = (heads + 2 * kv_heads) * dim
    (x, w, b), _ = _linear_inputs(20_000, 256, out, True, torch.bfloat16, device="cuda")
    lengths = [3000, 1, 0, 7000, 129, 9870]
    positions = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])
    rotary = ws.PairRotary(positions.cuda(), 10000.0, dim, rot, (heads + kv_heads) * dim)
    y = torch.full((20_000, out), float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    ws.linear_ws(x, w, b, y, block_n, rotary)
    plain = x.double().cpu() @ w.double().cpu().t() + b.double().cpu()
    cols = rotary.columns
    turned = oracle_rotate(plain[:, :cols].unflatten(1, (-1, dim)), positions.tolist(), 10000.0, rot, True).flatten(1)
    want = torch.cat([turned, plain[:, cols:]], 1).clamp(-448, 448)
    got = y.cpu().double()
    _e4m3_close(got[:, cols:], want[:, cols:])
    # Rotated columns: one e4m3 step, plus the float32 angle's error (a few of its ulps, up to 2.4e-3 rad
    # at position 9869) times the pair's length.
    step = (want.abs().clamp(min=2 ** -6).log2().floor() - 3).exp2()[:, :cols]
    pair_length = plain[:, :cols].unflatten(1, (-1, 2)).norm(dim=-1).repeat_interleave(2, 1)
    allowed = step + 4 * 2 ** -24 * positions.double()[:, None] * pair_length
    assert ((got[:, :cols] - want[:, :cols]).abs() <= allowed).all()
    assert (got[:, :cols] != want[:, :cols].float().to(torch.float8_e4m3fn).double()).double().mean() < 0.01


def test_projection_without_the_kernel_matches_the_kernel_contract():
    """CPU (no kernel): float32 product of the 16-bit input and folded weights, saturated, cast."""
    (x, w, b), want = _linear_inputs(129, 64, 129, True, torch.bfloat16)
    proj = FP8QKVProjection(w, b, torch.ones(3, 1), 1, 1, 43)
    y = proj.project(x)
    assert y.dtype == torch.float8_e4m3fn
    assert torch.equal(y, (x.float() @ w.float().t() + b).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert ((y.double() - want).abs() <= want.abs() * 2 ** -3 + 2 ** -9).all()


def test_conversion_errors_and_the_gradient_guard():
    layer = bl.BlockSelfAttention(64, 4, block_size=64)
    values, offsets = _batch(64)
    with pytest.raises(ValueError, match="no BlockSelfAttention"):
        bl.to_fp8_inference(torch.nn.Linear(4, 4), [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="calibration gave no batches"):
        bl.to_fp8_inference(layer, [])
    for margin in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="margin must be a finite number >= 1"):
            bl.to_fp8_inference(layer, [(values, offsets)], margin=margin)
    model = torch.nn.ModuleDict(dict(used=bl.BlockSelfAttention(64, 4), unused=bl.BlockSelfAttention(64, 4)))
    with pytest.raises(ValueError, match="no calibration batch reached BlockSelfAttention"):
        bl.to_fp8_inference(_Only(model), [(values, offsets)])
    bl.to_fp8_inference(layer, [(values, offsets)], margin=1.25)
    with pytest.raises(RuntimeError, match="runs fp8 inference.*torch.no_grad"):
        layer(values.clone().requires_grad_(), offsets)
    with torch.no_grad():
        assert layer(values, offsets).shape == values.shape


def test_a_converted_model_cast_to_another_dtype_keeps_float32_factors():
    """Calibrated in float32, then cast for serving: the descales and the folded bias keep their
    float32 values (``.to`` moves them, never rounds them), and the layer runs in bf16 and float64;
    a float64 model converts too (the fp8 attention writes float32, cast to the layer's dtype)."""
    torch.manual_seed(0)
    attn = bl.RotaryBlockAttention(64, 4, block_size=64).eval()
    values, offsets = _batch(64)
    served = bl.to_fp8_inference(copy.deepcopy(attn), [(values, offsets)])
    with torch.no_grad():
        want = served(values, offsets)
        for dtype, tol in ((torch.bfloat16, 0.05), (torch.float64, 1e-5)):
            cast = copy.deepcopy(served).to(dtype)
            assert cast.fp8.descales.dtype == cast.fp8.bias.dtype == torch.float32
            assert torch.equal(cast.fp8.descales, served.fp8.descales) and cast.fp8.weight.dtype == dtype
            got = cast(values.to(dtype), offsets)
            assert got.dtype == dtype and _rel(got.double(), want.double()) < tol
        wide = bl.to_fp8_inference(copy.deepcopy(attn).double(), [(values.double(), offsets)])
        got = wide(values.double(), offsets)
        # Ranges calibrated on float64 rather than float32 products move a few e4m3 roundings.
        assert got.dtype == torch.float64 and _rel(got, want.double()) < 3e-5


class _Only(torch.nn.Module):
    """Runs only the first of its two attention layers."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, values, offsets):
        return self.layers["used"](values, offsets)


def test_accuracy_report_on_the_demo_models_activations(capsys):
    """``bench.fp8_accuracy`` (a few training steps): per sub-layer, bf16's, fp8's and the
    partly rounded errors, each against the float64 sub-layer on the demo model's activations."""
    from blockattn_layers.bench import fp8_accuracy

    rows = fp8_accuracy.sublayer_rows(torch.device("cpu"), steps=3)
    assert [r["method"] for r in rows[:4]] == ["bf16", "fp8", "v only", "q, k only"] and len(rows) == 8
    for i in range(0, len(rows), 4):
        bf16, fp8_err, v_only, qk_only = (r["err"] for r in rows[i:i + 4])
        assert 0 < bf16 < 1e-2 and bf16 < v_only < fp8_err < 0.1 and bf16 < qk_only < fp8_err
