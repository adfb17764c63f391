"""Argument checks shared by ``block_attention``, the modules' constructors and the configs,
and the checks of what a module's ``forward`` is given.

Every check names the argument it rejects, in the caller's terms: a wrong type raises
``TypeError``, a wrong value ``ValueError``. Checks of tensor *values* (offsets that start at
0, never decrease and end at T) need the values on the host: they always run for CPU
tensors, and for device tensors only when the caller passes ``validate=True`` (that costs one
device-to-host copy). Under ``torch.compile`` they become an assert inside the graph
(:func:`assert_offsets_in_graph`), and under ``torch.export`` too where ``validate=True``. The
other checks read only types, shapes, dtypes and devices, so they cost no device sync and trace
under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import enum
import math
import numbers
from typing import Any, Optional, Tuple

import torch

from ._params import AttentionParams
from .dispatch import registered_backends
from .runtime import private_api

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Scalars are range-checked with comparisons only, never math.isfinite(float(x)): under
# torch.compile(dynamic=True) Dynamo traces a module's float attributes (a layer's rope_theta,
# a scale) as symbolic floats, where a comparison is a guard but math.isfinite is untraceable.
_INF = float("inf")
ACTIVATIONS = ("relu", "gelu")  # functions of torch.nn.functional, by name


# ----------------------------------------------------------------------------- scalar arguments
def is_int(x) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def is_real(x) -> bool:
    """A real number that is not a bool (ints and numpy floats count)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_int(name: str, value: Any, low: int = 1, *, optional: bool = False) -> Optional[int]:
    """``value`` as an int, if it is one (not a bool) and ``>= low``; ``None`` passes if ``optional``."""
    if value is None and optional:
        return None
    alternative = " or None" if optional else ""
    if not is_int(value):
        raise TypeError(f"{name} must be an int >= {low}{alternative}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}{alternative}, got {value}")
    return int(value)


def check_real(
    name: str, value: Any, expected: str, low: float = -_INF, high: float = _INF, *,
    low_open: bool = False, optional: bool = False,
) -> Optional[float]:
    """``value`` as a float, if it is a finite real number in ``[low, high]`` (``(low, high]`` if
    ``low_open``); ``None`` passes if ``optional``. ``expected`` completes "``name`` must be ..."."""
    if value is None and optional:
        return None
    if not is_real(value):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    above_low = low < value if low_open else low <= value
    if not (above_low and value <= high and -_INF < value < _INF):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def check_block_size(block_size: Any) -> Optional[int]:
    """Tokens per attention block: an int >= 1, or ``None`` for whole sequences."""
    return check_int("block_size", block_size, optional=True)


def check_rope_theta(rope_theta: Any, *, optional: bool = True) -> Optional[float]:
    """The rotary base: a positive finite number (or ``None`` for no rotary, if ``optional``)."""
    expected = "a positive finite number or None" if optional else "a positive finite number"
    return check_real("rope_theta", rope_theta, expected, 0.0, low_open=True, optional=optional)


def check_rotary_dim(rotary_dim: Any, head_dim: int) -> int:
    """Rotated channels per head: even, in ``[2, head_dim]``."""
    if not is_int(rotary_dim):
        raise TypeError(f"rotary_dim must be an int, got {rotary_dim!r}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    return int(rotary_dim)


def check_backend(backend: Any) -> Any:
    """A backend name the dispatcher knows (``"auto"`` or a registered backend), or its Enum."""
    name = backend.value if isinstance(backend, enum.Enum) else backend
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string or Backend enum, got {backend!r}")
    known = ["auto"] + [spec.name for spec in registered_backends()]
    if name not in known:
        raise ValueError(f"backend must be one of {', '.join(known)}; got {name!r}")
    return backend


def check_activation(activation: Any, *, allow_callable: bool = True) -> Any:
    """One of :data:`ACTIVATIONS` by name, or (if ``allow_callable``) a callable."""
    alternative = " or a callable" if allow_callable else ""
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}{alternative}, got {activation!r}")
    elif not (allow_callable and callable(activation)):
        raise TypeError(f"activation must be one of {list(ACTIVATIONS)}{alternative}, got {activation!r}")
    return activation


_HEAD_NAMES = ("embed_dim", "num_heads", "num_kv_heads")


def check_heads(embed_dim: Any, num_heads: Any, num_kv_heads: Any, names: Tuple[str, str, str] = _HEAD_NAMES) -> int:
    """Model width and head counts (``names`` as the caller calls them); returns ``num_kv_heads``
    with its default, ``num_heads``."""
    width, heads, kv_heads = names
    check_int(width, embed_dim)
    check_int(heads, num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else check_int(kv_heads, num_kv_heads)
    if embed_dim % num_heads:
        raise ValueError(f"{width} ({embed_dim}) must be a multiple of {heads} ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"{heads} ({num_heads}) must be a multiple of {kv_heads} ({num_kv_heads})")
    return int(num_kv_heads)


def check_param_dtype(dtype: Any) -> None:
    """A module's ``dtype`` argument: None or a floating dtype its parameters can take."""
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be None or one of torch.float32, torch.bfloat16, torch.float16, torch.float64, "
                        f"got {dtype!r} (for fp8 serving, convert a trained model with to_fp8_inference)")


def check_attention_args(
    embed_dim: Any, num_heads: Any, block_size: Any, num_kv_heads: Any, bias: Any, causal: Any, backend: Any,
    names: Tuple[str, str, str] = _HEAD_NAMES, dtype: Any = None,
) -> Tuple[Optional[int], int]:
    """The arguments of an attention layer; returns ``(block_size, num_kv_heads)`` normalized."""
    check_param_dtype(dtype)
    num_kv_heads = check_heads(embed_dim, num_heads, num_kv_heads, names)
    block_size = check_block_size(block_size)
    check_bool("bias", bias)
    check_bool("causal", causal)
    check_backend(backend)
    return block_size, num_kv_heads


def check_rotary_args(
    rope_theta: Any, rotary_dim: Any, rotary_interleaved: Any, head_dim: int,
) -> Tuple[float, Optional[int]]:
    """The rotary arguments of a layer; returns ``(rope_theta, rotary_dim)`` normalized
    (``rotary_dim`` ``None``: the whole head)."""
    rope_theta = check_rope_theta(rope_theta, optional=False)
    rotary_dim = None if rotary_dim is None else check_rotary_dim(rotary_dim, head_dim)
    check_bool("rotary_interleaved", rotary_interleaved)
    return rope_theta, rotary_dim


def check_encoder_layer_args(
    d_model: Any, nhead: Any, dim_feedforward: Any, dropout: Any, activation: Any, *, block_size: Any,
    norm_first: Any, rope_theta: Any, num_kv_heads: Any, causal: Any, layer_norm_eps: Any, bias: Any,
    backend: Any, rotary_dim: Any = None, rotary_interleaved: Any = False, allow_callable: bool = True,
) -> None:
    """The arguments of an encoder layer (``JaggedTransformerEncoderLayer``, ``EncoderLayerConfig``)."""
    check_attention_args(d_model, nhead, block_size, num_kv_heads, bias, causal, backend,
                         names=("d_model", "nhead", "num_kv_heads"))
    check_int("dim_feedforward", dim_feedforward)
    check_real("dropout", dropout, "a number in [0, 1]", 0.0, 1.0)
    check_activation(activation, allow_callable=allow_callable)
    check_bool("norm_first", norm_first)
    check_rope_theta(rope_theta)
    check_bool("rotary_interleaved", rotary_interleaved)
    if rope_theta is None:
        for name, used in (("rotary_dim", rotary_dim is not None), ("rotary_interleaved", rotary_interleaved)):
            if used:
                raise ValueError(f"{name} is only used with rotary embeddings: pass rope_theta too")
    elif rotary_dim is not None:
        check_rotary_dim(rotary_dim, d_model // nhead)
    check_real("layer_norm_eps", layer_norm_eps, "a finite number >= 0", 0.0)


# ----------------------------------------------------------------------------- block_attention
def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_positions(positions: Any, total: int, device: torch.device, where: str = "q") -> torch.Tensor:
    """``positions`` is an integer or float tensor ``[T]`` on ``device`` (that of ``where``)."""
    positions = _check_tensor("positions", positions)
    if positions.shape != (total,):
        raise ValueError(f"positions must have shape [T={total}], got {tuple(positions.shape)}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer or float tensor, got {positions.dtype}")
    if positions.device != device:
        raise ValueError(f"positions is on {positions.device} but {where} is on {device}")
    return positions


def check_offsets_tensor(name: str, offsets: Any, total: int) -> torch.Tensor:
    """``offsets`` is a 1-D, non-empty int32 / int64 tensor (int64 where ``total`` needs it)."""
    _check_tensor(name, offsets)
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dtype == torch.int32 and total >= 2**31:
        raise ValueError(f"{name} must be int64 when T ({total}) >= 2**31")
    return offsets


def check_offsets_values(name: str, offsets: torch.Tensor, total: int,
                         rows: str = "q.shape[0]; a module's: its input's rows") -> torch.Tensor:
    """Raise unless ``offsets`` starts at 0, never decreases and ends at ``total`` (the ``rows`` of
    the packed tensor, as the message names them); return the host copy."""
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
        raise ValueError(f"{name}[-1] must equal T = {total} ({rows}), got {int(host[-1])}")
    return host


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())


def assert_offsets_in_graph(name: str, offsets: torch.Tensor, total) -> None:
    """Under ``torch.compile`` / ``torch.export``, where the values cannot be read on the host:
    the same conditions as :func:`check_offsets_values` as an assert inside the graph (it raises
    when the graph runs on CPU; on a GPU it is a device-side assert, which leaves the CUDA context
    unusable, as any device assert does)."""
    # (Its shape is checked before: 1-D, non-empty. Non-decreasing as "equal to its running maximum":
    # no slice of B elements, whose size 1 would specialize a dynamic batch size.)
    good = (offsets[0] == 0) & (offsets[-1] == total) & (offsets.cummax(0).values == offsets).all()
    torch._assert_async(good, f"{name} must start at 0, never decrease and end at T (q.shape[0]); "
                              f"checked inside the compiled graph: call eagerly for which element is wrong")


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
    check_offsets_tensor("offsets", offsets, T)
    if offsets.device != device:
        raise ValueError(f"offsets is on {offsets.device} but q is on {device}")

    block_size = check_block_size(block_size)
    scale = 1.0 / math.sqrt(D) if scale is None else check_real("scale", scale, "a finite real number or None")
    check_bool("causal", causal)
    check_bool("rotary_interleaved", rotary_interleaved)

    if rope_theta is None:
        if positions is not None:
            raise ValueError("positions is only used with rotary embeddings: pass rope_theta too")
        if rotary_dim is not None:
            raise ValueError("rotary_dim is only used with rotary embeddings: pass rope_theta too")
        if rotary_interleaved:
            raise ValueError("rotary_interleaved is only used with rotary embeddings: pass rope_theta too")
        rotary_dim = 0
    else:
        rope_theta = check_rope_theta(rope_theta)
        rotary_dim = D if rotary_dim is None else check_rotary_dim(rotary_dim, D)
        if positions is not None:
            positions = check_positions(positions, T, device)

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
    max_seqlen = check_int("max_seqlen", max_seqlen, 0, optional=True)

    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool or None, got {validate!r}")
    compiling = torch.compiler.is_compiling()
    host = None
    if validate or (validate is None and device.type == "cpu"):
        if not compiling:
            host = check_offsets_values("offsets", offsets, T)
        elif validate or not _exporting():
            # (An exported graph may be served on a GPU: it checks only where validate=True asks.)
            assert_offsets_in_graph("offsets", offsets, T)
    if not compiling and cpu_offsets is not None and validate is not False:
        host_cpu = check_offsets_values("cpu_offsets", cpu_offsets, T)
        # ``host`` holds offsets' values wherever reading them cost no sync (CPU) or was asked for.
        if host is not None and not torch.equal(host_cpu, host):
            i = int(torch.nonzero(host_cpu != host)[0, 0])
            raise ValueError(
                f"cpu_offsets must hold the same values as offsets, but cpu_offsets[{i}] = {int(host_cpu[i])} "
                f"and offsets[{i}] = {int(host[i])}"
            )
        host = host_cpu if host is None else host
    if max_seqlen is not None and host is not None:
        _check_max_seqlen(max_seqlen, host)

    return AttentionParams(
        block_size=block_size, scale=scale, causal=causal, rope_theta=rope_theta, positions=positions,
        rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved, cpu_offsets=cpu_offsets,
        max_seqlen=max_seqlen,
    )


# ----------------------------------------------------------------------------- a module's input
_SOURCES = {
    "jagged_tensor": "the JaggedTensor's values", "keyed_jagged_tensor": "the KeyedJaggedTensor's values",
    "dict": "the JaggedTensors' values",
}


def check_module_input(
    values: torch.Tensor, offsets: Any, kind: str, width: Optional[int] = None,
    weight_dtype: Optional[torch.dtype] = None, width_name: str = "embed_dim",
) -> None:
    """Check what a module's ``forward`` got, as ``to_values_offsets`` flattened it (``kind`` is
    the layout's): floating ``values [T, width]`` of ``weight_dtype`` (unless autocast is on), and
    for packed tensors ``offsets`` a 1-D int32/int64 tensor on their device. ``width`` /
    ``weight_dtype`` ``None`` skip those checks. Reads only dtypes, shapes and devices.
    """
    # Written for host time: every layer's forward runs this.
    dtype, shape = values.dtype, values.shape
    if not dtype.is_floating_point:
        what = _SOURCES.get(kind, "values")
        if dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{what} must be floating point, got {dtype}")
        raise TypeError(
            f"{what} are {dtype}: integer ids must be embedded first, e.g. by a torchrec EmbeddingCollection "
            "(blockattn_layers.JaggedSequenceEncoder(embedding_collection, encoder) embeds a KeyedJaggedTensor "
            "of ids and encodes the embeddings)"
        )
    expected = "[T, E]" if width is None else f"[T, {width_name}={width}]"
    if len(shape) == 3:
        raise ValueError(
            f"{_SOURCES.get(kind, 'values')} must be packed {expected} with offsets [B+1], got a padded "
            f"[B, N, E] tensor of shape {tuple(shape)}: convert it with "
            "blockattn_layers.padded_to_jagged(x, lengths) (or key_padding_mask=...)"
        )
    if len(shape) != 2 or (width is not None and shape[1] != width):
        raise ValueError(f"{_SOURCES.get(kind, 'values')} must have shape {expected}, got {tuple(shape)}")
    if weight_dtype is not None and dtype != weight_dtype and not autocast_enabled(values.device.type):
        raise TypeError(
            f"{_SOURCES.get(kind, 'values')} are {dtype} but the module's parameters are {weight_dtype}: "
            "cast one to the other "
            f"(values.to({weight_dtype}) or module.to({dtype})), or run under torch.autocast"
        )
    if kind == "tensor":
        if not isinstance(offsets, torch.Tensor):
            raise TypeError(f"offsets must be a torch.Tensor [B+1] of int32 or int64, got {type(offsets).__name__}")
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"offsets must be a 1-D tensor [B+1], got shape {tuple(offsets.shape)}")
        if offsets.dtype not in _INDEX_DTYPES:
            raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
        if offsets.device != values.device:
            raise ValueError(f"offsets is on {offsets.device} but values is on {values.device}")
    elif isinstance(offsets, torch.Tensor) and offsets.device != values.device:
        raise ValueError(f"{_SOURCES.get(kind, 'values')} are on {values.device} but their lengths / offsets on "
                         f"{offsets.device}: keep both on one device")


# Device types with autocast (``torch.amp.is_autocast_available`` does not trace in torch 2.11).
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu", "mps", "xla", "privateuseone"})


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``. (The test of any autocast first: torch.compile
    constant-folds it, and it is cheap; most calls stop there.)"""
    if not private_api.any_autocast_enabled() or device_type not in _AUTOCAST_DEVICES:
        return False
    return torch.is_autocast_enabled(device_type)
