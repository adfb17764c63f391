"""``torch.compile(fullgraph=True, dynamic=True)``: every layer kind traces without a graph break,
matches eager in forward and backward, and does not recompile when T and B change.

Most cases compile with ``aot_eager`` (Dynamo plus AOTAutograd's forward and backward graphs:
where graph breaks, guards and recompiles come from) to stay fast on CPU; one case runs
Inductor end to end. Batches keep T >= 2: Dynamo specializes sizes 0 and 1 of every dynamic
dimension, so a batch of T = 0 or 1 tokens compiles once more (checked to be right below).
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from blockattn_layers import (
    BlockSelfAttention, JaggedTransformerEncoder, JaggedTransformerEncoderLayer, RotaryBlockAttention,
    block_attention,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

E = 16
# T = 8, 9, 19, 17, 32 and B = 2, 3, 5, 1, 8, with empty sequences among them.
BATCHES = ([3, 5], [2, 0, 7], [6, 0, 0, 4, 9], [17], [4] * 8)


def _layer(**kw):
    return JaggedTransformerEncoderLayer(E, 2, 32, 0.0, **kw)


KINDS = {
    "plain": lambda: _layer(block_size=4),
    "rotary": lambda: _layer(block_size=4, rope_theta=100.0),
    "rotary-positions": lambda: _layer(block_size=4, rope_theta=100.0),
    "gqa": lambda: JaggedTransformerEncoderLayer(E, 4, 32, 0.0, block_size=4, num_kv_heads=2),
    "causal-prenorm": lambda: _layer(block_size=4, causal=True, norm_first=True),
    "full": lambda: _layer(block_size=None),
    "attention": lambda: BlockSelfAttention(E, 4, block_size=8, num_kv_heads=1, causal=True),
    "rotary-attention-partial": lambda: RotaryBlockAttention(
        E, 2, block_size=None, rotary_dim=4, rotary_interleaved=True, rope_theta=500.0),
    "encoder": lambda: JaggedTransformerEncoder(_layer(block_size=4, rope_theta=100.0), 2, norm=torch.nn.LayerNorm(E)),
}
WITH_POSITIONS = {"rotary-positions", "rotary-attention-partial"}


def _batch(lengths, with_positions, generator):
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x = torch.randn(int(offsets[-1]), E, generator=generator, requires_grad=True)
    if not with_positions:
        return (x, offsets)
    return (x, offsets, torch.rand(x.shape[0], generator=generator) * 100)


def _run(module, args):
    out = module(*args)
    grads = torch.autograd.grad(out.square().sum(), [args[0], *module.parameters()])
    return out, grads


def _check_no_recompiles(module, backend, kind_has_positions, batches=BATCHES):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    generator = torch.Generator().manual_seed(0)
    first = None
    for lengths in batches:
        args = _batch(lengths, kind_has_positions, generator)
        out, grads = _run(compiled, args)
        want, want_grads = _run(module, args)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grads, want_grads)
        # (The first call may compile twice: Dynamo restarts once when it specializes float attributes.)
        first = counter.frame_count if first is None else first
        assert counter.frame_count == first, f"recompiled for lengths {lengths}"
    return compiled


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_graph_break_no_recompile(kind):
    torch.manual_seed(0)
    _check_no_recompiles(KINDS[kind](), "aot_eager", kind in WITH_POSITIONS)


def test_rotary_encoder_layer_with_inductor():
    """The reported case (rotary encoder layer, dynamic=True) through Inductor, forward and backward."""
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(E, 2, 32, 0.0, block_size=4, rope_theta=100.0, num_kv_heads=1)
    _check_no_recompiles(layer, "inductor", False, BATCHES[:3])


def test_tiny_batches_compile_once_more_and_match_eager():
    torch.manual_seed(0)
    layer = _layer(block_size=4, rope_theta=100.0)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    for lengths in ([3, 5], [0, 0], [1], [0]):
        args = _batch(lengths, False, generator)
        out, grads = _run(compiled, args)
        want, want_grads = _run(layer, args)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grads, want_grads)


class _Direct(torch.nn.Module):
    """block_attention called with float attributes (traced as symbolic floats under dynamic=True)."""

    def __init__(self):
        super().__init__()
        self.scale, self.rope_theta = 0.3, 50.0

    def forward(self, q, k, v, offsets, positions):
        return block_attention(q, k, v, offsets, 4, scale=self.scale, rope_theta=self.rope_theta,
                               positions=positions, causal=True)


def test_function_with_float_arguments():
    torch._dynamo.reset()
    module = _Direct()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    generator = torch.Generator().manual_seed(0)
    first = None
    for lengths in BATCHES:
        offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        t = int(offsets[-1])
        # head_dim 12 differs from every T: equal sizes would be duck-sized into one symbol.
        q, k, v = (torch.randn(t, h, 12, generator=generator) for h in (4, 2, 2))
        positions = torch.rand(t, generator=generator) * 10
        torch.testing.assert_close(compiled(q, k, v, offsets, positions), module(q, k, v, offsets, positions))
        first = counter.frame_count if first is None else first
        assert counter.frame_count == first, f"recompiled for lengths {lengths}"
