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


def test_hopper_admits():
    """The hopper kernels' inputs: 16-bit, D 64 / 128, blocks <= 64 rows, full split-half rotary or
    none, 32-bit offsets, 16-byte aligned rows of unit channel stride and 16-divisible strides."""
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)
    ok = dict(block_size=64, rot=0, interleaved=False, int64=False)

    def admits(x=q, tensors=None, **kw):
        return _common.hopper_admits(x, (x,) if tensors is None else tensors, **dict(ok, **kw))

    assert admits() and admits(rot=128) and admits(block_size=16)
    assert admits(torch.empty(5, 4, 64, dtype=torch.float16))
    assert not admits(rot=128, interleaved=True) and not admits(rot=64) and not admits(block_size=65)
    assert not admits(int64=True)
    assert not admits(torch.empty(5, 2, 128)) and not admits(torch.empty(5, 2, 96, dtype=torch.bfloat16))
    wide = torch.empty(5, 2, 136, dtype=torch.bfloat16)
    assert not admits(q, (q, wide[..., :128]))  # head stride 136
    assert not admits(q, (q, torch.empty(5, 128, 2, dtype=torch.bfloat16).transpose(1, 2)))  # channel stride 2
    flat = torch.empty(5 * 2 * 128 + 8, dtype=torch.bfloat16)
    assert not admits(q, (q, flat[8 - 1:-1].view(5, 2, 128)))  # 2-byte aligned rows
    assert admits(q, (q, flat[8:].view(5, 2, 128)))


def test_hopper_ws_admits():
    """The hopper_ws kernels' inputs: the hopper kernels', one query head per kv head, the heads of a
    row contiguous (one ``[T, H * D]`` tensor map covers them) where there is more than one."""
    q = torch.empty(5, 2, 128, dtype=torch.bfloat16)

    def admits(*tensors, **kw):
        args = dict(dict(block_size=64, rot=0, interleaved=False, int64=False), **kw)
        return _common.hopper_ws_admits(tensors[0], tensors, **args)

    assert admits(q, q, q) and admits(q, q, q, q, rot=128)
    assert not admits(q, q, q, block_size=65) and not admits(q.float(), q.float(), q.float())
    assert not admits(torch.empty(5, 4, 128, dtype=torch.bfloat16), q, q)  # GQA
    packed = torch.empty(5, 6, 128, dtype=torch.bfloat16)
    assert admits(packed[:, :2], packed[:, 2:4], packed[:, 4:])  # row stride 6 * 128, heads contiguous
    gaps = torch.empty(5, 2, 256, dtype=torch.bfloat16)[..., :128]
    assert _common.hopper_admits(gaps, (gaps,), 64, 0, False, False) and not admits(gaps, gaps, gaps)
    one = torch.empty(5, 1, 256, dtype=torch.bfloat16)[..., :128]
    assert admits(one, one, one)  # one head: its stride does not matter


def test_gluon_kernels_looked_up_by_module(monkeypatch):
    """A Triton whose Gluon lacks what hopper_ws needs still has the hopper kernels."""
    assert _common.hopper_kernel("_hopper_ws_fwd_kernel") is not None
    monkeypatch.setattr(_common, "hopper_ws_available", lambda: False)
    assert _common.hopper_kernel("_hopper_ws_fwd_kernel") is None
    assert _common.hopper_kernel("_hopper_fwd_kernel") is not None
    q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
    assert not _common.hopper_ws_fits(q, (q, q, q), 64, 0, False, False)


def test_hopper_ws_falls_back_to_hopper_then_simple(monkeypatch):
    q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
    args = (q, (q,), 64, 0, False, False)
    monkeypatch.setattr(_common, "KERNELS", "hopper_ws")
    assert _common.block_variant(*args) == "simple"  # CPU tensors: not an sm_90 GPU
    monkeypatch.setattr(_common, "hopper_fits", lambda *a: True)
    assert _common.block_variant(*args) == "hopper"
    monkeypatch.setattr(_common, "hopper_ws_fits", lambda *a: True)
    assert _common.block_variant(*args) == "hopper_ws"
    for backward, dim, per_sm in ((False, 64, 2), (False, 128, 2), (True, 64, 2), (True, 128, 1)):
        meta, loop, key = _common.block_plan(q, q, 16, 0, False, False, False, backward, 0, False, "hopper_ws")
        assert meta["BLOCK_M"] == 64 and meta["PERSISTENT"] and meta["num_stages"] == 1 and not loop
        assert meta["maxnreg"] == _common.HOPPER_WS_MAXNREG and key[-1] == "hopper_ws"
        meta = dict(meta, BLOCK_D=dim)
        sms = _common.sm_count(q.device)
        assert _common.block_grid(meta, 1000, 2, q.device, backward, "hopper_ws") == (sms * per_sm,)
        assert _common.block_grid(meta, 1, 2, q.device, backward, "hopper_ws") == (2,)


def test_hopper_variant_falls_back_to_simple(monkeypatch):
    q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
    args = (q, (q,), 64, 0, False, False)
    monkeypatch.setattr(_common, "KERNELS", "hopper")
    assert _common.block_variant(*args) == "simple"  # CPU tensors: not an sm_90 GPU
    monkeypatch.setattr(_common, "hopper_fits", lambda *a: True)
    assert _common.block_variant(*args) == "hopper"
    monkeypatch.setattr(_common, "KERNELS", "persistent")
    assert _common.block_variant(*args) == "persistent"
    for backward in (False, True):
        meta, loop, key = _common.block_plan(q, q, 16, 0, False, False, False, backward, 512, False, "hopper")
        assert meta["BLOCK_M"] == 64 and not meta["PERSISTENT"] and meta["num_stages"] == 1 and not loop
        assert meta.get("maxnreg") == _common.HOPPER_MAXNREG.get((backward, 64, False))
        assert key[-1] == "hopper" and _common.block_grid(meta, 10, 2, q.device, backward) == (10, 2)
    groups = dict(ROT_DIM=0, BLOCK_D=128, BLOCK_M=64, GROUPS=2)
    assert _common.max_registers(groups, "hopper", True, 9, 2) is None
    # Rotary at D64, one query head per kv head: the forward loops over the kv heads.
    for kv_heads, loops in ((2, True), (1, False)):
        meta, loop, _ = _common.block_plan(q, q[:, :kv_heads], 64, 64, False, False, False, False, 512, False, "hopper")
        assert loop == meta["HEAD_LOOP"] == loops
        assert meta.get("maxnreg") == (_common.HEAD_LOOP_MAXNREG if loops else None)


def test_forward_signature_separates_what_the_launch_depends_on(monkeypatch):
    """``block_fwd._signature`` (the remembered forward launches' key) differs whenever anything
    the variant, the launch plan or the launcher's key reads differs, and is the same across
    batches (T, B) of one layout, which reuse the remembered launch."""
    from blockattn_layers.kernels import _schedule, block_fwd

    def signature(total=70, heads=2, kv_heads=2, dim=64, dtype=torch.float16, view=None, positions=None,
                  block_size=64, rot=0, interleaved=False, causal=False, seqs=2, **_):
        q = torch.empty(total, heads, dim, dtype=dtype)
        k = torch.empty(total, kv_heads, dim, dtype=dtype)
        if view is not None:
            q = view(q)
        offsets = torch.linspace(0, total, seqs + 1).long()
        sched = _schedule.Schedule(offsets, total, block_size, None)
        pos = positions if positions is not None else sched.table
        ptrs = [t.data_ptr() for t in (q, k, k, q, sched.table, pos)]
        return block_fwd._signature(q, k, k, pos, sched, block_size, rot, interleaved, positions is not None, causal,
                                    tuple([p % 16 == 0 for p in ptrs]))

    base = signature()
    assert signature(total=500, seqs=7) == base  # another batch, same layout
    changed = [
        signature(dtype=torch.bfloat16), signature(heads=4), signature(kv_heads=1), signature(dim=128),
        signature(view=lambda q: torch.empty(70, 4, 64, dtype=q.dtype)[:, :2]),  # head-strided view
        signature(view=lambda q: torch.empty(70 * 2 * 64 + 1, dtype=q.dtype)[1:].view(70, 2, 64)),  # unaligned
        signature(positions=torch.zeros(70, dtype=torch.int64)), signature(positions=torch.zeros(70)),
        signature(block_size=48), signature(rot=64), signature(rot=64, interleaved=True), signature(causal=True),
    ]
    monkeypatch.setattr(_schedule, "INLINE_MAX_SEQS", 0)
    changed.append(signature())  # the block table instead of the in-kernel schedule
    monkeypatch.undo()
    monkeypatch.setattr(_common, "KERNELS", "persistent")
    changed.append(signature())
    monkeypatch.undo()
    matmul = torch.backends.cuda.matmul
    tf32 = matmul.allow_tf32
    try:
        for allow in (True, False):  # fp32 dots follow this flag
            matmul.allow_tf32 = allow
            changed.append(signature(dtype=torch.float32))
    finally:
        matmul.allow_tf32 = tf32
    assert len({base, *changed}) == len(changed) + 1
