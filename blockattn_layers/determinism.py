"""Which backward the multi-tile (flash) kernels run: deterministic, or fast with atomic dQ.

The flash kernels (full attention, blocks over 128 tokens, and 128-token blocks at head dims
over 128) have two backwards (``kernels.flash.bwd``):

- **deterministic** (the default): a dQ pass and a dK/dV pass; every gradient element is
  written once in a fixed order, so gradients are bitwise the same from run to run;
- **fast**: one dK/dV pass that also adds dQ's terms to float32 sums (tensor-map reductions
  and atomic adds; the score tiles are computed once, not twice); dQ may then differ between
  runs in its last bits.

The default is deterministic: reproducible, and on the H200 also the faster of the two today
(seed3 3.84 ms against the fast one's 5.01: BENCHMARKS.md, session 17);
``torch.use_deterministic_algorithms(True)`` always selects the deterministic one. Choose per
process with ``use_fast_backward()`` or the environment variable ``BLOCKATTN_BACKWARD=fast``
(``deterministic``: the default; read once, when the package is imported, and an unknown value
raises there), or for a region with ``with fast_backward(): ...``. The current setting is read
when the backward runs, so it applies to compiled and exported models too. The single-tile block
kernels have one backward, deterministic.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, List

import torch

_MODES = ("deterministic", "fast")


def _from_environment() -> bool:
    mode = os.environ.get("BLOCKATTN_BACKWARD", "deterministic").strip().lower() or "deterministic"
    if mode not in _MODES:
        raise ValueError(f"BLOCKATTN_BACKWARD must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode == "fast"


_FAST: List[bool] = [_from_environment()]


def use_fast_backward(enabled: bool = True) -> None:
    """Run the flash kernels' fast backward from now on (``enabled=False``: the deterministic one)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"use_fast_backward: enabled must be a bool, got {type(enabled).__name__}")
    _FAST[0] = enabled


@contextlib.contextmanager
def fast_backward(enabled: bool = True) -> Iterator[None]:
    """The fast backward (or, ``enabled=False``, the deterministic one) inside the block."""
    before = _FAST[0]
    use_fast_backward(enabled)
    try:
        yield
    finally:
        _FAST[0] = before


def deterministic_backward() -> bool:
    """Whether the flash kernels' backward runs deterministically now."""
    return not _FAST[0] or torch.are_deterministic_algorithms_enabled()
