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
