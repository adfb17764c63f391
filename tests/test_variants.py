"""The block-kernel variants in the one dispatcher: what each admits, auto's choice, a forced
variant that cannot serve a call (one warning, the reasons named), and what ``explain`` shows.
CPU only: the choices are made for hypothetical sm_90 calls where the tensors' device matters."""
import dataclasses
import warnings

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers.dispatch import AttentionRequest, explain_variants
from blockattn_layers.kernels.block import plan, variants
from blockattn_layers.kernels.common.meta import sm_count
from blockattn_layers.ops import library
from blockattn_layers.ops.backends import triton_block


def _facts(device="cuda", major=9, dtype=torch.bfloat16, head_dim=128, groups=1, block_size=64, rot=0,
           interleaved=False, int64=False, has_pos=False, backward=False):
    return variants.CallFacts(device, major, dtype, head_dim, groups, block_size, rot, interleaved, int64, has_pos,
                              backward)


@pytest.fixture
def restore_auto():
    yield
    variants.force_variant("auto")


def test_hopper_call_reasons():
    assert variants.HOPPER.call_reasons(_facts()) == []
    assert variants.HOPPER.call_reasons(_facts(rot=128)) == [] and variants.HOPPER.call_reasons(_facts(block_size=33)) == []
    assert variants.HOPPER.call_reasons(_facts(head_dim=64, dtype=torch.float16, groups=2)) == []
    # Head dims 16-256 in steps of 16 (padded tiles), blocks up to 128, 64-bit addressing.
    for admitted in (dict(head_dim=96), dict(head_dim=32, rot=32), dict(head_dim=256), dict(head_dim=48),
                     dict(block_size=128), dict(block_size=100, rot=128), dict(int64=True),
                     dict(head_dim=256, backward=True), dict(block_size=128, backward=True, rot=128),
                     dict(groups=4, head_dim=256), dict(groups=4, head_dim=96, backward=True),
                     dict(groups=2, block_size=100), dict(groups=2, block_size=100, backward=True),
                     # Rotary in half tiles: partial rotary_dim, padded head dims.
                     dict(rot=64), dict(rot=16, backward=True), dict(head_dim=96, rot=96),
                     dict(head_dim=80, rot=48, groups=2, backward=True), dict(head_dim=48, rot=32),
                     dict(rot=128, interleaved=True), dict(head_dim=96, rot=64, interleaved=True, backward=True),
                     # Rotary forward at D 144-256 (half tiles rotated by 32-row chunks).
                     dict(head_dim=256, rot=256), dict(head_dim=256, rot=64, groups=2, block_size=128),
                     dict(head_dim=192, rot=128, interleaved=True), dict(head_dim=256, rot=256, backward=True)):
        assert variants.HOPPER.call_reasons(_facts(**admitted)) == [], admitted
    for bad, words in [(dict(major=8), "sm_90"), (dict(device="cpu", major=None), "sm_90"),
                       (dict(dtype=torch.float32), "dtype"), (dict(head_dim=72), "head_dim 72"), (dict(head_dim=16), "head_dim 16"),
                       (dict(head_dim=272), "head_dim 272"), (dict(block_size=129), "block_size 129"),
                       (dict(block_size=32), "block_size 32 < 33"),
                       (dict(block_size=128, head_dim=256, backward=True), "backward of blocks over 64"),
                       (dict(rot=120), "rotary_dim 120 (needs a multiple of 16)"),
                       (dict(head_dim=256, rot=256, backward=True, block_size=128), "backward of blocks over 64"),
                       (dict(head_dim=256, rot=64, backward=True, groups=2), "backward of grouped-query"),
                       (dict(groups=2, head_dim=256, backward=True), "backward of grouped-query")]:
        reasons = variants.HOPPER.call_reasons(_facts(**bad))
        assert len(reasons) == 1 and words in reasons[0], (bad, reasons)
    assert "multiple of 16 in 32-256" in variants.HOPPER.call_reasons(_facts(head_dim=72))[0]
    # Grouped-query heads at 128-row tiles: admitted (they can be forced); auto takes the forward
    # at D 32-256 (at D256 without rotary since its tiles go in channel chunks, ``plan.CHUNKED_WIDE_FWD``),
    # and the backward at D 32 / 64 / 128.
    for dim, rot, taken in [(128, 0, True), (96, 0, True), (128, 128, True), (32, 0, True), (32, 32, True),
                            (64, 0, True), (64, 64, True), (256, 0, True), (256, 256, True)]:
        reasons = variants.HOPPER.auto_reasons(_facts(groups=2, block_size=100, head_dim=dim, rot=rot))
        assert (reasons == []) == taken, (dim, rot, reasons)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan, "CHUNKED_WIDE_FWD", False)
        reasons = variants.HOPPER.auto_reasons(_facts(groups=2, block_size=100, head_dim=256))
        assert len(reasons) == 1 and "simple is faster" in reasons[0], reasons
    assert variants.HOPPER.auto_reasons(_facts(groups=2, block_size=100, backward=True)) == []
    for dim, taken in [(32, True), (64, True), (96, True), (80, True), (48, False)]:
        reasons = variants.HOPPER.auto_reasons(_facts(groups=2, block_size=100, head_dim=dim, backward=True))
        assert (reasons == []) == taken, (dim, reasons)
    assert "padded to 64 channels" in variants.HOPPER.auto_reasons(
        _facts(groups=2, block_size=100, head_dim=48, backward=True))[0]
    # (... unless rotary covers all its channels: hopper, as since session 26.)
    assert variants.HOPPER.auto_reasons(_facts(groups=2, block_size=100, head_dim=48, rot=48, backward=True)) == []
    # With rotary there (split halves, or over part of the channels) hopper_heads runs before it.
    for rot in (96, 48):
        facts = _facts(groups=4, block_size=128, head_dim=96, rot=rot, backward=True)
        assert variants.HOPPER.auto_reasons(facts) == [] and variants.HOPPER_HEADS.auto_reasons(facts) == []
    assert variants.HOPPER.auto_reasons(_facts(groups=2)) == [] and variants.HOPPER.auto_reasons(_facts(block_size=128)) == []


def test_sm100_and_hopper_ws_keep_their_head_dims_and_32_bit_addressing():
    for variant in (variants.SM100, variants.HOPPER_WS):
        major = min(variant.generations)
        assert any("head_dim 96 (needs 64, 128)" in r for r in variant.call_reasons(_facts(major=major, head_dim=96)))
        assert any("64-bit" in r for r in variant.call_reasons(_facts(major=major, int64=True)))
        assert any("rotary_dim 64 of head_dim 128" in r for r in variant.call_reasons(_facts(major=major, rot=64)))
        assert any("interleaved rotary" in r
                   for r in variant.call_reasons(_facts(major=major, rot=128, interleaved=True)))
    assert any("block_size 128 > 64" in r for r in variants.HOPPER_WS.call_reasons(_facts(block_size=128)))


def test_explain_variants_shows_a_backward_that_chooses_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # describe() of hypothetical sm_90 calls
    gqa = AttentionRequest(device_type="cuda", dtype=torch.bfloat16, head_dim=256, num_heads=4, num_kv_heads=2,
                           block_size=64, causal=False, rotary=False, capability=(9, 0))
    reasons = explain_variants(gqa)["triton"]
    assert reasons["hopper"] == [] and reasons["backward: simple"] == []
    assert "backward of grouped-query" in reasons["backward: hopper"][0]
    assert bl.dispatch.describe(gqa, "triton") == "triton, hopper kernels (backward: simple kernels)"
    mha = dataclasses.replace(gqa, num_heads=2)
    assert not any(name.startswith("backward: ") for name in explain_variants(mha)["triton"])
    assert bl.dispatch.describe(mha, "triton") == "triton, hopper kernels"
    # Blocks over 64 tokens with heads over 128 wide: no block kernel's backward but hopper_wide's fits
    # one program (grouped query heads one by one, their dK and dV summed over the group).
    wide = dataclasses.replace(gqa, block_size=128)
    reasons = explain_variants(wide)["triton"]
    assert reasons["backward: hopper_wide"] == [] and reasons["backward: flash"] == ["a variant before it runs"]
    assert all("flash kernels run it" in why[-1] for name, why in reasons.items()
               if name.startswith("backward: ")
               and name not in ("backward: flash", "backward: hopper_wide", "backward: rotated"))
    assert reasons["backward: rotated"] == ["no rotary"]
    assert bl.dispatch.describe(wide, "triton") == "triton, hopper kernels (backward: hopper_wide kernels)"
    # Off sm_90 (no hopper_wide): the flash kernels'.
    a100 = explain_variants(dataclasses.replace(wide, capability=(8, 0)))["triton"]
    assert a100["backward: flash"] == [] and a100["backward: hopper_wide"][0] == "needs an sm_90 GPU"
    assert bl.dispatch.describe(dataclasses.replace(wide, capability=(8, 0)), "triton") == (
        "triton, simple kernels (backward: flash kernels)")
    # Grouped query heads at D 128 there: the block kernels' backward fits, but on sm_90 the flash kernel with dQ
    # stored runs it (the forward saves out and lse for it); with rotary through the rotation pass (whatever the
    # choice would be); not off sm_90, with a forced variant, or with one query head per kv head.
    d128 = dataclasses.replace(wide, head_dim=128)
    reasons = explain_variants(d128)["triton"]
    assert reasons["backward: flash"] == [] and reasons["hopper"] == []
    assert reasons["backward: hopper"][-1] == triton_block._STORED_DQ
    assert bl.dispatch.describe(d128, "triton") == "triton, hopper kernels (backward: flash kernels)"
    assert "backward: flash" not in explain_variants(dataclasses.replace(d128, capability=(8, 0)))["triton"]
    assert "backward: flash" not in explain_variants(dataclasses.replace(d128, num_heads=2))["triton"]
    assert "backward: flash" not in explain_variants(dataclasses.replace(d128, block_size=64))["triton"]
    for form in (dict(rotary_interleaved=True), dict(rotary_dim=64), dict(rotary_dim=64, rotary_interleaved=True)):
        rotary = explain_variants(dataclasses.replace(d128, num_heads=8, rotary=True, **form))["triton"]
        assert "backward: flash" not in rotary and rotary["backward: rotated"] == [], form
        assert rotary["backward: hopper_heads"][-1] == triton_block._STORED_DQ_ROTATED, form
        assert rotary[f"{triton_block.ROTATED_COPIES}: flash"] == [], form
        assert rotary[f"{triton_block.ROTATED_COPIES}: hopper"][-1] == triton_block._STORED_DQ, form
    assert bl.dispatch.describe(dataclasses.replace(d128, rotary=True, rotary_dim=64), "triton") == \
        "triton, hopper kernels (backward: rotated kernels; backward on rotated copies: flash kernels)"
    # Split halves over every channel too, since session 57 (copies in the paired-chunk order); not while they
    # save no lse.
    split = explain_variants(dataclasses.replace(d128, rotary=True))["triton"]
    assert split["backward: rotated"] == [] and split[f"{triton_block.ROTATED_COPIES}: flash"] == []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "GROUPED_SAVES_LSE_ROTARY", frozenset({"interleaved", "partial"}))
        split = explain_variants(dataclasses.replace(d128, rotary=True))["triton"]
        assert split["backward: hopper_heads"] == [] and not any("flash" in name for name in split)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "GROUPED_SAVES_LSE_ROTARY", frozenset())
        interleaved = explain_variants(dataclasses.replace(d128, num_heads=8, rotary=True, rotary_interleaved=True))
        assert interleaved["triton"]["backward: rotated"] == [] and not any(
            "flash" in name for name in interleaved["triton"])
    with variants.forced_variant("hopper"):
        assert "backward: flash" not in explain_variants(d128)["triton"]
    # One query head per kv head: hopper_wide's backward, rotary or not. There the
    # forward with gradients stores the logsumexp: hopper has such a kernel, so the forward with
    # gradients takes the same variant as the one without.
    wide_mha = dataclasses.replace(wide, num_heads=2)
    reasons = explain_variants(wide_mha)["triton"]
    assert reasons["hopper"] == [] and not any(name.startswith("forward with gradients") for name in reasons)
    assert reasons["backward: hopper_wide"] == [] and reasons["backward: flash"] == ["a variant before it runs"]
    assert bl.dispatch.describe(wide_mha, "triton") == "triton, hopper kernels (backward: hopper_wide kernels)"
    rotary = explain_variants(dataclasses.replace(wide_mha, rotary=True))["triton"]
    assert rotary["backward: hopper_wide"] == [] and rotary["backward: flash"] == ["a variant before it runs"]
    odd = explain_variants(dataclasses.replace(wide_mha, rotary=True, rotary_dim=40))["triton"]
    assert odd["backward: hopper_wide"] == ["rotary_dim 40 (needs a multiple of 16)"] and odd["backward: flash"] == []
    # A variant without one leaves the forward with gradients to the next that has one.
    no_lse = variants.HOPPER._replace(lse_forward=None)
    monkeypatch.setattr(variants, "AUTO_ORDER",
                        tuple(no_lse if v is variants.HOPPER else v for v in variants.AUTO_ORDER))
    monkeypatch.setitem(variants.VARIANTS, "hopper", no_lse)
    reasons = explain_variants(wide_mha)["triton"]
    assert reasons["hopper"] == [] and reasons["forward with gradients: simple"] == []
    assert reasons["forward with gradients: hopper"] == [variants.LSE_REASON]
    assert bl.dispatch.describe(wide_mha, "triton") == (
        "triton, hopper kernels (forward with gradients: simple kernels; backward: hopper_wide kernels)")


def test_float32_tiles_over_shared_memory_show_the_flash_kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    req = AttentionRequest(device_type="cuda", dtype=torch.float32, head_dim=128, num_heads=2, num_kv_heads=2,
                           block_size=128, causal=False, rotary=False, capability=(9, 0))
    reasons = explain_variants(req)["triton"]
    assert reasons["flash"] == [] and all("float32 tile" in why[-1] for name, why in reasons.items() if name != "flash")
    assert bl.dispatch.describe(req, "triton") == "triton, flash kernels"
    assert bl.dispatch.describe(dataclasses.replace(req, head_dim=64), "triton") == "triton, simple kernels"


def test_the_forwards_that_store_the_logsumexp_take_the_plain_forwards_plans():
    """A variant's two forwards share one launch plan (``block.plan.block_plan`` keys it by the
    variant, not the kernel): the same constexprs, and the same arguments with ``Lse`` after ``O``
    and its head stride last."""
    kernels = [variants.SIMPLE]
    if variants.gluon_import_error() is None:
        kernels.append(variants.HOPPER)
    for variant in kernels:
        plain, lse = variant.kernels()[0], variant.lse_forward()
        assert lse.constexpr_names() == plain.constexpr_names(), variant.name
        plain_args, lse_args = list(plain.kernel.arg_names), list(lse.kernel.arg_names)
        at = plain_args.index("O") + 1
        tail = plain_args.index("stride_od") + 1
        assert lse_args == plain_args[:at] + ["Lse"] + plain_args[at:tail] + ["stride_lh"] + plain_args[tail:]
    # Every variant that computes a forward which stores the logsumexp has such a kernel (a
    # backward-only variant's forward is its ``forward_of``'s).
    for name, variant in variants.VARIANTS.items():
        for block, dim, groups, rot in [(65, 144, 1, 0), (128, 256, 1, 0), (128, 192, 4, 0), (100, 256, 2, 256)]:
            for major in (8, 9, 10):
                facts = _facts(major=major, block_size=block, head_dim=dim, groups=groups, rot=rot)
                runs = variants.VARIANTS.get(variant.forward_of, variant)
                if not variants._call_reasons(variant, facts) and not variant.rotation_pass:
                    assert runs.lse_forward is not None, (name, facts)


def test_hopper_layout_reasons():
    """16-byte aligned rows of unit channel stride and 16-divisible strides."""
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)

    def ok(*tensors):
        return not variants.HOPPER.layout_reasons(tensors[0], tensors)

    assert ok(q, q)
    wide = torch.empty(5, 2, 136, dtype=torch.bfloat16)
    assert not ok(q, wide[..., :128])  # head stride 136
    assert not ok(q, torch.empty(5, 128, 2, dtype=torch.bfloat16).transpose(1, 2))  # channel stride 2
    flat = torch.empty(5 * 2 * 128 + 8, dtype=torch.bfloat16)
    assert not ok(q, flat[8 - 1:-1].view(5, 2, 128))  # 2-byte aligned rows
    assert ok(q, flat[8:].view(5, 2, 128))


def test_hopper_ws_admits_one_query_head_per_kv_head_with_packed_heads():
    assert variants.HOPPER_WS.call_reasons(_facts()) == []
    assert any("grouped-query" in r for r in variants.HOPPER_WS.call_reasons(_facts(groups=2)))
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    packed = torch.empty(5, 6, 128, dtype=torch.bfloat16)
    assert not variants.HOPPER_WS.layout_reasons(q, (packed[:, :2], packed[:, 2:4], packed[:, 4:]))
    gaps = torch.empty(5, 2, 256, dtype=torch.bfloat16)[..., :128]
    assert not variants.HOPPER.layout_reasons(gaps, (gaps,))
    assert variants.HOPPER_WS.layout_reasons(gaps, (gaps, gaps, gaps))
    one = torch.empty(5, 1, 256, dtype=torch.bfloat16)[..., :128]
    assert not variants.HOPPER_WS.layout_reasons(one, (one, one, one))  # one head: its stride does not matter


def test_auto_takes_hopper_on_sm90_where_admitted_and_never_the_experimental():
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    assert variants.choose(_facts(), q, (q, q)) is variants.HOPPER
    assert variants.choose(_facts(major=8), q, (q, q)) is variants.SIMPLE
    assert variants.choose(_facts(major=10), q, (q, q)) is variants.SIMPLE
    assert variants.choose(_facts(head_dim=96), q, (q, q)) is variants.HOPPER
    assert variants.choose(_facts(head_dim=72), q, (q, q)) is variants.SIMPLE
    assert variants.choose(_facts(groups=2, head_dim=256, backward=True), q, (q, q)) is variants.SIMPLE
    assert variants.choose(_facts(block_size=16, head_dim=256), q, (q, q)) is variants.SIMPLE
    assert variants.choose(_facts(block_size=16, head_dim=64), q, (q, q)) is variants.HOPPER_PACKED
    assert variants.HOPPER_WS.experimental and variants.HOPPER_WS not in variants.AUTO_ORDER


def test_auto_takes_hopper_packed_for_short_blocks_where_it_was_faster():
    """Blocks of up to 32 tokens on sm_90 (H200 grid, session 20): hopper_packed forward at D <= 64
    and with grouped query heads at D <= 128, backward with one query head per kv head at D <= 128,
    split-half and interleaved rotary at D <= 64 both ways; simple elsewhere (D256, the forward of
    one query head per kv head at D 96-128, the backward of grouped query heads without rotary at D
    over 64 (at D32 hopper_packed since its cap of session 50), rotary at D 96-128), and never packed
    (slower than both). explain() says why;
    forcing is not bound by where auto takes a variant."""
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)

    def auto(**kw):
        return variants.choose(_facts(**kw), q, (q, q)).name

    for block in (1, 16, 20, 32):
        for dim in (32, 64, 96, 128):
            assert auto(block_size=block, head_dim=dim) == ("hopper_packed" if dim <= 64 else "simple")
            assert auto(block_size=block, head_dim=dim, backward=True) == "hopper_packed"
            assert auto(block_size=block, head_dim=dim, groups=4) == "hopper_packed"
            assert auto(block_size=block, head_dim=dim, groups=4, backward=True) == (
                "hopper_packed" if dim <= 64 else "simple")
            rotary = "hopper_packed" if dim <= 64 else "simple"
            assert auto(block_size=block, head_dim=dim, rot=dim) == rotary
            assert auto(block_size=block, head_dim=dim, rot=dim, groups=4, backward=True) == rotary
            assert auto(block_size=block, head_dim=dim, rot=dim // 2) == rotary  # partial rotary
            # Interleaved rotary: hopper_packed at D <= 64 (session 27), simple at D 65-128 since its
            # pair loads are contiguous (session 28), both ways.
            interleaved = "hopper_packed" if dim <= 64 else "simple"
            assert auto(block_size=block, head_dim=dim, rot=dim, interleaved=True) == interleaved
            assert auto(block_size=block, head_dim=dim, rot=dim, interleaved=True, backward=True) == interleaved
            assert auto(block_size=block, head_dim=dim, rot=dim, interleaved=True, groups=4,
                        backward=True) == interleaved
        assert auto(block_size=block, head_dim=256) == auto(block_size=block, head_dim=256, backward=True) == "simple"
    assert auto(block_size=33, head_dim=72) == "simple"
    assert auto(block_size=16, dtype=torch.float32) == "simple"
    slower = "auto takes another variant here: " + variants.PACKED_SLOWER_REASON
    reasons = variants.explain(_facts(block_size=16, head_dim=256))
    assert reasons["hopper_packed"] == ["auto takes another variant here: head_dim 256 > 128: not faster than "
                                        "simple on the H200"]
    assert reasons["packed"] == [slower] and reasons["simple"] == []
    gqa_bwd = variants.explain(_facts(block_size=16, head_dim=128, groups=2, backward=True))
    assert gqa_bwd["hopper_packed"] == ["auto takes another variant here: backward of grouped-query heads at "
                                        "head_dim 128: not faster than simple on the H200 (its tiles spill)"]
    assert variants.explain(_facts(block_size=16, head_dim=64))["hopper_packed"] == []
    with variants.forced_variant("packed"):
        assert auto(block_size=16, head_dim=256, backward=True) == "packed"
    with variants.forced_variant("hopper_packed"):
        assert auto(block_size=16, head_dim=256, backward=True) == "hopper_packed"
    # Grouped-query heads at 128-row tiles: the backward at padded head dims is simple by auto, the forward
    # at D 32-256 (at D256 in channel chunks, session 61) and the backward at D 32 / 64 / 128 hopper; hopper
    # when forced, both ways.
    assert auto(block_size=128, groups=2) == "hopper" and auto(block_size=128, groups=2, backward=True) == "hopper"
    assert auto(block_size=128, groups=2, head_dim=64) == "hopper"
    assert auto(block_size=128, groups=2, head_dim=64, rot=64) == "hopper"
    assert auto(block_size=128, groups=2, head_dim=256) == "hopper"
    assert auto(block_size=128, groups=2, head_dim=256, rot=256) == "hopper"  # rotary: hopper (session 30)
    assert auto(block_size=128, head_dim=256, rot=256) == auto(block_size=64, head_dim=256, rot=256) == "hopper"
    assert auto(block_size=128, head_dim=256, backward=True) == "hopper_wide"
    assert auto(block_size=128, head_dim=256, rot=256, backward=True) == "hopper_wide"
    assert auto(block_size=64, head_dim=256, rot=256, backward=True) == "hopper"  # 64-row tiles (session 30)
    # Grouped query heads: the rotation pass around simple's backward (session 31).
    assert auto(block_size=64, head_dim=256, rot=256, groups=2, backward=True) == "rotated"
    assert auto(block_size=128, groups=2, head_dim=64, backward=True) == "hopper"
    assert auto(block_size=128, groups=2, head_dim=96, backward=True) == "hopper"  # session 32
    assert auto(block_size=128, groups=4, head_dim=32, backward=True) == "hopper"
    with variants.forced_variant("hopper"):
        assert auto(block_size=128, groups=2) == "hopper" and auto(block_size=128, groups=2, backward=True) == "hopper"


def test_a_forced_variant_that_cannot_serve_warns_once_with_the_reasons(restore_auto):
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    variants.force_variant("hopper_ws")
    assert variants.choose(_facts(), q, (q, q)) is variants.HOPPER_WS
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert variants.choose(_facts(groups=2), q, (q, q)) is variants.HOPPER  # what auto takes
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "'hopper_ws' cannot compute this call" in message and "grouped-query" in message


def test_a_forced_variant_runs_and_falls_back_through_the_public_function(restore_auto):
    q, k, v = (torch.randn(40, 2, 16) for _ in range(3))
    offsets = torch.tensor([0, 7, 40])
    want = bl.block_attention(q, k, v, offsets, 16, backend="reference")
    variants.force_variant("hopper")
    with pytest.warns(RuntimeWarning, match="'hopper' cannot compute this call .*needs an sm_90 GPU"):
        got = bl.block_attention(q, k, v, offsets, 16, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unknown_variant_names_raise(monkeypatch):
    with pytest.raises(ValueError, match=r"force_variant\(name\) must be auto or one of simple, hopper, hopper_packed, sm100, hopper_ws, packed"):
        variants.force_variant("persistent")
    monkeypatch.setattr(variants, "_FORCED", ["fast", False])
    with pytest.raises(ValueError, match="BLOCKATTN_KERNELS must be auto or one of simple, hopper, hopper_packed, sm100, hopper_ws, packed, keys, "
                       "hopper_wide, hopper_heads, rotated, got 'fast'"):
        variants.forced()


def test_the_forced_variant_is_in_the_remembered_launches_key(restore_auto):
    """Remembered forward launches are keyed by the forced variant too, so forcing one neither
    reuses another's launch nor needs the caches emptied (the bench interleaves forced rows)."""
    from blockattn_layers.kernels.block import fwd
    from blockattn_layers.kernels.common.schedule import Schedule

    q = torch.empty(70, 2, 64, dtype=torch.float16)
    sched = Schedule(torch.tensor([0, 30, 70]), 70, 64, None)

    def signature():
        return fwd._signature(q, q, q, sched.table, sched, 64, 0, False, False, False, (True,) * 6)

    seen = {signature()}
    for name in ("simple", "hopper", "hopper_ws"):
        with variants.forced_variant(name):
            assert variants.forced() is variants.VARIANTS[name]
            seen.add(signature())
    assert variants.forced() is None and signature() in seen and len(seen) == 4


def test_explain_names_the_variant_that_runs_and_why_the_others_do_not(restore_auto):
    reasons = variants.explain(_facts(groups=2))
    assert list(reasons) == ["rotated", "hopper_wide", "hopper_heads", "keys", "hopper", "hopper_packed", "sm100", "packed",
                             "simple", "hopper_ws"]
    assert reasons["rotated"] == ["forward: the fused rotary kernels run it (the rotation pass serves the backward)",
                                  "no rotary"]
    assert reasons["keys"] == ["auto takes another variant here: forward: the simple kernels' (auto names it simple)"]
    assert reasons["hopper_packed"] == ["block_size 64 > 32"]
    assert reasons["hopper"] == [] and reasons["simple"] == ["a variant before it runs"]
    assert any("grouped-query" in r for r in reasons["hopper_ws"])
    assert any("runs only when forced" in r for r in reasons["hopper_ws"])
    assert reasons["packed"] == ["block_size 64 > 32"]
    assert reasons["hopper_wide"] == [
        "auto takes another variant here: forward: the hopper kernels' (auto names it hopper)"]
    backward = variants.explain(_facts(groups=2)._replace(backward=True))
    assert backward["hopper_wide"] == ["head_dim 128 (needs a multiple of 16 in 144-256)", "block_size 64 < 65"]
    variants.force_variant("hopper_ws")
    forced = variants.explain(_facts())
    assert list(forced) == ["hopper_ws", "rotated", "hopper_wide", "hopper_heads", "keys", "hopper", "hopper_packed", "sm100", "packed",
                            "simple"]
    assert forced["hopper_ws"] == []
    assert not variants.explain(_facts(major=8))["simple"]


def test_the_dispatcher_shows_the_variants_beside_the_backends(monkeypatch):
    on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # sm_90 calls judged here (the backend serves them)
    req = AttentionRequest("cuda", (9, 0), torch.bfloat16, 64, 4, 2, 64, False, True)
    shown = explain_variants(req)
    assert list(shown) == ["triton", "triton_flash"] and shown["triton"]["hopper"] == []
    # triton_flash's kernels (Gluon or Triton) run only where it serves the call: not 64-token blocks.
    assert all(why and why[0].startswith("the triton_flash backend does not serve this call: block_size 64 <= 128")
               for why in shown["triton_flash"].values()), shown["triton_flash"]
    partial = AttentionRequest("cuda", (9, 0), torch.bfloat16, 64, 4, 2, 64, False, True, rotary_dim=32)
    assert explain_variants(partial)["triton"]["hopper"] == []
    interleaved = dataclasses.replace(partial, rotary_interleaved=True)
    assert explain_variants(interleaved)["triton"]["hopper"] == []
    cpu = AttentionRequest("cpu", None, torch.float32, 64, 4, 2, 64, False, True)
    assert bl.dispatch.describe(cpu) == "reference"
    if on_sm90:
        assert bl.dispatch.describe(req) == "triton, hopper kernels"


def test_plans_of_the_sm90_variants():
    q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
    for backward in (False, True):
        launcher = variants.HOPPER.kernels()[backward]
        meta, loop, key = plan.block_plan(q, q, 16, 0, False, False, False, backward, 512, False, variants.HOPPER,
                                          launcher)
        assert meta["BLOCK_M"] == 64 and not loop and key[-2:] == ("hopper", False)
        assert meta.get("maxnreg") == plan.HOPPER_MAXNREG.get((backward, 64, False))
        assert plan.block_grid(10, 2, q.device, backward, variants.HOPPER, 64) == (10, 2)
    for causal in (False, True):
        meta = dict(ROT_DIM=0, BLOCK_D=128, BLOCK_M=64, GROUPS=2, IS_CAUSAL=causal)
        assert plan.max_registers(meta, variants.HOPPER, True, 9, 2) is None
    # Rotary at D64, one query head per kv head: the forward loops over the kv heads.
    for kv_heads, loops in ((2, True), (1, False)):
        meta, loop, _ = plan.block_plan(q, q[:, :kv_heads], 64, 64, False, False, False, False, 512, False,
                                        variants.HOPPER, variants.HOPPER.kernels()[0])
        assert loop == meta["HEAD_LOOP"] == loops
        assert meta.get("maxnreg") == (plan.HEAD_LOOP_MAXNREG if loops else plan.HOPPER_GROUP_FWD_MAXNREG[(64, False, True)])
    for backward, dim, per_sm in ((False, 64, 2), (False, 128, 2), (True, 64, 2), (True, 128, 1)):
        launcher = variants.HOPPER_WS.kernels()[backward]
        meta, loop, key = plan.block_plan(q, q, 16, 0, False, False, False, backward, 0, False, variants.HOPPER_WS,
                                          launcher)
        assert meta["BLOCK_M"] == 64 and meta["maxnreg"] == variants.HOPPER_WS.maxnreg and not loop
        sms = sm_count(q.device)
        assert plan.block_grid(1000, 2, q.device, backward, variants.HOPPER_WS, dim) == (sms * per_sm,)
        assert plan.block_grid(1, 2, q.device, backward, variants.HOPPER_WS, dim) == (2,)


def test_sm100_admission_plan_and_opt_in(monkeypatch):
    sm100 = variants.SM100
    assert sm100.call_reasons(_facts(major=10)) == [] and sm100.call_reasons(_facts(major=10, block_size=33)) == []
    for bad, words in [(dict(block_size=32), "block_size 32 < 33"), (dict(block_size=129), "129"),
                       (dict(rot=64), "rotary"),
                       (dict(block_size=128, rot=128, groups=2), "implicit positions")]:
        assert any(words in r for r in sm100.call_reasons(_facts(**dict(dict(major=10), **bad)))), bad
    assert any("sm_100" in r for r in sm100.call_reasons(_facts(major=9)))
    assert sm100.call_reasons(_facts(major=10, block_size=128, rot=128, groups=2, has_pos=True)) == []
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    for backward in (False, True):
        meta, loop, _ = plan.block_plan(q, q, 128, 0, False, False, False, backward, 0, False, sm100,
                                        sm100.kernels()[backward])
        assert meta["num_warps"] == 4 and meta["BLOCK_M"] == 128 and "maxnreg" not in meta and not loop
    monkeypatch.setattr(variants, "_UNVERIFIED", [False])
    assert any("no hardware run recorded on sm_10x" in r for r in variants.explain(_facts(major=10))["sm100"])
    assert variants.choose(_facts(major=10), q, (q,)) is variants.SIMPLE


def test_auto_takes_the_keys_backward_only_where_it_was_faster(restore_auto):
    """Among the fused backwards (``rotated`` aside), ``keys`` (the backward over key rows) runs rotary
    backwards of grouped query heads on blocks over 64 at head dims 65-128 (where it was timed faster
    than hopper and simple), on sm_90; never a forward, one query head per kv head, blocks of up to
    64 or narrower heads. Interleaved grouped-query backwards at blocks of up to 64 and D 65-128 run
    simple."""
    fused = tuple(v for v in variants.AUTO_ORDER if v is not variants.ROTATED)

    def auto(**kw):
        return variants._auto_by_facts(_facts(**kw), fused).name

    # (Since session 32 hopper_heads, before keys, takes its region but interleaved pairs at D over 96.)
    assert auto(head_dim=128, groups=4, block_size=128, rot=128, interleaved=True, backward=True) == "keys"
    for major in (8, 10):  # timed on sm_90 only
        assert auto(major=major, head_dim=128, groups=4, block_size=128, rot=128, interleaved=True,
                    backward=True) != "keys"
    without = tuple(v for v in fused if v is not variants.HOPPER_HEADS)
    assert variants._auto_by_facts(_facts(head_dim=96, groups=4, block_size=100, rot=64, backward=True),
                                   without).name == "keys"
    assert auto(head_dim=128, groups=4, block_size=128, rot=128) != "keys"
    assert auto(head_dim=128, groups=4, block_size=64, rot=128, interleaved=True, backward=True) == "simple"
    assert auto(head_dim=128, groups=4, block_size=64, rot=128, interleaved=True) == "hopper"
    for block in (16, 32):
        assert auto(head_dim=96, groups=4, block_size=block, rot=96, interleaved=True, backward=True) == "simple"
        assert auto(head_dim=64, groups=4, block_size=block, rot=64, interleaved=True, backward=True) == "hopper_packed"
    assert auto(head_dim=128, groups=1, block_size=128, rot=128, backward=True) != "keys"
    assert auto(head_dim=128, groups=4, block_size=64, rot=128, backward=True) != "keys"
    assert auto(head_dim=64, groups=4, block_size=128, rot=64, backward=True) != "keys"
    assert auto(head_dim=128, groups=4, block_size=128, backward=True) == "hopper"
    assert variants.explain(_facts(head_dim=256, groups=4, block_size=128, rot=128, backward=True))["keys"][0] == \
        "head_dim 256 > 128"


def test_auto_takes_the_rotation_pass_where_the_fused_backward_is_simple_or_keys(restore_auto):
    """``rotated`` (rotated copies of q and k, the backward without rotary, dq and dk rotated back) is
    auto's for rotary backwards of grouped query heads at head dims over 64 on blocks over 32 tokens
    where the fused backward would be simple's, keys' or the flash kernels' (session 31); never a
    forward, a call without rotary, one query head per kv head, other GPU generations, or where a
    Gluon variant takes the fused backward."""
    def auto(**kw):
        return variants._auto(_facts(**kw), torch.empty(0), ()).name

    rotary = dict(groups=4, rot=128, backward=True)
    assert auto(head_dim=128, block_size=128, **rotary) == "hopper_heads"  # keys' region (session 32)
    assert auto(head_dim=128, block_size=128, interleaved=True, **rotary) == "rotated"
    assert auto(head_dim=96, block_size=100, **dict(rotary, rot=64)) == "hopper_heads"
    assert auto(head_dim=96, block_size=100, interleaved=True, **dict(rotary, rot=96)) == "hopper_heads"
    assert auto(head_dim=128, block_size=64, interleaved=True, **rotary) == "rotated"  # simple's
    assert auto(head_dim=96, block_size=64, interleaved=True, **dict(rotary, rot=96)) == "rotated"
    assert auto(head_dim=96, block_size=64, **dict(rotary, rot=96)) == "hopper"
    assert auto(head_dim=256, block_size=64, **dict(rotary, rot=256)) == "rotated"
    assert auto(head_dim=256, block_size=128, **dict(rotary, rot=256)) == "hopper_wide"  # grouped, fused rotary
    assert auto(head_dim=256, block_size=128, **dict(rotary, rot=40)) == "rotated"  # around flash's
    assert auto(head_dim=128, block_size=64, **rotary) == "hopper"  # the fused hopper backward
    assert auto(head_dim=64, block_size=128, **dict(rotary, rot=64)) == "hopper"
    assert auto(head_dim=256, block_size=32, **dict(rotary, rot=256)) == "simple"
    assert auto(head_dim=128, block_size=128, groups=4, rot=128) == "hopper"  # forward
    assert auto(head_dim=128, block_size=128, groups=4, backward=True) == "hopper"  # no rotary
    assert auto(head_dim=256, block_size=128, rot=256, backward=True) == "hopper_wide"  # one query head per kv head
    for major in (8, 10):
        assert auto(major=major, head_dim=128, block_size=128, **rotary) != "rotated"
    reasons = variants.explain(_facts(head_dim=128, block_size=64, **rotary))
    assert reasons["rotated"] == ["auto takes another variant here: the fused hopper backward is faster on the H200"]


def test_a_backward_only_variant_stands_for_its_forward_of_in_the_forward(restore_auto):
    """``hopper_wide`` computes backwards only: forced or not, the forward of a call is its
    ``forward_of``'s (hopper's), with its admission, auto reasons, kernels and launch plan (hopper's
    split groups at D256 and register caps, not the defaults of another name)."""
    q = torch.empty(5, 4, 256, dtype=torch.bfloat16)
    for name, forward in (("hopper_wide", "hopper"), ("hopper_heads", "hopper")):
        variant = variants.VARIANTS[name]
        assert variant.forward_of == forward and variant.lse_forward is None
        with variants.forced_variant(name), warnings.catch_warnings():
            warnings.simplefilter("error")
            for block, rot in ((128, 0), (128, 256), (64, 0)):
                facts = _facts(head_dim=256, groups=2, block_size=block, rot=rot)
                assert variants.choose(facts, q, (q,)) is variants.VARIANTS[forward]
                assert variants._call_reasons(variant, facts) == variants._call_reasons(
                    variants.VARIANTS[forward], facts)
        auto = variants.explain(_facts(groups=2))[name]
        assert auto == [f"auto takes another variant here: forward: the {forward} kernels' (auto names it {forward})"]
        # Where its forward's variant cannot compute a forward, the warning names the forced variant.
        variants._WARNED.clear()
        with variants.forced_variant(name), pytest.warns(RuntimeWarning) as caught:
            variants.choose(_facts(head_dim=256, groups=2, block_size=16)._replace(dtype=torch.float32), q, (q,))
        assert f"the forced variant {name!r} (its forward: {forward}'s) cannot compute" in str(caught[0].message)
    # The plan the forward of a forced hopper_wide runs: hopper's.
    fwd = variants.HOPPER.kernels()[0]
    hopper, _, _ = plan.block_plan(q, q[:, :2], 128, 0, False, False, False, False, 0, False, variants.HOPPER, fwd)
    assert hopper["SPLIT_GROUPS"] == 2 and hopper["GROUPS"] == 1


def test_the_flash_backward_runs_without_a_variant_choice_where_it_is_fixed(monkeypatch):
    """Where no block kernel's backward fits one program, the flash kernels run it without asking the
    variant choice: for float32 tiles over one program's shared memory (flash both ways, as explain
    shows), and under a forced variant with no backward of its own there and no rotation pass (as
    before it was forced: no warning, no rotation pass). Otherwise the choice decides."""
    from blockattn_layers.ops.backends import triton_block

    ran = []
    monkeypatch.setattr(triton_block, "flash_attention_bwd", lambda *a, **kw: ran.append("flash") or (a[1], a[2], a[3]))

    def chosen(*args):
        ran.append("choice")
        return variants.SIMPLE

    monkeypatch.setattr(triton_block, "backward_variant", chosen)

    def backward(dtype, heads, kv_heads, dim, block, rotary):
        q = torch.zeros(10, heads, dim, dtype=dtype)
        k = torch.zeros(10, kv_heads, dim, dtype=dtype)
        ran.clear()
        triton_block._backward(q, q, k, k, q, None, torch.tensor([0, 10]), block, 0.1, False,
                               1e4 if rotary else None, None, dim, False, None, None)
        return ran

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backward(torch.float32, 4, 1, 128, 128, True) == ["flash"]  # float32 128 x 128 tiles
        for name in ("simple", "hopper"):
            with variants.forced_variant(name):
                assert backward(torch.bfloat16, 4, 1, 256, 128, True) == ["flash"]
                assert backward(torch.bfloat16, 2, 2, 256, 128, False) == ["flash"]
        for name in ("auto", "hopper_wide", "rotated"):
            with variants.forced_variant(name):
                assert backward(torch.bfloat16, 4, 1, 256, 128, True) == ["choice", "flash"]
        assert backward(torch.float32, 4, 1, 128, 64, True)[0] == "choice"  # float32 64 x 128 tiles fit


def test_the_stored_dq_flash_backward_runs_where_the_forward_saved_lse_and_no_variant_is_forced(monkeypatch):
    """Grouped query heads on blocks of 65-128 tokens at D 128: the backward runs on the flash kernel with dQ
    stored where the forward saved out and lse (``saves_lse``), the kernel takes the call (``stored_dq_takes``,
    stubbed here: CPU tensors; for a rotary call, the call without rotary) and no variant is forced, a rotary
    call's through the rotation pass without the variant choice; else the variant choice decides (a rotary call
    with no lse saved, even through the rotation pass)."""
    ran = []
    monkeypatch.setattr(triton_block, "flash_attention_bwd", lambda *a, **kw: ran.append("flash") or (a[1], a[2], a[3]))
    monkeypatch.setattr(triton_block, "block_attention_bwd", lambda *a, **kw: ran.append("block") or a[1:4])
    takes = []
    monkeypatch.setattr(triton_block, "stored_dq_takes",
                        lambda do, q, k, v, block, rope: takes.append(rope) or rope is None)
    monkeypatch.setattr(triton_block, "backward_variant",
                        lambda do, q, k, v, block, rot, *rest: ran.append("choice") or (chosen[0] if rot else
                                                                                         variants.HOPPER))
    monkeypatch.setattr(triton_block, "rotated_backward", lambda inner, q, k, *rotate, **kw: inner(q, k))
    chosen = [variants.HOPPER]
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 128, dtype=torch.bfloat16)

    def backward(lse_rows, rope=None):
        ran.clear()
        lse = torch.zeros(4, lse_rows)
        triton_block._backward(q, q, k, k, q, lse, torch.tensor([0, 10]), 128, 0.1, False, rope, None, 128, False,
                               None, None)
        return ran

    with variants.forced_variant("auto"):
        assert backward(10) == ["flash"]
        assert backward(0) == ["choice", "block"]
        assert backward(10, rope=1e4) == ["flash"] and takes[-3:] == [1e4, None, None]  # rotary, as is, then not
        chosen[0] = variants.ROTATED
        assert backward(0, rope=1e4) == ["choice", "choice", "block"]
    with variants.forced_variant("hopper"):
        chosen[0] = variants.HOPPER
        assert backward(10) == ["choice", "block"]


def test_a_rotary_stored_dq_backward_skips_the_back_rotation_pass_where_the_kernel_rotates_back(monkeypatch):
    """A rotary call whose forward saved lse, where the flash kernel with dQ stored rotates dq and dk back itself
    (``stored_dq_unrotates``, stubbed here: CPU tensors; asked of the rotated copies, whose layout the kernel
    reads): the rotation pass writes the rotated copies, the kernel gets the rotation (``unrotate``: theta,
    positions, rotary channels, layout) and no second pass runs; where it does not, the second pass rotates them
    back."""
    from blockattn_layers.kernels.block import rotation

    passes, got, asked = [], [], []
    monkeypatch.setattr(rotation, "rotate_rows", lambda a, b, *rest, **kw: passes.append(rest[-2]) or (
        (a, b) if rest[-1] else (a.clone(), b.clone())))
    monkeypatch.setattr(triton_block, "stored_dq_takes", lambda do, q, k, v, block, rope: rope is None)
    monkeypatch.setattr(triton_block, "flash_attention_bwd",
                        lambda *a, **kw: got.append((a[10], kw.get("unrotate"))) or (a[1], a[2], a[3]))
    unrotates = [True]
    monkeypatch.setattr(triton_block, "stored_dq_unrotates", lambda do, q, k, v, block, rot, interleaved: asked.append(
        (q, k)) or (unrotates[0] and rot == 64 and interleaved))
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    pos = torch.arange(10)

    def backward():
        passes.clear()
        got.clear()
        triton_block._backward(q, q, k, k, q, torch.zeros(4, 10), torch.tensor([0, 10]), 128, 0.1, False, 1e4, pos,
                               64, True, None, None)
        return passes, got

    with variants.forced_variant("auto"):
        assert backward() == ([False], [(None, (1e4, pos, 64, True))])  # the forward rotation only
        assert asked and all(x is not q and y is not k for x, y in asked)
        unrotates[0] = False
        assert backward() == ([False, True], [(None, None)])  # and the back rotation


def test_the_triton_backend_routes_wide_backwards_to_hopper_wide_only_where_it_is_chosen(monkeypatch):
    """Blocks over 64 tokens at head dims over 128 (``one_tile_backward_fits`` refuses them): the block
    kernels compute the backward where the choice takes a variant with a backward for them (hopper_wide
    on sm_90: one query head per kv head, no rotary), else the flash kernels; a forced variant without
    one keeps the flash kernels."""
    from blockattn_layers.kernels.block import bwd

    q, k = torch.empty(300, 2, 256, dtype=torch.bfloat16), torch.empty(300, 2, 256, dtype=torch.bfloat16)
    assert not bwd.one_tile_backward_fits(128, 256, torch.bfloat16)
    def wide(*args):
        return bwd.wide_backward_runs(bwd.backward_variant(*args))

    assert not wide(q, q, k, k, 128, 0, False, False)  # CPU tensors: no sm_90 GPU
    on_sm90 = variants.call_facts

    def facts(*args, **kwargs):
        return on_sm90(*args, **kwargs)._replace(device_type="cuda", major=9)

    monkeypatch.setattr(bwd, "call_facts", facts)
    assert wide(q, q, k, k, 128, 0, False, False)
    assert wide(q, q, k, k, 100, 0, False, False)
    assert wide(q, q, k, k, 128, 256, False, False)  # rotary, split halves
    assert wide(q, q, k, k, 128, 128, True, True)  # partial, interleaved, given positions
    assert not wide(q, q, k, k, 128, 40, False, False)  # rotary_dim not whole chunks
    gqa = torch.empty(300, 4, 256, dtype=torch.bfloat16)
    assert wide(gqa, gqa, k, k, 128, 0, False, False)  # grouped query heads one by one
    assert wide(gqa, gqa, k, k, 128, 256, False, False)
    assert bwd.backward_variant(gqa, gqa, k, k, 128, 40, False, False).name == "rotated"  # around flash
    assert not wide(q.float(), q.float(), k.float(), k.float(), 128, 0, False, False)
    for name in ("simple", "hopper"):  # (hopper cannot compute it: auto's choice would be hopper_wide)
        with variants.forced_variant(name):
            assert not wide(q, q, k, k, 128, 0, False, False)
    for name in ("hopper_wide", "rotated"):  # (rotated: no rotary here, so auto's, hopper_wide)
        with variants.forced_variant(name):
            assert wide(q, q, k, k, 128, 0, False, False)


def test_auto_takes_hopper_heads_for_rotary_grouped_backwards_on_blocks_over_64(restore_auto):
    """``hopper_heads`` (the hopper backward one query head per program, dK and dV summed over the group
    after) is auto's for rotary backwards of grouped query heads on blocks over 64 at head dims 65-128
    (session 32), but interleaved pairs or partial rotary at D over 96 (the rotation pass); never a forward, a call
    without rotary, one query head per kv head, blocks of up to 64 or other generations."""
    def auto(**kw):
        return variants._auto(_facts(**kw), torch.empty(0), ()).name

    rotary = dict(groups=4, rot=96, head_dim=96, backward=True)
    for block in (65, 100, 128):
        assert auto(block_size=block, **rotary) == "hopper_heads"
    assert auto(block_size=128, **dict(rotary, rot=48, has_pos=True)) == "hopper_heads"
    assert auto(block_size=128, interleaved=True, **rotary) == "hopper_heads"
    assert auto(block_size=128, interleaved=True, **dict(rotary, head_dim=128, rot=128)) == "rotated"
    assert auto(block_size=128, **dict(rotary, head_dim=128, rot=128)) == "hopper_heads"
    assert auto(block_size=128, **dict(rotary, head_dim=128, rot=64)) == "rotated"
    assert auto(block_size=64, **rotary) == "hopper"
    assert auto(block_size=128, **dict(rotary, rot=0)) == "hopper"
    assert auto(block_size=128, **dict(rotary, head_dim=64, rot=64)) == "hopper"
    assert auto(block_size=128, **dict(rotary, groups=1)) == "hopper"
    assert auto(block_size=128, **dict(rotary, backward=False)) == "hopper"
    assert auto(block_size=128, major=10, **rotary) != "hopper_heads"
    with variants.forced_variant("hopper_heads"), warnings.catch_warnings():
        warnings.simplefilter("error")
        q = torch.empty(5, 4, 96, dtype=torch.bfloat16)
        assert variants.choose(_facts(block_size=64, **rotary), q, (q,)) is variants.HOPPER_HEADS


def test_hopper_heads_launches_hoppers_kernels_with_hoppers_plan():
    """``Variant.kernels_of``: the backward launch of hopper_heads is hopper's kernel and launch plan
    (register caps included), planned for the call it sees (one query head per kv head)."""
    from blockattn_layers.kernels.block import bwd

    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    flags = (64, 128, False, False, False, 0, False)  # block 64, rotary D128: hopper's capped plan
    heads = bwd._plan(variants.HOPPER_HEADS, q, q, 3, *flags)
    hopper = bwd._plan(variants.HOPPER, q, q, 3, *flags)
    assert heads[0] is hopper[0] and heads[1] == hopper[1] and heads[1]["maxnreg"] == 168
    assert variants.HOPPER_HEADS.group_partials and not variants.HOPPER.group_partials


def test_the_backwards_64_bit_addressing_counts_the_gradients():
    """The contiguous gradients can span more than the inputs: an expanded q (rows of stride 0) spans
    one row, its dq all of them."""
    from blockattn_layers.kernels.block.bwd import grads_need_int64

    row = torch.zeros(1, 1, 16)
    q = row.expand(2**27, 1, 16)  # 2**31 elements, one row of memory
    assert grads_need_int64(q, q, row, row)
    assert not grads_need_int64(row, row, row, row)
