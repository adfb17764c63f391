"""``torchrun --nproc_per_node=N -m blockattn_layers demo --distributed``: the click model under DMP.

The demo's click model (``EmbeddingCollection`` of the id features -> ``JaggedTransformerEncoder``
-> mean pooling -> MLP -> BCE) wrapped in torchrec's ``DistributedModelParallel`` with a
sharding plan (``--sharding``) and trained with ``TrainPipelineSparseDist``, which overlaps the
next batch's id all-to-all with this batch's forward and backward. Every rank draws its own
users. Rank 0 prints the plan, a progress bar, the loss (the mean over ranks), the speed and a
held-out AUC; ``--checkpoint DIR`` saves the state at the end, ``--resume DIR`` starts from one.

GPUs with NCCL when CUDA is available, else the CPU with gloo (``--device`` overrides). The
model trains in fp32 (the config's ``train.amp`` applies to the single-process demo only).
"""
from __future__ import annotations

import argparse
import gc
import logging
import time
import warnings
from typing import List, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from .demo_config import DemoConfig, load_demo_config
from .demo_data import FEATURES, SyntheticClicks
from .demo_model import build_click_model
from .demo_train import roc_auc
from .dmp_checkpoint import load_checkpoint, save_checkpoint
from .dmp_setup import (
    ClickTraining, ShardedTraining, SparseClickBatch, click_batches, describe_plan, init_distributed, shard,
)

_LOSS_WINDOW = 10


def _build(config: DemoConfig, device: torch.device, sharding: str) -> ShardedTraining:
    layer = config.encoder.layer
    torch.manual_seed(config.data.seed)  # the same initial weights on every rank
    model = build_click_model(
        FEATURES, (config.data.num_items, config.data.num_categories), config.encoder.build(), layer.d_model,
        config.train.mlp_hidden,
    )
    return shard(ClickTraining(model), sharding, device, config.train.lr, config.train.sparse_lr)


def _train(sharded: ShardedTraining, data: SyntheticClicks, config: DemoConfig, device: torch.device,
           start: int, rank: int) -> Tuple[torch.Tensor, int, float]:
    """``config.train.steps`` steps from step ``start``; returns this rank's losses, and the tokens and
    seconds of every step after the first (which also traces the model and fills the pipeline)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    pipeline = TrainPipelineSparseDist(sharded.model, sharded.optimizer, device)
    steps = config.train.steps
    drawn: List[int] = []  # tokens of each batch drawn; the pipeline draws up to two batches ahead

    def batches():
        for batch in click_batches(data, config.data.batch_size, config.data.seed, rank, start, start + steps):
            drawn.append(batch.num_tokens)
            yield batch

    source = batches()
    losses: List[torch.Tensor] = []
    bar = tqdm(total=steps, desc=f"train (rank 0 of {dist.get_world_size()})", unit="step", dynamic_ncols=True,
               disable=rank != 0)
    begin = time.perf_counter()
    for i in range(steps):
        loss, _, _ = pipeline.progress(source)
        losses.append(loss)
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)  # float() also waits for the device
        bar.update()
        if i == 0:
            begin = time.perf_counter()
    seconds = time.perf_counter() - begin
    bar.close()
    pipeline.detach()
    return torch.stack(losses), sum(drawn[1:steps]), seconds


@torch.no_grad()
def _evaluate(sharded: ShardedTraining, data: SyntheticClicks, config: DemoConfig, device: torch.device,
              rank: int, world: int) -> dict:
    """Held-out loss and AUC over ``eval_users`` users split evenly across the ranks."""
    model = sharded.model
    model.eval()
    per_rank = max(1, config.data.eval_users // world)
    gen = torch.Generator(data.device).manual_seed(config.data.seed + 2 + rank)
    logits, labels, truth = [], [], []
    for start in range(0, per_rank, config.data.batch_size):
        batch = data.batch(min(config.data.batch_size, per_rank - start), gen)
        sparse = SparseClickBatch(batch.to_kjt(), batch.labels, batch.num_tokens).to(device)
        logits.append(model(sparse)[1][1].float())
        labels.append(sparse.labels)
        truth.append(batch.click_prob.to(device))
    model.train()
    local = torch.stack([torch.cat(logits), torch.cat(labels), torch.cat(truth)])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    scores, targets, best = torch.cat(gathered, 1).cpu()
    return {
        "loss": float(torch.nn.functional.binary_cross_entropy_with_logits(scores, targets)),
        "auc": roc_auc(scores, targets), "best_auc": roc_auc(best, targets), "users": targets.numel(),
    }


def _header(config: DemoConfig, device: torch.device, sharded: ShardedTraining, sharding: str) -> None:
    data_cfg, layer = config.data, config.encoder.layer
    world = dist.get_world_size()
    print("blockattn_layers demo --distributed: the click model under torchrec DistributedModelParallel")
    print(f"  {world} ranks, {dist.get_backend()} on {device.type} | torch {torch.__version__} | "
          f"{config.train.steps} steps of {data_cfg.batch_size} users per rank | histories of 1-"
          f"{data_cfg.max_history} events")
    print(f"  features {', '.join(FEATURES)}: KeyedJaggedTensor -> sharded EmbeddingCollection -> "
          f"{config.encoder.num_layers} x JaggedTransformerEncoderLayer(d_model={layer.d_model}, "
          f"block_size={layer.block_size}) -> mean pooling -> MLP -> BCE")
    print(f"  sharding {sharding!r}; TrainPipelineSparseDist; fp32; tables: Adagrad fused into the backward, "
          "dense: Adam (DDP)")
    for line in describe_plan(sharded.plan):
        print(f"    {line}")


def _run_rank(args: argparse.Namespace, device: torch.device, config: DemoConfig) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = _build(config, device, args.sharding)
    start = load_checkpoint(args.resume, sharded) if args.resume else 0
    if rank == 0:
        _header(config, device, sharded, args.sharding)
        if args.resume:
            print(f"  resumed from {args.resume} after step {start}")
    data = SyntheticClicks(config.data, torch.device("cpu"))  # the pipeline copies each batch to the device
    losses, tokens, seconds = _train(sharded, data, config, device, start, rank)
    dist.all_reduce(losses)
    losses /= world
    stats = torch.tensor([float(tokens), seconds], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    held_out = _evaluate(sharded, data, config, device, rank, world)
    end = start + config.train.steps
    if args.checkpoint:
        save_checkpoint(args.checkpoint, sharded, end)
    if rank != 0:
        return
    steps = losses.numel()
    window = max(1, min(_LOSS_WINDOW, steps // 2))
    first, last = float(losses[:window].mean()), float(losses[-window:].mean())
    print(f"loss (mean over ranks): {first:.4f} (first {window} steps) -> {last:.4f} (last {window} steps): "
          f"{'falling' if last < first else 'not falling'}")
    print(f"held-out AUC: {held_out['auc']:.3f} over {held_out['users']} users, loss {held_out['loss']:.4f} "
          f"(the true click probabilities reach AUC {held_out['best_auc']:.3f})")
    step_seconds = float(stats[1]) / world / max(1, steps - 1)  # mean over ranks of the timed steps
    rate = float(stats[0]) / (float(stats[1]) / world) if steps > 1 else float("nan")
    print(f"throughput: {rate:,.0f} tokens/s over {world} ranks ({1e3 * step_seconds:.1f} ms per training step)")
    if args.checkpoint:
        print(f"checkpoint: {args.checkpoint} (after step {end}); continue with --resume {args.checkpoint}")


def run(args: argparse.Namespace) -> int:
    """The distributed demo on this rank; returns the exit status."""
    # Notices from torch.fx (is_fx_tracing, which torchrec calls) and torchrec's deprecations and
    # planner advice (how to build a Topology, its memory estimates): none is about this demo.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    begin = time.perf_counter()
    try:
        device = init_distributed(args.device)
        config = load_demo_config(
            args.config, cuda=device.type == "cuda", steps=args.steps, backend=args.backend,
            batch_size=args.batch_size, seed=args.seed, cpu_threads=args.threads,
        )
    except (OSError, RuntimeError, TypeError, ValueError) as err:
        raise SystemExit(f"demo: {err}")
    if device.type == "cpu" and config.train.cpu_threads:
        torch.set_num_threads(config.train.cpu_threads)
    rank = dist.get_rank()
    try:
        _run_rank(args, device, config)
    finally:
        # The DDP inside DMP must be gone before its process group: destroying the group while a
        # DDP reducer still holds it makes the process abort at exit now and then ("terminate
        # called without an active exception", torch 2.13 with gloo).
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        print(f"done in {time.perf_counter() - begin:.1f} s")
    return 0
