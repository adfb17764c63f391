"""CPU tests of the benchmark baselines built here: the Flex block mask made from the unit
boundaries (``flex_blocks_*``), its run through compiled flex_attention on CPU, and the skips."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import blockattn_layers
from blockattn_layers.bench import baselines
from blockattn_layers.bench.baselines import FLEX_TILE, unit_block_mask, unit_tile_blocks
from blockattn_layers.bench.common import Case, RunConfig, make_inputs

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = RunConfig(device=torch.device("cpu"), dtype=torch.float32)
TILE = FLEX_TILE

# Zero-length and one-token sequences, lengths below / above / at multiples of the 128-row tile.
LAYOUTS = [
    [0, 1, 130, 300, 0, 7],
    [256, 128, 1, 383, 0],
    [513],
    [1, 1, 1, 2, 127, 129, 0, 255],
]


def _random_layouts(n: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = int(torch.randint(1, 7, (1,), generator=gen))
        pick = torch.randint(0, 4, (batch,), generator=gen)  # empty, short, near a tile, long
        lengths = torch.where(pick == 0, 0, torch.where(pick == 1, torch.randint(1, 8, (batch,), generator=gen),
                              torch.where(pick == 2, 128 + torch.randint(-2, 3, (batch,), generator=gen),
                                          torch.randint(129, 420, (batch,), generator=gen))))
        if int(lengths.sum()) == 0:
            lengths[0] = 5
        out.append(lengths.tolist())
    return out


ALL_LAYOUTS = LAYOUTS + _random_layouts(6)


def _case(lengths, block, causal=False, heads=2, kv_heads=None, dim=16):
    return Case("t", "t", torch.tensor(lengths, dtype=torch.int64), heads, dim, block,
                num_kv_heads=kv_heads, causal=causal)


def _reference_mask(lengths, block, causal) -> torch.Tensor:
    """Dense ``[T, T]``: same unit (sequence, and block inside it) and, causal, ``q >= kv``; built
    from the lengths, not from ``Case.unit_bounds``."""
    lengths = torch.tensor(lengths, dtype=torch.int64)
    T = int(lengths.sum())
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    start = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(T) - start[seq]
    key = seq if block is None else seq * (T + 1) + pos // block
    mask = key[:, None] == key[None, :]
    if causal:
        mask &= torch.arange(T)[:, None] >= torch.arange(T)[None, :]
    return mask


def _tiles(num: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[n, n]`` tile matrix of one list pair; also checks each row's entries are distinct
    and ascending (a repeated tile would be computed twice by the kernel)."""
    num, idx = num.view(-1), idx.view(num.numel(), -1).long()
    assert idx.shape[0] == n and (num.numel() == 0 or int(num.max()) <= idx.shape[1])
    out = torch.zeros(n, n, dtype=torch.bool)
    for row in range(n):
        listed = idx[row, : int(num[row])]
        assert bool((listed.diff() > 0).all()), f"row {row}: {listed.tolist()} not strictly ascending"
        assert bool(((listed >= 0) & (listed < n)).all())
        out[row, listed] = True
    return out


def _expected_tiles(ref: torch.Tensor, n: int):
    """From the dense mask padded with False to ``n`` tiles (as create_block_mask pads): tiles
    with any pair (listed) and tiles whose whole square is valid (full)."""
    T = ref.shape[0]
    padded = torch.zeros(n * TILE, n * TILE, dtype=torch.bool)
    padded[:T, :T] = ref
    sums = padded.view(n, TILE, n, TILE).sum(dim=(1, 3))
    return sums > 0, sums == TILE * TILE


def _expand(tiles: torch.Tensor, T: int) -> torch.Tensor:
    return tiles.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:T, :T]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block", [64, 100, 256, None], ids=lambda b: f"block{b}")
def test_unit_block_mask_equals_the_dense_mask(block, causal):
    from torch.nn.attention.flex_attention import create_mask

    for lengths in ALL_LAYOUTS:
        case = _case(lengths, block, causal)
        T = case.total
        n = -(-T // TILE)
        ref = _reference_mask(lengths, block, causal)
        listed, full = _expected_tiles(ref, n)
        for compact in (False, True):
            bm = unit_block_mask(case.unit_bounds(), T, causal, "cpu", compact=compact)
            assert bm.shape == (1, 1, T, T) and bm.BLOCK_SIZE == (TILE, TILE)
            partial_kv = _tiles(bm.kv_num_blocks, bm.kv_indices, n)
            full_kv = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, n)
            where = f"lengths {lengths}, block {block}, causal {causal}, compact {compact}"
            # Every tile with a valid pair is listed, once; full exactly where the whole square is valid.
            assert not (partial_kv & full_kv).any(), where
            assert torch.equal(full_kv, full), where
            assert torch.equal(partial_kv | full_kv, listed), where
            # Element by element, as the kernel reads it: full tiles, and partial tiles where mask_mod says.
            mod = create_mask(bm.mask_mod, None, None, T, T, device="cpu")[0, 0]
            dense = _expand(full_kv, T) | (_expand(partial_kv, T) & mod)
            assert torch.equal(dense, ref), where
            # The backward's lists (query tiles per key tile) are the transpose.
            assert torch.equal(_tiles(bm.q_num_blocks, bm.q_indices, n), partial_kv.T), where
            assert torch.equal(_tiles(bm.full_q_num_blocks, bm.full_q_indices, n), full_kv.T), where
            if not compact:  # Flex's own layout: its to_dense() agrees
                assert torch.equal(bm.to_dense()[0, 0].bool(), listed), where
            else:  # index lists no wider than the longest row (power of two)
                longest = int((bm.kv_num_blocks + bm.full_kv_num_blocks).max())
                assert bm.kv_indices.shape[-1] <= max(1, 2 * longest), where


def test_unit_block_mask_matches_create_block_mask():
    """Same partial / full tiles as Flex's create_block_mask evaluating the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    for lengths, block, causal in [(LAYOUTS[0], 100, True), (LAYOUTS[1], None, False), (LAYOUTS[3], 64, True),
                                   (LAYOUTS[1], None, True), (LAYOUTS[2], 256, False)]:
        case = _case(lengths, block, causal)
        T, n = case.total, -(-case.total // TILE)
        ref = _reference_mask(lengths, block, causal)
        theirs = create_block_mask(lambda b, h, q, kv: ref[q, kv], None, None, T, T, device="cpu")
        ours = unit_block_mask(case.unit_bounds(), T, causal, "cpu", compact=True)
        for a, b in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]:
            assert torch.equal(_tiles(getattr(ours, a), getattr(ours, b), n),
                               _tiles(getattr(theirs, a), getattr(theirs, b), n)), (lengths, block, causal, a)


def test_tile_lists_stay_narrow_for_many_units():
    """Index lists grow with the tiles per row, not with T: 4,000 tiles of units of 100."""
    lengths = [100] * 5120  # T = 512,000: 4,000 tiles
    case = _case(lengths, None)
    num, idx, full_num, full_idx = unit_tile_blocks(case.unit_bounds(), case.total, causal=False)
    assert num.shape == (1, 1, 4000) and idx.shape[-1] <= 4 and full_idx.shape[-1] == 1
    assert int(full_num.sum()) == 0 and int(num.min()) >= 1


def _flex_cpu_skip():
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception as err:
        return f"flex_attention not importable: {err}"
    return None


@pytest.mark.skipif(_flex_cpu_skip() is not None, reason=str(_flex_cpu_skip()))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_blocks_runs_on_cpu_like_the_reference(causal):
    """The method's own setup (compiled flex_attention, Flex's C++ CPU kernel) on a tiny GQA case,
    against the reference backend in float32; block sizes share one compiled graph."""
    torch._dynamo.reset()
    method = next(m for m in baselines.BASELINES if m.name == "flex_blocks_triton")
    for block in (100, None):
        case = _case([0, 1, 130, 77, 200], block, causal, heads=2, kv_heads=1, dim=16)
        assert method.applies(case) and method.skip(case, CPU) is None
        inp = make_inputs(case, CPU.device, CPU.dtype, seed=3)
        # Flex's CPU kernel has no backward: the forward runs on inputs that do not require grad.
        inp = dataclasses.replace(inp, q=inp.q.detach(), k=inp.k.detach(), v=inp.v.detach())
        try:
            out = method.setup(case, inp, CPU).forward()
        except Exception as err:  # a torch without a CPU flex kernel
            pytest.skip(f"compiled flex_attention does not run on CPU here: {type(err).__name__}: {err}")
        ref = blockattn_layers.block_attention(
            inp.q, inp.k, inp.v, inp.offsets, block, causal=causal,
            cpu_offsets=inp.cpu_offsets, backend="reference",
        )
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_registry_applies_and_skips():
    names = {m.name: m for m in baselines.BASELINES}
    triton, flash, varlen = names["flex_blocks_triton"], names["flex_blocks_flash"], names["varlen_attn"]
    gqa_causal_full = _case([5, 300], None, causal=True, heads=4, kv_heads=2)
    block = _case([5, 300], 64)
    for m in (triton, flash, varlen):
        assert m.kind == "baseline" and m.gpu_only and m.description
        assert m.applies(gqa_causal_full) and m.applies(block)
    assert triton.skip(gqa_causal_full, CPU) is None
    bf16 = RunConfig(device=torch.device("cpu"), dtype=torch.bfloat16)
    reason = flash.skip(block, bf16)
    try:
        import importlib.util

        have_fa4 = importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:
        have_fa4 = False
    assert (reason is None) if have_fa4 else ("flash_attn.cute" in reason)
    assert "fp16 / bf16" in flash.skip(block, CPU)
    assert "CUDA only" in varlen.skip(gqa_causal_full, CPU)


def test_opt_in_methods_run_only_when_named():
    """A method marked opt-in (known to break the CUDA context somewhere) is left out of the
    default set and of the ``baselines`` group, and runs when ``--backends`` names it."""
    from blockattn_layers.bench import cli

    opt_in = [m.name for m in cli.all_methods() if m.opt_in]
    assert "flex_blocks_triton" in opt_in
    assert not {m.name for m in cli.select_methods(None)} & set(opt_in)
    assert not {m.name for m in cli.select_methods("baselines")} & set(opt_in)
    assert [m.name for m in cli.select_methods("flex_blocks_triton")] == ["flex_blocks_triton"]


def test_unit_chunks_split_the_units_into_runs_within_fa2s_limit():
    bounds = torch.tensor([0, 3, 3, 10, 11, 20])  # 5 units, one empty
    assert baselines.unit_chunks(bounds, 5) is None
    assert baselines.unit_chunks(bounds, 2) == [(0, 2, 0, 3), (2, 4, 3, 11), (4, 5, 11, 20)]
    assert baselines.FA2_MAX_UNITS == 65535
    # Runs of at most max_tokens tokens too (a longer unit alone), and of at most max_units units.
    assert baselines.unit_chunks(bounds, 5, max_tokens=20) is None
    assert baselines.unit_chunks(bounds, 5, max_tokens=10) == [(0, 3, 0, 10), (3, 5, 10, 20)]
    assert baselines.unit_chunks(bounds, 5, max_tokens=4) == [(0, 2, 0, 3), (2, 3, 3, 10), (3, 4, 10, 11),
                                                              (4, 5, 11, 20)]
    assert baselines.unit_chunks(bounds, 2, max_tokens=10) == [(0, 2, 0, 3), (2, 4, 3, 11), (4, 5, 11, 20)]


def test_fa2_chunks_keep_each_call_under_two_to_the_31_elements_of_q():
    """The grid's 8 query heads of D256 at prod lengths (q over 2^31 elements, where FA2 varlen
    failed the bench's check) are split into calls of fewer; 4 heads stay one call."""
    from blockattn_layers.bench import grid

    for heads, kv, calls in ((8, 2, 2), (4, 1, 1)):
        selection = grid.parse_slice([f"block=128 dim=256 heads={heads}x{kv} rotary=none causal=no"])
        (case,) = grid.cases(selection)
        chunks = baselines.fa2_chunks(case)
        if calls == 1:
            assert chunks is None
            continue
        assert len(chunks) == calls and chunks[0][2] == 0 and chunks[-1][3] == case.total
        assert all(t1 - t0 <= baselines.FA2_MAX_ELEMENTS // (heads * 256) for _, _, t0, t1 in chunks)
        assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(chunks, chunks[1:]))


def test_fa2_in_chunks_matches_one_call(monkeypatch):
    """``FlashVarlen`` over chunks of units (FA2's kernels stood in for by the reference, which
    CPU has): each call gets at most the chunk's units with its own cu_seqlens from 0, and the
    output and gradients are those of one call over every unit."""
    calls = []

    def attend(q, k, v, cu, scale, causal):
        return blockattn_layers.block_attention(q, k, v, cu.long(), None, scale=scale, causal=causal,
                                                backend="reference")

    def forward(q, k, v, cu, max_len, scale, causal):
        calls.append((int(cu[0]), len(cu) - 1, int(cu[-1]), q.shape[0]))
        return attend(q, k, v, cu, scale, causal), None, None, None, None

    def backward(grad_out, q, k, v, out, lse, cu, max_len, causal, rng_state, unused, scale):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            return torch.autograd.grad(attend(*leaves, cu, scale, causal), leaves, grad_out)

    monkeypatch.setattr(baselines, "_fa2_forward", forward)
    monkeypatch.setattr(baselines, "_fa2_backward", backward)
    lengths = [5, 0, 17, 1, 9, 30, 2]
    bounds = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(int(bounds[-1]), h, 16, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (4, 2, 2))
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    results = []
    for chunks in (None, baselines.unit_chunks(bounds, 3)):
        out = baselines.FlashVarlen.apply(q, k, v, bounds.int(), 30, 0.25, True, chunks)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    assert calls == [(0, 7, 64, 64), (0, 3, 22, 22), (0, 3, 40, 40), (0, 1, 2, 2)]
    for one, chunked in zip(*results):
        torch.testing.assert_close(chunked, one, rtol=1e-12, atol=1e-12)
