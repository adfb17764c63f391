"""Serving a model converted by ``to_fp8_inference`` on CPU: saving and restoring it (without
calibration data), ``torch.export`` and ``torch.compile`` of it, casts and moves, and the errors
of misuse (training a converted model, a calibration given as one batch, ranges float16 cannot hold)."""
import copy
import io

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers.modules.fp8 import FP8QKVProjection

LENGTHS = [5, 0, 1, 33, 64, 2]


def _batch(lengths=LENGTHS, width=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return torch.randn(int(offsets[-1]), width, generator=g) * scale, offsets


def _encoder(seed=0, **kw):
    torch.manual_seed(seed)
    layer = bl.JaggedTransformerEncoderLayer(64, 4, 128, dropout=0.0, block_size=32, rope_theta=1e4,
                                             num_kv_heads=2, **kw)
    return bl.JaggedTransformerEncoder(layer, 2).eval()


def _converted(seed=0, **kw):
    return bl.to_fp8_inference(_encoder(seed, **kw), [_batch()])


def _saved(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_a_saved_state_dict_restores_the_converted_model_without_calibration(bias):
    """A freshly built, unconverted model takes a converted model's state_dict (strict): its
    layers get their e4m3 projections from it and the outputs are the saved model's, bit for bit;
    so does a model built on the meta device and loaded with ``assign=True``."""
    served = _converted(bias=bias)
    x, offsets = _batch(seed=3)
    with torch.no_grad():
        want = served(x, offsets)
    state = _saved(served.state_dict())
    assert ("layers.1.self_attn.fp8.bias" in state) == bias
    fresh = _encoder(seed=1, bias=bias)
    fresh.load_state_dict(state)
    assert all(isinstance(layer.self_attn.fp8, FP8QKVProjection) for layer in fresh.layers)
    with torch.device("meta"):
        lazy = _encoder(seed=1, bias=bias)
    lazy.load_state_dict(state, assign=True)
    assert lazy.layers[0].self_attn.fp8.descales.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(fresh(x, offsets), want) and torch.equal(lazy(x, offsets), want)


def test_strict_loading_pickling_and_deepcopy_of_a_converted_model():
    """Verified, no change needed: a model converted on other data takes the saved state strictly;
    ``torch.save(model)`` / ``torch.load(weights_only=False)`` and ``copy.deepcopy`` keep the outputs;
    converting twice gives the first conversion's buffers; a 16-bit state_dict loaded strictly into a
    converted model names the fp8 keys it lacks."""
    served = _converted()
    x, offsets = _batch(seed=3)
    with torch.no_grad():
        want = served(x, offsets)
        other = bl.to_fp8_inference(_encoder(seed=1), [_batch(seed=5, scale=3.0)])
        other.load_state_dict(_saved(served.state_dict()))
        buffer = io.BytesIO()
        torch.save(served, buffer)
        buffer.seek(0)
        pickled = torch.load(buffer, weights_only=False)
        twice = bl.to_fp8_inference(copy.deepcopy(served), [_batch()])
        for model in (other, pickled, copy.deepcopy(served), twice):
            assert torch.equal(model(x, offsets), want)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.0\.self_attn\.fp8\.weight"):
        served.load_state_dict(_encoder().state_dict())


@pytest.mark.parametrize("kind", ["layer", "encoder"])
def test_export_of_a_converted_model_with_dynamic_shapes(kind):
    """``torch.export.export`` under ``torch.no_grad()``, with dynamic token and batch sizes as for
    unconverted models: the program runs the fp8 attention and gives the eager outputs at other
    sizes, also after ``torch.export.save`` / ``load``."""
    model = _converted() if kind == "encoder" else bl.to_fp8_inference(
        bl.RotaryBlockAttention(64, 4, block_size=32, num_kv_heads=2).eval(), [_batch()])
    tokens = torch.export.Dim("tokens", min=2, max=1 << 20)
    bounds = torch.export.Dim("bounds", min=2, max=1 << 16)
    with torch.no_grad():
        program = torch.export.export(model, _batch(), dynamic_shapes=({0: tokens}, {0: bounds}))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    ops = [n for n in program.graph.nodes if n.target == torch.ops.blockattn.attention_fwd.default]
    assert len(ops) == (2 if kind == "encoder" else 1)
    for lengths in ([3, 9], [1, 0, 70, 4, 31]):
        x, offsets = _batch(lengths, seed=len(lengths))
        with torch.no_grad():
            want = model(x, offsets)
            for run in (program.module(), loaded):
                torch.testing.assert_close(run(x, offsets), want, rtol=1e-6, atol=1e-6)


def test_compile_of_a_converted_encoder_is_fullgraph():
    """``torch.compile(fullgraph=True)`` of the converted encoder gives the eager outputs."""
    model = _converted()
    x, offsets = _batch(seed=3)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True)(x, offsets)
        torch.testing.assert_close(got, model(x, offsets), rtol=1e-5, atol=1e-5)


def test_a_converted_model_refuses_to_train():
    """Back in training mode with gradients enabled, a converted layer refuses (its in_proj would
    get no gradient, silently) and says what to do; without gradients, or in eval mode on an input
    that needs none, it runs."""
    layer = bl.to_fp8_inference(bl.BlockSelfAttention(64, 4, block_size=32).train(), [_batch()])
    assert not layer.training
    x, offsets = _batch()
    with torch.no_grad():
        want = layer(x, offsets)
    assert torch.equal(layer(x, offsets), want)
    layer.train()
    with pytest.raises(RuntimeError, match=r"training mode.*model\.eval\(\).*torch\.no_grad\(\)"):
        layer(x, offsets)
    with torch.no_grad():
        assert torch.equal(layer(x, offsets), want)
    encoder = _converted()
    with pytest.raises(RuntimeError, match=r"its input requires grad.*torch\.no_grad\(\).*torch\.export"):
        encoder(x, offsets)  # the second layer's input carries the first layer's parameters' gradients


def test_casts_and_moves_of_a_converted_model():
    """Verified, no change needed: ``.to(torch.float64)`` and back is exact; ``.half()`` serves
    within half precision; a meta-device copy keeps float32 factors and runs shapes."""
    served = bl.to_fp8_inference(bl.RotaryBlockAttention(64, 4, block_size=32).eval(), [_batch()])
    x, offsets = _batch()
    with torch.no_grad():
        want = served(x, offsets)
        assert torch.equal(copy.deepcopy(served).to(torch.float64).to(torch.float32)(x, offsets), want)
        half = copy.deepcopy(served).half()
        assert half.fp8.weight.dtype == torch.float16 and half.fp8.descales.dtype == torch.float32
        assert _rel(half(x.half(), offsets), want) < 0.02
        meta = copy.deepcopy(served).to("meta")
        assert meta.fp8.descales.dtype == torch.float32
        assert meta(x.to("meta"), offsets.to("meta")).shape == x.shape


def test_ranges_float16_cannot_hold_are_refused():
    """Small calibrated q, k, v ranges make the folded weights large (weight / factor): past
    float16's 65504 they would be infinite and the outputs NaN. Converting a float16 model, or
    casting a converted model to float16, says so instead; bfloat16 holds them."""
    x, offsets = _batch(scale=1e-4)
    layer = bl.BlockSelfAttention(64, 4, block_size=32, bias=False).eval()
    with pytest.raises(ValueError, match="overflow.*float16.*bfloat16"):
        bl.to_fp8_inference(copy.deepcopy(layer).half(), [(x.half(), offsets)])
    served = bl.to_fp8_inference(copy.deepcopy(layer), [(x, offsets)])
    with pytest.raises(ValueError, match="overflow.*float16.*bfloat16"):
        served.half()
    assert served.fp8.weight.dtype == torch.float32 and served.fp8.weight.isfinite().all()
    with torch.no_grad():
        want = layer.double()(x.double(), offsets)
        assert _rel(served.bfloat16()(x.bfloat16(), offsets), want) < 0.05


def test_calibration_leaves_out_non_finite_outputs_and_empty_batches():
    """A NaN in a calibration batch no longer sets its layer's factors to 1 (saturating every
    larger value), and an empty batch is skipped instead of failing."""
    layer = bl.BlockSelfAttention(64, 4, block_size=32).eval()
    with torch.no_grad():
        layer.in_proj.weight[-64:].mul_(1000.0)  # v far past 448
    x, offsets = _batch()
    poisoned = x.clone()
    poisoned[7, 3] = float("nan")
    clean = bl.to_fp8_inference(copy.deepcopy(layer), [(x, offsets)])
    empty = (torch.zeros(0, 64), torch.zeros(3, dtype=torch.int64))
    served = bl.to_fp8_inference(copy.deepcopy(layer), [(poisoned, offsets), empty])
    assert torch.equal(served.fp8.descales, clean.fp8.descales)
    with torch.no_grad():
        assert _rel(served(x, offsets), layer.double()(x.double(), offsets)) < 0.08


def test_calibration_given_as_one_batch_or_none_is_named():
    layer = bl.BlockSelfAttention(64, 4, block_size=32).eval()
    x, offsets = _batch()
    with pytest.raises(TypeError, match=r"one batch.*\[\(values, offsets\)\]"):
        bl.to_fp8_inference(layer, (x, offsets))
    with pytest.raises(TypeError, match="iterable of sample batches.*load_state_dict"):
        bl.to_fp8_inference(layer, None)
