"""Argument checks for the public functions.

Every check names the argument it rejects. Checks of tensor *values* (offsets that
start at 0, never decrease and end at T) need the values on the host: they always
run for CPU tensors, and for device tensors only when the caller passes
``validate=True`` (that costs one device-to-host copy).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ._params import AttentionParams

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Scalars are range-checked with comparisons only, never math.isfinite(float(x)): under
# torch.compile(dynamic=True) Dynamo traces a module's float attributes (a layer's rope_theta,
# a scale) as symbolic floats, where a comparison is a guard but math.isfinite is untraceable.
_INF = float("inf")


def _is_int(x) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_offsets_values(name: str, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Raise unless ``offsets`` starts at 0, never decreases and ends at ``total``; return the host copy."""
    host = offsets.detach().to("cpu", torch.int64)
    if host.numel() == 0:
        raise ValueError(f"{name} must have at least one element (offsets[0] == 0)")
    if int(host[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    if host.numel() > 1 and bool((host[1:] < host[:-1]).any()):
        bad = int(torch.nonzero(host[1:] < host[:-1])[0, 0]) + 1
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{bad}] = {int(host[bad])} "
            f"< {name}[{bad - 1}] = {int(host[bad - 1])}"
        )
    if int(host[-1]) != total:
        raise ValueError(f"{name}[-1] must equal T = {total} (q.shape[0]), got {int(host[-1])}")
    return host


def _check_max_seqlen(max_seqlen: int, host: torch.Tensor) -> None:
    if host.numel() > 1:
        longest = int((host[1:] - host[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(f"max_seqlen ({max_seqlen}) is below the longest sequence ({longest})")


def validate_attention_args(
    q, k, v, offsets, block_size, *, scale, causal, rope_theta, positions, rotary_dim,
    rotary_interleaved, cpu_offsets, max_seqlen, validate: Optional[bool],
) -> AttentionParams:
    """Check every argument of ``block_attention`` and return the normalized parameters."""
    # Written for host time: small batches pay for every attribute read here.
    for name, x in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        _check_tensor(name, x)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 3:
            raise ValueError(f"{name} must have shape [T, heads, head_dim], got {tuple(shape)}")
    dtype = q.dtype
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float64/float32/float16/bfloat16, got {dtype}")
    T, H, D = q_shape
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k_shape)} and v {tuple(v_shape)}")
    if k_shape[0] != T or k_shape[2] != D:
        raise ValueError(
            f"k must have shape [T={T}, H_kv, D={D}] to match q {tuple(q_shape)}, got {tuple(k_shape)}"
        )
    h_kv = k_shape[1]
    if h_kv < 1 or H < 1 or H % h_kv:
        raise ValueError(f"q heads ({H}) must be a positive multiple of k/v heads ({h_kv})")
    if D < 1:
        raise ValueError(f"head_dim (q.shape[2]) must be >= 1, got {D}")
    device = q.device
    for name, x in (("k", k), ("v", v)):
        if x.dtype != dtype:
            raise TypeError(f"{name} dtype {x.dtype} must match q dtype {dtype}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be a 1-D tensor [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in _INDEX_DTYPES:
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"offsets is on {offsets.device} but q is on {device}")
    if offsets.dtype == torch.int32 and T >= 2**31:
        raise ValueError(f"offsets must be int64 when T ({T}) >= 2**31")

    if block_size is not None:
        if not _is_int(block_size):
            raise TypeError(f"block_size must be an int >= 1 or None, got {block_size!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {block_size}")
        block_size = int(block_size)

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not _is_real(scale) or not -_INF < scale < _INF:
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")

    if rope_theta is None:
        if positions is not None:
            raise ValueError("positions is only used with rotary embeddings: pass rope_theta too")
        if rotary_dim is not None:
            raise ValueError("rotary_dim is only used with rotary embeddings: pass rope_theta too")
        rotary_dim = 0
    else:
        if not _is_real(rope_theta) or not 0 < rope_theta < _INF:
            raise ValueError(f"rope_theta must be a positive finite number or None, got {rope_theta!r}")
        rope_theta = float(rope_theta)
        if rotary_dim is None:
            rotary_dim = D
        if not _is_int(rotary_dim):
            raise TypeError(f"rotary_dim must be an int, got {rotary_dim!r}")
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={D}], got {rotary_dim}")
        rotary_dim = int(rotary_dim)
        if positions is not None:
            positions = _check_tensor("positions", positions)
            if positions.shape != (T,):
                raise ValueError(f"positions must have shape [T={T}], got {tuple(positions.shape)}")
            if positions.dtype == torch.bool or positions.is_complex():
                raise TypeError(f"positions must be an integer or float tensor, got {positions.dtype}")
            if positions.device != device:
                raise ValueError(f"positions is on {positions.device} but q is on {device}")

    if cpu_offsets is not None:
        cpu_offsets = _check_tensor("cpu_offsets", cpu_offsets)
        if cpu_offsets.device.type != "cpu":
            raise ValueError(f"cpu_offsets must be a CPU tensor, got device {cpu_offsets.device}")
        if cpu_offsets.dtype not in _INDEX_DTYPES:
            raise TypeError(f"cpu_offsets must be int32 or int64, got {cpu_offsets.dtype}")
        if cpu_offsets.shape != offsets.shape:
            raise ValueError(
                f"cpu_offsets must have the shape of offsets {tuple(offsets.shape)}, got {tuple(cpu_offsets.shape)}"
            )
    if max_seqlen is not None and (not _is_int(max_seqlen) or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be an int >= 0 or None, got {max_seqlen!r}")

    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool or None, got {validate!r}")
    compiling = torch.compiler.is_compiling()
    host = None
    if not compiling and (validate or (validate is None and device.type == "cpu")):
        host = check_offsets_values("offsets", offsets, T)
    if not compiling and cpu_offsets is not None and validate is not False:
        host_cpu = check_offsets_values("cpu_offsets", cpu_offsets, T)
        if validate and not torch.equal(host_cpu, offsets.detach().cpu().to(torch.int64)):
            raise ValueError("cpu_offsets must hold the same values as offsets")
        host = host_cpu if host is None else host
    if max_seqlen is not None and host is not None:
        _check_max_seqlen(max_seqlen, host)

    return AttentionParams(
        block_size=block_size, scale=float(scale), causal=causal, rope_theta=rope_theta,
        positions=positions, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        cpu_offsets=cpu_offsets, max_seqlen=None if max_seqlen is None else int(max_seqlen),
    )
