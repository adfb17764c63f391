"""Which backend ``backend="auto"`` picks for an :class:`~blockattn_layers.AttentionRequest`, and why."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import fp8
from ..ops import backends as _backends  # noqa: F401  (registers the backends)
from ..ops.backends.triton_block import CUDA_UNAVAILABLE
from ..dispatch import AttentionRequest, explain, explain_variants, registered_backends


def _without_the_machine(reasons: List[str], hypothetical: bool) -> List[str]:
    """``reasons``, less "CUDA is not available" where ``hypothetical`` (a device this machine lacks)."""
    return [r for r in reasons if r != CUDA_UNAVAILABLE] if hypothetical else reasons


def _backend_reasons(req: AttentionRequest, hypothetical: bool) -> Dict[str, List[str]]:
    """Every backend's reasons to refuse ``req`` (``explain``), judged as :func:`auto_choice` says."""
    return {name: _without_the_machine(why, hypothetical) for name, why in explain(req).items()}


def auto_choice(req: AttentionRequest, hypothetical: bool = False) -> Tuple[Optional[str], Dict[str, List[str]]]:
    """``(name or None, reasons)``: what ``backend="auto"`` picks for ``req`` and every backend's
    reasons to refuse it (an empty list: it can serve it; ``"auto: ..."``: only by name).

    ``hypothetical=True`` judges a device this machine lacks by every check but the one of the local
    machine ("CUDA is not available"): the backends' declared capabilities and their own rules.
    """
    reasons = _backend_reasons(req, hypothetical)
    choice = None
    for spec in registered_backends():
        if spec.auto_devices is not None and req.device_type not in spec.auto_devices:
            if not reasons[spec.name]:
                reasons[spec.name] = [f"auto: not picked on {req.device_type} (ask for it by name)"]
            continue
        if choice is None and not reasons[spec.name]:
            choice = spec.name
    return choice, reasons


def format_choice(req: AttentionRequest, hypothetical: bool = False) -> List[str]:
    """Lines saying what ``auto`` picks for ``req``, then each backend's reasons to refuse it (or ok),
    and for the chosen backend's kernel variants which one runs and why the others do not. An fp8
    request (``block_attention``'s own forward-only path, ``blockattn_layers.fp8``) says what serves
    it: the fp8 kernels, or descaled copies followed by these lines for the call on them."""
    if req.dtype == fp8.FP8_DTYPE:
        kernel_reasons = _without_the_machine(fp8.kernel_request_reasons(req), hypothetical)
        lines = [f"auto -> {fp8.path_line(req, kernel_reasons)}"]
        if kernel_reasons:
            lines += [f"  {line}" for line in format_choice(fp8.descaled_request(req), hypothetical)]
        return lines
    choice, reasons = auto_choice(req, hypothetical)
    lines = [f"auto -> {choice or 'no backend'}"]
    for name, why in reasons.items():
        lines.append(f"  {name}: {'; '.join(why) if why else 'ok'}")
    variants = explain_variants(req, _backend_reasons(req, hypothetical)).get(choice)
    if variants:
        running = next((name for name, why in variants.items() if not why), "chosen per call")
        lines.append(f"  {choice} kernels -> {running}")
        for name, why in variants.items():
            lines.append(f"    {name}: {'; '.join(why) if why else 'runs'}")
    return lines


def describe_request(req: AttentionRequest) -> str:
    """A one-line summary of ``req``: device, dtype, heads, head dim, block size, features."""
    device = req.device_type + (f" sm_{req.capability[0]}{req.capability[1]}" if req.capability else "")
    dtype = str(req.dtype).replace("torch.", "")
    heads = f"H={req.num_heads}" + (f"/{req.num_kv_heads} kv" if req.num_kv_heads != req.num_heads else "")
    block = "full (block_size=None)" if req.block_size is None else f"block {req.block_size}"
    extras = [name for name, on in (("causal", req.causal), ("rotary", req.rotary)) if on]
    return ", ".join([device, dtype, heads, f"D={req.head_dim}", block, *extras])
