"""FP8 (e4m3) inputs: the quantizer, the descale factors' shapes and meaning, the forward-only
contract, and bad inputs named in the user's terms. CPU (the reference on descaled float32 copies)."""
import numpy as np
import pytest
import torch

import blockattn_layers as bl
from blockattn_layers import fp8

from tests.oracle import oracle_attention, rel_err

LENGTHS = [0, 1, 63, 64, 65, 130, 0, 5]


def _offsets(lengths):
    o = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    o[1:] = torch.tensor(lengths).cumsum(0)
    return o


def _inputs(heads=4, kv_heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    # Per-head magnitudes that differ by 100x.
    q = torch.randn(total, heads, dim, generator=g) * torch.logspace(-1.5, 0.5, heads).view(1, heads, 1)
    k = torch.randn(total, kv_heads, dim, generator=g) * 0.5
    v = torch.randn(total, kv_heads, dim, generator=g) * torch.logspace(-1, 1, kv_heads).view(1, kv_heads, 1)
    return q, k, v, _offsets(LENGTHS)


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantize_fp8_round_trips_within_e4m3_precision(granularity):
    q, _, _, offsets = _inputs()
    x8, descale = bl.quantize_fp8(q, granularity, offsets=offsets, kv_heads=2)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == q.shape
    assert descale.dtype == torch.float32
    assert descale.shape == ((len(LENGTHS), 2) if granularity == "sequence_head" else (2,))
    back = fp8.dequantize(x8, descale, offsets, 2, torch.float64)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself (relative), or of the
    # smallest normal times its part's factor.
    tiny = 2.0 ** -6 * descale.max().item()
    assert ((back - q.double()).abs() <= q.double().abs() * 2 ** -4 + tiny).all()
    assert x8.float().abs().max() <= fp8.FP8_MAX
    if granularity == "tensor":
        assert torch.equal(descale, descale[:1].expand(2))


def test_sequence_factors_follow_each_sequence_and_empty_parts_get_one():
    q, _, _, offsets = _inputs(heads=2, kv_heads=2)
    q[offsets[5]:offsets[6]] *= 1000.0  # the sequence of 130 tokens
    _, descale = bl.quantize_fp8(q, "sequence_head", offsets=offsets)
    assert torch.equal(descale[0], torch.ones(2)) and torch.equal(descale[6], torch.ones(2))  # empty sequences
    assert (descale[5] > 100 * descale[4]).all()
    want = q[offsets[3]:offsets[4]].abs().amax(dim=(0, 2)) / fp8.FP8_MAX
    assert torch.allclose(descale[3], want)


@pytest.mark.parametrize("granularity", ["head", "sequence_head"])
@pytest.mark.parametrize("kw", [dict(causal=True, rope_theta=1e4), dict(block_size=16),
                                dict(rotary_dim=16, rope_theta=500.0)],
                         ids=["causal-rotary", "block16", "partial-rotary"])
def test_fp8_attention_is_attention_of_the_descaled_inputs(granularity, kw):
    """The output is the float64 oracle's attention of (stored value x descale), rotary applied
    after descaling, GQA, zero-length and 1-token sequences; output dtype bfloat16 by default."""
    q, k, v, offsets = _inputs()
    kw = dict(kw)
    block_size = kw.pop("block_size", 64)
    q8, qd = bl.quantize_fp8(q, granularity, offsets=offsets, kv_heads=2)
    k8, kd = bl.quantize_fp8(k, granularity, offsets=offsets)
    v8, vd = bl.quantize_fp8(v, granularity, offsets=offsets)
    out = bl.block_attention(q8, k8, v8, offsets, block_size, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64) for x, d, g in ((q8, qd, 2), (k8, kd, 1), (v8, vd, 1))]
    want = oracle_attention(*deq, offsets, block_size, **kw)
    assert rel_err(out, want) < 8e-3  # bfloat16 rounding of the output
    for dtype in (torch.float16, torch.float32):
        got = bl.block_attention(q8, k8, v8, offsets, block_size, q_descale=qd, k_descale=kd, v_descale=vd,
                                 out_dtype=dtype, **kw)
        assert got.dtype == dtype and rel_err(got, want) < (1e-3 if dtype == torch.float16 else 1e-5)


def test_fp8_error_against_the_unquantized_oracle_is_e4m3s():
    """Against the oracle of the unquantized inputs the error is e4m3's (a few percent) in the
    heads of each magnitude; without the factors the result is that of the scaled values."""
    q, k, v, offsets = _inputs()
    want = oracle_attention(q.double(), k.double(), v.double(), offsets, 64, causal=True)
    parts = [bl.quantize_fp8(x, "head", kv_heads=2) for x in (q, k, v)]
    out = bl.block_attention(*(p[0] for p in parts), offsets, 64, causal=True, q_descale=parts[0][1],
                             k_descale=parts[1][1], v_descale=parts[2][1], out_dtype=torch.float32)
    for h in range(2):  # the kv heads' values differ by 100x, q's heads by 100x
        assert rel_err(out[:, 2 * h:2 * h + 2], want[:, 2 * h:2 * h + 2]) < 0.08
    none = bl.block_attention(*(p[0] for p in parts), offsets, 64, causal=True, out_dtype=torch.float32)
    assert rel_err(none, want) > 0.5  # without the factors the values are the scaled ones


def test_fp8_is_forward_only_and_bad_inputs_are_named():
    q, k, v, offsets = _inputs()
    q8, qd = bl.quantize_fp8(q, kv_heads=2)
    k8, kd = bl.quantize_fp8(k)
    v8, vd = bl.quantize_fp8(v)

    def call(**over):
        args = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
        args.update(over)
        return bl.block_attention(args.pop("q"), args.pop("k"), args.pop("v"), offsets, 64, **args)

    cases = [
        (dict(q=q8.clone().requires_grad_()), RuntimeError, "forward-only.*q requires grad"),
        (dict(k_descale=kd.clone().requires_grad_()), RuntimeError, "forward-only.*k_descale requires grad"),
        (dict(k=k.bfloat16()), TypeError, "k must be too"),
        (dict(q_descale=qd.double()), TypeError, "q_descale must be float32"),
        (dict(v_descale=torch.ones(3)), ValueError,
         r"v_descale must have shape \[H_kv\] = \[2\] or \[B, H_kv\] = \[8, 2\]"),
        (dict(k_descale=torch.ones(2, 2)), ValueError, "k_descale must have shape"),
        (dict(q_descale=[1.0, 1.0]), TypeError, "q_descale must be a float32 tensor"),
        (dict(out_dtype=torch.int8), TypeError, "out_dtype must be"),
    ]
    for over, err, words in cases:
        with pytest.raises(err, match=words):
            call(**over)
    with pytest.raises(TypeError, match="q_descale applies to torch.float8_e4m3fn q, k, v; q is torch.float32"):
        bl.block_attention(q, k, v, offsets, 64, q_descale=qd)
    with pytest.raises(TypeError, match="out_dtype applies to torch.float8_e4m3fn"):
        bl.block_attention(q, k, v, offsets, 64, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="granularity must be one of tensor, head, sequence_head"):
        bl.quantize_fp8(q, "row")
    with pytest.raises(ValueError, match="needs offsets"):
        bl.quantize_fp8(q, "sequence_head")
    with pytest.raises(ValueError, match="kv_heads must divide x's 4 heads"):
        bl.quantize_fp8(q, kv_heads=3)
    with pytest.raises(TypeError, match="wider than fp8"):
        bl.quantize_fp8(q8)
    assert call().dtype == torch.bfloat16  # and the unchanged call runs


def test_quantize_fp8_checks_offsets_and_kv_heads_as_block_attention_does():
    """Offsets as ``block_attention`` checks them (values on CPU tensors; T named as x.shape[0]);
    kv_heads any integer but a bool; an empty x quantizes (factors 1)."""
    q = torch.randn(10, 4, 8)
    bad = {
        "offsets must be non-decreasing": torch.tensor([0, 7, 3, 10]),
        r"offsets\[-1\] must equal T = 10 \(x\.shape\[0\]\)": torch.tensor([0, 3, 5]),
        r"offsets\[0\] must be 0": torch.tensor([2, 3, 10]),
        "offsets must be int32 or int64": torch.tensor([0.0, 3.0, 10.0]),
        "offsets must be a torch.Tensor": [0, 3, 10],
        r"offsets must be a 1-D tensor \[B\+1\]": torch.tensor([[0, 3, 10]]),
    }
    for message, offsets in bad.items():
        with pytest.raises((TypeError, ValueError), match=message):
            bl.quantize_fp8(q, "sequence_head", offsets=offsets)
    with pytest.raises(TypeError, match="kv_heads must be an int, got bool"):
        bl.quantize_fp8(q, kv_heads=True)
    assert bl.quantize_fp8(q, kv_heads=np.int64(2))[1].shape == (2,)
    x8, descale = bl.quantize_fp8(torch.randn(0, 4, 8), "sequence_head", offsets=torch.tensor([0, 0]))
    assert x8.shape == (0, 4, 8) and torch.equal(descale, torch.ones(1, 4))


def test_quantize_fp8_keeps_a_nan_to_its_element():
    """A NaN (or infinity) does not set its part's factor: the finite values quantize as without it
    and the NaN stays NaN, so it is not clamped away into a finite value."""
    x = torch.randn(10, 2, 8) * 1000
    poisoned = x.clone()
    poisoned[3, 0, 1] = float("nan")
    poisoned[5, 1, 2] = float("inf")
    x8, descale = bl.quantize_fp8(poisoned)
    clean8, clean_descale = bl.quantize_fp8(torch.where(torch.isfinite(poisoned), poisoned, 0.0))
    assert torch.equal(descale, clean_descale) and torch.isnan(x8[3, 0, 1].float())
    keep = torch.isfinite(poisoned)
    assert torch.equal(x8.float()[keep], clean8.float()[keep])


def test_fp8_without_factors_means_descale_one():
    q, k, v, offsets = _inputs(heads=2, kv_heads=2)
    q8, k8, v8 = (x.clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn) for x in (q, k, v))
    out = bl.block_attention(q8, k8, v8, offsets, 64, out_dtype=torch.float32)
    want = oracle_attention(q8.double(), k8.double(), v8.double(), offsets, 64)
    assert rel_err(out, want) < 1e-5


KERNEL_CASES = [
    dict(block_size=64, causal=True),
    dict(block_size=16, rope_theta=1e4),
    dict(block_size=100, rope_theta=500.0, rotary_dim=16, rotary_interleaved=True, causal=True),
    dict(block_size=128, rope_theta=1e4, positions="float"),
    dict(block_size=48, scale=0.3),
]


@pytest.mark.parametrize("granularity", ["head", "sequence_head", None])
@pytest.mark.parametrize("kw", KERNEL_CASES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_fp8_kernel_matches_the_descaled_oracle(monkeypatch, granularity, kw):
    """The Triton fp8 forward (Triton's interpreter on CPU; float16 products, as bfloat16 math is
    wrong there) against the float64 oracle of the descaled inputs: GQA, per-head and
    per-sequence factors (the block's sequence found by binary search, empty sequences before
    it), no factors, rotary in every form, zero-length and 1-token sequences."""
    from blockattn_layers.ops.backends.triton_block import interpreter_active

    if not interpreter_active():
        pytest.skip("CPU interpreter test; the GPU tests cover the fp8 kernel")
    calls = []
    kernel = fp8.fp8_attention_fwd
    monkeypatch.setattr(fp8, "fp8_attention_fwd", lambda *a: calls.append(1) or kernel(*a))
    q, k, v, offsets = _inputs(heads=4, kv_heads=2, dim=32)
    kw = dict(kw)
    if kw.get("positions") == "float":
        kw["positions"] = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(3)) * 3000
    if granularity is None:
        parts = [(x.clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE), None) for x in (q, k, v)]
    else:
        parts = [bl.quantize_fp8(x, granularity, offsets=offsets, kv_heads=2) for x in (q, k, v)]
    (q8, qd), (k8, kd), (v8, vd) = parts
    out = bl.block_attention(q8, k8, v8, offsets, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16,
                             backend="triton", **kw)
    assert calls == [1] and out.dtype == torch.float16
    block_size = kw.pop("block_size")
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64) for x, d, g in ((q8, qd, 2), (k8, kd, 1), (v8, vd, 1))]
    want = oracle_attention(*deq, offsets, block_size, **kw)
    assert rel_err(out, want) < 3e-3


def test_fp8_kernel_sequence_search():
    """``_sequence_of`` finds each block's sequence past runs of empty sequences (the per-sequence
    factors are all distinct, so a wrong sequence shows)."""
    from blockattn_layers.ops.backends.triton_block import interpreter_active

    if not interpreter_active():
        pytest.skip("CPU interpreter test")
    lengths = [0, 0, 3, 0, 70, 0, 0, 1, 129, 0]
    offsets = _offsets(lengths)
    total = sum(lengths)
    v = torch.ones(total, 1, 16)
    q = k = torch.zeros(total, 1, 16)
    vd = (torch.arange(len(lengths), dtype=torch.float32) + 1.0).view(-1, 1)
    out = bl.block_attention(*(x.to(fp8.FP8_DTYPE) for x in (q, k, v)), offsets, 64, v_descale=vd,
                             out_dtype=torch.float16, backend="triton")  # (bfloat16 math is wrong in the interpreter)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(out[:, :, :], (seq + 1).to(torch.float16).view(-1, 1, 1).expand(total, 1, 16))


GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                         reason="needs an sm_89 or newer GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kw", KERNEL_CASES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("unverified", [False, True], ids=["verified", "unverified-allowed"])
def test_fp8_kernel_on_the_gpu(monkeypatch, kw, out_dtype, unverified):
    """The fp8 kernel (auto on CUDA) against the float64 oracle of the descaled inputs, per-head
    factors for q and v, per-sequence ones for k; the output in ``out_dtype``; NaN-free. Without
    rotary the scores come from the stored e4m3 q and k (``fp8_fwd.e4m3_scores``) where that is
    verified (``E4M3_SCORES_VERIFIED_ON``) or unverified kernels are allowed (sm_89 / sm_100 need it)."""
    from blockattn_layers.kernels.block import fp8_fwd, variants

    if not unverified and torch.cuda.get_device_capability()[0] not in fp8_fwd.VERIFIED_ON:
        pytest.skip("no hardware run recorded on this generation: taken only with unverified kernels allowed")
    calls = []
    kernel = fp8.fp8_attention_fwd
    monkeypatch.setattr(fp8, "fp8_attention_fwd", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(variants, "_UNVERIFIED", [unverified])
    q, k, v, offsets = (x.cuda() for x in _inputs(heads=8, kv_heads=2, dim=128))
    kw = dict(kw)
    if kw.get("positions") == "float":
        kw["positions"] = torch.rand(q.shape[0], device="cuda") * 3000
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(q, "head", kv_heads=2),
                                    bl.quantize_fp8(k, "sequence_head", offsets=offsets), bl.quantize_fp8(v))
    out = bl.block_attention(q8, k8, v8, offsets, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype, **kw)
    assert calls == [1] and out.dtype == out_dtype and torch.isfinite(out).all()
    block_size = kw.pop("block_size")
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64) for x, d, g in ((q8, qd, 4), (k8, kd, 1), (v8, vd, 1))]
    want = oracle_attention(*deq, offsets, block_size, **kw)
    assert rel_err(out, want) < (2e-2 if out_dtype == torch.bfloat16 or out_dtype == torch.float32 else 3e-3)


HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs an sm_90 GPU")
WS_CASES = [
    dict(heads=2, kv_heads=2, dim=128, block_size=64, causal=False, granularity="head"),
    dict(heads=4, kv_heads=1, dim=64, block_size=64, causal=True, granularity="sequence_head"),
    dict(heads=8, kv_heads=2, dim=128, block_size=40, causal=True, granularity="sequence_head"),
    dict(heads=4, kv_heads=4, dim=64, block_size=33, causal=False, granularity="tensor"),
    dict(heads=2, kv_heads=2, dim=128, block_size=64, causal=False, granularity="head", rope_theta=1e4),
    dict(heads=8, kv_heads=2, dim=64, block_size=48, causal=True, granularity="sequence_head", rope_theta=500.0,
         positions="float"),
]


def _ws_call(monkeypatch, heads, kv_heads, dim, block_size, causal, granularity, out_dtype, lengths=LENGTHS,
             poison=None, programs=None, **rotary):
    """The fp8 call through the warp-specialized sm_90 kernel (unverified kernels allowed, its
    launches counted); ``poison``: rows set to NaN in q, k, v before the call; ``rotary``: ``rope_theta``
    and ``positions`` ("float": random ones); ``programs``: the persistent grid (else one per SM), so
    few programs take many items each (every consumer, the ring's slots reused and wrapped)."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90 import fp8_fwd as ws

    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    monkeypatch.setattr(ws, "ROTARY_SLOWER_AT", ())  # tested where the Triton kernel is taken too
    launches = []
    launch = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    if programs is not None:
        from blockattn_layers.kernels.block import fp8_fwd

        monkeypatch.setattr(fp8_fwd, "sm_count", lambda device: programs)
    g = torch.Generator().manual_seed(heads * dim + block_size)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=g) * torch.logspace(-1, 0.5, heads).view(1, heads, 1)
    k = torch.randn(total, kv_heads, dim, generator=g) * 0.5
    v = torch.randn(total, kv_heads, dim, generator=g) * torch.logspace(-1, 1, kv_heads).view(1, kv_heads, 1)
    q, k, v, offsets = (x.cuda() for x in (q, k, v, _offsets(lengths)))
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x, granularity, offsets=offsets, kv_heads=kv_heads)
                                    for x in (q, k, v))
    if poison is not None:
        for x in (q8, k8, v8):
            x.view(torch.uint8)[poison] = 0x7F  # e4m3fn's NaN
    if rotary.get("positions") == "float":
        rotary["positions"] = torch.rand(total, generator=g).cuda() * 3000
    out = bl.block_attention(q8, k8, v8, offsets, block_size, causal=causal, q_descale=qd, k_descale=kd,
                             v_descale=vd, out_dtype=out_dtype, **rotary)
    assert launches == [1], "the warp-specialized kernel did not take the call"
    deq = [fp8.dequantize(x, d, offsets, g, torch.float64)
           for x, d, g in ((q8, qd, heads // kv_heads), (k8, kd, 1), (v8, vd, 1))]
    return out, oracle_attention(*deq, offsets, block_size, causal=causal, **rotary)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("out_tma", [False, True], ids=["stores", "tma-stores"])
@pytest.mark.parametrize("programs", [None, 2], ids=["one-per-SM", "two-programs"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WS_CASES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_fp8_ws_kernel_on_the_gpu(monkeypatch, case, out_dtype, programs, out_tma):
    """The warp-specialized sm_90 e4m3 forward (``kernels.sm90.fp8_fwd``) against the float64 oracle
    of the descaled inputs: zero-length and 1-token sequences, lengths around the block, GQA,
    causal, per-tensor, per-head and per-sequence factors, rotary (split halves over every channel,
    implicit or given positions), both 16-bit outputs, 64-token blocks' outputs stored by TMA or not."""
    from blockattn_layers.kernels.sm90 import fp8_fwd as ws

    monkeypatch.setattr(ws, "OUT_TMA", out_tma)
    out, want = _ws_call(monkeypatch, out_dtype=out_dtype, programs=programs, **case)
    assert out.dtype == out_dtype and torch.isfinite(out).all()
    assert rel_err(out, want) < (1e-2 if out_dtype == torch.bfloat16 else 2e-3)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in WS_CASES if "rope_theta" in c],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_fp8_ws_kernel_rotating_in_float32_on_the_gpu(monkeypatch, case, out_dtype):
    """``F16_ROTATION`` off (q and k rotated in float32 into halves of the output dtype, as the bench's
    row "float32 rotation" times it): the rotary cases against the float64 oracle."""
    from blockattn_layers.kernels.sm90 import fp8_fwd as ws

    monkeypatch.setattr(ws, "F16_ROTATION", False)
    out, want = _ws_call(monkeypatch, out_dtype=out_dtype, **case)
    assert out.dtype == out_dtype and torch.isfinite(out).all()
    assert rel_err(out, want) < (1e-2 if out_dtype == torch.bfloat16 else 2e-3)


@pytest.mark.gpu
@HOPPER
def test_fp8_ws_kernel_on_many_sequences_and_nan_stays_in_its_block(monkeypatch):
    """Over 512 sequences (the block table, per-sequence factors searched over 2,000 offsets), a
    NaN sequence between ragged ones: its rows are NaN, every other row is finite and right (the
    ragged blocks' tiles hold the NaN rows past their ends)."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 150, (2000,), generator=g).tolist()
    lengths[700] = 90
    lo = sum(lengths[:700])
    out, want = _ws_call(monkeypatch, 4, 2, 128, 64, False, "sequence_head", torch.bfloat16, lengths,
                         poison=slice(lo, lo + 90))
    assert torch.isnan(out[lo:lo + 90]).all()
    keep = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    keep[lo:lo + 90] = False
    assert torch.isfinite(out[keep]).all() and rel_err(out[keep], want[keep.to(want.device)]) < 1e-2


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("dim, slower_at, gluon", [(128, None, True), (64, None, True), (64, (64,), False)],
                         ids=["d128-gluon", "d64-gluon", "d64-triton-where-slower"])
def test_fp8_rotary_calls_run_the_kernel_measured_faster(monkeypatch, dim, slower_at, gluon):
    """With the defaults (verified kernels only), split-half rotary over every channel runs the
    warp-specialized kernel at D128 and D64, and the Triton fp8 forward at a head dim named in
    ``ROTARY_SLOWER_AT``, each matching the float64 oracle."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90 import fp8_fwd as ws

    monkeypatch.setattr(variants, "_UNVERIFIED", [False])
    if slower_at is not None:
        monkeypatch.setattr(ws, "ROTARY_SLOWER_AT", slower_at)
    launches = []
    launch = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    g = torch.Generator().manual_seed(dim)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, 2, dim, generator=g).cuda() for _ in range(3))
    offsets = _offsets(LENGTHS).cuda()
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x) for x in (q, k, v))
    out = bl.block_attention(q8, k8, v8, offsets, 64, q_descale=qd, k_descale=kd, v_descale=vd, rope_theta=1e4)
    assert launches == ([1] if gluon else [])
    deq = [fp8.dequantize(x, d, offsets, 1, torch.float64) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
    assert rel_err(out, oracle_attention(*deq, offsets, 64, rope_theta=1e4)) < 1e-2


def test_fp8_call_compiles_fullgraph():
    """``torch.compile(fullgraph=True)`` traces the fp8 call (its descaled-copies path) and
    gives the eager result."""
    q, k, v, offsets = _inputs()
    (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(q, kv_heads=2),
                                    bl.quantize_fp8(k, "sequence_head", offsets=offsets), bl.quantize_fp8(v))

    def call(q8, k8, v8, offsets, qd, kd, vd):
        return bl.block_attention(q8, k8, v8, offsets, 64, causal=True, rope_theta=1e4, q_descale=qd, k_descale=kd,
                                  v_descale=vd, out_dtype=torch.float32)

    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True)(q8, k8, v8, offsets, qd, kd, vd)
    assert torch.allclose(got, call(q8, k8, v8, offsets, qd, kd, vd), atol=1e-5, rtol=1e-5)
