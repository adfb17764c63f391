"""Modules reject bad arguments at construction and bad input at the call, in the user's terms."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import (
    BlockSelfAttention, JaggedTransformerEncoder, JaggedTransformerEncoderLayer, RotaryBlockAttention,
    from_torch_encoder,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

E, H, T = 16, 2, 12
OFFSETS = torch.tensor([0, 5, 5, 12])
NAN, INF = float("nan"), float("inf")
INT_ARG = r" must be an int >= 1"

# ----------------------------------------------------------------------------- construction
ATTENTION_ARGS = {
    "embed_dim_0": (ValueError, r"^embed_dim must be >= 1, got 0", (0, H), {}),
    "embed_dim_float": (TypeError, r"^embed_dim" + INT_ARG, (16.0, H), {}),
    "embed_dim_bool": (TypeError, r"^embed_dim" + INT_ARG, (True, 1), {}),
    "num_heads_0": (ValueError, r"^num_heads must be >= 1, got 0", (E, 0), {}),
    "num_heads_neg": (ValueError, r"^num_heads must be >= 1, got -2", (E, -2), {}),
    "num_heads_str": (TypeError, r"^num_heads" + INT_ARG, (E, "2"), {}),
    "embed_dim_not_multiple": (ValueError, r"^embed_dim \(30\) must be a multiple of num_heads \(4\)", (30, 4), {}),
    "num_kv_heads_not_divisor": (ValueError, r"^num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
                                 (E, 4), dict(num_kv_heads=3)),
    "num_kv_heads_0": (ValueError, r"^num_kv_heads must be >= 1, got 0", (E, 4), dict(num_kv_heads=0)),
    "num_kv_heads_float": (TypeError, r"^num_kv_heads" + INT_ARG, (E, 4), dict(num_kv_heads=2.0)),
    "block_size_0": (ValueError, r"^block_size must be >= 1 or None, got 0", (E, H), dict(block_size=0)),
    "block_size_neg": (ValueError, r"^block_size must be >= 1 or None, got -1", (E, H), dict(block_size=-1)),
    "block_size_bool": (TypeError, r"^block_size must be an int >= 1 or None, got True", (E, H), dict(block_size=True)),
    "block_size_float": (TypeError, r"^block_size must be an int", (E, H), dict(block_size=2.5)),
    "block_size_str": (TypeError, r"^block_size must be an int", (E, H), dict(block_size="64")),
    "bias_int": (TypeError, r"^bias must be a bool, got 1", (E, H), dict(bias=1)),
    "causal_str": (TypeError, r"^causal must be a bool, got 'yes'", (E, H), dict(causal="yes")),
    "backend_unknown": (ValueError, r"^backend must be one of auto, .*reference.*; got 'nope'", (E, H),
                        dict(backend="nope")),
    "backend_type": (TypeError, r"^backend must be a string or Backend enum, got 3", (E, H), dict(backend=3)),
}
ROTARY_ARGS = {
    "rope_theta_neg": (ValueError, r"^rope_theta must be a positive finite number, got -1", dict(rope_theta=-1)),
    "rope_theta_0": (ValueError, r"^rope_theta must be a positive finite number, got 0", dict(rope_theta=0)),
    "rope_theta_nan": (ValueError, r"^rope_theta must be a positive finite number, got nan", dict(rope_theta=NAN)),
    "rope_theta_inf": (ValueError, r"^rope_theta must be a positive finite number, got inf", dict(rope_theta=INF)),
    "rope_theta_none": (TypeError, r"^rope_theta must be a positive finite number, got None", dict(rope_theta=None)),
    "rope_theta_str": (TypeError, r"^rope_theta must be a positive", dict(rope_theta="1e4")),
    "rotary_dim_odd": (ValueError, r"^rotary_dim must be even and in \[2, head_dim=8\], got 3", dict(rotary_dim=3)),
    "rotary_dim_big": (ValueError, r"^rotary_dim must be even and in \[2, head_dim=8\], got 10", dict(rotary_dim=10)),
    "rotary_dim_0": (ValueError, r"^rotary_dim must be even", dict(rotary_dim=0)),
    "rotary_dim_float": (TypeError, r"^rotary_dim must be an int, got 4\.0", dict(rotary_dim=4.0)),
    "interleaved_int": (TypeError, r"^rotary_interleaved must be a bool", dict(rotary_interleaved=1)),
}
LAYER_ARGS = {
    "d_model_0": (ValueError, r"^d_model must be >= 1, got 0", (0, H), {}),
    "d_model_float": (TypeError, r"^d_model" + INT_ARG, (16.0, H), {}),
    "nhead_0": (ValueError, r"^nhead must be >= 1, got 0", (E, 0), {}),
    "d_model_not_multiple": (ValueError, r"^d_model \(30\) must be a multiple of nhead \(4\)", (30, 4), {}),
    "num_kv_heads": (ValueError, r"^nhead \(4\) must be a multiple of num_kv_heads \(3\)", (E, 4),
                     dict(num_kv_heads=3)),
    "dim_feedforward_0": (ValueError, r"^dim_feedforward must be >= 1, got 0", (E, H, 0), {}),
    "dim_feedforward_float": (TypeError, r"^dim_feedforward" + INT_ARG, (E, H, 32.0), {}),
    "dropout_neg": (ValueError, r"^dropout must be a number in \[0, 1\], got -0\.1", (E, H), dict(dropout=-0.1)),
    "dropout_big": (ValueError, r"^dropout must be a number in \[0, 1\], got 1\.5", (E, H), dict(dropout=1.5)),
    "dropout_nan": (ValueError, r"^dropout must be a number in \[0, 1\], got nan", (E, H), dict(dropout=NAN)),
    "dropout_str": (TypeError, r"^dropout must be a number", (E, H), dict(dropout="0.1")),
    "activation_name": (ValueError, r"^activation must be one of \['relu', 'gelu'\] or a callable, got 'tanh'",
                        (E, H), dict(activation="tanh")),
    "activation_type": (TypeError, r"^activation must be one of .* or a callable, got 3", (E, H), dict(activation=3)),
    "layer_norm_eps_neg": (ValueError, r"^layer_norm_eps must be a finite number >= 0, got -1", (E, H),
                           dict(layer_norm_eps=-1)),
    "layer_norm_eps_inf": (ValueError, r"^layer_norm_eps must be a finite", (E, H), dict(layer_norm_eps=INF)),
    "layer_norm_eps_none": (TypeError, r"^layer_norm_eps must be a finite", (E, H), dict(layer_norm_eps=None)),
    "norm_first_str": (TypeError, r"^norm_first must be a bool", (E, H), dict(norm_first="yes")),
    "causal_int": (TypeError, r"^causal must be a bool", (E, H), dict(causal=1)),
    "bias_none": (TypeError, r"^bias must be a bool", (E, H), dict(bias=None)),
    "rope_theta_neg": (ValueError, r"^rope_theta must be a positive finite number or None, got -1", (E, H),
                       dict(rope_theta=-1)),
    "rope_theta_nan": (ValueError, r"^rope_theta must be a positive finite", (E, H), dict(rope_theta=NAN)),
    "block_size_0": (ValueError, r"^block_size must be >= 1 or None, got 0", (E, H), dict(block_size=0)),
    "block_size_bool": (TypeError, r"^block_size must be an int", (E, H), dict(block_size=False)),
    "backend": (ValueError, r"^backend must be one of", (E, H), dict(backend="cuda")),
}


@pytest.mark.parametrize("case", list(ATTENTION_ARGS))
@pytest.mark.parametrize("cls", [BlockSelfAttention, RotaryBlockAttention])
def test_attention_arguments(cls, case):
    exc, pattern, args, kwargs = ATTENTION_ARGS[case]
    with pytest.raises(exc, match=pattern):
        cls(*args, **kwargs)


@pytest.mark.parametrize("case", list(ROTARY_ARGS))
def test_rotary_arguments(case):
    exc, pattern, kwargs = ROTARY_ARGS[case]
    with pytest.raises(exc, match=pattern):
        RotaryBlockAttention(E, H, **kwargs)


@pytest.mark.parametrize("case", list(LAYER_ARGS))
def test_encoder_layer_arguments(case):
    exc, pattern, args, kwargs = LAYER_ARGS[case]
    with pytest.raises(exc, match=pattern):
        JaggedTransformerEncoderLayer(*args, **kwargs)


def test_encoder_arguments():
    layer = JaggedTransformerEncoderLayer(E, H, 32)
    with pytest.raises(ValueError, match=r"^num_layers must be >= 1, got 0"):
        JaggedTransformerEncoder(layer, 0)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match=r"^num_layers must be an int >= 1"):
            JaggedTransformerEncoder(layer, bad)
    with pytest.raises(TypeError, match=r"^encoder_layer must be an nn\.Module, got str"):
        JaggedTransformerEncoder("layer", 2)
    with pytest.raises(TypeError, match=r"^norm must be an nn\.Module or None, got int"):
        JaggedTransformerEncoder(layer, 2, norm=1)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(block_size=0), ValueError, r"^block_size must be >= 1 or None, got 0"),
    (dict(block_size=True), TypeError, r"^block_size must be an int"),
    (dict(backend="nope"), ValueError, r"^backend must be one of"),
])
def test_from_torch_encoder_arguments(kwargs, exc, pattern):
    layer = torch.nn.TransformerEncoderLayer(E, H, 32, batch_first=True)
    for module in (layer, torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)):
        with pytest.raises(exc, match=pattern):
            from_torch_encoder(module, **kwargs)


def test_accepted_arguments_are_normalized():
    attn = RotaryBlockAttention(np.int64(E), np.int64(H), block_size=np.int64(4), rope_theta=np.float32(100),
                                rotary_dim=np.int64(4), num_kv_heads=np.int64(1))
    assert type(attn.block_size) is int and type(attn.rope_theta) is float and type(attn.rotary_dim) is int
    assert (attn.embed_dim, attn.num_heads, attn.num_kv_heads, attn.head_dim) == (E, H, 1, 8)
    assert attn(torch.randn(T, E), OFFSETS).shape == (T, E)
    layer = JaggedTransformerEncoderLayer(E, H, 32, dropout=1, activation=torch.tanh, layer_norm_eps=0,
                                          block_size=None, backend="reference")
    assert layer(torch.randn(T, E), OFFSETS).shape == (T, E)


# ----------------------------------------------------------------------------- the call
def _modules():
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(E, H, 32, 0.0, block_size=4, rope_theta=100.0)
    return {
        "BlockSelfAttention": BlockSelfAttention(E, H, block_size=4),
        "RotaryBlockAttention": RotaryBlockAttention(E, H, block_size=4),
        "JaggedTransformerEncoderLayer": layer,
        "JaggedTransformerEncoderLayer-prenorm": JaggedTransformerEncoderLayer(E, H, 32, 0.0, norm_first=True),
        "JaggedTransformerEncoder": JaggedTransformerEncoder(layer, 2),
    }


MODULES = list(_modules())
WIDTH = r"\[T, (embed_dim|d_model)=16\]"
META = torch.device("meta")
INPUT_CASES = {
    "values_1d": (ValueError, r"^values must have shape " + WIDTH + r", got \(12,\)", (torch.randn(T), OFFSETS)),
    "values_wrong_width": (ValueError, r"^values must have shape " + WIDTH + r", got \(12, 8\)",
                           (torch.randn(T, 8), OFFSETS)),
    "values_padded": (ValueError, r"^values must be packed \[T, (E|embed_dim=16|d_model=16)\] with offsets \[B\+1\], "
                                  r"got a padded \[B, N, E\] tensor of shape \(3, 4, 16\): convert it with "
                                  r"blockattn_layers\.padded_to_jagged",
                      (torch.randn(3, 4, E), OFFSETS)),
    "values_ids": (TypeError, r"^values are torch\.int64: integer ids must be embedded first, e\.g\. by a torchrec "
                              r"EmbeddingCollection \(blockattn_layers\.JaggedSequenceEncoder",
                   (torch.randint(0, 9, (T,)), OFFSETS)),
    "values_int_2d": (TypeError, r"^values are torch\.int32: integer ids must be embedded first",
                      (torch.zeros(T, E, dtype=torch.int32), OFFSETS)),
    "values_bool": (TypeError, r"^values must be floating point, got torch\.bool",
                    (torch.zeros(T, E, dtype=torch.bool), OFFSETS)),
    "values_complex": (TypeError, r"^values must be floating point, got torch\.complex64",
                       (torch.zeros(T, E, dtype=torch.complex64), OFFSETS)),
    "values_dtype": (TypeError, r"^values are torch\.float64 but the module's parameters are torch\.float32: cast one "
                                r"to the other \(values\.to\(torch\.float32\) or module\.to\(torch\.float64\)\), or "
                                r"run under torch\.autocast",
                     (torch.randn(T, E, dtype=torch.float64), OFFSETS)),
    "offsets_list": (TypeError, r"^offsets must be a torch\.Tensor \[B\+1\] of int32 or int64, got list",
                     (torch.randn(T, E), [0, 5, 5, 12])),
    "offsets_float": (TypeError, r"^offsets must be int32 or int64, got torch\.float32",
                      (torch.randn(T, E), OFFSETS.float())),
    "offsets_2d": (ValueError, r"^offsets must be a 1-D tensor \[B\+1\], got shape \(1, 4\)",
                   (torch.randn(T, E), OFFSETS[None])),
    "offsets_empty": (ValueError, r"^offsets must be a 1-D tensor \[B\+1\], got shape \(0,\)",
                      (torch.randn(T, E), OFFSETS[:0])),
    "offsets_device": (ValueError, r"^offsets is on meta but values is on cpu", (torch.randn(T, E), OFFSETS.to(META))),
}


@pytest.mark.parametrize("case", list(INPUT_CASES))
@pytest.mark.parametrize("name", MODULES)
def test_bad_input(name, case):
    exc, pattern, args = INPUT_CASES[case]
    module = _modules()[name]
    with pytest.raises(exc, match=pattern):
        module(*args)


@pytest.mark.parametrize("name", MODULES)
def test_cpu_offsets_that_disagree_raise(name):
    module = _modules()[name]
    with pytest.raises(ValueError, match=r"^cpu_offsets must hold the same values as offsets, but cpu_offsets\[1\]"):
        module(torch.randn(T, E), OFFSETS, cpu_offsets=torch.tensor([0, 4, 4, 12]))


@pytest.mark.parametrize("name", MODULES)
def test_other_dtypes_run_under_autocast(name):
    module = _modules()[name]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(torch.randn(T, E, dtype=torch.bfloat16), OFFSETS)
    assert out.shape == (T, E) and out.dtype.is_floating_point


def test_torchrec_inputs_are_named():
    pytest.importorskip("torchrec")
    from torchrec import JaggedTensor, KeyedJaggedTensor

    encoder = _modules()["JaggedTransformerEncoder"]
    lengths = torch.tensor([3, 0, 4, 2])
    ids = KeyedJaggedTensor(keys=["clicks", "views"], values=torch.randint(0, 9, (9,)), lengths=lengths)
    with pytest.raises(TypeError, match=r"^the KeyedJaggedTensor's values are torch\.int64: integer ids must be "
                                        r"embedded first, e\.g\. by a torchrec EmbeddingCollection"):
        encoder(ids)
    jt = JaggedTensor(values=torch.randint(0, 9, (7,)), lengths=torch.tensor([3, 4]))
    for module in _modules().values():
        with pytest.raises(TypeError, match=r"^the JaggedTensor's values are torch\.int64: integer ids"):
            module(jt)
        narrow = {"a": JaggedTensor(values=torch.randn(7, 8), lengths=torch.tensor([3, 4]))}
        with pytest.raises(ValueError, match=r"^the JaggedTensors' values must have shape " + WIDTH):
            module(narrow)
        apart = JaggedTensor(values=torch.randn(7, E), lengths=torch.tensor([3, 4], device="meta"))
        with pytest.raises(ValueError, match=r"^the JaggedTensor's values are on cpu but their lengths / offsets on "
                                             r"meta: keep both on one device"):
            module(apart)


def test_checks_trace_under_compile():
    """The input checks read only shapes and dtypes: no graph break, and a bad input still says
    what is wrong (with fullgraph=True Dynamo wraps the error, its message kept)."""
    torch._dynamo.reset()
    layer = _modules()["JaggedTransformerEncoderLayer"]
    message = r"values must have shape \[T, d_model=16\], got \(12, (8|s\d+)\)"
    for fullgraph, exc in ((True, Exception), (False, ValueError)):
        compiled = torch.compile(layer, fullgraph=fullgraph, backend="eager")
        assert compiled(torch.randn(T, E), OFFSETS).shape == (T, E)
        with pytest.raises(exc, match=message):
            compiled(torch.randn(T, 8), OFFSETS)


def test_modules_take_the_validate_setting_of_block_attention(monkeypatch):
    """``validate`` reaches block_attention from the attention layers and the encoder layer (its
    offsets checks then run for device tensors too: here, the call's argument is recorded), is
    shown by ``extra_repr`` when set, and must be a bool or None."""
    import blockattn_layers.modules.attention as attention

    seen = []
    real = attention.block_attention
    monkeypatch.setattr(attention, "block_attention", lambda *a, **k: seen.append(k["validate"]) or real(*a, **k))
    layers = [BlockSelfAttention(E, H, validate=True), RotaryBlockAttention(E, H, validate=False),
              JaggedTransformerEncoderLayer(E, H, 32, validate=True), BlockSelfAttention(E, H)]
    for layer in layers:
        layer(torch.randn(T, E), OFFSETS)
    assert seen == [True, False, True, None]
    assert "validate=True" in repr(layers[0]) and "validate" not in layers[3].extra_repr()
    with pytest.raises(TypeError, match="^validate must be a bool, got 'yes'"):
        BlockSelfAttention(E, H, validate="yes")


def test_parameter_dtype_and_torchscript_are_refused_in_the_users_terms():
    """A non-float ``dtype`` is refused at construction (not by torch's parameter init), and
    TorchScript tracing by a message that names what to use instead."""
    for dtype in (torch.int64, torch.float8_e4m3fn, "float32"):
        with pytest.raises(TypeError, match="^dtype must be None or one of torch.float32"):
            BlockSelfAttention(E, H, dtype=dtype)
        with pytest.raises(TypeError, match="^dtype must be None or one of torch.float32"):
            JaggedTransformerEncoderLayer(E, H, 32, dtype=dtype)
    layer = BlockSelfAttention(E, H, block_size=4).eval()
    with pytest.raises(RuntimeError, match="does not run under TorchScript.*use torch.compile, or torch.export"):
        torch.jit.trace(layer, (torch.randn(T, E), OFFSETS))


def test_calls_that_would_lose_gradients_are_refused():
    """Positions that require grad (no gradient reaches them) and torch.func transforms (the op has
    no functorch rules) raise with what to do instead; positions under no_grad or detached run."""
    q = torch.randn(T, 2, 4, dtype=torch.float64, requires_grad=True)
    positions = (torch.rand(T, dtype=torch.float64) * 5).requires_grad_()
    with pytest.raises(ValueError, match=r"positions requires grad.*pass positions\.detach\(\)"):
        bl.block_attention(q, q, q, OFFSETS, 4, rope_theta=10.0, positions=positions)
    with pytest.raises(ValueError, match="positions requires grad"):
        RotaryBlockAttention(E, H, block_size=4)(torch.randn(T, E), OFFSETS, positions=positions)
    with torch.no_grad():
        bl.block_attention(q, q, q, OFFSETS, 4, rope_theta=10.0, positions=positions)
    bl.block_attention(q, q, q, OFFSETS, 4, rope_theta=10.0, positions=positions.detach()).sum().backward()
    with pytest.raises(RuntimeError, match="does not run under torch.func transforms.*loss.backward"):
        torch.func.grad(lambda x: bl.block_attention(x, x, x, OFFSETS, 4, backend="reference").sum())(q.detach())


def test_offset_values_are_checked_inside_compiled_and_validated_exported_graphs():
    """Offsets that do not start at 0, decrease or end short of T: under torch.compile on CPU (as
    eagerly) and under torch.export with validate=True, an assert inside the graph raises when it
    runs; an export without validate=True (it may be served on a GPU) has none."""
    torch._dynamo.reset()
    q = torch.randn(13, 2, 8)
    good = torch.tensor([0, 5, 13])
    compiled = torch.compile(lambda o: bl.block_attention(q, q, q, o, 4), fullgraph=True)
    assert compiled(good).shape == q.shape
    for bad in ([0, 5, 12], [0, 14, 13], [1, 5, 13]):  # ends short of T, decreases, starts past 0
        with pytest.raises(RuntimeError, match="offsets must start at 0, never decrease and end at T"):
            compiled(torch.tensor(bad))

    class Attend(torch.nn.Module):
        def __init__(self, validate):
            super().__init__()
            self.validate = validate

        def forward(self, q, offsets):
            return bl.block_attention(q, q, q, offsets, 4, validate=self.validate)

    checked = torch.export.export(Attend(True), (q, good)).module()
    unchecked = torch.export.export(Attend(None), (q, good)).module()
    torch.testing.assert_close(checked(q, good), unchecked(q, good))
    with pytest.raises(RuntimeError, match="offsets must start at 0"):
        checked(q, torch.tensor([0, 14, 13]))
    assert unchecked(q, torch.tensor([0, 6, 13])).shape == q.shape


def test_encoder_leaves_the_dtype_check_to_each_layer():
    """A layer's parameters may take their dtype in its own forward (FSDP2's param_dtype does, in a
    pre-forward hook): the stack checks the width only, each layer its own dtype."""
    def cast_parameters(module, args):
        module.to(torch.float64)

    encoder = JaggedTransformerEncoder(JaggedTransformerEncoderLayer(E, H, 32, 0.0, block_size=4), 2)
    for layer in encoder.layers:
        layer.register_forward_pre_hook(cast_parameters)
    assert encoder(torch.randn(T, E, dtype=torch.float64), OFFSETS).dtype == torch.float64
