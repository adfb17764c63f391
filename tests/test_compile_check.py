"""The kernels compile for sm_80, sm_90 and sm_100 on a machine without a GPU, with each
generation's matrix instructions in the PTX (``mma.sync``, ``wgmma``, ``tcgen05.mma``) and, from
sm_90 on, TMA copies in the flash kernels' tensor-map variants."""
import os
import re
import subprocess
import sys

import pytest

ARCHS = [("sm_80", "mma.sync"), ("sm_90", "wgmma"), ("sm_100", "tcgen05.mma")]


def _compile_check(arch: str, only: str, out) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", arch, "--out", str(out),
           "--only", only]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return {p.stem: p.read_text() for p in out.glob("*.ptx")}


@pytest.mark.parametrize("arch,instruction", ARCHS)
def test_compile_check(arch, instruction, tmp_path):
    ptx = _compile_check(arch, "bf16_b64_d128", tmp_path)
    # fwd/bwd x rotary x causal, and on sm_90 the hopper kernels (x 1 or 2 query heads per kv head,
    # and the rotary pair with 64-bit addressing)
    assert len(ptx) == (26 if arch == "sm_90" else 8)
    assert sum(name.endswith("_hopper") for name in ptx) == (18 if arch == "sm_90" else 0)
    assert all(instruction in text for text in ptx.values())
    # 16-byte tile loads: vector loads into registers, or cp.async.cg copies into shared memory
    # (16 bytes each).
    vector = ("ld.global.v4", "cp.async.cg.shared.global")
    assert all(any(op in text for op in vector) for text in ptx.values()), "tile loads should be 16-byte vectors"
    # The simple kernels have no loop to pipeline; the hopper kernels copy every tile asynchronously.
    for name, text in ptx.items():
        assert ("cp.async.cg.shared.global" in text) == name.endswith("_hopper"), name


def test_hopper_kernels_compile(tmp_path):
    """The Gluon kernels for sm_90 (fp16 / bf16, D 64 / 128, rotary with given or implicit
    positions, causal, GQA, block table or in-kernel schedule; in bf16 also 128-row tiles (D64 among
    them, where the launch plan caps registers), D 32, 96 and 256, 64-bit addressing, rotary at D96 and over
    half the channels; the logsumexp-storing forward of 128-row tiles at D 192 / 256, and at D 128 with
    grouped query heads, registers capped):
    wgmma products, 16-byte asynchronous copies in, 16-byte stores
    out (through shared memory, not from the accumulators' 4-byte pieces), within the register,
    spill and shared-memory budgets. Other generations have no hopper variant."""
    ptx = _compile_check("sm_90", "_hopper", tmp_path / "sm_90")
    assert len(ptx) == 162
    assert {"fwd_bf16_b128_d128_causal_hopper", "bwd_bf16_b128_d128_rope_causal_hopper", "bwd_bf16_b64_d96_gqa_hopper",
            "bwd_bf16_b64_d256_hopper", "fwd_bf16_b64_d256_gqa_hopper", "bwd_bf16_b64_d32_rope_hopper",
            "bwd_bf16_b64_d128_rope_int64_hopper", "fwd_bf16_b128_d128_causal_gqa_hopper",
            "bwd_bf16_b128_d128_causal_gqa_hopper", "fwd_lse_fp16_b128_d192_causal_gqa_hopper",
            "fwd_lse_bf16_b128_d256_hopper", "fwd_bf16_b128_d64_causal_gqa_hopper",
            "bwd_bf16_b128_d64_rope_causal_hopper", "bwd_bf16_b128_d96_rope_causal_gqa_hopper",
            "bwd_bf16_b64_d96_rope48_hopper", "fwd_bf16_b128_d128_rope64_causal_gqa_hopper",
            "bwd_bf16_b128_d96_rope64i_gqa_hopper", "fwd_bf16_b128_d256_rope_causal_hopper",
            "bwd_bf16_b128_d96_rope_causal_group4_hopper", "bwd_bf16_b128_d128_ropei_causal_group4_hopper",
            "fwd_lse_bf16_b128_d128_gqa_hopper", "fwd_lse_fp16_b128_d128_causal_gqa_hopper"} <= set(ptx)
    # Not admitted, so not built: the backward of 128-row tiles at D256.
    assert "bwd_bf16_b128_d256_causal_hopper" not in ptx and "bwd_bf16_b128_d256_causal_gqa_hopper" not in ptx
    for name, text in ptx.items():
        assert "wgmma.mma_async" in text and "cp.async.cg.shared.global" in text, name
        assert "st.global.v4" in text and "st.global.v2" not in text, name
        # No 2-byte global loads or stores (interleaved rotary pairs move as 32-bit words).
        assert not re.search(r"(ld|st)\.global(\.\w+)*\.b16", text), name
        # 4-byte stores: the logsumexp's float32 values only.
        assert ("st.global.b32" in text) == name.startswith("fwd_lse"), name
    for arch in ("sm_80", "sm_100"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", arch, "--out",
               str(tmp_path / arch), "--only", "_hopper"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 1 and f"{arch}: 0 variants" in result.stdout


def test_hopper_ws_kernels_compile(tmp_path):
    """The experimental persistent, warp-specialized Gluon kernels for sm_90 (forward and backward, fp16 / bf16,
    D 64 / 128, rotary, causal, block table or in-kernel schedule): wgmma products, TMA copies in
    and out for full blocks (``cp.async.bulk.tensor`` both ways), 16-byte asynchronous copies for
    ragged ones, tensor maps made in the kernel, and the partitions' register reallocation.
    Other generations have no such variant."""
    ptx = _compile_check("sm_90", "ws_", tmp_path / "sm_90")
    assert len(ptx) == 32 and sum(name.startswith("ws_bwd") for name in ptx) == 16
    for name, text in ptx.items():
        for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor.2d.shared::cluster.global",
                            "cp.async.bulk.tensor.2d.global.shared", "cp.async.cg.shared.global",
                            "tensormap.replace", "setmaxnreg.inc", "mbarrier.try_wait"):
            assert instruction in text, (name, instruction)
    for arch in ("sm_80", "sm_100"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", arch, "--out",
               str(tmp_path / arch), "--only", "ws_"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 1 and f"{arch}: 0 variants" in result.stdout


def test_warp_specialized_flash_forward_compiles(tmp_path):
    """The Gluon flash forward for sm_90 (bf16, D 64 / 128, causal GQA or
    neither, consumers serial, overlapped or in ping-pong): wgmma, TMA loads and the output's TMA store, tensor
    maps made in the kernel, mbarrier waits and the partitions' register reallocation, within the
    register, spill and shared-memory budgets (``compile_check`` fails a build over them); the
    overlapped and ping-pong builds commit two wgmma groups (the next ``Q K^T``, then ``P V``)
    before a wait, the serial ones never. The persistent builds (``sm90.flash_persistent``, serial,
    overlapped, and serial in turns (``PINGPONG``, each product waited for alone); k and v on one barrier
    pair per slot or, ``SPLIT_KV``, on pairs of their own (v's two barriers per slot initialised too), a
    block's last key tile its last keys (``SHIFT_LAST``), the previous item's query buffer released after the
    first ``Q K^T`` (``EARLY_RELEASE``), items of one key tile reusing the previous one's (``SHARE_KV``), slots
    released by every consumer thread's own arrival (``THREAD_RELEASE``: no warpgroup barrier before them, so
    fewer ``bar.sync`` than the same loop's elected releases); two consumer warpgroups, or three on 192-row
    items at D 64 and, on 64-row key tiles, D 128) likewise."""
    # bf16 builds (the CLI builds fp16 too: the same code at another element type, 40 more builds and 2 more
    # minutes of the CPU run).
    only = "flash_gluon_fwd_bf16,flash_gluon_fwd_persistent_bf16,flash_gluon_fwd_persistent_m192"
    ptx = _compile_check("sm_90", only, tmp_path / "sm_90")
    assert len(ptx) == 62 and sum("_persistent_" in name for name in ptx) == 50
    assert sum("_m192_" in name for name in ptx) == 10 and sum(name.endswith("_split_kv") for name in ptx) == 10
    assert sum(name.endswith("_shift_last") for name in ptx) == 8
    assert sum(name.endswith("_early_release") for name in ptx) == 4
    assert sum(name.endswith("_share_kv") for name in ptx) == 4
    assert sum(name.endswith("_thread_release") for name in ptx) == 4
    for name in (n for n in ptx if n.endswith("_thread_release")):
        elected = ptx[name.replace("_thread_release", "_overlap_split_kv")]
        assert "cp.async.mbarrier.arrive.noinc" in ptx[name] and "cp.async.mbarrier.arrive" not in elected, name
        assert ptx[name].count("bar.sync") < elected.count("bar.sync"), name
    assert not any("_overlap_split_kv_shift" in name for name in ptx)
    for name in (n for n in ptx if n.endswith("_split_kv")):
        inits = [ptx[n].count("mbarrier.init") for n in (name.removesuffix("_split_kv"), name)]
        assert inits[1] == inits[0] + 4, (name, inits)  # v's ready and empty barriers of two slots
    for name, text in ptx.items():
        for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor.2d.shared::cluster.global",
                            "cp.async.bulk.tensor.2d.global.shared", "tensormap.replace", "setmaxnreg.inc",
                            "mbarrier.try_wait"):
            assert instruction in text, (name, instruction)
        order = "".join("C" if op == "commit_group" else "W"
                        for op in re.findall(r"wgmma\.(commit_group|wait_group)", text))
        stem = name.removesuffix("_share_kv").removesuffix("_early_release").removesuffix("_shift_last")
        stem = stem.replace("_thread_release", "_overlap_split_kv")
        overlapped = stem.removesuffix("_split_kv").endswith("_overlap") or (
            name.endswith("_pingpong") and "_persistent_" not in name)
        assert ("CC" in order) == overlapped, (name, order)


def test_warp_specialized_flash_backward_compiles(tmp_path):
    """The Gluon dK/dV pass of the flash backward for sm_90 (fp16 / bf16, D 64 / 128, causal GQA or
    neither, dQ's terms in any order or a fixed one) within the register, spill and shared-memory
    budgets: wgmma with the dQ product's transposed shared dS tile, TMA loads and the dK / dV TMA
    stores, ``cp.async`` copies of lse and delta, mbarrier waits, the partitions' register
    reallocation; dQ's terms added by the writer partition by TMA reduce-adds and no per-thread
    atomics, ordered ones each waited for until written (``cp.async.bulk.wait_group 0``, not only
    read); the ordered builds read each counter with acquire semantics and count with release
    semantics, the others have no counters. With them the
    candidates: dQ's adds by the consumers themselves (D 64 / 128, per-thread atomics), P beside dP's
    product, dK / dV alone (no dQ term: neither adds nor counters; at D 64 over 64 and 128 query
    rows a step), and lse / delta copied by the loader warp, whose slot's ready barrier waits for them
    (``cp.async.mbarrier.arrive``; the others have none), at D 128 also with slots released by every consumer
    thread (``THREAD_RELEASE``: ``.noinc`` arrivals, fewer ``bar.sync`` than the elected releases), and on
    those each step's dQ product the step before's (``DQ_LAG``; ``STAGGER``: warpgroup 1 half a step behind),
    with two more mbarrier waits a step (the dS^T slot free, the step before's halves in), and the writer warp
    on 24 registers (``LEAN_WRITER``: the lag builds, and on its own); dQ stored where one key tile holds the
    block (``DQ_STORE``: no reduce-adds; at D 128 a TMA store by each consumer beside dK's and dV's and no
    writer, at D 64 the writer's), with the delta rows computed in the kernel (``DELTA_IN_KERNEL``: O's tile one
    more TMA copy a step), and with dQ and dK rotated back in the kernel (``ROT_DIM``: sines and cosines, none
    in the other builds; ``PAIR_CHUNK``: two dQ stores per consumer, and where the tiles are padded or the rotary
    channels part of the head each rotary half's dQ and dK columns through rank-4 maps, the pass-through ones
    among them apart); at D 96 (``PADDED_HEAD_DIMS``) every copy through a rank-3 tensor map of one head's boxes,
    none through the flat ones."""
    ptx = _compile_check("sm_90", "flash_gluon_bwd", tmp_path / "sm_90")
    assert len(ptx) == 73 and sum(name.endswith("_deterministic") for name in ptx) == 21
    padded = {name: ptx.pop(name) for name in list(ptx) if "_d96" in name}
    # Per build, the TMA stores through rank-3 and rank-4 maps: per consumer dQ's, dK's and dV's; with paired
    # chunks each rotary half's dQ and dK columns apart (rank 4), the pass-through ones among them (rank 3) too.
    padded_stores = {"flash_gluon_bwd_dq_store_bf16_d96_causal_gqa": (6, 0),
                     "flash_gluon_bwd_dq_store_bf16_d96_gqa": (6, 0),
                     "flash_gluon_bwd_dq_store_unrotate_i96_bf16_d96_gqa": (6, 0),
                     "flash_gluon_bwd_dq_store_unrotate_s48_paired8_bf16_d96_gqa": (8, 6),
                     "flash_gluon_bwd_dq_store_unrotate_s96_paired16_bf16_d96_causal_gqa": (2, 12)}
    assert sorted(padded) == sorted(padded_stores)
    for name, text in padded.items():
        assert "cp.async.bulk.tensor.2d" not in text and "cp.reduce.async.bulk" not in text, name
        assert "cp.async.bulk.tensor.3d.shared::cluster.global" in text, name
        stores = tuple(text.count(f"cp.async.bulk.tensor.{r}d.global.shared") for r in (3, 4))
        assert stores == padded_stores[name], name
        assert ("sin.approx.f32" in text) == ("_unrotate_" in name), name
    unrotated = {name: ptx.pop(name) for name in list(ptx) if name.startswith("flash_gluon_bwd_dq_store_unrotate_")}
    assert len(unrotated) == 9
    for name, text in unrotated.items():  # the default D 128 stored form (rows by the loader) plus the rotations;
        # split halves over every channel (paired chunks, ``_s128``): each consumer's dQ in two stores; over 96
        # channels (``_s96``) each rotary half's dQ and dK columns through rank-4 maps, the pass-through ones apart
        assert "cp.reduce.async.bulk" not in text and "atom.global" not in text, name
        stores = (8, 0) if "_unrotate_s128_" in name else (5, 12) if "_unrotate_s96_" in name else (6, 0)
        assert tuple(text.count(f"cp.async.bulk.tensor.{r}d.global.shared") for r in (2, 4)) == stores, name
        assert "cp.async.mbarrier.arrive.noinc" in text and "sin.approx.f32" in text, name
    assert not any("sin.approx.f32" in text for text in ptx.values())
    stored = [name for name in ptx if name.startswith("flash_gluon_bwd_dq_store_")]
    assert len(stored) == 10
    loads = "cp.async.bulk.tensor.2d.shared::cluster.global"
    stored = {name: ptx.pop(name) for name in stored}
    for name, text in stored.items():  # dQ stored by TMA beside dK and dV, no reduce-adds: by each consumer at
        # D 128 (no writer), by the writer at D 64
        assert "cp.reduce.async.bulk" not in text and "atom.global" not in text, name
        d128 = "_d128" in name
        assert text.count("cp.async.bulk.tensor.2d.global.shared") == (6 if d128 else 5), name
        assert bool(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", text)) != d128, name
        by_loader = "_by_loader_" in name
        assert ("cp.async.mbarrier.arrive" in text) == ("cp.async.mbarrier.arrive.noinc" in text) == by_loader, name
        if "_delta_" in name:  # O's rows copied into the ring beside q and dO
            assert text.count(loads) > stored[name.replace("_delta_", "_")].count(loads), name
    for causal in ("", "_causal_gqa"):  # the writer on fewer registers: consumer 1's on more
        lean, base = ptx[f"flash_gluon_bwd_lean_writer_bf16_d128{causal}"], ptx[f"flash_gluon_bwd_bf16_d128{causal}"]
        writer_40 = re.compile(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;")
        assert writer_40.search(base) and not writer_40.search(lean)
    lagged = [name for name in ptx if name.startswith(("flash_gluon_bwd_dq_lag_", "flash_gluon_bwd_stagger_"))]
    assert len(lagged) == 8
    for name in lagged:
        base = ptx[name.replace("_dq_lag_", "_lse_by_loader_thread_release_").replace(
            "_stagger_", "_lse_by_loader_thread_release_")]
        assert ptx[name].count("mbarrier.try_wait") > base.count("mbarrier.try_wait"), name
    assert sum("_dkdv_only_" in name for name in ptx) == 4 and sum("_dkdv_only_m128_" in name for name in ptx) == 2
    assert sum("_consumer_adds_" in name for name in ptx) == 4
    assert sum("_pbesidedp_" in name for name in ptx) == 3
    assert sum("_lse_by_loader_" in name for name in ptx) == 12
    assert sum("_thread_release_" in name for name in ptx) == 4
    for name, text in ptx.items():
        assert ("cp.async.mbarrier.arrive" in text) == ("_lse_by_loader_" in name or name in lagged), name
        assert ("cp.async.mbarrier.arrive.noinc" in text) == ("_thread_release_" in name or name in lagged), name
        if "_thread_release_" in name:
            elected = ptx[name.replace("_thread_release", "")]
            assert text.count("bar.sync") < elected.count("bar.sync"), name
        for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor.2d.shared::cluster.global",
                            "cp.async.bulk.tensor.2d.global.shared", "cp.async.ca.shared.global", "setmaxnreg.inc",
                            "mbarrier.try_wait"):
            assert instruction in text, (name, instruction)
        ordered = ("ld.global.gpu.acquire" in text, "atom.global.gpu.release.add" in text)
        assert ordered == (name.endswith("_deterministic"),) * 2, name
        adds = "_dkdv_only_" not in name
        tma_adds = adds and "_consumer_adds_" not in name
        written = tma_adds and name.endswith("_deterministic")
        assert bool(re.search(r"cp\.async\.bulk\.wait_group 0\b", text)) == written, name
        assert ("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in text) == tma_adds, name
        assert ("atom.global.gpu.relaxed.add" in text) == (adds and not tma_adds), name


@pytest.mark.parametrize("arch,instruction", ARCHS)
def test_flash_kernels_compile(arch, instruction, tmp_path):
    """bf16 flash forward, dK/dV and dQ, and the fast backward's dK/dV pass with atomic dQ (GQA,
    causal, D128, the generation's tiles): plain heads take tensor-map loads from sm_90 on (TMA
    copies in the PTX), rotary heads pointer loads everywhere; the fast backward's dQ store and
    delta passes build (row-wise, no products)."""
    ptx = _compile_check(arch, "flash_fwd_bf16,flash_dkv_bf16,flash_dq_bf16,flash_dkv_fast_bf16,flash_dq_store_bf16,"
                                 "flash_delta_bf16", tmp_path)
    plain = "" if arch == "sm_80" else "_tma"
    products = {f"flash_{k}_bf16_d128_causal_gqa{v}" for k in ("fwd", "dkv", "dq", "dkv_fast") for v in (plain, "_rope")}
    assert products <= set(ptx)
    assert {"flash_dq_store_bf16_d128_causal_gqa", "flash_dq_store_bf16_d128_causal_gqa_rope",
            "flash_delta_bf16_d128"} <= set(ptx)
    for name in products:
        assert instruction in ptx[name] and ("cp.async.bulk.tensor" in ptx[name]) == name.endswith("_tma")
        assert ("atom.global.gpu.relaxed.add" in ptx[name]) == ("dkv_fast" in name)
    # sm_90's own tiles at D > 128 build within its shared memory (the run checks every flash build's).
    wide = {f"flash_{k}_bf16_d256_causal_gqa_tma" for k in ("fwd", "dkv", "dq", "dkv_fast")}
    assert (wide <= set(ptx)) == (arch == "sm_90")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_float32_flash_builds_fit_shared_memory(arch, tmp_path):
    """float32 flash builds at D128 (forward, both backward modes, plain and rotary) take their own
    tiles, within a program's shared memory: the 16-bit ones' needed 246-328 KB."""
    ptx = _compile_check(arch, "flash_fwd_fp32,flash_dkv_fp32,flash_dq_fp32,flash_dkv_fast_fp32", tmp_path)
    assert len(ptx) == 8


def test_flash_tiles_over_shared_memory_fail(tmp_path):
    """A flash build whose tiles need more shared memory than a program gets fails the check (the
    fast dK/dV pass at D256 with 64-row query tiles: 270,864 bytes, as the H200 refused it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from blockattn_layers.kernels import compile_check as cc; tiles = cc.flash_tiles; "
            "cc.flash_tiles = lambda dim, *a, **k: dict(tiles(dim, *a, **k), dkv_fast=(64, 64)); "
            f"sys.exit(cc.main(['--arch', 'sm_90', '--out', {str(tmp_path)!r}, '--only', 'flash_dkv_fast_bf16_d256']))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL flash_dkv_fast_bf16_d256_causal_gqa_tma: over budget: 270864 bytes of shared memory" in result.stdout


def test_register_caps():
    """``maxnreg`` only where it was measured: the rotary kv-head loop at tiles of up to 64 rows (at
    128 rows it spilled: 9-11x the floor on the H200); the hopper rotary
    backward at D128 with one query head per kv head; on sm_90 with
    16-bit inputs, 64-row simple tiles and one query head per kv head, the rotary forward at D128,
    the rotary backward at D64, the plain backward at D128 and the plain forward at D64; the hopper
    forward of grouped query heads on 128-row tiles of D <= 64, and its backward of one query head per
    kv head there at D32 and at D64 with rotary; the hopper rotary forward of grouped query heads at
    D128, and of one query head per kv head on 128-row tiles (not D64 causal); the hopper forward
    that stores the logsumexp on 128-row tiles of D128 without rotary; the hopper forward of 128-row tiles of
    D 144-256 without rotary in channel chunks (``CHUNKED_WIDE_FWD``), with or without the logsumexp."""
    from blockattn_layers.kernels.block.plan import (
        CHUNKED_WIDE_FWD, HEAD_LOOP_MAXNREG, HOPPER_CHUNKED_FWD_MAXNREG, HOPPER_GROUP_LOOP_MAXNREG,
        HOPPER_ROTARY_GROUP_FWD_MAXNREG,
        HOPPER_TILE128_BWD_MAXNREG, HOPPER_TILE128_LSE_FWD_MAXNREG, HOPPER_TILE128_ROTARY_FWD_MAXNREG,
        max_registers as caps,
    )
    from blockattn_layers.kernels.block.variants import VARIANTS

    def max_registers(meta, variant, *args):
        return caps(meta, VARIANTS[variant], *args)

    def meta(rot, d, m=64, groups=1, causal=False):
        return dict(ROT_DIM=rot, BLOCK_D=d, BLOCK_M=m, GROUPS=groups, IS_CAUSAL=causal)

    assert max_registers(meta(64, 64), "simple", False, 8, 4) == HEAD_LOOP_MAXNREG
    assert max_registers(meta(64, 64, groups=2), "simple", False, 9, 2) == HEAD_LOOP_MAXNREG
    assert max_registers(meta(64, 64), "hopper_ws", False, 9, 2) == 128
    assert max_registers(meta(128, 128), "simple", False, 9, 2) == 104
    assert max_registers(meta(64, 64), "simple", True, 9, 2) == 128
    assert max_registers(meta(32, 64), "simple", True, 9, 2) == 128
    assert max_registers(meta(0, 128), "simple", True, 9, 2) == 168
    assert max_registers(meta(0, 64), "simple", False, 9, 2) == 72
    assert max_registers(meta(128, 128), "hopper", True, 9, 2) == 168
    for rot, d in [(0, 32), (32, 32), (0, 64), (64, 64)]:
        assert max_registers(meta(rot, d, 128, groups=4), "hopper", False, 9, 2) == HOPPER_GROUP_LOOP_MAXNREG
    for m in (64, 128):
        for causal in (False, True):
            assert (max_registers(meta(128, 128, m, groups=4, causal=causal), "hopper", False, 9, 2)
                    == HOPPER_ROTARY_GROUP_FWD_MAXNREG[m])
    for rot, d, causal in [(32, 32, False), (32, 32, True), (64, 64, False), (128, 128, False), (128, 128, True)]:
        assert (max_registers(meta(rot, d, 128, causal=causal), "hopper", False, 9, 2)
                == HOPPER_TILE128_ROTARY_FWD_MAXNREG)
    for rot, d in [(0, 32), (32, 32), (64, 64)]:
        assert max_registers(meta(rot, d, 128), "hopper", True, 9, 2) == HOPPER_TILE128_BWD_MAXNREG
    for causal in (False, True):
        assert max_registers(meta(64, 64, groups=4, causal=causal), "hopper", False, 9, 2) == 128
    # The forward that also stores the logsumexp on 128-row tiles of D 65-128 without rotary; not the one without.
    for groups, causal in ((4, False), (4, True), (1, False)):
        lse_tile = meta(0, 128, 128, groups=groups, causal=causal)
        assert max_registers(lse_tile, "hopper", False, 9, 2, True) == HOPPER_TILE128_LSE_FWD_MAXNREG
        assert max_registers(lse_tile, "hopper", False, 9, 2) is None
    assert CHUNKED_WIDE_FWD
    for groups, causal, lse in [(4, False, True), (2, False, False), (1, True, False)]:
        wide = meta(0, 256, 128, groups=groups, causal=causal)
        assert max_registers(wide, "hopper", False, 9, 2, lse) == HOPPER_CHUNKED_FWD_MAXNREG
    assert max_registers(meta(0, 256, 128), "hopper", True, 9, 2) is None
    assert max_registers(meta(256, 256, 128), "hopper", False, 9, 2) is None
    for args in [(meta(128, 128), "hopper", False, 9, 2), (meta(0, 128), "hopper", True, 9, 2),
                 (meta(64, 64, 128, causal=True), "hopper", False, 9, 2),
                 (meta(128, 128, groups=4), "hopper", True, 9, 2), (meta(0, 64, groups=4), "hopper", False, 9, 2),
                 (meta(64, 64), "hopper", True, 9, 2), (meta(128, 128, groups=2), "hopper", True, 9, 2),
                 (meta(64, 64, 128), "simple", False, 9, 2), (meta(32, 32, 128, groups=4), "simple", False, 9, 2),
                 (meta(128, 128, 128), "hopper", True, 9, 2),
                 (meta(0, 128, 128, groups=4), "hopper", False, 9, 2),
                 (meta(0, 64, 128, groups=4), "hopper", True, 9, 2),
                 (meta(0, 64, 128), "hopper", True, 9, 2),
                 (meta(32, 32, 128, groups=2), "hopper", True, 9, 2), (meta(0, 32, 128), "hopper", False, 9, 2)]:
        assert max_registers(*args) is None, args
    for args in [(meta(128, 128), "simple", False, 8, 2), (meta(128, 128), "simple", False, 10, 2),
                 (meta(128, 128), "simple", False, 9, 4), (meta(128, 128, 128), "simple", False, 9, 2),
                 (meta(0, 128), "simple", False, 9, 2), (meta(0, 128, groups=2), "simple", True, 9, 2),
                 (meta(0, 128), "simple", True, 10, 2),
                 (meta(0, 128), "simple", True, 9, 4), (meta(0, 64), "simple", True, 9, 2),
                 (meta(0, 64, groups=2), "simple", False, 9, 2), (meta(0, 64, 128), "simple", False, 9, 2),
                 (meta(128, 128), "simple", True, 9, 2),
                 (meta(64, 64, groups=4), "simple", True, 9, 2)]:
        assert max_registers(*args) is None, args


def test_sm100_kernels_compile(tmp_path):
    """The warp-specialized Gluon kernels for sm_100 (a representative subset here: bf16, 128-row
    tiles, D 128, forward and backward, plain with the block table and rotary + causal + GQA with
    the in-kernel schedule; ``compile_check --arch sm_100 --only sm100_`` builds all 192): tcgen05
    products, tensor-memory loads, TMA copies, asynchronous copies for ragged blocks, mbarrier
    waits, register reallocation; registers, spills, shared and tensor memory reported and within
    budget. Other generations have no sm100 builds."""
    from blockattn_layers.kernels.compile_check import SM100_CI

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sm_100"
    cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", "sm_100", "--out", str(out),
           "--only", ",".join(SM100_CI)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ptx = {p.stem: p.read_text() for p in out.glob("*.ptx")}
    assert set(ptx) == set(SM100_CI)
    for name, text in ptx.items():
        for instruction in ("tcgen05.mma", "tcgen05.ld", "tcgen05.commit", "cp.async.bulk.tensor.2d.shared::cluster.global",
                            "cp.async.bulk.tensor.2d.global.shared", "cp.async.cg.shared.global", "tensormap.replace",
                            "mbarrier.try_wait", "setmaxnreg"):
            assert instruction in text, (name, instruction)
        line = next(line for line in result.stdout.splitlines() if line.startswith(name + ":"))
        assert "regs ?" not in line and "tmem" in line, line
    for arch in ("sm_80", "sm_90"):
        cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", arch, "--out",
               str(tmp_path / arch), "--only", "sm100_"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 1 and f"{arch}: 0 variants" in result.stdout


def test_budget_overruns_fail():
    """A build over any budget (registers, spills, shared memory, tensor-memory columns) fails."""
    from blockattn_layers.kernels.compile_check import MAX_SHARED, Usage

    assert Usage(255, 0, MAX_SHARED, 512).over_budget() == []
    for used in (Usage(256, 0, 0, 0), Usage(128, 257, 0, 0), Usage(128, 0, MAX_SHARED + 1, 0), Usage(128, 0, 0, 513)):
        assert len(used.over_budget()) == 1, used


def test_programs_per_sm():
    """Programs an SM holds (sm_90: 64 K registers in 256-register pieces per warp, 228 KB of shared
    memory, 1 KB more per program, 2048 threads): the hopper forward's causal group loop on 128-row
    tiles at 167 registers holds one 8-warp program, at 128 two (session 24)."""
    from blockattn_layers.kernels.compile_check import Usage

    assert Usage(167, 0, 32768, 0).programs_per_sm(8, 90) == 1
    assert Usage(128, 0, 32768, 0).programs_per_sm(8, 90) == 2
    assert Usage(72, 0, 0, 0).programs_per_sm(4, 90) == 7
    assert Usage(64, 0, 98304, 0).programs_per_sm(4, 90) == 2  # shared memory binds
    assert Usage(32, 0, 0, 0).programs_per_sm(4, 89) == 12  # threads bind (1536 on sm_89)
    assert Usage(128, 0, 0, 256).programs_per_sm(4, 100) == 2  # tensor memory binds
    assert Usage(None, None, 0, 0).programs_per_sm(4, 90) is None


def test_usage_of_every_build_on_request(tmp_path):
    """``--usage`` prints the registers, spills, shared memory and programs per SM of the Triton
    builds too (without it, the Gluon builds' only)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", "sm_90", "--out",
           str(tmp_path), "--only", "fwd_bf16_b64_d128_causal"]
    plain = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0 and "fwd_bf16_b64_d128_causal:" not in plain.stdout, plain.stdout
    result = subprocess.run(cmd + ["--usage"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("fwd_bf16_b64_d128_causal:"))
    assert "regs " in line and "programs per SM" in line and "regs ?" not in line, line


def test_fp8_kernels_compile(tmp_path):
    """The fp8 forward and the fp8 projection build for sm_89, sm_90 and sm_100 (e4m3 loads
    converted in registers, or float32 results converted to e4m3 with saturation; each
    generation's products) and not before sm_89, where Triton has no e4m3. On sm_90 also the
    warp-specialized fp8 forward (``sm90.fp8_fwd``): e4m3 wgmma scores (16-bit ones of the rotated
    halves with rotary), TMA copies, mbarrier waits and the partitions' register reallocation; and
    the warp-specialized projection (``sm90.linear``): 16-bit wgmma, TMA copies in and out, and with
    rotary in its epilogue the pairs rotated in place (approximate sines, no shuffles), and its candidate
    releasing the chunks' slots thread by thread (``THREAD_RELEASE``: fewer ``bar.sync``); the candidate
    forward rotating q and k in float32 (``F16_ROTATION`` off) as well."""
    for arch, instruction in (("sm_89", "mma.sync"), ("sm_90", "wgmma"), ("sm_100", "tcgen05.mma")):
        ptx = _compile_check(arch, "fp8_", tmp_path / arch)
        ws = {name: text for name, text in ptx.items() if name.startswith("fp8_gluon_")}
        linear_ws = {name: text for name, text in ptx.items() if name.startswith("fp8_linear_gluon_")}
        assert len(ptx) - len(ws) - len(linear_ws) == 12, arch
        assert (len(ws), len(linear_ws)) == ((12, 10) if arch == "sm_90" else (0, 0)), arch
        for name, text in ptx.items():
            convert = "cvt.rn.satfinite.e4m3x2" if name.startswith("fp8_linear") else "cvt.rn.f16x2.e4m3x2"
            assert convert in text and instruction in text, (arch, name)
        for name, text in ws.items():
            # Rotary: 16-bit products of the rotated halves only (float16 ones where rotated in float16,
            # in packed float16 arithmetic); else e4m3 scores.
            half = "bf16" if "_rope_f32" in name else "f16"
            scores = f"m64n64k16.f32.{half}.{half}" if "_rope" in name else "m64n64k32.f32.e4m3.e4m3"
            assert ("fma.rn.f16" in text) == ("_rope" in name and "_rope_f32" not in name), name
            assert all(x in text for x in (scores, "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg")), name
            assert ("e4m3.e4m3" in text) != ("_rope" in name), name
            # 64-token blocks' outputs by TMA stores unless built with masked stores only.
            assert ("cp.async.bulk.tensor.2d.global.shared" in text) != ("_masked_out" in name), name
            # v and P in float16 for P V.
            assert f"m64n{name.split('_d')[1][:3].rstrip('_')}k16.f32.f16.f16" in text, name
        for name, text in linear_ws.items():
            # 16-bit products over the program's columns, x and the weights in by TMA, e4m3 out by TMA.
            width = name.split("_")[-2].removesuffix("cols")
            product = f"m64n{width}k16.f32.{name.split('_')[-1].replace('fp16', 'f16')}"
            assert all(x in text for x in (product, "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier",
                                           "cp.async.bulk.tensor.2d.global.shared", "setmaxnreg")), name
            # Rotary in the epilogue: approximate sines of the reduced angles, and no data moved for the pairs.
            assert ("sin.approx.f32" in text) == ("_rotary" in name) and "shfl.sync.bfly" not in text, name
            # Chunks' slots released by every consumer thread: no barrier before each release.
            assert ("cp.async.mbarrier.arrive.noinc" in text) == ("_thread_release" in name), name
        threads = linear_ws.get("fp8_linear_gluon_e256_n768_chunked_thread_release_256cols_bf16")
        if threads is not None:
            elected = linear_ws["fp8_linear_gluon_e256_n768_chunked_256cols_bf16"]
            assert threads.count("bar.sync") < elected.count("bar.sync")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "blockattn_layers.kernels.compile_check", "--arch", "sm_80", "--out",
           str(tmp_path / "sm_80"), "--only", "fp8_"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "sm_80: 0 variants" in result.stdout


def test_hopper_packed_kernels_compile(tmp_path):
    """The hopper kernels on tiles of several blocks (``hopper_packed``): forward and backward, blocks
    of 16 and 32 rows, one and four query heads per kv head, rotary, causal with the in-kernel schedule:
    wgmma products, 16-byte asynchronous copies in and stores out, within the register, spill and
    shared-memory budgets (the CLI builds every head dim; this is a subset)."""
    names = ("fwd_bf16_s16_d128_hpacked", "bwd_bf16_s16_d128_hpacked", "fwd_bf16_s32_d64_causal_gqa_hpacked",
             "bwd_bf16_s32_d64_causal_gqa_hpacked", "fwd_bf16_s16_d128_rope_gqa_hpacked",
             "bwd_bf16_s32_d64_rope_causal_hpacked")
    ptx = _compile_check("sm_90", ",".join(names), tmp_path)
    assert set(ptx) == set(names)
    for name, text in ptx.items():
        assert "wgmma.mma_async" in text and "cp.async.cg.shared.global" in text and "st.global.v4" in text, name


def test_packed_kernels_compile(tmp_path):
    """The packed variant's kernels (fwd and bwd, blocks of 16 / 32 rows four or two to
    a 64-row tile, D 64 / 128, rotary, GQA) build for sm_90 with its products."""
    ptx = _compile_check("sm_90", "packed_fwd_bf16_s16,packed_bwd_bf16_s32", tmp_path)
    assert len(ptx) == 16 and all("wgmma" in text for text in ptx.values())


def test_hopper_wide_backward_compiles(tmp_path):
    """The hopper_wide backward (blocks of 128 rows at D 192 / 256, one query head per kv head): wgmma products, 16-byte asynchronous copies in and stores out, within the register, spill
    and shared-memory budgets (its four tiles: 224 KB of the 227 a program gets); with the group's sums
    in the launch, their arrival and reads."""
    ptx = _compile_check("sm_90", "_hwide", tmp_path)
    sums = {"bwd_bf16_b128_d256_sums4_hwide", "bwd_bf16_b128_d256_causal_int64_sums4_hwide"}
    assert set(ptx) == {"bwd_bf16_b128_d256_hwide", "bwd_fp16_b128_d256_hwide", "bwd_bf16_b128_d256_causal_int64_hwide",
                        "bwd_bf16_b128_d192_causal_hwide", "bwd_bf16_b128_d256_rope256_pos_causal_hwide",
                        "bwd_bf16_b128_d256_rope128_interleaved_hwide", "bwd_bf16_b128_d256_rope256_group4_hwide"} | sums
    for name, text in ptx.items():
        assert "wgmma.mma_async" in text and "cp.async.cg.shared.global" in text and "st.global.v4" in text, name
        # The group's sums in the launch (``sm90.group_sums``): fenced stores, one arrival per program,
        # the other programs' partials read past L1.
        marks = ("fence.acq_rel.gpu", "atom.global.gpu.acq_rel.add.u32", "ld.global.cg.v4")
        if name in sums:
            assert all(mark in text for mark in marks), name
        else:
            assert not any(mark in text for mark in marks), name


@pytest.mark.parametrize("arch", ["sm_80", "sm_100"])
def test_row_passes_compile(arch, tmp_path):
    """The rotation pass (``block.rotation``) and the group sums (``common.head_sums``) compile with
    16-byte vector loads, and no matrix products are asked of them."""
    ptx = _compile_check(arch, "rotation_,head_sums_", tmp_path)
    assert len(ptx) == 22 and sum(name.startswith("head_sums_") for name in ptx) == 3
    assert all("ld.global.v4" in text or "ld.global.nc.v4" in text for text in ptx.values())
