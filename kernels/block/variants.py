"""The block-kernel variants: what each computes, where ``auto`` takes it, and the choice.

Every variant declares the calls it admits: ``call_reasons`` (from dtypes, shapes and flags) and
``layout_reasons`` (from the tensors' strides and addresses) say why it cannot compute a call,
and are empty when it can. ``auto`` takes, among the variants declared for the call's GPU
generation, the first in ``AUTO_ORDER`` that admits the call and has no ``auto_reasons`` (where
it was measured slower than the next); ``simple`` admits every call of the ``triton`` backend.
The forward and the backward choose apart (``CallFacts.backward``). Experimental variants are
never taken by ``auto``.

A variant is forced with :func:`force_variant` (or ``BLOCKATTN_KERNELS=<name>`` in the
environment, read at import and checked at the first call: an unknown name raises there).
A forced variant that cannot compute a call says so in one warning per reason, and the call
runs what ``auto`` takes. :func:`explain` gives every variant's reasons for a call, the
dispatcher's ``explain_variants`` shows them beside the backends.

Each variant also records the GPU generations where it was run and checked on hardware
(``verified_on``). Elsewhere ``auto`` takes it only after :func:`allow_unverified` (or
``BLOCKATTN_UNVERIFIED_KERNELS=1``), and it is self-checked at first use (``block.self_check``):
today the ``sm100`` kernels, which no GPU here could run.

What was measured: on the H200, ``hopper`` is the fastest on every block shape it admits
(BENCHMARKS.md); for blocks of up to 32 tokens ``hopper_packed`` (the same kernels on tiles of 2 or
4 blocks) beats ``simple`` forward at D <= 64 (and with grouped query heads at D 96-128), backward
with one query head per kv head at D <= 128, and with split-half rotary at D <= 64 both ways
(``_hopper_packed_auto_reasons``); ``packed`` (the Triton twin) is slower than both since it
confines a NaN to its block; the persistent Triton variant, slower everywhere, was deleted; the
warp-specialized ``hopper_ws`` kernels (``experimental.sm90_ws``), slower on every prod shape, are
kept beside the ``sm100`` kernels that grew from their design. ``keys`` (Triton, a backward over key
rows; its forward is simple's) was faster than hopper and simple only for the rotary backward of
grouped query heads on blocks over 64 at D 65-128 (``_keys_auto_reasons``). ``rotated`` (first in
``AUTO_ORDER``) runs a rotary backward as a rotation pass into copies of q and k, the backward
without rotary and the transpose rotation of dq and dk (``block.rotation``); on sm_90 auto takes it
for grouped query heads at D over 64 on blocks over 32 wherever the fused backward would be simple's,
keys' or the flash kernels' (``_rotated_auto_reasons``): 1.0-2.1x faster there, keys' region included.
Grouped query heads can also run one query head per program, each head's dK and dV summed over the
group (``Variant.group_partials``; in the launch where ``plan.group_sums_in_launch`` says, else
after it): ``hopper_wide`` takes them so (block-128 D256 backwards 1.4-1.7x faster than the flash
kernels, session 32), and ``hopper_heads`` (hopper's kernels so) the
rotary backward on blocks over 64 at D 65-128 where it beat hopper's group loop and the rotation
pass (``_hopper_heads_auto_reasons``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..common.launch import Launcher
from ..common.meta import major_of, tile_extent
from . import self_check


class CallFacts(NamedTuple):
    """What the variants decide on, short of the tensors' layout. ``major``: the GPU's
    compute-capability major (None off the GPU); ``rot``: the rotary dim, 0 without rotary."""

    device_type: str
    major: Optional[int]
    dtype: torch.dtype
    head_dim: int
    groups: int
    block_size: int
    rot: int
    interleaved: bool
    int64: bool
    has_pos: bool = False
    backward: bool = False
    stores_lse: bool = False


def call_facts(q: torch.Tensor, k: torch.Tensor, block_size: int, rot: int, interleaved: bool,
               int64: bool, has_pos: bool = False, backward: bool = False, stores_lse: bool = False) -> CallFacts:
    """What the variant choice reads of a call, short of the tensors' layout (``has_pos``: rotary
    positions given; ``backward``: the choice is the backward's; ``stores_lse``: the forward also
    stores each row's logsumexp, for the flash backward)."""
    return CallFacts(q.device.type, major_of(q) if q.is_cuda else None, q.dtype, q.shape[2], q.shape[1] // k.shape[1],
                     block_size, rot, interleaved, int64, has_pos, backward, stores_lse)


class Variant(NamedTuple):
    """A block-kernel variant and what it admits.

    ``generations``: compute-capability majors where ``auto`` may take it (None: every one);
    ``kernels``: returns its ``(forward, backward)`` launchers, imported at first use;
    ``lse_forward``: returns its forward launcher that also stores each row's logsumexp (same
    arguments with ``Lse`` after ``O`` and its head stride last), or None where it has none;
    ``persistent``: a grid of resident programs (``programs_per_sm`` of them per SM, keyed
    (backward, BLOCK_D > 64)) instead of one program per (block, kv head); ``block_m``: fixed
    tile rows; ``warpgroup_tiles``: tiles of 64 or 128 rows (the block's tile extent, at least 64)
    with one warpgroup per 64 rows; ``packs_blocks``: 64-row tiles of several blocks, each in
    ``SLOT`` rows (its tile extent), masked block-diagonally; ``maxnreg``: a register cap for every
    launch; ``num_warps``: the warps of the kernels' default partition, where they fix it;
    ``verified_on``: the generations
    where it was run and checked on hardware (None: wherever it compiles, as the Triton kernels);
    elsewhere ``auto`` takes it only with :func:`allow_unverified`, and it is self-checked at first
    use (``block.self_check``); ``auto_reasons``: why ``auto`` leaves a call it admits to the
    variants after it (where it was measured slower), no bar to forcing it; ``wide_backward``: its
    backward takes blocks over 64 tokens at head dims over 128, which no other variant's backward
    fits in one program (those calls' backward runs on the flash kernels otherwise, or a rotation
    pass around them);
    ``group_partials``: its backward takes grouped query heads as one query head per kv head, k and
    v repeated by a zero head stride, each head's dK and dV summed over the group (after the launch,
    or in it: ``sums_in_launch``; ``block.bwd._by_query_heads``); ``kernels_of``: the variant whose kernels and backward launch
    plan (register caps, warps) it launches, where it differs only in how it splits a call;
    ``rotation_pass``: a rotary backward run as a rotation pass, the backward without rotary
    (the variant ``auto`` takes for it) and the transpose rotation (``block.rotation``); ``kernels``
    then gives the rotation pass's launcher; ``forward_of``: the variant whose forward runs this
    one's (a backward-only variant): the choice takes that variant for the forward, forced or not,
    and its admission, ``auto`` reasons, kernels and launch plan are that variant's;
    ``sums_in_launch``: its backward kernel takes ``sm90.wide``'s arguments past ``block.bwd``'s
    (block counters and the summed dK and dV) and, launched for ``group_partials``, can sum the
    group's dK and dV itself (``sm90.group_sums``) instead of the pass after the launch, where
    ``plan.group_sums_in_launch`` says (measured faster).
    """

    name: str
    description: str
    generations: Optional[FrozenSet[int]]
    experimental: bool
    call_reasons: Callable[[CallFacts], List[str]]
    layout_reasons: Callable[[torch.Tensor, Sequence[torch.Tensor]], List[str]]
    kernels: Callable[[], Tuple[Launcher, Launcher]]
    persistent: bool = False
    programs_per_sm: Optional[Dict[Tuple[bool, bool], int]] = None
    block_m: Optional[int] = None
    warpgroup_tiles: bool = False
    packs_blocks: bool = False
    maxnreg: Optional[int] = None
    verified_on: Optional[FrozenSet[int]] = None
    num_warps: Optional[int] = None
    auto_reasons: Optional[Callable[[CallFacts], List[str]]] = None
    lse_forward: Optional[Callable[[], Launcher]] = None
    wide_backward: bool = False
    group_partials: bool = False
    kernels_of: Optional[str] = None
    rotation_pass: bool = False
    forward_of: Optional[str] = None
    sums_in_launch: bool = False


# What the Gluon kernels take: 16-bit dtypes; the sm_90 ones head dims 32-256 in multiples of 16
# (tiles padded to a power of two past the head's channels) and blocks of 33-128 rows (64-row
# tiles of one warpgroup, 128-row tiles of two: on the H200 the simple kernels' 16- and 32-row
# tiles are faster for shorter blocks, 1.3-2x at every grid point); the sm_100 ones head dims 64 and 128.
HOPPER_DTYPES = (torch.float16, torch.bfloat16)
HOPPER_HEAD_DIMS = tuple(range(32, 257, 16))
HOPPER_BLOCKS = (33, 128)
SM100_HEAD_DIMS = (64, 128)


def _no_reasons(*args) -> List[str]:
    return []


def _import_error(module: str) -> Optional[str]:
    """Why ``kernels.<module>`` cannot be imported with this Triton, or None."""
    try:
        importlib.import_module(f"blockattn_layers.kernels.{module}")
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


@functools.lru_cache(maxsize=1)
def gluon_import_error() -> Optional[str]:
    """Why the sm_90 Gluon kernels cannot be imported with this Triton, or None."""
    return _import_error("sm90.block")


def _gluon_call_reasons(facts: CallFacts, major: int, blocks: Tuple[int, int], head_dims: Tuple[int, ...],
                        import_error, addresses_64bit: bool) -> List[str]:
    """What the Gluon block kernels of generation ``major`` share: 16-bit dtypes, head dims in
    ``head_dims``, blocks in ``blocks`` (inclusive), and 32-bit offsets unless ``addresses_64bit``
    (which rotary forms each admits: ``_whole_rotary_reasons``, ``_half_tile_rotary_reasons``)."""
    reasons = []
    if facts.device_type != "cuda" or facts.major != major:
        reasons.append(f"needs an sm_{major}0 GPU")
    if facts.dtype not in HOPPER_DTYPES:
        reasons.append(f"dtype {facts.dtype} (needs float16 or bfloat16)")
    if facts.head_dim not in head_dims:
        dims = (", ".join(map(str, head_dims)) if len(head_dims) < 4
                else f"a multiple of {head_dims[1] - head_dims[0]} in {head_dims[0]}-{head_dims[-1]}")
        reasons.append(f"head_dim {facts.head_dim} (needs {dims})")
    low, high = blocks
    if facts.block_size > high:
        reasons.append(f"block_size {facts.block_size} > {high}")
    elif facts.block_size < low:
        reasons.append(f"block_size {facts.block_size} < {low}")
    if facts.int64 and not addresses_64bit:
        reasons.append("64-bit addressing")
    if not reasons and import_error() is not None:
        reasons.append(f"Gluon kernels unavailable ({import_error()})")
    return reasons


def _whole_rotary_reasons(facts: CallFacts) -> List[str]:
    """Rotary only over all channels in split halves (the sm_100 and hopper_ws kernels' rotary
    halves are the head's two column halves)."""
    reasons = []
    if facts.rot and facts.rot != facts.head_dim:
        reasons.append(f"rotary_dim {facts.rot} of head_dim {facts.head_dim} (needs rotary over all channels)")
    if facts.rot and facts.interleaved:
        reasons.append("interleaved rotary (needs split halves)")
    return reasons


def _half_tile_rotary_reasons(facts: CallFacts, wide_halves: bool = False) -> List[str]:
    """Rotary in the sm_90 kernels' half tiles (``sm90.rotary.half_channels``): over ``rot``
    channels of a head dim of at most 128 (``wide_halves``: any head dim, half tiles of D 144-256
    rotated 32 rows at a time, as the hopper kernels' blocks; tiles of blocks rotate whole tiles,
    whose angles at D256 spill), both runs of each half tile (the rotary pairs, the pass-through
    channels) whole 16-byte chunks: ``rot`` a multiple of 16. Split halves or interleaved pairs
    (each pair one 32-bit word, split into the half tiles in registers)."""
    reasons = []
    if facts.rot and facts.head_dim > 128 and not wide_halves:
        reasons.append(f"rotary at head_dim {facts.head_dim} (needs at most 128)")
    return reasons + _rotary_chunk_reasons(facts)


def _rotary_chunk_reasons(facts: CallFacts) -> List[str]:
    """Both runs of each rotary half tile (the pairs, the pass-through channels) whole 16-byte
    chunks, as the sm_90 kernels' copies take them: ``rotary_dim`` a multiple of 16."""
    return [f"rotary_dim {facts.rot} (needs a multiple of 16)"] if facts.rot % 16 else []


def _hopper_call_reasons(facts: CallFacts) -> List[str]:
    """The hopper kernels' admission. Beyond ``_gluon_call_reasons``: rotary as
    ``_half_tile_rotary_reasons``; in the backward no 128-row tiles wider than 128 (288 KB of shared
    memory) and no grouped query heads at D256 (ptxas spills 7.7 KB). Grouped query heads at
    128-row tiles are admitted (their backward reads P back from shared memory: 332 bytes spilled
    at D128, 940 with rotary); where ``auto`` takes them is ``_hopper_auto_reasons``."""
    reasons = _gluon_call_reasons(facts, 9, HOPPER_BLOCKS, HOPPER_HEAD_DIMS, gluon_import_error, True)
    reasons += _half_tile_rotary_reasons(facts, wide_halves=True)
    if facts.backward and facts.block_size > 64 and facts.head_dim > 128:
        reasons.append("backward of blocks over 64 with head_dim over 128")
    elif facts.backward and facts.groups > 1 and facts.head_dim > 128:
        reasons.append("backward of grouped-query heads with head_dim over 128")
    return reasons


def _hopper_packed_call_reasons(facts: CallFacts) -> List[str]:
    """The hopper kernels on 64-row tiles of several blocks (``SLOT`` rows each, 4 of up to 16
    tokens or 2 of up to 32), masked block-diagonally: what ``_gluon_call_reasons`` admits at blocks
    of up to ``PACKED_MAX_BLOCK`` tokens; rotary as ``hopper`` (its gradients rotated back in
    registers, where hopper's 128-wide tiles go through shared memory 32 rows of one block at a
    time); in the backward no grouped query heads over D128 (as ``hopper``)."""
    reasons = _gluon_call_reasons(facts, 9, (1, PACKED_MAX_BLOCK), HOPPER_HEAD_DIMS, gluon_import_error, True)
    reasons += _half_tile_rotary_reasons(facts)
    if facts.backward and facts.groups > 1 and facts.head_dim > 128:
        reasons.append("backward of grouped-query heads with head_dim over 128")
    return reasons


def _hopper_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``hopper`` admits a call that ``auto`` leaves to ``simple``. Grouped query heads at
    128-row tiles, forward (H200, bf16, grid lengths, 8x2 heads, causal no, one process; ms against
    simple): hopper faster at D96 / D128 without rotary with one program per query head
    (``plan.split_groups``: 2.056 vs 2.414, 2.059 vs 2.452), at D128 rotary (2.874 vs 4.248), and,
    since its group loop runs at 128 registers (``plan.HOPPER_GROUP_LOOP_MAXNREG``, session 24), at
    D32 (1.123 vs 1.256-1.339; causal 1.120 vs 1.275-1.316; rotary 1.187 vs 1.263-1.283) and D64
    (1.237 vs 1.595-1.666; causal 1.402 vs 1.522-1.544; 4x1 0.755 vs 0.898-0.912; with rotary,
    session 25, timed apart from the host's work: 8x2 1.296 vs 1.575, causal 1.328 vs 1.451, 4x1
    causal 0.671 vs 0.737, where session 24's A/B, each call synced, had simple ahead); at D256 without
    rotary simple was faster (4.895 vs 5.003) until hopper's 128-row tiles went in 64-channel chunks
    (``plan.CHUNKED_WIDE_FWD``, session 61, H100: 8x2 3.64 vs simple 5.42, 4x1 1.82 vs 2.71); with split-half
    rotary there (session 30, its
    half tiles rotated by 32-row chunks) hopper is faster (4x1 3.041 vs 4.638). Their backward at D64 / D128 (P read back
    from shared memory) is 1.3-2.3x faster than simple (block 128, heads 8x2 and 4x1, rotary none and
    split: e.g. 8x2 D64 6.87 -> 3.08 ms, 8x2 D128 7.91 -> 5.80), at D32 1.02-1.13x (8x2 2.643 vs
    2.961, causal 2.709 vs 3.058, rotary 3.014 vs 3.302; 4x1 1.395 vs 1.464); at D96, on tiles padded
    to 128 channels, simple is faster (8x2 8.403 vs 10.745, causal 7.962 vs 12.356; 4x1 4.043 vs
    5.365): the other padded head dims are left to simple as D96 (session 24); with rotary over all
    channels (admitted there since session 26) hopper is faster (D96 split 8x2 13.21 vs 18.37 ms,
    whose simple backward was the grid's worst point, 11.8x floor); partial rotary there is not
    timed against simple (simple's backward of D96 rotary_dim 48, 8x2: 13.0 ms; since session 32
    ``hopper_heads`` runs the rotary ones there). Session 32, the same block-128 D96 backward without
    rotary: hopper faster (4x1 2.86 vs simple 3.94 ms, 8x2 5.79 vs 8.06), so the other head dims on
    128-wide tiles (D80, D112, untimed) go with it, and of the padded head dims only D48 (tiles of 64,
    not timed) is left to simple, unless rotary covers all its channels (as before). Interleaved
    rotary backward of grouped query heads at blocks of up to 64 and D 65-128: since simple loads the
    pairs as contiguous tiles (session 28), simple is faster (block 64 8x2 D128 6.39 vs 8.06 ms; its
    strided loads before took 25.6); at blocks over 64 and D 33-64 as well (session 32, block 128 8x2
    D64: 4.17 vs 5.96)."""
    tile = tile_extent(facts.head_dim)
    if (facts.backward and facts.groups > 1 and facts.interleaved and facts.rot
            and (tile == 128 if facts.block_size <= 64 else tile == 64)):
        return [f"backward of interleaved rotary with grouped-query heads at head_dim {facts.head_dim}: simple is "
                "faster on the H200"]
    if facts.groups > 1 and facts.block_size > 64:
        if not facts.backward:
            from .plan import CHUNKED_WIDE_FWD  # (plan imports this module)

            if tile == 256 and not facts.rot and not CHUNKED_WIDE_FWD:
                return [f"forward of grouped-query heads with blocks over 64 at head_dim {facts.head_dim}: "
                        "simple is faster on the H200"]
        elif tile == 64 and facts.head_dim != 64 and facts.rot != facts.head_dim:
            return [f"backward of grouped-query heads with blocks over 64 at head_dim {facts.head_dim} "
                    f"(tiles padded to {tile} channels): not timed against simple, which keeps it"]
    return []


def rows_copyable(t: torch.Tensor) -> bool:
    """16-byte aligned rows of unit channel stride, token and head strides multiples of 16
    elements (what Triton specializes as 16-divisible), as the sm_90 kernels' copies need."""
    st, sh, sd = t.stride()
    return sd == 1 and st % 16 == 0 and sh % 16 == 0 and t.data_ptr() % 16 == 0


def _hopper_layout_reasons(q: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[str]:
    if all(rows_copyable(t) for t in tensors):
        return []
    return ["rows not 16-byte aligned with unit channel stride"]


# What the sm_100 Gluon kernels take (``sm100.block``): tcgen05 tiles of 64 or 128 rows, so the
# block's tile (its next power of two) must be one of those.
SM100_BLOCKS = (33, 128)


@functools.lru_cache(maxsize=1)
def sm100_import_error() -> Optional[str]:
    """Why the sm_100 Gluon kernels cannot be imported with this Triton, or None."""
    return _import_error("sm100.block")


def _sm100_call_reasons(facts: CallFacts) -> List[str]:
    reasons = _gluon_call_reasons(facts, 10, SM100_BLOCKS, SM100_HEAD_DIMS, sm100_import_error, False)
    reasons += _whole_rotary_reasons(facts)
    if (facts.rot == facts.head_dim == 128 and not facts.interleaved and not facts.has_pos and facts.groups > 1
            and facts.block_size > 64):
        reasons.append("rotary at implicit positions with grouped-query heads, D128 and 128-row tiles "
                       "(those builds spill 0.5-0.9 KB)")
    return reasons


def _hopper_ws_call_reasons(facts: CallFacts) -> List[str]:
    reasons = _gluon_call_reasons(facts, 9, (1, 64), SM100_HEAD_DIMS, gluon_import_error, False)
    reasons += _whole_rotary_reasons(facts)
    if facts.groups != 1:
        reasons.append("grouped-query attention (needs one query head per kv head)")
    return reasons


def _hopper_ws_layout_reasons(q: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[str]:
    reasons = _hopper_layout_reasons(q, tensors)
    if not all(t.shape[1] == 1 or t.stride(1) == t.shape[2] for t in tensors):
        reasons.append("heads of a row not contiguous (one [T, H * D] tensor map covers them)")
    return reasons


def _simple_kernels() -> Tuple[Launcher, Launcher]:
    from . import bwd, fwd

    return fwd.launch_fwd, bwd.launch_bwd


def _simple_lse_forward() -> Launcher:
    from . import fwd

    return fwd.launch_fwd_lse


def _hopper_heads_call_reasons(facts: CallFacts) -> List[str]:
    """hopper's admission of the launches it makes: one query head per kv head (``Variant.group_partials``)."""
    return _hopper_call_reasons(facts._replace(groups=1))


def _hopper_heads_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``auto`` takes ``hopper_heads``: the rotary backward of grouped query heads on blocks over
    64 tokens at D 65-128, but interleaved pairs or rotary over part of the channels at D over 96.
    A/B on the H200 (bf16, grid lengths, causal no, session 32; ms hopper_heads / rotated (the
    rotation pass around simple or hopper) / hopper's fused group loop): block 128 D96 split 4x1
    4.13 / 5.18 / 6.78, 8x2 8.17 / 10.47 / 13.52, interleaved 4x1 4.98 / 5.19 / 6.99, 8x2 10.04 /
    10.39 / 13.99, rotary_dim 48 (grid runs, against session 31's) 4x1 4.24 / 4.88, 8x2 8.57 /
    10.02; D128 split 4x1 4.19 / 4.37 / 6.68, 8x2 8.35 / 8.59 (grid runs); D128 interleaved 4x1 4.75
    / 4.32 and rotary_dim 64 4x1 4.21 / 3.99, 8x2 8.45 / 8.01 (grid runs): rotated faster. Without
    rotary hopper's group loop is faster (D96 4x1 2.86 vs 3.35, 8x2 5.79 vs 6.71; D128 4x1 2.96 vs
    3.44; D64 8x2 3.12 vs 4.36), as it is on blocks of up to 64 (block 64 D96 4x1 split 1.96 vs
    2.88). Timed without causal masking (the facts do not hold it): causal calls take it too."""
    if facts.groups == 1:
        return ["one query head per kv head: hopper's backward, the same kernels in one launch"]
    if not facts.rot or facts.block_size <= 64 or not 64 < facts.head_dim <= 128:
        return ["slower than hopper's group loop on the H200 outside rotary on blocks over 64 at head dims 65-128"]
    if facts.head_dim > 96 and (facts.interleaved or facts.rot < facts.head_dim):
        form = "interleaved" if facts.interleaved else f"rotary_dim {facts.rot}"
        return [f"{form} at head_dim {facts.head_dim}: the rotation pass is faster on the H200"]
    return []


def _hopper_lse_forward() -> Launcher:
    from ..sm90 import block

    return block.launch_fwd_lse


def _hopper_kernels() -> Tuple[Launcher, Launcher]:
    from ..sm90 import block

    return block.launch_fwd, block.launch_bwd


def _sm100_kernels() -> Tuple[Launcher, Launcher]:
    from ..sm100 import block

    return block.launch_fwd, block.launch_bwd


def _packed_call_reasons(facts: CallFacts) -> List[str]:
    return [] if facts.block_size <= PACKED_MAX_BLOCK else [f"block_size {facts.block_size} > {PACKED_MAX_BLOCK}"]


def _packed_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``auto`` leaves ``packed`` to the variants after it: everywhere. Since its kernels
    confine a NaN to its block (a tile with a non-finite input is done again block by block), it
    was slower than ``simple`` on the H200 at 27 of 30 points of the grid's blocks of 16 and 32
    (bf16, prod lengths, rotary none, causal no; backward 1.3-3.2x slower), and where it was faster
    (forward at D32) ``hopper_packed`` is faster still (BENCHMARKS.md, session 20)."""
    return [PACKED_SLOWER_REASON]


PACKED_SLOWER_REASON = "slower than simple or hopper_packed on the H200 (session 20 grid, blocks of 16 and 32)"


def _hopper_packed_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``hopper_packed`` admits a call that ``auto`` leaves to ``simple``. H200, blocks of 16
    and 32, prod lengths, rotary none, one process per slice (bf16 causal and not, fp16 not:
    BENCHMARKS.md, session 20), hopper_packed against simple: forward 1.25-1.56x faster at D 32-64,
    with grouped query heads 1.0-1.16x at D 96-128, with one query head per kv head 0.94-1.04x
    there (simple faster at 9 of 12 points), 0.88-1.11x at D256; backward with one query head per
    kv head 1.0-1.34x faster at D 32-128, 0.71-0.84x at D256; backward of grouped query heads
    0.72-1.00x at 9c1adb3 (tiles spilling 0.6-0.9 KB at D 64-128); since its NaN check counts dK
    and dV (session 21: bf16, 8x2 and 4x1, causal or not) 1.03-1.22x faster than simple at D64 (8 of
    8 points; block 32 causal 8x2 2.002 vs 2.442 ms), 0.8-1.1x at D32 (simple kept then; capped at 160
    registers since session 50, 2 -> 3 programs per SM: H100, bf16, 4x1, grid lengths, backward ms
    against simple's, blocks of 16 / 32: 0.658 / 0.694, 0.622 / 0.758, causal 0.654 / 0.711, 0.621 /
    0.885, so auto takes it at D32); D 96-128 spill 0.3 KB at 255 registers, not timed (simple kept).
    Split-half rotary
    (bf16, causal no): at D 32-64 forward 0.98-1.35x and backward 1.05-1.37x, grouped query heads
    included, so auto takes it there; at D128 forward 0.87-1.13x (simple). Its split-half rotary
    backward at D 96-128 (session 27, bf16, causal no, A/B): 0.95-0.97x at 2x2, 0.38x at 4x1 (simple
    kept); rotary_dim 64 at D128 2x2 forward 0.97x, backward 1.09x (one point; simple kept).
    Interleaved rotary at D128 (session 27): forward 1.9-3.4x and backward 1.9-6.3x faster than
    simple (whose interleaved pairs were strided loads then), 2x2 and 8x2. Since simple loads the
    pairs as contiguous tiles (session 28, A/B) it is faster at D 65-128 in every mode measured:
    backward of grouped query heads 2.9-3.1x (8x2: block 32 D128 4.00 vs 12.28 ms, block 16 D128
    4.01 vs 12.35, block 32 D96 4.04 vs 11.61), block 32 D128 forward 2.183 vs 2.507 (8x2) and
    0.752 vs 0.851 (2x2), backward 2x2 1.406 vs 1.499; auto takes hopper_packed for interleaved
    rotary at D <= 64 only (not re-timed there)."""
    if facts.rot and facts.head_dim > 64 and not facts.interleaved:
        return [f"split-half rotary at head_dim {facts.head_dim}: not faster than simple on the H200"]
    if facts.rot and tile_extent(facts.head_dim) == 128:
        return [f"interleaved rotary at head_dim {facts.head_dim}: simple is faster on the H200"]
    if facts.rot:
        return []
    if facts.head_dim > 128:
        return [f"head_dim {facts.head_dim} > 128: not faster than simple on the H200"]
    if facts.backward and facts.groups > 1 and tile_extent(facts.head_dim) > 64:
        return [f"backward of grouped-query heads at head_dim {facts.head_dim}: not faster than simple on the H200 "
                "(its tiles spill)"]
    if not facts.backward and facts.groups == 1 and facts.head_dim > 64:
        return [f"forward at head_dim {facts.head_dim} with one query head per kv head: not faster than simple "
                "on the H200"]
    return []


@functools.lru_cache(maxsize=1)
def wide_import_error() -> Optional[str]:
    """Why the sm_90 Gluon hopper_wide kernels cannot be imported with this Triton, or None."""
    return _import_error("sm90.wide")


def _hopper_wide_kernels() -> Tuple[Launcher, Launcher]:
    from ..sm90 import block, wide

    return block.launch_fwd, wide.launch_bwd


# What the hopper_wide kernels take (``sm90.wide``): blocks of 65-128 tokens (one 128-row key tile)
# at head dims 144-256 in steps of 16 (tiles 256 channels wide, whose column halves are 128 x 128
# like the backward's P tile).
WIDE_BLOCKS = (65, 128)
WIDE_HEAD_DIMS = tuple(range(144, 257, 16))


def _hopper_wide_call_reasons(facts: CallFacts) -> List[str]:
    """The hopper_wide backward's admission (its forward is hopper's: ``Variant.forward_of``): blocks
    and head dims of ``WIDE_BLOCKS`` / ``WIDE_HEAD_DIMS``, every group size (grouped query heads by
    ``Variant.group_partials``: ``sm90.wide`` says why), rotary in every form with ``rotary_dim`` a
    multiple of 16 (as hopper's half tiles), 16-bit dtypes, 32- or 64-bit offsets."""
    reasons = _gluon_call_reasons(facts, 9, WIDE_BLOCKS, WIDE_HEAD_DIMS, wide_import_error, True)
    return reasons + _rotary_chunk_reasons(facts)


def _keys_kernels() -> Tuple[Launcher, Launcher]:
    from . import bwd_keys, fwd

    return fwd.launch_fwd, bwd_keys.launch_bwd


# Blocks the ``keys`` backward takes: 64- and 128-row key tiles (64-row query tiles), head dims up
# to 128 (its dK and dV accumulators, 128 x 256 in float32 at D256, would not fit the registers).
KEYS_BLOCKS = (33, 128)
KEYS_MAX_HEAD_DIM = 128


def _keys_call_reasons(facts: CallFacts) -> List[str]:
    """The ``keys`` backward's admission: blocks of ``KEYS_BLOCKS`` tokens, head dims up to
    ``KEYS_MAX_HEAD_DIM``, every rotary form, dtype and offset width of the Triton kernels. Its
    forward is ``simple``'s."""
    reasons = []
    low, high = KEYS_BLOCKS
    if facts.block_size > high:
        reasons.append(f"block_size {facts.block_size} > {high}")
    elif facts.block_size < low:
        reasons.append(f"block_size {facts.block_size} < {low}")
    if facts.head_dim > KEYS_MAX_HEAD_DIM:
        reasons.append(f"head_dim {facts.head_dim} > {KEYS_MAX_HEAD_DIM}")
    return reasons


def _keys_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``auto`` leaves a call ``keys`` admits to the variants after it. Its forward is
    simple's (auto names that simple). Backward, A/B against hopper and simple (``bench.variant_ab``,
    H200, bf16, grid lengths, causal no; ms keys / hopper / simple): faster only for split-half
    rotary of grouped query heads on 128-token blocks at D 96-128, where the query-row kernels hold
    128 x 128 scores beside the group's dK and dV (8x2 D128 10.22 / 12.98 / 18.16, D96 10.25 /
    13.22 / 18.12, D128 rotary_dim 64 9.75 / 13.18 / 12.92). Slower everywhere else measured: its
    column softmax and delta are reductions across the warps of the key rows, per 64-row query tile
    (block 128 8x2 D128 6.94 / 5.76 / 7.87, D64 5.61 / 3.07 / 3.22, D32 4.97 / 2.39 / 2.54; 2x2
    D128 2.34 / 1.32 / 1.79; D64 rotary 8x2 6.08 / 3.92 / 4.32; interleaved pairs, loaded by
    strided gathers then, 30.2 / 12.6 / 37.8; block 64 8x2 D128 4.27 / 3.19 / 5.59, rotary 14.0 / 3.90 /
    6.17). Interleaved pairs since the Triton kernels load them as contiguous tiles
    (``tiles.load_pairs``): block 128 8x2 D128 10.46 / 12.64 / 15.24, D96 rotary_dim 64 9.10 / 13.61 /
    11.08 (taken); 2x2 3.64 / 1.97 / 1.98 and block 64 8x2 D128 14.26 / 8.06 / 6.39 (not). Taken on
    sm_90 only, where it was timed (simple's 128-row backward there spills 1.6 KB, keys 0.3-0.5 KB):
    on sm_80 the Triton wheel's ptxas (CUDA 12.8) gives its D128 builds 128 registers and 3.7-4.4 KB
    of spills (simple: 255 and 1.4 KB); sm_100 is untimed."""
    if not facts.backward:
        return ["forward: the simple kernels' (auto names it simple)"]
    if facts.major != 9:
        return ["backward timed on sm_90 only (sm_80 builds spill 3.7-4.4 KB at D128)"]
    if facts.block_size > 64 and facts.groups > 1 and facts.rot and tile_extent(facts.head_dim) == 128:
        return []
    return [KEYS_SLOWER_REASON]


def _rotation_kernels() -> Tuple[Launcher, Launcher]:
    from . import rotation

    return rotation.launch_rotation, rotation.launch_rotation


def _rotated_call_reasons(facts: CallFacts) -> List[str]:
    """The ``rotated`` variant's admission: the backward of rotary calls (the forward rotates in its
    kernels; without rotary there is nothing to rotate). Every dtype, head dim, block size and
    rotary form: the backward without rotary is the one auto takes."""
    reasons = []
    if not facts.backward:
        reasons.append("forward: the fused rotary kernels run it (the rotation pass serves the backward)")
    if not facts.rot:
        reasons.append("no rotary")
    return reasons


def _rotated_auto_reasons(facts: CallFacts) -> List[str]:
    """Where ``auto`` takes the rotation pass: the rotary backward of grouped query heads at head dims
    over 64 on blocks over 32 tokens where no Gluon variant takes the fused backward (the fused one
    would be simple's, keys' or the flash kernels'). A/B on the H200 (bf16, grid lengths, causal no;
    ms rotated / fused, session 31): block 128 D256 split 4x1 14.2 / 23.8 (flash), 8x2 34.3 / 47.6;
    block 64 D256 4x1 8.05 / 14.5 (simple; causal 8.01 / 17.1); block 128 8x2 D128 split 8.61 / 10.35
    (keys), interleaved 8.46 / 10.56, D96 10.29 / 10.31 and 10.21 / 10.44; block 64 4x1 interleaved
    D96 2.69 / 3.15 (simple), D128 2.91 / 3.22. Slower where the fused backward is hopper's (block
    64 4x1 D128 split 2.98 / 1.89 in the grid record) and on blocks of up to 32, where simple's is
    (8x2 D256 split: block 16 12.95 / 7.39, block 32 12.79 / 11.34)."""
    if facts.major != 9:
        return ["timed on sm_90 only"]
    if facts.groups == 1 or facts.head_dim <= 64 or facts.block_size <= 32:
        return [ROTATED_SLOWER_REASON]
    fused = _auto_by_facts(facts, tuple(v for v in AUTO_ORDER if not v.rotation_pass))
    if fused not in (SIMPLE, KEYS):
        return [f"the fused {fused.name} backward is faster on the H200"]
    return []


ROTATED_SLOWER_REASON = ("the fused rotary backward is faster on the H200 outside grouped query heads at head dims "
                         "over 64 on blocks over 32 tokens")


KEYS_SLOWER_REASON = ("backward slower than hopper or simple on the H200 outside rotary of grouped query heads on "
                      "blocks over 64 at head dims 65-128")


def _hopper_ws_kernels() -> Tuple[Launcher, Launcher]:
    from ..experimental import sm90_ws

    return sm90_ws.launch_fwd, sm90_ws.launch_bwd


# Blocks of up to this many tokens share 64-row tiles in the packed variants (2 or 4 per tile).
PACKED_MAX_BLOCK = 32

SIMPLE = Variant(
    "simple", "Triton, one program per (block, kv head); rotary at D <= 64: per block, looping over the kv heads",
    None, False, _no_reasons, _no_reasons, _simple_kernels, lse_forward=_simple_lse_forward)
HOPPER = Variant(
    "hopper", "Gluon for sm_90: cp.async tiles in shared memory, wgmma from one copy, rotary rotated in place, "
    "results stored through shared memory", frozenset({9}), False, _hopper_call_reasons, _hopper_layout_reasons,
    _hopper_kernels, warpgroup_tiles=True, verified_on=frozenset({9}), auto_reasons=_hopper_auto_reasons,
    lse_forward=_hopper_lse_forward)
HOPPER_HEADS = Variant(
    "hopper_heads", "the hopper kernels' backward one query head per program: grouped query heads against k and v "
    "repeated by a zero head stride, their dK and dV summed over the group after; its forward: hopper's",
    frozenset({9}), False, _hopper_heads_call_reasons, _hopper_layout_reasons, _hopper_kernels,
    warpgroup_tiles=True, verified_on=frozenset({9}), auto_reasons=_hopper_heads_auto_reasons, group_partials=True,
    kernels_of="hopper", forward_of="hopper")
HOPPER_PACKED = Variant(
    "hopper_packed", "the hopper kernels on 64-row tiles of 2 or 4 blocks of up to 32 tokens (block-diagonal "
    "mask; a tile with a NaN or inf is done again block by block)", frozenset({9}), False,
    _hopper_packed_call_reasons, _hopper_layout_reasons, _hopper_kernels, packs_blocks=True, num_warps=4,
    verified_on=frozenset({9}), auto_reasons=_hopper_packed_auto_reasons)
HOPPER_WS = Variant(
    "hopper_ws", "experimental Gluon for sm_90, persistent and warp-specialized (a TMA loader warp, 2 stages); "
    "slower than hopper on every measured shape", frozenset({9}), True, _hopper_ws_call_reasons,
    _hopper_ws_layout_reasons, _hopper_ws_kernels, persistent=True,
    # 8 warps launched at 128 registers (the compute warpgroup raises its own): at most 2 programs
    # per SM; shared memory (2 stages) allows 1 backward at D = 128 (139 KB).
    programs_per_sm={(False, False): 2, (False, True): 2, (True, False): 2, (True, True): 1},
    block_m=64, maxnreg=128, verified_on=frozenset({9}))

KEYS = Variant(
    "keys", "Triton backward over key rows: one program per (block, kv head) holds dK and dV of the block's keys "
    "and walks the query heads in 64-row query tiles, scores transposed (the forward: simple's)", None, False,
    _keys_call_reasons, _no_reasons, _keys_kernels, auto_reasons=_keys_auto_reasons, lse_forward=_simple_lse_forward)

HOPPER_WIDE = Variant(
    "hopper_wide", "Gluon for sm_90, backward of blocks of 65-128 tokens at head dims 144-256: the whole block of "
    "one query head in one program (q, k, dO tiles in shared memory, v by column halves, P and dS in v's dead half "
    "tile); grouped query heads one by one, a block's programs side by side, their dK and dV summed over the group "
    "(without rotary by the last of them to finish); its forward: hopper's", frozenset({9}),
    False, _hopper_wide_call_reasons, _hopper_layout_reasons, _hopper_wide_kernels, warpgroup_tiles=True,
    verified_on=frozenset({9}), wide_backward=True, group_partials=True, forward_of="hopper", sums_in_launch=True)

ROTATED = Variant(
    "rotated", "backward of rotary calls in three steps: a Triton pass writes rotated copies of q and k, the "
    "backward without rotary runs on them (the variant auto takes for it, or the flash kernels), a second pass "
    "rotates dq and dk back in place; its forward: the fused kernels'", None, False, _rotated_call_reasons,
    _no_reasons, _rotation_kernels, auto_reasons=_rotated_auto_reasons, rotation_pass=True)

PACKED = Variant(
    "packed", "Triton simple kernels on 64-row tiles of 2 or 4 blocks of up to 32 tokens (block-diagonal "
    "mask; a tile with a NaN or inf is done again block by block); slower than simple or hopper_packed on the "
    "H200, so auto does not take it", frozenset({9}), False,
    _packed_call_reasons, _no_reasons, _simple_kernels, packs_blocks=True, verified_on=frozenset({9}),
    auto_reasons=_packed_auto_reasons)

SM100 = Variant(
    "sm100", "Gluon for sm_100, persistent and warp-specialized: TMA loads, tcgen05 MMA into tensor "
    "memory, load / MMA / softmax partitions; compile-checked, never run on hardware here",
    frozenset({10}), False, _sm100_call_reasons, _hopper_ws_layout_reasons, _sm100_kernels, persistent=True,
    # Tensor and shared memory (140-225 KB) leave no room for a second program per SM.
    programs_per_sm={(False, False): 1, (False, True): 1, (True, False): 1, (True, True): 1},
    verified_on=frozenset(), num_warps=4)

VARIANTS: Dict[str, Variant] = {v.name: v for v in (SIMPLE, HOPPER, HOPPER_PACKED, SM100, HOPPER_WS, PACKED, KEYS,
                                                    HOPPER_WIDE, HOPPER_HEADS, ROTATED)}
# auto's preference, fastest first; simple admits every call.
AUTO_ORDER: Tuple[Variant, ...] = (ROTATED, HOPPER_WIDE, HOPPER_HEADS, KEYS, HOPPER, HOPPER_PACKED, SM100, PACKED,
                                   SIMPLE)

_ENVIRONMENT = "BLOCKATTN_KERNELS"
_UNVERIFIED_ENVIRONMENT = "BLOCKATTN_UNVERIFIED_KERNELS"
# [forced variant name or None, checked]: the environment's until ``force_variant``.
_FORCED: list = [os.environ.get(_ENVIRONMENT, "auto"), False]
_UNVERIFIED = [os.environ.get(_UNVERIFIED_ENVIRONMENT, "0") not in ("", "0")]
_WARNED: set = set()


def allow_unverified(allow: bool = True) -> None:
    """Let ``auto`` take variants with no recorded hardware run on the GPU's generation (they are
    self-checked at first use); ``BLOCKATTN_UNVERIFIED_KERNELS=1`` in the environment does too."""
    _UNVERIFIED[0] = bool(allow)


@contextlib.contextmanager
def unverified_kernels(allow: bool = True):
    """:func:`allow_unverified` (``allow``) inside the block, the previous setting after it."""
    before = _UNVERIFIED[0]
    allow_unverified(allow)
    try:
        yield
    finally:
        _UNVERIFIED[0] = before


def taken_on(device: torch.device, verified_on: FrozenSet[int]) -> bool:
    """Whether a kernel verified on the GPU generations ``verified_on`` may run on ``device``: off
    CUDA (the interpreter), on those generations, or anywhere with :func:`allow_unverified`."""
    return (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] in verified_on
            or _UNVERIFIED[0])


def unverified_allowed() -> bool:
    """Whether kernels with no recorded hardware run may be taken (:func:`allow_unverified`)."""
    return _UNVERIFIED[0]


def _check_name(name: str, origin: str) -> Optional[Variant]:
    if name == "auto":
        return None
    if name not in VARIANTS:
        raise ValueError(f"{origin} must be auto or one of {', '.join(VARIANTS)}, got {name!r}")
    return VARIANTS[name]


def forced() -> Optional[Variant]:
    """The forced variant, or None for ``auto``."""
    if not _FORCED[1]:
        _FORCED[:] = [_check_name(_FORCED[0], _ENVIRONMENT), True]
    return _FORCED[0]


def forced_name() -> Optional[str]:
    """The forced variant's name, or None for ``auto`` (a cache key's part)."""
    variant = forced()
    return None if variant is None else variant.name


def force_variant(name: str) -> None:
    """Force the variant ``name`` for every later call (``"auto"``: none). The host-side caches
    whose entries depend on the choice hold the forced variant in their keys (block plans: the
    variant; remembered forward launches: the forced variant), so nothing is forgotten."""
    _FORCED[:] = [_check_name(name, "force_variant(name)"), True]


@contextlib.contextmanager
def forced_variant(name: str):
    """:func:`force_variant` for the duration of a ``with`` block."""
    before = forced()
    force_variant(name)
    try:
        yield
    finally:
        force_variant("auto" if before is None else before.name)


LSE_REASON = "no forward that stores the logsumexp (which the flash backward reads)"


def _call_reasons(variant: Variant, facts: CallFacts) -> List[str]:
    """The variant's ``call_reasons`` (a forward: those of its ``forward_of``), and where the forward
    must store the logsumexp, a variant with no such kernel (``lse_forward``)."""
    if variant.forward_of is not None and not facts.backward:
        return _call_reasons(VARIANTS[variant.forward_of], facts)
    reasons = list(variant.call_reasons(facts))
    if facts.stores_lse and variant.lse_forward is None:
        reasons.append(LSE_REASON)
    return reasons


def _state_reasons(variant: Variant, facts: CallFacts, by_auto: bool) -> List[str]:
    """Reasons of the process's state: disabled by its self-check, or (for ``auto``) no recorded
    hardware run on this generation without the opt-in."""
    why = self_check.disabled(variant.name)
    if why is not None:
        return [f"disabled: disagreed with the verified kernels at first use ({why})"]
    if by_auto and facts.major is not None and self_check.unverified(variant, facts.major) and not _UNVERIFIED[0]:
        return [f"no hardware run recorded on sm_{facts.major}x: auto takes it only with "
                f"{_UNVERIFIED_ENVIRONMENT}=1 (then self-checked at first use)"]
    return []


def _auto_reasons(variant: Variant, facts: CallFacts) -> List[str]:
    if variant.forward_of is not None and not facts.backward:
        return [f"forward: the {variant.forward_of} kernels' (auto names it {variant.forward_of})"]
    return variant.auto_reasons(facts) if variant.auto_reasons is not None else []


def _auto(facts: CallFacts, q: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Variant:
    for variant in AUTO_ORDER:
        if _auto_takes(variant, facts) and not variant.layout_reasons(q, tensors):
            return variant
    return SIMPLE


def _auto_takes(variant: Variant, facts: CallFacts) -> bool:
    """Whether ``auto`` takes ``variant`` for a call with these facts, short of the tensors' layout."""
    if variant.generations is not None and facts.major not in variant.generations:
        return False
    return not _call_reasons(variant, facts) and not _auto_reasons(variant, facts) and not _state_reasons(
        variant, facts, True)


def _auto_by_facts(facts: CallFacts, order: Tuple[Variant, ...]) -> Variant:
    """The first variant of ``order`` that ``auto`` takes for these facts (layout aside)."""
    return next((variant for variant in order if _auto_takes(variant, facts)), SIMPLE)


def choose(facts: CallFacts, q: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Variant:
    """The variant that computes this call: the forced one where it admits the call, else auto's.
    A forced ``rotated`` (``Variant.rotation_pass``) leaves forwards and calls without rotary to
    auto without a warning: they are the calls it runs around (its inner backward is one). A forced
    backward-only variant (``Variant.forward_of``) stands for that variant in the forward."""
    variant = forced()
    if variant is not None and variant.rotation_pass and not (facts.backward and facts.rot):
        variant = None
    label = repr(variant.name) if variant is not None else None
    if variant is not None and variant.forward_of is not None and not facts.backward:
        variant = VARIANTS[variant.forward_of]
        label += f" (its forward: {variant.name}'s)"
    if variant is not None:
        reasons = (_call_reasons(variant, facts) + _state_reasons(variant, facts, False)
                   + variant.layout_reasons(q, tensors))
        if not reasons:
            return variant
        _warn_once(label, reasons)
    return _auto(facts, q, tensors)


def _warn_once(label: str, reasons: List[str]) -> None:
    """One warning per (forced variant, reasons); ``label``: the variant's quoted name, and for a
    backward-only one in a forward, whose forward it stands for."""
    key = (label, tuple(reasons))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"block kernels: the forced variant {label} cannot compute this call "
                      f"({'; '.join(reasons)}): running the variant auto takes", RuntimeWarning, stacklevel=3)


def explain(facts: CallFacts) -> Dict[str, List[str]]:
    """Every variant's reasons not to run a call with these facts (empty: it runs), in the order
    they are considered: the forced variant first, then ``AUTO_ORDER``. Layout requirements,
    checked per call, are not known here."""
    chosen = forced()
    order = ([chosen] if chosen is not None else []) + [v for v in AUTO_ORDER if v is not chosen]
    order += [v for v in VARIANTS.values() if v not in order]
    reasons: Dict[str, List[str]] = {}
    taken = False
    for variant in order:
        why = _call_reasons(variant, facts) or _state_reasons(variant, facts, variant is not chosen)
        if variant is not chosen and not why:
            why = [f"auto takes another variant here: {r}" for r in _auto_reasons(variant, facts)]
        if variant is not chosen:
            if variant.experimental:
                why.append(f"experimental: runs only when forced ({_ENVIRONMENT}={variant.name})")
            elif variant.generations is not None and facts.major not in variant.generations:
                why.append(f"auto takes it on sm_{min(variant.generations)}x only")
        if not why and taken:
            why.append("a variant before it runs")
        taken = taken or not why
        reasons[variant.name] = why
    return reasons
