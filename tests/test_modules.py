"""Modules: attention math against a dense masked oracle, every input kind, encoder conventions, wrappers."""
import doctest

import pytest
import torch
from torch.nn import functional as F

import blockattn_layers
from blockattn_layers import (
    BlockSelfAttention, JaggedTransformerEncoder, JaggedTransformerEncoderLayer, RotaryBlockAttention,
)
from blockattn_layers.modules import attention as attention_module

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

OFFSETS = torch.tensor([0, 5, 5, 6, 23, 40])  # lengths 5, 0, 1, 17, 17
T = int(OFFSETS[-1])


def _allowed(offsets, block_size, causal):
    """``[T, T]`` bool: key j is visible to query i (same sequence, same block, causal if asked)."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(int(offsets[-1])) - offsets[seq]
    block = torch.zeros_like(pos) if block_size is None else pos // block_size
    same = (seq[:, None] == seq[None, :]) & (block[:, None] == block[None, :])
    return same & (pos[None, :] <= pos[:, None]) if causal else same


def _rotate(x, positions, theta, rotary_dim, interleaved):
    """Rotary embedding written with complex numbers (independent of the package's code)."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    turn = torch.polar(torch.ones_like(freq), positions.double()[:, None] * freq)[:, None, :]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], half, 2).contiguous()) * turn
        rot = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(rot[..., :half], rot[..., half:]) * turn
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def _dense_oracle(attn, x, offsets, positions=None):
    """The module's math as dense masked attention over all T tokens at once."""
    h, h_kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = F.linear(x, attn.in_proj.weight, attn.in_proj.bias).split([h * d, h_kv * d, h_kv * d], -1)
    q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (h_kv, d)), v.unflatten(-1, (h_kv, d))
    if isinstance(attn, RotaryBlockAttention):
        if positions is None:
            positions = torch.cat([torch.arange(n) for n in (offsets[1:] - offsets[:-1]).tolist()])
        dim = attn.rotary_dim or d
        q = _rotate(q, positions, attn.rope_theta, dim, attn.rotary_interleaved)
        k = _rotate(k, positions, attn.rope_theta, dim, attn.rotary_interleaved)
    k, v = k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=_allowed(offsets, attn.block_size, attn.causal),
    )
    return attn.out_proj(out.transpose(0, 1).flatten(1))


ATTENTION_CASES = {
    "block16": dict(cls=BlockSelfAttention, kw=dict(block_size=16)),
    "block4-gqa-causal": dict(cls=BlockSelfAttention, kw=dict(block_size=4, num_kv_heads=2, causal=True)),
    "full-mqa-nobias": dict(cls=BlockSelfAttention, kw=dict(block_size=None, num_kv_heads=1, bias=False)),
    "rotary-block8": dict(cls=RotaryBlockAttention, kw=dict(block_size=8)),
    "rotary-partial-interleaved": dict(
        cls=RotaryBlockAttention, kw=dict(block_size=None, rotary_dim=4, rotary_interleaved=True, rope_theta=500.0),
    ),
}


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=list(ATTENTION_CASES))
def test_attention_matches_dense_oracle(case):
    torch.manual_seed(0)
    spec = ATTENTION_CASES[case]
    attn = spec["cls"](32, 4, dtype=torch.float64, **spec["kw"])
    x = torch.randn(T, 32, dtype=torch.float64, requires_grad=True)
    out = attn(x, OFFSETS)
    expected = _dense_oracle(attn, x, OFFSETS)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, attn.in_proj.weight], grad)
    want = torch.autograd.grad(expected, [x, attn.in_proj.weight], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_rotary_positions_event_times_and_default():
    torch.manual_seed(0)
    attn = RotaryBlockAttention(32, 2, block_size=8, dtype=torch.float64)
    x = torch.randn(T, 32, dtype=torch.float64)
    times = torch.rand(T, dtype=torch.float64) * 1000
    torch.testing.assert_close(attn(x, OFFSETS, times), _dense_oracle(attn, x, OFFSETS, times), rtol=1e-10, atol=1e-10)
    index = torch.cat([torch.arange(n) for n in (OFFSETS[1:] - OFFSETS[:-1]).tolist()])
    assert torch.equal(attn(x, OFFSETS), attn(x, OFFSETS, index))
    assert not torch.allclose(attn(x, OFFSETS), attn(x, OFFSETS, times))


def test_hints_are_passed_through(monkeypatch):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return blockattn_layers.block_attention(*args, **kwargs)

    monkeypatch.setattr(attention_module, "block_attention", spy)
    layer = JaggedTransformerEncoderLayer(16, 2, 32, block_size=4, backend="reference")
    layer(torch.randn(T, 16), OFFSETS, cpu_offsets=OFFSETS, max_seqlen=17)
    assert seen["cpu_offsets"] is OFFSETS and seen["max_seqlen"] == 17 and seen["backend"] == "reference"


def _modules():
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.0, block_size=4, rope_theta=100.0)
    return {
        "BlockSelfAttention": BlockSelfAttention(16, 2, block_size=4),
        "RotaryBlockAttention": RotaryBlockAttention(16, 2, block_size=4),
        "JaggedTransformerEncoderLayer": layer,
        "JaggedTransformerEncoder": JaggedTransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(16)),
    }


@pytest.mark.parametrize("name", list(_modules()))
def test_every_input_kind_returns_same_kind(name):
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import JaggedTensor

    module = _modules()[name].eval()
    a = JaggedTensor(values=torch.randn(7, 16), lengths=torch.tensor([3, 0, 4], dtype=torch.int32))
    b = JaggedTensor(values=torch.randn(5, 16), offsets=torch.tensor([0, 5]))
    values = torch.cat([a.values(), b.values()])
    offsets = torch.tensor([0, 3, 3, 7, 12])
    expected = module(values, offsets)
    assert isinstance(expected, torch.Tensor) and expected.shape == (12, 16)

    out_jt = module(a)
    assert type(out_jt) is JaggedTensor and out_jt.lengths().tolist() == [3, 0, 4]
    torch.testing.assert_close(out_jt.values(), expected[:7])

    out_dict = module({"a": a, "b": b})
    assert list(out_dict) == ["a", "b"]
    assert out_dict["b"].lengths().tolist() == [5]
    torch.testing.assert_close(torch.cat([out_dict["a"].values(), out_dict["b"].values()]), expected)


def test_dict_positions_follow_input_keys():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import JaggedTensor

    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(16, 2, 32, 0.0, block_size=None, rope_theta=10.0)
    encoder = JaggedTransformerEncoder(layer, 2)
    x = {"a": JaggedTensor(values=torch.randn(3, 16), lengths=torch.tensor([3])),
         "b": JaggedTensor(values=torch.randn(2, 16), lengths=torch.tensor([2]))}
    times = {"b": JaggedTensor(values=torch.tensor([7.0, 9.0]), lengths=torch.tensor([2])),
             "a": JaggedTensor(values=torch.tensor([0.0, 4.0, 5.0]), lengths=torch.tensor([3]))}
    out = encoder(x, positions=times)
    flat = encoder(torch.cat([x["a"].values(), x["b"].values()]), torch.tensor([0, 3, 5]),
                   torch.tensor([0.0, 4.0, 5.0, 7.0, 9.0]))
    torch.testing.assert_close(torch.cat([out["a"].values(), out["b"].values()]), flat)


def test_encoder_deep_copies_layers_and_applies_norm():
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.0, block_size=4)
    norm = torch.nn.LayerNorm(16)
    encoder = JaggedTransformerEncoder(layer, 3, norm=norm).eval()
    assert len(encoder.layers) == 3 and encoder.num_layers == 3
    assert all(l is not layer for l in encoder.layers)
    assert encoder.layers[0].linear1.weight is not encoder.layers[1].linear1.weight
    x = torch.randn(T, 16)
    manual = x
    for l in encoder.layers:
        manual = l(manual, OFFSETS)
    torch.testing.assert_close(encoder(x, OFFSETS), norm(manual))
    with torch.no_grad():
        encoder.layers[1].linear1.weight.zero_()
    assert not torch.equal(encoder.layers[0].linear1.weight, encoder.layers[1].linear1.weight)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_layer_composition_matches_definition(norm_first):
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(16, 2, 24, dropout=0.0, activation="gelu", block_size=4,
                                          norm_first=norm_first, dtype=torch.float64).eval()
    x = torch.randn(T, 16, dtype=torch.float64)

    def ff(y):
        return layer.linear2(F.gelu(layer.linear1(y)))

    if norm_first:
        y = x + layer.self_attn(layer.norm1(x), OFFSETS)
        expected = y + ff(layer.norm2(y))
    else:
        y = layer.norm1(x + layer.self_attn(x, OFFSETS))
        expected = layer.norm2(y + ff(y))
    torch.testing.assert_close(layer(x, OFFSETS), expected, rtol=0, atol=0)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.5, block_size=4)
    x = torch.randn(T, 16)
    assert not torch.equal(layer(x, OFFSETS), layer(x, OFFSETS))
    layer.eval()
    assert torch.equal(layer(x, OFFSETS), layer(x, OFFSETS))


def test_module_argument_errors():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        BlockSelfAttention(30, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        BlockSelfAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryBlockAttention(32, 4, rotary_dim=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        JaggedTransformerEncoderLayer(16, 2, activation="tanh")
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        JaggedTransformerEncoder(JaggedTransformerEncoderLayer(16, 2), 0)
    with pytest.raises(ValueError, match="rotary attention only"):
        JaggedTransformerEncoderLayer(16, 2)(torch.randn(T, 16), OFFSETS, torch.zeros(T))
    with pytest.raises(TypeError, match="offsets is required"):
        BlockSelfAttention(16, 2)(torch.randn(T, 16))


def test_sequence_encoder_over_embedding_collection():
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingCollection, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor

    from blockattn_layers import JaggedSequenceEncoder

    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(name="item_ids", embedding_dim=16, num_embeddings=50, feature_names=["clicks", "views"]),
        EmbeddingConfig(name="shop_ids", embedding_dim=16, num_embeddings=20, feature_names=["shops"]),
    ]
    collection = EmbeddingCollection(tables=tables)
    encoder = JaggedTransformerEncoder(JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.0, block_size=4), 2)
    model = JaggedSequenceEncoder(collection, encoder)
    lengths = torch.tensor([3, 0, 6, 1, 2, 2], dtype=torch.int32)  # 3 keys x 2 examples
    ids = KeyedJaggedTensor(keys=["clicks", "views", "shops"], values=torch.randint(0, 20, (14,)), lengths=lengths)
    out = model(ids)
    embedded = collection(ids)
    assert set(out) == {"clicks", "views", "shops"}
    for key, jt in out.items():
        assert type(jt) is JaggedTensor
        assert torch.equal(jt.lengths(), embedded[key].lengths())
    expected = encoder(embedded)
    for key in out:
        torch.testing.assert_close(out[key].values(), expected[key].values())
    sum(jt.values().sum() for jt in out.values()).backward()
    assert collection.embeddings["item_ids"].weight.grad.abs().sum() > 0


def test_sequence_encoder_passes_event_times():
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingCollection, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor

    from blockattn_layers import JaggedSequenceEncoder

    tables = [EmbeddingConfig(name="item_ids", embedding_dim=16, num_embeddings=30, feature_names=["clicks"])]
    collection = EmbeddingCollection(tables=tables)
    encoder = JaggedTransformerEncoder(JaggedTransformerEncoderLayer(16, 2, 32, 0.0, block_size=4, rope_theta=10.0), 1)
    model = JaggedSequenceEncoder(collection, encoder)
    lengths = torch.tensor([3, 2])
    ids = KeyedJaggedTensor(keys=["clicks"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=lengths)
    times = {"clicks": JaggedTensor(values=torch.tensor([0.0, 30.0, 95.0, 1.0, 7.0]), lengths=lengths)}
    out = model(ids, times, max_seqlen=3)
    torch.testing.assert_close(out["clicks"].values(), encoder(collection(ids), positions=times)["clicks"].values())
    assert not torch.allclose(out["clicks"].values(), model(ids)["clicks"].values())


def test_docstring_examples_run():
    from blockattn_layers import config, jagged
    from blockattn_layers.modules import convert, encoder

    for module in (jagged, attention_module, encoder, convert, config):
        result = doctest.testmod(module, raise_on_error=True)
        assert result.attempted > 0, module.__name__


def test_torchrec_docstring_example_runs():
    pytest.importorskip("torchrec")
    from blockattn_layers.modules import embedding

    assert doctest.testmod(embedding, raise_on_error=True).attempted > 0
