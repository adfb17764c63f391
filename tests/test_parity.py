"""End-to-end parity: a tiny encoder trained on the reference and on the Triton backend.

Same seed, data and optimizer; the loss curves must match step by step. On CPU the Triton side
runs through the Triton interpreter, which has to be switched on (``TRITON_INTERPRET=1``)
before the kernels are imported, so it runs in a subprocess (this file as a script). On a GPU
both sides run here, in bf16 autocast.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from blockattn_layers import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

STEPS = 24
TRITON_MISSING = importlib.util.find_spec("blockattn_layers.ops.backends.triton_block") is None


def _batches(device, steps, generator):
    """Jagged batches (lengths 0..33: empty, short, one to three blocks) with a regression target."""
    teacher = torch.randn(32, 1, generator=generator)
    for _ in range(steps):
        lengths = torch.randint(0, 34, (3,), generator=generator)
        offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        x = torch.randn(int(offsets[-1]), 32, generator=generator)
        context = torch.repeat_interleave(torch.segment_reduce(x, "mean", lengths=lengths, unsafe=True), lengths, dim=0)
        yield x.to(device), offsets.to(device), torch.tanh((x + context) @ teacher).to(device)


def train_losses(backend, device="cpu", autocast_dtype=None, steps=STEPS):
    """Losses of ``steps`` Adam steps of a one-layer block-attention encoder plus a linear head.

    Small on purpose: the Triton interpreter costs tens of milliseconds per kernel program.
    """
    torch.manual_seed(0)
    layer = JaggedTransformerEncoderLayer(
        32, 2, 64, 0.0, block_size=16, norm_first=True, rope_theta=100.0, num_kv_heads=1, backend=backend,
    )
    encoder = JaggedTransformerEncoder(layer, 1, norm=torch.nn.LayerNorm(32)).to(device)
    head = torch.nn.Linear(32, 1).to(device)
    params = list(encoder.parameters()) + list(head.parameters())
    optimizer = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for x, offsets, target in _batches(device, steps, torch.Generator().manual_seed(1)):
        with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = torch.nn.functional.mse_loss(head(encoder(x, offsets)).float(), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _check_curves(reference, triton, rtol):
    assert len(reference) == len(triton) == STEPS
    assert sum(reference[-5:]) < 0.7 * sum(reference[:5]), f"the encoder did not learn: {reference}"
    for step, (r, t) in enumerate(zip(reference, triton)):
        assert abs(r - t) <= rtol * abs(r), f"step {step}: reference {r:.6g} vs triton {t:.6g}"


@pytest.mark.skipif(TRITON_MISSING, reason="the Triton backend (ops.backends.triton_block) is not in this tree")
def test_loss_curves_match_reference_vs_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "triton"], capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    triton = json.loads(result.stdout.strip().splitlines()[-1])
    _check_curves(train_losses("reference"), triton, rtol=1e-3)


@pytest.mark.gpu
def test_loss_curves_match_reference_vs_triton_bf16_cuda():
    reference = train_losses("reference", "cuda", torch.bfloat16)
    triton = train_losses("triton", "cuda", torch.bfloat16)
    _check_curves(reference, triton, rtol=3e-2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(train_losses(sys.argv[1])))
