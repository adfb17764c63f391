"""Host-side launch plans: ``block.plan.block_plan`` (options built once per signature) and the
launcher's direct call of Triton's C launch function. CPU only: no kernel runs here."""
import itertools

import pytest
import torch
from triton.backends.nvidia.driver import CudaLauncher

from blockattn_layers.kernels.block import plan, variants
from blockattn_layers.kernels.common import launch as _launch
from blockattn_layers.kernels.common import meta as _meta

from tests.oracle import tf32_products


def _options_per_call(q, k, block_size, rot, interleaved, has_pos, causal, backward, inline_seqs, int64, variant):
    """The launch options as built from their parts on every call, for the simple kernels."""
    positions = torch.zeros(q.shape[0]) if has_pos else None
    meta = _meta.kernel_meta(q, k, block_size=block_size, rope_theta=10000.0 if rot else None, rotary_dim=rot,
                             interleaved=interleaved, positions=positions, causal=causal, backward=backward)
    meta.pop("log2_theta")
    meta.update(INT64=int64, GROUPS=q.shape[1] // k.shape[1], INLINE_SEQS=inline_seqs, SLOT=0)
    if not backward:
        meta["HEAD_LOOP"] = plan.head_loop(meta, variant.name)
    else:
        meta["num_warps"] = plan.simple_backward_warps(meta)
    regs = plan.max_registers(meta, variant, backward, _meta.major_of(q), q.element_size())
    if regs:
        meta["maxnreg"] = regs
    return meta


def _plan(*args, variant=variants.SIMPLE):
    launcher = variant.kernels()[args[7]]
    return plan.block_plan(*args, variant, launcher)


def test_block_plan_gives_the_options_built_per_call():
    cases = itertools.product(
        [torch.float16, torch.float32], [(4, 2, 64), (2, 2, 128), (8, 1, 40)], [16, 64, 100],
        [False, True], [False, True], [False, True], [0, 512],
    )
    for dtype, (heads, kv_heads, dim), block, rotary, causal, backward, inline in cases:
        q, k = torch.empty(3, heads, dim, dtype=dtype), torch.empty(3, kv_heads, dim, dtype=dtype)
        rot = dim if rotary else 0
        for interleaved, has_pos, int64 in [(False, False, False), (rotary, True, True)]:
            args = (q, k, block, rot, interleaved, has_pos, causal, backward, inline, int64)
            meta, loop, key = _plan(*args)
            assert meta == _options_per_call(*args, variants.SIMPLE), args
            assert loop == (not backward and meta["HEAD_LOOP"])
            assert _plan(*args)[2] is key  # built once, then looked up


@pytest.mark.parametrize("heads,block,rotary,warps", [
    ((4, 1, 96), 64, True, 8), ((8, 2, 32), 128, False, 8), ((4, 1, 256), 32, True, 8),
    ((2, 2, 96), 64, True, 4), ((4, 1, 64), 32, False, 4), ((4, 1, 256), 16, True, 4),
])
def test_simple_backward_of_grouped_heads_takes_8_warps_where_measured_faster(heads, block, rotary, warps):
    """The simple backward of grouped query heads: 8 warps on 64- and 128-row tiles and on 32-row
    tiles of D256 with rotary (H200), 4 elsewhere on tiles up to 64 x 128; the forward keeps 4."""
    h, hk, d = heads
    q, k = torch.empty(3, h, d, dtype=torch.bfloat16), torch.empty(3, hk, d, dtype=torch.bfloat16)
    args = (q, k, block, d if rotary else 0, False, False, False)
    assert _plan(*args, True, 0, False)[0]["num_warps"] == warps
    assert _plan(*args, False, 0, False)[0]["num_warps"] == 4


@pytest.mark.parametrize("block,dim,backward,precision", [
    (64, 128, True, "tf32"), (128, 128, True, "ieee"), (64, 256, True, "ieee"), (128, 64, True, "tf32"),
    (64, 256, False, "tf32"), (128, 256, False, "ieee"), (128, 128, False, "tf32"),
])
def test_float32_takes_tf32_products_only_where_their_tiles_fit(block, dim, backward, precision):
    """With TF32 allowed, float32 tiles whose operands would overflow a program's shared memory
    (H200: 227 KB) take IEEE products instead of failing to launch; 16-bit types are unaffected."""
    q = torch.empty(3, 2, dim)
    with tf32_products():
        assert _plan(q, q, block, 0, False, False, False, backward, 0, False)[0]["PRECISION"] == precision
    assert plan.tf32_tiles_fit(block, dim, backward, 227 * 1024) == (precision == "tf32")
    half = q.to(torch.bfloat16)
    with tf32_products():
        assert _plan(half, half, block, 0, False, False, False, backward, 0, False)[0]["PRECISION"] == "tf32"


def test_block_plan_key_follows_tf32_and_variant():
    q = torch.empty(3, 2, 64)
    args = (q, q, 64, 0, False, False, False, False, 512, False)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = _plan(*args)
        torch.backends.cuda.matmul.allow_tf32 = False
        ieee = _plan(*args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert (tf32[0]["PRECISION"], ieee[0]["PRECISION"]) == ("tf32", "ieee") and tf32[2] != ieee[2]
    hopper = _plan(*args, variant=variants.HOPPER)
    assert hopper[2] != ieee[2] and hopper[2][-2:] == ("hopper", False)


def test_plans_hold_only_the_kernels_own_constexprs():
    """The Gluon kernels take the subset of the constexprs they use: a plan passes no other."""
    q = torch.empty(5, 2, 64, dtype=torch.bfloat16)
    for variant in (variants.HOPPER, variants.HOPPER_WS):
        for backward in (False, True):
            meta = _plan(q, q, 64, 0, False, False, False, backward, 512, False, variant=variant)[0]
            launcher = variant.kernels()[backward]
            assert set(meta) - {"num_warps", "num_stages", "maxnreg"} == set(launcher.constexpr_names())
            # (hopper takes interleaved rotary pairs; hopper_ws only split halves.)
            assert "PERSISTENT" not in meta and ("INTERLEAVED" in meta) == (variant is variants.HOPPER)


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


def test_forward_signature_separates_what_the_launch_depends_on(monkeypatch):
    """``block.fwd._signature`` (the remembered forward launches' key) differs whenever anything
    the variant, the launch plan or the launcher's key reads differs, and is the same across
    batches (T, B) of one layout, which reuse the remembered launch. (A forced variant is process
    state: forcing one forgets the remembered launches, ``test_variants``.)"""
    from blockattn_layers.kernels.block import fwd as block_fwd
    from blockattn_layers.kernels.common import schedule as _schedule

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
    matmul = torch.backends.cuda.matmul
    tf32 = matmul.allow_tf32
    try:
        for allow in (True, False):  # fp32 dots follow this flag
            matmul.allow_tf32 = allow
            changed.append(signature(dtype=torch.float32))
    finally:
        matmul.allow_tf32 = tf32
    assert len({base, *changed}) == len(changed) + 1


def test_packed_plan_puts_blocks_of_up_to_32_rows_into_64_row_tiles():
    """The packed variant: 64-row tiles of ``64 // SLOT`` blocks, ``SLOT`` their
    tile extent, one program per tile (the last one partly empty); the simple kernels keep
    ``SLOT`` 0 and one program per block."""
    q = torch.empty(3, 4, 64, dtype=torch.float16)
    for block, slot in [(1, 16), (5, 16), (16, 16), (17, 32), (32, 32)]:
        for backward in (False, True):
            meta, loop, _ = _plan(q, q, block, 0, False, False, False, backward, 512, False, variant=variants.PACKED)
            assert (meta["BLOCK_M"], meta["SLOT"], loop) == (64, slot, False)
            assert plan.block_grid(10, 4, q.device, backward, variants.PACKED, 64, meta["SLOT"]) == (
                -(-10 // (64 // slot)), 4)
        simple = _plan(q, q, block, 0, False, False, False, False, 512, False)[0]
        assert simple["SLOT"] == 0 and plan.block_grid(10, 4, q.device, False, variants.SIMPLE, 64) == (10, 4)


@pytest.mark.parametrize("block,dim,rot,split", [
    (128, 128, 0, True), (100, 96, 0, True), (64, 256, 0, True), (128, 256, 0, True), (128, 128, 128, False),
    (64, 128, 0, False), (128, 64, 0, False), (16, 64, 0, False), (32, 256, 0, False),
])
def test_grouped_query_forward_runs_one_program_per_query_head(block, dim, rot, split):
    """The hopper forward of grouped query heads at 128-row tiles of D 96-128 without rotary, and at
    D256: one program per query head (``SPLIT_GROUPS`` the group size, ``GROUPS`` 1), the grid's second
    axis over the query heads; elsewhere (and hopper_packed's tiles of blocks of up to 32), their
    backward, and the simple kernels: one program per kv head and its group."""
    variant = variants.HOPPER_PACKED if block <= 32 else variants.HOPPER
    for heads, kv_heads in [(8, 2), (4, 1), (4, 4)]:
        q = torch.empty(3, heads, dim, dtype=torch.bfloat16)
        k = torch.empty(3, kv_heads, dim, dtype=torch.bfloat16)
        groups = heads // kv_heads
        meta, loop, _ = _plan(q, k, block, rot, False, False, False, False, 512, False, variant=variant)
        split_here = split and groups > 1
        assert (meta["SPLIT_GROUPS"], meta["GROUPS"]) == ((groups, 1) if split_here else (1, groups))
        assert plan.grid_heads(meta, loop, kv_heads) == (heads if split_here else kv_heads) and not loop
        back, _, _ = _plan(q, k, block, rot, False, False, False, True, 512, False, variant=variant)
        assert back["GROUPS"] == groups and "SPLIT_GROUPS" not in back
        simple, simple_loop, _ = _plan(q, k, block, rot, False, False, False, False, 512, False)
        assert simple["GROUPS"] == groups and plan.grid_heads(simple, simple_loop, kv_heads) == kv_heads


@pytest.mark.parametrize("dim,causal,rotary,heads,backward,want", [
    (32, True, False, (4, 1), False, 80), (32, True, False, (8, 2), False, 80),
    (32, False, False, (4, 1), False, None), (64, True, False, (4, 1), False, None),
    (32, True, True, (4, 1), False, 80), (32, False, True, (4, 1), False, None), (64, False, True, (8, 2), False, 128),
    (64, True, True, (4, 1), False, 128), (32, True, False, (2, 2), False, None),
    (32, True, False, (4, 1), True, 160), (32, True, False, (8, 2), True, 160), (32, False, False, (4, 1), True, None),
    (32, True, True, (4, 1), True, 168), (32, False, True, (8, 2), True, 168), (64, True, False, (4, 1), True, None),
    (64, False, False, (4, 1), True, None), (64, True, True, (4, 1), True, None), (32, True, False, (2, 2), True, None),
    (32, True, True, (2, 2), True, None),
])
def test_hopper_forward_of_grouped_heads_capped_where_measured_faster(dim, causal, rotary, heads, backward, want):
    """hopper's grouped query heads on 64-row tiles run capped where measured faster (H100): the forward at D32 with
    causal at 80 registers (rotary or not; 6 programs per SM instead of 4-5), with rotary at D64 at 128; the backward
    at D32 with causal, without rotary, at 160, and with rotary, causal or not, at 168 (3 programs instead of 2).
    Elsewhere (D32 without causal or rotary, D64: slower capped), and with one query head per kv head, ptxas's own
    choice."""
    q = torch.empty(3, heads[0], dim, dtype=torch.bfloat16)
    k = torch.empty(3, heads[1], dim, dtype=torch.bfloat16)
    meta = _options_per_call(q, k, 64, dim if rotary else 0, False, False, causal, backward, 0, False,
                             variants.HOPPER)
    assert meta.get("maxnreg") == want


@pytest.mark.parametrize("dim,block,causal,heads,rotary,want", [
    (32, 16, False, (4, 1), False, 80), (32, 9, True, (8, 2), False, 80), (32, 32, False, (8, 2), False, 80),
    (32, 20, True, (4, 1), False, 80), (64, 16, True, (4, 1), False, 96), (64, 16, False, (4, 1), False, None),
    (64, 32, True, (4, 1), False, None), (128, 16, True, (4, 1), False, None), (32, 16, True, (2, 2), False, None),
    (32, 16, True, (4, 1), True, 96), (32, 30, False, (8, 2), True, 96), (64, 16, False, (4, 1), True, 128),
    (64, 32, True, (8, 2), True, 128), (128, 16, True, (4, 1), True, None), (64, 16, True, (2, 2), True, None),
])
def test_packed_forward_of_grouped_heads_capped_where_measured_faster(dim, block, causal, heads, rotary, want):
    """hopper_packed's forward of grouped query heads runs capped where measured faster (H100): without rotary 80
    registers at D32 (blocks of up to 16 and of 17-32, causal or not) and 96 at D64 causal on blocks of up to 16;
    with rotary 96 at D32 and 128 at D64 (both slots, causal or not); elsewhere, and with one query head per kv
    head, ptxas's own choice."""
    q = torch.empty(3, heads[0], dim, dtype=torch.bfloat16)
    k = torch.empty(3, heads[1], dim, dtype=torch.bfloat16)
    rot = dim if rotary else 0
    meta, _, _ = _plan(q, k, block, rot, False, False, causal, False, 0, False, variant=variants.HOPPER_PACKED)
    assert meta.get("maxnreg") == want


@pytest.mark.parametrize("dim,block,causal,heads,rotary,want", [
    (32, 16, False, (2, 2), False, 96), (32, 32, True, (2, 2), False, 96), (32, 16, False, (4, 1), False, 160),
    (32, 29, True, (8, 2), False, 160), (32, 16, True, (4, 1), True, 168), (32, 32, False, (8, 2), True, 168),
    (64, 16, False, (2, 2), False, None), (64, 16, False, (4, 1), False, None), (64, 32, True, (4, 1), True, None),
    (128, 32, False, (2, 2), False, 168), (32, 16, False, (2, 2), True, 96), (32, 20, True, (2, 2), True, 96),
    (128, 16, True, (2, 2), True, 168),
])
def test_packed_backward_capped_where_measured_faster(dim, block, causal, heads, rotary, want):
    """hopper_packed's backward runs capped where measured faster (H100): one query head per kv head at 96 registers
    at D32, rotary or not (5 programs per SM instead of 4; 1.04-1.10x faster without rotary, 1.2-1.25x with), 168
    at D128; grouped query heads at D32, 160 without rotary and 168 with (3 programs instead of 2). D64 at ptxas's
    own choice."""
    q = torch.empty(3, heads[0], dim, dtype=torch.bfloat16)
    k = torch.empty(3, heads[1], dim, dtype=torch.bfloat16)
    meta, _, _ = _plan(q, k, block, dim if rotary else 0, False, False, causal, True, 0, False,
                       variant=variants.HOPPER_PACKED)
    assert meta.get("maxnreg") == want
