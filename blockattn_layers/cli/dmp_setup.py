"""The click model under torchrec ``DistributedModelParallel``: process group, batches, sharding, optimizers.

Used by ``demo --distributed`` (see :mod:`.dmp_demo`) and its tests. This module, and the two
that use it (:mod:`.dmp_demo`, :mod:`.dmp_checkpoint`), import torchrec; ``demo`` imports them
only with ``--distributed``, and the rest of the package never imports torchrec.

- :func:`init_distributed`: the default process group from torchrun's environment, NCCL on
  ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on the CPU.
- :class:`SparseClickBatch`: one rank's batch as ``TrainPipelineSparseDist`` moves it
  (a ``KeyedJaggedTensor`` of ids and the labels); :func:`click_batches` draws them, each
  determined by ``(seed, rank, step)`` so a resumed run sees the batches it would have seen.
- :class:`ClickTraining`: the model's ``(loss, output)`` forward that torchrec pipelines call.
- :func:`sharding_plan` / :func:`shard`: table-wise, row-wise or column-wise sharding of every
  table with the fused compute kernel, or the planner's own plan; then DMP and the optimizers
  (the tables' optimizer fused into the backward, Adam for the dense parameters).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torchrec import EmbeddingCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable

from .demo_config import SHARDINGS
from .demo_data import SyntheticClicks
from .demo_model import ClickModel

FUSED = EmbeddingComputeKernel.FUSED.value


def init_distributed(device: Optional[str] = None) -> torch.device:
    """Join the job torchrun started and return this rank's device.

    ``device`` ``None`` or ``"auto"``: ``cuda:LOCAL_RANK`` with NCCL when CUDA is available, else
    the CPU with gloo; ``"cpu"`` forces gloo on the CPU, ``"cuda"`` requires a GPU.
    """
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device 'cuda': CUDA is not available (torch {torch.__version__})")
    chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
    return chosen


class SparseClickBatch(Pipelineable):
    """One rank's batch: ``features``, a ``KeyedJaggedTensor`` of ids (one key per feature),
    and ``labels [B]``; ``num_tokens`` counts the ids (a host int, known before any copy)."""

    def __init__(self, features: KeyedJaggedTensor, labels: Tensor, num_tokens: int) -> None:
        self.features, self.labels, self.num_tokens = features, labels, num_tokens

    def to(self, device: torch.device, non_blocking: bool = False) -> "SparseClickBatch":
        return SparseClickBatch(
            self.features.to(device=device, non_blocking=non_blocking),
            self.labels.to(device=device, non_blocking=non_blocking), self.num_tokens,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "SparseClickBatch":
        return SparseClickBatch(self.features.pin_memory(), self.labels.pin_memory(), self.num_tokens)


def click_batch(data: SyntheticClicks, batch_size: int, seed: int, rank: int, step: int) -> SparseClickBatch:
    """Rank ``rank``'s batch of step ``step``, on ``data``'s device; the same for the same arguments."""
    gen = torch.Generator(data.device).manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
    batch = data.batch(batch_size, gen)
    return SparseClickBatch(batch.to_kjt(), batch.labels, batch.num_tokens)


def click_batches(data: SyntheticClicks, batch_size: int, seed: int, rank: int, start: int,
                  stop: int) -> Iterator[SparseClickBatch]:
    """Rank ``rank``'s batches of steps ``start, ..., stop - 1`` (see :func:`click_batch`)."""
    for step in range(start, stop):
        yield click_batch(data, batch_size, seed, rank, step)


class ClickTraining(nn.Module):
    """``batch -> (loss, (loss, logits, labels))``: the forward torchrec's train pipelines call.

    The loss is the mean BCE of ``model``'s click logits on this rank's batch. The forward only
    reads the batch's fields and calls ``model``, so ``TrainPipelineSparseDist``'s tracer finds
    the sharded ``EmbeddingCollection`` fed straight from ``batch.features`` and pipelines it.
    """

    def __init__(self, model: ClickModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: SparseClickBatch) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
        logits = self.model(batch.features)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def embedding_collection_path(module: nn.Module) -> str:
    """The qualified name of the one ``EmbeddingCollection`` inside ``module``."""
    paths = [name for name, child in module.named_modules() if isinstance(child, EmbeddingCollection)]
    if len(paths) != 1:
        raise ValueError(f"expected one EmbeddingCollection in the model, found {len(paths)}: {paths}")
    return paths[0]


def sharding_plan(module: nn.Module, kind: str, device: torch.device) -> ShardingPlan:
    """The plan for ``module``'s ``EmbeddingCollection`` over the default process group.

    ``kind`` ``"table_wise"`` (table ``i`` on rank ``i % world``), ``"row_wise"`` or
    ``"column_wise"`` (every table over all ranks), each with the fused compute kernel; or
    ``"planner"``: ``EmbeddingShardingPlanner``'s choice for this topology (made on rank 0 and
    broadcast).
    """
    if kind not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {kind!r}")
    world = dist.get_world_size()
    sharder = EmbeddingCollectionSharder()
    if kind == "planner":
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device=device.type))
        return planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    path = embedding_collection_path(module)
    collection = module.get_submodule(path)
    sharding_of = {
        "table_wise": lambda i: table_wise(rank=i % world, compute_kernel=FUSED),
        "row_wise": lambda i: row_wise(compute_kernel=FUSED),
        "column_wise": lambda i: column_wise(ranks=list(range(world)), compute_kernel=FUSED),
    }[kind]
    tables = [config.name for config in collection.embedding_configs()]
    per_table = {name: sharding_of(i) for i, name in enumerate(tables)}
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    plan = construct_module_sharding_plan(
        collection, per_table, sharder=sharder, local_size=local_world, world_size=world, device_type=device.type,
    )
    return ShardingPlan({path: plan})


@dataclass
class ShardedTraining:
    """A DMP-wrapped :class:`ClickTraining` and its optimizers.

    ``optimizer`` combines the tables' fused optimizer (it steps inside the backward) and
    ``dense_optimizer`` (Adam over the parameters DMP replicates with DDP); give ``optimizer``
    to the train pipeline.
    """

    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    dense_optimizer: KeyedOptimizerWrapper
    plan: ShardingPlan


def shard(training: ClickTraining, kind: str, device: torch.device, lr: float, sparse_lr: float) -> ShardedTraining:
    """Shard ``training``'s embedding tables by ``kind`` (see :func:`sharding_plan`) and wrap it in DMP.

    The tables train with Adagrad at ``sparse_lr``, fused into the backward (torchrec's fused
    compute kernel); the dense parameters with Adam at ``lr``. ``training`` is changed in place.
    """
    collection = training.get_submodule(embedding_collection_path(training))
    apply_optimizer_in_backward(torch.optim.Adagrad, collection.parameters(), {"lr": sparse_lr})
    plan = sharding_plan(training, kind, device)
    model = DistributedModelParallel(training, device=device, plan=plan, sharders=[EmbeddingCollectionSharder()])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.Adam(params, lr=lr),
    )
    return ShardedTraining(model, CombinedOptimizer([model.fused_optimizer, dense]), dense, plan)


def describe_plan(plan: ShardingPlan) -> List[str]:
    """One line per table: ``name: sharding type, compute kernel, ranks``."""
    lines = []
    for module_path, module_plan in plan.plan.items():
        for table, sharding in module_plan.items():
            lines.append(f"{module_path}.{table}: {sharding.sharding_type}, {sharding.compute_kernel} kernel, "
                         f"ranks {sharding.ranks}")
    return lines

