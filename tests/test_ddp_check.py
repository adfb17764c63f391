"""``blockattn_layers.distributed_check`` under torchrun: two processes, DDP, a PASS line from rank 0."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(*args, env=None, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "blockattn_layers.distributed_check", *args]
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "PASS", output
    return lines


def test_attention_kernel_names_cover_every_launcher():
    """The check counts a profiler event as attention by its kernel name: every attention kernel
    the package launches (any variant; the schedule kernels excepted) is named there."""
    from blockattn_layers.distributed_check import ATTENTION_KERNELS
    from blockattn_layers.kernels.block import bwd as block_bwd
    from blockattn_layers.kernels.block import fwd as block_fwd
    from blockattn_layers.kernels.common import launch as _launch
    from blockattn_layers.kernels.experimental import sm90_ws
    from blockattn_layers.kernels.flash import bwd as flash_bwd
    from blockattn_layers.kernels.flash import fwd as flash_fwd
    from blockattn_layers.kernels.sm90 import block as sm90_block
    from blockattn_layers.kernels.sm90 import flash_fwd as sm90_flash_fwd
    from blockattn_layers.kernels.sm90 import flash_persistent

    modules = (block_fwd, block_bwd, flash_fwd, flash_bwd, sm90_block, sm90_ws, sm90_flash_fwd, flash_persistent)
    launched = {launcher.kernel.__name__ for module in modules
                for launcher in vars(module).values()
                if isinstance(launcher, _launch.Launcher) and launcher.kernel is not None}
    assert {"_block_fwd_kernel", "_block_bwd_kernel", "_flash_fwd_kernel"} <= launched
    assert launched <= set(ATTENTION_KERNELS)


def test_ddp_check_gloo_cpu_reference():
    lines = _torchrun("--backend-dist", "gloo", "--attn-backend", "reference", "--steps", "3")
    assert "NCCL_NVLS_ENABLE=0" in lines[0]
    for rank in (0, 1):
        assert any(line.startswith(f"rank {rank} on cpu") and "via ['reference']" in line for line in lines)


@pytest.mark.slow
def test_ddp_check_gloo_cpu_triton_interpreter():
    """The Triton kernels, run by Triton's interpreter on CPU tensors, under DDP."""
    lines = _torchrun("--backend-dist", "gloo", "--attn-backend", "triton", "--steps", "1",
                      env=dict(os.environ, TRITON_INTERPRET="1"))
    assert sum("via ['triton']" in line for line in lines) == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ddp_check_nccl_two_gpus_triton(dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = _torchrun("--backend-dist", "nccl", "--attn-backend", "triton", "--dtype", dtype, env=env, timeout=600)
    assert any(line.startswith("rank 1 on cuda:1 (current cuda:1)") and "via ['triton']" in line for line in lines)
    assert sum("sync-debug: error mode, no sync" in line for line in lines) == 2
    for rank in (0, 1):
        line = next(line for line in lines if line.startswith(f"rank {rank} on"))
        assert f"attention on cuda:{rank}" in line and f"cuda:{1 - rank}" not in line.split("GPU kernels:")[1]
