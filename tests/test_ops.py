"""The op layer: one registered op pair for every attention kind, the kernel chosen inside it.

Exported graphs hold ``blockattn::attention_fwd`` whatever backend served the export, with the
backend name as an argument; the op's ``lse`` output has the same meaning on every backend;
``FlopCounterMode`` counts the in-block FLOP formula for forward and backward.
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import blockattn_layers as bl
from blockattn_layers.ops import library
from blockattn_layers.ops.backends.triton_block import interpreter_active
from tests.oracle import make_jagged, oracle_attention

LENGTHS = [5, 0, 1, 37, 16]
ATTENTION_OPS = {torch.ops.blockattn.attention_fwd.default, torch.ops.blockattn.attention_bwd.default}


def _attention_nodes(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]


def _exported(backend):
    torch.manual_seed(0)
    model = bl.BlockSelfAttention(32, 2, block_size=16, backend=backend).eval()
    values, offsets = torch.randn(sum(LENGTHS), 32), torch.tensor([0, 5, 5, 6, 43, 59])
    return model, (values, offsets), torch.export.export(model, (values, offsets))


def test_export_holds_the_one_op_with_the_backend_as_an_argument():
    model, inputs, program = _exported("auto")
    nodes = _attention_nodes(program)
    assert [n.target for n in nodes] == [torch.ops.blockattn.attention_fwd.default]
    assert nodes[0].args[-1] == "auto"
    torch.testing.assert_close(program.module()(*inputs), model(*inputs))


@pytest.mark.skipif(not interpreter_active(), reason="the triton backend on CPU needs TRITON_INTERPRET=1")
def test_export_with_triton_holds_the_same_op():
    _, _, auto = _exported("auto")
    model, inputs, triton = _exported("triton")
    auto_ops, triton_ops = _attention_nodes(auto), _attention_nodes(triton)
    assert [n.target for n in triton_ops] == [n.target for n in auto_ops]
    assert triton_ops[0].args[-1] == "triton"
    torch.testing.assert_close(triton.module()(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def test_op_runs_the_backend_named_by_its_argument():
    q, k, v, offsets = make_jagged(LENGTHS, 2, 2, 16, torch.float32, 3)
    args = (q, k, v, offsets, 16, 0.25, False, None, None, 0, False, None, None)
    out, lse = torch.ops.blockattn.attention_fwd(*args, "reference")
    assert lse.shape == (2, 0)
    torch.testing.assert_close(out, oracle_attention(q, k, v, offsets, 16).float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backend must be one of"):
        torch.ops.blockattn.attention_fwd(*args, "no_such_backend")


@pytest.mark.parametrize("block_size", [0, 200])
def test_reference_lse_is_the_rows_logsumexp(block_size):
    q, k, v, offsets = make_jagged(LENGTHS, 2, 1, 8, torch.float64, 4)
    out, lse = torch.ops.blockattn.attention_fwd(q, k, v, offsets, block_size, 0.5, True, None, None, 0, False,
                                                 None, None, "reference")
    assert lse.shape == (2, q.shape[0]) and lse.dtype == torch.float32
    bounds = offsets.tolist()
    for b in range(len(LENGTHS)):
        lo, hi = bounds[b], bounds[b + 1]
        for t in range(lo, hi):
            keys = k[lo:t + 1, 0]
            want = torch.logsumexp(q[t] @ keys.T * 0.5, -1)
            torch.testing.assert_close(lse[:, t].double(), want, rtol=1e-6, atol=1e-6)


def _pairs(lengths, block):
    total = 0
    for n in lengths:
        if block:
            total += (n // block) * block * block + (n % block) ** 2
        else:
            total += n * n
    return total


@pytest.mark.parametrize("block_size,causal", [(16, False), (16, True), (None, False), (None, True), (200, True)])
def test_flop_counter_counts_in_block_work(block_size, causal):
    heads, head_dim = 2, 8
    q, k, v, offsets = make_jagged(LENGTHS, heads, 1, head_dim, torch.float32, 5, requires_grad=True)
    want = 4 * _pairs(LENGTHS, block_size) * heads * head_dim
    want = want // 2 if causal else want
    with FlopCounterMode(display=False) as counter:
        out = bl.block_attention(q, k, v, offsets, block_size, causal=causal)
    forward = counter.get_flop_counts()["Global"]
    assert forward == {torch.ops.blockattn.attention_fwd: want}
    with FlopCounterMode(display=False) as counter:
        out.backward(torch.ones_like(out))
    assert counter.get_flop_counts()["Global"] == {torch.ops.blockattn.attention_bwd: want * 5 // 2}
    assert q.grad is not None and k.grad is not None


def test_flop_count_under_fake_tensors_is_the_bound():
    assert library.score_elements(torch.empty(4, device="meta", dtype=torch.int64), 100, 16) == 100 * 16
    assert library.score_elements(torch.tensor([0, 3, 10]), 10, 0) == 9 + 49


def test_lse_is_saved_where_the_backward_runs_the_multi_tile_kernels():
    tile, short, wide = library.SINGLE_TILE_MAX, library.ONE_PROGRAM_BACKWARD_MAX, library.ONE_PROGRAM_BACKWARD_HEAD_DIM
    half = torch.bfloat16
    assert not library.saves_lse(tile, wide, half, 1, "") and not library.saves_lse(short, 256, half, 1, "")
    assert library.saves_lse(short + 1, wide + 16, half, 1, "") and library.saves_lse(tile, 256, half, 4, "")
    assert library.saves_lse(tile + 1, 16, half, 1, "") and library.saves_lse(0, 16, half, 1, "")
    # float32 tiles of over FLOAT32_TILE_MAX elements (rows and channels rounded up to powers of two).
    f32 = torch.float32
    assert library.FLOAT32_TILE_MAX == 64 * 128
    assert not library.saves_lse(64, 128, f32, 1, "") and not library.saves_lse(33, 100, f32, 1, "")
    assert not library.saves_lse(128, 64, f32, 1, "") and not library.saves_lse(32, 256, f32, 1, "")
    assert library.saves_lse(65, 128, f32, 1, "") and library.saves_lse(64, 129, f32, 1, "")
    assert library.saves_lse(128, 128, f32, 1, "") and library.saves_lse(128, 128, f32, 4, "")
    assert not library.saves_lse(65, 128, half, 1, "") and not library.saves_lse(64, 129, half, 1, "")
    # Grouped query heads on 16-bit blocks over 64 tokens at D 96 and 128: for the flash kernel with dQ stored (D 96
    # in its 128-wide tiles).
    assert library.GROUPED_SAVES_LSE_HEAD_DIMS == frozenset({96, 128})
    assert library.saves_lse(65, 128, half, 2, "") and library.saves_lse(tile, 128, torch.float16, 4, "")
    assert library.saves_lse(tile, 96, half, 4, "") and not library.saves_lse(short, 96, half, 4, "")
    assert not library.saves_lse(short, 128, half, 4, "") and not library.saves_lse(tile, 80, half, 4, "")
    assert not library.saves_lse(tile, 64, half, 4, "") and not library.saves_lse(tile, 128, half, 1, "")
    assert not library.saves_lse(tile, 96, half, 1, "")
    # With rotary in the forms of GROUPED_SAVES_LSE_ROTARY (their backward on rotated copies): every form since
    # session 57 (split halves over every channel on copies in the paired-chunk order).
    assert library.GROUPED_SAVES_LSE_ROTARY == frozenset({"interleaved", "partial", "split"})
    assert library.saves_lse(tile, 128, half, 4, "interleaved") and library.saves_lse(tile, 128, half, 4, "partial")
    assert library.saves_lse(tile, 128, half, 4, "split") and library.saves_lse(tile, 256, half, 4, "split")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "GROUPED_SAVES_LSE_ROTARY", frozenset({"interleaved", "partial"}))
        assert not library.saves_lse(tile, 128, half, 4, "split") and library.saves_lse(tile, 128, half, 4, "partial")
    assert not library.saves_lse(tile, 128, half, 1, "partial") and not library.saves_lse(tile, 80, half, 4, "partial")
    assert library.saves_lse(tile, 96, half, 4, "partial") and library.saves_lse(tile, 96, half, 4, "split")
    assert not library.saves_lse(short, 128, half, 4, "interleaved")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(library, "GROUPED_SAVES_LSE_ROTARY", frozenset())
        assert not library.saves_lse(tile, 128, half, 4, "interleaved") and library.saves_lse(tile, 128, half, 4, "")


def test_rotary_form_names_the_rotation_by_channels_and_layout():
    assert library.rotary_form(0, 128, False) == library.rotary_form(0, 128, True) == ""
    assert library.rotary_form(128, 128, False) == "split" and library.rotary_form(64, 128, False) == "partial"
    assert library.rotary_form(128, 128, True) == library.rotary_form(32, 128, True) == "interleaved"

def test_the_op_saves_lse_by_the_call_s_shapes_alone():
    """``call_saves_lse``: the groups are q's heads over k's, the rotary form from ``rotary_dim`` (0: every channel)
    and ``rotary_interleaved``; the op's autograd keeps out and lse exactly there."""
    q, k, v, offsets = make_jagged([3, 0, 130], 4, 2, 128, torch.bfloat16, 0)
    assert library.call_saves_lse(q, k, 128, None, 0, False) and not library.call_saves_lse(q, q, 128, None, 0, False)
    assert not library.call_saves_lse(q, k, 64, None, 0, False) and library.call_saves_lse(q, k, 128, None, 64, True)
    assert library.call_saves_lse(q, k, 128, 1e4, 0, False) and library.call_saves_lse(q, k, 128, 1e4, 128, False)
    assert not library.call_saves_lse(q, q, 128, 1e4, 0, False)
    assert library.call_saves_lse(q, k, 128, 1e4, 64, False) and library.call_saves_lse(q, k, 128, 1e4, 0, True)
    for kv, saved in ((k, True), (q, False)):
        leaves = [x.clone().requires_grad_() for x in (q, kv, v if kv is k else q)]
        out, lse = library.attention_fwd(*leaves, offsets, 128, 0.1, False, None, None, 0, False, None, None,
                                         "reference")
        assert lse.shape == (4, q.shape[0] if saved else 0)
        kept_out, kept_lse = out.grad_fn.saved_tensors[-2:]
        assert (kept_out is not None and kept_lse is not None) == saved


@pytest.mark.parametrize("rope_theta,rotary", [(None, ""), (1e4, "split"), (1e4, "interleaved"), (1e4, "partial")],
                         ids=["plain", "split", "interleaved", "partial"])
@pytest.mark.parametrize("block_size,head_dim,dtype", [(64, 144, torch.float32), (100, 144, torch.float16),
                                                       (128, 128, torch.float32), (128, 128, torch.float16),
                                                       (128, 96, torch.bfloat16), (0, 16, torch.float32)])
def test_the_forward_fake_returns_the_lse_the_backend_does(block_size, head_dim, dtype, rope_theta, rotary):
    q, k, v, offsets = make_jagged([3, 0, 70], 2, 1, head_dim, dtype, 0)
    rotary_dim, interleaved = (head_dim // 2 if rotary == "partial" else head_dim), rotary == "interleaved"
    args = (offsets, block_size, 0.1, False, rope_theta, None, rotary_dim, interleaved, None, None, "reference")
    _, lse = library.attention_fwd(q, k, v, *args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in (q, k, v, offsets)]
        _, fake_lse = library.attention_fwd(*fakes, *args[1:])
    saved = library.call_saves_lse(q, k, block_size, rope_theta, rotary_dim, interleaved)
    assert fake_lse.shape == lse.shape == (2, 73 if saved else 0)
    assert saved == (block_size in (0, 100) or dtype == torch.float32 or head_dim in (96, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_exported_on_cpu_runs_the_gpu_kernels_on_gpu_inputs():
    """The exported graph holds the one op with backend "auto": moved to the GPU it runs the Triton
    kernels (the profiler sees them), and agrees with the eager GPU model."""
    model, inputs, program = _exported("auto")
    gpu_module = program.module().to("cuda")
    values, offsets = (x.cuda() for x in inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = gpu_module(values, offsets)
        torch.cuda.synchronize()
    kernels = {event.name for event in prof.events()}
    assert any("block_fwd_kernel" in name or "hopper_fwd_kernel" in name for name in kernels), sorted(kernels)
    torch.testing.assert_close(got, model.cuda()(values, offsets), rtol=1e-4, atol=1e-4)
