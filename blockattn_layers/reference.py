"""Pure-PyTorch block attention over jagged sequences: the CPU fallback and the test oracle's peer.

Core torch only (no triton, no fbgemm), so it runs on any device. Blocks are gathered from
``offsets`` with index math into a padded ``[n_blocks, H, tile, D]`` layout (ragged last
blocks masked) and processed in chunks whose score tensors stay under
``SCORE_BUDGET`` elements however large T is. Forward and backward are written out
explicitly (the backward recomputes each chunk's probabilities, as the kernels do), so the
memory bound holds for training too.

Half-precision inputs are computed in float32, float64 inputs in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

# Elements of one chunk's score tensor [n_blocks, H, tile, tile]; 2**24 float32 = 64 MiB.
SCORE_BUDGET = 1 << 24

# Full attention pads each sequence up to the next step of this geometric ladder of tile
# lengths and groups sequences of equal tile, so padding wastes at most ~25% per row.
_LADDER_RATIO = 1.25


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- positions, rotary
def sequence_ids(offsets: Tensor, total: int) -> Tensor:
    """Index of every token's sequence, ``[T]`` int64 (no host sync; empty sequences skipped)."""
    tokens = torch.arange(total, device=offsets.device)
    return torch.searchsorted(offsets.to(torch.int64), tokens, right=True) - 1


def sequence_positions(offsets: Tensor, total: int) -> Tensor:
    """Index of every token inside its own sequence, ``[T]`` int64 (no host sync)."""
    offsets = offsets.to(torch.int64)
    return torch.arange(total, device=offsets.device) - offsets[sequence_ids(offsets, total)]


def rotary_angles(positions: Tensor, rope_theta: float, rotary_dim: int, dtype: torch.dtype) -> Tensor:
    """``[T, rotary_dim/2]`` angles ``position * rope_theta ** (-2 i / rotary_dim)``.

    Computed in float32 (float64 when ``dtype`` is float64), as the kernels do.
    """
    i = torch.arange(rotary_dim // 2, device=positions.device, dtype=torch.float64)
    inv_freq = (rope_theta ** (-2.0 * i / rotary_dim)).to(dtype)
    return positions.to(dtype)[:, None] * inv_freq[None, :]


def apply_rotary(x: Tensor, angles: Tensor, rotary_dim: int, interleaved: bool, inverse: bool = False) -> Tensor:
    """Rotate pairs of the first ``rotary_dim`` channels of ``x [T, H, D]`` by ``angles [T, rotary_dim/2]``.

    Pairs are ``(x[i], x[i + rotary_dim/2])`` or, interleaved, ``(x[2i], x[2i+1])``;
    ``(a, b) -> (a cos - b sin, a sin + b cos)``. ``inverse`` rotates by ``-angle``
    (the transpose, used for gradients). Channels past ``rotary_dim`` pass unchanged.
    """
    cos = angles.cos()[:, None, :].to(x.dtype)
    sin = angles.sin()[:, None, :].to(x.dtype)
    if inverse:
        sin = -sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((out, rest), dim=-1)


def paired_chunks(x: Tensor, chunk: int, rotary_dim: Optional[int] = None) -> Tensor:
    """``x [..., D]``'s channels in the paired-chunk order of split-halves rotary pairs over its first ``rotary_dim``
    channels (default: all): the first half's and the second half's chunks of ``chunk`` channels alternating,
    ``[a_0, b_0, a_1, b_1, ...]``, so that each pair ``(i, i + rotary_dim / 2)`` lies inside ``2 * chunk`` adjacent
    channels, the channels past ``rotary_dim`` after them in their order (a copy; ``chunk`` 0: ``x`` itself).
    Attention scores are the same on q and k in this order; their gradients come in it too
    (:func:`unpaired_chunks`)."""
    if not chunk:
        return x
    rot = x.shape[-1] if rotary_dim is None else rotary_dim
    halves = x[..., :rot].unflatten(-1, (2, rot // (2 * chunk), chunk))
    return torch.cat([halves.transpose(-3, -2).flatten(-3), x[..., rot:]], dim=-1)


def unpaired_chunks(x: Tensor, chunk: int, rotary_dim: Optional[int] = None) -> Tensor:
    """The inverse of :func:`paired_chunks`: ``x``'s channels back in their order (a copy; ``chunk`` 0: ``x``)."""
    if not chunk:
        return x
    rot = x.shape[-1] if rotary_dim is None else rotary_dim
    pairs = x[..., :rot].unflatten(-1, (rot // (2 * chunk), 2, chunk))
    return torch.cat([pairs.transpose(-3, -2).flatten(-3), x[..., rot:]], dim=-1)


# ----------------------------------------------------------------------------- block groups
@dataclass
class BlockGroup:
    """Blocks that share one padded tile length: start token and length of each block."""

    starts: Tensor  # [n] int64
    lengths: Tensor  # [n] int64
    tile: int


def _host_offsets(offsets: Tensor, cpu_offsets: Optional[Tensor]) -> Optional[Tensor]:
    """The offsets to group blocks from on the host: ``offsets`` themselves on the CPU (a ``cpu_offsets``
    hint is only ever a copy of them), else the hint."""
    if offsets.device.type == "cpu":
        return offsets.to(torch.int64)
    if cpu_offsets is not None:
        return cpu_offsets.to(torch.int64)
    return None


def _blocks_host(host: Tensor, block_size: int, device: torch.device) -> List[BlockGroup]:
    lengths = host[1:] - host[:-1]
    n_blocks = (lengths + block_size - 1) // block_size
    total = int(n_blocks.sum())
    if total == 0:
        return []
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), n_blocks)
    first = torch.cumsum(n_blocks, 0) - n_blocks
    j = torch.arange(total) - first[seq]
    starts = host[:-1][seq] + j * block_size
    lens = torch.clamp(host[1:][seq] - starts, max=block_size)
    tile = int(lens.max())
    return [BlockGroup(starts.to(device), lens.to(device), tile)]


def _blocks_device(offsets: Tensor, total_tokens: int, block_size: int) -> List[BlockGroup]:
    """Sync-free grouping: an upper bound on the number of blocks, extra blocks get length 0."""
    offsets = offsets.to(torch.int64)
    num_seqs = offsets.numel() - 1
    bound = min(total_tokens, -(-total_tokens // block_size) + num_seqs)
    if bound == 0:
        return []
    lengths = offsets[1:] - offsets[:-1]
    n_blocks = (lengths + block_size - 1) // block_size
    cum = torch.cumsum(n_blocks, 0)
    b = torch.arange(bound, device=offsets.device)
    seq = torch.clamp(torch.searchsorted(cum, b, right=True), max=num_seqs - 1)
    j = b - (cum[seq] - n_blocks[seq])
    starts = offsets[seq] + j * block_size
    lens = torch.clamp(offsets[seq + 1] - starts, min=0, max=block_size)
    lens = torch.where(b < cum[-1], lens, torch.zeros_like(lens))
    starts = torch.clamp(starts, max=max(total_tokens - 1, 0))
    # No block is longer than T: a block_size far above T must not size the tile.
    return [BlockGroup(starts, lens, min(block_size, total_tokens))]


def _ladder(longest: int) -> Tensor:
    """Tile lengths 16, 32, ... growing by ``_LADDER_RATIO``, up to the first >= ``longest``."""
    tiles = [16]
    while tiles[-1] < longest:
        tiles.append(max(tiles[-1] + 16, int(tiles[-1] * _LADDER_RATIO) // 16 * 16))
    return torch.tensor(tiles)


def _sequences_host(host: Tensor, device: torch.device) -> List[BlockGroup]:
    lengths = host[1:] - host[:-1]
    keep = torch.nonzero(lengths > 0).flatten()
    if keep.numel() == 0:
        return []
    tiles = _ladder(int(lengths.max()))
    bucket = torch.bucketize(lengths[keep], tiles)
    groups = []
    for i, tile in enumerate(tiles.tolist()):
        members = keep[bucket == i]
        if members.numel():
            groups.append(BlockGroup(host[:-1][members].to(device), lengths[members].to(device), tile))
    return groups


def group_blocks(
    offsets: Tensor, total_tokens: int, block_size: Optional[int],
    cpu_offsets: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
) -> List[BlockGroup]:
    """Cut the jagged batch into groups of equally padded blocks.

    With host offsets (CPU tensors, or ``cpu_offsets``) the grouping is exact. Without them,
    block attention uses a sync-free upper bound; full attention pads every sequence to
    ``max_seqlen`` if given, and otherwise reads the offsets to the host once (the only
    case in which this path synchronizes; GPU batches normally take the Triton backend).
    """
    host = _host_offsets(offsets, cpu_offsets)
    if block_size is not None:
        if host is not None:
            return _blocks_host(host, block_size, offsets.device)
        return _blocks_device(offsets, total_tokens, block_size)
    if host is None and max_seqlen is not None:
        if max_seqlen == 0 or total_tokens == 0:
            return []
        o = offsets.to(torch.int64)
        return [BlockGroup(torch.clamp(o[:-1], max=total_tokens - 1), o[1:] - o[:-1], min(max_seqlen, total_tokens))]
    if host is None:
        host = offsets.to("cpu", torch.int64)
    return _sequences_host(host, offsets.device)


def iter_chunks(groups: List[BlockGroup], num_heads: int) -> Iterator[Tuple[Tensor, Tensor, int]]:
    """Yield ``(starts, lengths, tile)`` chunks whose score tensors fit ``SCORE_BUDGET``."""
    for g in groups:
        per_chunk = max(1, SCORE_BUDGET // (num_heads * g.tile * g.tile))
        n = g.starts.numel()
        for lo in range(0, n, per_chunk):
            yield g.starts[lo:lo + per_chunk], g.lengths[lo:lo + per_chunk], g.tile


# ----------------------------------------------------------------------------- chunk math
@dataclass
class _Chunk:
    index: Tensor  # [n * tile] gather index into the token dimension
    dest: Tensor  # [n * tile] scatter index; padded slots point at the dummy row T
    valid: Tensor  # [n, tile] bool
    n: int
    tile: int


def _chunk(starts: Tensor, lengths: Tensor, tile: int, total: int) -> _Chunk:
    slot = torch.arange(tile, device=starts.device)
    valid = slot[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + slot[None, :], starts[:, None].clamp(max=total - 1))
    dest = torch.where(valid, index, torch.full_like(index, total))
    return _Chunk(index.flatten(), dest.flatten(), valid, starts.numel(), tile)


def _gather(x: Tensor, c: _Chunk, groups: int) -> Tensor:
    """``x [T, h, D]`` -> ``[n, h * groups, tile, D]`` (kv heads repeated for GQA)."""
    g = x.index_select(0, c.index).view(c.n, c.tile, x.shape[1], x.shape[2]).transpose(1, 2)
    return g.repeat_interleave(groups, dim=1) if groups > 1 else g


def _scatter_add(buf: Tensor, x: Tensor, c: _Chunk, groups: int) -> None:
    """Add ``x [n, heads, tile, D]`` into ``buf [T + 1, heads / groups, D]``, summing GQA groups."""
    n, heads, tile, head_dim = x.shape
    if groups > 1:
        x = x.view(n, heads // groups, groups, tile, head_dim).sum(2)
    buf.index_add_(0, c.dest, x.transpose(1, 2).reshape(n * tile, heads // groups, head_dim))


def _scores(qc: Tensor, kc: Tensor, c: _Chunk, scale: float, causal: bool) -> Tensor:
    """Scaled scores ``[n, H, tile, tile]``, keys outside the block (or after the query) masked."""
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    mask = c.valid[:, None, None, :]
    if causal:
        mask = mask & torch.ones(c.tile, c.tile, dtype=torch.bool, device=s.device).tril()
    # finfo.min rather than -inf: a block of length 0 (sync-free groupings) gives a uniform row, not NaN.
    return s.masked_fill(~mask, torch.finfo(s.dtype).min)


def _probs(qc: Tensor, kc: Tensor, c: _Chunk, scale: float, causal: bool) -> Tensor:
    return torch.softmax(_scores(qc, kc, c, scale, causal), dim=-1)


def _rotated_inputs(q, k, offsets, rope_theta, positions, rotary_dim, interleaved, dtype):
    q, k = q.to(dtype), k.to(dtype)
    if rope_theta is None:
        return q, k, None
    pos = positions if positions is not None else sequence_positions(offsets, q.shape[0])
    angles = rotary_angles(pos, rope_theta, rotary_dim, dtype)
    return apply_rotary(q, angles, rotary_dim, interleaved), apply_rotary(k, angles, rotary_dim, interleaved), angles


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: Optional[int], scale: float,
    causal: bool, rope_theta: Optional[float] = None, positions: Optional[Tensor] = None,
    rotary_dim: int = 0, rotary_interleaved: bool = False, cpu_offsets: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None, dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Block (or full, ``block_size=None``) attention ``[T, H, D]``; see ``block_attention``.

    ``dtype`` overrides the compute dtype (tests use the input dtype to measure the error of
    a same-precision computation).
    """
    return _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
                    rotary_interleaved, cpu_offsets, max_seqlen, dtype, False)[0]


def attention_forward_lse(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: Optional[int], scale: float,
    causal: bool, rope_theta: Optional[float] = None, positions: Optional[Tensor] = None,
    rotary_dim: int = 0, rotary_interleaved: bool = False, cpu_offsets: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`attention_forward` and ``lse [H, T]`` float32, the natural-log logsumexp of each
    query row's scaled scores over the keys it attends to (what multi-tile kernels save)."""
    return _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
                    rotary_interleaved, cpu_offsets, max_seqlen, None, True)


def _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
             cpu_offsets, max_seqlen, dtype, with_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    total, num_heads, head_dim = q.shape
    dtype = dtype or compute_dtype(q.dtype)
    groups = num_heads // k.shape[1]
    qr, kr, _ = _rotated_inputs(q, k, offsets, rope_theta, positions, rotary_dim, rotary_interleaved, dtype)
    vr = v.to(dtype)
    out = torch.zeros(total + 1, num_heads, head_dim, dtype=dtype, device=q.device)
    lse = torch.zeros(total + 1, num_heads, dtype=torch.float32, device=q.device) if with_lse else None
    block_groups = group_blocks(offsets, total, block_size, cpu_offsets, max_seqlen)
    for starts, lengths, tile in iter_chunks(block_groups, num_heads):
        c = _chunk(starts, lengths, tile, total)
        s = _scores(_gather(qr, c, 1), _gather(kr, c, groups), c, scale, causal)
        o = torch.matmul(torch.softmax(s, dim=-1), _gather(vr, c, groups))  # [n, H, tile, D]
        out.index_copy_(0, c.dest, o.transpose(1, 2).reshape(c.n * tile, num_heads, head_dim))
        if lse is not None:
            lse.index_copy_(0, c.dest, torch.logsumexp(s, -1).transpose(1, 2).reshape(c.n * tile, num_heads).float())
    out = out[:total].to(q.dtype)
    return out, None if lse is None else lse[:total].t().contiguous()


def attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: Optional[int],
    scale: float, causal: bool, rope_theta: Optional[float] = None, positions: Optional[Tensor] = None,
    rotary_dim: int = 0, rotary_interleaved: bool = False, cpu_offsets: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None, dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention_forward`, recomputing each chunk's probabilities."""
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = num_heads // kv_heads
    dtype = dtype or compute_dtype(q.dtype)
    qr, kr, angles = _rotated_inputs(q, k, offsets, rope_theta, positions, rotary_dim, rotary_interleaved, dtype)
    vr, go = v.to(dtype), grad_out.to(dtype)
    dq = torch.zeros(total + 1, num_heads, head_dim, dtype=dtype, device=q.device)
    dk = torch.zeros(total + 1, kv_heads, head_dim, dtype=dtype, device=q.device)
    dv = torch.zeros_like(dk)
    block_groups = group_blocks(offsets, total, block_size, cpu_offsets, max_seqlen)
    for starts, lengths, tile in iter_chunks(block_groups, num_heads):
        c = _chunk(starts, lengths, tile, total)
        qc, kc, vc = _gather(qr, c, 1), _gather(kr, c, groups), _gather(vr, c, groups)
        p = _probs(qc, kc, c, scale, causal)
        doc = _gather(go, c, 1) * c.valid[:, None, :, None]  # padded query rows carry no gradient
        dvc = torch.matmul(p.transpose(-1, -2), doc)
        dp = torch.matmul(doc, vc.transpose(-1, -2))
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # rowsum(dP * P) == rowsum(dO * O)
        dqc = torch.matmul(ds, kc) * scale
        dkc = torch.matmul(ds.transpose(-1, -2), qc) * scale
        _scatter_add(dq, dqc, c, 1)
        _scatter_add(dk, dkc, c, groups)
        _scatter_add(dv, dvc, c, groups)
    dq, dk, dv = dq[:total], dk[:total], dv[:total]
    if angles is not None:
        dq = apply_rotary(dq, angles, rotary_dim, rotary_interleaved, inverse=True)
        dk = apply_rotary(dk, angles, rotary_dim, rotary_interleaved, inverse=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
