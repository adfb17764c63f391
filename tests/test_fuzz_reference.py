"""Bounded hypothesis fuzz: the reference backend against the float64 oracle, forward and gradients.

Draws length distributions (many empty / single-token sequences, block multiples +-1), block
sizes (including None), GQA/MQA head layouts, causal, scale, every rotary variant, offsets
dtypes, and the planning paths (host grouping, sync-free device grouping, small memory budget).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockattn_layers.reference as reference
from blockattn_layers import block_attention
from tests.oracle import make_jagged, oracle_attention, rel_err

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_T = 240
BLOCKS = [1, 2, 3, 7, 8, 16, 31, 32, 64, 100, None]


@st.composite
def lengths_for(draw, block_size):
    unit = block_size or draw(st.sampled_from([8, 16, 32, 64]))
    near_multiples = sorted({max(0, unit * m + d) for m in range(0, 4) for d in (-1, 0, 1)})
    one_length = st.one_of(
        st.sampled_from([0, 0, 1, 1, 2]),  # empties and singletons
        st.sampled_from(near_multiples),  # block boundaries +-1
        st.integers(0, 70),
    )
    lengths = draw(st.lists(one_length, min_size=0, max_size=10))
    while sum(lengths) > MAX_T:  # keep the oracle's loops small
        lengths.pop()
    return lengths


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from(BLOCKS))
    lengths = draw(lengths_for(block_size))
    h_kv = draw(st.sampled_from([1, 2]))
    H = h_kv * draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([1, 2, 3, 4, 8, 12]))
    kw = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(-2.0, 2.0, allow_nan=False))
    if D >= 2 and draw(st.booleans()):
        kw["rope_theta"] = draw(st.sampled_from([1.5, 10.0, 500.0, 10000.0]))
        kw["rotary_interleaved"] = draw(st.booleans())
        rd = draw(st.one_of(st.none(), st.sampled_from([r for r in range(2, D + 1, 2)])))
        if rd is not None or D % 2:
            kw["rotary_dim"] = rd if rd is not None else D - 1
        pos_kind = draw(st.sampled_from(["default", "int", "int32", "float", "timestamps"]))
        T = sum(lengths)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
        if pos_kind == "int":
            kw["positions"] = torch.randint(0, 500, (T,), generator=g)
        elif pos_kind == "int32":
            kw["positions"] = torch.randint(0, 500, (T,), generator=g, dtype=torch.int32)
        elif pos_kind == "float":
            kw["positions"] = torch.rand(T, generator=g, dtype=torch.float64) * 50
        elif pos_kind == "timestamps":
            kw["positions"] = 1000 + torch.rand(T, generator=g, dtype=torch.float64) * 5000
    offsets_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    grouping = draw(st.sampled_from(["host", "host", "cpu_offsets", "device", "device_max_seqlen", "small_budget"]))
    seed = draw(st.integers(0, 2 ** 16))
    return lengths, H, h_kv, D, block_size, kw, offsets_dtype, grouping, seed


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_fuzz_reference_matches_oracle(case):
    lengths, H, h_kv, D, block_size, kw, offsets_dtype, grouping, seed = case
    q, k, v, offsets = make_jagged(lengths, H, h_kv, D, torch.float64, seed, offsets_dtype=offsets_dtype,
                                   requires_grad=True)
    g = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    extra = {}
    patches = []
    longest = max(lengths, default=0)
    if grouping == "cpu_offsets":
        extra = dict(cpu_offsets=offsets.clone(), max_seqlen=longest)
    elif grouping in ("device", "device_max_seqlen"):
        patches.append(mock.patch.object(reference, "_host_offsets", lambda o, c: None))
        if grouping == "device_max_seqlen":
            extra = dict(max_seqlen=longest + 3)
    elif grouping == "small_budget":
        patches.append(mock.patch.object(reference, "SCORE_BUDGET", 64))

    saved = [x.detach().clone() for x in (q, k, v, offsets)]
    for p in patches:
        p.start()
    try:
        out = block_attention(q, k, v, offsets, block_size, backend="reference", **kw, **extra)
        grads = torch.autograd.grad(out, (q, k, v), g) if q.numel() else (q, k, v)
    finally:
        for p in reversed(patches):
            p.stop()
    exp = oracle_attention(q, k, v, offsets, block_size, **kw)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert rel_err(out, exp) < 1e-10
    if q.numel():
        exp_grads = torch.autograd.grad(exp, (q, k, v), g)
        for name, a, b in zip(("dq", "dk", "dv"), grads, exp_grads):
            assert rel_err(a, b) < 1e-10, name
    for x, s in zip((q, k, v, offsets), saved):
        assert torch.equal(x.detach(), s)
