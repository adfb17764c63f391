"""What ``explain_variants``, ``describe`` and ``info`` say: a variant runs only where its backend serves
the call, full attention in the user's terms, and fp8 calls by the path that serves them (the fp8
kernels or descaled copies, forward only). CPU only: sm_90 calls are judged as requests."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import fp8
from blockattn_layers.cli.backend_choice import format_choice
from blockattn_layers.dispatch import AttentionRequest, describe, explain, explain_variants, running_variants
from blockattn_layers.kernels.block import variants
from blockattn_layers.ops.backends import triton_flash

SM90 = AttentionRequest("cuda", (9, 0), torch.bfloat16, 128, 2, 2, 64, False, False)
FP8 = dataclasses.replace(SM90, dtype=torch.float8_e4m3fn)
GATE = "the triton backend does not serve this call: "
TRITON = next(spec for spec in bl.registered_backends() if spec.name == "triton")


@pytest.fixture
def with_cuda(monkeypatch):
    """Judge CUDA requests as on a machine with a GPU, whether or not this one has one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("req,reason", [
    (FP8, "dtype torch.float8_e4m3fn not supported"),
    (dataclasses.replace(SM90, block_size=256), "block_size 256 above 128"),
    (dataclasses.replace(SM90, block_size=None), "full attention (block_size=None) not supported"),
], ids=["fp8", "block-256", "full-attention"])
def test_no_variant_runs_where_the_backend_refuses(with_cuda, req, reason):
    shown = explain_variants(req)["triton"]
    assert all(why and why[0] == GATE + reason for why in shown.values()), shown
    assert running_variants(shown) == (None, {})


def test_variants_run_where_only_this_machine_lacks_cuda(monkeypatch):
    """Without a GPU, the triton backend does not serve a CUDA call and says so on each variant;
    judged as for a GPU the machine lacks (``info``), the variants are as on that GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shown = explain_variants(SM90)["triton"]
    assert all(why[0] == GATE + "CUDA is not available" for why in shown.values())
    hypothetical = {name: [r for r in why if r != "CUDA is not available"] for name, why in explain(SM90).items()}
    assert explain_variants(SM90, hypothetical)["triton"]["hopper"] == []
    lines = format_choice(SM90, hypothetical=True)
    assert "  triton kernels -> hopper" in lines and "    hopper: runs" in lines, lines


def test_full_attention_variants_name_no_stand_in_block_size(with_cuda):
    req = dataclasses.replace(SM90, block_size=None)
    for shown in (explain_variants(req)["triton"], TRITON.variant_reasons(req)):
        assert list(shown) == list(explain_variants(SM90)["triton"])[:len(shown)]
        for why in shown.values():
            assert not any("block_size 0" in r for r in why), why
            assert "full attention (block_size=None): the block kernels take blocks of up to 128 tokens" in why[-1]


def test_describe_fp8_names_the_fp8_kernels(with_cuda):
    line = describe(FP8)
    assert line.startswith("fp8 kernels: e4m3 q, k, v descaled in registers") and "Forward only" in line, line
    assert describe(FP8, "triton") == line and "no backend serves" not in line
    with variants.unverified_kernels(False):
        assert "BLOCKATTN_UNVERIFIED_KERNELS=1" in describe(dataclasses.replace(FP8, capability=(10, 0)))
    with variants.unverified_kernels():
        assert describe(dataclasses.replace(FP8, capability=(10, 0))).startswith("fp8 kernels")
    assert "sm_89 or newer" in describe(dataclasses.replace(FP8, capability=(8, 0)))


@pytest.mark.parametrize("changes,backend,served,why", [
    (dict(block_size=256), "auto", "bfloat16 (float16 for out_dtype=torch.float16), then triton_flash",
     "blocks of up to 128 tokens, not 256"),
    (dict(block_size=None), "auto", "then triton_flash", "not full attention (block_size=None)"),
    ({}, "reference", "then reference", "not 'reference'"),
    (dict(capability=(8, 0)), "auto", "then triton, simple kernels", "sm_89 or newer"),
    (dict(device_type="cpu", capability=None), "auto", "float32, then reference", "on CUDA only"),
], ids=["block-256", "full-attention", "reference", "sm80", "cpu"])
def test_describe_fp8_names_the_descaled_path(with_cuda, changes, backend, served, why):
    line = describe(dataclasses.replace(FP8, **changes), backend)
    assert line.startswith("fp8 inputs descaled to ") and served in line and why in line, line
    assert line.endswith(fp8.FORWARD_ONLY)


def test_info_says_what_serves_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert format_choice(FP8, hypothetical=True)[0].startswith("auto -> fp8 kernels")
    assert "CUDA is not available" in format_choice(FP8)[0]
    large = format_choice(dataclasses.replace(FP8, block_size=256), hypothetical=True)
    assert large[0].startswith("auto -> fp8 inputs descaled to bfloat16") and large[1] == "  auto -> triton_flash"


@pytest.mark.parametrize("backend", ["auto", "triton", "reference"])
@pytest.mark.parametrize("block_size", [64, 256, None])
def test_fp8_kernel_reasons_match_what_runs_on_cpu(monkeypatch, backend, block_size):
    """The request's fp8 kernel reasons are empty exactly where the call takes the kernel (CPU
    tensors, the kernel stubbed)."""
    taken = []
    monkeypatch.setattr(fp8, "fp8_attention_fwd", lambda q, *args: taken.append(True) or torch.zeros(q.shape))
    q = torch.randn(70, 2, 16).to(torch.float8_e4m3fn)
    try:
        bl.block_attention(q, q, q, torch.tensor([0, 30, 70]), block_size, backend=backend)
    except ValueError as err:  # descaled copies sent by name to the triton backend, which refuses them
        assert backend == "triton" and "backend='triton' cannot serve this call" in str(err)
    req = AttentionRequest("cpu", None, q.dtype, 16, 2, 2, block_size, False, False)
    assert bool(taken) == (not fp8.kernel_request_reasons(req, backend))


def test_fp8_call_with_the_triton_backend_where_it_cannot_run_names_the_backend(monkeypatch):
    """CPU fp8 tensors with ``backend="triton"`` and no Triton interpreter: the backend's own refusal
    (device type), as for 16-bit tensors, not a Triton driver error from a launched kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(10, 2, 64)
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(t) for t in (x, x, x))
    offsets = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match="backend='triton' cannot serve this call: device type 'cpu'"):
        bl.block_attention(q8, k8, v8, offsets, 64, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton")


@pytest.mark.parametrize("changes,deterministic,want", [
    (dict(block_size=None), True, "triton_flash, gluon kernels"),
    (dict(block_size=None), False, "triton_flash, gluon kernels"),
    (dict(block_size=256), True, "triton_flash, gluon kernels (backward: triton kernels)"),
    (dict(block_size=256), False, "triton_flash, gluon kernels (backward: triton kernels)"),
    (dict(block_size=None, head_dim=64), True, "triton_flash, gluon kernels"),
    (dict(block_size=None, head_dim=64), False, "triton_flash, gluon kernels"),
    (dict(block_size=256, head_dim=64), True, "triton_flash, gluon kernels (backward: triton kernels)"),
    (dict(block_size=512, head_dim=96), False, "triton_flash, triton kernels"),
    (dict(block_size=None, rotary=True), False, "triton_flash, triton kernels"),
    (dict(block_size=None, capability=(8, 0)), False, "triton_flash, triton kernels"),
    (dict(block_size=None, dtype=torch.float32), False, "triton_flash, triton kernels"),
], ids=["full-d128", "full-d128-fast", "block256-d128", "block256-d128-fast", "full-d64", "full-d64-fast",
        "block256-d64", "block512-d96-fast",
        "rotary-fast", "sm80-fast", "fp32-fast"])
def test_describe_names_the_flash_kernels_each_phase_runs(with_cuda, changes, deterministic, want):
    """``triton_flash``'s Gluon forward where measured faster (D 128 and D 64) unless forced off, the Gluon
    backward kernel at full attention (D 128 whole in either backward; D 64 without dQ's terms in the deterministic one, which
    the fast one runs there), the Triton kernels elsewhere (the fast backward on blocks runs the
    deterministic one's Triton passes), with the reasons ``explain_variants`` gives."""
    req = dataclasses.replace(SM90, **changes)
    with bl.fast_backward(not deterministic):
        assert describe(req, "triton_flash") == want
        shown = explain_variants(req)["triton_flash"]
    assert shown["triton"] == []
    if "rotary" in changes:
        assert shown["gluon"] == ["no rotary"]
    if "capability" in changes:
        assert shown["gluon"] == ["an sm_90 GPU"]
    if changes.get("head_dim") == 64:
        with triton_flash.gluon_forward(False):
            assert explain_variants(req)["triton_flash"]["gluon"] == [
                "head dim 64: the Triton forward measured faster, or not yet measured (or forced by "
                "gluon_forward(False))"]
    if changes.get("block_size") is not None and "head_dim" not in changes:
        assert shown["backward: gluon"] == ["full attention at D 64/128: the deterministic backward's Triton passes "
                                            "measured faster elsewhere (the fast backward runs the deterministic "
                                            "one there)"]


def test_describe_follows_the_deterministic_gluon_dkdv_switch(with_cuda, monkeypatch):
    """With ``DKDV_ONLY_TAKEN`` the deterministic backward's dK/dV pass is the Gluon kernel's on blocks
    too (by default only at full attention)."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    req = dataclasses.replace(SM90, block_size=256)
    assert describe(req, "triton_flash") == "triton_flash, gluon kernels (backward: triton kernels)"
    monkeypatch.setattr(flash_bwd, "DKDV_ONLY_TAKEN", [True])
    assert describe(req, "triton_flash") == "triton_flash, gluon kernels"
