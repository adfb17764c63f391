"""State of a sharded click model: a single-process model's weights into DMP, and checkpoints.

:func:`load_full_state` copies the unsharded tensors of a plain (single-process) model into
the shards each rank holds, so a DMP model and a plain one can start from the same weights.
:func:`save_checkpoint` / :func:`load_checkpoint` write and read the DMP model's and its
optimizers' state (torchrec's sharded ``state_dict``) with ``torch.distributed.checkpoint``:
every rank writes its own shards, and loading puts them back in place, optimizer state included.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor

from .dmp_setup import ShardedTraining


def load_full_state(sharded: ShardedTraining, state: Mapping[str, Tensor]) -> None:
    """Load ``state`` (full tensors keyed as the unsharded model's ``state_dict``) into the DMP model.

    Each rank copies the rows and columns of every table that its shards hold; replicated
    (dense) tensors are copied whole.
    """
    target = sharded.model.state_dict()
    missing = sorted(set(target) - set(state))
    if missing:
        raise ValueError(f"state lacks {len(missing)} entries of the sharded model, e.g. {missing[:3]}")
    with torch.no_grad():
        for key, value in target.items():
            full = state[key]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    meta = shard.metadata
                    rows = tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes))
                    shard.tensor.copy_(full[rows])
            else:
                value.copy_(full)
    sharded.model.load_state_dict(target)


def _state(sharded: ShardedTraining, step: int) -> dict:
    return {
        "model": sharded.model.state_dict(), "optimizer": sharded.optimizer.state_dict(), "step": torch.tensor(step),
    }


def save_checkpoint(path: str, sharded: ShardedTraining, step: int) -> None:
    """Write the model's and optimizers' state after ``step`` steps to the directory ``path`` (all ranks call it)."""
    dcp.save(_state(sharded, step), checkpoint_id=path)


def load_checkpoint(path: str, sharded: ShardedTraining) -> int:
    """Read a :func:`save_checkpoint` directory into ``sharded`` in place; returns the steps it had done.

    The dense optimizer's state (Adam's moments) exists only after a step, so a fresh one is
    first given zero-filled state (a step with zero gradients, which leaves Adam's parameters
    unchanged) to load into.
    """
    if not sharded.dense_optimizer.state:
        sharded.dense_optimizer.init_state()
        sharded.dense_optimizer.zero_grad(set_to_none=True)
    state = _state(sharded, 0)
    dcp.load(state, checkpoint_id=path)
    sharded.model.load_state_dict(state["model"])
    sharded.optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
