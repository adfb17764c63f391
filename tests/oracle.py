"""An independent float64 oracle for block-diagonal attention over jagged sequences.

Written from DESIGN.md only, as plain Python loops over sequences, blocks and heads; it
shares no code with ``blockattn_layers`` (do not import the package here). It is built
from differentiable torch ops, so tests get oracle gradients with ``torch.autograd.grad``.
Keep it to small sizes (T up to a few hundred, H <= 4, D <= 32): it is slow on purpose.
Inputs may live on any device (the loops run there; offsets are read to the host).

Import it from any test as ``from tests.oracle import oracle_attention, make_jagged, rel_err``
(``tests/`` is a package; see ``tests/conftest.py``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["oracle_attention", "oracle_rotate", "make_jagged", "rel_err", "offsets_from_lengths", "clean_and_poisoned"]


def offsets_from_lengths(lengths: Sequence[int], dtype: torch.dtype = torch.int64, device="cpu") -> Tensor:
    """``[B+1]`` offsets ``[0, l0, l0+l1, ...]`` of the given sequence lengths."""
    out = [0]
    for n in lengths:
        if n < 0:
            raise ValueError(f"negative length {n}")
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=dtype, device=device)


def _positions(offs, total: int, positions: Optional[Tensor]):
    """Python list of float positions: the given ones, or each token's index inside its sequence."""
    if positions is not None:
        return [float(p) for p in positions.detach().to("cpu", torch.float64).tolist()]
    pos = [0.0] * total
    for b in range(len(offs) - 1):
        for t in range(offs[b], offs[b + 1]):
            pos[t] = float(t - offs[b])
    return pos


def oracle_rotate(x: Tensor, pos, rope_theta: float, rotary_dim: int, interleaved: bool,
                  compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x [T, h, D]`` at positions ``pos`` (list of T floats).

    Pair ``i < rotary_dim/2`` is ``(x[i], x[i + rotary_dim/2])`` or, interleaved,
    ``(x[2i], x[2i+1])``; it turns by ``pos * rope_theta ** (-2 i / rotary_dim)`` (angles in float64):
    ``(a, b) -> (a cos - b sin, a sin + b cos)``. Other channels pass through.
    """
    T, _, D = x.shape
    half = rotary_dim // 2
    cols = [x[:, :, c] for c in range(D)]
    new = list(cols)
    for i in range(half):
        inv_freq = float(rope_theta) ** (-2.0 * i / rotary_dim)
        ang = torch.tensor([p * inv_freq for p in pos], dtype=torch.float64)
        cos = torch.cos(ang).to(device=x.device, dtype=compute_dtype)[:, None]
        sin = torch.sin(ang).to(device=x.device, dtype=compute_dtype)[:, None]
        ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        a, b = cols[ia], cols[ib]
        new[ia] = a * cos - b * sin
        new[ib] = a * sin + b * cos
    return torch.stack(new, dim=-1)


def oracle_attention(
    q: Tensor, k: Tensor, v: Tensor, offsets, block_size: Optional[int], *,
    scale: Optional[float] = None, causal: bool = False, rope_theta: Optional[float] = None,
    positions: Optional[Tensor] = None, rotary_dim: Optional[int] = None,
    rotary_interleaved: bool = False, compute_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Block-diagonal attention ``[T, H, D]`` computed naively in ``compute_dtype`` (default float64).

    Every sequence ``offsets[b]:offsets[b+1]`` is cut into blocks of ``block_size`` tokens (the
    last one may be short; ``None``: the whole sequence is one block); each token attends to the
    tokens of its block (causal: to those at or before it). GQA: query head ``h`` uses kv head
    ``h // (H // H_kv)``. Rotary (when ``rope_theta`` is set) rotates q and k, never v; the
    default positions are each token's index inside its sequence (not inside its block).

    ``compute_dtype`` other than float64 gives the naive same-dtype torch computation, which
    tests use as the yardstick for half-precision error.
    """
    offs = [int(o) for o in (offsets.tolist() if isinstance(offsets, Tensor) else offsets)]
    T, H, D = q.shape
    h_kv = k.shape[1]
    assert H % h_kv == 0 and offs[0] == 0 and offs[-1] == T
    group = H // h_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    if rope_theta is not None:
        rd = D if rotary_dim is None else rotary_dim
        pos = _positions(offs, T, positions)
        q = oracle_rotate(q, pos, rope_theta, rd, rotary_interleaved, compute_dtype)
        k = oracle_rotate(k, pos, rope_theta, rd, rotary_interleaved, compute_dtype)

    pieces = []
    for b in range(len(offs) - 1):
        start, end = offs[b], offs[b + 1]
        step = (end - start) if block_size is None else block_size
        lo = start
        while lo < end:
            hi = min(lo + step, end)
            n = hi - lo
            heads = []
            for h in range(H):
                qb = q[lo:hi, h, :]
                kb = k[lo:hi, h // group, :]
                vb = v[lo:hi, h // group, :]
                s = (qb @ kb.transpose(0, 1)) * scale
                if causal:
                    allowed = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
                    s = s.masked_fill(~allowed, float("-inf"))
                p = torch.softmax(s, dim=-1)
                heads.append(p @ vb)
            pieces.append(torch.stack(heads, dim=1))  # [n, H, D]
            lo = hi
    if not pieces:  # T == 0: an empty result that still belongs to the autograd graph
        return torch.zeros(0, H, D, dtype=compute_dtype, device=q.device) + (q.sum() + k.sum() + v.sum()) * 0
    return torch.cat(pieces, dim=0)


def make_jagged(
    lengths: Sequence[int], H: int, H_kv: int, D: int, dtype: torch.dtype = torch.float64,
    seed: int = 0, *, offsets_dtype: torch.dtype = torch.int64, device="cpu",
    requires_grad: bool = False, std: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random ``q [T,H,D]``, ``k, v [T,H_kv,D]`` and ``offsets [B+1]`` for the given lengths.

    Values are drawn in float64 from a generator seeded with ``seed`` and then cast, so the
    same seed gives the same (rounded) values in every dtype.
    """
    g = torch.Generator().manual_seed(seed)
    T = sum(int(n) for n in lengths)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64) * std
    k = torch.randn(T, H_kv, D, generator=g, dtype=torch.float64) * std
    v = torch.randn(T, H_kv, D, generator=g, dtype=torch.float64)
    q, k, v = (x.to(device=device, dtype=dtype).requires_grad_(requires_grad) for x in (q, k, v))
    return q, k, v, offsets_from_lengths(lengths, offsets_dtype, device)


def rel_err(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (the absolute error when ``b`` is zero)."""
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    num = torch.linalg.vector_norm(a - b).item()
    den = torch.linalg.vector_norm(b).item()
    return num / den if den > 0 else num


def rotary_positions(kind, total: int):
    """``(positions, tolerance)`` for rotary tests: ``None`` (index in the sequence, default
    tolerance), ``"int"`` or ``"float"`` positions in the thousands, where float32 angles carry
    ~1e-4 relative error and the tolerance is 2e-3."""
    if kind == "int":
        return torch.randint(0, 5000, (total,), generator=torch.Generator().manual_seed(3)), 2e-3
    if kind == "float":
        return torch.rand(total, generator=torch.Generator().manual_seed(4)) * 3000 + 0.25, 2e-3
    return None, None


def clean_and_poisoned(attention, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, token: int):
    """``((out, dq, dk, dv) clean, (out, dq, dk, dv) poisoned)``: ``attention(q, k, v)`` and its
    gradients for ``grad_out``, once on the inputs as given and once with row ``token`` of q, k, v
    and ``grad_out`` set to NaN (for tests that a NaN stays in its attention unit)."""

    def run(poison: bool):
        xs = [x.clone() for x in (q, k, v, grad_out)]
        if poison:
            for x in xs:
                x[token] = float("nan")
        leaves = [x.requires_grad_() for x in xs[:3]]
        out = attention(*leaves)
        return (out, *torch.autograd.grad(out, leaves, xs[3]))

    return run(False), run(True)


@contextlib.contextmanager
def tf32_products():
    """``torch.backends.cuda.matmul.allow_tf32 = True`` inside the block, the previous value after
    (pytest's monkeypatch cannot set it: it is no plain attribute)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
