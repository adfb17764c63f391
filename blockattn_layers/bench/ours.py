"""Our backends as benchmark methods: ``block_attention(..., backend=NAME)`` for every registered backend."""
from __future__ import annotations

import contextlib
import functools
import importlib

from typing import Dict, List, Optional

import torch

import blockattn_layers
from blockattn_layers.ops import backends as _backends
from blockattn_layers._validation import validate_attention_args
from blockattn_layers.determinism import deterministic_backward
from blockattn_layers.ops.backends.triton_block import ROTATED_COPIES

from .common import Case, Inputs, Method, Prepared, RunConfig, module_attrs

# Above this many tokens the reference backend runs on GPU only with --with-reference (it is slow).
REFERENCE_MAX_TOKENS = 1 << 18


def _request(case: Case, cfg: RunConfig) -> blockattn_layers.AttentionRequest:
    """The dispatcher's view of a case, built from a one-token stand-in of its tensors."""
    q = torch.empty(1, case.num_heads, case.head_dim, device=cfg.device, dtype=cfg.dtype)
    k = torch.empty(1, case.kv_heads, case.head_dim, device=cfg.device, dtype=cfg.dtype)
    offsets = torch.tensor([0, 1], device=cfg.device, dtype=torch.int32)
    params = validate_attention_args(
        q, k, k, offsets, case.block_size, scale=None, causal=case.causal, rope_theta=case.rope_theta,
        positions=None, rotary_dim=case.rotary_dim, rotary_interleaved=case.rotary_interleaved, cpu_offsets=None,
        max_seqlen=None, validate=False,
    )
    return blockattn_layers.AttentionRequest.from_call(q, k, params)


def block_kernels(case: Case, cfg: RunConfig) -> Dict[str, Optional[str]]:
    """The kernel variant ``auto`` runs a case with, per mode (``{"fwd": ..., "bwd": ...}``): the
    first variant without reasons of the backend the dispatcher selects, and the backward's own
    where it chooses apart (``backward: NAME``, e.g. ``flash``; ``rotated+NAME`` for a rotation pass
    around the backward NAME without rotary); ``None`` for a backend without
    variants or a case no backend serves."""
    req = _request(case, cfg)
    try:
        spec = blockattn_layers.dispatch.select_backend("auto", req)
    except ValueError:
        return {"fwd": None, "bwd": None}
    if spec.variant_reasons is None:
        return {"fwd": None, "bwd": None}
    reasons = spec.variant_reasons(req)
    fwd, phases = blockattn_layers.dispatch.running_variants(reasons)
    bwd = phases.get("backward", fwd)
    inner = next((name.split(": ", 1)[1] for name, why in reasons.items()
                  if name.startswith(f"{ROTATED_COPIES}: ") and not why), None)
    return {"fwd": fwd, "bwd": f"{bwd}+{inner}" if inner else bwd}


def _skip(spec: blockattn_layers.BackendSpec):
    def skip(case: Case, cfg: RunConfig) -> Optional[str]:
        reasons = spec.not_supported_reasons(_request(case, cfg))
        if reasons:
            return "; ".join(reasons)
        slow = spec.name == "reference" and cfg.device.type == "cuda" and case.total > REFERENCE_MAX_TOKENS
        if slow and not cfg.with_reference:
            return "slow at this size; --with-reference runs it"
        return None

    return skip


def _setup(name: str):
    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        kwargs = dict(rope_theta=case.rope_theta, backend=name, causal=case.causal, rotary_dim=case.rotary_dim,
                      rotary_interleaved=case.rotary_interleaved)
        if cfg.host_offsets:
            kwargs.update(cpu_offsets=inp.cpu_offsets, max_seqlen=case.max_seqlen)

        def forward():
            return blockattn_layers.block_attention(inp.q, inp.k, inp.v, inp.offsets, case.block_size, **kwargs)

        return Prepared(forward, (inp.q, inp.k, inp.v), inp.grad_out)

    return setup


def _attention(case: Case) -> bool:
    return case.layer is None


def _import_failed(err: BaseException):
    def skip(case: Case, cfg: RunConfig) -> Optional[str]:
        return f"not registered: {type(err).__name__}: {err}"

    return skip


def _variant_skip(spec: blockattn_layers.BackendSpec, variant: str):
    backend_skip = _skip(spec)

    def skip(case: Case, cfg: RunConfig) -> Optional[str]:
        from blockattn_layers.kernels.block import variants

        refused = backend_skip(case, cfg)
        if refused:
            return refused
        reasons = spec.variant_reasons(_request(case, cfg))
        backward_apart = blockattn_layers.dispatch.running_variants(reasons)[1].get("backward")
        if variants.VARIANTS[variant].rotation_pass:
            # A backward-only variant: the forward runs auto's either way.
            if backward_apart == variant and variants.forced() is None:
                return f"the '{spec.name}' row runs this variant here"
            return None if case.rope_theta is not None else "no rotary"
        if reasons.get(variant) == [] and backward_apart is None and variants.forced() is None:
            # (Where auto's backward runs another variant, the forced row times this one's backward.)
            return f"the '{spec.name}' row runs this variant here"
        ignored = ("a variant before", "auto takes", "experimental")
        why = [r for r in reasons.get(variant, []) if not r.startswith(ignored)]
        return "; ".join(why) or None

    return skip


def _variant_methods(spec: blockattn_layers.BackendSpec) -> List[Method]:
    """``triton`` with each block-kernel variant forced, side by side (those that can compute the case)."""
    if spec.variant_reasons is None:
        return []
    from blockattn_layers.kernels.block.variants import VARIANTS, forced_variant

    return [
        Method(f"{spec.name}[{variant}]", "ours", _setup(spec.name), _attention, skip=_variant_skip(spec, variant),
               gpu_only=True, description=f"{spec.name} backend, {variant} block kernels forced",
               context=lambda variant=variant: forced_variant(variant))
        for variant in VARIANTS
    ]


def _unverified_kernels():
    from blockattn_layers.kernels.block.variants import unverified_kernels

    return unverified_kernels()


def _gluon_kernel_refusal(case: Case, cfg: RunConfig) -> Optional[str]:
    """Why the Gluon flash forward kernel cannot compute ``case`` here, whatever the op's routing (None: it can)."""
    from blockattn_layers.kernels.block import variants
    from blockattn_layers.kernels.sm90.flash_fwd import flash_ws_call_reasons

    refused = variants.gluon_import_error()
    return refused or "; ".join(flash_ws_call_reasons(cfg.device, cfg.dtype, case.head_dim, case.rope_theta)) or None


def _gluon_refusal(case: Case, cfg: RunConfig) -> Optional[str]:
    """Why the Gluon flash forward cannot compute ``case`` here through ``triton_flash`` (None: it can)."""
    return _flash_skip(case, cfg) or _gluon_kernel_refusal(case, cfg)


def _gluon_by_default(case: Case) -> bool:
    from blockattn_layers.ops.backends.triton_flash import gluon_forward_taken

    return gluon_forward_taken(case.block_size or 0, case.head_dim)


def _gluon_flash_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    refused = _gluon_refusal(case, cfg)
    if refused:
        return refused
    return "the 'triton_flash' row runs the Gluon forward here" if _gluon_by_default(case) else None


GLUON_FLASH = Method(
    "triton_flash[gluon]", "ours", _setup("triton_flash"), _attention, skip=_gluon_flash_skip, gpu_only=True,
    description="triton_flash with the warp-specialized Gluon forward (sm_90; TMA loader warp, two consumer "
                "warpgroups) on every call it admits, its backward the Triton one's",
    context=_unverified_kernels)


@contextlib.contextmanager
def _taken(module, taken: bool, switch: str = "TAKEN"):
    """``module.TAKEN`` (a kernel's default choice; or another such ``switch``) set to ``taken`` for the
    row's calls."""
    before = getattr(module, switch)[0]
    getattr(module, switch)[0] = taken
    try:
        yield
    finally:
        getattr(module, switch)[0] = before


@contextlib.contextmanager
def _gluon_forward_by_tiles():
    """The Gluon forward on every call it admits, one program per query tile (``sm90.flash_fwd``; its
    persistent form, ``sm90.flash_persistent``, off)."""
    from blockattn_layers.kernels.sm90 import flash_persistent

    with _taken(flash_persistent, False), _unverified_kernels():
        yield


GLUON_FLASH_BY_TILES = Method(
    "triton_flash[gluon_tiles]", "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal,
    gpu_only=True, description="triton_flash with the warp-specialized Gluon forward run one program per query "
                               "tile (sm_90; the persistent form, one program per SM, off), its backward the "
                               "Triton one's",
    context=_gluon_forward_by_tiles)


def _gluon_forward_option(name: str, module: str, description: str, **values) -> Method:
    """A row timing the Gluon forward on every call it admits with ``kernels.sm90.<module>``'s constants
    set to ``values`` (``bench.common.module_attrs``) for its calls."""
    @contextlib.contextmanager
    def context():
        kernels = importlib.import_module(f"blockattn_layers.kernels.sm90.{module}")
        with module_attrs(kernels, **values), _unverified_kernels():
            yield

    return Method(name, "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
                  description=description, context=context)


def _uniform_loops(overlap: bool, split_kv: bool) -> dict:
    """``flash_persistent.LOOPS`` (keys: head dim, full attention) with one consumer loop everywhere."""
    return {(dim, full): (overlap, split_kv) for dim in (64, 128) for full in (True, False)}


# The item and ping-pong rows run the serial loop on one barrier pair, as they were measured.
GLUON_FLASH_M128 = _gluon_forward_option(
    "triton_flash[gluon_m128]", "flash_persistent",
    "triton_flash with the persistent Gluon forward on 128-row query tiles (two consumer warpgroups) everywhere, "
    "where it takes 192-row tiles at full attention with D 64, serial loop on one barrier pair, on every call it "
    "admits", THREE_CONSUMER_HEAD_DIMS=frozenset(), LOOPS=_uniform_loops(False, False))
GLUON_FLASH_M192 = _gluon_forward_option(
    "triton_flash[gluon_m192]", "flash_persistent",
    "triton_flash with the persistent Gluon forward on 192-row query tiles (three consumer warpgroups) at full "
    "attention with D 128 as at D 64 (64-row key tiles at D 128), serial loop on one barrier pair, on every call "
    "it admits", THREE_CONSUMER_HEAD_DIMS=frozenset({64, 128}), LOOPS=_uniform_loops(False, False))
GLUON_FLASH_PINGPONG = _gluon_forward_option(
    "triton_flash[gluon_pingpong]", "flash_persistent",
    "triton_flash with the persistent Gluon forward's consumers issuing their products in turns in the serial loop "
    "(FlashAttention-3's inter-warpgroup ping-pong) on one barrier pair, on every call it admits",
    PINGPONG=True, LOOPS=_uniform_loops(False, False))


GLUON_FLASH_SHIFT_LAST = _gluon_forward_option(
    "triton_flash[gluon_shift_last]", "flash_persistent",
    "triton_flash with the persistent Gluon forward's ragged last key tile of a block taken from the block's last "
    "keys (no wait in the loader; serial loops only) on every call it admits, full attention included (by "
    "default blocks of up to 256 tokens)", SHIFT_LAST_BLOCKS=(0, 1 << 62))
GLUON_FLASH_EARLY_RELEASE = _gluon_forward_option(
    "triton_flash[gluon_early_release]", "flash_persistent",
    "triton_flash with the persistent Gluon forward's consumers giving the previous item's query buffer back after "
    "the first Q K^T (not the first P V), on every call it admits", EARLY_RELEASE=True)
GLUON_FLASH_THREAD_RELEASE = _gluon_forward_option(
    "triton_flash[gluon_thread_release]", "flash_persistent",
    "triton_flash with the persistent Gluon forward's consumers handing key and value slots back by every "
    "thread's own arrival (no warpgroup barrier before one elected arrival), on every call it admits",
    THREAD_RELEASE=True)
GLUON_FLASH_LOOPS = [
    _gluon_forward_option(
        f"triton_flash[gluon_{name}]", "flash_persistent",
        f"triton_flash with the persistent Gluon forward's {what} everywhere (flash_persistent.LOOPS), on every "
        "call it admits", LOOPS=_uniform_loops(overlap, split_kv))
    for name, what, overlap, split_kv in (
        ("serial_joint", "serial consumer loop on one barrier pair per key tile (the loop before 2026-12-06)",
         False, False),
        ("split_kv", "serial consumer loop with k and v on barriers of their own", False, True),
        ("overlap_joint", "overlapped consumer loop on one barrier pair per key tile", True, False),
        ("overlap_split_kv", "overlapped consumer loop with k and v on barriers of their own", True, True))]


def _triton_forward_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    refused = _flash_skip(case, cfg)
    if refused:
        return refused
    if _gluon_refusal(case, cfg) or not _gluon_by_default(case):
        return "the 'triton_flash' row runs the Triton forward here"
    return None


def _triton_forward():
    from blockattn_layers.ops.backends.triton_flash import gluon_forward

    return gluon_forward(False)


TRITON_FORWARD = Method(
    "triton_flash[triton_fwd]", "ours", _setup("triton_flash"), _attention, skip=_triton_forward_skip, gpu_only=True,
    description="triton_flash with the Triton forward where the backend takes the Gluon one (full attention, D 128, "
                "sm_90)",
    context=_triton_forward)


def _flash_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    if case.block_size is not None and case.block_size <= 128:
        return "blocks of up to 128 tokens run the single-tile kernels"
    return None


FAST_BACKWARD = Method(
    "triton_flash[fast_bwd]", "ours", _setup("triton_flash"), _attention, skip=_flash_skip, gpu_only=True,
    description="triton_flash with the fast backward (blockattn_layers.fast_backward): on sm_90 at full attention "
                "with D 128 the warp-specialized Gluon kernel in one pass, dQ's terms added in any order; the "
                "deterministic backward elsewhere (measured faster)",
    context=blockattn_layers.fast_backward)


@contextlib.contextmanager
def _triton_fast_backward():
    """The fast backward with the Triton dK/dV pass (its dQ terms by per-tile TMA reductions)
    everywhere: the Gluon one not taken, the Triton one taken (``flash.bwd.TRITON_FAST_TAKEN``)."""
    from blockattn_layers.kernels.flash import bwd
    from blockattn_layers.kernels.sm90 import flash_bwd

    with blockattn_layers.fast_backward(), _taken(flash_bwd, False, "FAST_TAKEN"), \
            _taken(bwd, True, "TRITON_FAST_TAKEN"):
        yield


@contextlib.contextmanager
def _triton_backward():
    """The deterministic backward by the Triton passes everywhere: the Gluon kernel not taken whole
    (``ORDERED_HEAD_DIMS``) nor as the dK/dV pass (``DKDV_ONLY_HEAD_DIMS``)."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    with blockattn_layers.fast_backward(False), module_attrs(flash_bwd, ORDERED_HEAD_DIMS=frozenset(),
                                                       DKDV_ONLY_HEAD_DIMS=frozenset()):
        yield


TRITON_BACKWARD = Method(
    "triton_flash[triton_bwd]", "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
    description="triton_flash with the deterministic backward by the Triton kernels where the Gluon kernel would "
                "take it (sm_90, full attention)",
    context=_triton_backward)


TRITON_FAST_BACKWARD = Method(
    "triton_flash[triton_fast_bwd]", "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
    description="triton_flash with the fast backward by the Triton kernels where the Gluon dK/dV pass would take "
                "it (sm_90)",
    context=_triton_fast_backward)


@contextlib.contextmanager
def _gluon_backward(fast: bool, writer: bool = True, early_p: bool = False, rows_by_loader: bool = True,
                    thread_release: bool = True, dq_lag: bool = False, stagger: bool = False,
                    lean_writer: bool = True, dq_store: bool = False, delta_in_kernel: bool = False):
    """The deterministic (or ``fast``) backward, its dK/dV pass by the Gluon kernel (``sm90.flash_bwd``)
    wherever that admits the call (the forward: the Gluon one wherever it admits it); ``writer``: dQ's
    adds by the writer partition (``DQ_WRITER``), else by the consumers; ``early_p``: P computed beside
    dP's product (``P_BESIDE_DP``); ``rows_by_loader``: lse and delta copied by the loader
    (``ROWS_BY_LOADER``); ``thread_release``: slots released by every consumer thread (``THREAD_RELEASE``);
    ``dq_lag``: each step's dQ product the step before's (``DQ_LAG``); ``stagger``: warpgroup 1 half a step
    behind (``STAGGER``); ``lean_writer``: the writer warp on fewer registers, consumer 1 on more
    (``LEAN_WRITER``, the default since session 58); ``dq_store``: dQ stored by the kernel where one key tile
    holds the block (``DQ_STORE``, at D 64, 96 and 128; without it the float32 sums at every head dim:
    ``DQ_STORE_HEAD_DIMS``);
    ``delta_in_kernel``: with it, the delta rows computed in the kernel (``DELTA_IN_KERNEL``)."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    with blockattn_layers.fast_backward(fast), _taken(flash_bwd, True), _unverified_kernels(), \
            module_attrs(flash_bwd, DQ_WRITER=writer, P_BESIDE_DP=early_p, ROWS_BY_LOADER=rows_by_loader,
                         THREAD_RELEASE=thread_release, DQ_LAG=dq_lag, STAGGER=stagger,
                         LEAN_WRITER=lean_writer, DELTA_IN_KERNEL=delta_in_kernel,
                         DQ_STORE_HEAD_DIMS=frozenset({64, 96, 128}) if dq_store else frozenset()):
        yield


@contextlib.contextmanager
def _gluon_dkdv_only_backward(narrow: bool = False):
    """The deterministic backward with its dK/dV pass by the Gluon kernel without dQ's terms
    (``sm90.flash_bwd.DKDV_ONLY_TAKEN``) beside the Triton dQ pass, at full attention with D 128 too
    (``ORDERED_HEAD_DIMS`` emptied); ``narrow``: over 64 query rows a step at every head dim
    (``DKDV_ONLY_WIDE_HEAD_DIMS`` emptied)."""
    from blockattn_layers.kernels.sm90 import flash_bwd

    wide_dims = frozenset() if narrow else flash_bwd.DKDV_ONLY_WIDE_HEAD_DIMS
    with blockattn_layers.fast_backward(False), _taken(flash_bwd, True, "DKDV_ONLY_TAKEN"), _unverified_kernels(), \
            module_attrs(flash_bwd, ORDERED_HEAD_DIMS=frozenset(), DKDV_ONLY_WIDE_HEAD_DIMS=wide_dims):
        yield


GLUON_DKDV_ONLY_BACKWARD = Method(
    "triton_flash[gluon_dkdv_bwd]", "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
    description="triton_flash with the deterministic backward, its dK/dV pass by the warp-specialized Gluon kernel "
                "computing dK and dV only (the Triton dQ pass beside it), the Gluon forward on every call it admits",
    context=_gluon_dkdv_only_backward)
GLUON_DKDV_ONLY_NARROW_BACKWARD = Method(
    "triton_flash[gluon_dkdv_m64]", "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
    description="triton_flash[gluon_dkdv_bwd] with the dK/dV-only pass stepping over 64 query rows at every head "
                "dim (128 at D 64 by default)",
    context=functools.partial(_gluon_dkdv_only_backward, True))


GLUON_BACKWARDS = [
    Method(name, "ours", _setup("triton_flash"), _attention, skip=_gluon_refusal, gpu_only=True,
           description=f"triton_flash with the {mode} backward, its dK/dV pass by the warp-specialized Gluon kernel "
                       "(sm_90; TMA loader warp, two consumer warpgroups over a 128-row key tile) adding dQ's terms "
                       f"{order}, the Gluon forward on every call it admits",
           context=functools.partial(_gluon_backward, fast, writer, early_p, rows_by_loader, thread_release, *more))
    for name, mode, order, fast, writer, early_p, rows_by_loader, thread_release, *more in (
        ("triton_flash[gluon_bwd]", "deterministic", "in a fixed order from a writer warp on fewer registers (the "
         "consumers store their terms in shared memory and go on), each step's lse and delta copied by the loader "
         "warp, the ring's slots released by every consumer thread", False, True, False, True, True),
        ("triton_flash[gluon_fast_bwd]", "fast", "in any order by TMA reduce-adds from a writer warp on fewer "
         "registers (the consumers store their terms in shared memory and go on), each step's lse and delta copied "
         "by the loader warp, the ring's slots released by every consumer thread", True, True, False, True, True),
        ("triton_flash[gluon_bwd_consumer_adds]", "deterministic", "in a fixed order by the consumers' own atomic "
         "adds", False, False, False, False, False),
        ("triton_flash[gluon_fast_bwd_consumer_adds]", "fast", "in any order by the consumers' own atomic adds",
         True, False, False, False, False),
        ("triton_flash[gluon_fast_bwd_p_beside_dp]", "fast", "in any order by TMA reduce-adds from a writer warp, "
         "each step's P computed while dP's product runs, lse and delta copied by the loader warp, slots released "
         "by every consumer thread", True, True, True, True, True),
        ("triton_flash[gluon_fast_bwd_rows_by_loader]", "fast", "in any order by TMA reduce-adds from a writer "
         "warp, each step's lse and delta copied by the loader warp", True, True, False, True, False, False, False,
         False),
        ("triton_flash[gluon_bwd_rows_by_loader]", "deterministic", "in a fixed order from a writer warp, each "
         "step's lse and delta copied by the loader warp", False, True, False, True, False, False, False, False),
        ("triton_flash[gluon_fast_bwd_consumer_rows]", "fast", "in any order by TMA reduce-adds from a writer "
         "warp, each consumer copying its own lse and delta rows, the ring's slots released by one elected "
         "arrival after a warpgroup barrier (the default before session 56)", True, True, False, False, False, False,
         False, False),
        ("triton_flash[gluon_bwd_consumer_rows]", "deterministic", "in a fixed order from a writer warp, each "
         "consumer copying its own lse and delta rows, the ring's slots released by one elected arrival after a "
         "warpgroup barrier (the default before session 56)", False, True, False, False, False, False, False,
         False),
        ("triton_flash[gluon_fast_bwd_dq_lag]", "fast", "in any order by TMA reduce-adds from a writer warp, "
         "each step's dQ product the step before's (no meeting of the warpgroups mid-step), lse and delta copied "
         "by the loader warp, slots released by every consumer thread, the writer warp on fewer registers", True, True,
         False, True, True, True, False, True),
        ("triton_flash[gluon_bwd_dq_lag]", "deterministic", "in a fixed order from a writer warp, each step's dQ "
         "product the step before's, lse and delta copied by the loader warp, slots released by every consumer "
         "thread, the writer warp on fewer registers", False, True, False, True, True, True, False, True),
        ("triton_flash[gluon_fast_bwd_stagger]", "fast", "in any order by TMA reduce-adds from a writer warp, "
         "each step's dQ product the step before's, the second consumer warpgroup half a step behind the first, "
         "lse and delta copied by the loader warp, slots released by every consumer thread, the writer warp on "
         "fewer registers", True, True, False, True, True, True, True, True),
        ("triton_flash[gluon_fast_bwd_full_writer]", "fast", "in any order by TMA reduce-adds from a writer warp "
         "on as many registers as the loader's (the second consumer warpgroup on fewer than the first: the default "
         "before session 58), lse and delta copied by the loader warp, slots released by every consumer thread",
         True, True, False, True, True, False, False, False),
        ("triton_flash[gluon_bwd_full_writer]", "deterministic", "in a fixed order from a writer warp on as many "
         "registers as the loader's (the default before session 58), lse and delta copied by the loader warp, "
         "slots released by every consumer thread", False, True, False, True, True, False, False, False),
    )
]


class _FlashKernels(torch.autograd.Function):
    """The flash kernels called directly (not through the op, whose contract gives blocks of up to
    128 tokens to the single-tile kernels, but for the sm_90 backward of grouped query heads on blocks of
    65-128 at D 128, ``ops.library.saves_lse``): the forward saves its output and logsumexp, or, with
    ``recompute``, the backward computes them again first, as the ``triton`` backend did where no
    block kernel's backward fits (``one_tile_backward_fits``) until session 23 (it now saves them
    from the simple forward). With ``gluon`` the forward is the warp-specialized Gluon one
    (``sm90.flash_fwd.flash_attention_fwd_ws``, its persistent form where taken). The backward runs
    in the package's mode (``blockattn_layers.fast_backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, block_size, params, recompute, gluon=False):
        from blockattn_layers.kernels.flash.fwd import flash_attention_fwd

        if gluon:
            from blockattn_layers.kernels.sm90.flash_fwd import flash_attention_fwd_ws

            out, lse = flash_attention_fwd_ws(q, k, v, offsets, block_size, params.scale, params.causal)
        else:
            out, lse = flash_attention_fwd(q, k, v, offsets, block_size, params.scale, params.causal,
                                           params.rope_theta, None, params.rotary_dim, params.rotary_interleaved, None)
        ctx.block_size, ctx.params, ctx.recompute = block_size, params, recompute
        ctx.save_for_backward(q, k, v, offsets, *(() if recompute else (out, lse)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from blockattn_layers.kernels.flash.bwd import flash_attention_bwd
        from blockattn_layers.kernels.flash.fwd import flash_attention_fwd

        p, block_size = ctx.params, ctx.block_size
        q, k, v, offsets, *saved = ctx.saved_tensors
        if ctx.recompute:
            saved = flash_attention_fwd(q, k, v, offsets, block_size, p.scale, p.causal, p.rope_theta, None,
                                        p.rotary_dim, p.rotary_interleaved, None)
        out, lse = saved
        grads = flash_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, offsets, block_size, p.scale, p.causal,
                                    p.rope_theta, None, p.rotary_dim, p.rotary_interleaved, None,
                                    deterministic=deterministic_backward())
        return (*grads, None, None, None, None, None)


def _flash_kernels_setup(recompute: bool, gluon: bool = False):
    def setup(case: Case, inp: Inputs, cfg: RunConfig) -> Prepared:
        params = validate_attention_args(
            inp.q, inp.k, inp.v, inp.offsets, case.block_size, scale=None, causal=case.causal,
            rope_theta=case.rope_theta, positions=None, rotary_dim=case.rotary_dim,
            rotary_interleaved=case.rotary_interleaved, cpu_offsets=None, max_seqlen=None, validate=False)

        def forward():
            return _FlashKernels.apply(inp.q, inp.k, inp.v, inp.offsets, case.block_size, params, recompute, gluon)

        return Prepared(forward, (inp.q, inp.k, inp.v), inp.grad_out)

    return setup


def _flash_kernels_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    if case.block_size is None or case.block_size > 128:
        return "the 'triton_flash' row runs these kernels here"
    return None


def _gluon_kernels_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    return _flash_kernels_skip(case, cfg) or _gluon_kernel_refusal(case, cfg)


def _gluon_kernels_options(**values):
    """The context of a ``flash_kernels[gluon*]`` row: unverified kernels allowed, ``sm90.flash_persistent``'s
    constants set to ``values``."""
    @contextlib.contextmanager
    def context():
        from blockattn_layers.kernels.sm90 import flash_persistent

        with module_attrs(flash_persistent, **values), _unverified_kernels():
            yield

    return context


FLASH_KERNELS = [
    Method(name, "ours", _flash_kernels_setup(recompute), _attention, skip=_flash_kernels_skip, gpu_only=True,
           opt_in="a measurement of the kernels outside the op: run when --backends names it",
           description=description)
    for name, recompute, description in (
        ("flash_kernels", False, "the flash kernels called directly at blocks of up to 128 tokens (outside the op, "
         "which gives those to the single-tile kernels but for the sm_90 grouped D 128 backward over 64 tokens), "
         "output and logsumexp saved"),
        ("flash_kernels[recompute]", True, "flash_kernels with the backward recomputing output and logsumexp, as "
         "the triton backend did where no block kernel's backward fits (it now saves them)"),
    )
] + [
    Method(name, "ours", _flash_kernels_setup(False, gluon=True), _attention, skip=_gluon_kernels_skip, gpu_only=True,
           opt_in="a measurement of the kernels outside the op: run when --backends names it",
           description=description, context=_gluon_kernels_options(**values))
    for name, description, values in (
        ("flash_kernels[gluon]", "flash_kernels with the persistent Gluon forward (sm_90) at blocks of up to 128 "
         "tokens, as it is launched for blocks over 128", {}),
        ("flash_kernels[gluon_early_release]", "flash_kernels[gluon] with the previous item's query buffer released "
         "after the first Q K^T (flash_persistent.EARLY_RELEASE)", dict(EARLY_RELEASE=True)),
        ("flash_kernels[gluon_share_kv]", "flash_kernels[gluon_early_release] with a block's grouped query heads "
         "reusing one copy of its key tile (flash_persistent.SHARE_KV)", dict(EARLY_RELEASE=True, SHARE_KV=True)),
    )
] + [
    Method(name, "ours", _flash_kernels_setup(False, gluon=True), _attention, skip=_gluon_kernels_skip, gpu_only=True,
           opt_in="a measurement of the kernels outside the op: run when --backends names it",
           description=description, context=functools.partial(_gluon_backward, **options))
    for name, description, options in (
        ("flash_kernels[gluon_fast_bwd]", "flash_kernels[gluon] with the fast backward by the warp-specialized Gluon "
         "kernel (dQ's float32 sums by TMA reduce-adds in any order, a delta pass before and a cast pass after) at "
         "blocks of up to 128 tokens", dict(fast=True)),
        ("flash_kernels[gluon_bwd]", "flash_kernels[gluon_fast_bwd] with the deterministic backward (the writer's "
         "adds in a fixed order)", dict(fast=False)),
        ("flash_kernels[gluon_fast_bwd_dq_store]", "flash_kernels[gluon_fast_bwd] with dQ stored by the kernel, no "
         "float32 sums or cast pass (sm90.flash_bwd.DQ_STORE, at D 64 too)", dict(fast=True, dq_store=True)),
        ("flash_kernels[gluon_fast_bwd_dq_store_consumer_rows]", "flash_kernels[gluon_fast_bwd_dq_store] with "
         "each consumer copying its own lse and delta rows and the slots released by one elected arrival",
         dict(fast=True, dq_store=True, rows_by_loader=False, thread_release=False)),
        ("flash_kernels[gluon_fast_bwd_dq_store_delta]", "flash_kernels[gluon_fast_bwd_dq_store] with the delta rows "
         "computed in the kernel from O's tiles, no delta pass (sm90.flash_bwd.DELTA_IN_KERNEL)",
         dict(fast=True, dq_store=True, delta_in_kernel=True)),
    )
]


def our_methods() -> List[Method]:
    """One method per registered backend, highest priority first, plus the ``triton`` block-kernel
    variants (a triton import failure shows as a row)."""
    methods = []
    for spec in blockattn_layers.registered_backends():
        methods.append(Method(spec.name, "ours", _setup(spec.name), _attention, skip=_skip(spec), gpu_only=False,
                              description=spec.description))
        methods.extend(_variant_methods(spec))
        if spec.name == "triton_flash":
            methods.extend([FAST_BACKWARD, TRITON_BACKWARD, TRITON_FAST_BACKWARD, GLUON_FLASH, GLUON_FLASH_BY_TILES,
                            GLUON_FLASH_M128,
                            GLUON_FLASH_M192, GLUON_FLASH_PINGPONG, GLUON_FLASH_SHIFT_LAST, GLUON_FLASH_EARLY_RELEASE,
                            GLUON_FLASH_THREAD_RELEASE,
                            *GLUON_FLASH_LOOPS,
                            *GLUON_BACKWARDS, GLUON_DKDV_ONLY_BACKWARD,
                            GLUON_DKDV_ONLY_NARROW_BACKWARD, TRITON_FORWARD,
                            *FLASH_KERNELS])
    err = getattr(_backends, "TRITON_IMPORT_ERROR", None)
    if err is not None and all(m.name != "triton" for m in methods):
        methods.insert(0, Method("triton", "ours", _setup("triton"), _attention, skip=_import_failed(err),
                                 gpu_only=False, description="Triton backend (import failed)"))
    return methods
