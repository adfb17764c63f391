"""Calls remembered by signature (``_checked_calls``) are checked and computed like fresh ones."""
from __future__ import annotations

import pytest
import torch

import blockattn_layers as bl
import blockattn_layers.dispatch as dispatch
from blockattn_layers import _checked_calls
from tests.test_validation import SCALAR_CASES, TENSOR_CASES, call, inputs

# Caught only by checks of offset values, which validate=False turns off.
_VALUE_CASES = {
    "offsets_first", "offsets_decreasing", "offsets_last_short", "offsets_last_long", "offsets_only_nonzero",
    "offsets_B0_nonempty_T", "cpu_offsets_decreasing", "cpu_offsets_last", "cpu_offsets_first",
    "cpu_offsets_mismatch_validate", "max_seqlen_short", "max_seqlen_short_cpu_offsets", "max_seqlen_short_full",
}
_CASES = {**TENSOR_CASES, **SCALAR_CASES}


@pytest.mark.parametrize("case", sorted(set(_CASES) - _VALUE_CASES))
def test_bad_argument_after_a_remembered_call(case):
    """A call that differs from a remembered valid one in one bad argument still raises."""
    exc, pattern, over = _CASES[case]
    _checked_calls._CALLS.clear()
    with pytest.raises(exc, match=pattern):
        call(validate=False, **over)
    call(validate=False)
    call(validate=False, rope_theta=1e4)
    assert _checked_calls._CALLS, "valid calls with validate=False are remembered"
    with pytest.raises(exc, match=pattern):
        call(validate=False, **over)


@pytest.mark.parametrize("good, bad, pattern", [
    (dict(block_size=1), dict(block_size=True), r"^block_size must be an int"),
    (dict(causal=True), dict(causal=1), r"^causal must be a bool"),
    (dict(scale=1.0), dict(scale=True), r"^scale must be a finite real"),
    (dict(rope_theta=1.0, rotary_dim=2), dict(rope_theta=True, rotary_dim=2), r"^rope_theta must be a positive"),
])
def test_equal_values_of_another_type_are_not_taken_for_the_remembered_ones(good, bad, pattern):
    """``True == 1`` and they hash alike: the remembered signature holds each scalar's type."""
    call(validate=False, **good)
    with pytest.raises((TypeError, ValueError), match=pattern):
        call(validate=False, **bad)


def test_value_checks_run_on_every_call():
    """Offsets on the CPU are checked on each call: a remembered signature does not skip that."""
    call()
    call()
    with pytest.raises(ValueError, match=r"^offsets must be non-decreasing"):
        call(offsets=torch.tensor([0, 5, 4, 12]))


def test_remembered_call_uses_this_calls_tensors(monkeypatch):
    """positions and cpu_offsets come from each call, not from the call that was remembered."""
    pos = [torch.arange(12) * 3, torch.arange(12).flip(0)]
    outs = [call(validate=False, rope_theta=100.0, positions=p) for p in pos]
    _checked_calls._CALLS.clear()
    fresh = call(validate=False, rope_theta=100.0, positions=pos[1])
    torch.testing.assert_close(outs[1], fresh, rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[1])

    seen = []
    _spy_registry(monkeypatch, lambda q, k, v, offsets, *args: (seen.append(args[7]) or q.clone(), None))
    offsets = inputs()["offsets"]
    for cpu in (offsets.clone(), offsets.clone()):
        call(backend="spy", validate=False, cpu_offsets=cpu)
        assert seen[-1] is cpu


def test_registering_a_backend_forgets_remembered_choices(monkeypatch):
    """A backend registered after a call was remembered (as distributed_check does to wrap them)
    serves the next call with the same signature."""
    call(backend="auto", validate=False)
    call(backend="auto", validate=False)
    seen = []
    _spy_registry(monkeypatch, lambda q, k, v, offsets, *args: (seen.append(1) or q.clone(), None), priority=1000)
    call(backend="auto", validate=False)
    assert seen == [1]


def _spy_registry(monkeypatch, run, priority=-1):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    monkeypatch.setattr(dispatch, "_BY_PRIORITY", list(dispatch._BY_PRIORITY))
    monkeypatch.setattr(dispatch, "_SELECTED", {})
    dispatch.register_backend(bl.BackendSpec(
        name="spy", forward=run, backward=None, priority=priority, devices=None, auto_devices=None,
        dtypes=frozenset({torch.float64, torch.float32}),
    ))
