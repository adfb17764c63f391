"""``python -m blockattn_layers.bench.fp8``: the fp8 (e4m3) attention forward beside bfloat16's.

The prod shapes (B 1152, lengths uniform in [1, 4000], block 64; D128 H2 and D64 H4), with and
without rotary. Per shape: our bfloat16 forward (no grad), the fp8 kernel (``kernels.block.fp8_fwd``,
per-head factors, bfloat16 output), and the fp8 call on descaled copies (what runs without the
kernel), each checked first on the first 64 sequences against the float32 reference of the
descaled inputs. ``x floor``: time over the bytes each must move at the device's copy bandwidth
(``env.floor_bandwidth``: PERFORMANCE.md's 4.27 TB/s on an H200, measured on any other GPU):
bfloat16 reads q, k, v and writes o (8 bytes per element of a head row); fp8 reads 1-byte q, k, v
and writes a bfloat16 o (5 bytes). Prints one line per shape and
method, then the attention sub-layer (d_model 256) in bfloat16 and converted by
``to_fp8_inference``, with its error against the float64 layer; ``--out FILE`` also writes them
as CSV. Rows marked ``unverified paths`` run with unverified kernels allowed
(``variants.allow_unverified``) beside the default rows: on sm_90, where the fp8 kernel, its
e4m3-score products and the fused e4m3 projection are verified, both rows run the same kernels;
on sm_89 / sm_100 the default row falls back to descaled copies (and a float32 projection).
``--projection`` times the e4m3 QKV projection alone, by each kernel (:func:`projection_rows`);
``--ws-options`` the warp-specialized forward under its candidate options (:func:`ws_option_rows`).
"""
from __future__ import annotations

import argparse
import copy
import csv
import itertools
from typing import List, Optional, Tuple

import torch

import blockattn_layers as bl
from blockattn_layers import fp8

from blockattn_layers.kernels.block.variants import unverified_kernels
from blockattn_layers.reference import sequence_positions

from .common import module_attrs
from .env import bandwidth_text, floor_bandwidth, git_commit
from .shapes import prod, rotary

CHECK_SEQS = 64


def _floor_ms(total: int, heads: int, kv_heads: int, dim: int, in_bytes: int, out_bytes: int,
              bandwidth: float) -> float:
    return 1e3 * total * dim * ((heads + 2 * kv_heads) * in_bytes + heads * out_bytes) / bandwidth


def _check(run, total_check: int, want: torch.Tensor) -> float:
    out = run()[:total_check].float()
    return float((out - want).norm() / want.norm())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="CSV file for the rows")
    parser.add_argument("--kernels", action="store_true",
                        help="also print where each sub-layer's time goes at prod D128 and rotary D128: GPU time per "
                             "kernel and call")
    parser.add_argument("--projection", action="store_true",
                        help="only the e4m3 QKV projection at the prod width, by each kernel (projection_rows)")
    parser.add_argument("--ws-options", action="store_true",
                        help="only the warp-specialized fp8 forward under each of its candidate options (ws_option_rows)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.fp8 needs a CUDA GPU")
        return 1
    import triton.testing

    commit = git_commit()[0]
    bandwidth, source = floor_bandwidth(torch.device("cuda"))
    print(f"memory floor at {bandwidth_text(bandwidth)}: {source}", flush=True)
    if args.projection or args.ws_options:
        rows = (projection_rows(commit, bandwidth=bandwidth) if args.projection
                else ws_option_rows(commit, bandwidth=bandwidth))
        if args.out:
            write_csv(args.out, rows)
        return 0
    rows = []
    for case in prod() + rotary():
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (case.total, case.num_heads, case.head_dim)
        q, k, v = (torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
        offsets = case.offsets.cuda()
        kw = dict(rope_theta=case.rope_theta)
        (q8, qd), (k8, kd), (v8, vd) = (bl.quantize_fp8(x) for x in (q, k, v))
        factors = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        check_offsets = offsets[:CHECK_SEQS + 1]
        total_check = int(check_offsets[-1])
        deq = [fp8.dequantize(x[:total_check], d, check_offsets, 1, torch.float32)
               for x, d in ((q8, qd), (k8, kd), (v8, vd))]
        want = bl.block_attention(*deq, check_offsets, case.block_size, backend="reference", **kw).float()
        def fp8_call():
            return bl.block_attention(q8, k8, v8, offsets, case.block_size, **factors, **kw)

        methods = {
            "bf16": (lambda: bl.block_attention(q, k, v, offsets, case.block_size, **kw), 2, False),
            "fp8 kernel": (fp8_call, 1, False),
            "fp8 kernel, unverified paths": (fp8_call, 1, True),
            "fp8 descaled copies": (_descaled_copies(q8, k8, v8, offsets, case.block_size, factors, kw), 1, False),
        }
        for name, (run, in_bytes, unverified) in methods.items():
            with torch.no_grad(), unverified_kernels(unverified):
                err = _check(run, total_check, want) if name != "bf16" else None
                ms = triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")
            floor = _floor_ms(case.total, case.num_heads, case.kv_heads, case.head_dim, in_bytes, 2, bandwidth)
            rows.append(dict(shape=case.name, method=name, ms=ms, floor_ms=floor, x_floor=ms / floor,
                             err=err, commit=commit))
            print(f"{case.name:16} {name:31} {ms:8.3f} ms  {ms / floor:5.2f}x floor"
                  + (f"  err {err:.2e}" if err is not None else ""), flush=True)
    rows += _sublayer_rows(commit, args.kernels)
    if args.out:
        write_csv(args.out, rows)
    return 0


def write_csv(path: str, rows: List[dict]) -> None:
    """``rows`` (dicts with the first one's keys) as a CSV file with a header."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def kernel_times(run, calls: int = 10, activity=None) -> List[Tuple[str, float]]:
    """``(kernel name, ms per call)`` of ``run()``'s device kernels, longest first, from
    ``calls`` profiled calls after one warm-up (``activity``: the profiler's, CUDA by default)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if activity is None else activity
    kind = DeviceType.CUDA if activity == ProfilerActivity.CUDA else DeviceType.CPU
    run()
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    times = []
    for event in prof.key_averages():
        total = event.self_device_time_total if kind == DeviceType.CUDA else event.self_cpu_time_total
        if event.device_type == kind and total > 0:
            times.append((event.key, total / calls / 1e3))
    return sorted(times, key=lambda item: -item[1])


def _sublayer_rows(commit: str, kernels: bool = False) -> List[dict]:
    """The attention sub-layer (QKV projection, attention, output projection; d_model 256) at the
    prod shapes, bfloat16 against ``to_fp8_inference``'s (calibrated on the first 64 sequences),
    each with its output's error against the float64 layer on those sequences; ``kernels``: the
    time per kernel too (:func:`kernel_times`) at prod D128 and rotary D128 (on an H100 the rotary
    sub-layer's extra time is its attention kernel, slower there than alone as the clock drops under
    sustained load: 0.23 ms with q and k rotated in float32, 0.13 ms in float16; the plain forward, at
    the memory floor, keeps its time)."""
    import triton.testing

    rows = []
    cases = prod() + rotary()
    for case in cases:
        g = torch.Generator(device="cuda").manual_seed(1)
        kind = bl.RotaryBlockAttention if case.rope_theta else bl.BlockSelfAttention
        extra = dict(rope_theta=case.rope_theta) if case.rope_theta else {}
        layer = kind(256, case.num_heads, block_size=case.block_size, **extra).to("cuda", torch.bfloat16).eval()
        values = torch.randn(case.total, 256, generator=g, device="cuda").to(torch.bfloat16)
        offsets = case.offsets.cuda()
        check_offsets = offsets[:CHECK_SEQS + 1]
        sample = values[:int(check_offsets[-1])]
        served = bl.to_fp8_inference(copy.deepcopy(layer), [(sample, check_offsets)])
        with torch.no_grad():
            want = copy.deepcopy(layer).double()(sample.double(), check_offsets)
            for name, model, unverified in (("bf16 sub-layer", layer, False), ("fp8 sub-layer", served, False),
                                            ("fp8 sub-layer, unverified paths", served, True)):
                with unverified_kernels(unverified):
                    got = model(sample, check_offsets)
                err = float((got.double() - want).norm() / want.norm())
                with unverified_kernels(unverified):
                    ms = triton.testing.do_bench(lambda: model(values, offsets), warmup=25, rep=150,
                                                 return_mode="median")
                rows.append(dict(shape=case.name, method=name, ms=ms, floor_ms=None, x_floor=None, err=err,
                                 commit=commit))
                print(f"{case.name:16} {name:31} {ms:8.3f} ms  err {err:.2e} (against the float64 layer)", flush=True)
                if kernels and case.name in (cases[0].name, rotary()[0].name):
                    with torch.no_grad(), unverified_kernels(unverified):
                        for kernel, kernel_ms in kernel_times(lambda: model(values, offsets))[:8]:
                            print(f"    {kernel_ms:8.3f} ms  {kernel[:100]}", flush=True)
    return rows


# The warp-specialized forward's candidate options (``kernels.sm90.fp8_fwd``: module constants set for the
# row), each timed beside the defaults: more of the ring in flight (at D 128 the default 96 KB is three
# items, one per consumer, so an item's copies start only once its consumer has released the last), and
# rotary's q and k rotated in float32 into halves of the output dtype, as before ``F16_ROTATION`` (rotary
# rows only differ).
WS_OPTIONS = {
    "defaults": {},
    "ring 144 KB": {"SLOT_BYTES": 144 * 1024},
    "ring 196 KB": {"SLOT_BYTES": 196 * 1024},
    "float32 rotation": {"F16_ROTATION": False},
}


def ws_option_rows(commit: str, device: str = "cuda", cases: Optional[list] = None,
                   bandwidth: Optional[float] = None) -> List[dict]:
    """The fp8 forward by the warp-specialized sm_90 kernel at the prod shapes (or ``cases``), with
    and without rotary (rotary calls at every head dim, ``ROTARY_SLOWER_AT`` set aside), under each of
    ``WS_OPTIONS``, beside the Triton fp8 forward; each checked first as ``main``'s rows. Floors at
    ``bandwidth`` bytes/s (default ``env.floor_bandwidth`` of ``device``)."""
    import triton.testing

    from blockattn_layers.kernels.sm90 import fp8_fwd as ws

    bandwidth = bandwidth or floor_bandwidth(torch.device(device))[0]

    rows = []
    for case in cases if cases is not None else prod() + rotary():
        g = torch.Generator(device=device).manual_seed(0)
        shape = (case.total, case.num_heads, case.head_dim)
        stored, factors = {}, {}
        for name in "qkv":
            x = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
            stored[name], factors[f"{name}_descale"] = bl.quantize_fp8(x)
        offsets = case.offsets.to(device)
        kw = dict(rope_theta=case.rope_theta)
        check_offsets = offsets[:CHECK_SEQS + 1]
        total_check = int(check_offsets[-1])
        deq = [fp8.dequantize(stored[n][:total_check], factors[f"{n}_descale"], check_offsets, 1, torch.float32)
               for n in "qkv"]
        want = bl.block_attention(*deq, check_offsets, case.block_size, backend="reference", **kw).float()

        def call():
            return bl.block_attention(stored["q"], stored["k"], stored["v"], offsets, case.block_size, **factors, **kw)

        settings = dict(WS_OPTIONS)
        settings["triton fp8 forward"] = None
        for name, options in settings.items():
            if options is None:
                overrides = dict(VERIFIED_ON=frozenset(), ROTARY_SLOWER_AT=tuple(ws.HEAD_DIMS))
            else:
                overrides = dict(options, ROTARY_SLOWER_AT=())
            with module_attrs(ws, **overrides), torch.no_grad(), unverified_kernels(False):
                err = _check(call, total_check, want)
                ms = triton.testing.do_bench(call, warmup=25, rep=150, return_mode="median")
            floor = _floor_ms(case.total, case.num_heads, case.kv_heads, case.head_dim, 1, 2, bandwidth)
            rows.append(dict(shape=case.name, method=f"fp8, {name}", ms=ms, floor_ms=floor, x_floor=ms / floor,
                             err=err, commit=commit))
            print(f"{case.name:16} {name:31} {ms:8.3f} ms  {ms / floor:5.2f}x floor  err {err:.2e}", flush=True)
    return rows


def projection_rows(commit: str, in_dim: int = 256, out_dim: int = 768, device: str = "cuda",
                    total: Optional[int] = None, bandwidth: Optional[float] = None) -> List[dict]:
    """The e4m3 QKV projection alone (``kernels.fp8_linear``) over the prod rows, ``[T, 256]``
    bfloat16 to ``[T, 768]`` e4m3: the Triton kernel, the warp-specialized sm_90 one in 128- and
    256-column slices, its ``x`` in 64-channel chunks or whole tiles (``sm90.linear``, where it
    admits the call; ``CHUNKED``), at 256 columns without its consumers' turns (``PINGPONG``) or its
    bias loaded once (``BIAS_ONCE``), or with its chunks' slots released by every thread (``THREAD_RELEASE``),
    with rotary on q and k in its epilogue (``PairRotary``, prod's D128 and
    D64 heads; its GPU test checks the values), and cuBLAS's bfloat16 product
    (what the bfloat16 sub-layer runs), each checked first against the float32 product. ``x floor``:
    time over the bytes (16-bit x read, e4m3 y written; cuBLAS: 16-bit y) at ``bandwidth`` bytes/s
    (default ``env.floor_bandwidth`` of ``device``). ``total``: rows (default the prod shapes')."""
    import triton.testing

    from blockattn_layers.kernels.fp8_linear import linear_triton

    bandwidth = bandwidth or floor_bandwidth(torch.device(device))[0]

    total = prod()[0].total if total is None else total
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(total, in_dim, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(out_dim, in_dim, generator=g, device=device) * 8 / in_dim ** 0.5).to(torch.bfloat16)
    b = torch.randn(out_dim, generator=g, device=device)
    check = slice(0, 4096)
    want = (x[check].float() @ w.float().t() + b).clamp(-448, 448)
    def output():
        return torch.empty(total, out_dim, dtype=torch.float8_e4m3fn, device=device)

    def triton_run():
        y = output()
        linear_triton(x, w, b, y)
        return y

    methods = {"triton": triton_run}
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9:
        from blockattn_layers.kernels.sm90 import linear as ws

        if not ws.linear_ws_reasons(x, w):
            options = [(f"gluon {block_n} columns{'' if chunked else ', whole tiles'}", block_n, dict(CHUNKED=chunked))
                       for block_n, chunked in itertools.product((128, 256), (True, False))]
            options += [("gluon 256 columns, no ping-pong", 256, dict(CHUNKED=True, PINGPONG=False)),
                        ("gluon 256 columns, bias per tile", 256, dict(CHUNKED=True, BIAS_ONCE=False)),
                        ("gluon 256 columns, neither", 256, dict(CHUNKED=True, PINGPONG=False, BIAS_ONCE=False)),
                        ("gluon 256 columns, thread release", 256, dict(CHUNKED=True, THREAD_RELEASE=True))]
            for name, block_n, values in options:
                def run(block_n=block_n, values=values):
                    y = output()
                    with module_attrs(ws, **values):
                        ws.linear_ws(x, w, b, y, block_n)
                    return y
                methods[name] = run
            shape = prod()[0]
            if total == shape.total and (in_dim, out_dim) == (256, 768):
                positions = sequence_positions(shape.offsets.to(device), total).float()
                for dim in (128, 64):  # prod's D128 H2 and D64 H4: q and k rotated (unchecked: want is unrotated)
                    rotary = ws.PairRotary(positions, 10000.0, dim, dim, 512)
                    methods[f"gluon 256 columns, rotary D{dim}"] = (
                        lambda rotary=rotary: ws.linear_ws(x, w, b, output(), rotary=rotary))
    methods["cublas bf16"] = lambda: torch.nn.functional.linear(x, w, b.to(torch.bfloat16))
    rows = []
    for name, run in methods.items():
        err = float("nan") if "rotary" in name else float((run()[check].float() - want).norm() / want.norm())
        ms = triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")
        floor = 1e3 * total * (in_dim * 2 + out_dim * (2 if name.startswith("cublas") else 1)) / bandwidth
        rows.append(dict(shape=f"prod e{in_dim} n{out_dim}", method=f"projection, {name}", ms=ms, floor_ms=floor,
                         x_floor=ms / floor, err=err, commit=commit))
        print(f"projection {name:22} {ms:8.3f} ms  {ms / floor:5.2f}x floor  err {err:.2e}", flush=True)
    return rows


def _descaled_copies(q8, k8, v8, offsets, block_size, factors, kw):
    """The fp8 call without the kernel: descaled bfloat16 copies through the 16-bit kernels."""
    def run():
        deq = [fp8.dequantize(x, factors[f"{n}_descale"], offsets, 1, torch.bfloat16)
               for n, x in zip("qkv", (q8, k8, v8))]
        return bl.block_attention(*deq, offsets, block_size, **kw)

    return run


if __name__ == "__main__":
    raise SystemExit(main())
