"""Public functions: ``block_attention`` and ``jagged_attention`` over packed jagged sequences."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ._checked_calls import checked_call
from ._validation import autocast_enabled
from .dispatch import Backend
from .fp8 import fp8_block_attention, is_fp8
from .ops import attention
from .ops import backends as _backends  # noqa: F401  (registers the backends)


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    block_size: Optional[int] = 64,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    rope_theta: Optional[float] = None,
    positions: Optional[Tensor] = None,
    rotary_dim: Optional[int] = None,
    rotary_interleaved: bool = False,
    cpu_offsets: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
    backend: Union[str, Backend] = "auto",
    validate: Optional[bool] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Block-diagonal self-attention over packed variable-length sequences.

    Every sequence ``offsets[b]:offsets[b+1]`` is cut into blocks of ``block_size``
    tokens (the last one may be short); each token attends only to its own block.

    Args:
        q: ``[T, H, D]`` queries.
        k, v: ``[T, H_kv, D]``; ``H % H_kv == 0`` (GQA/MQA: query head ``h`` uses kv head
            ``h // (H // H_kv)``).
        offsets: ``[B+1]`` int32/int64 sequence boundaries, ``offsets[0] == 0``,
            non-decreasing, ``offsets[-1] == T``.
        block_size: tokens per block (>= 1); ``None`` makes each whole sequence one block.
        scale: score scale, default ``1/sqrt(D)``.
        causal: causal masking inside each block.
        rope_theta: if set, rotary embeddings on q and k (fused into the kernel on GPU).
        positions: ``[T]`` int or float positions for rotary (e.g. event times relative to each
            sequence's first: the angles are float32, so absolute epoch timestamps lose the differences);
            default: each token's index inside its sequence.
        rotary_dim: rotate only the first ``rotary_dim`` channels (even, <= D); default D.
        rotary_interleaved: pairs ``(x[2i], x[2i+1])`` instead of ``(x[i], x[i + rotary_dim/2])``.
        cpu_offsets: optional host copy of ``offsets`` (lets backends schedule without device work).
        max_seqlen: optional host int, the longest sequence.
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or a :class:`Backend`.
        validate: check offset values (start 0, non-decreasing, end T). ``None`` checks CPU
            tensors only; ``True`` also device tensors (one device-to-host copy).
        q_descale, k_descale, v_descale: for ``torch.float8_e4m3fn`` q, k, v (inference only:
            no gradients), float32 factors with real value = stored value x descale, ``[H_kv]``
            or ``[B, H_kv]`` (None: 1); see ``blockattn_layers.fp8`` and ``quantize_fp8``.
        out_dtype: the output dtype of an fp8 call: bfloat16 (default), float16 or float32.

    Returns:
        ``[T, H, D]`` in the dtype of ``q`` (``out_dtype`` for fp8 inputs).

    Example:
        >>> import torch
        >>> from blockattn_layers import block_attention
        >>> offsets = torch.tensor([0, 3, 3, 70])          # lengths 3, 0, 67
        >>> q = torch.randn(70, 4, 32); k = v = torch.randn(70, 2, 32)
        >>> block_attention(q, k, v, offsets, block_size=64, causal=True).shape
        torch.Size([70, 4, 32])
    """
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        raise RuntimeError("block_attention does not run under TorchScript (torch.jit.trace / torch.jit.script): "
                           "use torch.compile, or torch.export for a graph to serve")
    if is_fp8(q):
        return fp8_block_attention(
            q, k, v, offsets, block_size, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            out_dtype=out_dtype, attention=block_attention, scale=scale, causal=causal, rope_theta=rope_theta,
            positions=positions, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
            cpu_offsets=cpu_offsets, max_seqlen=max_seqlen, backend=backend, validate=validate)
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                        ("out_dtype", out_dtype)):
        if value is not None:
            got = q.dtype if isinstance(q, Tensor) else type(q).__name__
            raise TypeError(f"{name} applies to torch.float8_e4m3fn q, k, v; q is {got}")
    if positions is not None and getattr(positions, "requires_grad", False) and torch.is_grad_enabled():
        raise ValueError("positions requires grad, but no gradient flows to rotary positions (every backend "
                         "takes them as data): pass positions.detach() to rotate by their values")
    q, k, v = _autocast_inputs(q, k, v)
    params, spec = checked_call(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
        cpu_offsets, max_seqlen, backend, validate,
    )
    return attention(q, k, v, offsets, params, spec, backend)


def _autocast_inputs(q: Tensor, k: Tensor, v: Tensor):
    """Under autocast, attention runs in the autocast dtype, as ``scaled_dot_product_attention`` does.

    The registered ops then compute in their inputs' dtype (autocast is off inside them).
    float64 inputs are left alone, as autocast leaves them.
    """
    if not isinstance(q, Tensor) or not autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    cast = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(x.to(dtype) if isinstance(x, Tensor) and x.dtype in cast else x for x in (q, k, v))


def jagged_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, **kwargs) -> Tensor:
    """Full attention inside each sequence: ``block_attention(..., block_size=None)``."""
    if "block_size" in kwargs:
        raise TypeError("jagged_attention() takes no block_size: it is block_attention(block_size=None)")
    return block_attention(q, k, v, offsets, None, **kwargs)
