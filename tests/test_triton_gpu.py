"""Triton backend on a CUDA GPU: accuracy against a float64 oracle, production shapes,
NaN-poisoned memory, bitwise determinism, CUDA graphs, 64-bit addressing, torch.compile.

The oracle is the reference path run in float64 (itself checked against plain loops in
test_reference.py). A kernel passes when its error is within a small factor of the error of
the same computation done naively in the input dtype (2x forward, 3x gradients), with a
floor for tiny errors.

Most of the time goes to JIT-compiling kernel variants on the CPU: run with ``-n 8``
(pytest-xdist) on a multi-core GPU machine.
"""
import contextlib
import gc

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import reference
from blockattn_layers.kernels.block import variants
from blockattn_layers.runtime import caches

pytestmark = pytest.mark.gpu

DEV = "cuda"
EDGE_LENGTHS = [0, 1, 63, 64, 65, 130, 0, 7, 128, 1, 200]


def make_inputs(lengths, heads, kv_heads, dim, dtype, seed=0, positions=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = int(sum(lengths))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    q = torch.randn(total, heads, dim, device=DEV, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, dim, device=DEV, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, dim, device=DEV, generator=g).to(dtype)
    return q, k, v, offsets.to(DEV)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_oracle(q, k, v, offsets, fwd_factor=2.0, grad_factor=3.0, floor=None, **kw):
    """Triton fwd/grads vs the float64 oracle, relative to the same-dtype naive error."""
    floor = floor if floor is not None else {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[q.dtype]
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, backend="triton", **kw)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    params = bl._validation.validate_attention_args(
        q, k, v, offsets, kw.pop("block_size", 64), scale=kw.pop("scale", None), causal=kw.pop("causal", False),
        rope_theta=kw.pop("rope_theta", None), positions=kw.pop("positions", None),
        rotary_dim=kw.pop("rotary_dim", None), rotary_interleaved=kw.pop("rotary_interleaved", False),
        cpu_offsets=None, max_seqlen=None, validate=False,
    )
    args = params.op_args()
    ref_args = (params.block_size,) + args[1:8]
    d = [x.double() for x in (q, k, v)]
    oracle = reference.attention_forward(*d, offsets, *ref_args)
    oracle_grads = reference.attention_backward(grad_out.double(), *d, offsets, *ref_args)
    naive, naive_grads = _naive(q, k, v, offsets, grad_out, params)
    assert torch.isfinite(out).all()
    err, base = rel(out, oracle), rel(naive, oracle)
    assert err <= max(fwd_factor * base, floor), f"forward error {err:.3e} vs naive {base:.3e}"
    for name, g_, o_, n_ in zip("qkv", grads, oracle_grads, naive_grads):
        err, base = rel(g_, o_), rel(n_, o_)
        assert err <= max(grad_factor * base, 1.5 * floor), f"d{name} error {err:.3e} vs naive {base:.3e}"


def _naive(q, k, v, offsets, grad_out, params):
    """The same attention computed naively in q's dtype: the bound a kernel's error is held to.
    Rotary is applied in float64 first (the kernels rotate in float32), so that the naive error
    is attention's in that dtype, not the rotation angles' (fp16 angles of positions in the
    thousands would make every bound loose)."""
    ref_args = (params.block_size, params.scale, params.causal)
    if params.rope_theta is None:
        out = reference.attention_forward(q, k, v, offsets, *ref_args, dtype=q.dtype)
        return out, reference.attention_backward(grad_out, q, k, v, offsets, *ref_args, dtype=q.dtype)
    pos = params.positions if params.positions is not None else reference.sequence_positions(offsets, q.shape[0])
    angles = reference.rotary_angles(pos, params.rope_theta, params.rotary_dim, torch.float64)
    rotate = dict(rotary_dim=params.rotary_dim, interleaved=params.rotary_interleaved)
    qr, kr = (reference.apply_rotary(x.double(), angles, **rotate).to(q.dtype) for x in (q, k))
    out = reference.attention_forward(qr, kr, v, offsets, *ref_args, dtype=q.dtype)
    dq, dk, dv = reference.attention_backward(grad_out, qr, kr, v, offsets, *ref_args, dtype=q.dtype)
    dq, dk = (reference.apply_rotary(g.double(), angles, inverse=True, **rotate) for g in (dq, dk))
    return out, (dq, dk, dv)


CASES = [
    dict(heads=4, kv_heads=4, dim=64, block_size=64),
    dict(heads=4, kv_heads=2, dim=128, block_size=64, causal=True),
    dict(heads=4, kv_heads=1, dim=32, block_size=100),
    dict(heads=8, kv_heads=2, dim=32, block_size=128, rope_theta=10000.0, causal=True),
    dict(heads=2, kv_heads=2, dim=80, block_size=48, causal=True),
    dict(heads=2, kv_heads=2, dim=256, block_size=32),
    dict(heads=2, kv_heads=1, dim=16, block_size=128, causal=True),
    dict(heads=4, kv_heads=2, dim=128, block_size=64, rope_theta=10000.0),
    dict(heads=2, kv_heads=2, dim=64, block_size=64, rope_theta=500.0, rotary_dim=32, rotary_interleaved=True, causal=True),
    dict(heads=2, kv_heads=1, dim=128, block_size=64, rope_theta=10000.0, positions="float"),
    dict(heads=2, kv_heads=2, dim=64, block_size=16, rope_theta=10000.0, positions="int"),
    dict(heads=4, kv_heads=1, dim=64, block_size=128, rope_theta=10000.0, causal=True),
    dict(heads=4, kv_heads=2, dim=192, block_size=128),
]


def _case_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items())


# bf16 on every case; fp16 and fp32 on a few (each new variant costs a JIT compile).
ACCURACY = [(c, torch.bfloat16) for c in CASES] + [
    (CASES[i], dt) for i in (1, 3, 7) for dt in (torch.float16, torch.float32)
]


@pytest.mark.parametrize("case,dtype", ACCURACY, ids=lambda x: _case_id(x) if isinstance(x, dict) else str(x))
def test_accuracy_edge_lengths(case, dtype):
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    q, k, v, offsets = make_inputs(EDGE_LENGTHS * 3, heads, kv_heads, dim, dtype, seed=len(_case_id(case)))
    pos = case.pop("positions", None)
    if pos == "float":
        case["positions"] = torch.rand(q.shape[0], device=DEV) * 5000
    elif pos == "int":
        case["positions"] = torch.randint(0, 4000, (q.shape[0],), device=DEV)
    check_against_oracle(q, k, v, offsets, **case)


@pytest.mark.parametrize("case", [
    dict(heads=2, kv_heads=2, dim=128, block_size=128),
    dict(heads=4, kv_heads=2, dim=256, block_size=64, causal=True),
    dict(heads=4, kv_heads=1, dim=256, block_size=128, rope_theta=10000.0),
], ids=_case_id)
def test_float32_with_tf32_products_at_large_tiles(case):
    """float32 with TF32 allowed at tiles whose operands would not fit a program's shared memory,
    with TF32 or IEEE products (128 x 128, 64 x 256, 128 x 256): the op layer runs them on the flash
    kernels, so the calls run and match the oracle as float32 does."""
    from tests.oracle import tf32_products

    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    q, k, v, offsets = make_inputs(EDGE_LENGTHS, heads, kv_heads, dim, torch.float32, seed=dim)
    with tf32_products():
        check_against_oracle(q, k, v, offsets, floor=4e-3, **case)


# Issue 25's shape grid, covered: every (block, head dim) pair of the grid once, with the heads,
# rotary forms, causal setting and dtype rotating so that each block meets every rotary form, each
# head dim every head layout, and both dtypes and causal settings appear in every block.
GRID_BLOCKS = (16, 32, 64, 128)
GRID_DIMS = (32, 64, 96, 128, 256)
GRID_HEADS = ((2, 2), (8, 2), (4, 1))
GRID_ROTARY = ("none", "split", "interleaved", "partial")


def _grid_case(b: int, d: int) -> dict:
    block, dim = GRID_BLOCKS[b], GRID_DIMS[d]
    heads, kv_heads = GRID_HEADS[(d + 2 * b) % 3]
    case = dict(heads=heads, kv_heads=kv_heads, dim=dim, block_size=block, causal=bool((b + d) % 2))
    rotary = GRID_ROTARY[(b + d) % 4]
    if rotary != "none":
        case.update(rope_theta=1e4, rotary_interleaved=rotary == "interleaved")
        if rotary == "partial":
            case["rotary_dim"] = dim // 2
    case["dtype"] = "fp16" if (b * len(GRID_DIMS) + d) % 3 == 0 else "bf16"
    return case


GRID_CASES = [_grid_case(b, d) for b in range(len(GRID_BLOCKS)) for d in range(len(GRID_DIMS))]


@pytest.mark.parametrize("case", GRID_CASES, ids=_case_id)
def test_grid_regions_match_the_oracle(case):
    """Each region of the shape grid, as ``auto`` runs it (the block kernels' variants, or the
    flash kernels' backward where no block kernel's fits), against the float64 oracle on jagged
    lengths with empty and 1-token sequences and lengths around the block size."""
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.pop("dtype")]
    block = case["block_size"]
    lengths = EDGE_LENGTHS + [block - 1, block, block + 1, 2 * block + 3, 0, 1]
    q, k, v, offsets = make_inputs(lengths * 2, heads, kv_heads, dim, dtype, seed=block + dim)
    check_against_oracle(q, k, v, offsets, **case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,block,dim,causal", [
    (4, 1, 64, 32, True), (8, 2, 40, 32, True), (4, 1, 16, 32, False), (8, 2, 13, 32, True), (4, 1, 32, 32, True),
    (8, 2, 24, 32, False), (4, 1, 16, 64, True), (8, 2, 11, 64, True)])
def test_capped_grouped_query_forward_matches_the_oracle(heads, kv_heads, block, dim, causal, dtype):
    """The regions whose forward of grouped query heads runs under a register cap (``plan.HOPPER_GROUP_FWD_MAXNREG``:
    hopper at D32 with causal on 64-row tiles; ``plan.PACKED_HOPPER_GROUP_FWD_MAXNREG``: hopper_packed at D32 on
    blocks of up to 32 tokens and D64 with causal on blocks of up to 16) against the float64 oracle, on jagged
    lengths around the block."""
    lengths = EDGE_LENGTHS + [block - 1, block, block + 1, 2 * block + 3, 0, 1]
    q, k, v, offsets = make_inputs(lengths * 2, heads, kv_heads, dim, dtype, seed=block + dim)
    check_against_oracle(q, k, v, offsets, block_size=block, causal=causal)


ROTARY_FORMS = {"split": {}, "interleaved": dict(rotary_interleaved=True), "partial": dict(rotary_dim=16),
                "positions": {}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form", sorted(ROTARY_FORMS))
@pytest.mark.parametrize("heads,kv_heads,block,dim,causal", [
    (4, 1, 64, 32, True), (8, 2, 50, 64, False), (4, 1, 64, 64, True), (8, 2, 16, 32, True), (4, 1, 29, 32, False),
    (4, 1, 13, 64, True), (8, 2, 32, 64, False)])
def test_capped_rotary_grouped_query_forward_matches_the_oracle(heads, kv_heads, block, dim, causal, form, dtype):
    """The rotary forwards of grouped query heads under a register cap (hopper on 64-row tiles: D32 causal at 80,
    D64 at 128; hopper_packed on blocks of up to 32: D32 at 96, D64 at 128) in every rotary form (split halves,
    interleaved pairs, partial, given int positions), against the float64 oracle on jagged lengths around the
    block."""
    _check_rotary_form(heads, kv_heads, block, dim, causal, form, dtype, seed=block + dim)


def _check_rotary_form(heads, kv_heads, block, dim, causal, form, dtype, seed):
    """Forward and gradients of one rotary form (``ROTARY_FORMS``) against the float64 oracle on jagged lengths
    around the block."""
    lengths = EDGE_LENGTHS + [block - 1, block, block + 1, 2 * block + 3, 0, 1]
    q, k, v, offsets = make_inputs(lengths * 2, heads, kv_heads, dim, dtype, seed=seed)
    kw = dict(ROTARY_FORMS[form])
    if form == "positions":
        kw["positions"] = torch.randint(0, 4000, (q.shape[0],), device=DEV)
    check_against_oracle(q, k, v, offsets, block_size=block, causal=causal, rope_theta=1e4, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,block,causal", [
    (2, 2, 16, False), (2, 2, 32, True), (2, 2, 21, False), (4, 1, 64, True), (8, 2, 48, True), (4, 1, 16, False),
    (8, 2, 29, True), (4, 1, 32, True)])
def test_capped_d32_backward_matches_the_oracle(heads, kv_heads, block, causal, dtype):
    """The D32 backwards under a register cap (hopper_packed's of one query head per kv head at 96 and of grouped
    query heads at 160; hopper's of grouped query heads with causal on 64-row tiles at 160) against the float64
    oracle."""
    lengths = EDGE_LENGTHS + [block - 1, block, block + 1, 2 * block + 3, 0, 1]
    q, k, v, offsets = make_inputs(lengths * 2, heads, kv_heads, 32, dtype, seed=block)
    check_against_oracle(q, k, v, offsets, block_size=block, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form", sorted(ROTARY_FORMS))
@pytest.mark.parametrize("heads,kv_heads,block,causal", [
    (2, 2, 16, True), (2, 2, 27, False), (4, 1, 64, False), (8, 2, 40, True), (4, 1, 16, True), (8, 2, 32, False)])
def test_capped_d32_rotary_backward_matches_the_oracle(heads, kv_heads, block, causal, form, dtype):
    """The D32 rotary backwards under a register cap (hopper_packed's of one query head per kv head at 96 and of
    grouped query heads at 168; hopper's of grouped query heads on 64-row tiles at 168), in every rotary form,
    against the float64 oracle."""
    _check_rotary_form(heads, kv_heads, block, 32, causal, form, dtype, seed=block + 7)


# The regions auto gave another variant in sessions 28, 31 and 32, with the variant each phase runs
# there on sm_90 (forward, backward): hopper_heads (session 32; the rotation pass in session 31, keys
# in session 28) for rotary grouped-query backwards at blocks over 64 and D 65-128, the rotation pass
# for interleaved pairs there at D over 96 and for interleaved grouped-query backwards at blocks of
# 33-64; simple for interleaved rotary at D 65-128 on blocks up to 32.
AUTO_28_CASES = [
    (dict(heads=8, kv_heads=2, dim=128, block_size=128, causal=True, rope_theta=1e4, rotary_interleaved=True),
     ("hopper", "rotated")),
    (dict(heads=4, kv_heads=1, dim=96, block_size=100, rope_theta=1e4, rotary_dim=64), ("hopper", "hopper_heads")),
    (dict(heads=8, kv_heads=2, dim=128, block_size=64, rope_theta=1e4, rotary_interleaved=True),
     ("hopper", "rotated")),
    (dict(heads=4, kv_heads=1, dim=96, block_size=32, causal=True, rope_theta=1e4, rotary_interleaved=True),
     ("simple", "simple")),
    (dict(heads=2, kv_heads=2, dim=128, block_size=16, rope_theta=1e4, rotary_interleaved=True), ("simple", "simple")),
]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="auto's sm_90 choices")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case,running", AUTO_28_CASES,
                         ids=lambda c: _case_id(c) if isinstance(c, dict) else "-".join(c))
def test_session_28_auto_regions(case, running, dtype):
    """auto runs the variants named for these calls (forward, backward), and they match the
    float64 oracle on lengths around the block size (empty and 1-token sequences included)."""
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    block = case["block_size"]
    q, k, v, offsets = make_inputs(EDGE_LENGTHS + [block - 1, block, block + 1, 2 * block + 3, 0, 1], heads,
                                   kv_heads, dim, dtype, seed=dim)
    rot = case.get("rotary_dim") or dim
    with variants.forced_variant("auto"):  # whatever the environment forces
        for backward, name in enumerate(running):
            facts = variants.call_facts(q, k, block, rot, case.get("rotary_interleaved", False), False,
                                        backward=bool(backward))
            assert variants.choose(facts, q, (q, k, v)).name == name
        check_against_oracle(q, k, v, offsets, **case)


def _prod_lengths(count, seed=0, multiple=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4001, (count,), generator=g)
    return ((lengths + multiple - 1) // multiple * multiple).tolist()


@pytest.fixture
def release_cuda_cache():
    """After the test, the memory its tensors held goes back to the device (the caching allocator
    would keep it reserved in this worker, and the other workers of an 80 GB card would run out)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def BIG_MEMORY(test):
    """Tests that need tens of GiB run one after another in one pytest-xdist worker (`make
    gpu-check` runs the GPU tests with `-n 8 --dist loadgroup`) and hand their memory back."""
    return pytest.mark.xdist_group("gpu_memory")(pytest.mark.usefixtures("release_cuda_cache")(test))


@BIG_MEMORY
@pytest.mark.parametrize("heads,dim", [(2, 128), (4, 64)])
def test_prod_shape_bf16(heads, dim):
    q, k, v, offsets = make_inputs(_prod_lengths(1152), heads, heads, dim, torch.bfloat16)
    check_against_oracle(q, k, v, offsets, block_size=64)


def test_nan_poisoned_memory_beyond_valid_rows():
    lengths = [5, 64, 0, 130, 1]
    total = sum(lengths)
    q, k, v, offsets = make_inputs(lengths, 4, 2, 64, torch.bfloat16)
    pad = 256

    def poisoned(x):
        buf = torch.full((x.shape[0] + pad, *x.shape[1:]), float("nan"), dtype=x.dtype, device=DEV)
        buf[:total] = x
        return buf[:total]

    qp, kp, vp = (poisoned(x).requires_grad_() for x in (q, k, v))
    junk = torch.full((1 << 24,), float("nan"), device=DEV)  # recycled by the allocator: unwritten outputs stay NaN
    del junk
    out = bl.block_attention(qp, kp, vp, offsets, backend="triton", causal=True, rope_theta=1e4)
    grads = torch.autograd.grad(out, (qp, kp, vp), torch.randn_like(out))
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,rotary", [
    (2, 2, 128, 128, False), (4, 2, 96, 64, False), (2, 2, 256, 64, False), (2, 2, 32, 128, True),
    (8, 2, 64, 100, True),
    # Heads over 128 wide in 128-token blocks: hopper_wide's backward (grouped query heads one by one;
    # the flash kernels' off sm_90 and with the simple kernels forced).
    (4, 2, 192, 128, False), (2, 2, 256, 128, True),
    # Blocks of 16 and 32 tokens, which share 64-row tiles in the packed variant.
    (2, 2, 64, 16, False), (8, 2, 32, 32, False), (4, 1, 128, 16, True), (4, 2, 64, 16, True),
    # Rotary at a padded head dim, and over part of the channels (an int: rotary_dim).
    (4, 2, 96, 128, True), (2, 2, 128, 64, 64), (4, 2, 48, 16, 16),
    # Rotary at D256 (half tiles rotated by 32-row chunks): 64-row hopper tiles both ways.
    (2, 2, 256, 64, True),
])
def test_nan_stays_in_its_block(heads, kv_heads, dim, block_size, rotary):
    """A NaN in one token's q, k and v reaches only its own block's outputs and gradients: the
    other blocks' rows are bitwise those of the clean call."""
    _assert_nan_stays_in_its_block(heads, kv_heads, dim, block_size, rotary)


def _assert_nan_stays_in_its_block(heads, kv_heads, dim, block_size, rotary, variant=None):
    """A NaN in one token's q, k and v reaches only its own block's outputs and gradients
    (``rotary``: a bool, or the rotary_dim), with ``variant`` forced (checked to run the backward),
    or with None whatever the environment forces."""
    lengths = [3, block_size * 2 + 5, 0, 1, block_size + 1]
    q, k, v, offsets = make_inputs(lengths, heads, kv_heads, dim, torch.bfloat16)
    token = 3 + block_size + 2  # inside the second block of the second sequence
    rot = (dim if rotary is True else rotary) or 0
    kw = dict(block_size=block_size, causal=True, rope_theta=1e4 if rot else None, rotary_dim=rot or None)

    def run(poison):
        xs = [x.clone() for x in (q, k, v)]
        if poison:
            for x in xs:
                x[token] = float("nan")
        xs = [x.requires_grad_() for x in xs]
        out = bl.block_attention(*xs, offsets, backend="triton", **kw)
        grad_out = torch.ones_like(out)
        return (out, *torch.autograd.grad(out, xs, grad_out))

    with contextlib.nullcontext() if variant is None else variants.forced_variant(variant):
        if variant is not None:
            facts = variants.call_facts(q, k, block_size, rot, False, False, backward=True)
            assert variants.choose(facts, q, (q, k, v)).name == variant
        clean, poisoned = run(False), run(True)
    block = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
    block[3 + block_size: 3 + 2 * block_size] = True
    for a, b in zip(clean, poisoned):
        assert torch.equal(a[~block], b[~block])
        assert torch.isnan(b[block]).any()


def test_backward_bitwise_deterministic():
    q, k, v, offsets = make_inputs(_prod_lengths(64), 4, 2, 128, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = bl.block_attention(q, k, v, offsets, backend="triton", rope_theta=1e4)
    grad_out = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("block_size,backend", [(64, "triton"), (None, "triton_flash")], ids=["block", "flash"])
def test_cuda_graph_replay_with_new_data(block_size, backend):
    """Captured forward and backward replay with new data in the same buffers (the flash case's
    tensor maps hold the buffers' addresses)."""
    _graph_replay_matches_eager(block_size, backend, kv_heads=2)


def _graph_replay_matches_eager(block_size, backend, kv_heads):
    q, k, v, offsets = make_inputs([10, 64, 0, 100, 3, 64], 4, kv_heads, 64, torch.bfloat16)
    static = [x.clone().requires_grad_() for x in (q, k, v)]
    grad_out = torch.randn_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            out = bl.block_attention(*static, offsets, block_size, backend=backend, causal=True)
            torch.autograd.grad(out, static, grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bl.block_attention(*static, offsets, block_size, backend=backend, causal=True)
        grads = torch.autograd.grad(out, static, grad_out)
    for seed in range(3):
        fresh = make_inputs([10, 64, 0, 100, 3, 64], 4, kv_heads, 64, torch.bfloat16, seed=seed + 10)[:3]
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        fresh = [x.requires_grad_() for x in fresh]
        eager = bl.block_attention(*fresh, offsets, block_size, backend=backend, causal=True)
        eager_grads = torch.autograd.grad(eager, fresh, grad_out)
        assert torch.equal(out, eager)
        assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@BIG_MEMORY
def test_more_than_2_pow_31_elements():
    heads, dim = 1, 128
    lengths = [1 << 16] * 256 + [77, 5]
    total = sum(lengths)
    assert total * heads * dim > 2**31
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    q = torch.randn(total, heads, dim, device=DEV, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = bl.block_attention(q, k, v, offsets.to(DEV), backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # Check the tail past 2**31 elements: the last 1024 tokens (16 whole blocks) of the last
    # long sequence, then the sequences of 77 and 5 tokens.
    start = total - 82 - 1024
    tail = [x[start:].detach().float().requires_grad_() for x in (q, k, v)]
    sub_offsets = torch.tensor([0, 1024, 1101, 1106], device=DEV)
    ref = bl.block_attention(*tail, sub_offsets, backend="reference")
    ref_grads = torch.autograd.grad(ref, tail, torch.ones_like(ref))
    assert rel(out[start:], ref) < 1.5e-2
    for g, r in zip(grads, ref_grads):
        assert rel(g[start:], r) < 3e-2


@pytest.mark.parametrize("path", ["fast", "specialized"])
def test_small_calls_launch_path(monkeypatch, path):
    """Calls launch the compiled kernel directly from the second call on; both paths, with the
    block table or the in-kernel schedule, match the oracle on changing batches."""
    from blockattn_layers.kernels.common import launch as _launch
    from blockattn_layers.kernels.common import schedule as _schedule

    if path == "specialized":
        monkeypatch.setattr(_launch, "DIRECT", False)
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    for seed, lengths in enumerate(([5, 64, 0, 130, 1], [70, 3, 0], [1, 1, 200, 0, 64, 65])):
        q, k, v, offsets = make_inputs(lengths, 4, 2, 64, torch.float16, seed=seed)
        check_against_oracle(q, k, v, offsets, block_size=48, causal=True, rope_theta=1e4)


def test_remembered_forward_gives_the_ordinary_bits(monkeypatch):
    """From the second forward of a signature on, the launch remembered for it runs
    (``block.fwd._REMEMBERED``: no variant choice, launch plan or launcher key); across batches,
    input strides, alignments, positions' dtypes and a variant switch (which forgets the
    remembered launches) it gives the bits of the ordinary launch through ``kernel[grid]``."""
    from blockattn_layers.kernels.block import fwd as block_fwd
    from blockattn_layers.kernels.common import launch as _launch

    ordinary_calls = []
    ordinary = block_fwd._launch_ordinary

    def spy(*args):
        ordinary_calls.append(1)
        return ordinary(*args)

    monkeypatch.setattr(block_fwd, "_launch_ordinary", spy)
    caches.clear_all()  # an earlier test in this process may have remembered these signatures

    def inputs(lengths, seed, layout):
        q, k, v, offsets = make_inputs(lengths, 4, 2, 64, torch.float16, seed=seed)
        if layout == "packed":
            packed = torch.cat([q, k, v], dim=1)
            q, k, v = packed[:, :4], packed[:, 4:6], packed[:, 6:]
        elif layout == "unaligned":
            flat = torch.empty(q.numel() + 1, device=DEV, dtype=q.dtype)
            flat[1:].copy_(q.flatten())
            q = flat[1:].view(q.shape)
        return q, k, v, offsets

    def forward(q, k, v, offsets, **kw):
        return bl.block_attention(q, k, v, offsets, 48, backend="triton", causal=True, rope_theta=1e4, **kw)

    with variants.forced_variant("auto"):  # whatever the environment forces
        cases = [("contiguous", None), ("packed", None), ("unaligned", None), ("contiguous", "int"),
                 ("contiguous", "float"), ("contiguous", None)]
        for i, (layout, positions) in enumerate(cases):
            if i == len(cases) - 1:
                variants.force_variant("simple")
            for seed, lengths in enumerate(([5, 64, 0, 130, 1], [70, 3, 0, 200], [1, 1, 65])):
                q, k, v, offsets = inputs(lengths, seed, layout)
                kw = {}
                if positions is not None:
                    pos = torch.randint(0, 1000, (q.shape[0],), device=DEV)
                    kw["positions"] = pos if positions == "int" else pos.float() * 0.5
                before = len(ordinary_calls)
                got = forward(q, k, v, offsets, **kw)
                assert len(ordinary_calls) == before + (seed == 0), (layout, positions, seed)
                monkeypatch.setattr(_launch, "DIRECT", False)
                want = forward(q, k, v, offsets, **kw)
                monkeypatch.setattr(_launch, "DIRECT", True)
                assert torch.isfinite(got).all() and torch.equal(got, want), (layout, positions, seed)


def test_compile_fullgraph_no_recompile_across_batches():
    torch._dynamo.reset()
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    @torch.compile(backend=counting_backend, fullgraph=True, dynamic=True)
    def f(q, k, v, offsets):
        return bl.block_attention(q, k, v, offsets, block_size=64, backend="triton", causal=True) * 2

    # (The first batch's B + 1 differs from every dimension of q: dynamo's duck sizing would
    # otherwise tie the two and recompile when they part.)
    for i, lengths in enumerate(([5, 64, 130, 0, 9], [1, 1, 300, 7, 0], [65] * 9, [2000, 3, 17, 64])):
        q, k, v, offsets = make_inputs(lengths, 4, 2, 64, torch.bfloat16, seed=i)
        out = f(q, k, v, offsets)
        assert torch.equal(out, 2 * bl.block_attention(q, k, v, offsets, backend="triton", causal=True))
    assert len(compiles) == 1


def test_kernels_compile_once_across_batches():
    launchers = [launcher for variant in variants.VARIANTS.values() for launcher in variant.kernels()]

    def count():
        return tuple(sum(len(c[0]) for c in x.kernel.device_caches.values()) if x.kernel else 0 for x in launchers)

    def step(lengths, seed):
        for kv_heads in (2, 4):  # GQA, and one query head per kv head (what hopper_ws takes)
            q, k, v, offsets = make_inputs(lengths, 4, kv_heads, 64, torch.bfloat16, seed=seed)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = bl.block_attention(q, k, v, offsets, backend="triton", rope_theta=1e4)
            out.sum().backward()

    step([5, 64, 130], 0)
    before = count()
    assert sum(before) > 0
    for i, lengths in enumerate(([1, 1, 300, 7, 0], [65] * 33, [2000, 3, 17, 64], [999] * 3)):
        step(lengths, i + 1)
    assert count() == before


SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                          reason="needs an sm_90 GPU")
HOPPER_CASES = [
    dict(heads=2, kv_heads=2, dim=128, block_size=64),
    dict(heads=4, kv_heads=2, dim=128, block_size=64, causal=True, rope_theta=1e4),
    dict(heads=4, kv_heads=4, dim=64, block_size=48, rope_theta=500.0, positions="int"),
    dict(heads=2, kv_heads=1, dim=64, block_size=64, causal=True, scale=0.3),
    # 128-row tiles (two warpgroups), padded head dims, D 32 and 256; the grouped-query backward at
    # D256 runs the simple kernels (the forced variant warns).
    dict(heads=2, kv_heads=2, dim=128, block_size=128, causal=True),
    dict(heads=2, kv_heads=2, dim=128, block_size=100, rope_theta=1e4, positions="float"),
    dict(heads=2, kv_heads=2, dim=64, block_size=128, rope_theta=1e4),
    dict(heads=4, kv_heads=2, dim=32, block_size=64, rope_theta=1e4, causal=True),
    dict(heads=4, kv_heads=2, dim=96, block_size=64, causal=True),
    dict(heads=2, kv_heads=2, dim=80, block_size=128),
    dict(heads=2, kv_heads=2, dim=32, block_size=64, rope_theta=1e4),
    dict(heads=2, kv_heads=2, dim=256, block_size=64),
    dict(heads=2, kv_heads=1, dim=256, block_size=40, causal=True),
    # Four query heads per kv head (the query-side slots wrap; dQ by column halves at D128), and
    # grouped-query heads at 128-row tiles (P read back from shared memory in the backward).
    dict(heads=8, kv_heads=2, dim=128, block_size=64),
    dict(heads=4, kv_heads=2, dim=64, block_size=128, causal=True),
    dict(heads=4, kv_heads=1, dim=128, block_size=128, rope_theta=1e4),
    # Rotary forward of grouped query heads at D128 (angles for each head, output by halves through
    # q's tiles) with given positions; the capped rotary forward on 128-row tiles at D32.
    dict(heads=8, kv_heads=2, dim=128, block_size=64, rope_theta=1e4, positions="int"),
    dict(heads=2, kv_heads=2, dim=32, block_size=128, rope_theta=1e4, causal=True),
    # One program per query head (the forward's SPLIT_GROUPS): 128-row tiles at D 96-128, and D256.
    dict(heads=8, kv_heads=2, dim=96, block_size=128),
    dict(heads=4, kv_heads=2, dim=256, block_size=64, causal=True),
    # Blocks over 64 at D > 128: the forward stores the logsumexp, the flash kernels run the backward.
    dict(heads=2, kv_heads=2, dim=256, block_size=128, causal=True),
    dict(heads=4, kv_heads=2, dim=192, block_size=100),
    # The forward's 128-row tiles of D 144-256 in 64-channel chunks (``sm90.chunked``): three chunks at D144.
    dict(heads=4, kv_heads=1, dim=144, block_size=128),
    # Rotary in half tiles that are not the head's column halves: padded head dims (D96, D48) and
    # partial rotary_dim (pass-through channels), one or several query heads per kv head.
    dict(heads=2, kv_heads=2, dim=96, block_size=64, rope_theta=1e4, causal=True),
    dict(heads=8, kv_heads=2, dim=96, block_size=128, rope_theta=1e4, positions="int"),
    dict(heads=2, kv_heads=2, dim=128, block_size=64, rope_theta=1e4, rotary_dim=64),
    dict(heads=4, kv_heads=1, dim=64, block_size=128, rope_theta=1e4, rotary_dim=32, causal=True),
    dict(heads=4, kv_heads=2, dim=80, block_size=64, rope_theta=1e4, rotary_dim=48),
    dict(heads=2, kv_heads=2, dim=48, block_size=100, rope_theta=1e4, rotary_dim=16, positions="float"),
    # Interleaved pairs, gathered into the half tiles through registers.
    dict(heads=2, kv_heads=2, dim=128, block_size=64, rope_theta=1e4, rotary_interleaved=True, causal=True),
    dict(heads=8, kv_heads=2, dim=96, block_size=128, rope_theta=1e4, rotary_interleaved=True, rotary_dim=64),
    dict(heads=4, kv_heads=1, dim=64, block_size=64, rope_theta=1e4, rotary_interleaved=True, positions="int"),
    # Rotary at D 144-256 (half tiles 128 wide rotated 32 rows at a time): the forward, and the
    # backward of one query head per kv head on 64-row tiles (gradients rotated back through dead
    # tiles); grouped-query backwards there run simple's kernels, blocks over 64 hopper_wide's.
    dict(heads=4, kv_heads=2, dim=256, block_size=64, rope_theta=1e4, causal=True),
    dict(heads=2, kv_heads=2, dim=256, block_size=48, rope_theta=1e4, positions="float"),
    dict(heads=1, kv_heads=1, dim=176, block_size=64, rope_theta=1e4, rotary_dim=96, rotary_interleaved=True,
         causal=True),
    dict(heads=2, kv_heads=2, dim=192, block_size=128, rope_theta=1e4, rotary_dim=128, rotary_interleaved=True),
]
LENGTHS_AROUND_128 = [0, 1, 99, 100, 101, 127, 128, 129, 255, 256, 257, 0, 3]


@SM90
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=_case_id)
@pytest.mark.filterwarnings("ignore:block kernels. the forced variant 'hopper' cannot compute:RuntimeWarning")
def test_hopper_kernels_forced(monkeypatch, case, table):
    """The Gluon kernels take these calls on sm_90 (checked) and match the float64 oracle, fp16
    and bf16, with the in-kernel schedule or the block table, on lengths around the block size."""
    _forced_variant_matches_oracle(monkeypatch, "hopper", case, table, EDGE_LENGTHS * 2 + LENGTHS_AROUND_128)


@SM90
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,causal", [
    (2, 2, 256, 128, True), (4, 2, 192, 100, False), (2, 1, 144, 128, False), (8, 2, 256, 128, True),
    (8, 2, 128, 128, False), (4, 1, 128, 100, True)])
def test_hopper_forward_stores_the_logsumexp(heads, kv_heads, dim, block_size, causal):
    """The hopper forward that stores each row's logsumexp (blocks over 64 at D > 128, and grouped query
    heads there at D 128, whose backward runs the flash kernels on it) is taken there and matches the
    float64 oracle's, as the simple kernels' does, output included."""
    from blockattn_layers.kernels.block.fwd import block_attention_fwd_lse

    q, k, v, offsets = make_inputs(EDGE_LENGTHS + LENGTHS_AROUND_128, heads, kv_heads, dim, torch.bfloat16)
    args = (offsets, block_size, dim ** -0.5, causal, None, None, 0, False, None)
    want, want_lse = torch.ops.blockattn.attention_fwd(q.double(), k.double(), v.double(), *args, None, "reference")
    facts = variants.call_facts(q, k, block_size, 0, False, False, stores_lse=True)
    for name in ("hopper", "simple"):
        with variants.forced_variant(name):
            assert variants.choose(facts, q, (q, k, v)).name == name
            out, lse = block_attention_fwd_lse(q, k, v, *args)
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-4, atol=1e-4, msg=name)
        assert rel(out, want) < 1e-2, name


def _forced_variant_matches_oracle(monkeypatch, variant, case, table, lengths):
    """``variant`` forced takes the call (checked) and matches the float64 oracle, bf16 and fp16;
    ``positions="int"`` / ``"float"`` in ``case`` draws random positions."""
    from blockattn_layers.kernels.common import schedule as _schedule
    from blockattn_layers.ops import library

    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    monkeypatch.setattr(library, "GROUPED_SAVES_LSE_HEAD_DIMS", frozenset())
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    with variants.forced_variant(variant):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = make_inputs(lengths, heads, kv_heads, dim, dtype, seed=heads + dim)
            if isinstance(case.get("positions"), str):
                total = q.shape[0]
                case["positions"] = (torch.randint(0, 4000, (total,), device=DEV) if case["positions"] == "int"
                                     else torch.rand(total, device=DEV) * 4000)
            rot = case.get("rotary_dim") or dim if case.get("rope_theta") else 0
            assert _variant(q, k, (q, k, v), case["block_size"], rot, case.get("rotary_interleaved", False)) == variant
            check_against_oracle(q, k, v, offsets, **dict(case))


def _variant(q, k, tensors, block_size, rot, interleaved=False, int64=False) -> str:
    """The variant that computes this call."""
    return variants.choose(variants.call_facts(q, k, block_size, rot, interleaved, int64), q, tensors).name


KEYS_CASES = [
    # Grouped query heads at 128-row key tiles (the region it is for), causal, padded head dims.
    dict(heads=8, kv_heads=2, dim=128, block_size=128, causal=True),
    dict(heads=4, kv_heads=1, dim=64, block_size=100),
    dict(heads=8, kv_heads=2, dim=96, block_size=128),
    dict(heads=4, kv_heads=2, dim=32, block_size=64, causal=True),
    dict(heads=2, kv_heads=2, dim=128, block_size=65),
    # Every rotary form: split halves at given positions, interleaved pairs, partial rotary_dim.
    dict(heads=8, kv_heads=2, dim=128, block_size=128, rope_theta=1e4, positions="int", causal=True),
    dict(heads=4, kv_heads=1, dim=96, block_size=128, rope_theta=1e4, rotary_interleaved=True, rotary_dim=64),
    dict(heads=4, kv_heads=2, dim=128, block_size=100, rope_theta=1e4, rotary_dim=64, positions="float"),
    dict(heads=2, kv_heads=1, dim=64, block_size=64, rope_theta=500.0, rotary_interleaved=True, causal=True),
]


@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", KEYS_CASES, ids=_case_id)
def test_keys_backward_forced(monkeypatch, case, table):
    """The backward over key rows (``keys``: 64-row query tiles against the block's keys, scores
    transposed; its forward is simple's), forced, matches the float64 oracle, bf16 and fp16, on
    lengths around the block size (empty, 1-token and ragged blocks)."""
    _forced_variant_matches_oracle(monkeypatch, "keys", case, table, EDGE_LENGTHS * 2 + LENGTHS_AROUND_128)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size,rotary", [(8, 2, 128, 128, False), (4, 1, 64, 100, True)])
def test_keys_backward_keeps_a_nan_in_its_block(heads, kv_heads, dim, block_size, rotary):
    """With ``keys`` forced, a NaN in one token's q, k, v reaches only its own block's gradients."""
    _assert_nan_stays_in_its_block(heads, kv_heads, dim, block_size, rotary, "keys")


def _around_the_blocks(case, heads, kv_heads, dim, dtype, seed):
    """Inputs on lengths around blocks of up to 128 tokens (empty, 1-token and ragged blocks); a
    ``case["positions"]`` of "int" or "float" becomes that kind of positions in the thousands, once
    (the next dtype's call keeps them)."""
    q, k, v, offsets = make_inputs(EDGE_LENGTHS * 2 + LENGTHS_AROUND_128, heads, kv_heads, dim, dtype, seed=seed)
    if isinstance(case.get("positions"), str):
        total = q.shape[0]
        case["positions"] = (torch.randint(0, 4000, (total,), device=DEV) if case["positions"] == "int"
                             else torch.rand(total, device=DEV) * 4000)
    return q, k, v, offsets


WIDE_CASES = [
    dict(heads=2, kv_heads=2, dim=256, block_size=128),
    dict(heads=2, kv_heads=2, dim=256, block_size=128, causal=True),
    # Tiles padded past the head's channels (v's second column half partly masked), blocks of 65-127.
    dict(heads=1, kv_heads=1, dim=192, block_size=100, causal=True),
    dict(heads=3, kv_heads=3, dim=144, block_size=65),
    # Rotary: split halves over every channel, at given positions; interleaved pairs over part of them.
    dict(heads=2, kv_heads=2, dim=256, block_size=128, causal=True, rope_theta=1e4),
    dict(heads=1, kv_heads=1, dim=192, block_size=100, rope_theta=500.0, positions="float"),
    dict(heads=2, kv_heads=2, dim=256, block_size=128, rope_theta=1e4, rotary_dim=128, rotary_interleaved=True),
    dict(heads=1, kv_heads=1, dim=160, block_size=128, causal=True, rope_theta=1e4, rotary_dim=64, positions="int"),
    # Grouped query heads (one by one, a block's programs adjacent; dK and dV summed over the group in
    # the launch without rotary, after it with): MQA, causal; three heads a group at D192 (channels
    # past the head masked in the sums); two kv heads with rotary in interleaved pairs over part of
    # the channels; three with given positions.
    dict(heads=4, kv_heads=1, dim=256, block_size=128, causal=True),
    dict(heads=6, kv_heads=2, dim=192, block_size=100),
    dict(heads=8, kv_heads=2, dim=192, block_size=100, rope_theta=1e4, rotary_dim=128, rotary_interleaved=True),
    dict(heads=6, kv_heads=3, dim=144, block_size=65, rope_theta=500.0, positions="float"),
]


@SM90
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", WIDE_CASES, ids=_case_id)
def test_hopper_wide_backward(monkeypatch, case, table):
    """Blocks of 65-128 tokens at head dims over 128, any group size, rotary or not: auto takes the
    hopper_wide backward (the flash kernels are not called) and it matches the float64
    oracle, bf16 and fp16, on lengths around the block size (empty, 1-token and ragged blocks)."""
    from blockattn_layers.kernels.block.bwd import backward_variant, wide_backward_runs
    from blockattn_layers.kernels.common import schedule as _schedule
    from blockattn_layers.ops.backends import triton_block

    def no_flash(*args, **kwargs):
        raise AssertionError("the flash backward ran")

    monkeypatch.setattr(triton_block, "flash_attention_bwd", no_flash)
    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    with variants.forced_variant("auto"):  # whatever the environment forces
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = _around_the_blocks(case, heads, kv_heads, dim, dtype, seed=dim)
            rot = case.get("rotary_dim", dim) if "rope_theta" in case else 0
            rotary = (rot, case.get("rotary_interleaved", False), "positions" in case)
            facts = variants.call_facts(q, k, case["block_size"], rot, rotary[1], False, rotary[2], backward=True)
            assert variants.choose(facts, q, (q, k, v)).name == "hopper_wide"
            assert wide_backward_runs(backward_variant(q, q, k, v, case["block_size"], *rotary))
            check_against_oracle(q, k, v, offsets, **case)


@SM90
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("heads", [2, 4], ids=["mha", "gqa"])
def test_hopper_wide_backward_keeps_a_nan_in_its_block(heads, rotary):
    """With hopper_wide's backward, a NaN in one token's q, k, v reaches only its own block's gradients."""
    _assert_nan_stays_in_its_block(heads, 2, 256, 128, rotary, "hopper_wide")


HEADS_CASES = [
    # Rotary backwards of grouped query heads on blocks over 64 at D 65-128: split halves over every
    # channel, causal; over part of them at given positions; interleaved pairs at a padded head dim;
    # D128 split halves (the variant choice; since session 57 the backend runs their backward on the flash kernel
    # with dQ stored instead, ``GROUPED_SAVES_LSE_ROTARY``, and since session 58 at D 96 too: the test empties
    # ``GROUPED_SAVES_LSE_HEAD_DIMS`` so that hopper_heads runs them all).
    dict(heads=4, kv_heads=1, dim=96, block_size=128, causal=True, rope_theta=1e4),
    dict(heads=8, kv_heads=2, dim=96, block_size=100, rope_theta=1e4, rotary_dim=48, positions="int"),
    dict(heads=6, kv_heads=3, dim=80, block_size=128, rope_theta=500.0, rotary_interleaved=True, positions="float"),
    dict(heads=4, kv_heads=2, dim=128, block_size=128, rope_theta=1e4),
]


@SM90
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", HEADS_CASES, ids=_case_id)
def test_hopper_heads_backward(monkeypatch, case, table):
    """auto takes ``hopper_heads`` (the hopper backward one query head per program, each head's dK and
    dV summed over the group after) and it matches the float64 oracle, bf16 and fp16, on lengths around
    the block size (empty, 1-token and ragged blocks), twice: the second call of a signature would take
    a prepared backward, which must not launch the kernel once for the whole group."""
    from blockattn_layers.kernels.common import schedule as _schedule

    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    with variants.forced_variant("auto"):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = _around_the_blocks(case, heads, kv_heads, dim, dtype, seed=dim + heads)
            rot = case.get("rotary_dim", dim)
            facts = variants.call_facts(q, k, case["block_size"], rot, case.get("rotary_interleaved", False), False,
                                        "positions" in case, backward=True)
            assert variants.choose(facts, q, (q, k, v)).name == "hopper_heads"
            for _ in range(2):
                check_against_oracle(q, k, v, offsets, **case)


STORED_DQ_CASES = [
    # Grouped query heads on blocks of 65-128 tokens at D 128 without rotary: four and two query heads a group,
    # MQA, causal, a block of 100 (padding key rows in the tile) and of 65.
    dict(heads=8, kv_heads=2, dim=128, block_size=128),
    dict(heads=4, kv_heads=1, dim=128, block_size=128, causal=True),
    dict(heads=6, kv_heads=3, dim=128, block_size=100, causal=True),
    dict(heads=4, kv_heads=2, dim=128, block_size=65),
]


def _stored_dq_spy(monkeypatch) -> list:
    """Calls of the Gluon flash backward, each ``(dq stored by it, delta computed by it)``; the block kernels'
    backward made to fail."""
    from blockattn_layers.kernels.sm90 import flash_bwd
    from blockattn_layers.ops.backends import triton_block

    calls = []
    real = flash_bwd.dkdv_pass_ws
    monkeypatch.setattr(flash_bwd, "dkdv_pass_ws",
                        lambda *a, dq=None, **kw: calls.append((dq is not None, kw.get("o") is not None))
                        or real(*a, dq=dq, **kw))

    def no_block_kernels(*args, **kwargs):
        raise AssertionError("the block kernels' backward ran")

    monkeypatch.setattr(triton_block, "block_attention_bwd", no_block_kernels)
    return calls


@SM90
@pytest.mark.parametrize("fast", [False, True], ids=["deterministic", "fast"])
@pytest.mark.parametrize("case", STORED_DQ_CASES, ids=_case_id)
def test_grouped_d128_backward_runs_the_flash_kernel_with_dq_stored(monkeypatch, case, fast):
    """Grouped query heads on blocks of 65-128 tokens at D 128 (``saves_lse``): auto runs the backward on the
    flash kernel with dQ stored (the block kernels' backward not at all), in both modes, and it matches the
    float64 oracle, bf16 and fp16, on lengths around the block size (empty, 1-token and ragged blocks); the
    same bits twice. Without causal masks the kernel computes the delta rows itself (``computes_delta``)."""
    calls = _stored_dq_spy(monkeypatch)
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    _check_stored_dq_backward(calls, case, heads, kv_heads, dim, fast)


def _check_stored_dq_backward(calls, case, heads, kv_heads, dim, fast):
    """Under auto, in the ``fast`` or deterministic mode, bf16 and fp16, on lengths around the block size: one call
    of the flash kernel with dQ stored (computing delta itself without causal masks, ``calls`` as
    :func:`_stored_dq_spy` records them), gradients against the float64 oracle, the same bits twice."""
    with variants.forced_variant("auto"), bl.fast_backward(fast):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = _around_the_blocks(case, heads, kv_heads, dim, dtype, seed=heads + case["block_size"])
            calls.clear()
            check_against_oracle(q, k, v, offsets, **case)
            assert calls == [(True, not case.get("causal", False))]
            grads = []
            for _ in range(2):
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                out = bl.block_attention(*leaves, offsets, backend="triton", **case)
                grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
            assert all(torch.equal(a, b) for a, b in zip(*grads))


@SM90
def test_grouped_d128_flash_backward_keeps_a_nan_in_its_block(monkeypatch):
    """Where the flash kernel with dQ stored runs the backward, a NaN in one token's q, k, v reaches only its own
    block's outputs and gradients."""
    calls = _stored_dq_spy(monkeypatch)
    with variants.forced_variant("auto"):
        _assert_nan_stays_in_its_block(8, 2, 128, 128, False)
    assert calls and all(stored for stored, _ in calls)


ROTARY_STORED_DQ_CASES = [
    # The rotary forms of GROUPED_SAVES_LSE_ROTARY (interleaved, partial split halves), with grouped query heads on
    # blocks of 65-128 tokens at D 128.
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4, rotary_interleaved=True),
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4, rotary_interleaved=True, causal=True),
    dict(heads=4, kv_heads=1, block_size=100, rope_theta=500.0, rotary_dim=64),
    dict(heads=6, kv_heads=3, block_size=128, rope_theta=1e4, rotary_dim=32, rotary_interleaved=True,
         positions="float"),
    # Split halves over 96, 48 and 112 channels: the copies' rotary channels in paired chunks of 16 and 8
    # (flash_bwd.PAIRED_PARTIAL); over 80, rotated back by the rotation pass's second half.
    dict(heads=4, kv_heads=1, block_size=128, rope_theta=1e4, rotary_dim=96, positions="int"),
    dict(heads=8, kv_heads=2, block_size=100, rope_theta=1e4, rotary_dim=48, causal=True),
    dict(heads=4, kv_heads=2, block_size=128, rope_theta=500.0, rotary_dim=112, positions="float"),
    dict(heads=4, kv_heads=1, block_size=128, rope_theta=1e4, rotary_dim=80),
    # Split halves over every channel: the copies in the paired-chunk order (flash_bwd.pair_chunk).
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4),
    dict(heads=4, kv_heads=1, block_size=100, rope_theta=500.0, causal=True, positions="float"),
]


@SM90
@pytest.mark.parametrize("copies", [True, False], ids=["copies-saved", "copies-in-backward"])
@pytest.mark.parametrize("case", ROTARY_STORED_DQ_CASES, ids=_case_id)
def test_grouped_d128_rotary_backward_runs_the_flash_kernel_on_rotated_copies(monkeypatch, case, copies):
    """Interleaved or partial rotary (``GROUPED_SAVES_LSE_ROTARY``): the forward saves lse too, and the backward
    runs as a rotation pass whose inner backward is the flash kernel with dQ stored (the block kernels' not at
    all), given positions too, against the float64 oracle, bf16 and fp16; where each rotary pair lies in one of
    the kernel's dQ column halves (``flash_bwd.unrotates``: interleaved, split halves over 64 or fewer) the kernel
    rotates dq and dk back and the pass's second half does not run (other split halves but over 80 channels on
    copies in the paired-chunk order), and with ``SAVES_ROTATED_COPIES`` the first runs in the forward, on the copies
    autograd saves."""
    from blockattn_layers.kernels.block import rotation
    from blockattn_layers.kernels.sm90 import flash_bwd
    from blockattn_layers.ops.backends import triton_block

    monkeypatch.setattr(triton_block, "SAVES_ROTATED_COPIES", copies)

    calls = _stored_dq_spy(monkeypatch)
    passes = []
    real = rotation.rotate_rows
    monkeypatch.setattr(rotation, "rotate_rows", lambda *a, **kw: passes.append(a[-2]) or real(*a, **kw))
    case = dict(case)
    heads, kv_heads = case.pop("heads"), case.pop("kv_heads")
    rot = case.get("rotary_dim", 128)
    unrotates = flash_bwd.unrotates(case["block_size"], 128, rot, case.get("rotary_interleaved", False))
    assert unrotates == (rot != 80)
    with variants.forced_variant("auto"):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = _around_the_blocks(case, heads, kv_heads, 128, dtype, seed=heads + case["block_size"])
            calls.clear()
            passes.clear()
            check_against_oracle(q, k, v, offsets, **case)
            assert calls == [(True, not case.get("causal", False))]
            assert passes == ([False] if unrotates else [False, True])
            # With ``SAVES_ROTATED_COPIES`` q and k are rotated in the forward and autograd saves the copies where the
            # kernel rotates back (the backward runs no pass) and, with ``COPIES_ROTATED_BACK_BY_PASS``, elsewhere too
            # (the backward runs the pass back); otherwise the forward rotates in its kernel.
            passes.clear()
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = bl.block_attention(*leaves, offsets, backend="triton", **case)
            in_forward = copies and (unrotates or triton_block.COPIES_ROTATED_BACK_BY_PASS)
            assert passes == ([False] if in_forward else [])
            saved = out.grad_fn.saved_tensors[0]
            assert (saved.data_ptr() != leaves[0].data_ptr()) == in_forward
            torch.autograd.grad(out, leaves, torch.ones_like(out))
            assert passes == ([False] if unrotates else [False, True])


@SM90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_d128_split_rotary_backward_without_paired_chunks(monkeypatch, causal):
    """Split halves over every channel (saving lse, ``GROUPED_SAVES_LSE_ROTARY``) with ``flash_bwd.PAIRED_SPLIT``
    off: the flash kernel with dQ stored on copies in their own order, and a second pass rotating dq and dk back,
    against the float64 oracle."""
    from blockattn_layers.kernels.block import rotation
    from blockattn_layers.kernels.sm90 import flash_bwd

    monkeypatch.setattr(flash_bwd, "PAIRED_SPLIT", False)
    calls = _stored_dq_spy(monkeypatch)
    passes = []
    real = rotation.rotate_rows
    monkeypatch.setattr(rotation, "rotate_rows", lambda *a, **kw: passes.append(a[-2]) or real(*a, **kw))
    q, k, v, offsets = _around_the_blocks({}, 8, 2, 128, torch.bfloat16, seed=2)
    with variants.forced_variant("auto"):
        check_against_oracle(q, k, v, offsets, block_size=128, rope_theta=1e4, causal=causal)
    assert calls == [(True, not causal)] and passes == [False, True]


@SM90
def test_a_forced_variant_keeps_the_grouped_d128_backward_on_the_block_kernels(monkeypatch):
    """A forced variant computes the backward the flash kernel with dQ stored would take under auto."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    calls = []
    real = flash_bwd.dkdv_pass_ws
    monkeypatch.setattr(flash_bwd, "dkdv_pass_ws", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, offsets = _around_the_blocks({}, 8, 2, 128, torch.bfloat16, seed=1)
    with variants.forced_variant("hopper"):
        check_against_oracle(q, k, v, offsets, block_size=128)
    assert calls == []


PADDED_STORED_DQ_CASES = [
    # D 96 in the flash kernel's 128-wide tiles (flash_bwd.PADDED_HEAD_DIMS), grouped query heads on blocks of 65-128:
    # without rotary (four and two query heads a group, MQA, causal, ragged blocks), interleaved rotary over every
    # channel and over 32 at given positions, split halves over 64, split halves over every channel (in the
    # paired-chunk order of 16, flash_bwd.PADDED_PAIRED_SPLIT), split halves over 48 and 80 (in paired chunks of 8,
    # flash_bwd.PAIRED_PARTIAL, the pass-through channels in consumer 0 / 1); each rotated back by the kernel.
    dict(heads=8, kv_heads=2, block_size=128),
    dict(heads=4, kv_heads=1, block_size=100, causal=True),
    dict(heads=6, kv_heads=3, block_size=65),
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4, rotary_interleaved=True),
    dict(heads=4, kv_heads=1, block_size=128, rope_theta=500.0, rotary_dim=32, rotary_interleaved=True,
         positions="float", causal=True),
    dict(heads=4, kv_heads=2, block_size=100, rope_theta=1e4, rotary_dim=64, positions="int"),
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4, causal=True),
    dict(heads=4, kv_heads=1, block_size=100, rope_theta=500.0, positions="int"),
    dict(heads=8, kv_heads=2, block_size=128, rope_theta=1e4, rotary_dim=48),
    dict(heads=4, kv_heads=1, block_size=100, rope_theta=1e4, rotary_dim=48, causal=True, positions="int"),
    dict(heads=6, kv_heads=3, block_size=128, rope_theta=500.0, rotary_dim=80, causal=True),
]


@SM90
@pytest.mark.parametrize("fast", [False, True], ids=["deterministic", "fast"])
@pytest.mark.parametrize("case", PADDED_STORED_DQ_CASES, ids=_case_id)
def test_grouped_d96_backward_runs_the_flash_kernel_in_padded_tiles(monkeypatch, case, fast):
    """With D 96 among the head dims whose grouped calls save lse (``GROUPED_SAVES_LSE_HEAD_DIMS``), the backward
    runs on the flash kernel with dQ stored in 128-wide tiles (the block kernels' backward not at all; a rotary
    call's through the rotation pass, or on the copies the forward saved where the kernel rotates back), in both
    modes, against the float64 oracle, bf16 and fp16, on lengths around the block size; the same bits twice."""
    from blockattn_layers.kernels.sm90 import flash_bwd
    from blockattn_layers.ops import library

    monkeypatch.setattr(library, "GROUPED_SAVES_LSE_HEAD_DIMS", library.GROUPED_SAVES_LSE_HEAD_DIMS | {96})
    calls = _stored_dq_spy(monkeypatch)
    case = dict(case)
    heads, kv_heads = case.pop("heads"), case.pop("kv_heads")
    rot = case.get("rotary_dim", 96) if "rope_theta" in case else 0
    if rot:
        assert flash_bwd.unrotates(case["block_size"], 96, rot, case.get("rotary_interleaved", False))
    _check_stored_dq_backward(calls, case, heads, kv_heads, 96, fast)


@SM90
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_grouped_d96_flash_backward_keeps_nan_in_its_block_and_head(monkeypatch, rotary):
    """Where the flash kernel runs the D 96 backward in 128-wide tiles, a NaN in one token's q, k, v reaches only its
    own block's outputs and gradients, and a NaN in one query head's q and one kv head's k and v (whose channels
    a tile of the head before would reach past its 96) only that head's own and its group's."""
    from blockattn_layers.ops import library

    monkeypatch.setattr(library, "GROUPED_SAVES_LSE_HEAD_DIMS", library.GROUPED_SAVES_LSE_HEAD_DIMS | {96})
    calls = _stored_dq_spy(monkeypatch)
    with variants.forced_variant("auto"):
        _assert_nan_stays_in_its_block(8, 2, 96, 128, rotary)
    assert calls and all(stored for stored, _ in calls)
    q, k, v, offsets = make_inputs(EDGE_LENGTHS + LENGTHS_AROUND_128, 8, 2, 96, torch.bfloat16, seed=5)
    kw = dict(block_size=128, rope_theta=1e4 if rotary else None, rotary_interleaved=rotary)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    clean = bl.block_attention(*leaves, offsets, backend="triton", **kw)
    grads = torch.autograd.grad(clean, leaves, torch.ones_like(clean))
    q, k, v = (x.clone() for x in (q, k, v))
    q[:, 1] = float("nan")  # query head 1 (kv head 0's group)
    k[:, 1] = v[:, 1] = float("nan")  # kv head 1 (query heads 4-7)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = bl.block_attention(*leaves, offsets, backend="triton", **kw)
    poisoned = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for head in (0, 2, 3):
        assert torch.equal(out[:, head], clean[:, head]) and torch.equal(poisoned[0][:, head], grads[0][:, head])


@SM90
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_hopper_heads_backward_keeps_a_nan_in_its_block(rotary):
    """With hopper_heads forced, a NaN in one token's q, k, v reaches only its own block's gradients."""
    _assert_nan_stays_in_its_block(4, 2, 96, 128, rotary, "hopper_heads")


ROTATED_CASES = [
    # The backward without rotary on hopper_wide's, grouped query heads one by one (blocks over 64 at D
    # over 128; the flash kernels' off sm_90).
    dict(heads=4, kv_heads=1, dim=256, block_size=128, causal=True, rope_theta=1e4),
    # ... on hopper_wide (one query head per kv head), interleaved pairs over part of the channels.
    dict(heads=2, kv_heads=2, dim=256, block_size=128, rope_theta=1e4, rotary_dim=128, rotary_interleaved=True),
    # ... on hopper, at given positions; and on simple (D256 grouped query heads at block 64).
    dict(heads=8, kv_heads=2, dim=128, block_size=128, rope_theta=1e4, rotary_interleaved=True, positions="int"),
    dict(heads=4, kv_heads=1, dim=96, block_size=100, causal=True, rope_theta=1e4, rotary_dim=64),
    dict(heads=8, kv_heads=2, dim=256, block_size=64, rope_theta=500.0, positions="float"),
    dict(heads=8, kv_heads=2, dim=128, block_size=32, rope_theta=1e4, causal=True),
]


@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", ROTATED_CASES, ids=_case_id)
def test_rotated_backward_forced(monkeypatch, case, table):
    """``rotated`` forced: the rotary backward as a rotation pass into copies of q and k, the
    backward without rotary (whichever variant auto takes for it, or the flash kernels) and the
    transpose rotation of dq and dk in place, against the float64 oracle, bf16 and fp16, on lengths
    around the block size (empty, 1-token and ragged blocks)."""
    from blockattn_layers.kernels.block import rotation
    from blockattn_layers.kernels.common import schedule as _schedule

    passes = []
    real = rotation.rotate_rows
    monkeypatch.setattr(rotation, "rotate_rows", lambda *a, **kw: passes.append(a[-2:]) or real(*a, **kw))
    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    with variants.forced_variant("rotated"):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, offsets = _around_the_blocks(case, heads, kv_heads, dim, dtype, seed=heads + dim)
            passes.clear()
            check_against_oracle(q, k, v, offsets, **case)
            assert passes == [(False, False), (True, True)]


def test_forcing_a_backward_variant_is_not_undone_by_a_prepared_backward(monkeypatch):
    """The forward prepares its backward (``bwd.prepare_backward``) by the forward's launch key. A
    forced variant whose forward is auto's (``rotated`` here) launches that same forward: its
    backward must still be its own, not the one prepared for auto's calls."""
    from blockattn_layers.kernels.block import rotation

    passes = []
    real = rotation.rotate_rows
    monkeypatch.setattr(rotation, "rotate_rows", lambda *a, **kw: passes.append(a[-2:]) or real(*a, **kw))
    q, k, v, offsets = make_inputs(EDGE_LENGTHS, 4, 1, 64, torch.bfloat16)

    def step():
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = bl.block_attention(*xs, offsets, block_size=64, rope_theta=1e4, backend="triton")
        return torch.autograd.grad(out, xs, torch.ones_like(out))

    with variants.forced_variant("auto"):
        facts = variants.call_facts(q, k, 64, 64, False, False, backward=True)
        assert variants.choose(facts, q, (q, k, v)).name != "rotated"
        want = [step() for _ in range(3)][-1]  # the first backward compiles; later ones are prepared
    assert passes == []
    with variants.forced_variant("rotated"):
        got = step()
    assert passes == [(False, False), (True, True)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(4, 1, 128, 128), (8, 2, 256, 64), (4, 1, 256, 128)])
def test_rotated_backward_keeps_a_nan_in_its_block(heads, kv_heads, dim, block_size):
    """With ``rotated`` forced, a NaN in one token's q, k, v reaches only its own block's gradients."""
    _assert_nan_stays_in_its_block(heads, kv_heads, dim, block_size, True, "rotated")


PACKED_CASES = [
    dict(heads=2, kv_heads=2, dim=128, block_size=16),
    dict(heads=8, kv_heads=2, dim=64, block_size=32, causal=True, rope_theta=1e4),
    dict(heads=2, kv_heads=2, dim=96, block_size=20, rope_theta=1e4, positions="float"),
]


@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", PACKED_CASES, ids=_case_id)
def test_packed_kernels_forced(monkeypatch, case, table):
    """The packed variant (blocks of up to 32 tokens several to a 64-row tile), forced (auto does not
    take it: a NaN crosses its blocks), matches the float64 oracle, bf16 and fp16 (off sm_90 its first
    launches are self-checked against the simple kernels: no hardware run is recorded there)."""
    _forced_variant_matches_oracle(monkeypatch, "packed", case, table, EDGE_LENGTHS * 2 + [16, 32, 33, 1] * 3)


HOPPER_PACKED_CASES = [
    dict(heads=2, kv_heads=2, dim=128, block_size=16),
    dict(heads=8, kv_heads=2, dim=64, block_size=32, causal=True),
    dict(heads=4, kv_heads=1, dim=96, block_size=20, causal=True, scale=0.3),
    dict(heads=2, kv_heads=2, dim=256, block_size=8),
    dict(heads=4, kv_heads=2, dim=32, block_size=32),
    dict(heads=2, kv_heads=2, dim=64, block_size=16, causal=True, rope_theta=1e4),
    dict(heads=8, kv_heads=2, dim=32, block_size=32, rope_theta=500.0, positions="float"),
    dict(heads=4, kv_heads=4, dim=64, block_size=24, rope_theta=1e4, positions="int"),
    dict(heads=2, kv_heads=2, dim=48, block_size=16, rope_theta=1e4, rotary_dim=32, causal=True),
    dict(heads=8, kv_heads=2, dim=64, block_size=32, rope_theta=1e4, rotary_dim=32, positions="int"),
    dict(heads=2, kv_heads=2, dim=32, block_size=16, rope_theta=1e4, rotary_interleaved=True),
    # The rotary backward of 128-wide tiles of blocks (gradients rotated back in registers).
    dict(heads=2, kv_heads=2, dim=128, block_size=16, rope_theta=1e4, causal=True),
    dict(heads=4, kv_heads=1, dim=96, block_size=32, rope_theta=1e4, rotary_dim=64, positions="float"),
    # Interleaved pairs at 128-wide tiles (auto took them in session 27; simple is faster since session 28).
    dict(heads=8, kv_heads=2, dim=128, block_size=32, rope_theta=1e4, rotary_interleaved=True, causal=True),
    dict(heads=2, kv_heads=2, dim=96, block_size=16, rope_theta=1e4, rotary_interleaved=True, rotary_dim=64),
]


@SM90
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", HOPPER_PACKED_CASES, ids=_case_id)
def test_hopper_packed_kernels_forced(monkeypatch, case, table):
    """The hopper kernels on 64-row tiles of 2 or 4 blocks (``hopper_packed``), forced, take these calls
    on sm_90 (checked) and match the float64 oracle, bf16 and fp16, forward and backward, on lengths
    around 16 and 32 with empty and 1-token sequences, the in-kernel schedule or the table; rotary at
    each row's position in its sequence or at given int / float positions."""
    _forced_variant_matches_oracle(monkeypatch, "hopper_packed", case, table,
                                   EDGE_LENGTHS * 2 + [16, 32, 33, 1, 15, 17, 31] * 3)


@SM90
def test_remembered_launch_of_tiles_of_blocks():
    """Calls of one signature after the first skip the variant choice (a remembered launch): with
    hopper_packed (blocks of 16, 4 to a program) the grid is the tiles' count of each call's blocks,
    so a second batch of other sizes, then a third with more sequences than the in-kernel schedule
    takes, still match the float64 oracle, forward and backward."""
    with variants.forced_variant("auto"):  # (whatever the environment forces)
        for lengths in ([5, 16, 33, 0, 70], EDGE_LENGTHS * 3, [17, 3, 40] * 200):
            q, k, v, offsets = make_inputs(lengths, 2, 2, 64, torch.bfloat16, seed=len(lengths))
            assert _variant(q, k, (q, k, v), 16, 0) == "hopper_packed"
            check_against_oracle(q, k, v, offsets, block_size=16, causal=True)
            check_against_oracle(q, k, v, offsets, block_size=16, causal=True)


HOPPER_WS_CASES = [
    dict(heads=2, kv_heads=2, dim=128, block_size=64),
    dict(heads=2, kv_heads=2, dim=128, block_size=64, causal=True, rope_theta=1e4),
    dict(heads=4, kv_heads=4, dim=64, block_size=64, rope_theta=500.0, positions="float"),
    dict(heads=1, kv_heads=1, dim=64, block_size=48, causal=True, scale=0.3),
]


@SM90
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", HOPPER_WS_CASES, ids=_case_id)
def test_hopper_ws_kernels_forced(monkeypatch, case, table):
    """The experimental persistent, warp-specialized kernels, forced, take these calls on sm_90 (checked), forward and
    backward, and match the float64 oracle, fp16 and bf16: full blocks through TMA, ragged and
    empty ones (the edge lengths) through masked copies, with the in-kernel schedule or the table."""
    _forced_variant_matches_oracle(monkeypatch, "hopper_ws", case, table, EDGE_LENGTHS * 2 + [64] * 5)


@SM90
def test_hopper_ws_cuda_graph_replay(monkeypatch):
    """The hopper_ws kernels (tensor maps made in the kernel, their scratch from PyTorch's
    allocator during capture) replay captured forward and backward with new data."""
    q = torch.empty(1, 4, 64, device=DEV, dtype=torch.bfloat16)
    with variants.forced_variant("hopper_ws"):
        assert _variant(q, q, (q, q, q), 64, 0) == "hopper_ws"
        _graph_replay_matches_eager(64, "triton", kv_heads=4)


@SM90
def test_hopper_falls_back_to_simple():
    """Calls the hopper kernels do not take run the simple ones under auto (whatever the
    environment forces): fp32, blocks over 128, rotary_dim not a multiple of 16, interleaved
    rotary, rows not 16-byte aligned; 128-row blocks and 64-bit addressing run hopper, blocks of 32 or fewer rows (D64,
    with and without rotary) hopper_packed."""
    q, k, v, offsets = make_inputs([5, 64, 0, 130], 2, 2, 64, torch.bfloat16)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)[1:].view(q.shape).copy_(q)
    with variants.forced_variant("auto"):
        assert _variant(q, k, (q, k, v), 64, 0) == "hopper"
        assert _variant(q, k, (q, k, v), 128, 0) == "hopper" and _variant(q, k, (q, k, v), 64, 0, int64=True) == "hopper"
        assert _variant(q, k, (q, k, v), 32, 0) == "hopper_packed"
        assert _variant(q, k, (q, k, v), 16, 0, int64=True) == "hopper_packed"
        assert _variant(q, k, (q, k, v), 32, 64) == "hopper_packed"
        for q_, tensors, block, rot, interleaved, int64 in [
                (q.float(), (q.float(),), 64, 0, False, False), (q, (q, k, v), 129, 0, False, False),
                (q, (q, k, v), 64, 24, False, False), (q, (q, k, v), 64, 24, True, False),
                (q, (odd, k, v), 64, 0, False, False)]:
            assert _variant(q_, k.to(q_.dtype), tensors, block, rot, interleaved, int64) == "simple"
        check_against_oracle(odd, k, v, offsets, block_size=64, causal=True)
        check_against_oracle(q, k, v, offsets, block_size=64, rope_theta=1e4, rotary_dim=24)


def test_auto_picks_triton_on_cuda():
    q, k, v, offsets = make_inputs([5, 9], 2, 2, 64, torch.bfloat16)
    params = bl._validation.validate_attention_args(
        q, k, v, offsets, 64, scale=None, causal=False, rope_theta=None, positions=None, rotary_dim=None,
        rotary_interleaved=False, cpu_offsets=None, max_seqlen=None, validate=False,
    )
    spec = bl.dispatch.select_backend("auto", bl.AttentionRequest.from_call(q, k, params))
    assert spec.name == "triton"
    params_full = bl._validation.validate_attention_args(
        q.double(), k.double(), v.double(), offsets, 64, scale=None, causal=False, rope_theta=None,
        positions=None, rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=None,
        validate=False,
    )
    spec = bl.dispatch.select_backend("auto", bl.AttentionRequest.from_call(q.double(), k.double(), params_full))
    assert spec.name == "reference"


def test_cpu_offsets_exact_grid_matches():
    q, k, v, offsets = make_inputs(EDGE_LENGTHS, 4, 2, 64, torch.bfloat16)
    a = bl.block_attention(q, k, v, offsets, backend="triton", rope_theta=1e4)
    b = bl.block_attention(q, k, v, offsets, backend="triton", rope_theta=1e4, cpu_offsets=offsets.cpu())
    assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("block_size", [64, None], ids=["block", "full"])
def test_tensors_on_a_gpu_that_is_not_current(block_size):
    """Triton launches on the current device; a call on cuda:1 while cuda:0 is current runs on
    cuda:1 and gives what it gives with cuda:1 current, forward and gradients."""
    q, k, v, offsets = (x.to("cuda:1") for x in make_inputs([70, 0, 130, 5, 1], 4, 2, 64, torch.float16))
    grad_out = torch.randn_like(q)

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = bl.block_attention(*leaves, offsets, block_size, causal=True, rope_theta=1e4, backend="auto")
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    with torch.cuda.device(0):
        got = run()
    with torch.cuda.device(1):
        want = run()
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)
