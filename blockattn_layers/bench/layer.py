"""Layer-level benchmark: one encoder layer, forward and backward on packed jagged tokens.

Rows: ours (``blockattn_layers.JaggedTransformerEncoderLayer``); the same post-norm layer
built on FA2 varlen (projections, norms and feed-forward of a seeded
``nn.TransformerEncoderLayer``, attention through FA2 with block boundaries as cu_seqlens);
and that ``nn.TransformerEncoderLayer`` itself on padded ``[B, max_len, E]`` input with a
block-diagonal mask, pad and unpad included, where its ``[B*H, L, L]`` mask fits in memory.
Dropout is 0 everywhere so the rows compute the same function.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import blockattn_layers

from .baselines import FlashVarlen, fits_in_memory, pad_rows
from .common import Case, Method, Prepared, RunConfig

LAYER_CLASS = "JaggedTransformerEncoderLayer"


@dataclass(eq=False)
class LayerInputs:
    """``x [T, E]`` (a leaf), its output gradient, offsets and the block boundaries."""

    x: Tensor
    grad_out: Tensor
    offsets: Tensor
    cpu_offsets: Tensor
    bounds: Tensor
    max_unit: int
    seed: int


def make_layer_inputs(case: Case, device: torch.device, dtype: torch.dtype, seed: int) -> LayerInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.total, case.layer.d_model)
    x = torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(shape, generator=gen, device=device).to(dtype)
    bounds = case.unit_bounds()
    return LayerInputs(
        x=x, grad_out=grad_out, offsets=case.offsets.to(device, torch.int32), cpu_offsets=case.offsets,
        bounds=bounds.to(device, torch.int32), max_unit=int(bounds.diff().max()), seed=seed,
    )


class PackedEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer``'s post-norm math on packed ``[T, E]`` tokens.

    Weights are copied from ``source``; ``attention(q, k, v)`` maps ``[T, H, E/H]`` to the same.
    """

    def __init__(self, source: nn.TransformerEncoderLayer, attention: Callable[[Tensor, Tensor, Tensor], Tensor]):
        super().__init__()
        src = copy.deepcopy(source)
        d_model = src.self_attn.embed_dim
        self.nhead = src.self_attn.num_heads
        self.in_proj = nn.Linear(d_model, 3 * d_model, device=src.linear1.weight.device,
                                 dtype=src.linear1.weight.dtype)
        self.in_proj.weight = src.self_attn.in_proj_weight
        self.in_proj.bias = src.self_attn.in_proj_bias
        self.out_proj, self.linear1, self.linear2 = src.self_attn.out_proj, src.linear1, src.linear2
        self.norm1, self.norm2 = src.norm1, src.norm2
        self.attention = attention

    def forward(self, x: Tensor) -> Tensor:
        T, E = x.shape
        q, k, v = self.in_proj(x).view(T, 3, self.nhead, E // self.nhead).unbind(1)
        x = self.norm1(x + self.out_proj(self.attention(q, k, v).reshape(T, E)))
        return self.norm2(x + self.linear2(F.relu(self.linear1(x))))


def _torch_layer(case: Case, inp: LayerInputs, dtype: torch.dtype) -> nn.TransformerEncoderLayer:
    cfg = case.layer
    torch.manual_seed(inp.seed)
    layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.nhead, cfg.dim_feedforward, dropout=0.0, batch_first=True)
    return layer.to(inp.x.device, dtype)


def _reference_attention(case: Case, inp: LayerInputs):
    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return blockattn_layers.block_attention(
            q, k, v, inp.offsets, case.block_size, cpu_offsets=inp.cpu_offsets, backend="reference",
        )

    return attention


def _oracle(model: nn.Module, inp: LayerInputs, call: Callable[[nn.Module, Tensor], Tensor]):
    """Float32 output and ``dx`` of ``model`` (already float32) for the same ``x`` and output gradient."""

    def run():
        x = inp.x.detach().float().requires_grad_()
        out = call(model, x)
        (dx,) = torch.autograd.grad(out, (x,), inp.grad_out.float())
        return out.detach(), (dx,)

    return run


def _prepared(model: nn.Module, inp: LayerInputs, forward: Callable[[], Tensor], oracle) -> Prepared:
    leaves = (inp.x,) + tuple(p for p in model.parameters() if p.requires_grad)
    return Prepared(forward, leaves, inp.grad_out, grads_to_packed=lambda grads: grads[:1], oracle=oracle)


# ----------------------------------------------------------------------------- ours
def _our_class():
    return getattr(blockattn_layers, LAYER_CLASS, None)


def _ours_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    if _our_class() is None:
        return f"blockattn_layers.{LAYER_CLASS} not available in this build"
    return None


def _call_ours(model: nn.Module, x: Tensor, offsets: Tensor) -> Tensor:
    out = model(x, offsets)
    return out[0] if isinstance(out, (tuple, list)) else out


def ours(case: Case, inp: LayerInputs, cfg: RunConfig) -> Prepared:
    cls, c = _our_class(), case.layer
    kwargs = dict(dim_feedforward=c.dim_feedforward, dropout=0.0, block_size=case.block_size)
    torch.manual_seed(inp.seed)
    model = cls(c.d_model, c.nhead, **kwargs).to(inp.x.device, inp.x.dtype)
    try:
        reference = cls(c.d_model, c.nhead, backend="reference", **kwargs)
        reference.load_state_dict(model.state_dict())
    except TypeError:
        reference = copy.deepcopy(model)
    reference = reference.to(inp.x.device, torch.float32)

    def forward():
        return _call_ours(model, inp.x, inp.offsets)

    oracle = _oracle(reference, inp, lambda m, x: _call_ours(m, x, inp.offsets))
    return _prepared(model, inp, forward, oracle)


# ----------------------------------------------------------------------------- FA2 layer
def _packed_oracle(case: Case, inp: LayerInputs, source: nn.TransformerEncoderLayer):
    model = PackedEncoderLayer(source, _reference_attention(case, inp)).float()
    return _oracle(model, inp, lambda m, x: m(x))


def fa2_layer(case: Case, inp: LayerInputs, cfg: RunConfig) -> Prepared:
    source = _torch_layer(case, inp, inp.x.dtype)
    scale = (case.layer.d_model // case.layer.nhead) ** -0.5

    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return FlashVarlen.apply(q, k, v, inp.bounds, inp.max_unit, scale)

    model = PackedEncoderLayer(source, attention)
    return _prepared(model, inp, lambda: model(inp.x), _packed_oracle(case, inp, source))


# ----------------------------------------------------------------------------- padded nn.TransformerEncoderLayer
def _padded_mask(case: Case, device) -> Tensor:
    """``[B*H, L, L]`` bool, True = masked: other blocks, and padded keys (a padded query sees itself)."""
    L, bs = case.max_seqlen, case.block_size
    pos = torch.arange(L, device=device)
    same_block = (pos[:, None] // bs) == (pos[None, :] // bs)
    valid_key = pos[None, :] < case.lengths.to(device)[:, None]
    allowed = same_block[None] & (valid_key[:, None, :] | torch.eye(L, dtype=torch.bool, device=device)[None])
    return (~allowed).repeat_interleave(case.layer.nhead, dim=0)


def _padded_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    elt = torch.finfo(cfg.dtype).bits // 8
    mask = case.batch * case.layer.nhead * case.max_seqlen ** 2 * (1 + 2 * elt)
    reason = fits_in_memory(mask, cfg)
    return f"[B*H, L, L] attention mask {reason}" if reason else None


def padded_layer(case: Case, inp: LayerInputs, cfg: RunConfig) -> Prepared:
    model = _torch_layer(case, inp, inp.x.dtype)
    B, L, E = case.batch, case.max_seqlen, case.layer.d_model
    rows = pad_rows(case, inp.x.device)
    mask = _padded_mask(case, inp.x.device)

    def forward():
        padded = inp.x.new_zeros(B * L, E).index_copy(0, rows, inp.x).view(B, L, E)
        return model(padded, src_mask=mask).reshape(B * L, E).index_select(0, rows)

    return _prepared(model, inp, forward, _packed_oracle(case, inp, model))


def _layer(case: Case) -> bool:
    return case.layer is not None


LAYER_METHODS = [
    Method("ours_layer", "ours", ours, _layer, skip=_ours_skip, gpu_only=False,
           description=f"blockattn_layers.{LAYER_CLASS} (backend auto)"),
    Method("fa2_layer", "baseline", fa2_layer, _layer,
           description="same projections, attention through FA2 varlen (cu_seqlens = block bounds)"),
    Method("torch_padded", "baseline", padded_layer, _layer, skip=_padded_skip, gpu_only=False,
           description="nn.TransformerEncoderLayer on padded input, block-diagonal mask, pad/unpad timed"),
]
