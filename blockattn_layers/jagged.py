"""The torchrec boundary: jagged batches in every shape users hold them <-> ``(values, offsets)``.

Below this module, ops see only flat tensors: ``values [T, ...]`` and ``offsets [B+1]``
(int32 or int64, ``offsets[0] == 0``, ``offsets[-1] == T``). This module converts

- lengths <-> offsets (plain torch ops: torchrec's ``.offsets()`` calls fbgemm ops that
  some GPU machines lack);
- padded dense ``[B, N, ...]`` plus ``lengths`` or a ``key_padding_mask`` <-> jagged, with
  index math (no Python loop over sequences);
- torchrec ``JaggedTensor``, ``KeyedJaggedTensor`` and ``Dict[str, JaggedTensor]`` <->
  ``(values, offsets)`` and back to the kind given, lengths unchanged;
- torchrec's lazy awaitables (what a sharded ``EmbeddingCollection`` returns inside
  ``DistributedModelParallel``, e.g. ``EmbeddingCollectionAwaitable``) -> their result, then as above.

torchrec is never imported here: an object can only be a torchrec type if the caller has
imported torchrec already, so the types are looked up in ``sys.modules``. Nothing here calls
``.sync()``, ``.item()`` or ``.tolist()`` on device data; the padded conversions that must
learn a size from the data say so and take that size as an optional argument instead.
"""
from __future__ import annotations

import numbers
import sys
from typing import Any, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ._validation import check_offsets_values
from .reference import sequence_ids

_TORCHREC_JT_MODULE = "torchrec.sparse.jagged_tensor"
_TORCHREC_TYPES_MODULE = "torchrec.distributed.types"
_INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- lengths, offsets
def lengths_to_offsets(lengths: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``[B]`` lengths -> ``[B+1]`` offsets ``(0, l0, l0+l1, ...)``, on the device of ``lengths``.

    ``dtype`` defaults to the dtype of ``lengths`` (int32 or int64). No host sync.

    Example:
        >>> lengths_to_offsets(torch.tensor([2, 0, 3], dtype=torch.int32))
        tensor([0, 2, 2, 5], dtype=torch.int32)
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    dtype = lengths.dtype if dtype is None else dtype
    if dtype not in _INDEX_DTYPES:
        raise TypeError(f"offsets dtype must be int32 or int64, got {dtype}")
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=dtype), (1, 0))


def offsets_to_lengths(offsets: Tensor) -> Tensor:
    """``[B+1]`` offsets -> ``[B]`` lengths, same dtype and device. No host sync."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D [B+1] with B >= 0, got shape {tuple(offsets.shape)}")
    return offsets[1:] - offsets[:-1]


def lengths_to_key_padding_mask(lengths: Tensor, max_length: int) -> Tensor:
    """``[B, max_length]`` bool mask, ``True`` at padding (the ``nn.Transformer`` convention)."""
    steps = torch.arange(max_length, device=lengths.device)
    return steps[None, :] >= lengths[:, None]


def _token_coords(offsets: Tensor, total: int) -> Tuple[Tensor, Tensor]:
    """Sequence index and position inside it of every token, each ``[T]`` int64."""
    offsets = offsets.to(torch.int64)
    seq = sequence_ids(offsets, total)
    return seq, torch.arange(total, device=offsets.device) - offsets[seq]


# ----------------------------------------------------------------------------- padded dense
def padded_to_jagged(
    x: Tensor, lengths: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
    total_length: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Padded ``x [B, N, ...]`` -> ``(values [T, ...], offsets [B+1])``.

    Give exactly one of ``lengths [B]`` (sequence ``b`` is ``x[b, :lengths[b]]``) or
    ``key_padding_mask [B, N]`` (``True`` at padding, any pattern: the valid tokens of each row
    are kept in order). ``T`` is a property of the data, so it is read to the host once unless
    given as ``total_length``. Offsets are int64, or the dtype of ``lengths``.

    Example:
        >>> x = torch.randn(2, 4, 8)
        >>> values, offsets = padded_to_jagged(x, torch.tensor([3, 1]))
        >>> values.shape, offsets
        (torch.Size([4, 8]), tensor([0, 3, 4]))
    """
    if x.dim() < 2:
        raise ValueError(f"x must be padded [B, N, ...], got shape {tuple(x.shape)}")
    if (lengths is None) == (key_padding_mask is None):
        raise ValueError("give exactly one of lengths and key_padding_mask")
    if key_padding_mask is not None:
        if key_padding_mask.shape != x.shape[:2] or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be bool [B, N] = {tuple(x.shape[:2])}, got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
        valid = ~key_padding_mask
        offsets = lengths_to_offsets(valid.sum(1))
        _check_total_length(total_length, offsets)
        flat = valid.flatten()
        index = flat.nonzero().flatten() if total_length is None else flat.nonzero_static(size=total_length).flatten()
        return x.flatten(0, 1).index_select(0, index), offsets
    if lengths.shape != x.shape[:1] or lengths.dtype not in _INDEX_DTYPES:
        raise ValueError(f"lengths must be int32/int64 [B={x.shape[0]}], got {lengths.dtype} {tuple(lengths.shape)}")
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(((lengths < 0) | (lengths > x.shape[1])).any()):
            raise ValueError(f"lengths must lie in [0, N={x.shape[1]}], got {lengths.tolist()}")
    offsets = lengths_to_offsets(lengths)
    _check_total_length(total_length, offsets)
    total = int(offsets[-1]) if total_length is None else total_length
    seq, pos = _token_coords(offsets, total)
    return x[seq, pos], offsets


def _check_total_length(total_length: Any, offsets: Tensor) -> None:
    """``total_length`` is None or a non-negative int, equal to the tokens' count where that is on
    the host (no device sync)."""
    if total_length is None:
        return
    if isinstance(total_length, bool) or not isinstance(total_length, numbers.Integral) or total_length < 0:
        raise ValueError(f"total_length must be a non-negative int or None, got {total_length!r}")
    if offsets.device.type == "cpu" and not torch.compiler.is_compiling() and int(offsets[-1]) != total_length:
        raise ValueError(f"total_length ({total_length}) must equal the number of valid tokens ({int(offsets[-1])})")


def jagged_to_padded(
    values: Tensor, offsets: Tensor, max_length: Optional[int] = None, *,
    padding_value: float = 0.0, key_padding_mask: Optional[Tensor] = None,
) -> Tensor:
    """``(values [T, ...], offsets [B+1])`` -> padded ``[B, N, ...]`` filled with ``padding_value``.

    ``N`` is ``max_length`` (longer sequences are cut), else the longest sequence (read to the
    host once). With ``key_padding_mask [B, N]`` (``True`` at padding) the tokens go to the
    valid slots of each row instead, undoing ``padded_to_jagged(x, key_padding_mask=...)``.
    Differentiable in ``values``.
    """
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in _INDEX_DTYPES:
        raise ValueError(f"offsets must be int32/int64 [B+1], got {offsets.dtype} {tuple(offsets.shape)}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral)
                                   or max_length < 0):
        raise ValueError(f"max_length must be a non-negative int or None, got {max_length!r}")
    if offsets.device.type == "cpu" and not torch.compiler.is_compiling():
        check_offsets_values("offsets", offsets, values.shape[0], "values.shape[0]")
    batch, rest = offsets.numel() - 1, values.shape[1:]
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
            raise ValueError(f"key_padding_mask must be [B={batch}, N], got {tuple(key_padding_mask.shape)}")
        out = values.new_full((*key_padding_mask.shape, *rest), padding_value)
        valid = (~key_padding_mask).view(*key_padding_mask.shape, *(1,) * len(rest)).expand_as(out)
        return out.masked_scatter(valid, values)
    if max_length is None:
        max_length = int(offsets_to_lengths(offsets).max()) if batch else 0
    seq, pos = _token_coords(offsets, values.shape[0])
    # Tokens past max_length land in a spare slot N that is cut off: no data-dependent filtering.
    out = values.new_full((batch, max_length + 1, *rest), padding_value)
    out = torch.index_put(out, (seq, pos.clamp(max=max_length)), values)
    return out[:, :max_length]


# ----------------------------------------------------------------------------- torchrec adapters
def _torchrec_types() -> Tuple[Optional[type], Optional[type]]:
    """``(JaggedTensor, KeyedJaggedTensor)`` if the caller has imported torchrec, else ``(None, None)``."""
    module = sys.modules.get(_TORCHREC_JT_MODULE)
    if module is None:
        return None, None
    return module.JaggedTensor, module.KeyedJaggedTensor


def resolve_awaitable(x: Any) -> Any:
    """``x``, or what it stands for if it is a torchrec ``LazyAwaitable``; a dict's values likewise.

    Inside ``DistributedModelParallel`` (with or without ``TrainPipelineSparseDist``) a sharded
    ``EmbeddingCollection`` returns an ``EmbeddingCollectionAwaitable``, a ``LazyAwaitable`` of
    ``Dict[str, JaggedTensor]`` whose output all-to-all is still in flight. It is waited here,
    once: torchrec's own ``LazyAwaitable._wait_async`` caches the result on the awaitable, as
    when torchrec resolves one passed to a torch function. Other objects pass through unchanged.
    """
    module = sys.modules.get(_TORCHREC_TYPES_MODULE)
    lazy = getattr(module, "LazyAwaitable", None)
    if lazy is None:
        return x
    while isinstance(x, lazy):
        x = lazy._wait_async(x)
    if isinstance(x, Mapping) and any(isinstance(v, lazy) for v in x.values()):
        x = {key: resolve_awaitable(value) for key, value in x.items()}
    return x


def _offsets_of(jt: Any) -> Tensor:
    offsets = jt.offsets_or_none()
    return lengths_to_offsets(jt.lengths_or_none()) if offsets is None else offsets


def _lengths_of(jt: Any) -> Tensor:
    lengths = jt.lengths_or_none()
    return offsets_to_lengths(jt.offsets_or_none()) if lengths is None else lengths


def _rebuild_jt(jt: Any, values: Tensor) -> Any:
    return type(jt)(
        values=values, weights=jt.weights_or_none(), lengths=jt.lengths_or_none(), offsets=jt.offsets_or_none(),
    )


def _short(offsets: Tensor) -> str:
    """``offsets`` for a message: its values where it is a short host tensor, else its shape."""
    if offsets.device.type == "cpu" and offsets.numel() <= 8 and not torch.compiler.is_compiling():
        return str(offsets.tolist())
    return f"of shape {tuple(offsets.shape)}"


def _rebuild_kjt(kjt: Any, values: Tensor) -> Any:
    vbe = kjt.variable_stride_per_key()
    return type(kjt)(
        keys=kjt.keys(), values=values, weights=kjt.weights_or_none(), lengths=kjt.lengths_or_none(),
        offsets=kjt.offsets_or_none(), stride=None if vbe else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if vbe else None,
        length_per_key=kjt.length_per_key_or_none(), offset_per_key=kjt.offset_per_key_or_none(),
        inverse_indices=kjt.inverse_indices_or_none(),
    )


class JaggedLayout:
    """How to turn flat ``values`` back into the kind the caller gave (see :func:`to_values_offsets`).

    ``kind`` is ``"tensor"``, ``"jagged_tensor"``, ``"keyed_jagged_tensor"`` or ``"dict"``;
    ``sizes`` holds the token count of each part (one per dict key, else one); ``keys`` is set for dicts;
    ``offsets`` are the input's (for a torchrec input).
    """

    __slots__ = ("kind", "source", "keys", "sizes", "offsets")

    def __init__(self, kind: str, source: Any = None, keys: Tuple[str, ...] = (), sizes: Tuple[int, ...] = (),
                 offsets: Optional[Tensor] = None):
        self.kind, self.source, self.keys, self.sizes, self.offsets = kind, source, keys, sizes, offsets

    def wrap(self, values: Tensor) -> Any:
        """``values [T, ...]`` (new values for the same tokens) in the caller's kind, lengths unchanged.

        Lengths, offsets, weights and keys are those of the input; only the values are new.
        """
        if self.kind == "tensor":
            return values
        if values.shape[0] != sum(self.sizes):
            raise ValueError(f"values must have T = {sum(self.sizes)} rows, got {values.shape[0]}")
        if self.kind == "jagged_tensor":
            return _rebuild_jt(self.source, values)
        if self.kind == "keyed_jagged_tensor":
            return _rebuild_kjt(self.source, values)
        parts = torch.split(values, list(self.sizes)) if len(self.keys) > 1 else (values,)
        return {key: _rebuild_jt(self.source[key], part) for key, part in zip(self.keys, parts)}

    def _kind_message(self, name: str, other: Any) -> str:
        if self.kind == "jagged_tensor":
            wanted = "a [T] tensor or a JaggedTensor, as the input"
        else:
            wanted = "a [T] tensor, or a dict of JaggedTensors or a KeyedJaggedTensor with the input's keys"
        return f"{name} must be {wanted}, got {type(other).__name__}"

    def flatten(self, other: Any, name: str = "positions") -> Tensor:
        """Values of ``other`` (the argument ``name``), a batch of the same kind and lengths, in this
        layout's token order.

        Used for per-token side inputs such as rotary positions (event times): a ``[T]`` tensor
        passes through; for a JaggedTensor input, a JaggedTensor gives its values; for a keyed
        input (a dict or a KeyedJaggedTensor), a dict of JaggedTensors or a KeyedJaggedTensor with
        the same keys gives its values key by key in the input's key order. Its lengths must be
        the input's (checked where both are on the host; the batch size always).
        """
        other = resolve_awaitable(other)
        if isinstance(other, Tensor):
            return other
        if self.kind == "tensor":
            raise TypeError(f"{name} must be a [T] tensor when the input is a tensor of packed values, "
                            f"got {type(other).__name__}")
        _, kjt_type = _torchrec_types()
        keyed = self.kind in ("dict", "keyed_jagged_tensor")
        if keyed and kjt_type is not None and isinstance(other, kjt_type):
            other = other.to_dict()  # matched to the input by key below, whatever its key order
        if keyed and isinstance(other, Mapping):
            missing = [k for k in self.keys if k not in other]
            if missing:
                raise ValueError(f"{name} lacks keys {missing} of the input")
            extra = [k for k in other if k not in self.keys]
            if extra:
                raise ValueError(f"{name} has keys {extra} that the input has not")
            other = {k: other[k] for k in self.keys}
        elif keyed or isinstance(other, Mapping) or (kjt_type is not None and isinstance(other, kjt_type)):
            raise TypeError(self._kind_message(name, other))
        try:
            values, offsets, _ = to_values_offsets(other)
        except TypeError:
            raise TypeError(self._kind_message(name, other)) from None
        mine = self.offsets
        # The batch sizes always; the lengths where both are on the host (no device sync).
        same = offsets.shape == mine.shape
        if same and offsets.device.type == mine.device.type == "cpu" and not torch.compiler.is_compiling():
            same = torch.equal(offsets.to(torch.int64), mine.to(torch.int64))
        if not same:
            raise ValueError(f"{name} must have the input's lengths: offsets {_short(offsets)} against the "
                             f"input's {_short(mine)}")
        return values


def to_values_offsets(x: Any, offsets: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, JaggedLayout]:
    """Flatten a jagged batch to ``(values [T, ...], offsets [B+1], layout)``.

    ``x`` is a tensor ``[T, ...]`` (then ``offsets`` is required), a torchrec ``JaggedTensor``, a
    ``KeyedJaggedTensor`` (its ``len(keys) * stride`` sequences, key-major), a
    ``Dict[str, JaggedTensor]`` (all keys' sequences concatenated in the dict's order, so one
    attention call serves every feature), or a torchrec ``LazyAwaitable`` of one of these (see
    :func:`resolve_awaitable`; the layout is that of its result). ``layout.wrap(new_values)``
    rebuilds the same kind.
    Offsets come from the input's offsets if it holds them, else from its lengths by a cumsum.

    Example:
        >>> values, offsets, layout = to_values_offsets(torch.randn(5, 8), torch.tensor([0, 2, 5]))
        >>> layout.wrap(values * 2).shape
        torch.Size([5, 8])
    """
    if isinstance(x, Tensor):
        if offsets is None:
            raise TypeError("offsets is required when x is a tensor of packed values [T, ...]")
        return x, offsets, JaggedLayout("tensor")
    if isinstance(x, torch.fx.Proxy):
        raise TypeError(
            "got a torch.fx Proxy: to_values_offsets (every blockattn_layers module calls it) is being traced "
            "symbolically, but the kind of its input is only known at run time; call it inside a module the "
            "tracer keeps as a leaf (torchrec's pipeline tracer keeps every module without a sharded child)"
        )
    x = resolve_awaitable(x)
    if offsets is not None:
        raise TypeError(f"offsets must be None when x is a {type(x).__name__}: it carries its own lengths")
    jt_type, kjt_type = _torchrec_types()
    if kjt_type is not None and isinstance(x, kjt_type):
        offsets = _offsets_of(x)
        return x.values(), offsets, JaggedLayout("keyed_jagged_tensor", x, tuple(x.keys()),
                                                 sizes=(x.values().shape[0],), offsets=offsets)
    if jt_type is not None and isinstance(x, jt_type):
        offsets = _offsets_of(x)
        return x.values(), offsets, JaggedLayout("jagged_tensor", x, sizes=(x.values().shape[0],), offsets=offsets)
    if isinstance(x, Mapping) and x and jt_type is not None and all(isinstance(v, jt_type) for v in x.values()):
        keys = tuple(x)
        jts = [x[k] for k in keys]
        if len(jts) == 1:
            values, offsets = jts[0].values(), _offsets_of(jts[0])
        else:
            values = torch.cat([jt.values() for jt in jts])
            offsets = lengths_to_offsets(torch.cat([_lengths_of(jt) for jt in jts]))
        sizes = tuple(jt.values().shape[0] for jt in jts)
        return values, offsets, JaggedLayout("dict", dict(x), keys, sizes, offsets)
    raise TypeError(
        "expected packed values [T, ...] with offsets, a torchrec JaggedTensor or KeyedJaggedTensor, "
        f"a non-empty Dict[str, JaggedTensor] or a torchrec LazyAwaitable of one; got {type(x).__name__}"
    )
