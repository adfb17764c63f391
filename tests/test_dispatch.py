"""The backend registry: declared capabilities, reasons, selection, explicit overrides."""
from __future__ import annotations

import dataclasses
import enum

import pytest
import torch

import blockattn_layers
import blockattn_layers.dispatch as dispatch
from blockattn_layers import Backend, BackendSpec, block_attention, explain, registered_backends
from blockattn_layers._validation import validate_attention_args
from blockattn_layers.dispatch import AttentionRequest, register_backend, select_backend
from tests.oracle import make_jagged

HALF = frozenset({torch.float16, torch.bfloat16})
ALL_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry for the test; the real one is restored afterwards."""
    reg = dict(dispatch._REGISTRY)
    monkeypatch.setattr(dispatch, "_REGISTRY", reg)
    monkeypatch.setattr(dispatch, "_BY_PRIORITY", list(dispatch._BY_PRIORITY))
    monkeypatch.setattr(dispatch, "_SELECTED", {})
    return reg


def request(device_type="cpu", capability=None, dtype=torch.float32, head_dim=64, num_heads=4,
            num_kv_heads=2, block_size=64, causal=False, rotary=False):
    return AttentionRequest(device_type=device_type, capability=capability, dtype=dtype, head_dim=head_dim,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
                            causal=causal, rotary=rotary)


class Recorder:
    """A backend forward that records its calls and returns a recognisable output."""

    def __init__(self, fill):
        self.fill, self.calls = fill, 0

    def __call__(self, q, k, v, offsets, *op_args):
        self.calls += 1
        return torch.full_like(q, self.fill), None


def _no_backward(*args):  # pragma: no cover - the dispatch tests never differentiate
    raise AssertionError("backward was not expected")


def spec(name, run=None, priority=10, devices=None, auto_devices=None, dtypes=ALL_FLOATS, **kw):
    return BackendSpec(name=name, forward=run or Recorder(1.0), backward=_no_backward, priority=priority,
                       devices=None if devices is None else (lambda: frozenset(devices)),
                       auto_devices=None if auto_devices is None else frozenset(auto_devices),
                       dtypes=frozenset(dtypes), **kw)


def call(block_size=16, dtype=torch.float32, D=16, **kw):
    q, k, v, offsets = make_jagged([5, 0, 20], 4, 2, D, dtype, 0)
    return block_attention(q, k, v, offsets, block_size, **kw)


# ----------------------------------------------------------------------------- the real registry
def test_reference_is_registered():
    names = [s.name for s in registered_backends()]
    assert "reference" in names
    ref = dispatch._REGISTRY["reference"]
    assert ref.devices is None and ref.auto_devices is None and ref.dtypes == ALL_FLOATS


@pytest.mark.parametrize("dtype", sorted(ALL_FLOATS, key=str), ids=str)
@pytest.mark.parametrize("block_size,causal,rotary", [(64, False, False), (None, True, True), (1000, True, False)])
def test_auto_picks_reference_on_cpu(dtype, block_size, causal, rotary):
    req = request(dtype=dtype, block_size=block_size, causal=causal, rotary=rotary, head_dim=24)
    assert select_backend("auto", req).name == "reference"
    assert select_backend(Backend.AUTO, req).name == "reference"
    assert explain(req)["reference"] == []


def test_request_from_call():
    q, k, v, offsets = make_jagged([5, 7], 6, 3, 8, torch.float16, 0)
    params = validate_attention_args(q, k, v, offsets, None, scale=None, causal=True, rope_theta=1e4,
                                     positions=None, rotary_dim=None, rotary_interleaved=False,
                                     cpu_offsets=None, max_seqlen=None, validate=None)
    req = AttentionRequest.from_call(q, k, params)
    assert req == dataclasses.replace(
        request(dtype=torch.float16, head_dim=8, num_heads=6, num_kv_heads=3, block_size=None, causal=True,
                rotary=True), rotary_dim=8)


@pytest.mark.parametrize("name", ["reference", Backend.REFERENCE])
def test_backend_names_and_enum(name):
    assert select_backend(name, request()).name == "reference"
    out = call(backend=name)
    torch.testing.assert_close(out, call(backend="auto"), rtol=0, atol=0)


def test_backend_enum_values():
    assert Backend("auto") is Backend.AUTO and Backend.REFERENCE == "reference" and Backend.TRITON.value == "triton"

    class Other(enum.Enum):  # any Enum whose value is a backend name is accepted
        REF = "reference"

    assert select_backend(Other.REF, request()).name == "reference"


def test_unknown_backend_message_lists_known_names():
    with pytest.raises(ValueError) as info:
        select_backend("nope", request())
    msg = str(info.value)
    assert "'nope'" in msg and "auto" in msg
    for s in registered_backends():
        assert s.name in msg


# ----------------------------------------------------------------------------- declared capabilities
@pytest.mark.parametrize("field,value,req_kw,reason", [
    ("devices", {"cuda"}, {}, "device type 'cpu' not in ['cuda']"),
    ("dtypes", HALF, dict(dtype=torch.float32), "dtype torch.float32 not supported"),
    ("head_dims", (16, 128), dict(head_dim=8), "head_dim 8 outside [16, 128]"),
    ("head_dims", (16, 128), dict(head_dim=256), "head_dim 256 outside [16, 128]"),
    ("max_block_size", 128, dict(block_size=129), "block_size 129 above 128"),
    ("full_attention", False, dict(block_size=None), "full attention (block_size=None) not supported"),
    ("causal", False, dict(causal=True), "causal not supported"),
    ("rotary", False, dict(rotary=True), "rotary embeddings not supported"),
    ("min_capability", (9, 0), dict(device_type="cuda", capability=(8, 0)), "compute capability (8, 0) below (9, 0)"),
])
def test_each_declared_capability_refuses(field, value, req_kw, reason):
    kw = {field: value}
    if field == "devices":
        s = spec("x", devices=value)
    elif field == "dtypes":
        s = spec("x", dtypes=value)
    else:
        s = spec("x", **kw)
    assert s.not_supported_reasons(request(**req_kw)) == [reason]
    # the same spec serves a request without that feature
    assert spec("y", devices={"cpu", "cuda"}, dtypes=ALL_FLOATS).not_supported_reasons(request(**req_kw)) == []


def test_capability_limits_are_inclusive():
    s = spec("x", head_dims=(16, 128), max_block_size=128, min_capability=(9, 0), devices={"cuda"})
    assert s.not_supported_reasons(request(device_type="cuda", capability=(9, 0), head_dim=16, block_size=128)) == []
    assert s.not_supported_reasons(request(device_type="cuda", capability=(10, 0), head_dim=128)) == []
    # min_capability only applies to CUDA requests with a known capability
    assert spec("y", min_capability=(9, 0)).not_supported_reasons(request(device_type="cpu")) == []


def test_reasons_accumulate_and_extra_reasons():
    s = spec("x", devices={"cuda"}, dtypes=HALF, causal=False,
             extra_reasons=lambda r: [] if r.head_dim % 16 == 0 else [f"head_dim {r.head_dim} not a multiple of 16"])
    reasons = s.not_supported_reasons(request(dtype=torch.float64, head_dim=24, causal=True))
    assert reasons == ["device type 'cpu' not in ['cuda']", "dtype torch.float64 not supported",
                       "causal not supported", "head_dim 24 not a multiple of 16"]


def test_explain_lists_every_backend(registry):
    register_backend(spec("gpu_only", devices={"cuda"}, dtypes=HALF))
    reasons = explain(request(dtype=torch.float32))
    assert list(reasons) == [s.name for s in registered_backends()]
    assert reasons["reference"] == []
    assert reasons["gpu_only"] == ["device type 'cpu' not in ['cuda']", "dtype torch.float32 not supported"]


# ----------------------------------------------------------------------------- selection
def test_auto_prefers_higher_priority_capable_backend(registry):
    fast = Recorder(7.0)
    register_backend(spec("fast", run=fast, priority=50, dtypes={torch.float32}, head_dims=(16, 64),
                          max_block_size=64, full_attention=False, causal=False, rotary=False))
    out = call(block_size=16)
    assert fast.calls == 1 and bool((out == 7.0).all())
    assert [s.name for s in registered_backends()][0] == "fast"
    # every unsupported feature falls back to the next capable backend (the reference)
    for kw in (dict(dtype=torch.float64), dict(D=8), dict(block_size=65), dict(block_size=None),
               dict(causal=True), dict(rope_theta=1e4)):
        out = call(**{"block_size": 16, **kw})
        assert fast.calls == 1, kw
        assert not bool((out == 7.0).all()), kw


def test_priority_order_between_capable_backends(registry):
    low, high = Recorder(1.0), Recorder(2.0)
    register_backend(spec("low", run=low, priority=5))
    register_backend(spec("high", run=high, priority=6))
    assert select_backend("auto", request()).name == "high"
    assert select_backend("low", request()).name == "low"  # explicit wins over priority
    call(backend="low")
    assert (low.calls, high.calls) == (1, 0)


def test_auto_devices_limit_auto_but_not_explicit(registry):
    run = Recorder(3.0)
    register_backend(spec("cuda_auto", run=run, priority=100, auto_devices={"cuda"}))
    assert select_backend("auto", request()).name == "reference"
    assert select_backend("cuda_auto", request()).name == "cuda_auto"
    assert bool((call(backend="cuda_auto") == 3.0).all()) and run.calls == 1


def test_explicit_incapable_backend_raises_with_reasons(registry):
    register_backend(spec("picky", priority=100, dtypes=HALF, causal=False))
    with pytest.raises(ValueError) as info:
        select_backend("picky", request(dtype=torch.float32, causal=True))
    msg = str(info.value)
    assert msg.startswith("backend='picky' cannot serve this call: dtype torch.float32 not supported, "
                          "causal not supported.")
    assert "All backends:" in msg and "reference: ok" in msg
    # auto silently falls back
    assert select_backend("auto", request(dtype=torch.float32, causal=True)).name == "reference"


def test_auto_with_no_capable_backend_raises(registry):
    registry.clear()
    register_backend(spec("only", devices={"cuda"}))
    with pytest.raises(ValueError) as info:
        select_backend("auto", request())
    assert "backend='auto': no backend serves this call" in str(info.value)
    assert "only: device type 'cpu' not in ['cuda']" in str(info.value)


def test_register_replaces_same_name(registry):
    register_backend(spec("dup", priority=1))
    register_backend(spec("dup", priority=2, dtypes=HALF))
    assert [s for s in registered_backends() if s.name == "dup"][0].priority == 2
    assert sum(s.name == "dup" for s in registered_backends()) == 1


def test_devices_callable_and_meta_device(registry):
    register_backend(spec("cpu_only", priority=100, devices={"cpu"}, auto_devices={"cpu"}))
    assert select_backend("auto", request(device_type="cpu")).name == "cpu_only"
    # the reference serves any device: meta tensors run its fake implementation
    assert select_backend("auto", request(device_type="meta")).name == "reference"
    q, k = torch.empty(9, 4, 16, device="meta"), torch.empty(9, 2, 16, device="meta")
    offsets = torch.empty(3, dtype=torch.int64, device="meta")
    assert block_attention(q, k, k, offsets, 4).shape == (9, 4, 16)


def test_registry_fixture_restores(registry):
    register_backend(spec("temp"))
    assert "temp" in dispatch._REGISTRY


def test_registry_was_restored():
    assert "temp" not in dispatch._REGISTRY and "reference" in dispatch._REGISTRY
    assert blockattn_layers.dispatch._REGISTRY is dispatch._REGISTRY
