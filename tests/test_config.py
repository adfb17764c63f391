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


@pytest.mark.parametrize("bad, match", [
    (dict(d_model=30, nhead=4), "multiple of nhead"),
    (dict(d_model=32, nhead=4, num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(d_model=32, nhead=4, dropout=1.0), "dropout"),
    (dict(d_model=32, nhead=4, block_size=0), "block_size"),
    (dict(d_model=32, nhead=4, activation="swish"), "activation"),
    (dict(d_model=32, nhead=4, norm_first="yes"), "norm_first"),
])
def test_layer_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        EncoderLayerConfig(**bad)


def test_bad_files_and_names(tmp_path):
    with pytest.raises(ValueError, match="no preset named 'huge'"):
        load_config("huge")
    path = tmp_path / "typo.yaml"
    path.write_text("num_layers: 1\nlayer:\n  d_model: 32\n  nhead: 4\n  n_head: 2\n")
    with pytest.raises(ValueError, match=r"unknown layer settings \['n_head'\]"):
        load_config(path)
    path.write_text("num_layers: 1\n")
    with pytest.raises(ValueError, match="needs a 'layer' mapping"):
        load_config(path)
    with pytest.raises(ValueError, match="num_layers"):
        EncoderConfig(EncoderLayerConfig(32, 4), num_layers=0)
