"""Every bad argument of ``block_attention`` raises ValueError/TypeError naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import blockattn_layers.dispatch as dispatch
from blockattn_layers import BackendSpec, block_attention, jagged_attention
from blockattn_layers._validation import validate_attention_args
from tests.oracle import make_jagged

T, H, H_KV, D = 12, 4, 2, 8
LENGTHS = [5, 0, 7]


def inputs(dtype=torch.float64):
    q, k, v, offsets = make_jagged(LENGTHS, H, H_KV, D, dtype, 0)
    return dict(q=q, k=k, v=v, offsets=offsets)


def call(**over):
    args = inputs()
    args.update(over)
    q, k, v, offsets = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("offsets")
    block_size = args.pop("block_size", 4)
    return block_attention(q, k, v, offsets, block_size, backend=args.pop("backend", "reference"), **args)


def expect(exc, pattern, **over):
    with pytest.raises(exc, match=pattern):
        call(**over)


def test_valid_call_passes():
    assert call().shape == (T, H, D)


# ----------------------------------------------------------------------------- tensors
_q, _k, _v, _o = make_jagged(LENGTHS, H, H_KV, D, torch.float64, 0)
META = torch.device("meta")

TENSOR_CASES = {
    "q_not_tensor": (TypeError, r"^q must be a torch\.Tensor", dict(q=_q.tolist())),
    "k_not_tensor": (TypeError, r"^k must be a torch\.Tensor", dict(k=None)),
    "v_not_tensor": (TypeError, r"^v must be a torch\.Tensor", dict(v=np.zeros((T, H_KV, D)))),
    "offsets_not_tensor": (TypeError, r"^offsets must be a torch\.Tensor", dict(offsets=[0, 5, 5, 12])),
    "q_ndim_2": (ValueError, r"^q must have shape \[T, heads, head_dim\]", dict(q=_q[:, 0])),
    "q_ndim_4": (ValueError, r"^q must have shape", dict(q=_q[None])),
    "k_ndim": (ValueError, r"^k must have shape", dict(k=_k.flatten(1))),
    "v_ndim": (ValueError, r"^v must have shape", dict(v=_v[..., None])),
    "q_int_dtype": (TypeError, r"^q must be float64/float32/float16/bfloat16, got torch\.int64",
                    dict(q=_q.long())),
    "q_complex": (TypeError, r"^q must be float", dict(q=_q.to(torch.complex128))),
    "k_dtype_mismatch": (TypeError, r"^k dtype torch\.float32 must match q dtype torch\.float64",
                         dict(k=_k.float(), v=_v.float())),
    "v_dtype_mismatch": (TypeError, r"^v dtype torch\.float16 must match q", dict(v=_v.half())),
    "kv_shape_mismatch": (ValueError, r"^k and v must have the same shape", dict(v=_v[:, :1])),
    "head_dim_mismatch": (ValueError, r"^k must have shape \[T=12, H_kv, D=8\]",
                          dict(k=_k[..., :4], v=_v[..., :4])),
    "T_mismatch": (ValueError, r"^k must have shape \[T=12", dict(k=_k[:11], v=_v[:11])),
    "heads_not_multiple": (ValueError, r"q heads \(4\) must be a positive multiple of k/v heads \(3\)",
                           dict(k=torch.zeros(T, 3, D, dtype=torch.float64),
                                v=torch.zeros(T, 3, D, dtype=torch.float64))),
    "zero_kv_heads": (ValueError, r"k/v heads \(0\)", dict(k=_k[:, :0], v=_v[:, :0])),
    "zero_head_dim": (ValueError, r"^head_dim", dict(q=_q[..., :0], k=_k[..., :0], v=_v[..., :0])),
    "k_device": (ValueError, r"^k is on meta but q is on cpu", dict(k=_k.to(META))),
    "v_device": (ValueError, r"^v is on meta but q is on cpu", dict(v=_v.to(META))),
    "offsets_device": (ValueError, r"^offsets is on meta but q is on cpu", dict(offsets=_o.to(META))),
    "offsets_2d": (ValueError, r"^offsets must be a 1-D tensor \[B\+1\], got shape \(1, 4\)",
                   dict(offsets=_o[None])),
    "offsets_empty": (ValueError, r"^offsets must be a 1-D tensor", dict(offsets=_o[:0])),
    "offsets_scalar": (ValueError, r"^offsets must be a 1-D tensor", dict(offsets=_o[0])),
    "offsets_float": (TypeError, r"^offsets must be int32 or int64, got torch\.float32", dict(offsets=_o.float())),
    "offsets_int16": (TypeError, r"^offsets must be int32 or int64", dict(offsets=_o.short())),
    "offsets_bool": (TypeError, r"^offsets must be int32 or int64", dict(offsets=_o.bool())),
    "offsets_first": (ValueError, r"^offsets\[0\] must be 0, got 1", dict(offsets=torch.tensor([1, 5, 5, 12]))),
    "offsets_decreasing": (ValueError, r"^offsets must be non-decreasing, but offsets\[2\] = 4 < offsets\[1\] = 5",
                           dict(offsets=torch.tensor([0, 5, 4, 12]))),
    "offsets_last_short": (ValueError, r"^offsets\[-1\] must equal T = 12 \(q\.shape\[0\]; a module's: its input's rows\), got 11",
                           dict(offsets=torch.tensor([0, 5, 5, 11], dtype=torch.int32))),
    "offsets_last_long": (ValueError, r"^offsets\[-1\] must equal T = 12", dict(offsets=torch.tensor([0, 13]))),
    "offsets_only_nonzero": (ValueError, r"^offsets\[0\] must be 0", dict(offsets=torch.tensor([12]))),
    "offsets_B0_nonempty_T": (ValueError, r"^offsets\[-1\] must equal T = 12 \(q\.shape\[0\]; a module's: its input's rows\), got 0",
                              dict(offsets=torch.tensor([0]))),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_bad_tensors(case):
    exc, pattern, over = TENSOR_CASES[case]
    expect(exc, pattern, **over)


@pytest.mark.parametrize("case", ["offsets_first", "offsets_decreasing", "offsets_last_short", "offsets_last_long"])
def test_bad_offsets_with_validate_true(case):
    exc, pattern, over = TENSOR_CASES[case]
    expect(exc, pattern, validate=True, **over)


def test_validate_false_skips_value_checks():
    """validate=False trusts the caller: the value checks (which need host data) do not run."""
    a = inputs()
    bad = torch.tensor([0, 5, 4, 12])
    params = validate_attention_args(
        a["q"], a["k"], a["v"], bad, 4, scale=None, causal=False, rope_theta=None, positions=None,
        rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=3, validate=False)
    assert params.block_size == 4 and params.max_seqlen == 3
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_attention_args(
            a["q"], a["k"], a["v"], bad, 4, scale=None, causal=False, rope_theta=None, positions=None,
            rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=None, validate=None)


def test_device_offsets_values_not_read_by_default():
    """On a non-CPU device (meta here) validate=None must not read offset values (no host sync)."""
    q, k = torch.empty(T, H, D, device=META), torch.empty(T, H_KV, D, device=META)
    offsets = torch.empty(4, dtype=torch.int64, device=META)
    assert block_attention(q, k, k, offsets, 4).shape == (T, H, D)  # would fail if values were read
    with pytest.raises((NotImplementedError, RuntimeError)):
        block_attention(q, k, k, offsets, 4, validate=True)  # asked to: it must try to read them


def test_int32_offsets_too_small_for_T():
    q = torch.empty(2 ** 31, 1, 1, device=META)
    offsets = torch.empty(2, dtype=torch.int32, device=META)
    with pytest.raises(ValueError, match=r"^offsets must be int64 when T"):
        block_attention(q, q, q, offsets, 4)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_validate(value):
    if value is None:
        assert call(validate=value).shape == (T, H, D)
    else:
        expect(TypeError, r"^validate must be a bool or None", validate=value)


# ----------------------------------------------------------------------------- scalars
SCALAR_CASES = {
    "block_size_0": (ValueError, r"^block_size must be >= 1 or None, got 0", dict(block_size=0)),
    "block_size_neg": (ValueError, r"^block_size must be >= 1", dict(block_size=-1)),
    "block_size_float": (TypeError, r"^block_size must be an int >= 1 or None, got 2\.5", dict(block_size=2.5)),
    "block_size_float_integral": (TypeError, r"^block_size must be an int", dict(block_size=16.0)),
    "block_size_bool": (TypeError, r"^block_size must be an int", dict(block_size=True)),
    "block_size_str": (TypeError, r"^block_size must be an int", dict(block_size="16")),
    "block_size_tensor": (TypeError, r"^block_size must be an int", dict(block_size=torch.tensor(16))),
    "scale_nan": (ValueError, r"^scale must be a finite real number or None, got nan", dict(scale=float("nan"))),
    "scale_inf": (ValueError, r"^scale must be a finite real", dict(scale=float("inf"))),
    "scale_str": (TypeError, r"^scale must be a finite real", dict(scale="0.5")),
    "scale_bool": (TypeError, r"^scale must be a finite real", dict(scale=True)),
    "scale_complex": (TypeError, r"^scale must be a finite real", dict(scale=1j)),
    "causal_int": (TypeError, r"^causal must be a bool, got 1", dict(causal=1)),
    "causal_str": (TypeError, r"^causal must be a bool", dict(causal="True")),
    "causal_none": (TypeError, r"^causal must be a bool", dict(causal=None)),
    "interleaved_int": (TypeError, r"^rotary_interleaved must be a bool", dict(rope_theta=1.0, rotary_interleaved=1)),
    "rope_theta_zero": (ValueError, r"^rope_theta must be a positive finite number or None, got 0",
                        dict(rope_theta=0)),
    "rope_theta_neg": (ValueError, r"^rope_theta must be a positive", dict(rope_theta=-10000.0)),
    "rope_theta_nan": (ValueError, r"^rope_theta must be a positive", dict(rope_theta=float("nan"))),
    "rope_theta_inf": (ValueError, r"^rope_theta must be a positive", dict(rope_theta=float("inf"))),
    "rope_theta_str": (TypeError, r"^rope_theta must be a positive", dict(rope_theta="10000")),
    "rope_theta_bool": (TypeError, r"^rope_theta must be a positive", dict(rope_theta=True)),
    "rotary_dim_odd": (ValueError, r"^rotary_dim must be even and in \[2, head_dim=8\], got 3",
                       dict(rope_theta=1e4, rotary_dim=3)),
    "rotary_dim_too_big": (ValueError, r"^rotary_dim must be even and in \[2, head_dim=8\], got 10",
                           dict(rope_theta=1e4, rotary_dim=10)),
    "rotary_dim_zero": (ValueError, r"^rotary_dim must be even", dict(rope_theta=1e4, rotary_dim=0)),
    "rotary_dim_neg": (ValueError, r"^rotary_dim must be even", dict(rope_theta=1e4, rotary_dim=-2)),
    "rotary_dim_float": (TypeError, r"^rotary_dim must be an int", dict(rope_theta=1e4, rotary_dim=4.0)),
    "rotary_dim_bool": (TypeError, r"^rotary_dim must be an int", dict(rope_theta=1e4, rotary_dim=True)),
    "rotary_dim_without_theta": (ValueError, r"^rotary_dim is only used with rotary embeddings: pass rope_theta",
                                 dict(rotary_dim=4)),
    "positions_without_theta": (ValueError, r"^positions is only used with rotary embeddings: pass rope_theta",
                                dict(positions=torch.arange(T))),
    "interleaved_without_theta": (ValueError,
                                  r"^rotary_interleaved is only used with rotary embeddings: pass rope_theta",
                                  dict(rotary_interleaved=True)),
    "positions_not_tensor": (TypeError, r"^positions must be a torch\.Tensor",
                             dict(rope_theta=1e4, positions=list(range(T)))),
    "positions_long": (ValueError, r"^positions must have shape \[T=12\], got \(13,\)",
                       dict(rope_theta=1e4, positions=torch.arange(T + 1))),
    "positions_2d": (ValueError, r"^positions must have shape \[T=12\], got \(12, 1\)",
                     dict(rope_theta=1e4, positions=torch.arange(T)[:, None])),
    "positions_scalar": (ValueError, r"^positions must have shape", dict(rope_theta=1e4, positions=torch.tensor(3))),
    "positions_bool": (TypeError, r"^positions must be an integer or float tensor, got torch\.bool",
                       dict(rope_theta=1e4, positions=torch.ones(T, dtype=torch.bool))),
    "positions_complex": (TypeError, r"^positions must be an integer or float tensor",
                          dict(rope_theta=1e4, positions=torch.ones(T, dtype=torch.complex64))),
    "positions_device": (ValueError, r"^positions is on meta but q is on cpu",
                         dict(rope_theta=1e4, positions=torch.arange(T, device=META))),
    "cpu_offsets_not_tensor": (TypeError, r"^cpu_offsets must be a torch\.Tensor", dict(cpu_offsets=[0, 5, 5, 12])),
    "cpu_offsets_device": (ValueError, r"^cpu_offsets must be a CPU tensor, got device meta",
                           dict(cpu_offsets=_o.to(META))),
    "cpu_offsets_dtype": (TypeError, r"^cpu_offsets must be int32 or int64", dict(cpu_offsets=_o.double())),
    "cpu_offsets_shape": (ValueError, r"^cpu_offsets must have the shape of offsets \(4,\), got \(3,\)",
                          dict(cpu_offsets=torch.tensor([0, 5, 12]))),
    "cpu_offsets_decreasing": (ValueError, r"^cpu_offsets must be non-decreasing",
                               dict(cpu_offsets=torch.tensor([0, 6, 5, 12]))),
    "cpu_offsets_last": (ValueError, r"^cpu_offsets\[-1\] must equal T = 12", dict(cpu_offsets=torch.tensor([0, 5, 5, 10]))),
    "cpu_offsets_first": (ValueError, r"^cpu_offsets\[0\] must be 0", dict(cpu_offsets=torch.tensor([2, 5, 5, 12]))),
    "cpu_offsets_mismatch_validate": (ValueError, r"^cpu_offsets must hold the same values as offsets",
                                      dict(cpu_offsets=torch.tensor([0, 6, 6, 12]), validate=True)),
    "max_seqlen_neg": (ValueError, r"^max_seqlen must be >= 0 or None, got -1", dict(max_seqlen=-1)),
    "max_seqlen_float": (TypeError, r"^max_seqlen must be an int", dict(max_seqlen=7.0)),
    "max_seqlen_str": (TypeError, r"^max_seqlen must be an int", dict(max_seqlen="7")),
    "max_seqlen_bool": (TypeError, r"^max_seqlen must be an int", dict(max_seqlen=True)),
    "max_seqlen_short": (ValueError, r"^max_seqlen \(6\) is below the longest sequence \(7\)", dict(max_seqlen=6)),
    "max_seqlen_short_cpu_offsets": (ValueError, r"^max_seqlen \(6\) is below the longest sequence \(7\)",
                                     dict(max_seqlen=6, cpu_offsets=_o.int())),
    "max_seqlen_short_full": (ValueError, r"^max_seqlen \(0\) is below the longest sequence \(7\)",
                              dict(max_seqlen=0, block_size=None)),
    "backend_unknown": (ValueError, r"^backend must be one of auto, .*reference.*; got 'no_such_backend'",
                        dict(backend="no_such_backend")),
    "backend_type": (TypeError, r"^backend must be a string or Backend enum, got 3", dict(backend=3)),
    "backend_none": (TypeError, r"^backend must be a string or Backend enum", dict(backend=None)),
}


@pytest.mark.parametrize("case", list(SCALAR_CASES))
def test_bad_scalars(case):
    exc, pattern, over = SCALAR_CASES[case]
    expect(exc, pattern, **over)


@pytest.mark.parametrize("over", [
    dict(block_size=np.int64(4)), dict(block_size=None), dict(block_size=10 ** 6), dict(block_size=1),
    dict(scale=1), dict(scale=np.float32(0.5)), dict(scale=-0.25), dict(scale=0.0),
    dict(rope_theta=1), dict(rope_theta=np.float64(500.0), rotary_dim=np.int64(2)),
    dict(rope_theta=1e4, rotary_dim=D, rotary_interleaved=True),
    dict(rope_theta=1e4, positions=torch.arange(T, dtype=torch.int32)),
    dict(rope_theta=1e4, positions=torch.arange(T, dtype=torch.float16)),
    dict(rope_theta=1e4, positions=torch.arange(T, dtype=torch.uint8)),
    dict(max_seqlen=7), dict(max_seqlen=np.int32(100)), dict(cpu_offsets=_o.int(), max_seqlen=7, validate=True),
    dict(backend="auto"), dict(validate=False),
])
def test_accepted_edge_values(over):
    assert call(**over).shape == (T, H, D)


@pytest.mark.parametrize("validate", [None, True])
def test_cpu_offsets_that_disagree_with_cpu_offsets_raise(validate):
    """Both on the CPU, comparing them costs no sync: a wrong host copy is never used silently."""
    expect(ValueError, r"^cpu_offsets must hold the same values as offsets, but cpu_offsets\[1\] = 6 and "
           r"offsets\[1\] = 5", cpu_offsets=torch.tensor([0, 6, 6, 12]), validate=validate)
    assert call(cpu_offsets=_o.int(), validate=validate).shape == (T, H, D)


def test_cpu_offsets_of_device_offsets_not_compared_by_default():
    """Comparing with offsets on a device would cost a sync: only validate=True does it."""
    q, k = torch.empty(T, H, D, device=META), torch.empty(T, H_KV, D, device=META)
    offsets = torch.empty(4, dtype=torch.int64, device=META)
    assert block_attention(q, k, k, offsets, 4, cpu_offsets=_o).shape == (T, H, D)


def test_cpu_offsets_value_checks_can_be_skipped():
    """validate=False skips the value checks of cpu_offsets too."""
    a = inputs()
    params = validate_attention_args(
        a["q"], a["k"], a["v"], a["offsets"], 4, scale=None, causal=False, rope_theta=None, positions=None,
        rotary_dim=None, rotary_interleaved=False, cpu_offsets=torch.tensor([0, 6, 5, 12]), max_seqlen=None,
        validate=False)
    assert params.cpu_offsets is not None


def test_normalized_params():
    a = inputs()
    p = validate_attention_args(
        a["q"], a["k"], a["v"], a["offsets"], np.int64(4), scale=None, causal=True, rope_theta=10,
        positions=None, rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=np.int64(7),
        validate=None)
    assert p.block_size == 4 and type(p.block_size) is int
    assert p.scale == pytest.approx(D ** -0.5) and type(p.scale) is float
    assert p.rope_theta == 10.0 and type(p.rope_theta) is float
    assert p.rotary_dim == D and p.rotary and p.max_seqlen == 7 and type(p.max_seqlen) is int
    assert p.block_arg == 4
    p = validate_attention_args(
        a["q"], a["k"], a["v"], a["offsets"], None, scale=0.5, causal=False, rope_theta=None,
        positions=None, rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=None,
        validate=None)
    assert p.block_arg == 0 and p.rotary_dim == 0 and not p.rotary and p.scale == 0.5


def test_jagged_attention_rejects_block_size():
    a = inputs()
    with pytest.raises(TypeError, match=r"jagged_attention\(\) takes no block_size"):
        jagged_attention(a["q"], a["k"], a["v"], a["offsets"], block_size=4)
    with pytest.raises(ValueError, match=r"^offsets\[-1\] must equal T"):
        jagged_attention(a["q"], a["k"], a["v"], torch.tensor([0, 3]))


# ----------------------------------------------------------------------------- explicit backends
def _fake_spec(name, **kw):
    def run(*args):  # pragma: no cover - must never be reached here
        raise AssertionError("an incapable backend was run")

    fields = dict(name=name, forward=run, backward=run, priority=-5, devices=lambda: frozenset({"cuda"}),
                  auto_devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
                  head_dims=(16, 256), max_block_size=128, full_attention=False, causal=False, rotary=False)
    fields.update(kw)
    return BackendSpec(**fields)


def test_explicit_incapable_backend_lists_reasons(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    monkeypatch.setattr(dispatch, "_BY_PRIORITY", list(dispatch._BY_PRIORITY))
    monkeypatch.setattr(dispatch, "_SELECTED", {})
    dispatch.register_backend(_fake_spec("fake_gpu"))
    with pytest.raises(ValueError) as info:
        call(backend="fake_gpu", block_size=None, causal=True, rope_theta=1e4)
    msg = str(info.value)
    assert msg.startswith("backend='fake_gpu' cannot serve this call: ")
    for reason in ("device type 'cpu' not in ['cuda']", "dtype torch.float64 not supported",
                   "head_dim 8 outside [16, 256]", "full attention (block_size=None) not supported",
                   "causal not supported", "rotary embeddings not supported"):
        assert reason in msg, reason
    assert "reference: ok" in msg  # it also says which backend could serve the call
    with pytest.raises(ValueError, match=r"block_size 200 above 128"):
        call(backend="fake_gpu", block_size=200)
    # auto never picks it on CPU, and it is gone after the test (monkeypatch restores the registry)
    assert call(backend="auto").shape == (T, H, D)


def test_registry_restored_after_monkeypatch():
    assert "fake_gpu" not in dispatch._REGISTRY
    expect(ValueError, r"^backend must be one of .*got 'fake_gpu'", backend="fake_gpu")
