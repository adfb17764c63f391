"""FP8 inference of the attention layers (``to_fp8_inference``): calibration, the e4m3 QKV
projection's outputs and factors, the converted layers against the float64 model, and misuse.
CPU (``torch._scaled_mm`` runs there too)."""
import copy

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import fp8
from blockattn_layers.modules.fp8 import FP8QKVProjection

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


def test_the_projection_emits_e4m3_q_k_v_straight_from_the_gemm(monkeypatch):
    """q, k, v leave ``torch._scaled_mm`` as e4m3 (no 16-bit q, k, v is written and quantized
    again), and stored value x descale is the float model's q, k, v within e4m3's precision,
    per kv head."""
    torch.manual_seed(0)
    layer = bl.BlockSelfAttention(64, 4, block_size=64, num_kv_heads=2).eval()
    with torch.no_grad():
        layer.in_proj.weight[:16] *= 30.0  # q's first kv-head group: a 30x larger range
    values, offsets = _batch(64)
    bl.to_fp8_inference(layer, [(values, offsets)])
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(kw["out_dtype"]) or real(*a, **kw))
    with torch.no_grad():
        q8, k8, v8, qd, kd, vd = layer.fp8(values)
        q, k, v = layer._qkv(values)
    assert calls == [torch.float8_e4m3fn]
    assert all(x.dtype == torch.float8_e4m3fn for x in (q8, k8, v8)) and qd.shape == kd.shape == vd.shape == (2,)
    assert qd[0] > 10 * qd[1]  # each kv head's group has its own factor
    for x8, d, x, groups in ((q8, qd, q, 2), (k8, kd, k, 1), (v8, vd, v, 1)):
        back = fp8.dequantize(x8, d, offsets, groups, torch.float64)
        for h in range(2):
            part = slice(h * groups, (h + 1) * groups)
            assert _rel(back[:, part], x[:, part]) < 0.1


def test_conversion_errors_and_the_gradient_guard():
    layer = bl.BlockSelfAttention(64, 4, block_size=64)
    values, offsets = _batch(64)
    with pytest.raises(ValueError, match="no BlockSelfAttention"):
        bl.to_fp8_inference(torch.nn.Linear(4, 4), [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="calibration gave no batches"):
        bl.to_fp8_inference(layer, [])
    with pytest.raises(ValueError, match="margin must be a number >= 1"):
        bl.to_fp8_inference(layer, [(values, offsets)], margin=0.5)
    model = torch.nn.ModuleDict(dict(used=bl.BlockSelfAttention(64, 4), unused=bl.BlockSelfAttention(64, 4)))
    with pytest.raises(ValueError, match="no calibration batch reached BlockSelfAttention"):
        bl.to_fp8_inference(_Only(model), [(values, offsets)])
    bl.to_fp8_inference(layer, [(values, offsets)], margin=1.25)
    with pytest.raises(RuntimeError, match="runs fp8 inference.*torch.no_grad"):
        layer(values.clone().requires_grad_(), offsets)
    with torch.no_grad():
        assert layer(values, offsets).shape == values.shape


class _Only(torch.nn.Module):
    """Runs only the first of its two attention layers."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, values, offsets):
        return self.layers["used"](values, offsets)
