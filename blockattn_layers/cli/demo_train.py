"""Training, evaluation and timing for the demo, plus a tie-aware ROC AUC in plain torch."""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from tqdm import tqdm

from .demo_data import ClickBatch
from .demo_model import set_attention_backend


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (ties count one half); ``nan`` when only one class is present."""
    scores, labels = scores.double().flatten().cpu(), labels.flatten().cpu().bool()
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # 1-based rank shared by tied scores
    rank_sum = float(mean_rank[inverse][labels].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


@dataclass
class Trainer:
    """One model, its optimiser and how to feed it a :class:`ClickBatch` (``as_input``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    as_input: Callable[[ClickBatch], Any]
    autocast: Callable[[], ContextManager]

    def step(self, batch: ClickBatch) -> Tensor:
        """One optimisation step; returns the loss (a device tensor, not synchronised)."""
        self.model.train()
        with self.autocast():
            logits = self.model(self.as_input(batch))
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[ClickBatch]) -> dict:
        """Held-out loss and AUC of the model, and the AUC of the true click probabilities."""
        self.model.eval()
        logits, labels, truth = [], [], []
        for batch in batches:
            with self.autocast():
                logits.append(self.model(self.as_input(batch)).float())
            labels.append(batch.labels)
            truth.append(batch.click_prob)
        logits, labels, truth = torch.cat(logits), torch.cat(labels), torch.cat(truth)
        return {
            "loss": float(F.binary_cross_entropy_with_logits(logits, labels)),
            "auc": roc_auc(logits, labels),
            "best_auc": roc_auc(truth, labels),
        }

    def fit(self, next_batch: Callable[[], ClickBatch], steps: int, desc: str) -> "FitResult":
        """``steps`` steps on fresh batches with a progress bar; times every step after the first."""
        losses: List[Tensor] = []
        tokens, seconds = 0, 0.0
        bar = tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True)
        for i in bar:
            batch = next_batch()
            num_tokens = batch.num_tokens
            start = time.perf_counter()
            losses.append(self.step(batch))
            loss = float(losses[-1])  # also waits for the device
            if i > 0:
                tokens, seconds = tokens + num_tokens, seconds + time.perf_counter() - start
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.close()
        return FitResult([float(x) for x in losses], tokens, seconds)


@dataclass
class FitResult:
    """Per-step losses, and tokens and seconds of the timed steps (all but the first)."""

    losses: List[float]
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def make_autocast(device: torch.device, amp: str) -> Callable[[], ContextManager]:
    """A context-manager factory: bf16 autocast on ``device`` when ``amp == "bf16"``, else a no-op."""
    if amp == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def time_steps(trainer: Trainer, batch: ClickBatch, steps: int, backend: str) -> float:
    """Median seconds of a training step on ``batch`` for a copy of the model on ``backend``."""
    model = copy.deepcopy(trainer.model)
    set_attention_backend(model, backend)
    optimizer = type(trainer.optimizer)(model.parameters(), **trainer.optimizer.defaults)
    copy_trainer = Trainer(model, optimizer, trainer.as_input, trainer.autocast)
    float(copy_trainer.step(batch))  # warm-up: kernel compilation, allocator
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(copy_trainer.step(batch))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
