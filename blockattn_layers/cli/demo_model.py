"""The demo's click model: id features -> embeddings -> jagged encoder -> mean pooling -> MLP -> logit.

With torchrec the features are a ``KeyedJaggedTensor`` embedded by an ``EmbeddingCollection``
inside a :class:`~blockattn_layers.JaggedSequenceEncoder`; without torchrec (e.g. a GPU machine
that lacks it) one ``nn.Embedding`` per feature embeds the flat ids. Either way the encoder sees
every feature's sequences in one jagged batch, and pooling works on ``(values, offsets)``.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..jagged import lengths_to_offsets, offsets_to_lengths, resolve_awaitable, to_values_offsets
from ..modules import BlockSelfAttention, JaggedSequenceEncoder


@functools.lru_cache(maxsize=None)
def torchrec_problem() -> Optional[str]:
    """Why torchrec cannot be used here (not installed, or its fbgemm fails to load), else ``None``."""
    try:
        import torchrec  # noqa: F401
    except Exception as err:  # ImportError, or fbgemm's native library failing against this torch
        return f"{type(err).__name__}: {err}"
    return None


def mean_pool(values: Tensor, offsets: Tensor) -> Tensor:
    """Mean of each sequence's rows: ``values [T, E]``, ``offsets [N+1]`` -> ``[N, E]``; empty -> 0.

    A segment sum by ``index_add_`` over each token's sequence index: no loop over sequences.
    """
    lengths = offsets_to_lengths(offsets).long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths,
                                  output_size=values.shape[0])
    sums = values.new_zeros(lengths.numel(), values.shape[1]).index_add_(0, seq, values)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


class PlainSequenceEncoder(nn.Module):
    """Without torchrec: ``{feature: ids [T]}`` plus shared ``lengths [B]`` -> ``(values, offsets)``."""

    def __init__(self, features: Sequence[str], num_embeddings: Sequence[int], dim: int, encoder: nn.Module):
        super().__init__()
        self.features = tuple(features)
        self.embeddings = nn.ModuleDict({f: nn.Embedding(n, dim) for f, n in zip(features, num_embeddings)})
        self.encoder = encoder

    def forward(self, ids: Dict[str, Tensor], lengths: Tensor) -> Tuple[Tensor, Tensor]:
        values = torch.cat([self.embeddings[f](ids[f]) for f in self.features])
        offsets = lengths_to_offsets(lengths.repeat(len(self.features)))
        return self.encoder(values, offsets), offsets


class ClickHead(nn.Module):
    """Encoded features -> mean pooling of each feature's sequences -> MLP -> one logit per user.

    ``encoded`` is the encoder's ``Dict[str, JaggedTensor]`` (pooled in :attr:`features` order,
    whatever order the dict has: a sharded ``EmbeddingCollection`` groups its keys by sharding)
    or, without torchrec, ``(values, offsets)`` with the features' sequences feature-major.
    A module of its own so that torchrec's pipeline tracer keeps it a leaf and never traces
    into the pooling.
    """

    def __init__(self, features: Sequence[str], dim: int, hidden: int) -> None:
        super().__init__()
        self.features = tuple(features)
        self.mlp = nn.Sequential(nn.Linear(len(self.features) * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, encoded: Any) -> Tensor:
        encoded = resolve_awaitable(encoded)
        if isinstance(encoded, Mapping):
            values, offsets, _ = to_values_offsets({f: encoded[f] for f in self.features})
        else:
            values, offsets = encoded
        pooled = mean_pool(values, offsets)  # [F * B, E], feature-major
        pooled = pooled.unflatten(0, (len(self.features), -1)).transpose(0, 1).flatten(1)  # [B, F * E]
        return self.mlp(pooled).squeeze(1)


class ClickModel(nn.Module):
    """Click logit of each user from their jagged id features.

    ``sequence_encoder`` is a :class:`JaggedSequenceEncoder` (torchrec; called with a
    ``KeyedJaggedTensor``) or a :class:`PlainSequenceEncoder` (called with ``(ids, lengths)``);
    ``head`` is a :class:`ClickHead`. The forward only calls the two, so torchrec's pipeline
    tracer can follow it to the (sharded) ``EmbeddingCollection`` inside the sequence encoder.
    """

    def __init__(self, sequence_encoder: nn.Module, features: Sequence[str], dim: int, hidden: int) -> None:
        super().__init__()
        self.sequence_encoder = sequence_encoder
        self.head = ClickHead(features, dim, hidden)

    def forward(self, features: Any) -> Tensor:
        if isinstance(self.sequence_encoder, PlainSequenceEncoder):
            return self.head(self.sequence_encoder(*features))
        return self.head(self.sequence_encoder(features))


def build_click_model(
    features: Sequence[str], num_embeddings: Sequence[int], encoder: nn.Module, dim: int, hidden: int,
    use_torchrec: bool = True,
) -> ClickModel:
    """A :class:`ClickModel` over ``features`` (one table each) around ``encoder`` of width ``dim``;
    ``use_torchrec=False`` embeds with plain ``nn.Embedding`` tables instead of an ``EmbeddingCollection``."""
    if use_torchrec:
        from torchrec import EmbeddingCollection, EmbeddingConfig

        tables = [
            EmbeddingConfig(name=f"{f}_table", embedding_dim=dim, num_embeddings=n, feature_names=[f])
            for f, n in zip(features, num_embeddings)
        ]
        sequence_encoder = JaggedSequenceEncoder(EmbeddingCollection(tables=tables), encoder)
    else:
        sequence_encoder = PlainSequenceEncoder(features, num_embeddings, dim, encoder)
    return ClickModel(sequence_encoder, features, dim, hidden)


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Point every attention layer of ``model`` at ``backend``."""
    for module in model.modules():
        if isinstance(module, BlockSelfAttention):
            module.backend = backend
