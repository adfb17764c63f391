"""The rotation pass (``kernels.block.rotation``) and the ``rotated`` variant: a rotary backward as
rotated copies of q and k, the backward without rotary, and dq, dk rotated back in place.

Through Triton's interpreter on CPU (fp32, fp16), against the float64 oracle; the GPU runs are in
``test_triton_gpu.py``.
"""
import dataclasses
import warnings

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers.ops.backends.triton_block import interpreter_active

from tests.oracle import oracle_rotate, offsets_from_lengths, rel_err, rotary_positions

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="CPU interpreter tests")

# Empty and one-token sequences, lengths around the pass's 32-row chunks and the blocks.
LENGTHS = [0, 1, 31, 32, 33, 0, 70, 5, 129]


def _sequence_positions(lengths):
    return [float(i) for n in lengths for i in range(n)]


@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("dim,rotary_dim,interleaved,positions", [
    (64, 64, False, None), (48, 32, True, None), (96, 64, False, "int"), (32, 32, True, "float"),
])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotation_pass_matches_the_oracle(monkeypatch, table, dim, rotary_dim, interleaved, positions, inverse):
    """Copies (channels past ``rotary_dim`` copied) and in place (only the rotary channels written),
    forward and transpose rotations, two tensors of different head counts, with the in-kernel
    schedule or the block table."""
    from blockattn_layers.kernels.block.rotation import rotate_rows
    from blockattn_layers.kernels.common import schedule

    if table:
        monkeypatch.setattr(schedule, "INLINE_MAX_SEQS", 0)
    total = sum(LENGTHS)
    g = torch.Generator().manual_seed(dim + rotary_dim)
    a, b = torch.randn(total, 3, dim, generator=g), torch.randn(total, 1, dim, generator=g)
    pos, tol = rotary_positions(positions, total)
    tol = tol or 2e-5
    pos_list = _sequence_positions(LENGTHS) if pos is None else pos.tolist()
    # The transpose rotation is the rotation by the negated positions.
    angle_pos = [-p for p in pos_list] if inverse else pos_list
    want = [oracle_rotate(x.double(), angle_pos, 1e4, rotary_dim, interleaved) for x in (a, b)]
    offsets = offsets_from_lengths(LENGTHS, torch.int32)
    copies = rotate_rows(a, b, offsets, None, 1e4, pos, rotary_dim, interleaved, inverse, False)
    for got, ref, src in zip(copies, want, (a, b)):
        assert got.data_ptr() != src.data_ptr() and got.is_contiguous()
        assert rel_err(got, ref) < tol
    in_place = (a.clone(), b.clone())
    rotate_rows(*in_place, offsets, None, 1e4, pos, rotary_dim, interleaved, inverse, True)
    for got, ref in zip(in_place, want):
        assert rel_err(got, ref) < tol


@pytest.mark.parametrize("dim,rot,chunk", [(128, 128, 32), (96, 96, 16), (64, 64, 16), (96, 48, 8), (128, 96, 16)])
def test_rotation_pass_writes_copies_in_paired_chunks(dim, rot, chunk):
    """``pair_chunk``: split halves over ``rot`` channels into copies whose rotary channels come in the paired-chunk
    order (``reference.paired_chunks``), the channels past them copied in place; refused in place, interleaved or
    where the rotary channels are no whole pairs of chunks."""
    from blockattn_layers.kernels.block.rotation import rotate_rows
    from blockattn_layers.reference import paired_chunks, unpaired_chunks

    total = sum(LENGTHS)
    g = torch.Generator().manual_seed(dim + rot)
    a, b = torch.randn(total, 3, dim, generator=g), torch.randn(total, 1, dim, generator=g)
    offsets = offsets_from_lengths(LENGTHS, torch.int32)
    pos = _sequence_positions(LENGTHS)
    copies = rotate_rows(a, b, offsets, None, 1e4, None, rot, False, False, False, pair_chunk=chunk)
    for got, src in zip(copies, (a, b)):
        rotated = oracle_rotate(src.double(), pos, 1e4, rot, False)
        want = paired_chunks(rotated, chunk, rot)
        assert rel_err(got, want) < 2e-5
        assert torch.equal(got[..., rot:], src[..., rot:])
        assert torch.equal(unpaired_chunks(want, chunk, rot), rotated)
    for bad in (dict(in_place=True), dict(interleaved=True), dict(rotary_dim=rot - chunk)):
        args = {**dict(rotary_dim=rot, interleaved=False, in_place=False), **bad}
        with pytest.raises(ValueError, match="pair_chunk"):
            rotate_rows(a, b, offsets, None, 1e4, None, args["rotary_dim"], args["interleaved"], False,
                        args["in_place"], pair_chunk=chunk)


def test_rotation_pass_with_64_bit_addressing(monkeypatch):
    """The pass's 64-bit element offsets (``needs_int64``: tensors past 2**31 elements), forced on
    small tensors: the same result as the 32-bit offsets."""
    from blockattn_layers.kernels.block import rotation

    total = sum(LENGTHS)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(total, 2, 64, generator=g), torch.randn(total, 1, 64, generator=g)
    offsets = offsets_from_lengths(LENGTHS)
    args = (offsets, None, 1e4, None, 48, True, False, False)
    want = rotation.rotate_rows(a, b, *args)
    monkeypatch.setattr(rotation, "needs_int64", lambda *tensors: True)
    got = rotation.rotate_rows(a, b, *args)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_rotation_pass_of_an_empty_batch():
    from blockattn_layers.kernels.block.rotation import rotate_rows

    a, b = torch.empty(0, 2, 32), torch.empty(0, 1, 32)
    qa, qb = rotate_rows(a, b, torch.zeros(3, dtype=torch.int64), None, 1e4, None, 32, False, False, False)
    assert qa.shape == a.shape and qb.shape == b.shape


ROTATED_CASES = [
    dict(heads=4, kv_heads=2, dim=32, block_size=64, rope_theta=1e4, causal=True),
    dict(heads=3, kv_heads=1, dim=48, block_size=100, rope_theta=500.0, rotary_dim=16, rotary_interleaved=True),
    dict(heads=2, kv_heads=2, dim=32, block_size=16, rope_theta=1e4, positions="float"),
    # The flash backward (blocks over 64 at head dims over 128), on the saved logsumexp.
    dict(heads=2, kv_heads=1, dim=144, block_size=80, rope_theta=1e4, rotary_dim=64, causal=True),
]


@pytest.mark.parametrize("case", ROTATED_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_rotated_variant_matches_the_oracle(monkeypatch, case):
    """``rotated`` forced: the backward runs the rotation pass twice around the backward without
    rotary, and forward and gradients match the float64 oracle on edge lengths (fp32, fp16)."""
    from blockattn_layers.kernels.block import rotation, variants
    from tests.test_triton_interpret import EDGE_LENGTHS, _check

    passes = []
    real = rotation.rotate_rows

    def counted(*args, **kwargs):
        passes.append(args[-2:])  # (inverse, in_place)
        return real(*args, **kwargs)

    monkeypatch.setattr(rotation, "rotate_rows", counted)
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    tol = {}
    if case.get("positions") == "float":
        case["positions"], tol["tol"] = rotary_positions("float", sum(EDGE_LENGTHS))
    # (float32 tiles over one program's shared memory run the flash kernels both ways, no variant.)
    dtypes = (torch.float16,) if dim > 128 else (torch.float32, torch.float16)
    with variants.forced_variant("rotated"), warnings.catch_warnings():
        # Its forward and inner backward run auto's choice, unwarned.
        warnings.filterwarnings("error", message="block kernels: the forced variant")
        for dtype in dtypes:
            passes.clear()
            _check(EDGE_LENGTHS, heads, kv_heads, dim, dtype, **case, **tol)
            assert passes == [(False, False), (True, True)]


def test_rotated_is_a_rotary_backward_only():
    from blockattn_layers.kernels.block import variants

    q, k = torch.empty(1, 4, 128, dtype=torch.bfloat16), torch.empty(1, 1, 128, dtype=torch.bfloat16)

    def facts(**kw):
        return variants.call_facts(q, k, 128, kw.pop("rot", 128), False, False, **kw)._replace(major=9)

    reasons = variants.explain(facts(backward=False))
    assert reasons["rotated"][0].startswith("forward: the fused rotary kernels run it")
    assert variants.explain(facts(rot=0, backward=True))["rotated"][0] == "no rotary"
    with variants.forced_variant("rotated"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="block kernels: the forced variant")
        assert variants.choose(facts(backward=True), q, (q,)) is variants.ROTATED
        assert variants.choose(facts(backward=False), q, (q,)) is not variants.ROTATED
        assert variants.choose(facts(rot=0, backward=True), q, (q,)) is not variants.ROTATED


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_rotated_backward_confines_a_nan_to_its_block():
    from tests.test_triton_interpret import _nan_confined

    assert _nan_confined("rotated", 32, 4, 2, 32, True)


def test_explain_shows_the_backward_on_rotated_copies():
    from blockattn_layers.dispatch import AttentionRequest, running_variants
    from blockattn_layers.ops.backends.triton_block import ROTATED_COPIES, _variant_reasons

    req = AttentionRequest("cuda", (9, 0), torch.bfloat16, 256, 4, 1, 64, False, True)
    running, phases = running_variants(_variant_reasons(req))
    assert running == "hopper" and phases == {"backward": "rotated", ROTATED_COPIES: "simple"}
    # Blocks over 64 at D256: hopper_wide's fused rotary backward, but not at a rotary_dim of 40.
    wide = dataclasses.replace(req, block_size=128)
    assert running_variants(_variant_reasons(wide))[1] == {"backward": "hopper_wide"}
    odd = running_variants(_variant_reasons(dataclasses.replace(wide, rotary_dim=40)))[1]
    assert odd == {"backward": "rotated", ROTATED_COPIES: "hopper_wide"}
    plain = AttentionRequest("cuda", (9, 0), torch.bfloat16, 256, 4, 1, 128, False, False)
    assert ROTATED_COPIES not in running_variants(_variant_reasons(plain))[1]


# Rotary calls that save lse with grouped query heads at D 128 (``library.GROUPED_SAVES_LSE_ROTARY``).
ON_ROTATED_CASES = [
    dict(heads=4, kv_heads=2, block_size=100, rope_theta=1e4, rotary_interleaved=True, causal=True),
    dict(heads=4, kv_heads=1, block_size=128, rope_theta=500.0, rotary_dim=64, positions="float"),
    # Split halves over every channel: the copies in the paired-chunk order (``flash_bwd.pair_chunk``).
    dict(heads=4, kv_heads=2, block_size=128, rope_theta=1e4),
    # Over 96 and 48 of the 128 channels: the copies' rotary channels in paired chunks of 16 and 8, the rest after.
    dict(heads=4, kv_heads=1, block_size=128, rope_theta=1e4, rotary_dim=96, causal=True),
    dict(heads=4, kv_heads=2, block_size=100, rope_theta=500.0, rotary_dim=48, positions="float"),
]


def _rotated_copies_taken(monkeypatch):
    """The copies' forward taking what it takes on sm_90 (the Gluon kernel's facts there), and the rotation passes
    recorded as ``(inverse, in_place)``."""
    from blockattn_layers.kernels.block import rotation
    from blockattn_layers.ops.backends import triton_block

    monkeypatch.setattr(triton_block, "stored_dq_reasons", lambda *args: [])
    monkeypatch.setattr(triton_block, "stored_dq_unrotates_facts", lambda *args: True)
    passes = []
    real = rotation.rotate_rows
    monkeypatch.setattr(rotation, "rotate_rows", lambda *a, **kw: passes.append(a[-2:]) or real(*a, **kw))
    return passes


def _grouped_rotary_inputs(case, dtype=torch.float16):
    from tests.test_triton_interpret import EDGE_LENGTHS, _inputs, _offsets

    case = dict(case)
    heads, kv_heads = case.pop("heads"), case.pop("kv_heads")
    if case.get("positions") == "float":
        case["positions"], _ = rotary_positions("float", sum(EDGE_LENGTHS))
    q, k, v = _inputs(EDGE_LENGTHS, heads, kv_heads, 128, dtype, seed=heads)
    return q, k, v, _offsets(EDGE_LENGTHS), case


@pytest.mark.parametrize("case", ON_ROTATED_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_on_rotated_copies_matches_the_oracle(monkeypatch, case):
    """Where the copies' forward takes an eager call with gradients (``triton_block.SAVES_ROTATED_COPIES``): the
    rotation pass runs in the forward, the forward without rotary on its copies, and autograd saves the copies in
    place of q and k; the backward (on the CPU without the Gluon kernel that rotates dq and dk back: the backward
    without rotary on the copies, then the pass back in place) matches the float64 oracle (fp16)."""
    from tests.test_triton_interpret import EDGE_LENGTHS, _check

    passes = _rotated_copies_taken(monkeypatch)
    q, k, v, offsets, kw = _grouped_rotary_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = bl.block_attention(*leaves, offsets, backend="triton", **kw)
    assert passes == [(False, False)]
    saved = out.grad_fn.saved_tensors
    assert all(s.data_ptr() != x.data_ptr() for s, x in zip(saved[:2], leaves[:2]))
    assert saved[2].data_ptr() == leaves[2].data_ptr()
    passes.clear()
    case = dict(case)
    heads, kv_heads = case.pop("heads"), case.pop("kv_heads")
    tol = {}
    if case.get("positions") == "float":
        case["positions"], tol["tol"] = rotary_positions("float", sum(EDGE_LENGTHS))
    _check(EDGE_LENGTHS, heads, kv_heads, 128, torch.float16, seed=heads, **case, **tol)
    assert passes == [(False, False), (True, True)]


@pytest.mark.parametrize("by_pass", [True, False], ids=["rotated-back-by-pass", "switch-off"])
def test_forward_on_rotated_copies_where_a_pass_rotates_back(monkeypatch, by_pass):
    """Where the kernel does not rotate dq and dk back (split halves over 80 of 128 channels), the copies' forward
    takes the call with ``COPIES_ROTATED_BACK_BY_PASS`` (the backward: the flash kernel on the copies, then the pass
    back in place), matching the float64 oracle; with it off the forward rotates in its kernel (and here, on the CPU
    without the flash kernel, the backward too)."""
    from tests.test_triton_interpret import EDGE_LENGTHS, _check
    from blockattn_layers.ops.backends import triton_block

    passes = _rotated_copies_taken(monkeypatch)
    monkeypatch.setattr(triton_block, "stored_dq_unrotates_facts", lambda *args: False)
    monkeypatch.setattr(triton_block, "COPIES_ROTATED_BACK_BY_PASS", by_pass)
    case = dict(heads=4, kv_heads=2, block_size=128, rope_theta=1e4, rotary_dim=80)
    q, k, v, offsets, kw = _grouped_rotary_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = bl.block_attention(*leaves, offsets, backend="triton", **kw)
    assert passes == ([(False, False)] if by_pass else [])
    assert (out.grad_fn.saved_tensors[0].data_ptr() != leaves[0].data_ptr()) == by_pass
    passes.clear()
    _check(EDGE_LENGTHS, 4, 2, 128, torch.float16, seed=4, **kw)
    assert passes == ([(False, False), (True, True)] if by_pass else [])


def test_forward_on_rotated_copies_only_with_gradients(monkeypatch):
    """Without gradients, with the switch off, or with a variant forced, the forward rotates in its kernel and no
    rotation pass runs in it."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.ops.backends import triton_block

    passes = _rotated_copies_taken(monkeypatch)
    q, k, v, offsets, kw = _grouped_rotary_inputs(ON_ROTATED_CASES[0])
    with torch.no_grad():
        bl.block_attention(q, k, v, offsets, backend="triton", **kw)
    with variants.forced_variant("simple"):
        bl.block_attention(q.requires_grad_(), k, v, offsets, backend="triton", **kw)
    monkeypatch.setattr(triton_block, "SAVES_ROTATED_COPIES", False)
    out = bl.block_attention(q, k, v, offsets, backend="triton", **kw)
    assert passes == []
    assert out.grad_fn.saved_tensors[0].data_ptr() == q.data_ptr()


def test_backward_on_rotated_copies_under_a_dispatch_mode(monkeypatch):
    """A backward run under a dispatch mode (``FlopCounterMode``: its gradients are no plain tensors) goes through
    the op without rotary on the saved copies and rotates dq and dk back with the reference rotation: the same
    gradients as the eager backward."""
    from torch.utils.flop_counter import FlopCounterMode

    _rotated_copies_taken(monkeypatch)
    q, k, v, offsets, kw = _grouped_rotary_inputs(ON_ROTATED_CASES[1], torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for mode in (None, FlopCounterMode(display=False)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = bl.block_attention(*leaves, offsets, backend="triton", **kw)
        with mode if mode is not None else torch.enable_grad():
            grads.append(torch.autograd.grad(out, leaves, grad_out))
        if mode is not None:
            assert mode.get_total_flops() > 0
    for eager, traced in zip(*grads):
        assert rel_err(traced, eager.double()) < 1e-4  # (the reference rotation against the pass: float32 rounding)


def test_explain_shows_the_forward_on_rotated_copies(monkeypatch):
    """On sm_90, a grouped D128 block-128 call with interleaved rotary (its backward the flash kernel with dQ stored,
    rotating back itself) shows the eager forward on rotated copies and its variant, split halves over every channel
    too, and over 96 channels (in paired chunks too, ``PAIRED_PARTIAL``); split halves over 80 (rotated back by a
    second pass) only with ``COPIES_ROTATED_BACK_BY_PASS``, and none with the switch off."""
    from blockattn_layers.dispatch import AttentionRequest, running_variants
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.ops.backends import triton_block

    if variants.gluon_import_error() is not None:
        pytest.skip("the Gluon kernels do not import here")
    req = AttentionRequest("cuda", (9, 0), torch.bfloat16, 128, 8, 2, 128, False, True, 0, True)
    reasons = triton_block._variant_reasons(req)
    # (running_variants leaves out a phase whose variant is the forward's own, hopper here.)
    assert reasons[f"{triton_block.FORWARD_ON_ROTATED}: hopper"] == []
    assert running_variants(reasons)[1][triton_block.ROTATED_COPIES] == triton_block.FLASH

    def shown(request):
        return any(name.startswith(triton_block.FORWARD_ON_ROTATED) for name in triton_block._variant_reasons(request))

    assert shown(dataclasses.replace(req, rotary_interleaved=False))  # split halves, in paired chunks
    assert shown(dataclasses.replace(req, rotary_interleaved=False, rotary_dim=80))  # rotated back by a pass
    monkeypatch.setattr(triton_block, "COPIES_ROTATED_BACK_BY_PASS", False)
    assert shown(dataclasses.replace(req, rotary_interleaved=False, rotary_dim=96))
    assert not shown(dataclasses.replace(req, rotary_interleaved=False, rotary_dim=80))
    monkeypatch.setattr(triton_block, "SAVES_ROTATED_COPIES", False)
    assert not shown(req)
