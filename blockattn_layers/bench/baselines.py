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
    torch.nn.attention.varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
        return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, ...)  (torch 2.13:
        causal is window_size=(-1, 0))
    torch.nn.attention.flex_attention.flex_attention(..., block_mask=, scale=, enable_gqa=,
        kernel_options={"BACKEND": "AUTO" | "TRITON" | "FLASH" | "TRITON_DECODE"})  (torch 2.13)
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .common import Case, Inputs, Method, Prepared, RunConfig

_FRACTION_OF_FREE = 0.5  # a padded baseline runs only if its tensors fit in this share of free memory


# FA2's kernels put the batch (here: the attention units) on the grid's y dimension, at most
# 65,535; more units (blocks of 16 tokens at prod lengths: 66,9xx) fail with "invalid argument".
FA2_MAX_UNITS = 65535
# Elements of q one FA2 call is given at most: at the grid's lengths with 8 query heads of D256
# (q: 2.18e9 elements, over 2^31) FA2 varlen failed the bench's check (max relative error 0.63-0.85)
# where 4 heads of D256 and 8 of D128 (1.09e9) passed: a 32-bit element offset is the likely cause.
FA2_MAX_ELEMENTS = 2 ** 31 - 1


def unit_chunks(bounds: Tensor, max_units: int = FA2_MAX_UNITS,
                max_tokens: Optional[int] = None) -> Optional[List[Tuple[int, int, int, int]]]:
    """``(first unit, end unit, first token, end token)`` of consecutive runs of the host ``bounds``,
    each of at most ``max_units`` units and ``max_tokens`` tokens (a unit longer than that alone), or
    None where one call takes them all."""
    bounds = [int(b) for b in bounds]
    units = len(bounds) - 1
    if units <= max_units and (max_tokens is None or bounds[-1] - bounds[0] <= max_tokens):
        return None
    runs, first = [], 0
    for u in range(1, units + 1):
        full = u - first == max_units or (max_tokens is not None and u < units
                                          and bounds[u + 1] - bounds[first] > max_tokens)
        if full or u == units:
            runs.append((first, u, bounds[first], bounds[u]))
            first = u
    return runs


def fa2_chunks(case: Case) -> Optional[List[Tuple[int, int, int, int]]]:
    """``unit_chunks`` of a case's units within FA2's limits (units per call, elements of q)."""
    return unit_chunks(case.unit_bounds(), FA2_MAX_UNITS, FA2_MAX_ELEMENTS // (case.num_heads * case.head_dim))


def _fa2_forward(q, k, v, cu, max_len, scale, causal):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale)


def _fa2_backward(grad_out, q, k, v, out, lse, cu, max_len, causal, rng_state, unused, scale):
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, causal, rng_state, unused, scale=scale)


class FlashVarlen(torch.autograd.Function):
    """FA2 varlen (``torch.ops.aten._flash_attention_*``) with ``cu`` as both cu_seqlens; k, v may
    have fewer heads than q (GQA, native in FA2). ``chunks`` (:func:`fa2_chunks`): one FA2 call per
    run of units, as a user past FA2's unit or element limits would make them, the outputs and
    gradients concatenated (one more copy of each)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float,
                causal: bool = False, chunks: Optional[List[Tuple[int, int, int, int]]] = None) -> Tensor:
        parts = chunks or [(0, len(cu) - 1, 0, q.shape[0])]
        outs, saved = [], []
        for u0, u1, t0, t1 in parts:
            part_cu = cu if chunks is None else cu[u0:u1 + 1] - cu[u0]
            out, lse, rng_state, unused, _ = _fa2_forward(q[t0:t1], k[t0:t1], v[t0:t1], part_cu, max_len, scale, causal)
            outs.append(out)
            saved += [part_cu, lse, rng_state, unused]
        out = outs[0] if chunks is None else torch.cat(outs)
        ctx.save_for_backward(q, k, v, out, *saved)
        ctx.parts, ctx.max_len, ctx.scale, ctx.causal = parts, max_len, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, *saved = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grads = []
        for i, (u0, u1, t0, t1) in enumerate(ctx.parts):
            part_cu, lse, rng_state, unused = saved[4 * i:4 * i + 4]
            grads.append(_fa2_backward(grad_out[t0:t1], q[t0:t1], k[t0:t1], v[t0:t1], out[t0:t1], lse, part_cu,
                                       ctx.max_len, ctx.causal, rng_state, unused, ctx.scale))
        dq, dk, dv = grads[0] if len(grads) == 1 else (torch.cat(g) for g in zip(*grads))
        return dq, dk, dv, None, None, None, None, None


def _scale(case: Case) -> float:
    return case.head_dim ** -0.5


def _qkv(inp: Inputs):
    return inp.q, inp.k, inp.v


# ----------------------------------------------------------------------------- FA2 varlen
def fa2_varlen(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    scale = _scale(case)
    chunks = fa2_chunks(case)

    def forward():
        return FlashVarlen.apply(inp.q, inp.k, inp.v, inp.bounds, inp.max_unit, scale, case.causal, chunks)

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


# ----------------------------------------------------------------------------- FlexAttention, mask from the units
FLEX_TILE = 128  # Flex's default sparse block (tile) size, rows and columns


def _row_ranges(lo: Tensor, hi: Tensor, flo: Tensor, fhi: Tensor):
    """Per row: the partial tiles ``[lo, hi]`` minus the full range ``[flo, fhi]`` (a sub-range of it,
    empty when ``flo > fhi``), as two ranges ``(start, count)``, and the full range ``(start, count)``."""
    has_full = flo <= fhi
    full_count = torch.where(has_full, fhi - flo + 1, 0)
    end1 = torch.where(has_full, flo - 1, hi)
    count1 = (end1 - lo + 1).clamp(min=0)
    start2 = fhi + 1
    count2 = torch.where(has_full, hi - fhi, 0).clamp(min=0)
    return ((lo, count1), (start2, count2)), ((flo, full_count),)


def _ranges_to_blocks(ranges, n_tiles: int, compact: bool):
    """``(num_blocks [1, 1, n], indices [1, 1, n, width])`` int32 from per-row ascending ranges.

    ``width`` is ``n`` (Flex's own layout, which its CPU kernel and ``BlockMask.to_dense`` assume)
    or, ``compact``, the longest row rounded up to a power of two (fewer distinct shapes, so fewer
    recompiles), at most ``n``. Entries past a row's count are 0 (the kernels do not read them).
    """
    n = ranges[0][0].numel()
    count = sum(c for _, c in ranges)
    longest = int(count.max()) if n else 0
    width = max(n_tiles, 1)
    if compact:
        width = min(width, 1 << max(longest - 1, 0).bit_length())
    slot = torch.arange(width)[None, :]
    idx = torch.zeros(n, width, dtype=torch.int64)
    before = torch.zeros(n, 1, dtype=torch.int64)
    for start, c in ranges:  # two ranges at most: a loop over ranges, not tiles
        inside = (slot >= before) & (slot < before + c[:, None])
        idx = torch.where(inside, start[:, None] + slot - before, idx)
        before = before + c[:, None]
    return count.to(torch.int32).view(1, 1, n), idx.to(torch.int32).view(1, 1, n, width).contiguous()


def unit_tile_blocks(bounds: Tensor, total: int, causal: bool, kv_side: bool = True,
                     tile: int = FLEX_TILE, compact: bool = True):
    """The tile lists of a block-diagonal (per-unit) mask, from the unit boundaries alone.

    ``bounds``: host int64 unit starts and the end (``Case.unit_bounds()``). Row tile ``i`` (query
    tile when ``kv_side``, else key tile) lists every column tile holding a pair ``unit[q] ==
    unit[kv]`` (and ``q >= kv`` when ``causal``) with it; of those, the tiles whose whole
    ``tile x tile`` square lies in one unit (strictly below the diagonal when causal) are full,
    the rest partial (they touch a unit boundary, the end included, or the diagonal). Units are
    contiguous, so each row's tiles are one range ``[lo, hi]`` and its full tiles a sub-range:
    all of it is computed per tile with vectorized ops, in ``O(n_tiles * width)`` memory.

    Returns ``(num_blocks, indices, full_num_blocks, full_indices)``: int32 ``[1, 1, n]`` and
    ``[1, 1, n, width]`` on the host.
    """
    bounds = bounds.to(torch.int64)
    n = -(-total // tile)
    row = torch.arange(n, dtype=torch.int64)
    first = row * tile
    last = torch.clamp(first + tile - 1, max=max(total - 1, 0))
    u_first = torch.searchsorted(bounds, first, right=True) - 1  # unit of the tile's first row
    u_last = torch.searchsorted(bounds, last, right=True) - 1  # ... and of its last row
    lo = bounds[u_first] // tile  # first tile of the first unit
    hi = (bounds[u_last + 1] - 1) // tile  # last tile of the last unit
    # A tile wholly inside its unit shares full squares with the tiles wholly inside that unit.
    contained = (u_first == u_last) & (first + tile <= bounds[u_first + 1])
    flo = torch.where(contained, (bounds[u_first] + tile - 1) // tile, 1)
    fhi = torch.where(contained, bounds[u_first + 1] // tile - 1, 0)
    if causal:
        if kv_side:  # query tile i: key tiles up to i, full ones below it
            hi, fhi = torch.minimum(hi, row), torch.minimum(fhi, row - 1)
        else:  # key tile j: query tiles from j, full ones after it
            lo, flo = torch.maximum(lo, row), torch.maximum(flo, row + 1)
    partial, full = _row_ranges(lo, hi, flo, fhi)
    return _ranges_to_blocks(partial, n, compact) + _ranges_to_blocks(full, n, compact)


def unit_ids(bounds: Tensor, total: int) -> Tensor:
    """int32 ``[T]``: each token's unit (units from ``bounds`` as in :func:`unit_tile_blocks`)."""
    bounds = bounds.to(torch.int64)
    return (torch.searchsorted(bounds, torch.arange(total), right=True) - 1).to(torch.int32)


def unit_block_mask(bounds: Tensor, total: int, causal: bool, device, compact: bool = True):
    """Flex ``BlockMask`` of attention inside each unit (causal: ``q >= kv`` too), built from the
    unit boundaries with ``BlockMask.from_kv_blocks``: no ``T x T`` evaluation anywhere.

    ``from_kv_blocks`` would find the query-side lists (the backward's) by transposing a dense
    ``n x n`` tile matrix; here they come from the same range arithmetic and are set on the mask.
    """
    from torch.nn.attention.flex_attention import BlockMask

    unit = unit_ids(bounds, total).to(device)

    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return (unit[q_idx] == unit[kv_idx]) & (q_idx >= kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return unit[q_idx] == unit[kv_idx]

    kv = [x.to(device) for x in unit_tile_blocks(bounds, total, causal, kv_side=True, compact=compact)]
    # Without causal masking the tile pattern is symmetric: the query side is the key side.
    q = kv if not causal else [x.to(device) for x in unit_tile_blocks(bounds, total, causal, False, compact=compact)]
    mask = BlockMask.from_kv_blocks(*kv, BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod, seq_lengths=(total, total),
                                    compute_q_blocks=False)
    mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices = q
    return mask


def _flex_backends() -> tuple:
    try:
        import typing

        from torch.nn.attention import flex_attention as fa

        return typing.get_args(fa._Backend)
    except Exception:  # an older torch: no BACKEND option
        return ()


def _flex_blocks_skip(backend: str):
    def skip(case: Case, cfg: RunConfig) -> Optional[str]:
        if backend not in _flex_backends():
            return f"flex_attention kernel_options BACKEND={backend!r} not an option in torch {torch.__version__}"
        if case.total == 0:
            return "no tokens"
        if backend == "FLASH":
            if cfg.dtype not in (torch.float16, torch.bfloat16):
                return "BACKEND='FLASH' (FlashAttention-4 CuTe kernels) takes fp16 / bf16 only"
            try:
                import importlib.util

                found = importlib.util.find_spec("flash_attn.cute") is not None
            except Exception:  # a broken parent package
                found = False
            if not found:
                return "BACKEND='FLASH' needs flash_attn.cute (FlashAttention-4), not importable"
        return None

    return skip


def _flex_blocks(backend: str):
    """Compiled flex_attention on the packed ``[1, H, T, D]`` sequence, GQA through ``enable_gqa``,
    the block mask from the unit boundaries (:func:`unit_block_mask`), ``BACKEND`` forced."""

    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        T, device = case.total, inp.q.device
        # Flex's CPU kernel reads the index lists at their full width; the GPU kernels take them compact.
        block_mask = unit_block_mask(case.unit_bounds(), T, case.causal, device, compact=device.type == "cuda")
        attend = _compiled_flex()
        extra = dict(enable_gqa=True) if case.kv_heads != case.num_heads else {}
        options = {"BACKEND": backend}

        def packed(x: Tensor) -> Tensor:
            return x.transpose(0, 1).unsqueeze(0)

        def forward():
            o = attend(packed(inp.q), packed(inp.k), packed(inp.v), block_mask=block_mask, scale=_scale(case),
                       kernel_options=options, **extra)
            return o.squeeze(0).transpose(0, 1)

        return Prepared(forward, _qkv(inp), inp.grad_out)

    return setup


# ----------------------------------------------------------------------------- torch varlen_attn
@functools.lru_cache(maxsize=None)
def _varlen():
    """``torch.nn.attention.varlen.varlen_attn`` and its keyword names, or the import's error."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except Exception as err:
        return None, (), f"torch.nn.attention.varlen not importable ({type(err).__name__}: {str(err)[:120]})"
    return varlen_attn, tuple(inspect.signature(varlen_attn).parameters), None


def _varlen_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    attend, params, error = _varlen()
    if error:
        return error
    if cfg.device.type != "cuda":
        return "varlen_attn runs FlashAttention (or cuDNN) kernels: CUDA only"
    if cfg.dtype not in (torch.float16, torch.bfloat16):
        return "varlen_attn (FlashAttention kernels) takes fp16 / bf16 only"
    if case.kv_heads != case.num_heads and "enable_gqa" not in params:
        return f"varlen_attn in torch {torch.__version__} has no enable_gqa"
    if case.causal and not ({"is_causal", "window_size"} & set(params)):
        return f"varlen_attn in torch {torch.__version__} has no causal option"
    return None


def varlen(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """torch.nn.attention.varlen.varlen_attn, cu_seqlens = unit bounds, causal as the case says."""
    attend, params, _ = _varlen()
    extra = {}
    if case.kv_heads != case.num_heads:
        extra["enable_gqa"] = True
    if case.causal:  # torch 2.13: causal is window_size (-1, 0) (a tuple: it is compared to one)
        if "is_causal" in params:
            extra["is_causal"] = True
        else:
            extra["window_size"] = (-1, 0)
    scale = _scale(case)

    def forward():
        return attend(inp.q, inp.k, inp.v, inp.bounds, inp.bounds, inp.max_unit, inp.max_unit, scale=scale, **extra)

    return Prepared(forward, _qkv(inp), inp.grad_out)


# ----------------------------------------------------------------------------- eager
def eager(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
    """matmul + softmax on the padded ``[n_blocks, H, block, D]`` view (a gather unless aligned)."""
    H, D, bs = case.num_heads, case.head_dim, case.block_size
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
        chunks = fa2_chunks(case)

        def forward():
            q, k = rotate(inp.q, inp.k)
            return FlashVarlen.apply(q, k, inp.v, inp.bounds, inp.max_unit, scale, case.causal, chunks)

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
           description="aten._flash_attention_forward/backward, cu_seqlens = unit bounds (one call per 65,535 "
                       "units and under 2^31 elements of q)"),
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
    Method("flex_blocks_triton", "baseline", _flex_blocks("TRITON"), _plain, skip=_flex_blocks_skip("TRITON"),
           description="compiled flex_attention BACKEND=TRITON, packed [1, H, T, D], BlockMask from the unit "
                       "bounds (from_kv_blocks, 128-tiles, no T x T mask)",
           opt_in="on the H200 (torch 2.11) at seed3 its kernels left the CUDA context broken "
                  "(cudaErrorInvalidAddressSpace), ending the run for every method after it"),
    Method("flex_blocks_flash", "baseline", _flex_blocks("FLASH"), _plain, skip=_flex_blocks_skip("FLASH"),
           description="compiled flex_attention BACKEND=FLASH (FA4 CuTe), packed [1, H, T, D], BlockMask from the "
                       "unit bounds (from_kv_blocks, 128-tiles, no T x T mask)"),
    Method("varlen_attn", "baseline", varlen, _plain, skip=_varlen_skip,
           description="torch.nn.attention.varlen.varlen_attn, cu_seqlens = unit bounds"),
]
