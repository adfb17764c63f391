"""FP8 (e4m3) inputs for inference: the quantizer, descale factors, and the forward-only attention.

Conventions (FA3's): a stored value times its descale is the real value; ``q_descale``,
``k_descale`` and ``v_descale`` are float32 ``[H_kv]`` (one factor per kv head, which the query
heads of its group share) or ``[B, H_kv]`` (also per sequence). :func:`quantize_fp8` makes such a
pair from a wider tensor.

:func:`fp8_block_attention` (``block_attention`` with float8_e4m3fn q, k, v) is forward only: it
refuses inputs that require gradients. Rotary embeddings apply to the descaled values. On CUDA
(and with ``backend="triton"`` under Triton's interpreter) blocks of up to 128 tokens run the fp8
kernel (``kernels.block.fp8_fwd``), which reads e4m3 q, k, v and descales them in registers;
everything else (the reference backend, CPU, longer blocks, torch.compile) runs on descaled
copies: float32 on CPU, the 16-bit dtype ``out_dtype`` names on CUDA (bfloat16 for a float32
output), the output cast to ``out_dtype``. :func:`describe` says which of these serves a request
(``dispatch.describe`` of an fp8 request, and ``python -m blockattn_layers info``).
"""
from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ._validation import check_offsets_tensor, check_offsets_values, validate_attention_args
from .dispatch import AttentionRequest, Backend, describe as describe_call, register_dtype_path
from .reference import sequence_ids
from .kernels.block.fp8_fwd import VERIFIED_ON, fp8_attention_fwd, fp8_kernel_reasons
from .kernels.block.variants import unverified_allowed
from .kernels.common.meta import MAX_TILE
from .ops.backends.triton_block import cuda_reasons, triton_devices

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("tensor", "head", "sequence_head")


def is_fp8(x) -> bool:
    return isinstance(x, Tensor) and x.dtype == FP8_DTYPE


def quantize_fp8(x: Tensor, granularity: str = "head", *, offsets: Optional[Tensor] = None,
                 kv_heads: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``(x_e4m3, descale)`` with ``x_e4m3 * descale ~= x`` for a packed ``[T, H, D]`` tensor.

    ``granularity``: ``"tensor"`` (one factor, repeated over the kv heads), ``"head"`` (one per kv
    head: descale ``[H_kv]``) or ``"sequence_head"`` (per sequence and kv head: ``[B, H_kv]``,
    needs ``offsets``). ``kv_heads``: the heads the factors are shared by (default ``H``); pass
    ``H_kv`` to quantize q of grouped-query attention, whose group shares its kv head's factor.
    Each factor is the absolute maximum of its part's finite values over 448 (e4m3's largest finite
    value), 1 where the part is all zeros or empty; NaN stays NaN. ``offsets`` is checked as
    ``block_attention`` checks it (its values where it is a CPU tensor).
    """
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point() or is_fp8(x):
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"quantize_fp8: x must be a float [T, H, D] tensor wider than fp8, got {got}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_fp8: granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    total, heads, dim = x.shape
    kv_heads = heads if kv_heads is None else kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, numbers.Integral):
        raise TypeError(f"quantize_fp8: kv_heads must be an int, got {type(kv_heads).__name__}")
    kv_heads = int(kv_heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"quantize_fp8: kv_heads must divide x's {heads} heads, got {kv_heads}")
    values = x.detach().float().reshape(total, kv_heads, (heads // kv_heads) * dim)
    # The factors come from the finite values: a NaN or infinity stays where it is (NaN, or +-448)
    # instead of setting its whole part's factor.
    grouped = values.abs().nan_to_num_(nan=0.0, posinf=0.0)
    if granularity == "sequence_head":
        if offsets is None:
            raise ValueError("quantize_fp8: granularity 'sequence_head' needs offsets")
        check_offsets_tensor("offsets", offsets, total)
        if offsets.device.type == "cpu":
            check_offsets_values("offsets", offsets, total, "x.shape[0]")
        batch = offsets.numel() - 1
        seq = sequence_ids(offsets.to(x.device), total)
        amax = torch.zeros(batch, kv_heads, device=x.device, dtype=torch.float32)
        amax = amax.scatter_reduce_(0, seq.unsqueeze(1).expand(total, kv_heads), grouped.amax(2), "amax")
        per_token = amax[seq]
    else:
        amax = grouped.amax(dim=(0, 2)) if total else torch.zeros(kv_heads, device=x.device)
        if granularity == "tensor":
            amax = amax.amax().expand(kv_heads).clone()
        per_token = amax.expand(total, kv_heads)
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.where(per_token > 0, FP8_MAX / per_token, torch.ones_like(per_token))
    scaled = values * scale.unsqueeze(-1)
    quantized = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(total, heads, dim).to(FP8_DTYPE)
    return quantized, descale


def check_descale(name: str, descale: Optional[Tensor], kv_heads: int, batch: int, device: torch.device) -> None:
    """``descale`` is None, or float32 ``[H_kv]`` / ``[B, H_kv]`` on the inputs' device."""
    if descale is None:
        return
    if not isinstance(descale, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape [{kv_heads}] or [{batch}, {kv_heads}], "
                        f"got {type(descale).__name__}")
    if descale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {descale.dtype}")
    if tuple(descale.shape) not in ((kv_heads,), (batch, kv_heads)):
        raise ValueError(f"{name} must have shape [H_kv] = [{kv_heads}] or [B, H_kv] = [{batch}, {kv_heads}], "
                         f"got {list(descale.shape)}")
    if descale.device != device:
        raise ValueError(f"{name} is on {descale.device}, q on {device}")
    if descale.requires_grad:
        raise RuntimeError(f"fp8 attention is forward-only (inference): {name} requires grad")


def dequantize(x: Tensor, descale: Optional[Tensor], offsets: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``x`` (e4m3 ``[T, H, D]``) times its descale (``[H_kv]`` or ``[B, H_kv]``, each kv head's
    factor shared by ``groups`` heads of ``x``), in ``dtype``; ``descale`` None means 1."""
    values = x.float()
    if descale is not None:
        total, heads, _ = x.shape
        if descale.dim() == 2:
            factors = descale[sequence_ids(offsets.to(x.device), total)]
        else:
            factors = descale.expand(total, descale.shape[0])
        factors = factors.repeat_interleave(groups, dim=1) if groups > 1 else factors
        values = values * factors.unsqueeze(-1)
    return values.to(dtype)


def descaled_dtype(device: torch.device, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the descaled copies are computed in: float32 on CPU (the reference), else
    ``out_dtype``'s 16-bit type (bfloat16 for a float32 output)."""
    if device.type == "cpu":
        return torch.float32
    return out_dtype if out_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def check_fp8_inputs(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, q_descale, k_descale, v_descale,
                     out_dtype) -> torch.dtype:
    """Validate what is fp8's own in a call whose shared arguments are checked (in the user's
    terms); returns the output dtype (bfloat16 by default)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.requires_grad:
            raise RuntimeError(f"fp8 attention is forward-only (inference): {name} requires grad; "
                               f"train in bfloat16 and quantize for serving (quantize_fp8)")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    kv_heads, batch = k.shape[1], offsets.numel() - 1
    for name, descale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        check_descale(name, descale, kv_heads, batch, q.device)
    return out_dtype


def _stand_in(x: Tensor) -> Tensor:
    """A bfloat16 tensor of ``x``'s shape and device without storage, for the shared argument checks."""
    return torch.empty((), dtype=torch.bfloat16, device=x.device).expand(x.shape)


def _kernel_wanted(backend, q: Tensor) -> bool:
    """Whether ``backend`` asks for the fp8 kernel on ``q``'s device ("triton" where the Triton
    backends run: on CUDA, or on the CPU under Triton's interpreter; elsewhere the descaled path
    asks the backend, which refuses the call by name)."""
    name = backend.value if isinstance(backend, enum.Enum) else backend
    return (name == "triton" and q.device.type in triton_devices()) or (name == "auto" and q.is_cuda)


def fp8_block_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size, *, q_descale=None,
                        k_descale=None, v_descale=None, out_dtype=None, attention=None, **kwargs) -> Tensor:
    """``block_attention`` of e4m3 q, k, v with their descale factors (module docstring);
    ``attention`` is the 16/32-bit ``block_attention`` it runs on the descaled copies where the
    fp8 kernel (``kernels.block.fp8_fwd``: ``backend`` "triton", or "auto" on CUDA, blocks of up
    to 128 tokens, not under torch.compile) does not take the call."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dtype != FP8_DTYPE:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"q is {FP8_DTYPE}: {name} must be too, got {got}")
    backend = kwargs.pop("backend", "auto")
    validate = kwargs.pop("validate", None)
    params = validate_attention_args(_stand_in(q), _stand_in(k), _stand_in(v), offsets, block_size,
                                     validate=validate, **kwargs)
    out_dtype = check_fp8_inputs(q, k, v, offsets, q_descale, k_descale, v_descale, out_dtype)
    if (_kernel_wanted(backend, q) and not torch.compiler.is_compiling()
            and not fp8_kernel_reasons(q, k, v, params.block_size)):
        return fp8_attention_fwd(q, k, v, offsets, params.block_size, params.scale, params.causal, params.rope_theta,
                                 params.positions, params.rotary_dim, params.rotary_interleaved, params.cpu_offsets,
                                 q_descale, k_descale, v_descale, out_dtype)
    kwargs.update(backend=backend, validate=validate)
    dtype = descaled_dtype(q.device, out_dtype)
    groups = q.shape[1] // k.shape[1]
    qd = dequantize(q, q_descale, offsets, groups, dtype)
    kd = dequantize(k, k_descale, offsets, 1, dtype)
    vd = dequantize(v, v_descale, offsets, 1, dtype)
    return attention(qd, kd, vd, offsets, block_size, **kwargs).to(out_dtype)


FORWARD_ONLY = "Forward only: q, k, v or descale factors that require grad raise."


def kernel_request_reasons(req: AttentionRequest, backend: Union[str, Backend] = "auto") -> List[str]:
    """Why the fp8 kernels would not take a call like ``req`` with ``backend`` (empty: they take it),
    as :func:`fp8_block_attention` and ``fp8_kernel_reasons`` decide; what only the call shows is
    not known here (q, k or v without unit channel stride, and torch.compile, run descaled copies)."""
    name = backend.value if isinstance(backend, enum.Enum) else backend
    if name not in ("auto", "triton"):
        return [f"they run with backend 'auto' (on CUDA) or 'triton', not {name!r}"]
    reasons = []
    if name == "auto" and req.device_type != "cuda":
        reasons.append(f"backend='auto' takes them on CUDA only, not {req.device_type}")
    if req.device_type == "cuda":
        reasons += cuda_reasons(req)
        major, minor = req.capability or (None, None)
        if req.capability is not None and req.capability < (8, 9):
            reasons.append(f"they need an sm_89 or newer GPU (e4m3 conversions), not sm_{major}{minor}")
        if major is not None and major not in VERIFIED_ON and not unverified_allowed():
            reasons.append(f"no hardware run recorded on sm_{major}x: taken only with BLOCKATTN_UNVERIFIED_KERNELS=1")
    if req.block_size is None:
        reasons.append(f"they take blocks of up to {MAX_TILE} tokens, not full attention (block_size=None)")
    elif req.block_size > MAX_TILE:
        reasons.append(f"they take blocks of up to {MAX_TILE} tokens, not {req.block_size}")
    return reasons


def descaled_request(req: AttentionRequest, out_dtype: torch.dtype = torch.bfloat16) -> AttentionRequest:
    """``req`` as the call on descaled copies makes it (in ``descaled_dtype`` of ``out_dtype``)."""
    return dataclasses.replace(req, dtype=descaled_dtype(torch.device(req.device_type), out_dtype))


def path_line(req: AttentionRequest, kernel_reasons: List[str], descaled_choice: Optional[str] = None) -> str:
    """One line: what serves an fp8 call like ``req`` whose fp8 kernels have ``kernel_reasons``
    (:func:`kernel_request_reasons`): the fp8 kernels where there are none, else descaled copies
    (served by ``descaled_choice`` where given)."""
    if not kernel_reasons:
        where = "" if req.device_type == "cuda" else " (through Triton's interpreter: TRITON_INTERPRET=1)"
        sm90 = "; on sm_90 the Gluon kernel where it admits the call, else the Triton one" if (
            req.capability is not None and req.capability[0] == 9) else ""
        return f"fp8 kernels{where}: e4m3 q, k, v descaled in registers{sm90}. {FORWARD_ONLY}"
    dtype = str(descaled_request(req).dtype).replace("torch.", "")
    if req.device_type != "cpu":
        dtype += " (float16 for out_dtype=torch.float16)"
    served = f", then {descaled_choice}" if descaled_choice is not None else ""
    return f"fp8 inputs descaled to {dtype}{served}. Not the fp8 kernels: {', '.join(kernel_reasons)}. {FORWARD_ONLY}"


def describe(req: AttentionRequest, backend: Union[str, Backend] = "auto") -> str:
    """``dispatch.describe`` of an fp8 request: what serves ``block_attention`` of e4m3 q, k, v like
    ``req`` with ``backend`` (the default ``out_dtype``), and that it is forward only."""
    reasons = kernel_request_reasons(req, backend)
    return path_line(req, reasons, None if not reasons else describe_call(descaled_request(req), backend))


register_dtype_path(FP8_DTYPE, describe)
