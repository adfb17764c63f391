"""``python -m blockattn_layers info``: versions, device, and what ``backend="auto"`` picks for typical inputs."""
from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import List, Optional, Tuple

import torch

from ..dispatch import AttentionRequest, registered_backends
from .backend_choice import describe_request, format_choice

HYPOTHETICAL_CAPABILITY = (9, 0)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_lines() -> List[str]:
    if not torch.cuda.is_available():
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        note = "TRITON_INTERPRET=1: Triton kernels can run on CPU tensors, slowly" if interp else "no CUDA device"
        return [f"device: cpu ({note})"]
    lines = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(f"device: cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor}), CUDA {torch.version.cuda}")
    return lines


def typical_requests() -> List[Tuple[str, AttentionRequest, bool]]:
    """``(title, request, hypothetical)`` for a few typical calls. CUDA requests use this machine's
    GPU, or capability :data:`HYPOTHETICAL_CAPABILITY` without one; ``hypothetical`` marks requests
    for a GPU this machine does not have."""
    local = torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    def req(device: str, dtype: torch.dtype, head_dim: int, block: Optional[int], capability=None, heads=(2, 2),
            rotary=False) -> Tuple[AttentionRequest, bool]:
        if device == "cuda":
            capability = capability or local or HYPOTHETICAL_CAPABILITY
        request = AttentionRequest(device, capability, dtype, head_dim, heads[0], heads[1], block, False, rotary)
        return request, device == "cuda" and capability != local

    rows = [
        ("CPU, fp32 (the demo)", req("cpu", torch.float32, 16, 64, rotary=True)),
        ("GPU training, bf16", req("cuda", torch.bfloat16, 128, 64)),
        ("GPU, rotary + GQA, fp16", req("cuda", torch.float16, 64, 64, heads=(4, 2), rotary=True)),
        ("GPU, full attention", req("cuda", torch.bfloat16, 128, None)),
        ("GPU, large blocks", req("cuda", torch.bfloat16, 128, 256)),
        ("GPU inference, fp8 e4m3", req("cuda", torch.float8_e4m3fn, 128, 64)),
        ("GPU, fp8 e4m3, large blocks", req("cuda", torch.float8_e4m3fn, 128, 256)),
        ("GPU, float64", req("cuda", torch.float64, 128, 64)),
        ("older GPU", req("cuda", torch.float16, 64, 64, capability=(7, 5))),
    ]
    return [(title, request, hypothetical) for title, (request, hypothetical) in rows]


def _versions() -> str:
    found = [("python", platform.python_version()), ("torch", torch.__version__)]
    for dist in ("triton", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"):
        version = _version(dist)
        if version is not None or dist in ("triton", "torchrec"):
            found.append((dist, version or "not installed"))
    return " | ".join(f"{name} {version}" for name, version in found)


def run() -> int:
    """Print the report; returns the exit status."""
    import blockattn_layers

    print(f"blockattn_layers {blockattn_layers.__version__} ({os.path.dirname(blockattn_layers.__file__)})")
    print(_versions())
    for line in _device_lines():
        print(line)
    print("backends (highest priority first):")
    for spec in registered_backends():
        print(f"  {spec.name}: {spec.description}")
    print('what backend="auto" picks, and why the others refuse:')
    for title, request, hypothetical in typical_requests():
        print(f"  {title}: {describe_request(request)}{' [hypothetical: not this machine]' if hypothetical else ''}")
        for line in format_choice(request, hypothetical):
            print(f"    {line}")
    return 0
