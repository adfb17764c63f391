"""What a result was measured on: device, versions, commit, date; and the copy bandwidth of the floor.

The memory floor of a case is its bytes over a copy bandwidth (bytes read plus written).
:func:`floor_bandwidth` picks that bandwidth once per run: the H200's device copy measured in
PERFORMANCE.md on an H200, else a copy measured on the benchmark's device (a 4 GiB device copy on
other GPUs, a 256 MiB host copy on the CPU), unless the caller gives one.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, Optional, Tuple

import torch

_ATEN_OPS = ("_flash_attention_forward", "_flash_attention_backward")
H200_COPY_BANDWIDTH = 4.27e12  # bytes/s, read + write: the H200's device copy (PERFORMANCE.md)
GPU_COPY_BYTES = 4 << 30
CPU_COPY_BYTES = 256 << 20
CPU_COPY_REPS = 5


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


def cpu_name() -> str:
    """The CPU model: the first ``model name`` of ``/proc/cpuinfo``, else ``platform.processor()``,
    else the machine type (or ``unknown CPU``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}"


def _usable_cpus() -> Optional[int]:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA; on the CPU its model with torch's intra-op threads and the usable
    CPUs (the threads set how fast both the copy and the methods run); else the device string."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{cpu_name()}, {_threads()} of {_usable_cpus()} CPUs"
    return str(device)


def metadata(device: torch.device, dtype: torch.dtype, bandwidth: float, bandwidth_source: str) -> Dict[str, object]:
    """Stamp for CSV/JSON: device, versions, commit, date, bandwidth used for the floors and its
    source, aten schemas. ``gpu`` is the GPU's name or ``none``; ``device_name`` names the device
    on CPU as well."""
    commit, commit_source = git_commit()
    meta: Dict[str, object] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=commit, commit_source=commit_source, python=platform.python_version(), torch=torch.__version__,
        triton=_triton_version(), cuda=torch.version.cuda, device=str(device), dtype=str(dtype).replace("torch.", ""),
        bandwidth_bytes_per_s=bandwidth, bandwidth_source=bandwidth_source, argv=" ".join(sys.argv[1:]),
        gpu="none", device_name=device_name(device), threads=torch.get_num_threads(), host=platform.node(),
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


def copy_bytes(device: torch.device) -> int:
    """Bytes copied to measure ``device``'s bandwidth: 4 GiB on CUDA (at most an eighth of the
    GPU's memory), 256 MiB elsewhere (well past any CPU's last-level cache)."""
    if device.type == "cuda":
        return min(GPU_COPY_BYTES, torch.cuda.get_device_properties(device).total_memory // 8)
    return CPU_COPY_BYTES


def measure_bandwidth(device: torch.device, nbytes: Optional[int] = None) -> float:
    """Copy bandwidth of ``device`` in bytes/s, counting bytes read plus written, for a copy of
    ``nbytes`` (default :func:`copy_bytes`).

    CUDA: the median of ``triton.testing.do_bench`` over a device-to-device copy. Elsewhere: the
    host-clock median of ``CPU_COPY_REPS`` copies after one untimed copy, with torch's current
    intra-op threads (the copy is synchronous there).
    """
    nbytes = nbytes or copy_bytes(device)
    if device.type == "cuda":
        import triton.testing

        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        del src, dst
        torch.cuda.empty_cache()  # give the copy's memory back to the cases that follow
        return 2 * nbytes / (ms * 1e-3)
    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(CPU_COPY_REPS):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def floor_bandwidth(device: torch.device, requested: Optional[float] = None,
                    measure: bool = False) -> Tuple[float, str]:
    """``(bytes/s, source)`` for the memory floors of a run on ``device``.

    ``requested`` (``--bandwidth``) wins. On an H200 the copy bandwidth measured there
    (PERFORMANCE.md, 4.27 TB/s) is used unless ``measure`` asks for a fresh measurement; any other
    GPU and the CPU are measured with :func:`measure_bandwidth`.
    """
    if requested is not None:
        return requested, "--bandwidth"
    if device.type == "cuda" and not measure and "H200" in torch.cuda.get_device_name(device):
        return H200_COPY_BANDWIDTH, "H200 device copy (PERFORMANCE.md)"
    nbytes = copy_bytes(device)
    if device.type == "cuda":
        how = f"{nbytes / 2**30:.3g} GiB device copy, do_bench median"
    else:
        how = f"{nbytes >> 20} MiB host copy, {_threads()}, median of {CPU_COPY_REPS}"
    return measure_bandwidth(device, nbytes), f"measured ({how})"


def bandwidth_text(bandwidth: float) -> str:
    """``4.27 TB/s`` or ``41.3 GB/s``."""
    return f"{bandwidth / 1e12:.2f} TB/s" if bandwidth >= 1e12 else f"{bandwidth / 1e9:.1f} GB/s"
