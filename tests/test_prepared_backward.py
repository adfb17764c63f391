"""The backward launch prepared by the forward (``block.bwd.PreparedBackward``): the eager
backward takes it where it holds and gives the same bits as the ordinary path; where it does
not hold (strided dO, saved-tensor hooks, first call of a signature) the ordinary path runs.
The autograd plumbing is checked on the CPU with a stand-in preparation; the launches on the GPU."""
import pytest
import torch

import blockattn_layers as bl
from blockattn_layers._params import AttentionParams
from blockattn_layers.ops import entry
from blockattn_layers.runtime import caches

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair(result, calls):
    """An entry point over a doubling 'attention' backend whose preparation returns ``result``."""

    class Prepared:
        def launch(self, grad_out, q, k, v):
            calls.append((grad_out, q, k, v))
            return result

    def forward(q, k, v, offsets, *rest):
        return 2 * q, None

    def forward_prepared(q, k, v, offsets, *rest):
        return forward(q, k, v, offsets, *rest)[0], Prepared()

    def backward(grad_out, q, k, v, out, lse, offsets, *rest):
        return 2 * grad_out, torch.zeros_like(k), torch.zeros_like(v)

    spec = bl.BackendSpec(name="doubling", forward=forward, backward=backward, forward_prepared=forward_prepared,
                          priority=0, devices=None, auto_devices=None, dtypes=frozenset({torch.float32}))
    params = AttentionParams(*_REST)
    return lambda q, k, v, offsets: entry.attention(q, k, v, offsets, params, spec, "doubling")


_REST = (64, 1.0, False, None, None, 0, False, None, None)


def _leaves():
    return [torch.randn(5, 2, 4, requires_grad=True) for _ in range(3)]


def test_backward_takes_the_plan_where_it_holds():
    calls = []
    prepared = tuple(torch.full((5, 2, 4), float(i)) for i in (7, 8, 9))
    attention = _pair(prepared, calls)
    q, k, v = _leaves()
    grads = torch.autograd.grad(attention(q, k, v, torch.tensor([0, 5])), (q, k, v), torch.ones(5, 2, 4))
    assert len(calls) == 1 and calls[0][1] is q and calls[0][2] is k and calls[0][3] is v
    for g, want in zip(grads, prepared):
        assert torch.equal(g, want)


def test_backward_falls_back_where_the_plan_does_not_hold():
    calls = []
    attention = _pair(None, calls)
    q, k, v = _leaves()
    grad_out = torch.randn(5, 2, 4)
    dq, dk, dv = torch.autograd.grad(attention(q, k, v, torch.tensor([0, 5])), (q, k, v), grad_out)
    assert len(calls) == 1
    assert torch.equal(dq, 2 * grad_out) and not dk.any() and not dv.any()


# ------------------------------------------------------- CPU: the prepared launch's arguments
def _ordinary_launch(monkeypatch, do, q, k, v, offsets, **kw):
    """What the ordinary backward passes to its launcher: ``(grid, args, meta, key)``."""
    from blockattn_layers.kernels.block import bwd as block_bwd

    seen = []
    with monkeypatch.context() as m:
        m.setattr(block_bwd, "launch_bwd", _Recorder(seen, block_bwd.launch_bwd))
        block_bwd.block_attention_bwd(do, q, k, v, offsets, **kw)
    return seen[0]


class _Recorder:
    """Records the launches in place of ``launcher``."""

    def __init__(self, seen, launcher):
        self.seen, self.constexpr_names = seen, launcher.constexpr_names

    def __call__(self, grid, args, meta, q, key=None):
        self.seen.append((grid, args, meta, key))


def _ints(args):
    return [a for a in args if type(a) is int]


def _tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
def test_prepared_launch_passes_the_ordinary_arguments(monkeypatch, table):
    """On the CPU, with the launches recorded: the prepared launch gets the ordinary backward's
    grid and arguments (tensors as their addresses, the fresh gradient buffers aside), and the
    compiled kernel it asks for is looked up under the ordinary launch's specialization (the
    stand-ins for dO and the gradients have their dtypes and strides)."""
    from blockattn_layers.kernels.block import bwd as block_bwd
    from blockattn_layers.kernels.common import schedule as _schedule

    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    g = torch.Generator().manual_seed(0)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = offsets[-1].item()
    packed = torch.randn(total, 8, 32, generator=g, dtype=torch.float16)
    q, k, v = packed[:, :4], packed[:, 4:6], packed[:, 6:]
    positions = torch.rand(total, generator=g) * 100
    kw = dict(block_size=48, scale=0.3, causal=True, rope_theta=500.0, positions=positions, rotary_dim=16,
              rotary_interleaved=False, cpu_offsets=None)
    do = torch.randn(total, 4, 32, generator=g, dtype=torch.float16)
    grid, args, meta, key = _ordinary_launch(monkeypatch, do, q, k, v, offsets, **kw)

    sched = _schedule.Schedule(offsets, total, 48, None)
    looked_up, launched = [], []
    entry = (lambda *a: launched.append(a), ("head",), ("consts",))

    def entry_for(args_, q_, key_, aligned):
        looked_up.append((args_, key_, aligned))
        return entry

    monkeypatch.setattr(block_bwd.launch_bwd, "entry_for", entry_for)
    monkeypatch.setattr(block_bwd.launch_bwd, "goes_direct", lambda device: True)
    monkeypatch.setattr(block_bwd.launch_bwd, "stream", lambda device: 99)
    caches.clear_all()
    prepared = block_bwd.prepare_backward(q, k, v, sched, ("a forward key",), 48, 0.3, True, 500.0, positions, 16,
                                          False)
    # the schedule's table is the ordinary call's own (the table variant allocates a new one)
    args = (*args[:7], sched.table, args[8] if kw["positions"] is not None else sched.table, *args[9:])
    (stand_in, plan_key, aligned), = looked_up
    assert plan_key == key
    assert _ints(stand_in) == _ints(args), "the same ints (the specialized ones among them)"
    assert [t.dtype for t in _tensors(stand_in)] == [t.dtype for t in _tensors(args)]
    assert aligned == tuple(t.data_ptr() % 16 == 0 for t in _tensors(args))

    grads = prepared.launch(do, q, k, v)
    (call,) = launched
    assert call[:5] == (grid[0], grid[1] if len(grid) > 1 else 1, 1, 99, "head") and call[-1] == "consts"
    passed = call[5:-1]
    want = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    assert passed[:4] == tuple(want[:4]) and passed[7:] == tuple(want[7:])
    assert passed[4:7] == tuple(g_.data_ptr() for g_ in grads)
    for g_, x in zip(grads, (q, k, v)):
        assert g_.shape == x.shape and g_.dtype == x.dtype and g_.is_contiguous()


def test_plan_does_not_hold_for_other_tensors_or_a_strided_grad(monkeypatch):
    from blockattn_layers.kernels.block import bwd as block_bwd
    from blockattn_layers.kernels.common import schedule as _schedule

    launched = []
    monkeypatch.setattr(block_bwd.launch_bwd, "entry_for", lambda *a: (lambda *b: launched.append(b), (), ()))
    monkeypatch.setattr(block_bwd.launch_bwd, "goes_direct", lambda device: True)
    monkeypatch.setattr(block_bwd.launch_bwd, "stream", lambda device: 0)
    caches.clear_all()
    offsets = torch.tensor([0, 5, 70])
    q, k, v = (torch.randn(70, 2, 16) for _ in range(3))
    prepared = block_bwd.prepare_backward(q, k, v, _schedule.Schedule(offsets, 70, 64, None), ("key",), 64, 0.25, False,
                                   None, None, 0, False)
    do = torch.randn(70, 2, 16)
    assert prepared.launch(do, q.clone(), k, v) is None
    assert prepared.launch(do.transpose(0, 1).contiguous().transpose(0, 1), q, k, v) is None
    assert prepared.launch(torch.ones(1, 1, 1).expand(70, 2, 16), q, k, v) is None
    assert not launched
    assert prepared.launch(do, q, k, v) is not None and len(launched) == 1
    assert block_bwd.prepare_backward(q, k, v, _schedule.Schedule(offsets, 70, 64, None), None, 64, 0.25, False,
                                   None, None, 0, False) is None


# ------------------------------------------------------------------------------------------- GPU
def _inputs(lengths, heads, kv_heads, dim, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    total = int(offsets[-1])
    qkv = [torch.randn(total, h, dim, device="cuda", generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)]
    return qkv, offsets.cuda()


def _spy(monkeypatch):
    """Count the prepared launches that gave gradients."""
    from blockattn_layers.kernels.block.bwd import PreparedBackward

    used = []
    launch = PreparedBackward.launch

    def spy(self, *args):
        grads = launch(self, *args)
        used.append(grads is not None)
        return grads

    monkeypatch.setattr(PreparedBackward, "launch", spy)
    return used


def _run(qkv, offsets, grad_out, **kw):
    leaves = [x.clone().requires_grad_() for x in qkv]
    out = bl.block_attention(*leaves, offsets, backend="triton", **kw)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


PLANNED_CASES = [
    dict(block_size=64),
    dict(block_size=48, causal=True, rope_theta=1e4),
    dict(block_size=64, rope_theta=500.0, positions="float"),
]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("table", [False, True], ids=["inline", "table"])
@pytest.mark.parametrize("case", PLANNED_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_prepared_backward_gives_the_ordinary_bits(monkeypatch, case, table):
    """GQA, edge lengths; the in-kernel schedule and the block table (kept alive by the preparation:
    memory is reused and scribbled on between forward and backward)."""
    from blockattn_layers.kernels.block import fwd as block_fwd
    from blockattn_layers.kernels.common import schedule as _schedule

    if table:
        monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    case = dict(case)
    qkv, offsets = _inputs([0, 1, 63, 64, 65, 130, 7, 200], 4, 2, 64)
    if case.get("positions") == "float":
        case["positions"] = torch.rand(qkv[0].shape[0], device="cuda") * 1000
    grad_out = torch.randn_like(qkv[0])
    used = _spy(monkeypatch)
    _run(qkv, offsets, grad_out, **case)  # compiles the backward through the ordinary path
    leaves = [x.clone().requires_grad_() for x in qkv]
    out = bl.block_attention(*leaves, offsets, backend="triton", **case)
    for _ in range(4):
        torch.empty(1 << 20, device="cuda").fill_(float("nan"))
    prepared = (out, *torch.autograd.grad(out, leaves, grad_out))
    assert used[-1] is True, "the second call's backward takes its preparation"
    monkeypatch.setattr(block_fwd, "prepare_backward", lambda *a: None)
    ordinary = _run(qkv, offsets, grad_out, **case)
    for a, b in zip(prepared, ordinary):
        assert torch.equal(a, b)


@cuda
@pytest.mark.gpu
def test_prepared_backward_falls_back_on_strided_grad_and_saved_tensor_hooks(monkeypatch):
    """A dO that is not contiguous (``out.sum()``'s expanded ones) and saved-tensor hooks that
    replace q, k, v both take the ordinary path, with the same results."""
    qkv, offsets = _inputs([5, 64, 0, 130, 1], 4, 2, 64)
    used = _spy(monkeypatch)
    ones = torch.ones_like(qkv[0])
    want = _run(qkv, offsets, ones, block_size=64)
    leaves = [x.clone().requires_grad_() for x in qkv]
    out = bl.block_attention(*leaves, offsets, 64, backend="triton")
    got = torch.autograd.grad(out.sum(), leaves)
    assert used[-1] is False
    for a, b in zip(got, want[1:]):
        assert torch.equal(a, b)
    leaves = [x.clone().requires_grad_() for x in qkv]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.cpu(), lambda t: t.cuda()):
        out = bl.block_attention(*leaves, offsets, 64, backend="triton")
    got = torch.autograd.grad(out, leaves, ones)
    assert used[-1] is False
    for a, b in zip(got, want[1:]):
        assert torch.equal(a, b)


@cuda
@pytest.mark.gpu
def test_prepared_backward_follows_the_input_strides(monkeypatch):
    """Inputs of the same shapes, first contiguous, then views into one packed ``[T, 3H, D]``
    tensor (other strides, so another forward key and prepared backward): each prepared backward
    gives the ordinary path's bits."""
    from blockattn_layers.kernels.block import fwd as block_fwd

    lengths = [3, 64, 0, 130, 1, 77]
    (q, k, v), offsets = _inputs(lengths, 2, 2, 64)
    packed = torch.cat([q, k, v], dim=1)
    views = packed[:, :2], packed[:, 2:4], packed[:, 4:]
    grad_out = torch.randn_like(q)
    used = _spy(monkeypatch)
    planner = block_fwd.prepare_backward
    for qkv in ((q, k, v), views, (q, k, v), views):
        _run(qkv, offsets, grad_out, block_size=64, causal=True)
        monkeypatch.setattr(block_fwd, "prepare_backward", planner)
        prepared = _run(qkv, offsets, grad_out, block_size=64, causal=True)
        assert used[-1] is True
        monkeypatch.setattr(block_fwd, "prepare_backward", lambda *a: None)
        ordinary = _run(qkv, offsets, grad_out, block_size=64, causal=True)
        for a, b in zip(prepared, ordinary):
            assert torch.equal(a, b)
