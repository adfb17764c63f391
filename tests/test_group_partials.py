"""Grouped query heads as one query head per kv head (``Variant.group_partials``: the backwards of
``hopper_wide`` and ``hopper_heads`` on sm_90): ``block.bwd._by_query_heads`` launches the backward kv
head by kv head with k and v repeated by a zero head stride, and sums each query head's dK and dV
over the group.

The Gluon kernel has no interpreter, so the orchestration runs here around the simple kernels
(Triton's interpreter on CPU, fp32 and fp16) against the float64 oracle; the GPU runs of
``hopper_wide`` are in ``test_triton_gpu.py``.
"""
import pytest
import torch

from blockattn_layers.ops.backends.triton_block import interpreter_active

from tests.oracle import oracle_attention, offsets_from_lengths, rel_err, rotary_positions

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="CPU interpreter tests")

# Empty and one-token sequences, lengths around the blocks.
LENGTHS = [0, 1, 63, 64, 65, 0, 101, 5]

CASES = [
    dict(heads=4, kv_heads=2, dim=32, block_size=64, causal=True),
    dict(heads=3, kv_heads=1, dim=48, block_size=100, rope_theta=500.0, rotary_dim=16, rotary_interleaved=True),
    dict(heads=6, kv_heads=3, dim=32, block_size=32, rope_theta=1e4, positions="int"),
]


def _grads(case, dtype, variant):
    from blockattn_layers.kernels.block.bwd import block_attention_bwd

    case = dict(case)
    heads, kv_heads, dim = case.pop("heads"), case.pop("kv_heads"), case.pop("dim")
    total = sum(LENGTHS)
    g = torch.Generator().manual_seed(heads * dim)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(total, heads, dim, generator=g).to(dtype)
    offsets = offsets_from_lengths(LENGTHS, torch.int32)
    pos, tol = rotary_positions(case.pop("positions", None), total)
    theta = case.get("rope_theta")
    rot = case.get("rotary_dim", dim) if theta is not None else 0
    got = block_attention_bwd(do, q, k, v, offsets, case["block_size"], dim ** -0.5, case.get("causal", False), theta,
                              pos, rot, case.get("rotary_interleaved", False), None, variant)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    want = oracle_attention(qd, kd, vd, offsets, positions=pos, **case)
    return got, torch.autograd.grad(want, (qd, kd, vd), do.double()), tol


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_group_partials_match_the_oracle(monkeypatch, case, dtype):
    """dq, dk and dv of the kv-head-by-kv-head launches (one per kv head, each seeing one query head
    per kv head through k and v of zero head stride, one sum each) match the float64 oracle as closely
    as the simple kernels' own grouped backward (which sums dK and dV in registers)."""
    from blockattn_layers.kernels.block import bwd
    from blockattn_layers.kernels.block.variants import SIMPLE

    launches, sums = [], []
    real_launch, real_sums = bwd._launch_checked, bwd.sum_head_groups

    def launch(variant, major, sched, positions, flags, scalars, tensors, sums=None):
        launches.append((tensors[0].shape[1], tensors[1].shape[1], tensors[1].stride(1)))
        return real_launch(variant, major, sched, positions, flags, scalars, tensors, sums)

    monkeypatch.setattr(bwd, "_launch_checked", launch)
    monkeypatch.setattr(bwd, "sum_head_groups", lambda *a: sums.append(a[0].shape) or real_sums(*a))
    by_heads, want, tol = _grads(case, dtype, SIMPLE._replace(group_partials=True))
    groups = case["heads"] // case["kv_heads"]
    assert launches == [(groups, groups, 0)] * case["kv_heads"]
    assert len(sums) == case["kv_heads"]
    launches.clear()
    grouped, _, _ = _grads(case, dtype, SIMPLE)
    assert launches == [(case["heads"], case["kv_heads"], case["dim"])]
    bound = tol or {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]
    for name, got, ref, same_kernel in zip("qkv", by_heads, want, grouped):
        assert got.is_contiguous() and got.shape == ref.shape, name
        assert rel_err(got, ref) < bound, f"d{name}: {rel_err(got, ref):.2e}"
        assert rel_err(got, ref) < 2 * rel_err(same_kernel, ref) + 1e-6, f"d{name}"


@pytest.mark.parametrize("rows,groups,dim", [(0, 2, 32), (1, 4, 48), (131, 3, 256), (70, 8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_head_sums_into_strided_rows(rows, groups, dim, dtype):
    """``common.head_sums`` sums each row's group in float32 into one kv head of ``[T, H_kv, D]``
    (strided rows), leaving the other kv heads untouched; rows past a program's tile are masked."""
    from blockattn_layers.kernels.common.head_sums import sum_head_groups

    g = torch.Generator().manual_seed(rows + dim)
    a, b = (torch.randn(rows, groups, dim, generator=g).to(dtype) for _ in range(2))
    out_a, out_b = (torch.full((rows, 3, dim), 7.0, dtype=dtype) for _ in range(2))
    sum_head_groups(a, out_a[:, 1], b, out_b[:, 1])
    for parts, out in ((a, out_a), (b, out_b)):
        want = parts.double().sum(1)
        # float32 sums, rounded once: within half an ulp of the dtype and float32's error of G terms.
        bound = (2 ** -11 if dtype == torch.float16 else 2 ** -23) * want.abs() + groups * 2 ** -24 * parts.abs().sum(1)
        assert ((out[:, 1].double() - want).abs() <= bound.double() + 1e-30).all()
        assert (out[:, 0] == 7).all() and (out[:, 2] == 7).all()


def test_head_sums_refuse_mismatched_shapes():
    from blockattn_layers.kernels.common.head_sums import sum_head_groups

    parts = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="head sums"):
        sum_head_groups(parts, torch.zeros(4, 8), parts, torch.zeros(4, 16))


def test_a_self_check_disagreement_hands_the_other_kv_heads_to_simple(monkeypatch):
    """Where a variant's self-check (``block.self_check``) disagrees on the first kv head's launch, that
    head's gradients are the simple kernels' and the other kv heads run the simple kernels directly."""
    from blockattn_layers.kernels.block import bwd
    from blockattn_layers.kernels.block.variants import SIMPLE

    suspect = SIMPLE._replace(name="suspect", group_partials=True)
    ran = []
    real = bwd._launch_checked

    def launch(variant, major, sched, positions, flags, scalars, tensors, sums=None):
        ran.append(variant.name)
        if variant is suspect:  # a disagreement: the simple kernels' result, in new buffers
            grads = real(SIMPLE, major, sched, positions, flags, scalars, tensors, sums)
            return tuple(g.clone() for g in grads)
        return real(variant, major, sched, positions, flags, scalars, tensors, sums)

    monkeypatch.setattr(bwd, "_launch_checked", launch)
    case = dict(CASES[2])
    got, want, tol = _grads(case, torch.float32, suspect)
    assert ran == ["suspect", "simple", "simple"]
    for g, ref in zip(got, want):
        assert rel_err(g, ref) < (tol or 2e-5)


def test_a_split_group_backward_is_not_prepared(monkeypatch):
    """The prepared backward (one launch fixed by the forward) is not made for a backward that runs
    grouped query heads one by one: ``bwd._template`` says so before planning any launch."""
    from blockattn_layers.kernels.block import bwd
    from blockattn_layers.kernels.block.variants import SIMPLE
    from blockattn_layers.kernels.common.schedule import Schedule

    partials = SIMPLE._replace(group_partials=True)
    monkeypatch.setattr(bwd, "choose", lambda *args: partials)
    monkeypatch.setattr(bwd, "_plan", lambda *args: pytest.fail("planned a launch"))
    offsets = offsets_from_lengths([5, 70], torch.int32)
    q, k = torch.zeros(75, 4, 32), torch.zeros(75, 2, 32)
    sched = Schedule(offsets, 75, 64, None)
    assert bwd._template(q, k, k, sched, 64, 0.2, False, None, None, 0, False) is bwd._UNPREPARED
    assert bwd.splits_groups(partials, q, k) and not bwd.splits_groups(partials, q, q)
    assert not bwd.splits_groups(SIMPLE, q, k)
