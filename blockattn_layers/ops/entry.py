"""The entry point of the public functions into the op layer.

:func:`attention` takes a validated call and the backend the dispatcher chose for it. While
``torch.compile`` / ``torch.export`` trace it and under dispatch modes (``FlopCounterMode``, user
fake modes) it calls the registered ops
(:mod:`.library`), whose autograd and FLOP formulas then apply. For plain tensors in eager mode
it calls the backend's implementation directly through a ``torch.autograd.Function``: the
custom-op wrappers' host work is about half the host time of a call, which is what small
batches pay for. A backend with ``forward_prepared`` prepares its backward's launch in the
forward, on the caller's thread; the autograd engine runs the backward on its device thread
and launches that where it holds. A backend with ``forward_on_rotated`` may compute a rotary call that saves
lse on rotated copies of q and k, which autograd saves in their place, so that the backward rotates nothing
but dq and dk. ``torch.func`` transforms are refused: the op's autograd
(``register_autograd``) has no functorch rules in the torch versions tested.
"""
from __future__ import annotations

import enum
from typing import Callable

import torch
from torch import Tensor

from .._params import AttentionParams
from ..dispatch import BackendSpec
from .. import reference
from ..runtime import private_api
from . import library


def _eager(x: Tensor) -> bool:
    """A plain tensor with data, outside tracing and dispatch modes."""
    return (type(x) is torch.Tensor and not x.is_meta and not torch.compiler.is_compiling()
            and private_api.dispatch_stack_depth() == 0)


def plain_eager(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Plain tensors outside tracing, dispatch modes and functorch transforms. (A tensor left
    over from an exited ``torch.func`` transform is a functorch wrapper, though its type is
    ``torch.Tensor``.)"""
    if not _eager(q) or private_api.functorch_transforms_active():
        return False
    is_wrapped = private_api.is_functorch_wrapped
    return not (is_wrapped(q) or is_wrapped(k) or is_wrapped(v))


def raw_apply(function: type) -> Callable:
    """``function.apply`` without its Python wrapper, for plain tensors outside functorch transforms.

    ``torch.autograd.Function.apply`` binds default arguments when ``setup_context`` is defined
    (not here), checks for functorch transforms and unwraps tensors of exited transforms (the
    caller checks both: :func:`plain_eager`) before calling the C implementation: about a third of
    the host time of the call. Where torch lacks the C ``apply``, ``function.apply``.
    """
    raw = private_api.FUNCTION_APPLY
    if raw is None or not hasattr(raw, "__get__"):
        return function.apply
    return raw.__get__(None, function)


def _save(ctx, spec: BackendSpec, q, k, v, offsets, args: tuple, out, lse) -> None:
    block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen = args
    ctx.save_for_backward(q, k, v, offsets, positions, cpu_offsets, out, lse)
    ctx.scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen)
    ctx.spec = spec


class _EagerAttention(torch.autograd.Function):
    """The chosen backend's implementations, for plain tensors. The op arguments after offsets
    travel as one tuple: ``apply``'s host time grows with the number of arguments."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, spec, args):
        out, lse = spec.forward(q, k, v, offsets, *args)
        _save(ctx, spec, q, k, v, offsets, args, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, offsets, positions, cpu_offsets, out, lse = ctx.saved_tensors
        block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen = ctx.scalars
        rest = (offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
                cpu_offsets, max_seqlen)
        if _eager(grad_out):
            grads = ctx.spec.backward(grad_out, q, k, v, out, lse, *rest)
        else:
            grads = library.attention_bwd(grad_out, q, k, v, out, lse, *rest, ctx.spec.name)
        return (*grads, None, None, None)


class _PreparedAttention(_EagerAttention):
    """:class:`_EagerAttention` with the backward's launch prepared by the forward (single-tile
    kinds: nothing but q, k, v is saved)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, spec, args):
        out, ctx.prepared = spec.forward_prepared(q, k, v, offsets, *args)
        _save(ctx, spec, q, k, v, offsets, args, None, None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.prepared is not None and type(grad_out) is torch.Tensor:
            q, k, v = ctx.saved_tensors[:3]
            grads = ctx.prepared.launch(grad_out, q, k, v)
            if grads is not None:
                return (*grads, None, None, None)
        return _EagerAttention.backward(ctx, grad_out)


class _RotatedAttention(_EagerAttention):
    """:class:`_EagerAttention` computing a rotary call on rotated copies of q and k (the backend's
    ``forward_on_rotated``), which autograd saves in place of q and k; where the backend does not take
    the call, the ordinary forward."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, spec, args):
        result = spec.forward_on_rotated(q, k, v, offsets, *args)
        ctx.on_rotated = result is not None
        if result is None:
            return _EagerAttention.forward(ctx, q, k, v, offsets, spec, args)
        out, lse, q_rotated, k_rotated, ctx.pair_chunk = result
        _save(ctx, spec, q_rotated, k_rotated, v, offsets, args, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.on_rotated:
            return _EagerAttention.backward(ctx, grad_out)
        q_rotated, k_rotated, v, offsets, positions, cpu_offsets, out, lse = ctx.saved_tensors
        block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen = ctx.scalars
        if _eager(grad_out):
            grads = ctx.spec.backward_on_rotated(grad_out, q_rotated, k_rotated, v, out, lse, offsets, block_size,
                                                 scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
                                                 cpu_offsets, max_seqlen, ctx.pair_chunk)
        else:
            grads = library.attention_bwd(grad_out, q_rotated, k_rotated, v, out, lse, offsets, block_size, scale,
                                          causal, None, None, 0, False, cpu_offsets, max_seqlen, ctx.spec.name)
            grads = _rotated_back(*grads, offsets, rope_theta, positions, rotary_dim, rotary_interleaved,
                                  ctx.pair_chunk)
        return (*grads, None, None, None)


def _rotated_back(dq, dk, dv, offsets, rope_theta, positions, rotary_dim, interleaved, pair_chunk) -> tuple:
    """The gradients of q, k, v from those of their rotated copies where the backward ran through the op (a
    dispatch mode or tracing during the backward: ``grad_out`` no plain tensor): dq and dk put back in order
    (``reference.unpaired_chunks``) and rotated back by the reference rotation (torch operations)."""
    if positions is None:
        positions = reference.sequence_positions(offsets, dq.shape[0])
    angles = reference.rotary_angles(positions, rope_theta, rotary_dim, torch.float32)
    back = [reference.apply_rotary(reference.unpaired_chunks(g, pair_chunk, rotary_dim).float(), angles, rotary_dim,
                                   interleaved, inverse=True).to(g.dtype) for g in (dq, dk)]
    return back[0], back[1], dv


_eager_apply = raw_apply(_EagerAttention)
_prepared_apply = raw_apply(_PreparedAttention)
_rotated_apply = raw_apply(_RotatedAttention)


def backend_name(backend) -> str:
    """The ``backend`` argument as the string the ops take."""
    return backend.value if isinstance(backend, enum.Enum) else backend


def attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, params: AttentionParams, spec: BackendSpec,
              backend) -> Tensor:
    """Attention ``[T, H, D]`` for a validated call; ``spec`` is what the dispatcher chose for
    ``backend`` (the op, when it runs, chooses the same from the tensors)."""
    args = params.op_args()
    if private_api.functorch_transforms_active():
        raise RuntimeError("block_attention does not run under torch.func transforms (grad, vmap, jacrev, jvp): "
                           "its registered op has no functorch rules; differentiate with loss.backward() or "
                           "torch.autograd.grad")
    if not plain_eager(q, k, v):
        return library.attention_fwd(q, k, v, offsets, *args, backend_name(backend))[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if spec.forward_prepared is None and spec.forward_on_rotated is None:
            return _eager_apply(q, k, v, offsets, spec, args)
        if not library.call_saves_lse(q, k, args[0], args[3], args[5], args[6]):
            if spec.forward_prepared is not None:
                return _prepared_apply(q, k, v, offsets, spec, args)
        elif args[3] is not None and spec.forward_on_rotated is not None:
            return _rotated_apply(q, k, v, offsets, spec, args)
        return _eager_apply(q, k, v, offsets, spec, args)
    # Nothing to differentiate (inference, no_grad): no autograd node, the kernels directly.
    if spec.forward_inference is not None:
        return spec.forward_inference(q, k, v, offsets, *args)
    return spec.forward(q, k, v, offsets, *args)[0]
