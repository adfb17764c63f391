"""FP8 inference for the attention layers: a QKV projection that emits e4m3 q, k, v itself.

:func:`to_fp8_inference` calibrates every :class:`~blockattn_layers.BlockSelfAttention` of a
model (``RotaryBlockAttention`` and the encoder layers' attention included) on sample batches,
then gives each an :class:`FP8QKVProjection`: the layer's own 16-bit input times its weights,
accumulated in float32 and written as e4m3 in the same kernel (``kernels.fp8_linear`` on CUDA
GPUs where it passed its GPU tests, sm_90, elsewhere with unverified kernels allowed; else a
float32 product, then cast),
with a factor per kind (q, k, v) and kv head, so no pass quantizes the input and none reads a
16-bit q, k or v back to quantize it. Attention then reads e4m3 q, k, v with those factors as
descales; the output projection stays in the model's dtype.

How the factors are folded in: with ``s[c]`` the factor of output column ``c`` (its kind's and
kv head's calibrated absolute maximum over 448, times ``margin``), the weight rows and bias are
divided by ``s``, so the projection's result is ``y / s`` and ``s`` is q's, k's and v's descale.
Values past the calibrated range saturate at 448 x their factor. The input stays in its 16-bit
dtype: at the ranking models' widths (d_model of a few hundred) the projection moves more bytes
than it computes, and an e4m3 input would add its own rounding and a pass to make it.

Forward only: a converted layer refuses inputs that require gradients, and gradient-enabled calls
in training mode; convert a trained model. Its buffers are in its ``state_dict``: loading that into
a freshly built model of the same architecture restores the projections without calibration data
(``BlockSelfAttention._load_from_state_dict``).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from .._validation import check_positions
from ..fp8 import FP8_DTYPE, FP8_MAX
from ..kernels.fp8_linear import linear_e4m3, linear_e4m3_reasons, rotates_pairs
from ..reference import sequence_positions


# Rotary layers' q and k rotated in the projection's epilogue (:meth:`FP8QKVProjection.rotated`) instead of
# in attention: measured slower, so off. H100, 2026-12-06, prod lengths: the projection 2.098 ms (D128 heads)
# and 1.921 (D64) against 1.442 without rotary (the epilogue's sines are not hidden under the other
# consumer's products); the rotary sub-layer 4.064 ms at D128 H2 and 3.854 at D64 H4 against bf16's 4.178
# and 4.211, where with rotary in attention it took 3.527-3.533 and 3.928-3.952 (against 4.247-4.301 and
# 4.395-4.407) in the session's other runs.
ROTARY_IN_PROJECTION = False


class FP8QKVProjection(nn.Module):
    """``x [T, E]`` -> e4m3 ``q [T, H, D]``, ``k, v [T, H_kv, D]`` and their descales ``[H_kv]``.

    Buffers: ``weight`` ``[N, E]`` in the layer's dtype and ``bias`` float32 ``[N]`` (or None), both
    already divided by the output factors; ``descales`` float32 ``[3, H_kv]`` (q, k, v).
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor], descales: Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self._orders: Dict[Tuple[int, torch.device], Tensor] = {}  # _pair_order's, per rotary dim and device
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.register_buffer("descales", descales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, column_amax: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                    margin: float, rotary: Optional[Tuple[int, bool]] = None) -> "FP8QKVProjection":
        """From a fused QKV ``linear`` and the calibrated absolute maximum of each output column (``[N]``).
        ``rotary`` (``(rotary_dim, interleaved)`` of a rotary layer): q's and k's ranges bound their
        rotated values too (each pair's channels at the pair's largest length ``sqrt(amax_a ** 2 +
        amax_b ** 2)``), so one converted state serves rotary in attention and in the projection
        (:meth:`rotated`)."""
        groups = num_heads // num_kv_heads
        parts = list(column_amax.float().split([num_heads * head_dim, num_kv_heads * head_dim,
                                                num_kv_heads * head_dim]))
        if rotary is not None:
            parts[:2] = [_pair_lengths(part, head_dim, *rotary) for part in parts[:2]]
        per_head = [parts[0].view(num_kv_heads, groups * head_dim), parts[1].view(num_kv_heads, head_dim),
                    parts[2].view(num_kv_heads, head_dim)]
        amax = torch.stack([p.amax(1) for p in per_head])  # [3, H_kv]
        descales = torch.where(amax > 0, amax * margin / FP8_MAX, torch.ones_like(amax))
        widths = (groups * head_dim, head_dim, head_dim)  # columns per kv head of q, k, v
        columns = torch.cat([descales[i].repeat_interleave(widths[i]) for i in range(3)])
        folded = linear.weight.detach().float() / columns[:, None]
        _check_weight_fits(folded, linear.weight.dtype)
        bias = None if linear.bias is None else linear.bias.detach().float() / columns
        return cls(folded.to(linear.weight.dtype).contiguous(), bias, descales, num_heads, num_kv_heads, head_dim)

    @classmethod
    def blank(cls, layer: nn.Module, bias: bool) -> "FP8QKVProjection":
        """A projection shaped for ``layer`` (a ``BlockSelfAttention``), on its device and in its
        dtype, to load a converted layer's state into: zero weight and bias, unit descales."""
        weight = torch.zeros_like(layer.in_proj.weight)
        factory = {"device": weight.device, "dtype": torch.float32}
        return cls(weight, torch.zeros(weight.shape[0], **factory) if bias else None,
                   torch.ones(3, layer.num_kv_heads, **factory), layer.num_heads, layer.num_kv_heads, layer.head_dim)

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply``, but ``descales`` and ``bias`` keep their float32 values through a
        dtype cast of the model (``.to(torch.bfloat16)`` after calibrating in float32): they follow
        device moves only. A cast the folded weight overflows (``.half()`` of small calibrated
        ranges) raises, this module's buffers left as they were."""
        kept = {name: getattr(self, name) for name in ("weight", "descales", "bias") if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        weight, cast = kept.pop("weight"), self.weight
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != torch.float32:
                setattr(self, name, before.to(after.device))
        if cast.dtype != weight.dtype and "meta" not in (cast.device.type, weight.device.type):
            try:
                _check_weight_fits(weight, cast.dtype)
            except ValueError:
                for name, before in dict(kept, weight=weight).items():
                    setattr(self, name, before)
                raise
        return self

    def project(self, x: Tensor) -> Tensor:
        """e4m3 ``[T, N]``: ``clamp(x @ weight.T + bias, -448, 448)``, by the fused kernel where it
        takes the call (``linear_e4m3_reasons``), else in float32 and cast."""
        if x.is_cuda and not linear_e4m3_reasons(x, self.weight):
            return linear_e4m3(x, self.weight, self.bias)
        y = x.float() @ self.weight.float().t()
        if self.bias is not None:
            y = y + self.bias
        return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(q8, k8, v8, q_descale, k_descale, v_descale)`` of ``x [T, E]``."""
        return self._split(self.project(x))

    def rotated(self, x: Tensor, offsets: Tensor, positions: Optional[Tensor], rope_theta: float, rotary_dim: int,
                interleaved: bool) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]]:
        """As :meth:`forward`, with rotary applied to q and k in the projection's epilogue before the
        e4m3 cast (``kernels.fp8_linear.rotates_pairs``), or None where the kernel cannot or
        ``ROTARY_IN_PROJECTION`` is off (the default: measured slower). Positions: the
        given ones (``[T]``), else each token's index in its sequence. q's and k's channels come out in
        pair order (each head's pairs ``(i, i + rotary_dim / 2)`` adjacent, then its pass-through
        channels; interleaved pairs as they are): the same order in both, so their scores are the rotary
        attention's, and attention takes them without rotary."""
        if not ROTARY_IN_PROJECTION or x.dim() != 2 or not rotates_pairs(x, self.weight, self.head_dim):
            return None  # attention checks the positions and rotates
        from ..kernels.sm90.linear import PairRotary

        if positions is not None:
            check_positions(positions, x.shape[0], x.device, where="the input")

        order = self._pair_order(rotary_dim, interleaved, x.device)
        weight = self.weight if order is None else self.weight.index_select(0, order)
        bias = self.bias if order is None or self.bias is None else self.bias.index_select(0, order)
        pos = sequence_positions(offsets, x.shape[0]) if positions is None else positions
        columns = (self.num_heads + self.num_kv_heads) * self.head_dim
        rotary = PairRotary(pos.to(torch.float32), float(rope_theta), self.head_dim, rotary_dim, columns)
        return self._split(linear_e4m3(x, weight, bias, rotary=rotary))

    def _pair_order(self, rotary_dim: int, interleaved: bool, device: torch.device) -> Optional[Tensor]:
        """Output rows of the weight in pair order (:meth:`rotated`; None: the order they have)."""
        if interleaved:
            return None
        key = (rotary_dim, device)
        if key not in self._orders:
            d, half = self.head_dim, rotary_dim // 2
            head = [c for i in range(half) for c in (i, i + half)] + list(range(rotary_dim, d))
            rotated_heads = self.num_heads + self.num_kv_heads
            order = [h * d + c for h in range(rotated_heads) for c in head]
            order += range(rotated_heads * d, self.weight.shape[0])
            self._orders[key] = torch.tensor(order, device=device)
        return self._orders[key]

    def _split(self, y: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = y.split([h * d, hk * d, hk * d], dim=-1)
        return (q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d)),
                self.descales[0], self.descales[1], self.descales[2])

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def _pair_lengths(amax: Tensor, head_dim: int, rotary_dim: int, interleaved: bool) -> Tensor:
    """Column ranges ``amax`` (heads of ``head_dim``) with each rotary pair's two channels at the
    pair's largest length, the bound on either channel after any rotation."""
    heads = amax.view(-1, head_dim).clone()
    half = rotary_dim // 2
    first = torch.arange(half) * 2 if interleaved else torch.arange(half)
    second = first + 1 if interleaved else first + half
    length = torch.sqrt(heads[:, first] ** 2 + heads[:, second] ** 2)
    heads[:, first], heads[:, second] = length, length
    return heads.flatten()


def _check_weight_fits(weight: Tensor, dtype: torch.dtype) -> None:
    """Raise where ``weight`` (the folded QKV weight, finite) overflows ``dtype``: small calibrated
    q, k, v ranges make it large, and an infinite weight would make every output NaN."""
    largest = float(weight.abs().amax()) if weight.numel() else 0.0
    limit = torch.finfo(dtype).max
    if largest > limit:
        raise ValueError(f"fp8 QKV projection: its folded weight (in_proj's weight over the calibrated q, k, v "
                         f"factors) reaches {largest:.4g} and would overflow {dtype} (largest {limit:.4g}): the "
                         f"calibrated ranges are small for its weights; serve this model in torch.bfloat16 or "
                         f"torch.float32")


class _Calibration:
    """Absolute maximum of each attention layer's QKV output columns, over sample batches."""

    def __init__(self, layers) -> None:
        self.stats: Dict[nn.Module, Optional[Tensor]] = {layer: None for layer in layers}
        self.hooks = [layer.in_proj.register_forward_hook(self._hook(layer)) for layer in layers]

    def _hook(self, layer):
        def record(module, inputs, output):
            if output.shape[0] == 0:
                return
            # As quantize_fp8's factors: NaN and infinite outputs are left out of the ranges.
            amax = output.detach().abs().nan_to_num(nan=0.0, posinf=0.0).flatten(0, -2).amax(0).float()
            seen = self.stats[layer]
            self.stats[layer] = amax if seen is None else torch.maximum(seen, amax)

        return record

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _check_calibration(calibration: Any) -> None:
    """Refuse, in the caller's terms, a calibration that is no iterable of batches, or is one
    ``(values, offsets)`` batch itself (its items would be taken as batches of their own)."""
    if calibration is None or isinstance(calibration, (str, bytes)) or not hasattr(calibration, "__iter__"):
        raise TypeError(f"to_fp8_inference: calibration must be an iterable of sample batches, e.g. "
                        f"[(values, offsets)], got {type(calibration).__name__} (to restore a saved converted "
                        f"model, load_state_dict its state into a freshly built one: no calibration needed)")
    if (isinstance(calibration, tuple) and len(calibration) >= 2
            and all(isinstance(x, Tensor) for x in calibration[:2])
            and calibration[0].is_floating_point() and not calibration[1].is_floating_point()):
        raise TypeError("to_fp8_inference: calibration is an iterable of batches, got one batch (values, offsets); "
                        "pass [(values, offsets)]")


def to_fp8_inference(model: nn.Module, calibration: Iterable[Any], *, margin: float = 1.0) -> nn.Module:
    """Give every ``BlockSelfAttention`` in ``model`` an e4m3 QKV projection (module docstring),
    calibrated by running ``model`` on each item of ``calibration`` (an iterable of batches, e.g.
    ``[(values, offsets)]``; a tuple item: ``model(*item)``; a dict: ``model(**item)``; else
    ``model(item)``) without gradients. Each range is the largest finite absolute value seen
    (empty batches add nothing). ``margin`` (>= 1) widens every calibrated range. Returns
    ``model``, converted in place (set to eval mode). To serve a saved converted model, build the
    architecture and ``load_state_dict`` its state instead: no calibration is needed."""
    from .attention import BlockSelfAttention, RotaryBlockAttention

    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 1.0 <= margin < float("inf"):
        raise ValueError(f"margin must be a finite number >= 1, got {margin!r}")
    _check_calibration(calibration)
    layers = [m for m in model.modules() if isinstance(m, BlockSelfAttention)]
    if not layers:
        raise ValueError("to_fp8_inference: the model holds no BlockSelfAttention layer")
    for layer in layers:
        layer.fp8 = None  # calibrate the 16-bit path
    model.eval()
    calib = _Calibration(layers)
    batches = 0
    try:
        with torch.no_grad():
            for item in calibration:
                if isinstance(item, tuple):
                    model(*item)
                elif isinstance(item, dict):
                    model(**item)
                else:
                    model(item)
                batches += 1
    finally:
        calib.close()
    if batches == 0:
        raise ValueError("to_fp8_inference: calibration gave no batches")
    for layer in layers:
        y_amax = calib.stats[layer]
        if y_amax is None:
            raise ValueError(f"to_fp8_inference: no calibration batch reached {type(layer).__name__} "
                             f"({layer.extra_repr()})")
        rotary = None
        if isinstance(layer, RotaryBlockAttention):
            rotary = (layer.rotary_dim or layer.head_dim, layer.rotary_interleaved)
        layer.fp8 = FP8QKVProjection.from_linear(layer.in_proj, y_amax, layer.num_heads, layer.num_kv_heads,
                                                 layer.head_dim, float(margin), rotary)
    return model
