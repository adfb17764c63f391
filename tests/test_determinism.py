"""The backward-mode switch (``blockattn_layers.determinism``): the process setting, the region
form, the environment variable, PyTorch's deterministic flag, and the backends passing it on."""
import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import determinism


def test_default_is_deterministic_and_the_switch_and_region_set_it():
    assert determinism.deterministic_backward()
    with bl.fast_backward():
        assert not determinism.deterministic_backward()
        with bl.fast_backward(False):
            assert determinism.deterministic_backward()
        assert not determinism.deterministic_backward()
    assert determinism.deterministic_backward()
    bl.use_fast_backward()
    try:
        assert not determinism.deterministic_backward()
    finally:
        bl.use_fast_backward(False)
    with pytest.raises(TypeError, match="enabled must be a bool, got str"):
        bl.use_fast_backward("yes")


def test_torch_deterministic_algorithms_win():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with bl.fast_backward():
            assert determinism.deterministic_backward()
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("value,fast", [("fast", True), ("Deterministic", False), ("", False)])
def test_environment_variable(monkeypatch, value, fast):
    monkeypatch.setenv("BLOCKATTN_BACKWARD", value)
    assert determinism._from_environment() is fast


def test_environment_variable_rejects_other_values(monkeypatch):
    monkeypatch.setenv("BLOCKATTN_BACKWARD", "quick")
    with pytest.raises(ValueError, match="BLOCKATTN_BACKWARD must be one of deterministic, fast, got 'quick'"):
        determinism._from_environment()


def test_backends_pass_the_mode_read_when_the_backward_runs(monkeypatch):
    """The triton_flash backend (and the block backend's flash route) ask for the mode at backward time."""
    from blockattn_layers.ops.backends import triton_block, triton_flash

    seen = []
    monkeypatch.setattr(triton_flash, "flash_attention_bwd", lambda *a, **kw: seen.append(kw["deterministic"]))
    triton_flash._backward(*([None] * 16))
    with bl.fast_backward():
        triton_flash._backward(*([None] * 16))
    assert seen == [True, False]
    monkeypatch.setattr(triton_block, "flash_attention_bwd", lambda *a, **kw: seen.append(kw["deterministic"]))
    q = torch.empty(0, 1, 256)
    with bl.fast_backward():
        triton_block._backward(q, q, q, q, None, None, None, 128, 1.0, False, None, None, 0, False, None, None)
    assert seen == [True, False, False]
