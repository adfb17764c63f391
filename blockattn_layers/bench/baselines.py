"""Baselines: built-in attention kernels fed the same packed ``q, k, v [T, H, D]``.

One setup function per baseline returns a :class:`Prepared`; the runner checks, times
and measures them all the same way. Attention units are the blocks of each sequence
(``Inputs.bounds``), or whole sequences for full attention (``block_size=None``).

Signatures used (checked against torch 2.11's schema, which the run records in its JSON)::

    aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q,
        Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal,
        bool return_debug_mask, *, float? scale=None, ...)
        -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)
    aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
        Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
        float dropout_p, bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, ...)
        -> (Tensor, Tensor, Tensor)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .common import Case, Inputs, Method, Prepared, RunConfig

_FRACTION_OF_FREE = 0.5  # a padded baseline runs only if its tensors fit in this share of free memory


class FlashVarlen(torch.autograd.Function):
    """FA2 varlen (``torch.ops.aten._flash_attention_*``) with ``cu`` as both cu_seqlens; k, v may
    have fewer heads than q (GQA, native in FA2)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float,
                causal: bool = False) -> Tensor:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.max_len, ctx.scale, ctx.causal = max_len, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, ctx.causal,
            rng_state, unused, scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None


def _scale(case: Case) -> float:
    return case.head_dim ** -0.5


def _qkv(inp: Inputs):
    return inp.q, inp.k, inp.v


# ----------------------------------------------------------------------------- FA2 varlen
def fa2_varlen(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    scale = _scale(case)

    def forward():
        return FlashVarlen.apply(inp.q, inp.k, inp.v, inp.bounds, inp.max_unit, scale, case.causal)

    return Prepared(forward, _qkv(inp), inp.grad_out)


# ----------------------------------------------------------------------------- SDPA on the block view
def _sdpa_block_view(backend: SDPBackend, rotary: bool = False):
    """SDPA with one backend forced, on the dense ``[n_blocks, H, block, D]`` view (aligned lengths);
    causal inside each block, GQA through ``enable_gqa``; ``rotary``: q, k rotated first (compiled)."""

    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        T, H, D, bs = case.total, case.num_heads, case.head_dim, case.block_size
        gqa = case.kv_heads != H
        rotate = _rotary_prelude(case, inp, compiled=True) if rotary else None

        def view(x: Tensor) -> Tensor:
            return x.view(T // bs, bs, x.shape[1], D).transpose(1, 2)

        def forward():
            q, k = rotate(inp.q, inp.k) if rotate is not None else (inp.q, inp.k)
            extra = dict(enable_gqa=True) if gqa else {}
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(view(q), view(k), view(inp.v), scale=_scale(case),
                                                   is_causal=case.causal, **extra)
            return o.transpose(1, 2).reshape(T, H, D)

        return Prepared(forward, _qkv(inp), inp.grad_out)

    return setup


def _mha_only(case: Case, cfg: RunConfig) -> Optional[str]:
    """Baselines not wired for causal masking or GQA say so instead of computing something else."""
    if case.causal or case.kv_heads != case.num_heads:
        return "causal / GQA not wired for this baseline"
    return None


def _both(*checks):
    def skip(case: Case, cfg: RunConfig) -> Optional[str]:
        for check in checks:
            reason = check(case, cfg)
            if reason:
                return reason
        return None

    return skip


def _needs_aligned(case: Case, cfg: RunConfig) -> Optional[str]:
    if not case.aligned:
        return f"lengths not multiples of {case.block_size} (see prod_aligned)"
    return None


# ----------------------------------------------------------------------------- padded SDPA (full attention)
def pad_rows(case: Case, device) -> Tensor:
    """Row of every packed token in the padded ``[B * max_len]`` layout."""
    seq = torch.repeat_interleave(torch.arange(case.batch), case.lengths)
    pos = torch.arange(case.total) - case.offsets[:-1][seq]
    return (seq * case.max_seqlen + pos).to(device)


def _padded_sdpa(backend: SDPBackend, masked: bool):
    """SDPA on pre-padded ``[B, H, max_len, D]`` leaves; pad/unpad stay outside the timing.

    Without a mask the valid tokens also attend to padding: a speed bound, not checked.
    """

    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        B, L, H, D = case.batch, case.max_seqlen, case.num_heads, case.head_dim
        rows = pad_rows(case, inp.q.device)

        def pad(x: Tensor) -> Tensor:
            return x.new_zeros(B * L, H, D).index_copy_(0, rows, x.detach()).view(B, L, H, D)

        q, k, v = (pad(x).requires_grad_() for x in _qkv(inp))
        mask = None
        if masked:
            mask = (torch.arange(L, device=rows.device)[None, :] < case.lengths.to(rows.device)[:, None])
            mask = mask[:, None, None, :]

        def forward():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=_scale(case),
                )
            return o.transpose(1, 2)

        def unpad(x: Tensor) -> Tensor:
            return x.reshape(B * L, H, D).index_select(0, rows)

        return Prepared(
            forward, (q, k, v), pad(inp.grad_out), to_packed=unpad,
            grads_to_packed=lambda grads: tuple(unpad(g) for g in grads), checked=masked,
            note="" if masked else "no mask: speed bound, not checked",
        )

    return setup


def fits_in_memory(nbytes: int, cfg: RunConfig) -> Optional[str]:
    if cfg.device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(cfg.device)
    if nbytes > _FRACTION_OF_FREE * free:
        return f"needs ~{nbytes / 2**30:.0f} GiB of {free / 2**30:.0f} GiB free"
    return None


def _padded_fits(case: Case, cfg: RunConfig) -> Optional[str]:
    padded = case.batch * case.max_seqlen * case.num_heads * case.head_dim * torch.finfo(cfg.dtype).bits // 8
    return fits_in_memory(9 * padded, cfg)  # q, k, v, o, do, dq, dk, dv + workspace


# ----------------------------------------------------------------------------- nested tensors
def nested_sdpa(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """SDPA on jagged-layout nested tensors whose offsets are the unit boundaries."""
    offsets = inp.bounds.to(torch.int64)
    lengths = case.unit_bounds().diff()
    lo, hi = int(lengths.min()), int(lengths.max())

    def nested(x: Tensor) -> Tensor:
        return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=lo, max_seqlen=hi).transpose(1, 2)

    def forward():
        o = F.scaled_dot_product_attention(nested(inp.q), nested(inp.k), nested(inp.v), scale=_scale(case))
        return o.transpose(1, 2).values()

    return Prepared(forward, _qkv(inp), inp.grad_out)


# ----------------------------------------------------------------------------- FlexAttention
@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """Compiled FlexAttention on the packed ``[1, H, T, D]`` sequence with a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    T = case.total
    unit_lengths = case.unit_bounds().diff()
    unit = torch.repeat_interleave(torch.arange(unit_lengths.numel()), unit_lengths).to(inp.q.device)

    def same_unit(b, h, q_idx, kv_idx):
        return unit[q_idx] == unit[kv_idx]

    # Built eagerly: the mask is evaluated on the whole T x T grid (fails at prod sizes, as recorded in
    # PERFORMANCE.md); _compile=True avoids that memory but took minutes there, too long for this run.
    block_mask = create_block_mask(same_unit, None, None, T, T, device=inp.q.device)
    attend = _compiled_flex()

    def packed(x: Tensor) -> Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    def forward():
        o = attend(packed(inp.q), packed(inp.k), packed(inp.v), block_mask=block_mask, scale=_scale(case))
        return o.squeeze(0).transpose(0, 1)

    return Prepared(forward, _qkv(inp), inp.grad_out)


# ----------------------------------------------------------------------------- eager
def eager(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """matmul + softmax on the padded ``[n_blocks, H, block, D]`` view (a gather unless aligned)."""
    T, H, D, bs = case.total, case.num_heads, case.head_dim, case.block_size
    bounds = case.unit_bounds()
    starts, lengths = bounds[:-1], bounds.diff()
    nb = starts.numel()
    slot = torch.arange(bs)
    valid = slot[None, :] < lengths[:, None]
    device = inp.q.device
    index = torch.where(valid, starts[:, None] + slot[None, :], starts[:, None]).flatten().to(device)
    keep = torch.nonzero(valid.flatten()).flatten().to(device)  # valid slots, in token order
    key_masked = (~valid)[:, None, None, :].to(device)
    if case.causal:  # key slot after the query slot
        key_masked = key_masked | torch.ones(bs, bs, dtype=torch.bool, device=device).triu(1)[None, None]
    aligned = case.aligned
    groups = H // case.kv_heads

    def blocks(x: Tensor) -> Tensor:
        x = x if aligned else x.index_select(0, index)
        x = x.view(nb, bs, x.shape[1], D).transpose(1, 2)
        return x.repeat_interleave(groups, dim=1) if x.shape[1] != H else x

    def forward():
        s = torch.matmul(blocks(inp.q), blocks(inp.k).transpose(-1, -2)) * _scale(case)
        if not aligned or case.causal:
            s = s.masked_fill(key_masked, float("-inf"))
        o = torch.matmul(s.softmax(dim=-1), blocks(inp.v)).transpose(1, 2).reshape(nb * bs, H, D)
        return o if aligned else o.index_select(0, keep)

    return Prepared(forward, _qkv(inp), inp.grad_out)


def _eager_fits(case: Case, cfg: RunConfig) -> Optional[str]:
    n_blocks = case.unit_bounds().numel() - 1
    scores = n_blocks * case.num_heads * case.block_size ** 2 * torch.finfo(cfg.dtype).bits // 8
    return fits_in_memory(4 * scores, cfg)


# ----------------------------------------------------------------------------- rotary + FA2
def rotate_qk(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor, interleaved: bool = False):
    """Rotary on the first ``2 * len(inv_freq)`` channels of q and k (the rest pass unchanged) in
    float32, cos/sin from positions on every call; pairs ``(x[i], x[i + r/2])`` or, interleaved,
    ``(x[2i], x[2i+1])``. k may have fewer heads than q (GQA)."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    rot = 2 * inv_freq.shape[0]

    def rotate(x: Tensor) -> Tensor:
        xr = x[..., :rot].float()
        if interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = xr.chunk(2, dim=-1)
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        out = out.to(x.dtype)
        return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)

    return rotate(q), rotate(k)


@functools.lru_cache(maxsize=None)
def _compiled_rotate():
    return torch.compile(rotate_qk, dynamic=False)


def _rotary_prelude(case: Case, inp: Inputs, compiled: bool):
    """``(q, k) -> (q, k)`` rotated as ``case`` asks (rotary_dim, interleaved; theta per channel pair)."""
    rot = case.head_dim if case.rotary_dim is None else case.rotary_dim
    i = torch.arange(rot // 2, dtype=torch.float64)
    inv_freq = (case.rope_theta ** (-2.0 * i / rot)).to(inp.q.device, torch.float32)
    rotate = _compiled_rotate() if compiled else rotate_qk
    interleaved = bool(case.rotary_interleaved)
    return lambda q, k: rotate(q, k, inp.positions, inv_freq, interleaved)


def _rotary_fa2(compiled: bool):
    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        scale = _scale(case)
        rotate = _rotary_prelude(case, inp, compiled)

        def forward():
            q, k = rotate(inp.q, inp.k)
            return FlashVarlen.apply(q, k, inp.v, inp.bounds, inp.max_unit, scale, case.causal)

        return Prepared(forward, _qkv(inp), inp.grad_out)

    return setup


# ----------------------------------------------------------------------------- FlashAttention-4 varlen
@functools.lru_cache(maxsize=None)
def _fa4():
    """``flash_attn.cute.flash_attn_varlen_func`` or the import's error (PERFORMANCE.md says how to carry it)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as err:  # ImportError, or a CuTe DSL that fails to load
        return None, f"flash_attn.cute not importable ({type(err).__name__}: {str(err)[:120]})"
    return flash_attn_varlen_func, None


def _fa4_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    return _fa4()[1]


def fa4_varlen(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """FlashAttention-4 (CuTe DSL) varlen, cu_seqlens = unit bounds; GQA and causal native."""
    attend = _fa4()[0]
    scale = _scale(case)

    def forward():
        res = attend(inp.q, inp.k, inp.v, cu_seqlens_q=inp.bounds, cu_seqlens_k=inp.bounds,
                     max_seqlen_q=inp.max_unit, max_seqlen_k=inp.max_unit, softmax_scale=scale,
                     causal=case.causal)
        return res[0] if isinstance(res, tuple) else res  # (out, lse) in recent versions

    return Prepared(forward, _qkv(inp), inp.grad_out)


# ----------------------------------------------------------------------------- registry
def _attention(case: Case) -> bool:
    return case.layer is None


def _plain(case: Case) -> bool:
    return _attention(case) and case.rope_theta is None


def _block(case: Case) -> bool:
    return _plain(case) and case.block_size is not None


def _full(case: Case) -> bool:
    return _plain(case) and case.block_size is None


def _rotary(case: Case) -> bool:
    return _attention(case) and case.rope_theta is not None


def _rotary_block(case: Case) -> bool:
    return _rotary(case) and case.block_size is not None


BASELINES = [
    Method("fa2_varlen", "baseline", fa2_varlen, _plain,
           description="aten._flash_attention_forward/backward, cu_seqlens = unit bounds"),
    Method("sdpa_flash", "baseline", _sdpa_block_view(SDPBackend.FLASH_ATTENTION), _block, skip=_needs_aligned,
           description="SDPA FLASH_ATTENTION on the [n_blocks, H, block, D] view"),
    Method("sdpa_cudnn", "baseline", _sdpa_block_view(SDPBackend.CUDNN_ATTENTION), _block, skip=_needs_aligned,
           description="SDPA CUDNN_ATTENTION on the [n_blocks, H, block, D] view"),
    Method("sdpa_meff", "baseline", _sdpa_block_view(SDPBackend.EFFICIENT_ATTENTION), _block, skip=_needs_aligned,
           description="SDPA EFFICIENT_ATTENTION on the [n_blocks, H, block, D] view"),
    Method("rope_comp+cudnn", "baseline", _sdpa_block_view(SDPBackend.CUDNN_ATTENTION, rotary=True), _rotary_block,
           skip=_needs_aligned, description="rotary under torch.compile + SDPA CUDNN_ATTENTION on the block view"),
    Method("fa4_varlen", "baseline", fa4_varlen, _plain, skip=_fa4_skip,
           description="FlashAttention-4 flash_attn.cute.flash_attn_varlen_func, cu_seqlens = unit bounds"),
    Method("pad_flash", "baseline", _padded_sdpa(SDPBackend.FLASH_ATTENTION, masked=False), _full,
           skip=_both(_mha_only, _padded_fits),
           description="SDPA FLASH_ATTENTION on padded [B, H, max_len, D], no mask (speed bound)"),
    Method("pad_cudnn", "baseline", _padded_sdpa(SDPBackend.CUDNN_ATTENTION, masked=False), _full,
           skip=_both(_mha_only, _padded_fits),
           description="SDPA CUDNN_ATTENTION on padded [B, H, max_len, D], no mask (speed bound)"),
    Method("pad_meff_mask", "baseline", _padded_sdpa(SDPBackend.EFFICIENT_ATTENTION, masked=True), _full,
           skip=_both(_mha_only, _padded_fits),
           description="SDPA EFFICIENT_ATTENTION on padded [B, H, max_len, D], key-padding mask"),
    Method("nested_sdpa", "baseline", nested_sdpa, _plain, skip=_mha_only,
           description="SDPA on jagged nested tensors (offsets = unit bounds)"),
    Method("eager", "baseline", eager, _block, skip=_eager_fits, gpu_only=False,
           description="matmul + softmax on the padded block view"),
    Method("rope_eager+fa2", "baseline", _rotary_fa2(compiled=False), _rotary,
           description="rotary in eager PyTorch (float32) + FA2 varlen"),
    Method("rope_comp+fa2", "baseline", _rotary_fa2(compiled=True), _rotary,
           description="rotary under torch.compile + FA2 varlen"),
    Method("flex", "baseline", flex, _block, skip=_mha_only,
           description="compiled flex_attention, packed [1, H, T, D], block mask from a unit-id mask_mod"),
]
