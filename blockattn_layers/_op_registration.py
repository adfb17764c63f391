"""Fake implementations and autograd shared by every backend's (forward, backward) op pair.

Both ops take ``(q, k, v, offsets, block_size, scale, causal, rope_theta, positions,
rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen)``, the backward with ``grad_out``
first. Outputs are contiguous whatever the input strides, so the fakes use ``new_empty``.
Only q, k, v and offsets (plus positions / cpu_offsets when given) are saved for backward.
"""
from __future__ import annotations

_NUM_ARGS = 13


def register_attention_pair(fwd, bwd) -> None:
    """Register fakes for ``fwd``/``bwd`` and make ``bwd`` the autograd formula of ``fwd``."""

    @fwd.register_fake
    def _fwd_fake(q, *args):
        return q.new_empty(q.shape)

    @bwd.register_fake
    def _bwd_fake(grad_out, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        (q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
         rotary_interleaved, cpu_offsets, max_seqlen) = inputs
        ctx.save_for_backward(q, k, v, offsets, positions, cpu_offsets)
        ctx.scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen)

    def backward(ctx, grad_out):
        q, k, v, offsets, positions, cpu_offsets = ctx.saved_tensors
        block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen = ctx.scalars
        dq, dk, dv = bwd(
            grad_out, q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
            rotary_interleaved, cpu_offsets, max_seqlen,
        )
        return (dq, dk, dv) + (None,) * (_NUM_ARGS - 3)

    fwd.register_autograd(backward, setup_context=setup_context)
