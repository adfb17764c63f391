"""Self-attention layers over jagged batches: fused QKV projection -> block attention -> output projection."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._validation import check_attention_args, check_bool, check_module_input, check_rotary_args
from ..dispatch import Backend
from ..fp8 import OUT_DTYPES as FP8_OUT_DTYPES
from ..functional import block_attention
from ..jagged import to_values_offsets
from .fp8 import FP8QKVProjection


class BlockSelfAttention(nn.Module):
    """Multi-head self-attention inside fixed blocks of each sequence of a jagged batch.

    Every sequence is cut into blocks of ``block_size`` tokens (the last may be short) and each
    token attends to the tokens of its own block; ``block_size=None`` attends over the whole
    sequence. One fused ``in_proj`` gives q ``[T, H, D]`` and k, v ``[T, H_kv, D]``
    (``D = embed_dim // num_heads``; grouped-query attention when ``num_kv_heads < num_heads``),
    then :func:`~blockattn_layers.block_attention` and ``out_proj``.

    Args:
        embed_dim: E, model width; a multiple of ``num_heads``.
        num_heads: H, query heads.
        block_size: tokens per attention block, or ``None`` for full per-sequence attention.
        num_kv_heads: H_kv, key/value heads (default ``num_heads``); divides ``num_heads``.
        bias: biases in the projections.
        causal: causal masking inside each block.
        backend: ``"auto"``, ``"reference"``, ``"triton"`` (see :func:`~blockattn_layers.block_attention`).
        validate: check the offsets' values on every call, as ``block_attention(validate=...)``:
            ``None`` on CPU tensors only, ``True`` on device tensors too (one device-to-host copy a
            call: for debugging an input pipeline), ``False`` never.

    Forward:
        ``forward(x, offsets=None, *, cpu_offsets=None, max_seqlen=None)``: ``x`` is packed
        ``values [T, E]`` with ``offsets [B+1]``, a torchrec ``JaggedTensor`` or a
        ``Dict[str, JaggedTensor]``; the result is the same kind with values ``[T, E]`` and the
        lengths unchanged. ``cpu_offsets``/``max_seqlen`` are optional host-side hints.

    FP8 serving: :func:`~blockattn_layers.to_fp8_inference` gives the layer an e4m3 QKV projection
    ``fp8`` (None until then); loading a converted layer's ``state_dict`` gives it one too.

    Example:
        >>> import torch
        >>> from blockattn_layers import BlockSelfAttention
        >>> attn = BlockSelfAttention(32, 4, block_size=16, num_kv_heads=2)
        >>> values, offsets = torch.randn(40, 32), torch.tensor([0, 5, 5, 40])
        >>> attn(values, offsets).shape
        torch.Size([40, 32])
    """

    def __init__(
        self, embed_dim: int, num_heads: int, *, block_size: Optional[int] = 64, num_kv_heads: Optional[int] = None,
        bias: bool = True, causal: bool = False, backend: Union[str, Backend] = "auto",
        device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, validate: Optional[bool] = None,
    ) -> None:
        super().__init__()
        block_size, self.num_kv_heads = check_attention_args(
            embed_dim, num_heads, block_size, num_kv_heads, bias, causal, backend, dtype=dtype)
        if validate is not None:
            check_bool("validate", validate)
        self.validate = validate
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.block_size, self.causal, self.backend = block_size, causal, backend
        factory = {"device": device, "dtype": dtype}
        qkv_dim = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.in_proj = nn.Linear(self.embed_dim, qkv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias, **factory)
        # An e4m3 QKV projection for inference (``modules.fp8.to_fp8_inference``), or None.
        self.fp8 = None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"block_size={self.block_size}, causal={self.causal}, backend={self.backend!r}"
            + ("" if self.validate is None else f", validate={self.validate}")
        )

    def _qkv(self, values: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = self.in_proj(values).split([self.embed_dim, kv_dim, kv_dim], dim=-1)
        return (
            q.unflatten(-1, (self.num_heads, self.head_dim)),
            k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.num_kv_heads, self.head_dim)),
        )

    def _attention_kwargs(self, positions: Optional[Tensor]) -> dict:
        return {}

    def _attend(
        self, values: Tensor, offsets: Tensor, kind: str, positions: Optional[Tensor],
        cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
    ) -> Tensor:
        check_module_input(values, offsets, kind, self.embed_dim, self.in_proj.weight.dtype)
        kwargs = dict(causal=self.causal, cpu_offsets=cpu_offsets, max_seqlen=max_seqlen, backend=self.backend,
                      validate=self.validate, **self._attention_kwargs(positions))
        if self.fp8 is not None:
            _check_fp8_call(values, self.training)
            (q, k, v, q_descale, k_descale, v_descale), kwargs = self._fp8_qkv(values, offsets, positions, kwargs)
            dtype = self.out_proj.weight.dtype
            out = block_attention(q, k, v, offsets, self.block_size, q_descale=q_descale, k_descale=k_descale,
                                  v_descale=v_descale, out_dtype=dtype if dtype in FP8_OUT_DTYPES else torch.float32,
                                  **kwargs).to(dtype)
        else:
            q, k, v = self._qkv(values)
            out = block_attention(q, k, v, offsets, self.block_size, **kwargs)
        return self.out_proj(out.flatten(1))

    def _fp8_qkv(self, values: Tensor, offsets: Tensor, positions: Optional[Tensor], kwargs: dict) -> Tuple[tuple, dict]:
        """The converted layer's e4m3 q, k, v and descales (``self.fp8``) and the attention's keywords."""
        return self.fp8(values), kwargs

    def forward(
        self, x: Any, offsets: Optional[Tensor] = None, *, cpu_offsets: Optional[Tensor] = None,
        max_seqlen: Optional[int] = None,
    ) -> Any:
        values, offsets, layout = to_values_offsets(x, offsets)
        return layout.wrap(self._attend(values, offsets, layout.kind, None, cpu_offsets, max_seqlen))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # The state of a layer converted by to_fp8_inference restores its e4m3 projection here.
        if self.fp8 is None and prefix + "fp8.weight" in state_dict:
            self.fp8 = FP8QKVProjection.blank(self, bias=prefix + "fp8.bias" in state_dict)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _check_fp8_call(values: Tensor, training: bool) -> None:
    """A layer converted by ``to_fp8_inference`` gives no gradient to its input or ``in_proj``: with
    gradients enabled, refuse an input that requires grad, and training mode."""
    if not torch.is_grad_enabled():
        return
    if values.requires_grad:
        raise RuntimeError("this layer runs fp8 inference (to_fp8_inference): its input requires grad, and no "
                           "gradient reaches it; call the model under torch.no_grad() or torch.inference_mode() "
                           "(torch.export.export it under torch.no_grad() too)")
    if training:
        raise RuntimeError("this layer runs fp8 inference (to_fp8_inference): it is in training mode with grad "
                           "enabled, but it does not train (its in_proj gets no gradient); call model.eval(), or "
                           "run it under torch.no_grad() or torch.inference_mode()")


class RotaryBlockAttention(BlockSelfAttention):
    """:class:`BlockSelfAttention` with rotary position embeddings on q and k (fused into the kernel).

    Positions default to each token's index inside its sequence; pass ``positions`` (``[T]``
    int or float, e.g. event timestamps, or a JaggedTensor / dict of them shaped like ``x``) to
    rotate by other positions. For pair ``i < rotary_dim/2`` the angle is
    ``position * rope_theta ** (-2 i / rotary_dim)``.

    Args:
        embed_dim, num_heads, block_size, num_kv_heads, bias, causal, backend: as in
            :class:`BlockSelfAttention`.
        rope_theta: rotary base.
        rotary_dim: rotate the first ``rotary_dim`` channels of each head (even, <= head_dim);
            default the whole head.
        rotary_interleaved: pairs ``(x[2i], x[2i+1])`` instead of ``(x[i], x[i + rotary_dim/2])``.

    Forward:
        ``forward(x, offsets=None, positions=None, *, cpu_offsets=None, max_seqlen=None)``,
        returning the kind of ``x`` as in :class:`BlockSelfAttention`.

    Example:
        >>> import torch
        >>> from blockattn_layers import RotaryBlockAttention
        >>> attn = RotaryBlockAttention(32, 2, block_size=None, rotary_dim=8)
        >>> values, offsets = torch.randn(7, 32), torch.tensor([0, 3, 7])
        >>> event_times = torch.tensor([0.0, 1.5, 9.0, 2.0, 2.5, 3.0, 60.0])
        >>> attn(values, offsets, positions=event_times).shape
        torch.Size([7, 32])
    """

    def __init__(
        self, embed_dim: int, num_heads: int, *, block_size: Optional[int] = 64, rope_theta: float = 10000.0,
        rotary_dim: Optional[int] = None, rotary_interleaved: bool = False, num_kv_heads: Optional[int] = None,
        bias: bool = True, causal: bool = False, backend: Union[str, Backend] = "auto",
        device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, validate: Optional[bool] = None,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, block_size=block_size, num_kv_heads=num_kv_heads, bias=bias, causal=causal,
            backend=backend, device=device, dtype=dtype, validate=validate,
        )
        self.rope_theta, self.rotary_dim = check_rotary_args(rope_theta, rotary_dim, rotary_interleaved, self.head_dim)
        self.rotary_interleaved = rotary_interleaved

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, rope_theta={self.rope_theta}, rotary_dim={self.rotary_dim}, "
            f"rotary_interleaved={self.rotary_interleaved}"
        )

    def _attention_kwargs(self, positions: Optional[Tensor]) -> dict:
        return {
            "rope_theta": self.rope_theta, "positions": positions, "rotary_dim": self.rotary_dim,
            "rotary_interleaved": self.rotary_interleaved,
        }

    def _fp8_qkv(self, values: Tensor, offsets: Tensor, positions: Optional[Tensor], kwargs: dict) -> Tuple[tuple, dict]:
        """As :class:`BlockSelfAttention`'s, with q and k rotated in the e4m3 projection where its kernel
        can (``FP8QKVProjection.rotated``): attention then runs without rotary."""
        rotated = self.fp8.rotated(values, offsets, positions, self.rope_theta, self.rotary_dim or self.head_dim,
                                   self.rotary_interleaved)
        if rotated is None:
            return self.fp8(values), kwargs
        rotary = ("rope_theta", "positions", "rotary_dim", "rotary_interleaved")
        return rotated, {name: value for name, value in kwargs.items() if name not in rotary}

    def forward(
        self, x: Any, offsets: Optional[Tensor] = None, positions: Any = None, *,
        cpu_offsets: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
    ) -> Any:
        values, offsets, layout = to_values_offsets(x, offsets)
        if positions is not None:
            positions = layout.flatten(positions)
        return layout.wrap(self._attend(values, offsets, layout.kind, positions, cpu_offsets, max_seqlen))
