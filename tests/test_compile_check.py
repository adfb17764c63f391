"""The kernels compile for sm_80, sm_90 and sm_100 on a machine without a GPU, with each
generation's matrix instructions in the PTX (``mma.sync``, ``wgmma``, ``tcgen05.mma``)."""
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("arch,instruction", [("sm_80", "mma.sync"), ("sm_90", "wgmma"), ("sm_100", "tcgen05.mma")])
def test_compile_check(arch, instruction, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", arch, "--out", str(tmp_path), "--only", "bf16_b64_d128"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ptx = {p.name: p.read_text() for p in tmp_path.glob("*.ptx")}
    # fwd/bwd x rotary x causal x simple/persistent, and persistent_ws (TMA) from sm_90 on
    # (not the rotary backward on sm_100: see kernels._common.warp_specialized_builds)
    assert len(ptx) == {"sm_80": 16, "sm_90": 24, "sm_100": 22}[arch]
    assert all(instruction in text for text in ptx.values())
    warp_specialized = [text for name, text in ptx.items() if "persistent_ws" in name]
    assert all("setmaxnreg" in text and "cp.async.bulk.tensor" in text for text in warp_specialized)
    # 16-byte tile loads: vector loads into registers, cp.async.cg copies into shared memory
    # (16 bytes each), or TMA boxes.
    vector = ("ld.global.v4", "cp.async.cg.shared.global", "cp.async.bulk.tensor")
    assert all(any(op in text for op in vector) for text in ptx.values()), "tile loads should be 16-byte vectors"
