"""CPU smoke test of ``python -m blockattn_layers.bench`` on the tiny shapes (reference backend)."""
from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from blockattn_layers.bench import cli, env, report, runner, shapes
from blockattn_layers.bench.common import Case, Method, Prepared, RunConfig, make_inputs
from blockattn_layers.bench.ours import our_methods

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = RunConfig(device=torch.device("cpu"), dtype=torch.float32)


def test_tiny_run_on_cpu(tmp_path, monkeypatch):
    # conftest turns on the Triton interpreter; timing interpreted kernels would make this test slow.
    backends = "reference,baselines,ours_layer"
    argv = ["--shapes", "tiny", "--device", "cpu", "--dtype", "fp32", "--quick", "--backends", backends]
    monkeypatch.setattr(env, "CPU_COPY_BYTES", 8 << 20)  # the floor's copy, kept short here
    assert cli.main(argv + ["--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    meta = results["meta"]
    assert meta["gpu"] == "none" and meta["device_name"].startswith(env.cpu_name())
    assert "1 thread of" in meta["device_name"] and meta["threads"] == 1
    assert meta["bandwidth_source"] == "measured (8 MiB host copy, 1 thread, median of 5)"
    bandwidth = meta["bandwidth_bytes_per_s"]
    assert 1e8 < bandwidth < 1e13  # a host copy, not the H200's 4.27e12 by default
    block = results["cases"]["tiny/block"]
    assert block["fwd_floor_ms"] == pytest.approx(1e3 * 4 * block["T"] * block["H"] * block["D"] * 4 / bandwidth)
    table = (tmp_path / "table.txt").read_text()
    assert f"| {meta['device_name']} |" in table and "memory floor at " in table and "host copy" in table
    rows = {(r["case"], r["method"]): r for r in results["rows"]}
    assert set(results["cases"]) == {"tiny/block", "tiny/full", "tiny/rotary", "tiny/layer"}
    for case in ("tiny/block", "tiny/full", "tiny/rotary"):
        ref = rows[(case, "reference")]
        assert ref["status"] == "ok" and ref["err"] < 1e-5
        assert all(ref[f"{mode}_ms"] > 0 for mode in runner.MODES)
        assert results["cases"][case]["fwd_floor_ms"] > 0
    assert rows[("tiny/block", "eager")]["status"] == "ok"
    assert rows[("tiny/block", "fa2_varlen")]["status"] == "skipped"
    assert "GPU-only" in rows[("tiny/full", "nested_sdpa")]["reason"]
    assert rows[("tiny/layer", "torch_padded")]["status"] == "ok"
    ours_layer = rows[("tiny/layer", "ours_layer")]
    assert ours_layer["status"] == "ok" or "not available" in ours_layer["reason"]
    assert results["meta"]["commit"] and results["meta"]["torch"] == torch.__version__

    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(results["rows"])
    assert csv_rows[0]["device_name"] == meta["device_name"] and "host copy" in csv_rows[0]["bandwidth_source"]
    md = report.markdown(results)
    assert "### tiny/block" in md and "| reference |" in md


def _reference_method(name, mangle):
    reference = next(m for m in our_methods() if m.name == "reference")

    def setup(case, inp, cfg):
        p = reference.setup(case, inp, cfg)
        return Prepared(lambda: mangle(p.forward()), p.leaves, p.grad_out)

    return Method(name, "baseline", setup, lambda case: True, gpu_only=False)


def _broken(case, inp, cfg):
    raise RuntimeError("no kernel for this shape")


def test_wrong_or_broken_methods_are_marked():
    case = shapes.tiny()[0]
    methods = [
        _reference_method("right", lambda out: out),
        _reference_method("wrong", lambda out: out * 1.5),
        Method("broken", "baseline", _broken, lambda case: True, gpu_only=False),
    ]
    rows = {r["method"]: r for r in runner.run_case(case, methods, CPU, runner.Timing(cpu_reps=1), modes=("fwd",))}
    assert rows["right"]["status"] == "ok" and rows["right"]["fwd_ms"] > 0
    assert rows["wrong"]["status"] == "FAILED" and rows["wrong"]["err"] > 0.1
    assert rows["broken"]["status"] == "failed" and "no kernel" in rows["broken"]["reason"]


def test_unit_bounds_and_inputs():
    lengths = torch.tensor([3, 0, 130])
    assert Case("t", "t", lengths, 1, 8, 64).unit_bounds().tolist() == [0, 3, 67, 131, 133]
    assert Case("t", "t", lengths, 1, 8, None).unit_bounds().tolist() == [0, 3, 133]
    inp = make_inputs(Case("t", "t", lengths, 2, 8, 64), torch.device("cpu"), torch.float32, seed=0)
    assert inp.max_unit == 64 and inp.positions[:4].tolist() == [0, 1, 2, 0]
    assert inp.q.requires_grad and not inp.grad_out.requires_grad


def test_shape_names():
    assert "tiny" not in shapes.resolve("all") and shapes.resolve("default") == list(shapes.DEFAULT_SHAPES)
    # Blocks of 192-512 tokens, both production head layouts, each case named for its shape.
    for block in (192, 256, 384, 512):
        cases = shapes.SHAPES[f"block{block}"]()
        assert [(c.name, c.shape, c.block_size) for c in cases] == [
            (f"block{block}/d{d}h{h}", f"block{block}", block) for h, d in shapes.PROD_HEADS]
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.resolve("prod,nope")


def test_small_shape_is_timed_eager_and_graphed():
    """The small shape comes twice on the same lengths: eager calls and CUDA-graph replays; the
    graphed case needs CUDA and says so off the GPU instead of timing eager calls under its name."""
    eager, graphed = shapes.small()
    assert not eager.graphed and graphed.graphed and torch.equal(eager.lengths, graphed.lengths)
    assert "CUDA-graph" in graphed.describe()
    rows = runner.run_case(graphed, [_reference_method("right", lambda out: out)], CPU, runner.Timing(cpu_reps=1),
                           modes=("fwd",))
    assert rows[0]["status"] == "skipped" and "CUDA" in rows[0]["reason"] and "fwd_ms" not in rows[0]


def test_host_bound_cases_are_timed_in_interleaved_rounds(monkeypatch):
    """``rounds > 1``: every method is checked first, then all are timed round by round in turn
    (each round rotated by one), each mode reporting the median of its rounds; wrong and broken
    methods are still marked."""
    case = dataclasses.replace(shapes.tiny()[0], rounds=3)
    assert shapes.small()[0].rounds > 1 and "3 rounds" in case.describe()
    order, times = [], iter([5.0, 1.0, 3.0, 2.0, 9.0, 4.0])

    def fake_measure(fn, device, timing):
        fn()
        return next(times)

    def traced(name):
        return _reference_method(name, lambda out: order.append(name) or out)

    monkeypatch.setattr(runner, "measure_ms", fake_measure)
    methods = [traced("a"), traced("b"), Method("broken", "baseline", _broken, lambda c: True, gpu_only=False),
               _reference_method("wrong", lambda out: out * 1.5)]
    rows = {r["method"]: r for r in runner.run_case(case, methods[:3], CPU, runner.Timing(cpu_reps=1),
                                                     modes=("fwd",))}
    # checks (a, b), then rounds a, b / b, a / a, b (each round starts one method later): each
    # timing calls the method once
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert rows["a"]["fwd_rounds"] == "5 2 9" and rows["a"]["fwd_ms"] == 5.0
    assert rows["b"]["fwd_rounds"] == "1 3 4" and rows["b"]["fwd_ms"] == 3.0
    assert rows["broken"]["status"] == "failed" and "fwd_ms" not in rows["broken"]
    wrong = runner.run_case(case, methods[3:], CPU, runner.Timing(cpu_reps=1), modes=("fwd",))[0]
    assert wrong["status"] == "FAILED"


def test_commit_stamp_takes_blockattn_commit_first(monkeypatch):
    monkeypatch.setenv("BLOCKATTN_COMMIT", "abc123")
    assert env.git_commit() == ("abc123", "BLOCKATTN_COMMIT")
    monkeypatch.delenv("BLOCKATTN_COMMIT")
    assert env.git_commit()[1] in ("git", "none")


def test_cpu_copy_bandwidth_is_measured():
    bandwidth = env.measure_bandwidth(torch.device("cpu"), nbytes=4 << 20)
    assert 1e8 < bandwidth < 1e13
    assert env.cpu_name() and env.cpu_name() != "none"


def test_floor_bandwidth_choice(monkeypatch):
    """``--bandwidth`` wins; an H200 takes its measured 4.27 TB/s unless asked to measure; the CPU
    and any other GPU are measured once."""
    measured = []

    def fake_measure(device, nbytes=None):
        measured.append((device.type, nbytes))
        return 1.5e12 if device.type == "cuda" else 3e10

    monkeypatch.setattr(env, "measure_bandwidth", fake_measure)
    cuda = torch.device("cuda", 0)
    assert env.floor_bandwidth(cuda, requested=2e12) == (2e12, "--bandwidth")
    assert env.floor_bandwidth(torch.device("cpu"), requested=1e9) == (1e9, "--bandwidth")
    assert not measured

    bandwidth, source = env.floor_bandwidth(torch.device("cpu"))
    assert bandwidth == 3e10 and source.startswith("measured (256 MiB host copy")
    assert measured == [("cpu", 256 << 20)]

    monkeypatch.setattr(env, "copy_bytes", lambda device: 4 << 30 if device.type == "cuda" else 256 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert env.floor_bandwidth(cuda) == (4.27e12, "H200 device copy (PERFORMANCE.md)")
    assert len(measured) == 1
    assert env.floor_bandwidth(cuda, measure=True) == (1.5e12, "measured (4 GiB device copy, do_bench median)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert env.floor_bandwidth(cuda) == (1.5e12, "measured (4 GiB device copy, do_bench median)")
    assert measured[1:] == [("cuda", 4 << 30)] * 2


def test_report_names_the_device_and_the_floor():
    meta = dict(gpu="NVIDIA H200", bandwidth_bytes_per_s=4.27e12)  # a stamp from before device_name
    assert "| NVIDIA H200 |" in report.format_table([], {}, meta)
    assert "on NVIDIA H200," in report.markdown(dict(meta=meta, cases={}, rows=[]))
    meta.update(device_name="AMD EPYC, 2 threads of 2 CPUs", gpu="none", bandwidth_bytes_per_s=4.1e10,
                bandwidth_source="measured (256 MiB host copy, 2 threads, median of 5)")
    table = report.format_table([], {}, meta)
    assert "| AMD EPYC, 2 threads of 2 CPUs |" in table
    assert "memory floor at 41.0 GB/s, measured (256 MiB host copy" in table


def test_kernel_times_sums_each_kernel_per_call_longest_first():
    """``bench.fp8.kernel_times`` (its ``--kernels`` breakdown), here over CPU operators: the
    matrix product dominates, each time is per call, all are positive."""
    from torch.profiler import ProfilerActivity

    from blockattn_layers.bench.fp8 import kernel_times

    a = torch.randn(384, 384)
    times = kernel_times(lambda: (a @ a).sum(), calls=3, activity=ProfilerActivity.CPU)
    names = [name for name, _ in times]
    assert names[0] == "aten::mm" and "aten::sum" in names
    assert all(ms > 0 for _, ms in times) and [ms for _, ms in times] == sorted((ms for _, ms in times), reverse=True)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_flash_kernels_rows_match_the_oracle_at_a_single_tile_block(recompute):
    """The opt-in ``flash_kernels`` rows (the flash kernels called directly at blocks of up to 128
    tokens, outside the op) compute block attention and its gradients: against the float64 oracle
    in the interpreter, GQA with rotary and causal, lengths 0, 1 and across the block; only named
    by ``--backends`` (opt-in), and left to ``triton_flash`` at blocks over 128."""
    from blockattn_layers.ops.backends.triton_block import interpreter_active
    from tests.oracle import oracle_attention, rel_err

    if not interpreter_active():
        pytest.skip("CPU interpreter test; the GPU bench runs these rows on a GPU")
    name = "flash_kernels[recompute]" if recompute else "flash_kernels"
    method = next(m for m in our_methods() if m.name == name)
    assert method.opt_in and name not in [m.name for m in cli.select_methods("ours")]
    assert [m.name for m in cli.select_methods(name)] == [name]
    case = Case("t", "t", torch.tensor([0, 1, 40, 17, 64]), 4, 16, 32, rope_theta=1e4, num_kv_heads=2, causal=True)
    assert method.skip(case, None) is None
    assert method.skip(dataclasses.replace(case, block_size=256), None) is not None
    inp = make_inputs(case, torch.device("cpu"), torch.float32, seed=0)
    prepared = method.setup(case, inp, RunConfig(torch.device("cpu"), torch.float32))
    out = prepared.forward()
    grads = torch.autograd.grad(out, prepared.leaves, prepared.grad_out)
    leaves = [t.detach().double().requires_grad_() for t in prepared.leaves]
    ref = oracle_attention(*leaves, inp.cpu_offsets, 32, causal=True, rope_theta=1e4)
    ref_grads = torch.autograd.grad(ref, leaves, prepared.grad_out.double())
    assert rel_err(out, ref) < 2e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-5


def test_gluon_flash_kernels_rows_are_opt_in_and_set_their_options():
    """The opt-in ``flash_kernels[gluon*]`` rows (the persistent Gluon forward called directly at blocks of up to
    128 tokens): GPU rows, named only by ``--backends``, left to ``triton_flash`` at blocks over 128, each with
    its ``flash_persistent`` options (or, for the backward rows, the Gluon backward kernel and the backward's
    mode) set for its calls and restored after."""
    from blockattn_layers.determinism import deterministic_backward
    from blockattn_layers.kernels.sm90 import flash_bwd, flash_persistent

    rows = {m.name: m for m in our_methods() if m.name.startswith("flash_kernels[gluon")}
    want = {"flash_kernels[gluon]": (False, False), "flash_kernels[gluon_early_release]": (True, False),
            "flash_kernels[gluon_share_kv]": (True, True)}
    backward = {"flash_kernels[gluon_fast_bwd]": False, "flash_kernels[gluon_bwd]": True,  # deterministic?
                "flash_kernels[gluon_fast_bwd_dq_store]": False,
                "flash_kernels[gluon_fast_bwd_dq_store_consumer_rows]": False,
                "flash_kernels[gluon_fast_bwd_dq_store_delta]": False}
    assert set(rows) == set(want) | set(backward)
    case = Case("t", "t", torch.tensor([0, 1, 130, 17]), 4, 128, 128, num_kv_heads=1)
    for name, method in rows.items():
        assert method.opt_in and method.gpu_only and name not in [m.name for m in cli.select_methods("ours")]
        assert method.skip(dataclasses.replace(case, block_size=256), None) is not None
        with method.context():
            if name in backward:
                assert flash_bwd.TAKEN[0] and deterministic_backward() == backward[name]
                assert flash_bwd.stores_dq(128, 64) == ("_dq_store" in name)
                assert flash_bwd.stores_dq(128, 128) == flash_bwd.stores_dq(128, 96) == ("_dq_store" in name)
                assert flash_bwd.DELTA_IN_KERNEL == name.endswith("_delta]")
            else:
                assert (flash_persistent.EARLY_RELEASE, flash_persistent.SHARE_KV) == want[name]
        assert not flash_persistent.EARLY_RELEASE and not flash_persistent.SHARE_KV
        assert not flash_bwd.TAKEN[0] and deterministic_backward()
        assert flash_bwd.DQ_STORE_HEAD_DIMS == frozenset({96, 128})
        assert flash_bwd.DELTA_IN_KERNEL is None


def test_fp8_candidate_rows_time_each_setting_and_restore_the_kernel_options(monkeypatch):
    """``bench.fp8 --ws-options`` and ``--projection`` (their GPU rows run here on CPU tensors, the
    timer stubbed): a checked row per shape and setting, the warp-specialized forward's options
    back at their defaults afterwards, and the projection rows (the Triton kernel in the interpreter,
    the 16-bit product)."""
    import triton.testing

    from blockattn_layers.bench import fp8 as bench_fp8
    from blockattn_layers.kernels.sm90 import fp8_fwd as ws
    from blockattn_layers.ops.backends.triton_block import interpreter_active

    if not interpreter_active():
        pytest.skip("CPU interpreter test; the GPU runs these rows by `make gpu-fp8-bench`")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() is not None and 1.0)
    before = {key: getattr(ws, key) for key in ("ROTARY_SLOWER_AT", "VERIFIED_ON")}
    lengths = torch.tensor([0, 1, 70, 64, 5])
    cases = [Case("prod", "prod", lengths, 2, 64, 64), Case("rotary", "rotary", lengths, 4, 64, 64, rope_theta=1e4)]
    monkeypatch.setattr(bench_fp8, "CHECK_SEQS", 4)
    rows = bench_fp8.ws_option_rows("abc", device="cpu", cases=cases, bandwidth=1e9)
    assert len(rows) == 2 * (len(bench_fp8.WS_OPTIONS) + 1)
    assert all(row["err"] < 1e-2 and row["ms"] == 1.0 and row["commit"] == "abc" for row in rows)  # bf16 out
    assert {key: getattr(ws, key) for key in before} == before
    rows = bench_fp8.projection_rows("abc", 64, 48, device="cpu", total=70, bandwidth=1e9)
    assert [row["method"] for row in rows] == ["projection, triton", "projection, cublas bf16"]
    # (The interpreter's float32 -> e4m3 rounding is wrong where rounding carries into the exponent,
    # so the Triton row's error is checked on the GPU only, tests/test_fp8_modules.py.)
    assert rows[1]["err"] < 0.01 and all(row["x_floor"] > 0 for row in rows)
    # Floors at the bandwidth given (the device's, measured, where none is): x read, y written.
    assert rows[0]["floor_ms"] == pytest.approx(1e3 * 70 * (64 * 2 + 48) / 1e9)
    assert rows[1]["floor_ms"] == pytest.approx(1e3 * 70 * (64 * 2 + 48 * 2) / 1e9)


def test_gluon_flash_rows_set_their_kernel_switches_and_restore_them():
    """The rows that time the Gluon flash kernels off their defaults: inside each row's context the
    kernel it names is chosen (the dK/dV pass with its dQ form; the per-tile forward), and every
    switch is back at its default afterwards."""
    from blockattn_layers import determinism
    from blockattn_layers.bench import ours
    from blockattn_layers.kernels.sm90 import flash_bwd, flash_persistent

    def switches():
        return (flash_bwd.TAKEN[0], flash_bwd.FAST_TAKEN[0], flash_bwd.DKDV_ONLY_TAKEN[0], flash_bwd.DQ_WRITER,
                flash_bwd.P_BESIDE_DP, flash_persistent.TAKEN[0], not determinism.deterministic_backward(),
                tuple(sorted(flash_bwd.ORDERED_HEAD_DIMS)), tuple(sorted(flash_bwd.DKDV_ONLY_HEAD_DIMS)),
                tuple(sorted(flash_bwd.DKDV_ONLY_WIDE_HEAD_DIMS)), flash_bwd.ROWS_BY_LOADER,
                flash_bwd.THREAD_RELEASE, flash_bwd.DQ_LAG, flash_bwd.STAGGER, flash_bwd.LEAN_WRITER)

    defaults = switches()
    assert defaults == (False, True, False, True, False, True, False, (128,), (64,), (64,), True, True, False, False, True)
    rows = {method.name: method for method in ours.GLUON_BACKWARDS + [
        ours.GLUON_FLASH_BY_TILES, ours.TRITON_FAST_BACKWARD, ours.GLUON_DKDV_ONLY_BACKWARD, ours.TRITON_BACKWARD,
        ours.GLUON_DKDV_ONLY_NARROW_BACKWARD]}
    want = {
        "triton_flash[gluon_bwd]": (True, True, False, True, False, True, False,
                                   (128,), (64,), (64,), True, True, False, False, True),
        "triton_flash[gluon_fast_bwd]": (True, True, False, True, False, True, True,
                                        (128,), (64,), (64,), True, True, False, False, True),
        "triton_flash[gluon_bwd_consumer_adds]": (True, True, False, False, False, True, False,
                                                 (128,), (64,), (64,), False, False, False, False, True),
        "triton_flash[gluon_fast_bwd_consumer_adds]": (True, True, False, False, False, True, True,
                                                      (128,), (64,), (64,), False, False, False, False, True),
        "triton_flash[gluon_fast_bwd_p_beside_dp]": (True, True, False, True, True, True, True,
                                                    (128,), (64,), (64,), True, True, False, False, True),
        "triton_flash[gluon_tiles]": (False, True, False, True, False, False, False,
                                     (128,), (64,), (64,), True, True, False, False, True),
        "triton_flash[triton_fast_bwd]": (False, False, False, True, False, True, True,
                                         (128,), (64,), (64,), True, True, False, False, True),
        "triton_flash[gluon_dkdv_bwd]": (False, True, True, True, False, True, False,
                                        (), (64,), (64,), True, True, False, False, True),
        "triton_flash[triton_bwd]": (False, True, False, True, False, True, False,
                                    (), (), (64,), True, True, False, False, True),
        "triton_flash[gluon_dkdv_m64]": (False, True, True, True, False, True, False,
                                        (), (64,), (), True, True, False, False, True),
        "triton_flash[gluon_fast_bwd_rows_by_loader]": (True, True, False, True, False, True, True,
                                                       (128,), (64,), (64,), True, False, False, False, False),
        "triton_flash[gluon_bwd_rows_by_loader]": (True, True, False, True, False, True, False,
                                                  (128,), (64,), (64,), True, False, False, False, False),
        "triton_flash[gluon_fast_bwd_consumer_rows]": (True, True, False, True, False, True, True,
                                                      (128,), (64,), (64,), False, False, False, False, False),
        "triton_flash[gluon_bwd_consumer_rows]": (True, True, False, True, False, True, False,
                                                 (128,), (64,), (64,), False, False, False, False, False),
        "triton_flash[gluon_fast_bwd_dq_lag]": (True, True, False, True, False, True, True,
                                               (128,), (64,), (64,), True, True, True, False, True),
        "triton_flash[gluon_bwd_dq_lag]": (True, True, False, True, False, True, False,
                                          (128,), (64,), (64,), True, True, True, False, True),
        "triton_flash[gluon_fast_bwd_stagger]": (True, True, False, True, False, True, True,
                                                (128,), (64,), (64,), True, True, True, True, True),
        "triton_flash[gluon_fast_bwd_full_writer]": (True, True, False, True, False, True, True,
                                                    (128,), (64,), (64,), True, True, False, False, False),
        "triton_flash[gluon_bwd_full_writer]": (True, True, False, True, False, True, False,
                                               (128,), (64,), (64,), True, True, False, False, False),
    }
    assert set(rows) == set(want)
    for name, method in rows.items():
        with method.context():
            assert switches() == want[name], name
        assert switches() == defaults, name


def test_gluon_forward_candidate_rows_set_their_switches_and_restore_them():
    """``triton_flash[gluon_m128]`` times the persistent Gluon forward with 128-row items everywhere (192 at
    full attention, D 64, after), ``triton_flash[gluon_m192]`` with 192-row items at full attention with D 128
    too, ``triton_flash[gluon_pingpong]`` with the serial loop's products in turns (each of the three on the
    serial loop with one barrier pair, as measured), ``triton_flash[gluon_shift_last]`` with a block's ragged
    last key tile its last keys, ``triton_flash[gluon_early_release]`` with the previous item's query buffer
    released after the first ``Q K^T``, ``triton_flash[gluon_thread_release]`` with slots released by every
    consumer thread, and the ``[gluon_serial_joint]``, ``[gluon_split_kv]``,
    ``[gluon_overlap_joint]``, ``[gluon_overlap_split_kv]`` rows with one consumer loop
    (``flash_persistent.LOOPS``) everywhere; every switch back at its default afterwards."""
    from blockattn_layers.bench import ours
    from blockattn_layers.kernels.sm90 import flash_fwd, flash_persistent

    cpu = torch.device("cpu")
    serial_joint = {(128, 0): (False, False), (64, 0): (False, False), (128, 256): (False, False)}
    assert flash_fwd.CONSUMER_LOOP == "serial" and not flash_fwd.overlap_taken()
    assert flash_persistent.item_tile(64, 0) == (192, 128) and flash_persistent.item_tile(64, 256) == (128, 128)
    assert flash_persistent.item_tile(128, 0) == (128, 128)
    with ours.GLUON_FLASH_M128.context():
        assert flash_persistent.item_tile(64, 0) == (128, 128) and flash_persistent.item_tile(128, 0) == (128, 128)
        assert {key: flash_persistent.consumer_loop(*key) for key in serial_joint} == serial_joint
    with ours.GLUON_FLASH_M192.context():
        assert flash_persistent.item_tile(64, 0) == (192, 128) and flash_persistent.item_tile(128, 0) == (192, 64)
        assert flash_persistent.item_tile(128, 512) == (128, 128)
        assert {key: flash_persistent.consumer_loop(*key) for key in serial_joint} == serial_joint
    assert flash_persistent.THREE_CONSUMER_HEAD_DIMS == frozenset({64})
    assert not flash_persistent.PINGPONG
    with ours.GLUON_FLASH_PINGPONG.context():
        assert flash_persistent.PINGPONG and flash_persistent.taken(cpu)
        assert {key: flash_persistent.consumer_loop(*key) for key in serial_joint} == serial_joint
    shift_last = [flash_persistent.shift_last_taken(block) for block in (0, 64, 192, 256, 257, 512)]
    assert not flash_persistent.PINGPONG and shift_last == [False, True, True, True, False, False]
    with ours.GLUON_FLASH_SHIFT_LAST.context():
        assert all(flash_persistent.shift_last_taken(block) for block in (0, 64, 256, 512, 1 << 20))
        assert flash_persistent.taken(cpu)
    assert [flash_persistent.shift_last_taken(block) for block in (0, 64, 192, 256, 257, 512)] == shift_last
    assert not flash_persistent.EARLY_RELEASE
    with ours.GLUON_FLASH_EARLY_RELEASE.context():
        assert flash_persistent.EARLY_RELEASE and flash_persistent.taken(cpu)
    assert not flash_persistent.EARLY_RELEASE
    assert not flash_persistent.THREAD_RELEASE
    with ours.GLUON_FLASH_THREAD_RELEASE.context():
        assert flash_persistent.THREAD_RELEASE and flash_persistent.taken(cpu)
    assert not flash_persistent.THREAD_RELEASE
    # The loop rows: one consumer loop for every key of LOOPS; the defaults back afterwards.
    defaults = dict(flash_persistent.LOOPS)
    loop = flash_persistent.consumer_loop
    assert loop(128, 0) == (True, True) and loop(128, 256) == (False, False)
    assert loop(64, 0) == loop(64, 512) == (False, True)
    loops = {row.name: row for row in ours.GLUON_FLASH_LOOPS}
    want = {"serial_joint": (False, False), "split_kv": (False, True), "overlap_joint": (True, False),
            "overlap_split_kv": (True, True)}
    assert set(loops) == {f"triton_flash[gluon_{name}]" for name in want}
    for name, pair in want.items():
        with loops[f"triton_flash[gluon_{name}]"].context():
            assert set(flash_persistent.LOOPS) == set(defaults) and set(flash_persistent.LOOPS.values()) == {pair}
            assert flash_persistent.taken(cpu) and flash_persistent.consumer_loop(64, 0) == pair
        assert flash_persistent.LOOPS == defaults


@pytest.mark.parametrize("reasons,skipped", [
    ({"hopper_packed": [], "simple": ["a variant before is taken"]}, True),
    ({"hopper_packed": [], "simple": ["a variant before is taken"], "backward: simple": []}, False),
    ({"simple": [], "hopper_packed": ["a variant before is taken"]}, False),
])
def test_forced_variant_rows_skip_only_where_auto_runs_that_variant_in_both_phases(monkeypatch, reasons, skipped):
    """A forced-variant row (``triton[NAME]``) is a duplicate, and skips, only where auto runs NAME forward and
    backward; where auto's backward runs another variant (``backward: simple``), the row times NAME's backward."""
    from blockattn_layers.bench import ours

    class Spec:
        name = "triton"

        @staticmethod
        def not_supported_reasons(req):
            return []

        @staticmethod
        def variant_reasons(req):
            return reasons

    monkeypatch.setattr(ours, "_request", lambda case, cfg: None)
    why = ours._variant_skip(Spec, "hopper_packed")(None, None)
    assert (why == "the 'triton' row runs this variant here") == skipped
