"""Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest
when no GPU is present), forward and gradients against the float64 oracle.

fp32 and fp16 only: bf16 arithmetic is wrong in the interpreter; bf16 is covered on the GPU.
"""
import pytest
import torch

import blockattn_layers as bl
from blockattn_layers.ops.backends.triton_block import interpreter_active

from tests.oracle import clean_and_poisoned, offsets_from_lengths, oracle_attention, rel_err, rotary_positions

pytestmark = pytest.mark.skipif(
    not interpreter_active(), reason="CPU interpreter tests; on a GPU machine test_triton_gpu.py covers the kernels"
)

EDGE_LENGTHS = [0, 1, 63, 64, 65, 130, 0, 5]


def _offsets(lengths, dtype=torch.int64):
    o = torch.zeros(len(lengths) + 1, dtype=dtype)
    o[1:] = torch.tensor(lengths, dtype=dtype).cumsum(0)
    return o


def _inputs(lengths, heads, kv_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    return q, k, v


def _check(lengths, heads, kv_heads, dim, dtype, seed=0, tol=None, offsets_dtype=torch.int64, **kw):
    q, k, v = _inputs(lengths, heads, kv_heads, dim, dtype, seed)
    offsets = _offsets(lengths, offsets_dtype)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out = bl.block_attention(qs, ks, vs, offsets, backend="triton", **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    want = oracle_attention(qd, kd, vd, offsets, kw.pop("block_size", 64), **kw)
    want_grads = torch.autograd.grad(want, (qd, kd, vd), grad_out.double())
    tol = tol or {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, want) < tol
    for name, got, ref in zip("qkv", grads, want_grads):
        assert rel_err(got, ref) < 2 * tol, f"d{name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size,causal",
    [(2, 2, 32, 64, False), (4, 2, 24, 16, True), (2, 1, 32, 100, True), (3, 3, 16, 128, False)],
    ids=lambda x: str(x),
)
def test_edge_lengths(heads, kv_heads, dim, block_size, causal, dtype):
    _check(EDGE_LENGTHS, heads, kv_heads, dim, dtype, block_size=block_size, causal=causal)


def test_wide_heads_in_long_blocks_take_the_flash_backward(monkeypatch):
    """Blocks over 64 rows with head dims over 128 (no block kernel's backward fits one program on
    the GPU) get the flash kernels' backward on the output and logsumexp the forward saved:
    gradients match the oracle, and neither the block kernels' backward nor their forward without
    a logsumexp is called."""
    from blockattn_layers.ops.backends import triton_block

    def refuse(*args, **kwargs):
        raise AssertionError("a block kernel without the logsumexp ran")

    monkeypatch.setattr(triton_block, "block_attention_bwd", refuse)
    monkeypatch.setattr(triton_block, "block_attention_fwd", refuse)
    _check([0, 1, 99, 129, 3], 2, 1, 144, torch.float16, block_size=100, causal=True, rope_theta=1e4)
    with pytest.raises(AssertionError, match="without the logsumexp ran"):
        _check([5, 70], 1, 1, 144, torch.float16, block_size=64)


def test_grouped_heads_at_d128_save_the_logsumexp_the_block_kernels_leave_unread(monkeypatch):
    """Grouped query heads on 16-bit blocks over 64 tokens at D 128 (``saves_lse``: for sm_90's flash kernel
    with dQ stored): the forward stores each row's logsumexp, as the reference computes it; off sm_90 (here
    the interpreter) the block kernels run the backward, the flash kernels not at all, and it matches the
    oracle; one query head per kv head saves none."""
    from blockattn_layers.ops.backends import triton_block

    def refuse(*args, **kwargs):
        raise AssertionError("the flash backward ran")

    monkeypatch.setattr(triton_block, "flash_attention_bwd", refuse)
    lengths = [0, 1, 71, 72, 73, 5]
    q, k, v = _inputs(lengths, 4, 2, 128, torch.float16, 5)
    offsets = _offsets(lengths)
    args = (72, 0.09, True, None, None, 0, False, None, None)
    out, lse = torch.ops.blockattn.attention_fwd(q, k, v, offsets, *args, "triton")
    want, want_lse = torch.ops.blockattn.attention_fwd(q.double(), k.double(), v.double(), offsets, *args,
                                                       "reference")
    assert lse.shape == (4, sum(lengths)) and rel_err(out, want) < 3e-3 and rel_err(lse, want_lse) < 1e-4
    _check(lengths, 4, 2, 128, torch.float16, block_size=72, causal=True)
    _, none = torch.ops.blockattn.attention_fwd(q, k[:, :1].repeat(1, 4, 1), v[:, :1].repeat(1, 4, 1), offsets,
                                                *args, "triton")
    assert none.shape == (4, 0)


@pytest.mark.parametrize("dim,block_size", [(128, 128), (256, 64)])
def test_float32_tiles_over_shared_memory_take_the_flash_kernels(monkeypatch, dim, block_size):
    """float32 blocks whose tile would not fit a program's shared memory on the GPU (128 x 128 and
    64 x 256: the launch failed there with IEEE products too) run forward and backward on the flash
    kernels, with and without gradients, and match the oracle; 16-bit ones keep the block kernels."""
    from blockattn_layers.ops.backends import triton_block

    def refuse(*args, **kwargs):
        raise AssertionError("a block kernel ran")

    for name in ("block_attention_bwd", "block_attention_fwd", "block_attention_fwd_lse"):
        monkeypatch.setattr(triton_block, name, refuse)
    lengths = [0, 1, block_size - 1, block_size + 1, 3]
    _check(lengths, 4, 2, dim, torch.float32, block_size=block_size, causal=True)
    q, k, v = _inputs(lengths, 4, 2, dim, torch.float32, 0)
    with torch.no_grad():
        out = bl.block_attention(q, k, v, _offsets(lengths), block_size, backend="triton")
    want = oracle_attention(q.double(), k.double(), v.double(), _offsets(lengths), block_size)
    assert rel_err(out, want) < 2e-5
    with pytest.raises(AssertionError, match="a block kernel ran"):
        _check(lengths, 4, 2, dim, torch.float16, block_size=block_size)


@pytest.mark.parametrize("causal,rotary", [(False, {}), (True, dict(rope_theta=1e4, rotary_dim=64))],
                         ids=["plain", "causal-partial-rotary"])
def test_wide_heads_in_long_blocks_save_the_logsumexp(causal, rotary):
    """The forward op of those kinds returns each query row's logsumexp, as the reference computes
    it in float64 (zero- and one-token sequences, lengths around the block, grouped query heads);
    the output without gradients (the variant choice, no logsumexp) equals the one with them."""
    lengths = [0, 1, 80, 161, 0, 7]
    q, k, v = _inputs(lengths, 4, 2, 160, torch.float16, 3)
    offsets = _offsets(lengths)
    args = (80, 0.125, causal, rotary.get("rope_theta"), None, rotary.get("rotary_dim", 0), False, None, None)
    out, lse = torch.ops.blockattn.attention_fwd(q, k, v, offsets, *args, "triton")
    want, want_lse = torch.ops.blockattn.attention_fwd(q.double(), k.double(), v.double(), offsets, *args,
                                                       "reference")
    assert lse.shape == (4, sum(lengths)) and lse.dtype == torch.float32
    assert rel_err(out, want) < 3e-3 and rel_err(lse, want_lse) < 1e-4  # q, k rotated in float16
    with torch.no_grad():
        inference = bl.block_attention(q, k, v, offsets, 80, scale=0.125, causal=causal, backend="triton", **rotary)
    torch.testing.assert_close(inference, out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "rotary",
    [
        dict(rope_theta=10000.0),
        dict(rope_theta=100.0, rotary_dim=16),
        dict(rope_theta=10000.0, rotary_interleaved=True, causal=True),
        dict(rope_theta=500.0, rotary_dim=8, rotary_interleaved=True),
        dict(rope_theta=10000.0, positions="int"),
        dict(rope_theta=10000.0, positions="float"),
    ],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
def test_rotary(rotary):
    rotary = dict(rotary)
    total = sum(EDGE_LENGTHS)
    positions, tol = rotary_positions(rotary.pop("positions", None), total)
    if positions is not None:
        rotary["positions"] = positions
    _check(EDGE_LENGTHS, 4, 2, 32, torch.float32, block_size=32, tol=tol, **rotary)


def test_int32_offsets_noncontiguous_inputs_and_scale():
    lengths = [3, 64, 0, 70]
    total = sum(lengths)
    base = torch.randn(total, 2, 2, 32)
    q, k, v = base[:, 0], base[:, 1], torch.randn(32, total, 2).permute(1, 2, 0)
    assert not q.is_contiguous() and not v.is_contiguous()
    offsets = _offsets(lengths, torch.int32)
    out = bl.block_attention(q, k, v, offsets, block_size=32, scale=0.3, backend="triton")
    want = oracle_attention(q.double(), k.double(), v.double(), offsets, 32, scale=0.3)
    assert rel_err(out, want) < 2e-5


def test_outputs_have_the_fakes_strides():
    """Output and gradients are laid out as the ops' fakes say (standard contiguous strides), also
    for inputs that are contiguous with other strides on a dimension of size 1."""
    q = torch.randn(4, 1, 16).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(2, 1, 16).transpose(0, 1).requires_grad_() for _ in range(2))
    assert q.is_contiguous() and q.stride() != (64, 16, 1)
    out = bl.block_attention(q, k, v, _offsets([1]), 64, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert out.stride() == (64, 16, 1)
    assert [g.stride() for g in grads] == [(64, 16, 1), (32, 16, 1), (32, 16, 1)]


def test_empty_batches_and_cpu_offsets():
    q = torch.randn(0, 2, 16)
    assert bl.block_attention(q, q, q, torch.zeros(1, dtype=torch.int64), backend="triton").shape == (0, 2, 16)
    lengths = [0, 0, 9, 0]
    q, k, v = _inputs(lengths, 2, 2, 16, torch.float32, 0)
    offsets = _offsets(lengths)
    a = bl.block_attention(q, k, v, offsets, block_size=4, backend="triton")
    b = bl.block_attention(q, k, v, offsets, block_size=4, backend="triton", cpu_offsets=offsets.clone())
    assert torch.equal(a, b)
    assert rel_err(a, oracle_attention(q.double(), k.double(), v.double(), offsets, 4)) < 2e-5


def test_backward_bitwise_deterministic():
    q, k, v = (x.requires_grad_() for x in _inputs(EDGE_LENGTHS, 4, 2, 16, torch.float32, 5))
    offsets = _offsets(EDGE_LENGTHS)
    out = bl.block_attention(q, k, v, offsets, block_size=32, backend="triton", causal=True)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("block_size,dim", [(16, 16), (72, 144)], ids=["one-program-backward", "saves-lse"])
def test_opcheck_triton_ops(block_size, dim):
    lengths = [5, 0, 33] if block_size == 16 else [5, 0, 75]
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, 2, 1, dim, torch.float32, 6))
    offsets = _offsets(lengths)
    args = (q, k, v, offsets, block_size, 0.25, True, 1000.0, None, 16, False, None, None, "triton")
    torch.library.opcheck(torch.ops.blockattn.attention_fwd.default, args)


def test_auto_prefers_reference_on_cpu_even_with_interpreter():
    lengths = [5, 9]
    q, k, v = _inputs(lengths, 2, 2, 16, torch.float32, 0)
    explained = bl.explain(bl.AttentionRequest("cpu", None, torch.float32, 16, 2, 2, 64, False, False))
    assert explained["triton"] == []
    params = bl._validation.validate_attention_args(
        q, k, v, _offsets(lengths), 64, scale=None, causal=False, rope_theta=None, positions=None,
        rotary_dim=None, rotary_interleaved=False, cpu_offsets=None, max_seqlen=None, validate=None,
    )
    assert bl.dispatch.select_backend("auto", bl.AttentionRequest.from_call(q, k, params)).name == "reference"


def test_explicit_triton_refuses_unsupported_with_reasons():
    q = torch.randn(4, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="triton.*dtype torch.float64"):
        bl.block_attention(q, q, q, torch.tensor([0, 4]), backend="triton")
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="block_size 256 above 128"):
        bl.block_attention(q, q, q, torch.tensor([0, 4]), block_size=256, backend="triton")


@pytest.mark.parametrize("mode", ["inline", "table"])
def test_block_table_and_inline_schedule(monkeypatch, mode):
    """Small batches find their blocks from offsets inside the kernel; large ones use the table."""
    from blockattn_layers.kernels.common import schedule as _schedule

    if mode == "table":
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    positions, tol = rotary_positions("int", sum(EDGE_LENGTHS))
    _check(EDGE_LENGTHS, 4, 2, 16, torch.float32, block_size=32, causal=True, rope_theta=1e4,
           positions=positions, tol=tol)
    _check(EDGE_LENGTHS, 2, 2, 16, torch.float16, block_size=48, offsets_dtype=torch.int32)


def test_inline_schedule_at_its_limit_matches_table(monkeypatch):
    from blockattn_layers.kernels.common import schedule as _schedule

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (_schedule.INLINE_MAX_SEQS,), generator=g).tolist()
    q, k, v = _inputs(lengths, 1, 1, 16, torch.float32, 3)
    offsets = _offsets(lengths)
    inline = bl.block_attention(q, k, v, offsets, block_size=2, backend="triton")
    monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", len(lengths) - 1)
    table = bl.block_attention(q, k, v, offsets, block_size=2, backend="triton")
    assert torch.equal(inline, table)
    assert rel_err(inline, oracle_attention(q.double(), k.double(), v.double(), offsets, 2)) < 2e-5


LEAK_CASES = [(torch.float32, 32, 2e-5, 4e-5), (torch.float16, 64, 2e-3, 5e-3)]


@pytest.mark.parametrize("dtype,block_size,fwd_tol,grad_tol", LEAK_CASES, ids=["fp32", "fp16"])
def test_other_sequences_never_leak_in(dtype, block_size, fwd_tol, grad_tol):
    """NaN in one sequence's q, k, v leaves every other sequence's outputs and gradients exact."""
    lengths = [20, 37, 64, 9]
    offsets = _offsets(lengths)
    q, k, v = (x.requires_grad_() for x in _inputs(lengths, 2, 2, 16, dtype, 9))
    with torch.no_grad():
        for x in (q, k, v):
            x[20:57] = float("nan")  # the second sequence
    out = bl.block_attention(q, k, v, offsets, block_size=block_size, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    keep = torch.cat([torch.arange(0, 20), torch.arange(57, 130)])
    clean = [x.detach()[keep].double() for x in (q, k, v)]
    clean_offsets = _offsets([20, 64, 9])
    cq, ck, cv = (x.requires_grad_() for x in clean)
    want = oracle_attention(cq, ck, cv, clean_offsets, block_size)
    want_grads = torch.autograd.grad(want, (cq, ck, cv), torch.ones_like(want))
    assert rel_err(out[keep], want) < fwd_tol
    for got, ref in zip(grads, want_grads):
        assert rel_err(got[keep], ref) < grad_tol


PACKED_CASES = [  # (case, block table instead of the in-kernel schedule)
    (dict(heads=2, kv_heads=2, dim=32, block_size=16), False),
    (dict(heads=4, kv_heads=2, dim=32, block_size=32, causal=True), True),
    (dict(heads=2, kv_heads=1, dim=16, block_size=5, rope_theta=1e4), True),
    (dict(heads=2, kv_heads=2, dim=32, block_size=20, rope_theta=500.0, rotary_dim=16, rotary_interleaved=True,
          causal=True), False),
    (dict(heads=2, kv_heads=2, dim=32, block_size=16, rope_theta=1e4, positions="float"), False),
]


@pytest.mark.parametrize("case,table", PACKED_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         if isinstance(c, dict) else ("table" if c else "inline"))
def test_packed_variant_matches_the_oracle(monkeypatch, case, table):
    """The ``packed`` variant (several blocks of up to 32 tokens in one 64-row tile,
    masked block-diagonally) forced: forward and gradients against the float64 oracle on edge
    lengths (empty tiles and slots, 1-token and ragged blocks), GQA, causal, every rotary form,
    with the in-kernel schedule or the block table (its last tile partly past the table)."""
    from blockattn_layers.kernels.common import schedule

    if table:
        monkeypatch.setattr(schedule, "INLINE_MAX_SEQS", 0)
    _forced_variant_matches_the_oracle("packed", case, (torch.float16,))


def _forced_variant_matches_the_oracle(name: str, case: dict, dtypes) -> None:
    """``name`` forced takes the backward of ``case`` (checked) and matches the float64 oracle on
    ``EDGE_LENGTHS`` in each of ``dtypes``; ``positions="float"`` draws random positions."""
    from blockattn_layers.kernels.block import variants

    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    if case.get("positions") == "float":
        case["positions"] = torch.rand(sum(EDGE_LENGTHS), generator=torch.Generator().manual_seed(1)) * 3000
    q = torch.empty(1, heads, dim, dtype=torch.float16)
    k = torch.empty(1, kv_heads, dim, dtype=torch.float16)
    facts = variants.call_facts(q, k, case["block_size"], 0, False, False, backward=True)
    with variants.forced_variant(name):
        assert variants.choose(facts, q, (q,)) is variants.VARIANTS[name]
        for dtype in dtypes:
            _check(EDGE_LENGTHS, heads, kv_heads, dim, dtype, **case)


KEYS_CASES = [
    dict(heads=4, kv_heads=2, dim=32, block_size=100, causal=True),
    dict(heads=3, kv_heads=1, dim=48, block_size=128, rope_theta=1e4),
    dict(heads=4, kv_heads=2, dim=32, block_size=65, causal=True, rope_theta=500.0, rotary_dim=16,
         rotary_interleaved=True),
    dict(heads=2, kv_heads=1, dim=32, block_size=40, rope_theta=1e4, rotary_dim=16, positions="float"),
]


@pytest.mark.parametrize("case", KEYS_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_keys_variant_matches_the_oracle(case):
    """The ``keys`` backward (dK, dV over the block's key rows, 64-row query tiles, the scores
    transposed and each column's softmax over the keys) forced: forward and gradients against the
    float64 oracle on edge lengths (empty and 1-token blocks, ragged last blocks, two query tiles
    of which the second is partial), GQA, causal, every rotary form, fp32 and fp16."""
    _forced_variant_matches_the_oracle("keys", case, (torch.float32, torch.float16))


def _nan_confined(variant: str, block_size: int, heads: int, kv_heads: int, dim: int, rotary: bool) -> bool:
    """Whether a NaN in one token's q, k, v (and its output gradient) leaves every row outside its
    block bitwise as in the clean call, with ``variant`` forced (forward and the three gradients);
    the poisoned block itself must show NaN."""
    from blockattn_layers.kernels.block import variants

    lengths = [3, block_size * 2 + 5, 0, 1, block_size + 1]
    total = sum(lengths)
    offsets = offsets_from_lengths(lengths)
    g = torch.Generator().manual_seed(block_size + dim)
    q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(total, heads, dim, generator=g)
    token = 3 + block_size + 2  # in the second block of the second sequence
    block = torch.zeros(total, dtype=torch.bool)
    block[3 + block_size: 3 + 2 * block_size] = True

    def attention(q, k, v):
        return bl.block_attention(q, k, v, offsets, block_size, causal=True, rope_theta=1e4 if rotary else None,
                                  backend="triton")

    with variants.forced_variant(variant):
        clean, poisoned = clean_and_poisoned(attention, q, k, v, grad_out, token)
    assert all(torch.isnan(b[block]).any() for b in poisoned)
    return all(torch.equal(a[~block], b[~block]) for a, b in zip(clean, poisoned))


NAN_CASES = [(16, 2, 2, 32, False), (32, 4, 2, 32, True)]
# (numpy, under the interpreter, warns of the NaN arithmetic the test asks for)
NAN_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@NAN_WARNINGS
@pytest.mark.parametrize("block_size,heads,kv_heads,dim,rotary", NAN_CASES)
def test_simple_kernels_confine_a_nan_to_its_block(block_size, heads, kv_heads, dim, rotary):
    assert _nan_confined("simple", block_size, heads, kv_heads, dim, rotary)


@NAN_WARNINGS
@pytest.mark.parametrize("block_size,heads,kv_heads,dim,rotary", NAN_CASES)
def test_packed_kernels_confine_a_nan_to_its_block(block_size, heads, kv_heads, dim, rotary):
    """A tile with a non-finite input is computed again block by block (``tiles.finite_flag``)."""
    assert _nan_confined("packed", block_size, heads, kv_heads, dim, rotary)


@NAN_WARNINGS
@pytest.mark.parametrize("block_size,heads,kv_heads,dim,rotary", [(64, 4, 2, 32, True), (100, 2, 1, 16, False)])
def test_keys_backward_confines_a_nan_to_its_block(block_size, heads, kv_heads, dim, rotary):
    assert _nan_confined("keys", block_size, heads, kv_heads, dim, rotary)
