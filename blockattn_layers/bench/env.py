"""What a result was measured on: device, versions, commit, date; and the copy bandwidth."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Dict, Tuple

import torch

_ATEN_OPS = ("_flash_attention_forward", "_flash_attention_backward")


def git_commit() -> Tuple[str, str]:
    """``(commit, source)``: ``$BLOCKATTN_COMMIT`` if set (a copy of a tree whose own git
    metadata is stale, as on a remote GPU machine that receives the working tree), else git HEAD
    (``+dirty`` if the tree has changes), else unknown."""
    env = os.environ.get("BLOCKATTN_COMMIT")
    if env:
        return env, "BLOCKATTN_COMMIT"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            suffix = "+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
            return head.stdout.strip() + suffix, "git"
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", "none"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def metadata(device: torch.device, dtype: torch.dtype, bandwidth: float, bandwidth_source: str) -> Dict[str, object]:
    """Stamp for CSV/JSON: GPU, versions, commit, date, bandwidth used for the floors, aten schemas."""
    commit, commit_source = git_commit()
    meta: Dict[str, object] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=commit, commit_source=commit_source, python=platform.python_version(), torch=torch.__version__,
        triton=_triton_version(), cuda=torch.version.cuda, device=str(device), dtype=str(dtype).replace("torch.", ""),
        bandwidth_bytes_per_s=bandwidth, bandwidth_source=bandwidth_source, argv=" ".join(sys.argv[1:]),
        gpu="none", host=platform.node(),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
        )
    meta["aten_schemas"] = {
        name: str(getattr(torch.ops.aten, name).default._schema) for name in _ATEN_OPS
        if hasattr(torch.ops.aten, name)
    }
    return meta


def measure_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton.testing

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)
