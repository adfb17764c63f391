"""Self-check at first use: kernel variants without a recorded hardware run on this GPU generation.

A variant declares the generations it was run and checked on (``Variant.verified_on``). Where
it runs on another one (today: the sm_100 kernels, which no GPU here could run), the first call
of each launch signature (dtype, head shape, block size, flags, direction: the launch plan's key)
also runs the verified Triton kernels (``simple``) on the same inputs and compares the results,
forward and, at the first backward, the gradients. A difference beyond the dtype's tolerance
disables the variant for the process, with one warning naming the signature and the error, and
the call returns the verified result; a signature that agrees is not checked again.

The comparison reads one number per output to the host: the only host syncs of the block
kernels, once per signature, and only for unverified variants. While a CUDA graph is being
captured (no sync allowed) an unchecked signature runs the verified kernels instead.
:func:`suspended` turns the check off (``verify_arch`` measures the variants themselves).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Dict, Hashable, Optional, Sequence

import torch

# Largest relative difference (max |a - b| / max |b|) between two kernels' outputs that is taken
# for rounding: the same math in another order, in the input dtype (bf16 has 8 bits of mantissa).
TOLERANCE: Dict[torch.dtype, float] = {torch.bfloat16: 4e-2, torch.float16: 8e-3, torch.float32: 2e-3}

_PASSED: set = set()  # (variant name, signature) pairs that agreed
_DISABLED: Dict[str, str] = {}  # variant name -> why
_SUSPENDED = [False]


def unverified(variant, major: Optional[int]) -> bool:
    """Whether ``variant`` has no recorded hardware run on GPU generation ``major`` (None: off
    the GPU, where nothing is recorded for the Gluon kernels)."""
    return variant.verified_on is not None and major not in variant.verified_on


def disabled(name: str) -> Optional[str]:
    """Why the variant ``name`` is disabled for this process, or None."""
    return _DISABLED.get(name)


def pending(variant, major: Optional[int], signature: Hashable) -> bool:
    """Whether this call must be checked against the verified kernels."""
    return (not _SUSPENDED[0] and unverified(variant, major) and (variant.name, signature) not in _PASSED)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host sync allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def agrees(variant, signature: Hashable, described: str, got: Sequence[torch.Tensor],
           want: Sequence[torch.Tensor], names: Sequence[str]) -> bool:
    """Compare ``got`` (the variant's outputs) with ``want`` (the verified kernels'); on a
    difference beyond the tolerance disable the variant with one warning and return False."""
    checked, stats = [], []
    for name, a, b in zip(names, got, want):
        if b.numel() == 0:
            continue
        a32, b32 = a.float(), b.float()
        error = (a32 - b32).abs().amax() / b32.abs().amax().clamp_min(1e-6)
        broken = torch.isfinite(b32).all() & ~torch.isfinite(a32).all()
        stats.append(torch.where(broken, torch.full_like(error, float("inf")), error))
        checked.append((name, TOLERANCE.get(b.dtype, 2e-3)))
    values = torch.stack(stats).tolist() if stats else []  # the one host sync
    errors = [f"{name}: max relative error {error:.3g} > {tolerance:g}"
              for (name, tolerance), error in zip(checked, values) if not error <= tolerance]
    if not errors:
        _PASSED.add((variant.name, signature))
        return True
    why = f"{described}: {'; '.join(errors)}"
    _DISABLED[variant.name] = why
    warnings.warn(f"block kernels: the {variant.name!r} variant disagrees with the verified Triton kernels at "
                  f"first use ({why}); it is disabled for this process and the verified result is returned",
                  RuntimeWarning, stacklevel=2)
    return False


def describe(q: torch.Tensor, k: torch.Tensor, block_size: int, rot: int, interleaved: bool, has_pos: bool,
             causal: bool, backward: bool) -> str:
    """A launch signature in the user's terms, for the warning."""
    parts = [str(q.dtype).replace("torch.", ""), f"H={q.shape[1]}/{k.shape[1]} kv", f"D={q.shape[2]}",
             f"block {block_size}"]
    if rot:
        parts.append(f"rotary {rot}{' interleaved' if interleaved else ''}{' positions' if has_pos else ''}")
    if causal:
        parts.append("causal")
    return f"{'backward' if backward else 'forward'} ({', '.join(parts)})"


@contextlib.contextmanager
def suspended():
    """No self-check inside the ``with`` block: the variants' own results are returned."""
    before = _SUSPENDED[0]
    _SUSPENDED[0] = True
    try:
        yield
    finally:
        _SUSPENDED[0] = before


def reset() -> None:
    """Forget every check and re-enable every variant (tests)."""
    _PASSED.clear()
    _DISABLED.clear()
