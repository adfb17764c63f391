"""Synthetic ads-ranking data: user histories of (item, category) events and a click label.

The hidden signal: a few "hot" categories. Each user draws a share of their events from hot
items (a per-user taste in [0, 0.6]), the rest uniformly from all items. The click probability
rises with the fraction of hot events in the history, so a model must learn from the sequences
which items and categories are hot; users with an empty history rarely click.

Everything is drawn with tensor ops on the target device (no Python loop over users).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch import Tensor

from ..jagged import lengths_to_offsets
from .demo_config import DataConfig

FEATURES = ("item_ids", "category_ids")
_TASTE_MAX = 0.6
_CLICK_SLOPE = 14.0
_CLICK_MIDPOINT = 0.45


@dataclass
class ClickBatch:
    """One batch of users: ``ids[name]`` are flat ids ``[T]`` of each feature (all features share
    ``lengths [B]``, one event per position), ``labels [B]`` are 0/1 floats and ``click_prob [B]``
    the true probabilities the labels were drawn from."""

    ids: Dict[str, Tensor]
    lengths: Tensor
    labels: Tensor
    click_prob: Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens over all features (host int; read once per batch)."""
        return len(FEATURES) * int(self.lengths.sum())

    def to_kjt(self):
        """The features as a torchrec ``KeyedJaggedTensor`` (keys :data:`FEATURES`, key-major)."""
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor(
            keys=list(FEATURES), values=torch.cat([self.ids[k] for k in FEATURES]),
            lengths=self.lengths.repeat(len(FEATURES)).int(),
        )


class SyntheticClicks:
    """Draws :class:`ClickBatch` es with a fixed hidden item catalogue (seeded by ``config.seed``)."""

    def __init__(self, config: DataConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        gen = torch.Generator().manual_seed(config.seed)
        category = torch.randint(config.num_categories, (config.num_items,), generator=gen)
        hot = torch.randperm(config.num_categories, generator=gen)[: config.hot_categories]
        is_hot = torch.isin(category, hot)
        if not bool(is_hot.any()):
            is_hot[0] = True
        self.item_category = category.to(device)
        self.hot_items = is_hot.nonzero().flatten().to(device)

    def batch(self, num_users: int, generator: torch.Generator) -> ClickBatch:
        """``num_users`` fresh users drawn with ``generator`` (a generator on the target device)."""
        cfg, dev = self.config, self.device

        def rand(*shape: int) -> Tensor:
            return torch.rand(shape, generator=generator, device=dev)

        lengths = (rand(num_users) * cfg.max_history).long() + 1
        lengths = torch.where(rand(num_users) < cfg.empty_fraction, 0, lengths)
        taste = rand(num_users) * _TASTE_MAX
        offsets = lengths_to_offsets(lengths)
        total = int(offsets[-1])
        user = torch.repeat_interleave(torch.arange(num_users, device=dev), lengths, output_size=total)
        any_item = (rand(total) * cfg.num_items).long()
        hot_item = self.hot_items[(rand(total) * self.hot_items.numel()).long()]
        items = torch.where(rand(total) < taste[user], hot_item, any_item)
        hot = torch.isin(items, self.hot_items).float()
        hot_fraction = torch.zeros(num_users, device=dev).index_add_(0, user, hot) / lengths.clamp(min=1)
        click_prob = torch.sigmoid(_CLICK_SLOPE * (hot_fraction - _CLICK_MIDPOINT))
        labels = (rand(num_users) < click_prob).float()
        ids = {"item_ids": items, "category_ids": self.item_category[items]}
        return ClickBatch(ids, lengths, labels, click_prob)

    def eval_batches(self, seed: int) -> Tuple[ClickBatch, ...]:
        """The held-out users (``eval_users``, from their own seed), in batches of ``batch_size``."""
        gen = torch.Generator(self.device).manual_seed(seed)
        cfg = self.config
        sizes = [min(cfg.batch_size, cfg.eval_users - i) for i in range(0, cfg.eval_users, cfg.batch_size)]
        return tuple(self.batch(n, gen) for n in sizes)
