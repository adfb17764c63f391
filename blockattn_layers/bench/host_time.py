"""``python -m blockattn_layers.bench.host_time [LABEL]``: host time per eager call at the small shape.

B=64 sequences of 1-256 tokens, H4 D64, bf16, block 64 (the benchmark's ``small`` case): the
forward without grad, the forward with grad, and forward + backward. The GPU time of a call is
13-17 us, so these calls are host-bound and the wall time per call, over many calls with one
sync at the end, is the host's pace. Prints the median of 7 repeats of 400 calls, in us per call.
Run it in alternating processes of two trees to compare their host time (BENCHMARKS.md).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import blockattn_layers as bl

CALLS, REPEATS, WARMUP = 400, 7, 50


def per_call_us(fn) -> float:
    """Median wall time per call of ``fn`` in microseconds."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    label = (sys.argv[1:] if argv is None else list(argv))[:1] or ["host time"]
    if not torch.cuda.is_available():
        print("host_time needs a CUDA GPU")
        return 1
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 257, (64,), generator=g)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).cuda()
    total = int(lengths.sum())
    q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grad_out = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            bl.block_attention(q, k, v, offsets, 64)

    def forward_with_grad():
        bl.block_attention(*leaves, offsets, 64)

    def forward_backward():
        torch.autograd.grad(bl.block_attention(*leaves, offsets, 64), leaves, grad_out)

    cases = (("fwd", forward), ("fwd_grad", forward_with_grad), ("fwd_bwd", forward_backward))
    print(label[0], " ".join(f"{name} {per_call_us(fn):.1f}" for name, fn in cases), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
