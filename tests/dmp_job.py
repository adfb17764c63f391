"""The multi-process job behind tests/test_dmp.py; torchrun starts it, one process per rank.

For every sharding kind (``--shardings``), on every rank:

1. A plain single-process click model (seeded alike on all ranks) gives the loss on this rank's
   first batch, and its weights.
2. A differently initialised copy is sharded with DMP and given those weights; its loss on the
   same batch (plain DMP forward, no pipeline) and then ``--steps`` steps with
   ``TrainPipelineSparseDist`` on batches cycling through ``--distinct`` per rank. After step
   ``--save-at`` the state is checkpointed (mid-pipeline); training goes on without stopping.
3. Another differently initialised sharded copy loads that checkpoint, gives its loss on the
   next batch (plain DMP forward), then trains the remaining steps with a fresh pipeline.

Each rank writes ``rank<r>.json`` under ``--out``: per kind, the plan, the modules the pipeline
pipelined, the losses of 1-3, and the largest difference of the dense parameters across ranks.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import warnings

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from blockattn_layers.cli.demo_config import load_demo_config
from blockattn_layers.cli.demo_data import FEATURES, SyntheticClicks
from blockattn_layers.cli.demo_model import build_click_model
from blockattn_layers.cli.dmp_checkpoint import load_checkpoint, load_full_state, save_checkpoint
from blockattn_layers.cli.dmp_setup import ClickTraining, click_batch, init_distributed, shard


def _training(config, device, seed):
    torch.manual_seed(seed)
    model = build_click_model(
        FEATURES, (config.data.num_items, config.data.num_categories), config.encoder.build(),
        config.encoder.layer.d_model, config.train.mlp_hidden,
    )
    return ClickTraining(model).to(device)


def _sharded(config, device, kind, seed):
    return shard(_training(config, device, seed), kind, device, config.train.lr, config.train.sparse_lr)


def _dense_max_diff(model) -> float:
    """Largest difference, across ranks, of the parameters DDP replicates."""
    dense = [p.detach().flatten() for name, p in model.named_parameters() if "embedding_collection" not in name]
    local = torch.cat(dense)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return max(float((g - local).abs().max()) for g in gathered)


def _run_kind(kind, config, args, device, rank, data):
    seed, bs = config.data.seed, config.data.batch_size

    def batch(step):
        return click_batch(data, bs, seed, rank, step % args.distinct).to(device)

    def batches(start, stop):
        return (batch(step) for step in range(start, stop))

    def forward_loss(model, step):
        with torch.no_grad():
            return float(model(batch(step))[0])

    plain = _training(config, device, seed)
    plain_loss = forward_loss(plain, 0)
    state = {key: value.detach().clone() for key, value in plain.state_dict().items()}

    first = _sharded(config, device, kind, seed + 1 + rank)
    load_full_state(first, state)
    dmp_forward_loss = forward_loss(first.model, 0)
    pipeline = TrainPipelineSparseDist(first.model, first.optimizer, device)
    source = batches(0, args.steps)
    losses = []
    for step in range(args.steps):
        losses.append(float(pipeline.progress(source)[0]))
        if step + 1 == args.save_at:
            save_checkpoint(os.path.join(args.out, f"ckpt_{kind}"), first, args.save_at)
    pipelined = [type(m).__name__ for m in pipeline._pipelined_modules]
    pipeline.detach()

    resumed = _sharded(config, device, kind, seed + 100 + rank)
    fresh_forward_loss = forward_loss(resumed.model, args.save_at)
    start = load_checkpoint(os.path.join(args.out, f"ckpt_{kind}"), resumed)
    resumed_forward_loss = forward_loss(resumed.model, start)
    pipeline = TrainPipelineSparseDist(resumed.model, resumed.optimizer, device)
    source = batches(start, args.steps)
    resumed_losses = [float(pipeline.progress(source)[0]) for _ in range(start, args.steps)]
    pipeline.detach()

    plan = {
        table: [sharding.sharding_type, sharding.compute_kernel, sharding.ranks]
        for module_plan in first.plan.plan.values() for table, sharding in module_plan.items()
    }
    return {
        "plan": plan, "pipelined": pipelined, "plain_loss": plain_loss, "dmp_forward_loss": dmp_forward_loss,
        "losses": losses, "dense_max_diff": _dense_max_diff(first.model), "resumed_from": start,
        "fresh_forward_loss": fresh_forward_loss, "resumed_forward_loss": resumed_forward_loss,
        "resumed_losses": resumed_losses, "resumed_dense_max_diff": _dense_max_diff(resumed.model),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shardings", default="table_wise,row_wise,column_wise,planner")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-at", type=int, default=12)
    p.add_argument("--distinct", type=int, default=4)
    args = p.parse_args()
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = init_distributed()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = load_demo_config(args.config)
    data = SyntheticClicks(config.data, torch.device("cpu"))
    results = {kind: _run_kind(kind, config, args, device, rank, data) for kind in args.shardings.split(",")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    gc.collect()  # the DMP models' DDP must be gone before the process group (see dmp_demo.run)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
