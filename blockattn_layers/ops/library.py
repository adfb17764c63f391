"""The registered op pair ``blockattn::attention_fwd`` / ``blockattn::attention_bwd``.

One pair serves every kind of attention: ``block_size`` is the block length, 0 for full
per-sequence attention. Both ops take the arguments of ``block_attention`` after validation
(:meth:`~blockattn_layers._params.AttentionParams.op_args`) and the ``backend`` name
(``"auto"`` or a registered backend). Their implementation asks the dispatcher which backend
serves the tensors' device and runs it, so the kernel is a run-time choice, never part of a
traced or exported graph.

The forward returns ``(out, lse)``. Kinds whose backward may run the multi-tile kernels
(:func:`saves_lse`: full attention, blocks over ``SINGLE_TILE_MAX`` tokens, blocks over
``ONE_PROGRAM_BACKWARD_MAX`` tokens with heads over ``ONE_PROGRAM_BACKWARD_HEAD_DIM`` wide,
float32 blocks whose tile exceeds ``FLOAT32_TILE_MAX`` elements, and 16-bit blocks over
``ONE_PROGRAM_BACKWARD_MAX`` tokens with grouped query heads at the head dims of
``GROUPED_SAVES_LSE_HEAD_DIMS``, with rotary in the forms of ``GROUPED_SAVES_LSE_ROTARY``) return the
logsumexp of each query row's scaled scores, ``lse [H, T]`` float32, which that backward reads with
``out``; every backend returns the same quantity there (a backend whose backward does not read them
leaves them unread). The other kinds
recompute everything from q, k, v and return an empty ``lse [H, 0]``; autograd then saves only
q, k, v, offsets (and positions / cpu_offsets when given). The choice is the call's shapes and
dtype alone, never its device, so fake and exported graphs agree with every backend.

The FLOP formulas count in-block work only (``torch.utils.flop_counter``): forward
``4 * sum(n_b^2) * H * D`` over the attention units ``n_b`` (blocks, or whole sequences),
halved where causal; backward 2.5 times that.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._params import AttentionParams
from ..dispatch import BackendSpec, select_for_call
from ..runtime.private_api import is_fake

# Blocks of up to this many tokens are computed in one tile, with no logsumexp to save.
SINGLE_TILE_MAX = 128
# The op arguments after q, k, v, offsets that autograd gets no gradient for.
_NON_TENSOR_INPUTS = 10


# A backward of one program per block holds the block's q, k, v, dO and P tiles: blocks of up to
# this many tokens at any head dim, longer ones (up to ``SINGLE_TILE_MAX``) at head dims up to
# ``ONE_PROGRAM_BACKWARD_HEAD_DIM`` (128 x 256 tiles would take 288 KB of shared memory; the
# H200 has 227 KB per program).
ONE_PROGRAM_BACKWARD_MAX = 64
ONE_PROGRAM_BACKWARD_HEAD_DIM = 128
# float32 blocks are computed in one tile where it has at most this many elements (the block's
# rows by the head's channels, each rounded up to a power of two, at least 16); larger float32
# tiles did not fit a program's shared memory on the H200, forward or backward.
FLOAT32_TILE_MAX = 64 * 128


def float32_tile_fits(block_size: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a block of this kind fits the single-tile kernels as far as float32 goes: any
    16-bit dtype, float32 where the tile has at most ``FLOAT32_TILE_MAX`` elements."""
    if dtype != torch.float32:
        return True
    return _extent(block_size) * _extent(head_dim) <= FLOAT32_TILE_MAX


def _extent(n: int) -> int:
    # The kernels' ``tile_extent`` (``kernels.common.meta``), restated: the op layer imports no Triton.
    return max(16, 1 << (n - 1).bit_length())


# 16-bit blocks over ``ONE_PROGRAM_BACKWARD_MAX`` tokens with grouped query heads at these head dims, without
# rotary, save out and lse too: on sm_90 the ``triton`` backend runs their backward on the warp-specialized flash
# kernel, one key tile per block with dQ stored (``kernels.sm90.flash_bwd.DQ_STORE_HEAD_DIMS``), measured faster
# there than the block kernels, which need neither (H100, bf16, block 128 D128, grid lengths, ms, forward with
# the lse store + backward against the forward without it + the block kernels' backward: 8x2 2.31 + 5.24 against
# 2.10 + 6.58, 4x1 1.16 + 2.67 against 1.06 + 3.33; 1.14-1.15x).
# Since session 58 D 96 too, in the kernel's 128-wide tiles (``kernels.sm90.flash_bwd.PADDED_HEAD_DIMS``). H100, bf16,
# block 128, grid lengths, through the op, forward + backward ms with D 96 here / without (the block kernels:
# hopper, hopper_heads for rotary): 8x2 2.16 + 4.67 / 2.05 + 6.32 (1.23x), causal 2.41 + 4.85 / 2.13 + 6.44 (1.18x),
# 4x1 1.09 + 2.37 / 1.03 + 3.09 (1.19x), causal 1.15x; interleaved 8x2 3.61 + 5.28 / 2.65 + 9.80 (1.40x), 4x1 1.39x,
# causal 1.36-1.38x; partial (rotary_dim 48) 8x2 2.90 + 7.45 / 2.48 + 8.57 (1.07x), 1.05-1.08x; split halves over
# every channel 8x2 2.89 + 7.68 / 2.43 + 8.24, 4x1 1.42 + 3.89 / 1.20 + 4.05 (0.99-1.01x: the rotation pass's
# second half runs, as split pairs span both dQ column halves of the padded tile).
GROUPED_SAVES_LSE_HEAD_DIMS = frozenset({96, 128})
# The rotary forms (:func:`rotary_form`) whose calls of those kinds save them too: on sm_90 their backward then
# runs as a rotation pass whose inner backward, without rotary, is that flash kernel, whatever the variant choice.
# H100, bf16, block 128, D 128, grid lengths, through the op, forward + backward ms with the store / without it
# (session 56): interleaved 8x2 3.62 + 8.78 / 2.79 + 10.25, 4x1 1.81 + 4.40 / 1.39 + 5.13; partial (rotary_dim 64)
# 8x2 3.10 + 7.98 / 2.60 + 9.47, 4x1 1.55 + 4.01 / 1.30 + 4.77 (1.05-1.09x faster); split halves over every
# channel 8x2 3.09 + 8.84 / 2.60 + 8.61, 4x1 1.55 + 4.43 / 1.31 + 4.35 (slower: hopper_heads rotates in its own
# backward, and the rotary forward with the store spills more, ptxas 392-432 bytes against 156-164), so not those
# then. Since session 57 the flash kernel rotates dq and dk back itself (``sm90.flash_bwd.UNROTATE``; split halves
# over every channel on copies in the paired-chunk order, ``PAIRED_SPLIT``), and eager calls with gradients rotate
# q and k in the forward (``ops.backends.triton_block.SAVES_ROTATED_COPIES``), and split halves save them too. H100,
# same points, eager forward + backward ms, session 57's defaults / session 56's (hopper_heads for split halves;
# two runs each, within 1 %): split 8x2 4.05 + 5.37 / 2.60 + 8.61 (1.19x), causal 4.26 + 5.73 / 2.52 + 8.78
# (1.13x), 4x1 2.03 + 2.73 / 1.31 + 4.30 (1.18x); interleaved 8x2 4.04 + 5.57 / 3.62 + 7.18 (1.12x); partial 8x2
# 4.13 + 5.13 / 3.10 + 7.12 (1.10x). Compiled and exported calls (the op's autograd: the rotary forward with the
# store, the rotation pass's first half in the backward) of split halves: 8x2 3.08 + 7.18 against 2.60 + 8.61.
GROUPED_SAVES_LSE_ROTARY = frozenset({"interleaved", "partial", "split"})


def rotary_form(rot: int, head_dim: int, interleaved: bool) -> str:
    """A call's rotary form: "" without rotary (``rot`` 0 channels), "interleaved" (channel pairs side by side,
    over any number of channels), "split" (split halves over all ``head_dim`` channels), "partial" (split halves
    over fewer)."""
    if rot == 0:
        return ""
    return "interleaved" if interleaved else "split" if rot == head_dim else "partial"


def saves_lse(block_size: int, head_dim: int, dtype: torch.dtype, groups: int, rotary: str) -> bool:
    """Whether the forward of this kind (``groups`` query heads per kv head, ``rotary`` a :func:`rotary_form`)
    returns (and autograd saves) ``out`` and ``lse`` for its backward: where the backward may run the
    multi-tile kernels."""
    if block_size == 0 or block_size > SINGLE_TILE_MAX or not float32_tile_fits(block_size, head_dim, dtype):
        return True
    if block_size <= ONE_PROGRAM_BACKWARD_MAX:
        return False
    grouped = (groups > 1 and head_dim in GROUPED_SAVES_LSE_HEAD_DIMS and dtype != torch.float32
               and (not rotary or rotary in GROUPED_SAVES_LSE_ROTARY))
    return head_dim > ONE_PROGRAM_BACKWARD_HEAD_DIM or grouped


def call_saves_lse(q: Tensor, k: Tensor, block_size: int, rope_theta: Optional[float], rotary_dim: int,
                   rotary_interleaved: bool) -> bool:
    """:func:`saves_lse` of a call on these tensors (``q [T, H, D]``, ``k [T, H_kv, D]``; ``rope_theta``
    None without rotary; ``rotary_dim`` 0: every channel)."""
    dim = q.shape[2]
    rot = (rotary_dim or dim) if rope_theta is not None else 0
    return saves_lse(block_size, dim, q.dtype, q.shape[1] // max(1, k.shape[1]),
                     rotary_form(rot, dim, rotary_interleaved))


def op_backend(backend: str, q: Tensor, k: Tensor, block_size: int, causal: bool,
               rope_theta: Optional[float]) -> BackendSpec:
    """The backend that serves an op call on these tensors (the same choice as the public entry's)."""
    params = AttentionParams(block_size or None, 1.0, causal, rope_theta, None, 0, False, None, None)
    return select_for_call(backend, q, k, params)


@torch.library.custom_op("blockattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int], backend: str,
) -> Tuple[Tensor, Tensor]:
    """Attention forward: ``(out [T, H, D], lse)``; the backend chosen from the tensors' device."""
    spec = op_backend(backend, q, k, block_size, causal, rope_theta)
    out, lse = spec.forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
                            rotary_interleaved, cpu_offsets, max_seqlen)
    return out, (q.new_empty((q.shape[1], 0), dtype=torch.float32) if lse is None else lse)


@torch.library.custom_op("blockattn::attention_bwd", mutates_args=())
def attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], lse: Optional[Tensor],
    offsets: Tensor, block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor],
    max_seqlen: Optional[int], backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention backward: ``(dq, dk, dv)``. ``out`` and ``lse`` are the forward's where
    :func:`saves_lse`, else None."""
    spec = op_backend(backend, q, k, block_size, causal, rope_theta)
    return spec.backward(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                         rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen)


@attention_fwd.register_fake
def _fwd_fake(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
              *args):
    lse_rows = q.shape[0] if call_saves_lse(q, k, block_size, rope_theta, rotary_dim, rotary_interleaved) else 0
    return q.new_empty(q.shape), q.new_empty((q.shape[1], lse_rows), dtype=torch.float32)


@attention_bwd.register_fake
def _bwd_fake(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
     cpu_offsets, max_seqlen, backend) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    keep = call_saves_lse(q, k, block_size, rope_theta, rotary_dim, rotary_interleaved)
    ctx.save_for_backward(q, k, v, offsets, positions, cpu_offsets, out if keep else None, lse if keep else None)
    ctx.scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen, backend)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, offsets, positions, cpu_offsets, out, lse = ctx.saved_tensors
    block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen, backend = ctx.scalars
    grads = attention_bwd(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                          rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen, backend)
    return (*grads, None) + (None,) * _NON_TENSOR_INPUTS


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- FLOP formulas
def _host_offsets(offsets: Tensor, cpu_offsets: Optional[Tensor]) -> Optional[Tensor]:
    """Offsets with values to read (the counter may read device values: it is no op), or None
    under fake tensors, where only shapes exist."""
    for candidate in (cpu_offsets, offsets):
        if candidate is not None and not candidate.is_meta and not is_fake(candidate):
            return candidate.detach().to("cpu", torch.int64)
    return None


def score_elements(offsets: Tensor, total: int, block_size: int, cpu_offsets: Optional[Tensor] = None) -> int:
    """``sum(n_b^2)`` over the attention units (blocks of ``block_size``, or whole sequences for 0).

    Without offset values (fake tensors) the bound ``T * min(block, T)`` stands in.
    """
    host = _host_offsets(offsets, cpu_offsets)
    if host is None:
        return total * (min(block_size, total) if block_size else total)
    lengths = host[1:] - host[:-1]
    if not block_size:
        return int((lengths * lengths).sum())
    full, rest = lengths // block_size, lengths % block_size
    return int((full * block_size * block_size + rest * rest).sum())


def forward_flops(q_shape, offsets: Tensor, block_size: int, causal: bool,
                  cpu_offsets: Optional[Tensor] = None) -> int:
    """FLOPs of the two products ``QK^T`` and ``PV`` of one forward, in-block work only."""
    total, heads, head_dim = q_shape
    flops = 4 * score_elements(offsets, total, block_size, cpu_offsets) * heads * head_dim
    return flops // 2 if causal else flops


@register_flop_formula(torch.ops.blockattn.attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, offsets, block_size, scale, causal, rope_theta=None, positions=None, rotary_dim=0,
               rotary_interleaved=False, cpu_offsets=None, *rest, out_val=None, **kwargs) -> int:
    return forward_flops(q.shape, offsets, block_size, causal, cpu_offsets)


@register_flop_formula(torch.ops.blockattn.attention_bwd, get_raw=True)
def _bwd_flops(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta=None, positions=None,
               rotary_dim=0, rotary_interleaved=False, cpu_offsets=None, *rest, out_val=None, **kwargs) -> int:
    return forward_flops(q.shape, offsets, block_size, causal, cpu_offsets) * 5 // 2
