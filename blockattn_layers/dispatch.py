"""Backend registry and selection.

Each backend declares what it supports in a :class:`BackendSpec`; the registry turns a
call into an :class:`AttentionRequest` and asks every backend for its reasons to refuse.
``backend="auto"`` takes the highest-priority backend with no reasons among those that
serve the tensors' device automatically; an explicit backend wins, and raises with its
reasons when it cannot serve the call. A dtype that ``block_attention`` serves outside the
backends (fp8: ``blockattn_layers.fp8``) registers its own line for :func:`describe`
(:func:`register_dtype_path`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import torch

from ._params import AttentionParams
from .runtime import caches


class Backend(str, enum.Enum):
    """Names accepted by the ``backend`` argument (plain strings work too)."""

    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"
    TRITON_FLASH = "triton_flash"


@dataclass(frozen=True)
class AttentionRequest:
    """What a backend needs to know to say whether it can serve a call."""

    device_type: str
    capability: Optional[Tuple[int, int]]
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_size: Optional[int]
    causal: bool
    rotary: bool
    rotary_dim: Optional[int] = None
    rotary_interleaved: bool = False

    @classmethod
    def from_call(cls, q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> "AttentionRequest":
        return cls._from_key(_call_key(q, k, params))

    @classmethod
    def _from_key(cls, key: tuple) -> "AttentionRequest":
        device, dtype, head_dim, num_heads, num_kv_heads, block_size, causal, rotary, rotary_dim, interleaved = key
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(
            device_type=device.type, capability=capability, dtype=dtype, head_dim=head_dim,
            num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, causal=causal,
            rotary=rotary, rotary_dim=rotary_dim if rotary else None, rotary_interleaved=interleaved,
        )


def _call_key(q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> tuple:
    """Everything about a call that backends decide on (the fields of its request, by device)."""
    _, num_heads, head_dim = q.shape
    return (q.device, q.dtype, head_dim, num_heads, k.shape[1], params.block_size, params.causal,
            params.rope_theta is not None, params.rotary_dim, params.rotary_interleaved)


# forward(q, k, v, offsets, *op_args) -> (out, lse or None); backward(grad_out, q, k, v, out, lse,
# offsets, *op_args) -> (dq, dk, dv); op_args as ``AttentionParams.op_args()``.
Forward = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
Backward = Callable[..., Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BackendSpec:
    """A backend: its implementations and its declared capabilities.

    ``forward`` and ``backward`` implement the registered ops ``blockattn::attention_fwd`` /
    ``attention_bwd`` (:mod:`blockattn_layers.ops.library`) on this backend: ``forward`` returns
    ``(out, lse)``, ``lse`` None unless the kind saves it (``ops.library.saves_lse``), and
    ``backward`` gets ``out`` and ``lse`` back (None where not saved). ``forward_prepared``, if
    set, is ``forward`` for single-tile kinds that also returns the backward's launch prepared
    on the caller's thread (``(out, prepared)``, prepared None or with ``prepared.launch(grad_out, q, k, v)``
    returning the gradients or None). ``forward_inference``, if set, computes ``out`` alone for
    eager calls that nothing is differentiated through, where ``forward`` would also compute an
    ``lse`` that no backward reads. ``forward_on_rotated``, if set, is ``forward`` for eager rotary calls that
    save lse and that something is differentiated through, where it pays to rotate q and k once, in the forward:
    it returns None where it does not take the call, else ``(out, lse, q_rotated, k_rotated, pair_chunk)``, the
    attention without rotary on rotated copies of q and k (their channels in the paired-chunk order of
    ``reference.paired_chunks`` where ``pair_chunk`` is not 0), which autograd then saves in place of q and k;
    its ``backward_on_rotated`` takes ``backward``'s arguments with the copies in place of q and k, and
    ``pair_chunk`` last, and returns the gradients of q, k, v (dq and dk rotated back, in their own order).
    ``variant_reasons``, for a backend whose kernels come in variants, gives each variant's reasons not to run
    a request (empty: it runs; see :func:`explain_variants`). ``devices()`` lists the device types it can run
    on when asked by name; ``auto_devices`` those where ``backend="auto"`` may pick it (``None``: any device).
    ``extra_reasons`` adds checks that do not fit the declared fields (it returns reasons to refuse).
    """

    name: str
    forward: Forward
    backward: Backward
    priority: int
    devices: Optional[Callable[[], FrozenSet[str]]]
    auto_devices: Optional[FrozenSet[str]]
    dtypes: FrozenSet[torch.dtype]
    min_capability: Optional[Tuple[int, int]] = None
    head_dims: Tuple[int, int] = (1, 1 << 30)
    max_block_size: Optional[int] = None
    full_attention: bool = True
    causal: bool = True
    rotary: bool = True
    extra_reasons: Optional[Callable[[AttentionRequest], List[str]]] = field(default=None)
    description: str = ""
    forward_prepared: Optional[Callable] = None
    forward_inference: Optional[Callable[..., torch.Tensor]] = None
    forward_on_rotated: Optional[Callable] = None
    backward_on_rotated: Optional[Callable] = None
    variant_reasons: Optional[Callable[[AttentionRequest], Dict[str, List[str]]]] = None

    def not_supported_reasons(self, req: AttentionRequest) -> List[str]:
        """Why this backend cannot serve ``req``; empty when it can."""
        reasons = []
        devices = self.devices() if self.devices is not None else None
        if devices is not None and req.device_type not in devices:
            reasons.append(f"device type {req.device_type!r} not in {sorted(devices)}")
        elif (
            self.min_capability is not None and req.device_type == "cuda"
            and req.capability is not None and req.capability < self.min_capability
        ):
            reasons.append(f"compute capability {req.capability} below {self.min_capability}")
        if req.dtype not in self.dtypes:
            reasons.append(f"dtype {req.dtype} not supported")
        lo, hi = self.head_dims
        if not lo <= req.head_dim <= hi:
            reasons.append(f"head_dim {req.head_dim} outside [{lo}, {hi}]")
        if req.block_size is None and not self.full_attention:
            reasons.append("full attention (block_size=None) not supported")
        if req.block_size is not None and self.max_block_size is not None and req.block_size > self.max_block_size:
            reasons.append(f"block_size {req.block_size} above {self.max_block_size}")
        if req.causal and not self.causal:
            reasons.append("causal not supported")
        if req.rotary and not self.rotary:
            reasons.append("rotary embeddings not supported")
        if self.extra_reasons is not None:
            reasons.extend(self.extra_reasons(req))
        return reasons


_REGISTRY: Dict[str, BackendSpec] = {}
_BY_PRIORITY: List[BackendSpec] = []
# (backend argument, call key) -> spec: a call's answer depends only on what the key holds.
_SELECTED = caches.HostCache("backend_choices")
# describe(req, backend) of a path outside the backends: one line, what serves the call.
DescribePath = Callable[[AttentionRequest, Union[str, Backend]], str]
# dtype -> its path's describe (``register_dtype_path``).
_DTYPE_PATHS: Dict[torch.dtype, DescribePath] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add or replace a backend in the registry."""
    _REGISTRY[spec.name] = spec
    _BY_PRIORITY[:] = sorted(_REGISTRY.values(), key=lambda s: -s.priority)
    caches.clear_all()  # every cached choice may change (runtime.caches: the one invalidation rule)


def registered_backends() -> List[BackendSpec]:
    """Registered backends, highest priority first."""
    return list(_BY_PRIORITY)


def explain(req: AttentionRequest) -> Dict[str, List[str]]:
    """Every registered backend's reasons to refuse ``req`` (empty list: it can serve it)."""
    return {spec.name: spec.not_supported_reasons(req) for spec in registered_backends()}


def explain_variants(req: AttentionRequest,
                     backend_reasons: Optional[Dict[str, List[str]]] = None) -> Dict[str, Dict[str, List[str]]]:
    """For each backend whose kernels come in variants: every variant's reasons not to run
    ``req`` (empty list: that variant runs), in the order they are considered. Where a backend's
    backward chooses otherwise than its forward, the backward's reasons follow under
    ``backward: NAME`` keys.

    A variant runs only where its backend serves the call: where the backend refuses ``req``, every
    one of its variants' reasons begins with ``"the NAME backend does not serve this call: ..."``
    (the backend's reasons), before the variant's own. ``backend_reasons``: the backends' reasons to
    judge that by, as :func:`explain` gives them (its default); ``python -m blockattn_layers info``
    passes them without "CUDA is not available" where it judges a GPU this machine lacks."""
    backend_reasons = explain(req) if backend_reasons is None else backend_reasons
    shown = {}
    for spec in registered_backends():
        if spec.variant_reasons is None:
            continue
        reasons = spec.variant_reasons(req)
        refused = backend_reasons[spec.name]
        if refused:
            gate = f"the {spec.name} backend does not serve this call: {', '.join(refused)}"
            reasons = {name: [gate] + why for name, why in reasons.items()}
        shown[spec.name] = reasons
    return shown


def running_variants(reasons: Dict[str, List[str]]) -> Tuple[Optional[str], Dict[str, str]]:
    """From a backend's variant reasons (``explain_variants``): the variant that runs (the first
    without reasons; ``None`` where the tensors' layout decides, or the backend does not serve the
    call), and for each phase that chooses apart (``backward: NAME`` keys) the first variant it runs
    where that is another, e.g. ``{"backward": "flash"}``."""
    running = next((name for name, why in reasons.items() if not why and ": " not in name), None)
    phases: Dict[str, str] = {}
    for name, why in reasons.items():
        if not why and ": " in name:
            phase, variant = name.split(": ", 1)
            phases.setdefault(phase, variant)
    return running, {phase: variant for phase, variant in phases.items() if variant != running}


def describe(req: AttentionRequest, backend: Union[str, "Backend"] = "auto") -> str:
    """One line: the backend (and kernel variant) that serves ``req``, or why none does. Calls of a
    dtype that ``block_attention`` serves on a path of its own (:func:`register_dtype_path`: fp8)
    get that path's line instead."""
    path = _DTYPE_PATHS.get(req.dtype)
    if path is not None:
        return path(req, backend)
    try:
        spec = select_backend(backend, req)
    except ValueError as err:
        return str(err)
    line = f"{spec.name}"
    if spec.variant_reasons is not None:
        running, phases = running_variants(spec.variant_reasons(req))
        line += f", {running} kernels" if running else ", kernel variant chosen per call from the tensors' layout"
        if phases:
            line += " (" + "; ".join(f"{phase}: {name} kernels" for phase, name in phases.items()) + ")"
    return line


def register_dtype_path(dtype: torch.dtype, describe_path: DescribePath) -> None:
    """Declare that ``block_attention`` serves calls of ``dtype`` on a path of its own, outside the
    backends (which refuse that dtype); :func:`describe` hands such requests to ``describe_path``
    (``describe_path(req, backend)``: one line, what serves the call)."""
    _DTYPE_PATHS[dtype] = describe_path


def _format(reasons: Dict[str, List[str]]) -> str:
    return "; ".join(f"{name}: {', '.join(r) if r else 'ok'}" for name, r in reasons.items())


def select_backend(backend: Union[str, Backend], req: AttentionRequest) -> BackendSpec:
    """Resolve the ``backend`` argument to the spec that serves ``req``."""
    if isinstance(backend, enum.Enum):
        backend = backend.value
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or Backend enum, got {backend!r}")
    if backend == Backend.AUTO.value:
        for spec in _BY_PRIORITY:
            auto_ok = spec.auto_devices is None or req.device_type in spec.auto_devices
            if auto_ok and not spec.not_supported_reasons(req):
                return spec
        raise ValueError(f"backend='auto': no backend serves this call ({_format(explain(req))})")
    spec = _REGISTRY.get(backend)
    if spec is None:
        known = ", ".join(["auto"] + [s.name for s in registered_backends()])
        raise ValueError(f"backend must be one of {known}; got {backend!r}")
    reasons = spec.not_supported_reasons(req)
    if reasons:
        raise ValueError(
            f"backend={backend!r} cannot serve this call: {', '.join(reasons)}. "
            f"All backends: {_format(explain(req))}"
        )
    return spec


def select_for_call(backend: Union[str, Backend], q: torch.Tensor, k: torch.Tensor,
                    params: AttentionParams) -> BackendSpec:
    """:func:`select_backend` for a validated call, remembered per call key (host time matters)."""
    if not isinstance(backend, (str, enum.Enum)) or torch.compiler.is_compiling():
        # (Under torch.compile, a cache mutated by the first call would only add a recompile.)
        return select_backend(backend, AttentionRequest.from_call(q, k, params))
    key = (backend, _call_key(q, k, params))
    spec = _SELECTED.get(key)
    if spec is None:
        spec = select_backend(backend, AttentionRequest._from_key(key[1]))
        _SELECTED[key] = spec
    return spec
