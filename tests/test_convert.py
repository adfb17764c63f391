"""from_torch_encoder: a padded nn.TransformerEncoder and its jagged copy agree on valid tokens."""
import pytest
import torch

from blockattn_layers import (
    JaggedTransformerEncoder, JaggedTransformerEncoderLayer, from_torch_encoder, lengths_to_key_padding_mask,
    padded_to_jagged,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

LENGTHS = torch.tensor([7, 1, 12, 5])
N = 12

CASES = {
    "post-norm-relu": dict(norm_first=False, activation="relu", bias=True),
    "pre-norm-gelu-final-norm": dict(norm_first=True, activation="gelu", bias=True, final_norm=True),
    "no-bias": dict(norm_first=False, activation="gelu", bias=False),
}


def _torch_encoder(norm_first, activation, bias, final_norm=False, nested=False):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 48, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first, bias=bias,
        dtype=torch.float64,
    )
    norm = torch.nn.LayerNorm(32, dtype=torch.float64) if final_norm else None
    encoder = torch.nn.TransformerEncoder(layer, 3, norm=norm, enable_nested_tensor=nested)
    for p in encoder.parameters():  # move LayerNorm weights off their 1/0 init so a missed copy shows
        torch.nn.init.normal_(p, std=0.3)
    return encoder.eval()


def _padded_batch():
    torch.manual_seed(1)
    x = torch.randn(len(LENGTHS), N, 32, dtype=torch.float64)
    return x, lengths_to_key_padding_mask(LENGTHS, N)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_encoder_parity_on_valid_tokens(case):
    encoder = _torch_encoder(**CASES[case])
    jagged = from_torch_encoder(encoder)
    assert isinstance(jagged, JaggedTransformerEncoder) and not jagged.training
    assert jagged.layers[0].self_attn.block_size is None
    assert next(jagged.parameters()).dtype == torch.float64
    x, mask = _padded_batch()
    values, offsets = padded_to_jagged(x, key_padding_mask=mask)
    expected = encoder(x, src_key_padding_mask=mask)[~mask]
    torch.testing.assert_close(jagged(values, offsets), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_fast_path_parity():
    encoder = _torch_encoder(norm_first=False, activation="relu", bias=True, nested=True)
    x, mask = _padded_batch()
    values, offsets = padded_to_jagged(x, LENGTHS)
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=mask)[~mask]
        torch.testing.assert_close(from_torch_encoder(encoder)(values, offsets), expected, rtol=1e-10, atol=1e-10)


def test_layer_parity_and_block_size():
    encoder = _torch_encoder(norm_first=True, activation="relu", bias=True)
    layer = encoder.layers[0]
    jagged = from_torch_encoder(layer, block_size=4, backend="reference")
    assert isinstance(jagged, JaggedTransformerEncoderLayer)
    assert jagged.self_attn.block_size == 4 and jagged.self_attn.backend == "reference"
    x, mask = _padded_batch()
    values, offsets = padded_to_jagged(x, LENGTHS)
    full_attention = from_torch_encoder(layer)
    full = full_attention(values, offsets)
    torch.testing.assert_close(full, layer(x, src_key_padding_mask=mask)[~mask], rtol=1e-10, atol=1e-10)
    # Sequence 0 (7 tokens) in blocks of 4 is two sequences of 4 and 3 under full attention.
    blocked = jagged(values, offsets)
    split = full_attention(values[:7], torch.tensor([0, 4, 7]))
    torch.testing.assert_close(blocked[:7], split, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(blocked[:7], full[:7])


def test_training_mode_and_unsupported_modules():
    encoder = _torch_encoder(norm_first=False, activation="relu", bias=True).train()
    jagged = from_torch_encoder(encoder)
    assert jagged.training and jagged.layers[0].dropout.p == 0.1
    with pytest.raises(TypeError, match="nn.TransformerEncoder or nn.TransformerEncoderLayer"):
        from_torch_encoder(torch.nn.Linear(2, 2))
    odd = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    odd.self_attn = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_encoder(odd)
