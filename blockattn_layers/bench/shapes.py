"""Benchmark shapes (PERFORMANCE.md, issues 3, 4, 5 and 9), seeded so every run sees the same lengths."""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch import Tensor

from . import grid
from .common import Case, LayerConfig

PROD_HEADS = ((2, 128), (4, 64))  # (H, D): the two production head layouts
BLOCK = 64


def uniform_lengths(batch: int, low: int, high: int, seed: int) -> Tensor:
    """``batch`` host int64 lengths uniform in ``[low, high]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen, dtype=torch.int64)


def prod_lengths() -> Tensor:
    """B = 1152 lengths uniform in [1, 4000] (T ~ 2.3M)."""
    return uniform_lengths(1152, 1, 4000, seed=0)


def _round_up(lengths: Tensor, multiple: int) -> Tensor:
    return (lengths + multiple - 1) // multiple * multiple


def _heads(shape: str, lengths: Tensor, block, rope=None, heads=PROD_HEADS) -> List[Case]:
    return [
        Case(f"{shape}/d{d}h{h}", shape, lengths, h, d, block, rope_theta=rope) for h, d in heads
    ]


def prod() -> List[Case]:
    return _heads("prod", prod_lengths(), BLOCK)


def prod_aligned() -> List[Case]:
    return _heads("prod_aligned", _round_up(prod_lengths(), BLOCK), BLOCK)


def small() -> List[Case]:
    """B = 64 lengths in [1, 256]: host-bound. Timed twice: as eager calls (host time included
    where it exceeds the GPU time), in rounds with the methods interleaved (host time drifts
    by tens of percent over a run, more than the methods differ), and as CUDA-graph replays
    (GPU time: METHOD.md's way to time small launches, and how host-bound training steps are run)."""
    lengths = uniform_lengths(64, 1, 256, seed=1)
    return [Case("small/d64h4", "small", lengths, 4, 64, BLOCK, rounds=9),
            Case("small_graph/d64h4", "small", lengths, 4, 64, BLOCK, graphed=True)]


def rotary() -> List[Case]:
    return _heads("rotary", prod_lengths(), BLOCK, rope=10000.0)


def seed3() -> List[Case]:
    return _heads("seed3", _seed3_lengths(), None, heads=((8, 128),))


def _seed3_lengths() -> Tensor:
    return uniform_lengths(32, 1024, 3072, seed=3)


def seed3_causal() -> List[Case]:
    """seed3 with causal masking inside each sequence (issue 26)."""
    return [Case("seed3_causal/d128h8", "seed3_causal", _seed3_lengths(), 8, 128, None, causal=True)]


def seed3_gqa() -> List[Case]:
    """seed3 with 8 query heads sharing 2 kv heads (issue 26)."""
    return [Case("seed3_gqa/d128h8kv2", "seed3_gqa", _seed3_lengths(), 8, 128, None, num_kv_heads=2)]


def seed3_d256() -> List[Case]:
    """seed3's lengths with 4 heads of 256 channels: full attention at a head dim over 128, where
    the flash kernels take their own tiles (issues 25 and 26)."""
    return [Case("seed3_d256/d256h4", "seed3_d256", _seed3_lengths(), 4, 256, None)]


def seed3_d64() -> List[Case]:
    """seed3's lengths with 16 heads of 64 channels (seed3's bytes): full attention at D64, where the
    Gluon flash kernels' choice is timed apart from D128's (issue 26); causal, and 16 query heads
    sharing 4 kv heads, as seed3_causal and seed3_gqa are at D128."""
    lengths = _seed3_lengths()
    return [Case("seed3_d64/d64h16", "seed3_d64", lengths, 16, 64, None),
            Case("seed3_d64/d64h16_causal", "seed3_d64", lengths, 16, 64, None, causal=True),
            Case("seed3_d64/d64h16kv4", "seed3_d64", lengths, 16, 64, None, num_kv_heads=4)]


def prod_full() -> List[Case]:
    return _heads("prod_full", prod_lengths(), None, heads=((2, 128),))


def block256() -> List[Case]:
    """Blocks of 256 tokens on prod lengths, both production head layouts (D128 H2, D64 H4)."""
    return _heads("block256", prod_lengths(), 256)


def block512() -> List[Case]:
    """Blocks of 512 tokens on prod lengths, both production head layouts (D128 H2, D64 H4)."""
    return _heads("block512", prod_lengths(), 512)


def block192() -> List[Case]:
    """Blocks of 192 tokens (two 128-key tiles, the second half full) on prod lengths, both production head
    layouts: beside ``block256`` and ``block384`` for the flash forward's consumer loop choice
    (``sm90.flash_persistent.LOOPS``)."""
    return _heads("block192", prod_lengths(), 192)


def block384() -> List[Case]:
    """Blocks of 384 tokens (three 128-key tiles) on prod lengths, both production head layouts."""
    return _heads("block384", prod_lengths(), 384)


def layer() -> List[Case]:
    cfg = LayerConfig(d_model=256, nhead=2, dim_feedforward=1024)
    return [Case("layer/d256h2", "layer", prod_lengths(), 2, 128, BLOCK, layer=cfg)]


def tiny() -> List[Case]:
    """CPU smoke-test cases: block, full, rotary and a layer, a few hundred tokens each."""
    lengths = uniform_lengths(6, 1, 150, seed=4)
    cfg = LayerConfig(d_model=64, nhead=2, dim_feedforward=128)
    return [
        Case("tiny/block", "tiny", lengths, 2, 32, BLOCK),
        Case("tiny/full", "tiny", lengths, 2, 32, None),
        Case("tiny/rotary", "tiny", lengths, 2, 32, BLOCK, rope_theta=10000.0),
        Case("tiny/layer", "tiny", lengths, 2, 32, BLOCK, layer=cfg),
    ]


SHAPES: Dict[str, Callable[[], List[Case]]] = {
    "prod": prod,
    "prod_aligned": prod_aligned,
    "small": small,
    "rotary": rotary,
    "seed3": seed3,
    "seed3_causal": seed3_causal,
    "seed3_gqa": seed3_gqa,
    "seed3_d256": seed3_d256,
    "seed3_d64": seed3_d64,
    "prod_full": prod_full,
    "block192": block192,
    "block256": block256,
    "block384": block384,
    "block512": block512,
    "layer": layer,
    "tiny": tiny,
    # Issue 25's shape grid (bench/grid.py): 480 points, not part of 'all'; --grid runs a slice.
    "grid": grid.cases,
}

DEFAULT_SHAPES = ("prod", "prod_aligned", "small")
ALL_SHAPES = tuple(name for name in SHAPES if name not in ("tiny", "grid"))


def resolve(spec: str) -> List[str]:
    """``"prod,small"`` / ``"all"`` / ``"default"`` -> shape names (ValueError on unknown ones);
    ``all`` leaves out ``tiny`` and ``grid``."""
    names: List[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        expanded = {"all": ALL_SHAPES, "default": DEFAULT_SHAPES}.get(part, (part,))
        for name in expanded:
            if name not in SHAPES:
                raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}, all, default")
            if name not in names:
                names.append(name)
    return names


def build_cases(names: List[str], grid_selection=None, grid_batch: int = grid.DEFAULT_BATCH,
                grid_max_len: int = grid.DEFAULT_MAX_LEN) -> List[Case]:
    """The cases of ``names``; the grid's slice, batch and longest length as given."""
    out: List[Case] = []
    for name in names:
        if name == "grid":
            out += grid.cases(grid_selection, batch=grid_batch, max_len=grid_max_len)
        else:
            out += SHAPES[name]()
    return out
