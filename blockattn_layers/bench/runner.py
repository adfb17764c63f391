"""Check every method against the reference, then time fwd / bwd / fwd+bwd and measure peak memory.

Timing: ``triton.testing.do_bench(..., return_mode="median")`` on CUDA (it flushes L2 before
every call; small shapes also rotate between input sets), a host-clock median on CPU.

* ``fwd``: the training forward (inputs require grad, so each method saves what its backward needs).
* ``bwd``: the backward alone, as ``torch.autograd.grad(out, leaves, grad_out, retain_graph=True)`` on
  a graph built once before timing. Going through autograd rather than calling each backward
  kernel directly times every method the same way, including what its layout costs in backward
  (transposes, gathers' index_add, rotary's backward); the autograd engine adds a few microseconds.
* ``fwd+bwd``: a fresh forward and its backward per call.

Cases with ``rounds > 1`` (the small shape's eager calls: host-bound, and the host's speed drifts
by tens of percent over a run) set every method up and check it first, then time all of them in
``rounds`` rounds, the methods interleaved, and report each mode's median over the rounds (every
round's time is kept in ``<mode>_rounds``). Each round starts one method later than the one before:
in the all-shapes run of d9029ae the first method of every round ('triton') was host-bound in 5 of 9
rounds, the second ('triton[simple]', much the same host path) in 1.

Cases marked ``graphed`` (the small shape's second case) time the same calls captured in CUDA
graphs, one per input set, and replayed in turn: GPU time without the host's launch costs, for
every method alike. A method whose calls cannot be captured gets the error in that mode.

Peak memory is ``torch.cuda.max_memory_allocated()`` during one call minus what was allocated
before it (for ``bwd`` the retained graph is already counted in the base).
"""
from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import blockattn_layers

from .common import Case, Inputs, Method, Prepared, RunConfig, make_inputs
from .layer import make_layer_inputs

MODES = ("fwd", "bwd", "fwd+bwd")
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 5e-3}
# Floor bytes in units of T * D elements per head: fwd reads q, k, v and writes o; bwd reads q, k, v, do
# and writes dq, dk, dv. q, o, do, dq have the query heads, k, v, dk, dv the k/v heads (GQA).
FLOOR_Q_TENSORS = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}
FLOOR_KV_TENSORS = {"fwd": 2, "bwd": 4, "fwd+bwd": 6}
FLOOR_TENSORS = {m: FLOOR_Q_TENSORS[m] + FLOOR_KV_TENSORS[m] for m in FLOOR_Q_TENSORS}  # H == H_kv
# Matmul FLOP per (query, key) pair inside a unit, per head and channel: fwd 2 dots, bwd 5.
FLOP_PER_PAIR = {"fwd": 4.0, "bwd": 10.0, "fwd+bwd": 14.0}
_MAX_SETS = 8


@dataclass(frozen=True)
class Timing:
    """do_bench warm-up and repetition time (ms) on CUDA; repetitions on CPU."""

    warmup_ms: int = 25
    rep_ms: int = 150
    cpu_reps: int = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ms(fn: Callable[[], object], device: torch.device, timing: Timing) -> float:
    """Median milliseconds of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(timing.cpu_reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def peak_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Extra device memory (MiB) at the peak of one call of ``fn``; None off CUDA."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``max|x - ref| / max|ref|``; inf for NaN/inf or a shape mismatch."""
    if x.shape != ref.shape:
        return math.inf
    err = float((x.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0
    return err if math.isfinite(err) else math.inf


def mode_fn(sets: Sequence[Prepared], mode: str) -> Callable[[], object]:
    """The callable timed for ``mode``, cycling through the prepared input sets."""
    turn = itertools.cycle(range(len(sets)))
    if mode == "fwd":
        return lambda: sets[next(turn)].forward()
    if mode == "fwd+bwd":
        def step():
            p = sets[next(turn)]
            return torch.autograd.grad(p.forward(), p.leaves, p.grad_out)
        return step
    outs = [p.forward() for p in sets]

    def backward():
        i = next(turn)
        return torch.autograd.grad(outs[i], sets[i].leaves, sets[i].grad_out, retain_graph=True)
    return backward


def graphed_fn(sets: Sequence[Prepared], mode: str, device: torch.device) -> Callable[[], object]:
    """``mode_fn``'s call on each input set captured in a CUDA graph (after a warm-up on the
    capture stream, where the bwd mode also builds its retained autograd graphs, so that the
    backward runs on the stream being captured); the callable replays them in turn."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graphs = []
    with torch.cuda.stream(stream):
        calls = [mode_fn([p], mode) for p in sets]
        for call in calls:
            for _ in range(3):
                call()
        stream.synchronize()
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                call()
            graphs.append(graph)
    torch.cuda.current_stream(device).wait_stream(stream)
    turn = itertools.cycle(graphs)
    return lambda: next(turn).replay()


def n_input_sets(case: Case, cfg: RunConfig) -> int:
    """Enough input sets to cycle through three times the L2 cache (1 for large shapes)."""
    if cfg.device.type != "cuda" or case.layer is not None:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(cfg.device), "L2_cache_size", 50 << 20)
    per_set = 8 * case.total * case.num_heads * case.head_dim * torch.finfo(cfg.dtype).bits // 8
    return max(1, min(_MAX_SETS, math.ceil(3 * l2 / max(per_set, 1))))


def attention_oracle(case: Case, inp: Inputs) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """The reference backend on float32 copies: output and ``(dq, dk, dv)``."""
    q, k, v = (x.detach().float().requires_grad_() for x in (inp.q, inp.k, inp.v))
    out = blockattn_layers.block_attention(
        q, k, v, inp.offsets, case.block_size, rope_theta=case.rope_theta, cpu_offsets=inp.cpu_offsets,
        max_seqlen=case.max_seqlen, backend="reference", causal=case.causal, rotary_dim=case.rotary_dim,
        rotary_interleaved=case.rotary_interleaved,
    )
    grads = torch.autograd.grad(out, (q, k, v), inp.grad_out.float())
    return out.detach(), grads


def _rotated(count: int, start: int) -> List[int]:
    """``range(count)`` starting at ``start % count``, wrapping around."""
    first = start % count if count else 0
    return [*range(first, count), *range(first)]


def _short(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}".strip()
    return text[:400]


def _free(device: torch.device, collect: bool = True) -> None:
    """Return a finished method's device memory (so the next one's peak is its own); ``collect``
    runs the garbage collector first (about 0.1 s with torch imported)."""
    if device.type == "cuda":
        if collect:
            gc.collect()
        torch.cuda.empty_cache()


class CaseRunner:
    """Runs the methods of one case on shared input sets, computing the oracle once."""

    def __init__(self, case: Case, cfg: RunConfig, timing: Timing, modes: Sequence[str], seed: int):
        self.case, self.cfg, self.timing, self.modes, self.seed = case, cfg, timing, modes, seed
        self._sets: Optional[List[object]] = None
        self._oracle: Optional[Tuple[Tensor, Sequence[Tensor]]] = None

    def sets(self) -> List[object]:
        if self._sets is None:
            build = make_layer_inputs if self.case.layer is not None else make_inputs
            n = n_input_sets(self.case, self.cfg)
            self._sets = [build(self.case, self.cfg.device, self.cfg.dtype, self.seed + i) for i in range(n)]
        return self._sets

    def oracle(self, prepared: Prepared):
        if prepared.oracle is not None:
            return prepared.oracle()
        if self._oracle is None:
            self._oracle = attention_oracle(self.case, self.sets()[0])
        return self._oracle

    def row(self, method: Method) -> Dict[str, object]:
        """Set up, check and time one method (then free what it holds)."""
        row, prepared = self.prepare(method)
        try:
            if prepared is not None:
                with method.context():
                    for mode in self.modes:
                        row.update(self._time(prepared, mode))
        except Exception as err:
            row.update(status="failed", reason=_short(err))
        finally:
            prepared = None
            _free(self.cfg.device)
        return row

    def rows_in_rounds(self, methods: Sequence[Method]) -> List[Dict[str, object]]:
        """Set up and check every method, then time them all in ``case.rounds`` interleaved rounds."""
        rows, live = [], []
        for method in methods:
            row, prepared = self.prepare(method)
            rows.append(row)
            if prepared is not None:
                live.append((method, row, prepared))
        times: Dict[Tuple[int, str], List[float]] = {}
        for r in range(self.case.rounds):
            # Each round starts one method later, so that no method is always timed first.
            for i in _rotated(len(live), r):
                method, row, prepared = live[i]
                try:
                    with method.context():
                        for mode in self.modes:
                            result = self._time(prepared, mode)
                            ms = result.pop(f"{mode}_ms", None)
                            row.update(result)
                            if ms is not None:
                                times.setdefault((i, mode), []).append(ms)
                except Exception as err:
                    row.update(status="failed", reason=_short(err))
        for i, (method, row, prepared) in enumerate(live):
            for mode in self.modes:
                got = times.get((i, mode))
                if got and not row.get(f"{mode}_error") and row["status"] != "failed":
                    row[f"{mode}_ms"] = statistics.median(got)
                    row[f"{mode}_rounds"] = " ".join(f"{ms:.4g}" for ms in got)
        live = None
        _free(self.cfg.device)
        return rows

    def prepare(self, method: Method) -> Tuple[Dict[str, object], Optional[List[Prepared]]]:
        """The method's row after its checks, and its prepared input sets (None: nothing to time)."""
        case, cfg = self.case, self.cfg
        row: Dict[str, object] = dict(
            case=case.name, shape=case.shape, method=method.name, kind=method.kind, status="", reason="",
            err=None, tol=TOLERANCE.get(cfg.dtype), description=method.description,
        )
        if method.gpu_only and cfg.device.type != "cuda":
            return dict(row, status="skipped", reason="GPU-only baseline (no CUDA device)"), None
        if case.graphed and cfg.device.type != "cuda":
            return dict(row, status="skipped", reason="CUDA-graph timing needs a CUDA device"), None
        try:
            reason = method.skip(case, cfg)
        except Exception as err:  # a broken capability check is a failure of that row only
            return dict(row, status="failed", reason=_short(err)), None
        if reason:
            return dict(row, status="skipped", reason=reason), None
        try:
            with method.context():
                prepared = [method.setup(case, inp, cfg) for inp in self.sets()]
                row.update(self._check(prepared[0]))
            return row, prepared
        except Exception as err:
            row.update(status="failed", reason=_short(err))
            _free(cfg.device)
            return row, None

    def _check(self, p: Prepared) -> Dict[str, object]:
        out = p.forward()
        grads = torch.autograd.grad(out, p.leaves, p.grad_out)
        ref_out, ref_grads = self.oracle(p)
        got = [p.to_packed(out)] + list(p.grads_to_packed(grads))[:len(ref_grads)]
        err = max(rel_err(x, r) for x, r in zip(got, [ref_out, *ref_grads]))
        tol = TOLERANCE.get(self.cfg.dtype, 5e-3)
        if not p.checked:
            return dict(err=err, status="unchecked", reason=p.note)
        if err > tol:
            return dict(err=err, status="FAILED", reason=f"max rel error {err:.3g} > {tol:g}")
        return dict(err=err, status="ok", reason=p.note)

    def _time(self, prepared: List[Prepared], mode: str) -> Dict[str, object]:
        try:
            if self.case.graphed:
                fn = graphed_fn(prepared, mode, self.cfg.device)
                peak = None
            else:
                fn = mode_fn(prepared, mode)
                peak = peak_mib(fn, self.cfg.device)
            return {f"{mode}_ms": measure_ms(fn, self.cfg.device, self.timing), f"{mode}_peak_mib": peak}
        except Exception as err:
            return {f"{mode}_error": _short(err)}
        finally:
            fn = None
            # Grid points (hundreds of cases) skip the collection between modes: what a mode holds
            # is freed by reference counting; the row's own free still collects.
            _free(self.cfg.device, collect=self.case.coords is None)


def run_case(case: Case, methods: Sequence[Method], cfg: RunConfig, timing: Timing,
             modes: Sequence[str] = MODES, seed: int = 0, progress: bool = False,
             reset_compiled: bool = True) -> List[Dict[str, object]]:
    """One row per method that applies to ``case`` (compiled graphs are reset first unless
    ``reset_compiled`` is False: consecutive grid points of one ``compile_key`` share them)."""
    if reset_compiled:
        torch._dynamo.reset()
    runner = CaseRunner(case, cfg, timing, modes, seed)
    rows = []
    # The bwd mode replays a retained graph, which compiled backwards with donated buffers refuse.
    with torch._functorch.config.patch(donated_buffer=False):
        applicable = [m for m in methods if m.applies(case)]
        if case.rounds > 1:
            start = time.perf_counter()
            rows = runner.rows_in_rounds(applicable)
            if progress:
                print(f"  {case.name}: {len(rows)} methods, {case.rounds} rounds "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
        else:
            for method in applicable:
                start = time.perf_counter()
                rows.append(runner.row(method))
                if progress:
                    status = f"{rows[-1]['status']} {rows[-1]['reason']}"[:100]
                    print(f"  {case.name} {method.name}: {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    runner = None
    _free(cfg.device)
    return rows


def case_summary(case: Case, dtype: torch.dtype, bandwidth: float) -> Dict[str, object]:
    """Sizes, floors (ms at ``bandwidth`` bytes/s) and in-unit FLOP of a case; no floors for layers."""
    summary: Dict[str, object] = dict(
        case=case.name, shape=case.shape, describe=case.describe(), B=case.batch, T=case.total,
        max_len=case.max_seqlen, H=case.num_heads, H_kv=case.kv_heads, D=case.head_dim, block=case.block_size,
        causal=case.causal, rotary=case.rotary_form, rotary_dim=case.rotary_dim if case.rope_theta else None,
        rope_theta=case.rope_theta, dtype=str(dtype).replace("torch.", ""),
    )
    if case.coords is not None:
        summary["grid"] = dict(case.coords)
    if case.layer is None:
        for mode in MODES:
            summary[f"{mode}_floor_ms"] = 1e3 * floor_bytes(case, dtype, mode) / bandwidth
            summary[f"{mode}_flop"] = FLOP_PER_PAIR[mode] * attention_pairs(case) * case.num_heads * case.head_dim
    return summary


def floor_bytes(case: Case, dtype: torch.dtype, mode: str) -> int:
    """Bytes a mode must move at least: q-sized tensors at the query heads, k/v-sized ones at the
    k/v heads (PERFORMANCE.md's floor, GQA counted)."""
    per_head = case.total * case.head_dim * torch.finfo(dtype).bits // 8
    return per_head * (FLOOR_Q_TENSORS[mode] * case.num_heads + FLOOR_KV_TENSORS[mode] * case.kv_heads)


def attention_pairs(case: Case) -> float:
    """(query, key) pairs inside the units: ``sum(n^2)``, or ``sum(n (n + 1) / 2)`` when causal."""
    n = case.unit_bounds().diff().double()
    return float((n * (n + 1) / 2).sum()) if case.causal else float((n ** 2).sum())


def finalize(rows: List[Dict[str, object]], summaries: Dict[str, Dict[str, object]]) -> None:
    """Add ``x_floor``, TFLOP/s and speedup vs the best checked baseline to every timed row."""
    for mode in MODES:
        best: Dict[str, float] = {}
        for r in rows:
            ms = r.get(f"{mode}_ms")
            if r["kind"] == "baseline" and r["status"] == "ok" and ms:
                best[r["case"]] = min(best.get(r["case"], math.inf), ms)
        for r in rows:
            ms = r.get(f"{mode}_ms")
            if not ms:
                continue
            s = summaries[r["case"]]
            if s.get(f"{mode}_floor_ms"):
                r[f"{mode}_x_floor"] = ms / s[f"{mode}_floor_ms"]
                r[f"{mode}_tflops"] = s[f"{mode}_flop"] / (ms * 1e-3) / 1e12
            if r["case"] in best:
                r[f"{mode}_speedup"] = best[r["case"]] / ms
