"""Self-check at first use of kernel variants with no recorded hardware run on the GPU's
generation: with a deliberately wrong stand-in variant forced, the first call of a signature
returns the verified (simple) kernels' result, warns once naming the signature and the error,
and disables the variant; a right stand-in is checked once and keeps running. On the CPU the
stand-ins are the simple Triton kernels under the interpreter (nothing is recorded off the GPU);
on a GPU the same stand-ins run on the hardware."""
import warnings

import pytest
import torch

import blockattn_layers as bl
from blockattn_layers.kernels.block import bwd, fwd, self_check, variants
from blockattn_layers.runtime import caches
from tests.oracle import make_jagged, oracle_attention, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not __import__("os").environ.get("TRITON_INTERPRET"),
                                reason="the triton backend on CPU needs TRITON_INTERPRET=1")


class Corrupting:
    """A launcher that runs ``inner`` and then scales one output (argument ``index``) by ``factor``."""

    def __init__(self, inner, index, factor, launches):
        self.inner, self.index, self.factor, self.launches = inner, index, factor, launches
        self.constexpr_names = inner.constexpr_names

    def __call__(self, grid, args, meta, q, key=None):
        self.launches.append(self.index)
        result = self.inner(grid, args, meta, q, key)
        args[self.index].mul_(self.factor)
        return result


def _stand_in(name, fwd_factor=1.0, bwd_factor=1.0, launches=None):
    launches = [] if launches is None else launches
    kernels = (Corrupting(fwd.launch_fwd, 3, fwd_factor, launches), Corrupting(bwd.launch_bwd, 4, bwd_factor, launches))
    return variants.Variant(name, "a test stand-in", None, True, lambda facts: [], lambda q, t: [], lambda: kernels,
                            verified_on=frozenset()), launches


@pytest.fixture
def stand_in(monkeypatch):
    """Register stand-ins, force one; restore auto, the checks and the caches afterwards."""
    def register(*args, **kw):
        variant, launches = _stand_in(*args, **kw)
        monkeypatch.setitem(variants.VARIANTS, variant.name, variant)
        variants.force_variant(variant.name)
        return launches

    self_check.reset()
    caches.clear_all()
    yield register
    variants.force_variant("auto")
    self_check.reset()
    caches.clear_all()


def _inputs(seed=0, requires_grad=False):
    q, k, v, offsets = make_jagged([5, 0, 1, 37, 16, 64], 4, 2, 16, torch.float32, seed, device=DEV)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)], offsets


def _oracle(q, k, v, offsets):
    return oracle_attention(q.double(), k.double(), v.double(), offsets, 16)


def test_a_wrong_forward_is_caught_disabled_and_replaced(stand_in):
    launches = stand_in("wrong_forward", fwd_factor=1.5)
    (q, k, v), offsets = _inputs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = bl.block_attention(q, k, v, offsets, 16, backend="triton")
    assert rel_err(out, _oracle(q, k, v, offsets)) < 1e-5, "the verified result is returned"
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "'wrong_forward' variant disagrees" in message and "forward (float32, H=4/2 kv, D=16, block 16)" in message
    assert "max relative error" in message and "disabled for this process" in message
    assert self_check.disabled("wrong_forward") is not None and launches == [3]
    with pytest.warns(RuntimeWarning, match="forced variant 'wrong_forward' cannot compute this call .*disabled"):
        again = bl.block_attention(q, k, v, offsets, 16, backend="triton")
    assert torch.equal(again, out) and launches == [3], "the disabled variant does not run again"


def test_a_wrong_backward_is_caught_at_the_first_backward(stand_in):
    stand_in("wrong_backward", bwd_factor=1.5)
    (q, k, v), offsets = _inputs(1, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="'wrong_backward' variant disagrees .*backward .*dq: max relative error"):
        out = bl.block_attention(q, k, v, offsets, 16, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    cq, ck, cv = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = _oracle(cq, ck, cv, offsets)
    for got, ref in zip(grads, torch.autograd.grad(want, (cq, ck, cv), torch.ones_like(want))):
        assert rel_err(got, ref) < 1e-4
    assert "backward" in self_check.disabled("wrong_backward")


def test_a_right_variant_is_checked_once_and_keeps_running(stand_in):
    launches = stand_in("right")
    (q, k, v), offsets = _inputs(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            out = bl.block_attention(q, k, v, offsets, 16, backend="triton")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert self_check.disabled("right") is None
    assert launches == [3, 4] * 3, "the variant's own kernels run on every call"
    assert {("right", True), ("right", False)} <= {(name, sig[9]) for name, sig in self_check._PASSED}
    assert rel_err(out, _oracle(q, k, v, offsets)) < 1e-5


def test_suspended_returns_the_variants_own_result(stand_in):
    stand_in("wrong_suspended", fwd_factor=2.0)
    (q, k, v), offsets = _inputs(3)
    with self_check.suspended():
        out = bl.block_attention(q, k, v, offsets, 16, backend="triton")
    assert rel_err(out, 2 * _oracle(q, k, v, offsets)) < 1e-5 and self_check.disabled("wrong_suspended") is None


def test_auto_takes_an_unverified_variant_only_with_the_opt_in(monkeypatch):
    variant, _ = _stand_in("unrecorded")
    variant = variant._replace(generations=frozenset({10}), experimental=False)
    monkeypatch.setitem(variants.VARIANTS, variant.name, variant)
    monkeypatch.setattr(variants, "AUTO_ORDER", (variant, variants.SIMPLE))
    facts = variants.CallFacts("cuda", 10, torch.bfloat16, 128, 1, 64, 0, False, False)
    q = torch.empty(4, 1, 128, dtype=torch.bfloat16)
    reasons = variants.explain(facts)
    assert any("no hardware run recorded on sm_10x" in r and "BLOCKATTN_UNVERIFIED_KERNELS=1" in r
               for r in reasons["unrecorded"])
    assert variants.choose(facts, q, (q,)) is variants.SIMPLE
    monkeypatch.setattr(variants, "_UNVERIFIED", [True])
    assert variants.explain(facts)["unrecorded"] == [] and variants.choose(facts, q, (q,)) is variant
    assert self_check.unverified(variant, 10) and not self_check.unverified(variants.HOPPER, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_wrong_stand_in_on_the_gpu(stand_in):
    """The same stand-ins on the hardware: the wrong forward and the wrong backward are caught,
    the verified results returned."""
    test_a_wrong_forward_is_caught_disabled_and_replaced(stand_in)
    test_a_wrong_backward_is_caught_at_the_first_backward(stand_in)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_capture_runs_the_verified_kernels(stand_in):
    """No host sync while a CUDA graph is captured: an unchecked signature runs the simple kernels
    (right results), and the variant is neither checked nor disabled."""
    stand_in("wrong_captured", fwd_factor=1.5)
    (q, k, v), offsets = _inputs(4)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.cuda.graph(graph, stream=stream):
            out = bl.block_attention(q, k, v, offsets, 16, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _oracle(q, k, v, offsets)) < 1e-5
    assert self_check.disabled("wrong_captured") is None and not self_check._PASSED
