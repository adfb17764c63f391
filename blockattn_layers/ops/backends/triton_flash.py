"""The ``triton_flash`` backend: the multi-tile ("jagged flash") kernels.

For blocks longer than one tile (``block_size > SINGLE_TILE_MAX``) and full per-sequence
attention (op argument ``block_size == 0``). As in FA2, the forward returns ``(out, lse)``:
``lse [H, T]`` float32 (natural-log logsumexp of the scaled scores of each query row) lets the
backward recompute ``P`` without a second forward; autograd saves ``out`` and ``lse`` for it.
The backward is deterministic, or fast with atomic dQ (``blockattn_layers.determinism``). The
forward at D = 128 on sm_90 runs the warp-specialized Gluon kernel (``kernels.sm90.flash_fwd``;
GPU tests passed on the H200 and an H100) in its persistent form (``kernels.sm90.flash_persistent``,
one program per SM): full attention (1.02-1.06x the Triton forward on the H200) and blocks over
128 tokens (1.06x / 1.22x at 256 / 512 on an H100); at D 64 full attention, on 192-row query tiles
of three consumer warpgroups (1.10-1.13x the Triton forward on an H100, equal causal); with
``BLOCKATTN_UNVERIFIED_KERNELS=1`` it takes every call it admits (D 64 blocks too). The backward on
sm_90 at full attention is the Gluon kernel (``kernels.sm90.flash_bwd``) where that admits the call:
whole at D 128, the deterministic one's dK/dV pass at D 64; a fast backward runs the deterministic
one wherever its one-pass form measured slower. :func:`_variant_reasons` shows these
choices to the dispatcher (``explain_variants``, ``describe``). ``backend="auto"`` takes this
backend on CUDA devices for what the single-tile ``triton`` backend does not serve.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from blockattn_layers.kernels.block import variants
from blockattn_layers.kernels.flash.bwd import fast_form_taken, flash_attention_bwd
from blockattn_layers.kernels.flash.fwd import flash_attention_fwd

from ...determinism import deterministic_backward
from ...dispatch import AttentionRequest, BackendSpec, register_backend
from ..library import SINGLE_TILE_MAX
from .triton_block import cuda_reasons, triton_devices


def _forward(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor]:
    if gluon_forward_taken(block_size, q.shape[-1]):
        from blockattn_layers.kernels.sm90.flash_fwd import flash_attention_fwd_ws, flash_ws_reasons

        if not flash_ws_reasons(q, k, v, rope_theta):
            return flash_attention_fwd_ws(q, k, v, offsets, block_size, scale, causal, cpu_offsets)
    return flash_attention_fwd(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


# Where the Gluon forward was measured faster than the Triton one (bf16), at full attention and blocks
# over 128 rows: D 128 (H200 and H100; blocks of 256 / 512 on an H100, 2026-12-05: 1.06x / 1.22x) and
# D 64. At D 64, full attention, it runs 192-row items of three consumer warpgroups
# (``sm90.flash_persistent.THREE_CONSUMER_HEAD_DIMS``; H100, bf16, seed3_d64, 2026-12-06, two runs,
# ms, Triton / Gluon: H16 1.368, 1.371 / 1.242, 1.242; causal 0.813, 0.827 / 0.813, 0.827; 16 query
# heads on 4 kv heads 1.397, 1.409 / 1.237, 1.238), on blocks 128-row items (H100, D 64 H4, the bench's
# block lengths, ms, Triton / Gluon: blocks of 256 2.862 / 2.200, of 512 3.783 / 3.464).
GLUON_FORWARD_HEAD_DIMS = frozenset({64, 128})
_GLUON_FORWARD = [True]


@contextlib.contextmanager
def gluon_forward(enabled: bool) -> Iterator[None]:
    """Inside the block the Gluon forward is taken as :func:`gluon_forward_taken` says (``True``)
    or never (``False``: the Triton forward everywhere, as the benchmark's ``triton_flash[triton_fwd]``
    row runs it); the previous setting after it."""
    before = _GLUON_FORWARD[0]
    _GLUON_FORWARD[0] = bool(enabled)
    try:
        yield
    finally:
        _GLUON_FORWARD[0] = before


def gluon_forward_taken(block_size: int, head_dim: int) -> bool:
    """Whether a call of these facts that the warp-specialized Gluon forward admits runs it: full
    attention or blocks over 128 rows (every call of this backend) at D 128 and D 64 (measured
    faster), else only with ``BLOCKATTN_UNVERIFIED_KERNELS=1`` (``variants.allow_unverified``);
    never inside ``gluon_forward(False)``."""
    if not _GLUON_FORWARD[0] or variants.gluon_import_error() is not None:
        return False
    return head_dim in GLUON_FORWARD_HEAD_DIMS or variants.unverified_allowed()


# The flash path's kernels as ``explain_variants`` names them: the warp-specialized Gluon ones
# (``kernels.sm90``: the forward, the dK/dV pass) and the Triton ones (``kernels.flash``).
GLUON_KERNELS = "gluon"
TRITON_KERNELS = "triton"


def _gluon_admits(req: AttentionRequest) -> List[str]:
    """Why the Gluon flash kernels cannot take calls like ``req`` at all (empty: they can, given the
    tensors' layout, checked per call)."""
    error = variants.gluon_import_error()
    if error is not None:
        return [f"Gluon kernels importable ({error})"]
    from blockattn_layers.kernels.sm90.flash_fwd import flash_ws_fact_reasons

    major = req.capability[0] if req.device_type == "cuda" and req.capability is not None else None
    return flash_ws_fact_reasons(major, req.dtype, req.head_dim, req.rotary)


def _variant_reasons(req: AttentionRequest) -> Dict[str, List[str]]:
    """The flash kernels that run a call like ``req``: the forward's ``gluon`` or ``triton`` (the
    first without reasons runs) and, where the backward's choice differs, ``backward: NAME`` (the
    Gluon kernel at full attention: with D 128 in one pass in either backward, ``sm90.flash_bwd.taken``;
    with D 64 as the deterministic one's dK/dV pass, ``sm90.flash_bwd.dkdv_only``, which the fast
    backward runs there, ``flash.bwd.fast_form_taken``). The backward follows the current
    ``blockattn_layers.fast_backward`` setting. Per call the Gluon kernels also need rows of
    ``H * D`` contiguous, 16-byte aligned elements and 32-bit offsets; where a call's tensors lack
    them the Triton kernels run it."""
    admits = _gluon_admits(req)
    forward = list(admits)
    if not admits and not gluon_forward_taken(0 if req.block_size is None else req.block_size, req.head_dim):
        forward.append(f"head dim {req.head_dim}: the Triton forward measured faster, or not yet measured (or "
                       "forced by gluon_forward(False))")
    backward = list(admits)
    if not admits:
        from blockattn_layers.kernels.sm90 import flash_bwd

        if req.capability[0] not in flash_bwd.VERIFIED_ON and not variants.unverified_allowed():
            backward.append("a GPU its tests passed on (unverified kernels allowed)")
        block_size = 0 if req.block_size is None else req.block_size
        deterministic = deterministic_backward() or not fast_form_taken(flash_bwd.taken(False, block_size,
                                                                                         req.head_dim))
        if not flash_bwd.runs(deterministic, block_size, req.head_dim):
            dims = "/".join(str(dim) for dim in sorted(flash_bwd.ORDERED_HEAD_DIMS | flash_bwd.DKDV_ONLY_HEAD_DIMS
                                                       | flash_bwd.FAST_HEAD_DIMS))
            backward.append(f"full attention at D {dims}: the deterministic backward's Triton passes measured "
                            "faster elsewhere (the fast backward runs the deterministic one there)")
    reasons = {GLUON_KERNELS: forward, TRITON_KERNELS: []}
    if bool(backward) != bool(forward):
        reasons.update({f"backward: {GLUON_KERNELS}": backward, f"backward: {TRITON_KERNELS}": []})
    return reasons


def _backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, offsets: Tensor,
    block_size: int, scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    return flash_attention_bwd(
        grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
        rotary_dim, rotary_interleaved, cpu_offsets, deterministic=deterministic_backward(),
    )


def _flash_reasons(req: AttentionRequest) -> list:
    reasons = cuda_reasons(req)
    if req.block_size is not None and req.block_size <= SINGLE_TILE_MAX:
        reasons.append(
            f"block_size {req.block_size} <= {SINGLE_TILE_MAX} (the single-tile 'triton' backend serves it)")
    return reasons


register_backend(BackendSpec(
    name="triton_flash",
    forward=_forward,
    backward=_backward,
    priority=5,
    devices=triton_devices,
    auto_devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    min_capability=(8, 0),
    head_dims=(16, 256),
    max_block_size=None,
    full_attention=True,
    extra_reasons=_flash_reasons,
    variant_reasons=_variant_reasons,
    description="multi-tile Triton kernels with an online softmax (block_size > 128 or None = full "
    "attention), FA2-style deterministic backward; CUDA sm_80+, or CPU tensors under TRITON_INTERPRET=1 "
    "(by name only). On the H200: full attention 1.35x FA2 varlen forward, 1.27-1.28x backward",
))
