"""Fake implementations and autograd shared by every backend's (forward, backward) op pair.

Both ops take ``(q, k, v, offsets, block_size, scale, causal, rope_theta, positions,
rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen)``, the backward with ``grad_out``
first. Outputs are contiguous whatever the input strides, so the fakes use ``new_empty``.
Only q, k, v and offsets (plus positions / cpu_offsets when given) are saved for backward.

The forward op carries its autograd formula (``register_autograd``) for direct callers and
``opcheck``. The public path uses the entry point returned by
:func:`register_attention_pair` instead: a plain ``torch.autograd.Function`` that calls the
ops while ``torch.compile``/``torch.export`` trace it, and the ops' implementations directly
in eager mode. Both skip host work of the custom-op wrappers (about half the host time of a
call), which is what small batches pay for.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

_NUM_ARGS = 13


def _save(ctx, q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
          rotary_interleaved, cpu_offsets, max_seqlen) -> None:
    ctx.save_for_backward(q, k, v, offsets, positions, cpu_offsets)
    ctx.scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen)


def _grads(bwd, ctx, grad_out):
    q, k, v, offsets, positions, cpu_offsets = ctx.saved_tensors
    block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen = ctx.scalars
    dq, dk, dv = bwd(
        grad_out, q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets, max_seqlen,
    )
    return dq, dk, dv


def _eager(x: torch.Tensor) -> bool:
    """Plain tensors with data outside any tracing: call the implementation directly.

    Meta, fake and functional tensors (compile, export, user fake modes) go through the op.
    """
    return type(x) is torch.Tensor and not x.is_meta and not torch.compiler.is_compiling()


def plain_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Plain tensors outside tracing and functorch transforms: the entry points take
    :func:`raw_apply` and call the implementations directly. (A tensor left over from an exited
    ``torch.func`` transform is a functorch wrapper, though its type is ``torch.Tensor``.)"""
    if not _eager(q) or torch._C._are_functorch_transforms_active():
        return False
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not (is_wrapped(q) or is_wrapped(k) or is_wrapped(v))


def raw_apply(function: type) -> Callable:
    """``function.apply`` without its Python wrapper, for plain tensors outside functorch transforms.

    ``torch.autograd.Function.apply`` binds default arguments when ``setup_context`` is defined
    (not here), checks for functorch transforms and unwraps tensors of exited transforms (the
    caller checks both: :func:`plain_eager`) before calling the C implementation: about a third of
    the host time of the call. The entry point falls back to ``apply`` where torch lacks it.
    """
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    if raw is None or not hasattr(raw, "__get__"):
        return function.apply
    return raw.__get__(None, function)


def register_attention_pair(fwd, bwd, fwd_impl: Callable, bwd_impl: Callable,
                            fwd_planned: Optional[Callable] = None) -> Callable:
    """Register fakes and autograd for the ops ``fwd``/``bwd`` (implemented by ``fwd_impl`` /
    ``bwd_impl``); return the public autograd entry point.

    ``fwd_planned``, if given, is ``fwd_impl`` that also returns the backward's launch prepared
    on the caller's thread (``(out, plan)``, plan None or with ``plan.launch(grad_out, q, k, v)``
    returning the gradients or None): eager calls take it, and their backward, which the
    autograd engine runs on its device thread, launches the plan where it holds.
    """

    @fwd.register_fake
    def _fwd_fake(q, *args):
        return q.new_empty(q.shape)

    @bwd.register_fake
    def _bwd_fake(grad_out, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        _save(ctx, *inputs)

    def backward(ctx, grad_out):
        return _grads(bwd, ctx, grad_out) + (None,) * (_NUM_ARGS - 3)

    fwd.register_autograd(backward, setup_context=setup_context)

    class _Attention(torch.autograd.Function):
        # The trailing op arguments travel as one tuple: autograd.Function.apply's host time
        # grows with the number of arguments.
        @staticmethod
        def forward(ctx, q, k, v, offsets, rest):
            _save(ctx, q, k, v, offsets, *rest)
            return (fwd_impl if _eager(q) else fwd)(q, k, v, offsets, *rest)

        @staticmethod
        def backward(ctx, grad_out):
            # No gradients for offsets and the tuple of the other arguments.
            return _grads(bwd_impl if _eager(grad_out) else bwd, ctx, grad_out) + (None, None)

    class _EagerAttention(_Attention):
        # What ``attention`` runs for plain tensors: the forward needs no second ``_eager`` check.
        @staticmethod
        def forward(ctx, q, k, v, offsets, rest):
            _save(ctx, q, k, v, offsets, *rest)
            return fwd_impl(q, k, v, offsets, *rest)

    class _PlannedAttention(_Attention):
        # ``_EagerAttention`` with the backward's launch prepared by the forward.
        @staticmethod
        def forward(ctx, q, k, v, offsets, rest):
            _save(ctx, q, k, v, offsets, *rest)
            out, ctx.plan = fwd_planned(q, k, v, offsets, *rest)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            if ctx.plan is not None and type(grad_out) is torch.Tensor:
                q, k, v = ctx.saved_tensors[:3]
                grads = ctx.plan.launch(grad_out, q, k, v)
                if grads is not None:
                    return grads + (None, None)
            return _Attention.backward(ctx, grad_out)

    apply = raw_apply(_EagerAttention if fwd_planned is None else _PlannedAttention)

    def attention(q, k, v, offsets, *rest):
        if not plain_eager(q, k, v):
            return _Attention.apply(q, k, v, offsets, rest)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return apply(q, k, v, offsets, rest)
        # Nothing to differentiate (inference, no_grad): no autograd node, the kernels directly.
        return fwd_impl(q, k, v, offsets, *rest)

    return attention
