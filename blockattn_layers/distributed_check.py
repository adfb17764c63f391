"""Multi-process check: the jagged encoder trained under DistributedDataParallel, one device per rank.

Run with one process per GPU (NCCL, Triton kernels)::

    torchrun --standalone --nproc_per_node=2 -m blockattn_layers.distributed_check \\
        --backend-dist nccl --attn-backend triton --dtype fp32

Without CUDA every rank runs on the CPU with gloo (``--attn-backend auto`` then picks the
reference backend). ``NCCL_NVLS_ENABLE`` is forced to ``0`` before the process group starts:
NVLink multicast (NVLS) must stay off on the shared multi-GPU hosts.

Every rank builds the same seeded :class:`JaggedTransformerEncoder` (rotary, block 64) on its
own device (``cuda:{LOCAL_RANK}``), wraps it in ``DistributedDataParallel`` and trains a few
AdamW steps on its own seeded jagged batches (zero-length sequences included). The run fails
(non-zero exit) unless

- every parameter, gradient, input and output, and every attention call's inputs and outputs,
  are on the rank's device; each attention forward and backward ran with that device current;
  no other GPU holds memory allocated by the process (no hidden ``cuda:0``); on CUDA, the last
  step runs under ``torch.profiler``: every GPU kernel it records ran on the rank's device, and
  the attention kernels of the variant that ran (``ATTENTION_KERNELS``) are among them;
- on CUDA, the attention ops (forward and backward, nothing else) run under
  ``torch.cuda.set_sync_debug_mode("error")`` without raising: no device-to-host sync inside them
  (no ``cpu_offsets`` are passed). That mode sees syncs made through PyTorch only;
- the all-reduced step-0 gradients of every rank equal those of one model on rank 0 over the
  concatenation of all ranks' batches (the loss is a sum over tokens divided by the global
  token count, times the world size, so DDP's averaging gives the single-process gradient);
- the parameters are identical on all ranks after the last step.

Rank 0 prints one report line per rank and a final ``PASS`` or ``FAIL`` line.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import os
import sys
import traceback
from collections import Counter
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .dispatch import register_backend, registered_backends
from .modules import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

D_MODEL, HEADS, FEEDFORWARD, LAYERS, BLOCK = 128, 2, 256, 2, 64
GRAD_RTOL = {"fp32": 1e-5, "bf16": 2e-2}


class AttentionProbe:
    """While active, wraps every registered backend's implementations to watch the attention calls.

    Each forward and backward call (the prepared backward launch of ``forward_prepared`` and the
    ``forward_on_rotated`` / ``backward_on_rotated`` pair too)
    checks its tensors' devices and the current CUDA device, and runs under sync-debug
    ``"error"`` on CUDA. ``calls`` counts ``(direction, backend)`` pairs, ``dtypes`` holds the q
    dtypes seen and ``problems`` lists violations.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: Counter = Counter()
        self.dtypes: set = set()
        self.problems: List[str] = []
        self._saved: list = []
        self._idle_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0

    def __enter__(self) -> "AttentionProbe":
        self._saved = registered_backends()
        for spec in self._saved:
            prepared = None if spec.forward_prepared is None else self._wrap_prepared(spec)
            on_rotated = {}
            if spec.forward_on_rotated is not None:
                on_rotated = dict(forward_on_rotated=self._wrap(spec.name, "forward", spec.forward_on_rotated),
                                  backward_on_rotated=self._wrap(spec.name, "backward", spec.backward_on_rotated))
            register_backend(dataclasses.replace(
                spec, forward=self._wrap(spec.name, "forward", spec.forward),
                backward=self._wrap(spec.name, "backward", spec.backward), forward_prepared=prepared, **on_rotated))
        return self

    def __exit__(self, *exc) -> None:
        for spec in self._saved:
            register_backend(spec)

    def _sync_debug(self, on: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error" if on else self._idle_mode)

    def _check(self, what: str, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        devices = {str(t.device) for t in tensors if isinstance(t, torch.Tensor)}
        if devices - {str(self.device)}:
            self.problems.append(f"{what} on {sorted(devices)}, expected {self.device}")
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            self.problems.append(f"{what} ran with cuda:{torch.cuda.current_device()} current")

    def totals(self) -> Dict[str, int]:
        """Calls per direction (``"forward"``, ``"backward"``) over all backends."""
        totals: Dict[str, int] = {}
        for (direction, _), n in self.calls.items():
            totals[direction] = totals.get(direction, 0) + n
        return totals

    def _watched(self, name: str, direction: str, call, inputs: Sequence, args: tuple):
        """``call(*args)`` under sync-debug, its inputs and outputs checked and counted."""
        self._check(f"{name} {direction} inputs", inputs)
        self._sync_debug(True)
        try:
            result = call(*args)
        finally:
            self._sync_debug(False)
        self.calls[direction, name] += 1
        return result

    def _wrap(self, name: str, direction: str, impl):
        def run(*args):
            result = self._watched(name, direction, impl, [a for a in args if isinstance(a, torch.Tensor)], args)
            if result is None:  # a forward_on_rotated that does not take the call: the ordinary forward runs
                self.calls[direction, name] -= 1
                return None
            if direction == "forward":
                self.dtypes.add(str(args[0].dtype).replace("torch.", ""))
            self._check(f"{name} {direction} output", [r for r in result if isinstance(r, torch.Tensor)])
            return result

        return run

    def _wrap_prepared(self, spec):
        probe, forward = self, self._wrap(spec.name, "forward", lambda *args: spec.forward_prepared(*args))

        class Prepared:
            def __init__(self, prepared):
                self.prepared = prepared

            def launch(self, grad_out, q, k, v):
                grads = probe._watched(spec.name, "backward", self.prepared.launch, (grad_out, q, k, v),
                                       (grad_out, q, k, v))
                if grads is None:
                    probe.calls["backward", spec.name] -= 1  # the ordinary backward runs and counts
                else:
                    probe._check(f"{spec.name} backward output", grads)
                return grads

        def run(*args):
            out, prepared = forward(*args)
            return out, None if prepared is None else Prepared(prepared)

        return run


def _sync_debug_armed(device: torch.device) -> bool:
    """True when sync-debug ``"error"`` does raise on a sync here (so a clean run means something)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ones(1, device=device).item()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return False


def _build_encoder(attn_backend: str, device: torch.device, seed: int) -> JaggedTransformerEncoder:
    torch.manual_seed(seed)
    layer = JaggedTransformerEncoderLayer(
        D_MODEL, HEADS, FEEDFORWARD, 0.0, block_size=BLOCK, norm_first=True, rope_theta=10000.0,
        backend=attn_backend, device=device,
    )
    return JaggedTransformerEncoder(layer, LAYERS, norm=torch.nn.LayerNorm(D_MODEL, device=device))


def _make_batch(seed: int, rank: int, step: int) -> Dict[str, torch.Tensor]:
    """A CPU batch of its own per (rank, step): 5 + rank sequences, one empty, up to 3 blocks long."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + step)
    lengths = torch.randint(1, 3 * BLOCK, (5 + rank,), generator=g)
    lengths[(rank + step) % lengths.numel()] = 0
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    tokens = int(offsets[-1])
    return {"x": torch.randn(tokens, D_MODEL, generator=g), "offsets": offsets,
            "target": torch.randn(tokens, D_MODEL, generator=g)}


def _concat(batches: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    offsets, end = [batches[0]["offsets"][:1]], 0
    for b in batches:
        offsets.append(b["offsets"][1:] + end)
        end += b["x"].shape[0]
    return {"x": torch.cat([b["x"] for b in batches]), "offsets": torch.cat(offsets),
            "target": torch.cat([b["target"] for b in batches])}


def _loss(model, batch, device: torch.device, dtype: str, tokens: int, scale: float):
    """``scale * sum((model(x) - target)^2) / tokens`` (bf16 autocast for ``dtype="bf16"``) and the tensors used."""
    x, offsets, target = (batch[k].to(device) for k in ("x", "offsets", "target"))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = model(x, offsets)
    return (out.float() - target).square().sum() * (scale / tokens), [x, offsets, target, out]


def _gather(obj) -> list:
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def _tokens(batches: List[Dict[str, torch.Tensor]]) -> int:
    return sum(b["x"].shape[0] for b in batches)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _other_gpu_allocations(device: torch.device) -> List[str]:
    if device.type != "cuda":
        return []
    peaks = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}
    return [f"{peak} B allocated on {name}" for name, peak in peaks.items() if name != str(device) and peak]


# Profiler names of the attention kernels of every variant: the Triton block kernels, the Gluon
# ones of sm_90 (hopper, hopper_ws) and the flash kernels (blocks over 128 rows).
ATTENTION_KERNELS = (
    "_block_fwd_kernel", "_block_fwd_lse_kernel", "_block_bwd_kernel", "_hopper_fwd_kernel",
    "_hopper_fwd_lse_kernel", "_hopper_bwd_kernel", "_hopper_ws_fwd_kernel", "_hopper_ws_bwd_kernel",
    "_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_flash_bwd_delta_kernel",
    "_flash_bwd_dq_store_kernel", "_flash_fwd_ws_kernel", "_flash_fwd_persistent_kernel",
    "_sm100_fwd_kernel", "_sm100_bwd_kernel",
)


class KernelDevices:
    """On CUDA, records the GPU kernels run inside the ``with`` block (``torch.profiler``) and
    counts them per device: ``attention`` for the Triton attention kernels, ``other`` for the rest."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counts: Counter = Counter()
        self._profiler = None

    def __enter__(self) -> "KernelDevices":
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        torch.cuda.synchronize(self.device)
        self._profiler.__exit__(*exc)
        for event in self._profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
                kind = "attention" if event.name.startswith(ATTENTION_KERNELS) else "other"
                self.counts[f"cuda:{event.device_index}", kind] += 1

    def problems(self) -> List[str]:
        if self.device.type != "cuda":
            return []
        found = [f"{n} {kind} kernel(s) on {where}"
                 for (where, kind), n in self.counts.items() if where != str(self.device)]
        if not self.counts[str(self.device), "attention"]:
            found.append(f"the profiler recorded no attention kernel on {self.device}")
        return found

    def summary(self) -> str:
        if self.device.type != "cuda":
            return "n/a on CPU"
        return ", ".join(f"{n} {kind} on {where}" for (where, kind), n in sorted(self.counts.items()))


def _train(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict:
    """Train ``model`` under DDP on this rank's batches; return this rank's report and step-0 data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    probe, kernels = AttentionProbe(device), KernelDevices(device)
    problems, losses, tokens, step0 = [], [], [], None
    for step in range(args.steps):
        batch = _make_batch(args.seed, rank, step)
        batches = _gather(batch)
        tokens.append(batch["x"].shape[0])
        optimizer.zero_grad(set_to_none=True)
        with kernels if step == args.steps - 1 else contextlib.nullcontext():
            with probe:
                loss, tensors = _loss(ddp, batch, device, args.dtype, _tokens(batches), float(world))
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for what, group in (("inputs/output", tensors), ("parameters", list(model.parameters())),
                            ("gradients", list(grads.values()))):
            if any(t.device != device for t in group):
                problems.append(f"step {step}: {what} not all on {device}")
        if step == 0:
            step0 = (batches, {n: g.detach().cpu() for n, g in grads.items()})
        optimizer.step()
        losses.append(loss.item() * _tokens(batches) / (world * tokens[-1] * D_MODEL))
    problems += probe.problems + kernels.problems() + _other_gpu_allocations(device)
    calls = probe.totals()
    if calls != {"forward": LAYERS * args.steps, "backward": LAYERS * args.steps}:
        problems.append(f"attention calls {dict(probe.calls)}, expected {LAYERS * args.steps} each way")
    expected_dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    if probe.dtypes != {expected_dtype}:
        problems.append(f"attention ran in {sorted(probe.dtypes)}, expected {expected_dtype}")
    sync = "n/a on CPU"
    if device.type == "cuda":
        sync = "error mode, no sync" if _sync_debug_armed(device) else "NOT ARMED"
        if sync == "NOT ARMED":
            problems.append("torch.cuda.set_sync_debug_mode('error') did not raise on .item()")
    current = f"cuda:{torch.cuda.current_device()}" if device.type == "cuda" else "cpu"
    backends = sorted({name for _, name in probe.calls})
    line = (f"rank {rank} on {device} (current {current}): tokens/step {tokens}; attention calls {dict(calls)} "
            f"via {backends} in {sorted(probe.dtypes)}; sync-debug: {sync}; "
            f"last step's GPU kernels: {kernels.summary()}; "
            f"mean squared error/step {' '.join(f'{v:.4f}' for v in losses)}")
    params = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return {"line": line, "problems": problems, "batches": step0[0], "grads": step0[1], "params": params}


def _compare(args: argparse.Namespace, reference: torch.nn.Module, device: torch.device, reports: list) -> List[str]:
    """Rank 0: the report lines, ending in PASS or FAIL, from every rank's report and a one-process reference."""
    batches = reports[0]["batches"]
    loss, _ = _loss(reference, _concat(batches), device, args.dtype, _tokens(batches), 1.0)
    loss.backward()
    want = {n: p.grad.detach().cpu() for n, p in reference.named_parameters()}
    tol = GRAD_RTOL[args.dtype]
    errors = [max(_rel_err(r["grads"][n], g) for n, g in want.items()) for r in reports]
    same = all(torch.equal(r["params"], reports[0]["params"]) for r in reports)
    lines = [r["line"] for r in reports] + [
        f"step-0 gradients vs one process on all ranks' batches ({_tokens(batches)} tokens): worst "
        f"per-parameter relative error {', '.join(f'rank {r} {e:.2e}' for r, e in enumerate(errors))} "
        f"(tolerance {tol:.0e})",
        f"parameters identical on all ranks after {args.steps} steps: {'yes' if same else 'NO'}",
    ]
    failures = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep["problems"]]
    failures += [f"rank {r}: step-0 gradient error {e:.2e} > {tol:.0e}" for r, e in enumerate(errors) if not e <= tol]
    if not same:
        failures.append("parameters differ between ranks")
    return lines + [f"FAIL {f}" for f in failures] + ["FAIL" if failures else "PASS"]


def run_check(args: argparse.Namespace, device: torch.device) -> bool:
    """Train and check on this rank; rank 0 prints the report. Returns the verdict, the same on all ranks."""
    model = _build_encoder(args.attn_backend, device, args.seed)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    reports = _gather(_train(args, model, device))
    verdict = [None]
    if dist.get_rank() == 0:
        lines = _compare(args, reference, device, reports)
        print("\n".join(lines), flush=True)
        verdict = [lines[-1] == "PASS"]
    dist.broadcast_object_list(verdict, src=0)
    return bool(verdict[0])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend-dist", choices=["nccl", "gloo"], default=None,
                        help="process-group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--attn-backend", choices=["triton", "reference", "auto"], default="auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32, or bf16 autocast over float32 parameters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under ``torchrun``; returns the exit status (0 only when every check passed)."""
    args = parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if args.backend_dist == "nccl" and not cuda:
        raise SystemExit("--backend-dist nccl needs CUDA; use gloo on a CPU-only host")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend_dist or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        if dist.get_rank() == 0:
            print(f"distributed_check: world {dist.get_world_size()}, {backend}, attention backend "
                  f"{args.attn_backend}, {args.dtype}, {args.steps} steps, "
                  f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}, torch {torch.__version__}", flush=True)
        passed = run_check(args, device)
        # The DDP model of run_check sits in reference cycles: collect it (its reducer holds the
        # process group) while the group is alive, and leave together. Without both, gloo
        # aborted the process at exit now and then ("terminate called without an active exception").
        gc.collect()
        dist.barrier()
    except Exception:
        print(f"[rank {dist.get_rank()}] FAIL\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
