"""Host-side launch plans: ``_common.block_plan`` (options built once per signature) and the
launcher's direct call of Triton's C launch function. CPU only: no kernel runs here."""
import itertools

import pytest
import torch
from triton.backends.nvidia.driver import CudaLauncher

from blockattn_layers.kernels import _common, _launch


def _options_per_call(q, k, block_size, rot, interleaved, has_pos, causal, backward, inline_seqs, int64):
    """The launch options as the launchers built them on every call before ``block_plan``."""
    positions = torch.zeros(q.shape[0]) if has_pos else None
    meta = _common.kernel_meta(q, k, block_size=block_size, rope_theta=10000.0 if rot else None, rotary_dim=rot,
                               interleaved=interleaved, positions=positions, causal=causal, backward=backward)
    meta.pop("log2_theta")
    variant = _common.kernel_variant(q)
    meta.update(INT64=int64, GROUPS=q.shape[1] // k.shape[1], INLINE_SEQS=inline_seqs,
                **_common.variant_options(variant))
    if not backward:
        meta["HEAD_LOOP"] = _common.head_loop(meta, variant)
    meta["num_stages"] = _common.tile_loop_stages(variant, _common.major_of(q), q.element_size(), meta["BLOCK_M"],
                                                  meta["BLOCK_D"], backward)
    meta["PREFETCH"] = meta["num_stages"] > 1
    regs = _common.max_registers(meta, variant, backward, _common.major_of(q), q.element_size())
    if regs:
        meta["maxnreg"] = regs
    return meta


@pytest.mark.parametrize("variant", ["simple", "persistent"])
def test_block_plan_gives_the_options_built_per_call(monkeypatch, variant):
    monkeypatch.setattr(_common, "KERNELS", variant)
    cases = itertools.product(
        [torch.float16, torch.float32], [(4, 2, 64), (2, 2, 128), (8, 1, 40)], [16, 64, 100],
        [False, True], [False, True], [False, True], [0, 512],
    )
    for dtype, (heads, kv_heads, dim), block, rotary, causal, backward, inline in cases:
        q, k = torch.empty(3, heads, dim, dtype=dtype), torch.empty(3, kv_heads, dim, dtype=dtype)
        rot = dim if rotary else 0
        for interleaved, has_pos, int64 in [(False, False, False), (rotary, True, True)]:
            args = (q, k, block, rot, interleaved, has_pos, causal, backward, inline, int64)
            meta, loop, key = _common.block_plan(*args)
            assert meta == _options_per_call(*args), args
            assert loop == (not backward and meta["HEAD_LOOP"])
            assert _common.block_plan(*args)[2] is key  # built once, then looked up


def test_block_plan_key_follows_tf32_and_variant(monkeypatch):
    q = torch.empty(3, 2, 64)
    args = (q, q, 64, 0, False, False, False, False, 512, False)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = _common.block_plan(*args)
        torch.backends.cuda.matmul.allow_tf32 = False
        ieee = _common.block_plan(*args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert (tf32[0]["PRECISION"], ieee[0]["PRECISION"]) == ("tf32", "ieee") and tf32[2] != ieee[2]
    monkeypatch.setattr(_common, "KERNELS", "persistent")
    persistent = _common.block_plan(*args)
    assert persistent[0]["PERSISTENT"] and not ieee[0]["PERSISTENT"] and persistent[2] != ieee[2]


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _compiled(scratch: int):
    """A compiled kernel as Triton 3.6 builds it, with its launcher object made without compiling."""
    run = object.__new__(CudaLauncher)
    run.num_ctas, run.launch = 1, _Recorder()
    run.global_scratch_size = run.profile_scratch_size = scratch
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    compiled = type("Compiled", (), {})()
    compiled.run, compiled.function, compiled.packed_metadata = run, 1234, ("meta",)
    return compiled


def test_direct_launch_passes_what_tritons_launcher_passes():
    compiled = _compiled(scratch=0)
    args, consts = (0xA000, 7, 0.5), (64, True)
    CudaLauncher.__call__(compiled.run, 3, 2, 1, 99, compiled.function, compiled.packed_metadata, None, None, None,
                          *args, *consts)
    launch, head, kept = _launch._entry(compiled, consts)
    assert launch is compiled.run.launch and kept == consts
    launch(3, 2, 1, 99, *head, *args, *kept)
    through_triton, direct = compiled.run.launch.calls
    assert direct == through_triton


def test_kernels_with_scratch_memory_keep_tritons_launcher():
    compiled = _compiled(scratch=16)
    launch, head, _ = _launch._entry(compiled, ())
    assert launch is compiled.run and head == (compiled.function, compiled.packed_metadata, None, None, None)


@pytest.mark.parametrize("dtype,dim,block,fwd_stages,bwd_stages", [
    (torch.bfloat16, 128, 64, 2, 1), (torch.float16, 64, 64, 2, 2), (torch.bfloat16, 48, 64, 2, 2),
    (torch.float32, 128, 64, 1, 1), (torch.float32, 64, 64, 1, 1), (torch.bfloat16, 256, 64, 1, 1),
    (torch.bfloat16, 64, 128, 1, 1),
])
def test_persistent_tile_loop_stages(monkeypatch, dtype, dim, block, fwd_stages, bwd_stages):
    """The persistent kernels pipeline their tile loop (2 stages) where the prefetch buffers fit
    and it measured no slower (2-byte dtypes, 64-row tiles, forward D <= 128, backward D <= 64;
    Hopper choices off the GPU); the simple ones take 1."""
    q = torch.empty(8, 2, dim, dtype=dtype)
    for variant in ("persistent", "simple"):
        monkeypatch.setattr(_common, "KERNELS", variant)
        _common._BLOCK_PLANS.clear()
        for backward in (False, True):
            want = (bwd_stages if backward else fwd_stages) if variant == "persistent" else 1
            meta = _common.block_plan(q, q, block, 0, False, False, False, backward, 0, False)[0]
            assert meta["num_stages"] == want and meta["PREFETCH"] == (want > 1)
