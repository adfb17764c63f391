"""The ``triton`` backend: single-pass block kernels (``blockattn_layers.kernels``), one tile per block.

For blocks of up to ``SINGLE_TILE_MAX`` tokens: one exact softmax per block, no logsumexp, and a
backward that recomputes the probabilities from q, k, v. float32 blocks whose tile would not fit a
program's shared memory (``float32_tile_fits``) run forward and backward on the flash kernels. The
block-kernel variants (simple, hopper, ...: ``kernels.block.variants``) declare what they admit; the
launch runs the one they choose, and ``variant_reasons`` shows the choice to the dispatcher's
``explain_variants``. Where no block kernel's backward fits one program (``one_tile_backward_fits``:
blocks over 64 rows with head dims over 128; the op layer's ``saves_lse``), the forward also stores
each row's logsumexp (the variants with such a kernel: ``Variant.lse_forward``), and the backward
runs the flash kernels on the saved output and logsumexp, unless the choice takes a variant with a
backward of its own for those calls (``Variant.wide_backward``: ``hopper_wide`` on sm_90, grouped
query heads one by one, which needs neither). Grouped query heads on 16-bit blocks of 65-128 tokens
at D 96 and 128 (``saves_lse``'s ``GROUPED_SAVES_LSE_HEAD_DIMS``; rotary in the forms of ``GROUPED_SAVES_LSE_ROTARY``)
store them too, and on sm_90 their backward runs on the warp-specialized flash kernel with dQ stored
(``kernels.flash.bwd.stored_dq_takes``: one key tile per block, measured faster than the block kernels
there; a rotary call's through the rotation pass below, whatever the variant choice), unless a variant
is forced; elsewhere the block kernels run it and leave them unread. A rotary
backward the choice runs as a rotation pass (``Variant.rotation_pass``: ``rotated``,
``kernels.block.rotation``) runs this backward without rotary on rotated copies of q and k and rotates
dq and dk back. Where that inner backward is the flash kernel with dQ stored and the kernel rotates dq and dk
back itself (``stored_dq_unrotates``), an eager call with gradients rotates q and k in the forward instead
(``forward_on_rotated``, while ``SAVES_ROTATED_COPIES``): the rotation pass's copies, the forward without rotary
on them, and autograd saves the copies in place of q and k, so that the backward rotates nothing itself
(``backward_on_rotated``). Without gradients (``forward_inference``) it stores none. Kernel sizes are run-time
arguments, so batches of different T and B reuse the compiled kernels. On CPU tensors it runs through
Triton's interpreter under ``TRITON_INTERPRET=1`` (by name only: ``auto`` never picks it there).
"""
from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from blockattn_layers.kernels.block import variants
from blockattn_layers.kernels.block.bwd import (
    backward_variant, block_attention_bwd, forced_without_wide_backward, one_tile_backward_fits, wide_backward_runs,
)
from blockattn_layers.kernels.block.fwd import block_attention_fwd, block_attention_fwd_lse, block_attention_fwd_prepared
from blockattn_layers.kernels.block.plan import float32_tile_fits
from blockattn_layers.kernels.block import rotation
from blockattn_layers.kernels.block.rotation import rotated_backward
from blockattn_layers.kernels.common.meta import MAX_TILE, needs_int64
from blockattn_layers.kernels.flash.bwd import (
    flash_attention_bwd, stored_dq_pair_chunk, stored_dq_reasons, stored_dq_takes, stored_dq_unrotates,
    stored_dq_unrotates_facts,
)
from blockattn_layers.kernels.flash.fwd import flash_attention_fwd

from ...determinism import deterministic_backward
from ...dispatch import AttentionRequest, BackendSpec, register_backend
from .. import library
from ..library import SINGLE_TILE_MAX, call_saves_lse, rotary_form, saves_lse

assert MAX_TILE == SINGLE_TILE_MAX, "the block kernels' tile must be the op layer's single-tile bound"
assert all(saves_lse(block, dim, dtype, 1, "") != one_tile_backward_fits(block, dim, dtype)
           and library.float32_tile_fits(block, dim, dtype) == float32_tile_fits(block, dim, dtype)
           for block in (1, 16, 17, 32, 64, 65, 128) for dim in (16, 64, 128, 144, 256)
           for dtype in (torch.bfloat16, torch.float32)), \
    "with one query head per kv head the op layer must save lse exactly where the block kernels' backward does " \
    "not fit one program"


def _forward(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Optional[Tensor]]:
    args = (q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
            cpu_offsets)
    if not float32_tile_fits(block_size, q.shape[2], q.dtype):
        return flash_attention_fwd(*args)
    if call_saves_lse(q, k, block_size, rope_theta, rotary_dim, rotary_interleaved):
        return block_attention_fwd_lse(*args)
    return block_attention_fwd(*args), None


def _forward_inference(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tensor:
    """The output alone, from the variant the choice takes (no logsumexp to store)."""
    args = (q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
            cpu_offsets)
    if not float32_tile_fits(block_size, q.shape[2], q.dtype):
        return flash_attention_fwd(*args)[0]
    return block_attention_fwd(*args)


def _forward_prepared(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
):
    """:func:`_forward` returning ``(out, prepared)``: its backward's launch, prepared on this thread."""
    return block_attention_fwd_prepared(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


def _backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], lse: Optional[Tensor],
    offsets: Tensor, block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor],
    max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    rot = rotary_dim if rope_theta is not None else 0
    past_one_tile = not one_tile_backward_fits(block_size, q.shape[2], q.dtype)
    if past_one_tile and _flash_backward_fixed(q.dtype, block_size, q.shape[2]):
        return _flash_backward(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                               rotary_dim, rotary_interleaved, cpu_offsets)
    if _stored_dq_backward(grad_out, q, k, v, lse, block_size, rope_theta):
        return _flash_backward(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                               rotary_dim, rotary_interleaved, cpu_offsets)
    # A rotary call whose forward saved lse for it: the rotation pass, its inner backward on the flash kernel.
    rotated_stored_dq = rot > 0 and _stored_dq_backward(grad_out, q, k, v, lse, block_size, None)
    variant = None if rotated_stored_dq else backward_variant(grad_out, q, k, v, block_size, rot, rotary_interleaved,
                                                              positions is not None)
    if rotated_stored_dq or variant.rotation_pass:
        unrotating, pair_chunk = None, 0
        if rotated_stored_dq and stored_dq_unrotates_facts(block_size, q.shape[2], rot, rotary_interleaved):
            unrotating = functools.partial(_unrotating_backward, grad_out, v, out, lse, offsets, block_size, scale,
                                           causal, rope_theta, positions, rot, rotary_interleaved, cpu_offsets)
            pair_chunk = stored_dq_pair_chunk(q.shape[2], rot, rotary_interleaved)
        return rotated_backward(
            lambda qr, kr: _backward(grad_out, qr, kr, v, out, lse, offsets, block_size, scale, causal, None, None, 0,
                                     False, cpu_offsets, max_seqlen),
            q, k, offsets, cpu_offsets, rope_theta, positions, rotary_dim, rotary_interleaved,
            unrotating_backward=unrotating, pair_chunk=pair_chunk)
    if past_one_tile and not wide_backward_runs(variant):
        return _flash_backward(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                               rotary_dim, rotary_interleaved, cpu_offsets)
    return block_attention_bwd(
        grad_out, q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets, variant,
    )


def _unrotating_backward(grad_out, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions, rot,
                         interleaved, cpu_offsets, q_rotated, k_rotated) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """The backward on the rotation pass's copies by the flash kernel with dQ stored, dq and dk rotated back by the
    kernel itself (``stored_dq_unrotates``, checked on the copies), or None where it does not take them."""
    if not stored_dq_unrotates(grad_out, q_rotated, k_rotated, v, block_size, rot, interleaved):
        return None
    return flash_attention_bwd(grad_out, q_rotated, k_rotated, v, out, lse, offsets, block_size, scale, causal, None,
                               None, 0, False, cpu_offsets, deterministic=deterministic_backward(),
                               unrotate=(rope_theta, positions, rot, interleaved))


# Whether eager rotary calls with gradients whose backward the flash kernel with dQ stored runs, rotating dq and dk back
# itself (``stored_dq_unrotates``: grouped query heads on 16-bit blocks of 65-128 tokens at D 96 or 128, interleaved or
# partial rotary over 64 channels or fewer, sm_90), rotate q and k in the forward (``_forward_on_rotated``) rather than
# in the backward: the rotation pass writes the copies (q and k read, the copies written) and the forward without rotary
# runs on them (the rotary forward with the logsumexp store spills: PERF_NOTES sessions 55-56), and autograd saves the
# copies in place of q and k (no more memory), so that the backward is the flash kernel alone. GPU tests pass (H100,
# 2026-12-07). H100, bf16, block 128, D 128, grid lengths, forward + backward ms with it / with the rotation in the
# backward: 8x2 interleaved 4.04 + 5.57 / 3.62 + 7.18, partial 4.13 + 5.13 / 3.10 + 7.12, 4x1 interleaved 2.02 + 2.72 /
# 1.81 + 3.62 (1.09-1.15x; split halves 1.12-1.19x against hopper_heads: BENCHMARKS.md session 57).
SAVES_ROTATED_COPIES = True
# Whether the copies' forward (``SAVES_ROTATED_COPIES``) takes also the calls whose flash backward does not rotate dq
# and dk back itself (split halves over 80 of 128 channels, or over a rotary dim not a multiple of 16, or every split
# form with ``flash_bwd.PAIRED_PARTIAL`` / ``PADDED_PAIRED_SPLIT`` off: ``flash_bwd.pair_chunk``):
# their backward is then the flash kernel on the copies and the rotation pass back (``rotation.unrotated_gradients``),
# and their forward avoids the rotary logsumexp forward's spills. GPU tests pass (H100, 2026-12-07). Taken with
# ``flash_bwd.PADDED_PAIRED_SPLIT`` and ``PAIRED_PARTIAL`` (BENCHMARKS.md session 60, H100, block 128, D 96, forward +
# backward 1.10-1.19x faster than the rotary logsumexp forward and the rotation in the backward).
COPIES_ROTATED_BACK_BY_PASS = True


def _rotated_copies_take(q: Tensor, k: Tensor, v: Tensor, block_size: int, rope_theta: Optional[float],
                         rotary_dim: int, rotary_interleaved: bool) -> bool:
    """Whether :func:`_forward_on_rotated` takes a call: :func:`_rotated_copies_facts` of its facts (the copies'
    layout is the kernel's; the backward checks the rest, ``_backward_on_rotated``)."""
    if rope_theta is None:
        return False
    return _rotated_copies_facts(variants.call_facts(q, k, block_size, rotary_dim, rotary_interleaved,
                                                     needs_int64(q, k, v)))


def _rotated_copies_facts(facts: variants.CallFacts) -> bool:
    """Whether eager rotary calls of these (forward) facts with gradients rotate q and k in the forward
    (``SAVES_ROTATED_COPIES``): where their backward on the copies is the flash kernel with dQ stored
    (:func:`_stored_dq_facts`) and the kernel rotates dq and dk back itself, or a rotation pass does
    (``COPIES_ROTATED_BACK_BY_PASS``)."""
    if not SAVES_ROTATED_COPIES or not facts.rot or not _stored_dq_facts(facts):
        return False
    return COPIES_ROTATED_BACK_BY_PASS or stored_dq_unrotates_facts(facts.block_size, facts.head_dim, facts.rot,
                                                                     facts.interleaved)


def _forward_on_rotated(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor, int]]:
    """``(out, lse, q_rotated, k_rotated, pair_chunk)``: the rotation pass's copies of q and k (their channels in the
    paired-chunk order where ``pair_chunk``, as the flash kernel takes them: ``stored_dq_pair_chunk``) and the
    forward without rotary on them, where :func:`_rotated_copies_take`; else None."""
    if not _rotated_copies_take(q, k, v, block_size, rope_theta, rotary_dim, rotary_interleaved):
        return None
    pair_chunk = stored_dq_pair_chunk(q.shape[2], rotary_dim, rotary_interleaved)
    q_rotated, k_rotated = rotation.rotate_rows(q, k, offsets, cpu_offsets, rope_theta, positions, rotary_dim,
                                               rotary_interleaved, False, False, pair_chunk=pair_chunk)
    out, lse = block_attention_fwd_lse(q_rotated, k_rotated, v, offsets, block_size, scale, causal, None, None, 0,
                                       False, cpu_offsets)
    return out, lse, q_rotated, k_rotated, pair_chunk


def _backward_on_rotated(
    grad_out: Tensor, q_rotated: Tensor, k_rotated: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    offsets: Tensor, block_size: int, scale: float, causal: bool, rope_theta: float,
    positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor],
    max_seqlen: Optional[int], pair_chunk: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v from :func:`_forward_on_rotated`'s copies: the flash kernel with dQ stored rotating
    dq and dk back itself, or, where it does not take the call (``grad_out``'s layout), the backward without
    rotary on the copies, their channels put back in order (``pair_chunk``) and a rotation pass back."""
    grads = _unrotating_backward(grad_out, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                                 rotary_dim, rotary_interleaved, cpu_offsets, q_rotated, k_rotated)
    if grads is not None:
        return grads
    grads = _backward(grad_out, q_rotated, k_rotated, v, out, lse, offsets, block_size, scale, causal, None, None, 0,
                      False, cpu_offsets, max_seqlen)
    return rotation.unrotated_gradients(*grads, offsets, cpu_offsets, rope_theta, positions, rotary_dim,
                                        rotary_interleaved, pair_chunk)


def _flash_backward_fixed(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a backward that no block kernel fits in one program (``saves_lse``) runs on the flash
    kernels whatever the variant choice: float32 tiles over one program's shared memory (flash
    both ways, as ``_variant_reasons`` shows), and a forced variant with neither a backward of its
    own for those calls nor a rotation pass (the flash kernels, as before it was forced; no warning
    that it cannot compute the call)."""
    return not float32_tile_fits(block_size, head_dim, dtype) or forced_without_wide_backward()


def _stored_dq_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Optional[Tensor], block_size: int,
                        rope_theta: Optional[float]) -> bool:
    """Whether a backward whose block kernels fit one program runs on the flash kernel with dQ stored instead:
    where the forward saved out and lse for it (grouped query heads at D 96 and 128, ``saves_lse``),
    no variant is forced, and the kernel takes the call (``stored_dq_takes``: sm_90, no rotary, its layout)."""
    if lse is None or lse.shape[-1] == 0 or variants.forced() is not None:
        return False
    return stored_dq_takes(grad_out, q, k, v, block_size, rope_theta)


def _stored_dq_facts(facts: variants.CallFacts) -> bool:
    """:func:`_stored_dq_backward` of calls of these (forward) facts, short of their layout; of a rotary call, of
    its backward on rotated copies (without rotary), which then runs as a rotation pass."""
    rotary = rotary_form(facts.rot, facts.head_dim, facts.interleaved)
    if variants.forced() is not None or not saves_lse(facts.block_size, facts.head_dim, facts.dtype, facts.groups,
                                                      rotary):
        return False
    major = facts.major if facts.device_type == "cuda" else None
    return not stored_dq_reasons(major, facts.dtype, facts.block_size, facts.head_dim, False, facts.int64)


def _flash_backward(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta, positions,
                    rotary_dim, rotary_interleaved, cpu_offsets) -> Tuple[Tensor, Tensor, Tensor]:
    return flash_attention_bwd(grad_out, q, k, v, out, lse, offsets, block_size, scale, causal, rope_theta,
                               positions, rotary_dim, rotary_interleaved, cpu_offsets,
                               deterministic=deterministic_backward())


def interpreter_active() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_devices() -> frozenset:
    """Where the Triton backends run when asked by name."""
    return frozenset({"cuda", "cpu"}) if interpreter_active() else frozenset({"cuda"})


# The kernels of calls whose block kernels' backward (and, for float32, forward) does not fit one program.
FLASH = "flash"
# The phase, beside "backward", whose variant choice ``_variant_reasons`` may show apart.
FORWARD_WITH_GRADIENTS = "forward with gradients"
# The phase whose variant choice ``_variant_reasons`` shows where the backward runs as a rotation pass.
ROTATED_COPIES = "backward on rotated copies"
# The phase whose variant choice ``_variant_reasons`` shows where an eager forward with gradients runs on rotated
# copies (``SAVES_ROTATED_COPIES``).
FORWARD_ON_ROTATED = "eager forward with gradients on rotated copies"
_NO_ONE_TILE_BACKWARD = ("backward of blocks over 64 tokens with head_dim over 128: the flash kernels run it, "
                         "on the forward's output and logsumexp")
_FLOAT32_TILE = "float32 tile over one program's shared memory: the flash kernels run it"
_STORED_DQ = ("grouped query heads on blocks of 65-128 tokens at D 96 or 128 without rotary on sm_90: the flash "
              "kernel runs the backward (one key tile per block, dQ stored), on the forward's output and logsumexp")
_STORED_DQ_ROTATED = ("grouped query heads on blocks of 65-128 tokens at D 96 or 128 with rotary on sm_90: the "
                      "rotation pass runs the backward, the flash kernel with dQ stored on the rotated copies")
# Every variant's reason for a full-attention call (the backend refuses it too).
FULL_ATTENTION = (f"full attention (block_size=None): the block kernels take blocks of up to {SINGLE_TILE_MAX} "
                  "tokens (triton_flash serves full attention)")


def _variant_reasons(req: AttentionRequest) -> Dict[str, List[str]]:
    """Each block-kernel variant's reasons not to run a call like ``req`` (empty: it runs). Where
    the backward's choice differs from the forward's, its reasons follow under ``backward: NAME``;
    ``backward: flash`` where the flash kernels run the backward (``one_tile_backward_fits`` refuses
    it and no ``Variant.wide_backward`` variant takes it), and
    there, where the forward without gradients takes another variant than the forward with them
    (which stores the logsumexp: ``CallFacts.stores_lse``), the latter's reasons under
    ``forward with gradients: NAME``. Where the backward runs as a rotation pass (``rotated``), the
    choice of its inner backward, without rotary, follows under ``backward on rotated copies: NAME``, and where
    an eager forward with gradients runs on rotated copies (``_rotated_copies_facts``), its choice without rotary
    under ``eager forward with gradients on rotated copies: NAME``
    (where no variant's backward fits one program, ``backward: flash`` shows only where neither a
    ``wide_backward`` variant nor the rotation pass takes the call).
    float32 calls whose tile does not fit (``float32_tile_fits``): ``flash`` both ways, every variant
    with that reason. Full attention (``block_size=None``): every variant with ``FULL_ATTENTION``."""
    rot = (req.rotary_dim or req.head_dim) if req.rotary else 0
    groups = req.num_heads // req.num_kv_heads
    major = req.capability[0] if req.capability is not None else None
    block_size = SINGLE_TILE_MAX if req.block_size is None else req.block_size
    facts = variants.CallFacts(req.device_type, major, req.dtype, req.head_dim, groups, block_size, rot,
                               req.rotary_interleaved, False)
    forward = variants.explain(facts)
    if req.block_size is None:  # (``forward`` gives the variants' order only)
        return {name: [FULL_ATTENTION] for name in forward}
    if not float32_tile_fits(block_size, req.head_dim, req.dtype):
        return {**{name: why + [_FLOAT32_TILE] for name, why in forward.items()}, FLASH: []}
    training = forward
    if saves_lse(block_size, req.head_dim, req.dtype, groups, rotary_form(rot, req.head_dim, req.rotary_interleaved)):
        training = variants.explain(facts._replace(stores_lse=True))
    stored_dq = _stored_dq_facts(facts)
    backward = _backward_reasons(facts, stored_dq)
    reasons = dict(forward)
    if _running(training) != _running(forward):
        reasons.update({f"{FORWARD_WITH_GRADIENTS}: {name}": why for name, why in training.items()})
    if _running(backward) != _running(forward):
        reasons.update({f"backward: {name}": why for name, why in backward.items()})
    running = variants.VARIANTS.get(_running(backward))
    if running is not None and running.rotation_pass:
        inner = _backward_reasons(facts._replace(rot=0, interleaved=False), stored_dq)
        reasons.update({f"{ROTATED_COPIES}: {name}": why for name, why in inner.items()})
    if _rotated_copies_facts(facts):
        copies = variants.explain(facts._replace(rot=0, interleaved=False, stores_lse=True))
        reasons.update({f"{FORWARD_ON_ROTATED}: {name}": why for name, why in copies.items()})
    return reasons


def _backward_reasons(facts: variants.CallFacts, stored_dq: bool) -> Dict[str, List[str]]:
    """Each variant's reasons not to run the backward of a call with these (forward) facts, and
    ``flash``'s where no block kernel's backward fits one program or the flash kernel with dQ stored
    takes it (``stored_dq``: ``_stored_dq_facts`` of the call; with rotary, the rotation pass's variant runs it)."""
    explained = variants.explain(facts._replace(backward=True))
    if one_tile_backward_fits(facts.block_size, facts.head_dim, facts.dtype):
        if stored_dq and facts.rot:
            return {name: [] if variants.VARIANTS[name].rotation_pass else why + [_STORED_DQ_ROTATED]
                    for name, why in explained.items()}
        if stored_dq:
            return {**{name: why + [_STORED_DQ] for name, why in explained.items()}, FLASH: []}
        return explained
    backward = {name: why if variants.VARIANTS[name].wide_backward or variants.VARIANTS[name].rotation_pass
                else why + [_NO_ONE_TILE_BACKWARD] for name, why in explained.items()}
    backward[FLASH] = [] if _running(backward) is None else ["a variant before it runs"]
    return backward


def _running(reasons: Dict[str, List[str]]) -> Optional[str]:
    """The variant that runs: the first without reasons (the dicts follow ``AUTO_ORDER``)."""
    return next((name for name, why in reasons.items() if not why), None)


# The one reason about this machine rather than the call (``cli.backend_choice`` leaves it out when
# it judges a device the machine lacks).
CUDA_UNAVAILABLE = "CUDA is not available"


def cuda_reasons(req: AttentionRequest) -> list:
    if req.device_type == "cuda" and not torch.cuda.is_available():
        return [CUDA_UNAVAILABLE]
    return []


register_backend(BackendSpec(
    name="triton",
    forward=_forward,
    backward=_backward,
    forward_prepared=_forward_prepared,
    forward_inference=_forward_inference,
    forward_on_rotated=_forward_on_rotated,
    backward_on_rotated=_backward_on_rotated,
    priority=10,
    devices=triton_devices,
    auto_devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    min_capability=(8, 0),
    head_dims=(16, 256),
    max_block_size=SINGLE_TILE_MAX,
    full_attention=False,
    extra_reasons=cuda_reasons,
    variant_reasons=_variant_reasons,
    description="single-pass Triton kernels, one tile per block (block_size <= 128); CUDA sm_80+, "
    "or CPU tensors under TRITON_INTERPRET=1",
))
