"""Frozen configs and YAML presets."""
import dataclasses

import pytest
import torch

from blockattn_layers import (
    EncoderConfig, EncoderLayerConfig, JaggedTransformerEncoder, build_encoder, list_presets, load_config,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend


def test_presets_load_by_name_and_build():
    assert {"small", "production"} <= set(list_presets())
    small = load_config("small")
    assert small.layer.d_model == 64 and small.num_layers == 2 and small.final_norm
    encoder = build_encoder("small")
    assert isinstance(encoder, JaggedTransformerEncoder) and len(encoder.layers) == 2
    assert encoder.layers[0].self_attn.block_size == small.layer.block_size
    assert encoder(torch.randn(10, 64), torch.tensor([0, 4, 10])).shape == (10, 64)
    production = build_encoder(load_config("production"))
    layer = production.layers[0]
    assert (layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features) == (256, 2, 1024)
    assert layer.self_attn.block_size == 64
    from_dict = build_encoder(small.to_dict())  # a config's dict form builds too
    assert isinstance(from_dict, JaggedTransformerEncoder) and len(from_dict.layers) == 2


def test_load_by_path_with_yaml_float_quirk(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("num_layers: 3\nlayer:\n  d_model: 32\n  nhead: 4\n  layer_norm_eps: 1e-6\n  block_size: null\n")
    config = load_config(path)
    assert config == EncoderConfig(EncoderLayerConfig(32, 4, layer_norm_eps=1e-6, block_size=None), num_layers=3)
    assert load_config(str(path)) == config
    encoder = build_encoder(path)
    assert encoder.layers[2].norm1.eps == 1e-6 and encoder.layers[0].self_attn.block_size is None


def test_configs_are_frozen_and_round_trip():
    config = load_config("production")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 5
    assert EncoderConfig.from_dict(config.to_dict()) == config
    bigger = dataclasses.replace(config, num_layers=6)
    assert bigger.num_layers == 6 and config.num_layers == 3


@pytest.mark.parametrize("bad, exc, match", [
    (dict(d_model=30, nhead=4), ValueError, r"^d_model \(30\) must be a multiple of nhead \(4\)"),
    (dict(d_model=0, nhead=4), ValueError, r"^d_model must be >= 1, got 0"),
    (dict(d_model=32.0, nhead=4), TypeError, r"^d_model must be an int >= 1"),
    (dict(d_model=32, nhead=0), ValueError, r"^nhead must be >= 1, got 0"),
    (dict(d_model=32, nhead=4, num_kv_heads=3), ValueError, r"^nhead \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(d_model=32, nhead=4, num_kv_heads=0), ValueError, r"^num_kv_heads must be >= 1"),
    (dict(d_model=32, nhead=4, dim_feedforward=0), ValueError, r"^dim_feedforward must be >= 1"),
    (dict(d_model=32, nhead=4, dropout=1.5), ValueError, r"^dropout must be a number in \[0, 1\], got 1\.5"),
    (dict(d_model=32, nhead=4, dropout=-0.1), ValueError, r"^dropout must be a number in \[0, 1\]"),
    (dict(d_model=32, nhead=4, dropout=float("nan")), ValueError, r"^dropout must be a number in \[0, 1\]"),
    (dict(d_model=32, nhead=4, block_size=0), ValueError, r"^block_size must be >= 1 or None, got 0"),
    (dict(d_model=32, nhead=4, block_size=-1), ValueError, r"^block_size must be >= 1 or None, got -1"),
    (dict(d_model=32, nhead=4, block_size=True), TypeError, r"^block_size must be an int >= 1 or None"),
    (dict(d_model=32, nhead=4, rope_theta=-1.0), ValueError, r"^rope_theta must be a positive finite number or None"),
    (dict(d_model=32, nhead=4, rope_theta=float("inf")), ValueError, r"^rope_theta must be a positive finite"),
    (dict(d_model=32, nhead=4, rope_theta=float("nan")), ValueError, r"^rope_theta must be a positive finite"),
    (dict(d_model=32, nhead=4, layer_norm_eps=-1e-5), ValueError, r"^layer_norm_eps must be a finite number >= 0"),
    (dict(d_model=32, nhead=4, activation="swish"), ValueError, r"^activation must be one of \['relu', 'gelu'\], got"),
    (dict(d_model=32, nhead=4, activation=torch.tanh), TypeError,
     r"^activation must be one of \['relu', 'gelu'\], got"),
    (dict(d_model=32, nhead=4, norm_first="yes"), TypeError, r"^norm_first must be a bool, got 'yes'"),
    (dict(d_model=32, nhead=4, causal=1), TypeError, r"^causal must be a bool"),
    (dict(d_model=32, nhead=4, bias=None), TypeError, r"^bias must be a bool"),
    (dict(d_model=32, nhead=4, backend="nope"), ValueError, r"^backend must be one of auto, .*reference.*; got 'nope'"),
    (dict(d_model=32, nhead=4, backend=None), TypeError, r"^backend must be a string or Backend enum"),
    (dict(d_model=32, nhead=4, rotary_dim=4), ValueError,
     r"^rotary_dim is only used with rotary embeddings: pass rope_theta too"),
    (dict(d_model=32, nhead=4, rotary_interleaved=True), ValueError,
     r"^rotary_interleaved is only used with rotary embeddings: pass rope_theta too"),
    (dict(d_model=32, nhead=4, rope_theta=1e4, rotary_dim=10), ValueError,
     r"^rotary_dim must be even and in \[2, head_dim=8\], got 10"),
    (dict(d_model=32, nhead=4, rope_theta=1e4, rotary_interleaved="yes"), TypeError,
     r"^rotary_interleaved must be a bool"),
])
def test_layer_config_validation(bad, exc, match):
    with pytest.raises(exc, match=match):
        EncoderLayerConfig(**bad)


def test_config_checks_are_the_layers():
    """A config accepts what the layer accepts (one set of checks), and builds it."""
    config = EncoderLayerConfig(32, 4, dropout=1, layer_norm_eps=0, rope_theta=10, block_size=None)
    assert config.build().self_attn.rope_theta == 10.0


def test_config_rotary_forms_reach_the_attention(tmp_path):
    """Partial and interleaved rotary from a config (and its YAML form) build the rotary attention
    with those settings."""
    path = tmp_path / "rotary.yaml"
    path.write_text("layer:\n  d_model: 32\n  nhead: 4\n  rope_theta: 1e4\n  rotary_dim: 4\n"
                    "  rotary_interleaved: true\n")
    config = load_config(path)
    attn = config.build().layers[0].self_attn
    assert (attn.rotary_dim, attn.rotary_interleaved, attn.rope_theta) == (4, True, 1e4)
    assert EncoderConfig.from_dict(config.to_dict()) == config


def test_yaml_strings_that_are_not_numbers(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("layer:\n  d_model: 32\n  nhead: 4\n  dropout: lots\n")
    with pytest.raises(TypeError, match=r"^dropout must be a number in \[0, 1\], got 'lots'"):
        load_config(path)


def test_bad_files_and_names(tmp_path):
    with pytest.raises(ValueError, match="no preset named 'huge'"):
        load_config("huge")
    with pytest.raises(TypeError, match=r"expected a preset name or a YAML path \(str or os.PathLike\), got int"):
        load_config(3)
    path = tmp_path / "typo.yaml"
    path.write_text("num_layers: 1\nlayer:\n  d_model: 32\n  nhead: 4\n  n_head: 2\n")
    with pytest.raises(ValueError, match=r"unknown layer settings \['n_head'\]"):
        load_config(path)
    path.write_text("num_layers: 1\n")
    with pytest.raises(ValueError, match="needs a 'layer' mapping"):
        load_config(path)
    with pytest.raises(ValueError, match=r"^num_layers must be >= 1, got 0"):
        EncoderConfig(EncoderLayerConfig(32, 4), num_layers=0)
    with pytest.raises(TypeError, match=r"^num_layers must be an int >= 1"):
        EncoderConfig(EncoderLayerConfig(32, 4), num_layers=2.0)
    with pytest.raises(TypeError, match=r"^final_norm must be a bool"):
        EncoderConfig(EncoderLayerConfig(32, 4), final_norm="no")
    with pytest.raises(TypeError, match=r"^layer must be an EncoderLayerConfig, got dict"):
        EncoderConfig({"d_model": 32, "nhead": 4})
