"""Validated calls remembered by their signature, for the host time of small batches.

:func:`checked_call` returns the normalized :class:`AttentionParams` and the backend of a
``block_attention`` call. Checks and backend selection read only each tensor's type, shape,
dtype and device and the other arguments' values, so a call that matches an earlier one in
all of those (each scalar with its type: ``True`` is not taken for ``1``) reuses its result.
Calls that check tensor *values* (offsets on the CPU or ``validate=True``; ``cpu_offsets``
unless ``validate=False``) and calls traced by ``torch.compile`` take the full path. The
entries are a ``runtime.caches.HostCache``: registering a backend forgets them with every other
cached choice.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._params import AttentionParams
from ._validation import validate_attention_args
from .dispatch import BackendSpec, select_for_call
from .runtime.caches import HostCache

# signature -> (params without the call's tensors, backend)
_CALLS = HostCache("checked_calls")


def _tensor_key(x) -> tuple:
    return (type(x), x.shape, x.dtype, x.device)


def _key(q, k, v, offsets, positions, cpu_offsets, scalars: tuple) -> tuple:
    # (Written out: this runs on every call and its host time is what small batches pay for.)
    block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen, backend, validate = scalars
    return (
        type(q), q.shape, q.dtype, q.device, type(k), k.shape, k.dtype, k.device,
        type(v), v.shape, v.dtype, v.device, type(offsets), offsets.shape, offsets.dtype, offsets.device,
        None if positions is None else _tensor_key(positions),
        None if cpu_offsets is None else _tensor_key(cpu_offsets),
        scalars, (type(block_size), type(scale), type(causal), type(rope_theta), type(rotary_dim),
                  type(rotary_interleaved), type(max_seqlen), type(backend), type(validate)),
    )


def checked_call(
    q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim, rotary_interleaved,
    cpu_offsets, max_seqlen, backend, validate,
) -> Tuple[AttentionParams, BackendSpec]:
    """``(params, backend spec)`` of a ``block_attention`` call: checked, or as for an earlier call
    with the same signature (see the module docstring)."""
    device = getattr(q, "device", None)
    cacheable = (
        (validate is False or (validate is None and cpu_offsets is None and device is not None
                               and device.type != "cpu"))
        and not torch.compiler.is_compiling()
    )
    key = None
    if cacheable:
        scalars = (block_size, scale, causal, rope_theta, rotary_dim, rotary_interleaved, max_seqlen, backend,
                   validate)
        try:
            key = _key(q, k, v, offsets, positions, cpu_offsets, scalars)
            entry = _CALLS.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what is wrong
            key = entry = None
        if entry is not None:
            params, spec = entry
            if positions is not None or cpu_offsets is not None:
                params = params._replace(positions=positions, cpu_offsets=cpu_offsets)
            return params, spec
    params = validate_attention_args(
        q, k, v, offsets, block_size, scale=scale, causal=causal, rope_theta=rope_theta,
        positions=positions, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        cpu_offsets=cpu_offsets, max_seqlen=max_seqlen, validate=validate,
    )
    spec = select_for_call(backend, q, k, params)
    if key is not None:
        _CALLS.put(key, (params._replace(positions=None, cpu_offsets=None), spec))
    return params, spec
