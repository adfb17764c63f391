"""Fill the on-disk compile caches for a list of cases from several processes at once.

A cold grid run compiles a new specialization of our Triton kernels at every point (head dim,
block, causal, group size and rotary form are constexprs) and a torch.compile graph per rotary
baseline key, one after another in the timing process. ``--precompile N`` first runs, in ``N``
spawned processes, one forward and one backward of every compiling method (ours and the compiled
rotary baselines) on each case's own inputs, so that the same specializations land in Triton's
and Inductor's on-disk caches; the timing process then loads them. Nothing here is timed or
checked: the benchmark's run that follows does both.

Cases go to the workers as contiguous chunks in the grid's order (head shape, then D vary
slowest), so only one or two workers hold the largest inputs at a time.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import List, Sequence, Tuple

import torch
import torch._functorch.config

from .common import Case, Method, RunConfig, make_inputs


def compiling(method: Method) -> bool:
    """Methods whose first call compiles: ours and the baselines run under torch.compile (the
    compiled rotary ones, FlexAttention)."""
    return method.kind == "ours" or "comp" in method.name or method.name.startswith("flex")


def chunks(n_items: int, workers: int) -> List[range]:
    """``workers`` contiguous, nearly equal index ranges covering ``range(n_items)`` (none empty)."""
    workers = max(1, min(workers, n_items))
    bounds = [round(i * n_items / workers) for i in range(workers + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _warm(args: Tuple[Sequence[Tuple[Case, Sequence[str]]], RunConfig, int]) -> List[str]:
    work, cfg, seed = args
    from . import cli

    by_name = {m.name: m for m in cli.all_methods()}
    problems = []
    with torch._functorch.config.patch(donated_buffer=False):
        for case, names in work:
            torch._dynamo.reset()
            inp = make_inputs(case, cfg.device, cfg.dtype, seed)
            for method in (by_name[n] for n in names):
                if not method.applies(case) or method.skip(case, cfg):
                    continue
                try:
                    with method.context():
                        prepared = method.setup(case, inp, cfg)
                        out = prepared.forward()
                        torch.autograd.grad(out, prepared.leaves, prepared.grad_out)
                except Exception as err:  # reported, and met again by the timed run
                    problems.append(f"{case.name} {method.name}: {type(err).__name__}: {str(err)[:120]}")
            del inp
            if cfg.device.type == "cuda":
                torch.cuda.synchronize(cfg.device)
                torch.cuda.empty_cache()
    return problems


def precompile(cases: Sequence[Case], methods: Sequence[Method], grid_methods: Sequence[Method], cfg: RunConfig,
               workers: int, seed: int = 0) -> Tuple[float, List[str]]:
    """Run every compiling method once (forward and backward) on every case in ``workers``
    processes: of ``grid_methods`` on grid points, of ``methods`` elsewhere. Returns the wall time
    and the failures met (case, method, error)."""
    plain = [m.name for m in methods if compiling(m)]
    on_grid = [m.name for m in grid_methods if compiling(m)]
    work = [(c, on_grid if c.coords is not None else plain) for c in cases]
    work = [w for w in work if w[1]]
    start = time.perf_counter()
    if not work:
        return 0.0, []
    parts = [([work[i] for i in r], cfg, seed) for r in chunks(len(work), workers)]
    ctx = torch.multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(parts), mp_context=ctx) as pool:
        results = list(pool.map(_warm, parts))
    return time.perf_counter() - start, [p for r in results for p in r]
