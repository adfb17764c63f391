"""The ``triton_flash`` backend: the multi-tile ("jagged flash") kernels as registered ops.

For blocks longer than one tile (``block_size > 128``) and full per-sequence attention
(``block_size=None``, op argument 0). As in FA2, the forward op returns ``(out, lse)`` and
the backward op takes both: ``lse [H, T]`` float32 (natural-log logsumexp of the scaled
scores of each query row) lets the backward recompute ``P`` without a second forward. So
this pair does not use the shared ``register_attention_pair`` (whose forward returns only
``out``): its own fakes and ``register_autograd`` save q, k, v, offsets, out and lse (plus
positions / cpu_offsets when given) with ``save_for_backward``. ``lse`` is not
differentiable. As for the other backends, ``block_attention`` goes through a plain
``torch.autograd.Function`` that calls the ops under ``torch.compile``/``torch.export`` and
their implementations directly in eager mode; it returns ``out`` only.

``backend="auto"`` takes it on CUDA devices for what the single-tile ``triton`` backend does
not serve (blocks longer than 128 tokens, full attention); on the H200 it is faster than FA2
varlen both ways (``BENCHMARKS.md``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from blockattn_layers.kernels._common import MAX_TILE
from blockattn_layers.kernels.flash_bwd import flash_attention_bwd
from blockattn_layers.kernels.flash_fwd import flash_attention_fwd

from ._op_registration import plain_eager, raw_apply
from ._params import AttentionParams
from ._triton_op import _devices, _extra_reasons
from .dispatch import AttentionRequest, BackendSpec, register_backend

_NUM_ARGS = 13


def _flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor]:
    """Jagged flash forward: ``(out [T, H, D], lse [H, T] float32)``; ``block_size == 0`` is full attention."""
    return flash_attention_fwd(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


def _flash_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, offsets: Tensor,
    block_size: int, scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Jagged flash backward: ``(dq, dk, dv)``, deterministic (no atomics)."""
    return flash_attention_bwd(
        grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
        rotary_dim, rotary_interleaved, cpu_offsets,
    )


triton_flash_fwd = torch.library.custom_op("blockattn::triton_flash_fwd", _flash_fwd, mutates_args=())
triton_flash_bwd = torch.library.custom_op("blockattn::triton_flash_bwd", _flash_bwd, mutates_args=())


@triton_flash_fwd.register_fake
def _fwd_fake(q, k, v, offsets, *args):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@triton_flash_bwd.register_fake
def _bwd_fake(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, out, lse) -> None:
    (q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
     rotary_interleaved, cpu_offsets, max_seqlen) = inputs
    ctx.save_for_backward(q, k, v, offsets, positions, cpu_offsets, out, lse)
    ctx.scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen)


def _grads(bwd, ctx, grad_out):
    q, k, v, offsets, positions, cpu_offsets, out, lse = ctx.saved_tensors
    block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen = ctx.scalars
    return bwd(
        grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
        rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen,
    )


def _setup_context(ctx, inputs, output):
    out, lse = output
    ctx.mark_non_differentiable(lse)
    _save(ctx, inputs, out, lse)


triton_flash_fwd.register_autograd(
    lambda ctx, grad_out, grad_lse: tuple(_grads(triton_flash_bwd, ctx, grad_out)) + (None,) * (_NUM_ARGS - 3),
    setup_context=_setup_context,
)


class _FlashAttention(torch.autograd.Function):
    """The public entry: the ops while ``torch.compile``/``torch.export`` trace it, their
    implementations directly in eager mode (skipping the custom-op wrappers' host time). The
    trailing op arguments travel as one tuple (``apply``'s host time grows with their number)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, rest):
        args = (q, k, v, offsets, *rest)
        out, lse = (triton_flash_fwd if torch.compiler.is_compiling() else _flash_fwd)(*args)
        _save(ctx, args, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        bwd = triton_flash_bwd if torch.compiler.is_compiling() else _flash_bwd
        return tuple(_grads(bwd, ctx, grad_out)) + (None, None)


_apply = raw_apply(_FlashAttention)


def run_triton_flash(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, params: AttentionParams) -> Tensor:
    if plain_eager(q, k, v):
        return _apply(q, k, v, offsets, params.op_args())
    return _FlashAttention.apply(q, k, v, offsets, params.op_args())


def _flash_reasons(req: AttentionRequest) -> list:
    reasons = _extra_reasons(req)
    if req.block_size is not None and req.block_size <= MAX_TILE:
        reasons.append(f"block_size {req.block_size} <= {MAX_TILE} (the single-tile 'triton' backend serves it)")
    return reasons


register_backend(BackendSpec(
    name="triton_flash",
    run=run_triton_flash,
    priority=5,
    devices=_devices,
    auto_devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    min_capability=(8, 0),
    head_dims=(16, 256),
    max_block_size=None,
    full_attention=True,
    extra_reasons=_flash_reasons,
    description="multi-tile Triton kernels with an online softmax (block_size > 128 or None = full "
    "attention), FA2-style deterministic backward; CUDA sm_80+, or CPU tensors under TRITON_INTERPRET=1 "
    "(by name only). On the H200: full attention 1.35-1.36x FA2 varlen forward, 1.26-1.27x backward",
))
