"""Ids in, encoded sequences out: a torchrec ``EmbeddingCollection`` feeding a jagged encoder."""
from __future__ import annotations

from typing import Any, Dict, Optional

from torch import Tensor, nn


class JaggedSequenceEncoder(nn.Module):
    """``KeyedJaggedTensor`` of ids -> ``EmbeddingCollection`` -> jagged encoder -> ``Dict[str, JaggedTensor]``.

    The embedding collection turns the ids into one ``JaggedTensor`` of ``[T_key, E]`` embeddings
    per feature; ``encoder`` (any module of this package, e.g. a
    :class:`JaggedTransformerEncoder` of width E) encodes all features' sequences in one call and
    returns the dict with the same keys and lengths. torchrec stays at this boundary: nothing
    below sees its types.

    Under torchrec's ``DistributedModelParallel`` this is the sparse + sequence part of the model:
    DMP shards ``embedding_collection``, whose forward then returns an
    ``EmbeddingCollectionAwaitable`` (its output all-to-all still in flight); the encoder waits on
    it when it needs the embeddings. The forward only calls the two submodules, so
    ``TrainPipelineSparseDist``'s tracer follows it to the sharded collection, fed straight from
    the model's input, and pipelines the collection's input all-to-all (the encoder, which has
    no sharded child, stays a leaf of that trace).

    Args:
        embedding_collection: a ``torchrec.EmbeddingCollection``, sharded or not (or anything
            mapping a ``KeyedJaggedTensor`` to ``Dict[str, JaggedTensor]`` or a torchrec
            ``LazyAwaitable`` of one).
        encoder: a module taking that dict (``forward(dict, positions=None, *, cpu_offsets, max_seqlen)``).

    Forward:
        ``forward(features, positions=None, *, cpu_offsets=None, max_seqlen=None)``. ``positions``
        (rotary encoders only) is a ``Dict[str, JaggedTensor]`` of e.g. event times with the
        features' keys and lengths, or a ``[T]`` tensor in the order of the embedded dict's keys
        (a sharded collection may order its keys by sharding: under DMP give the dict).
        ``cpu_offsets``/``max_seqlen`` describe the concatenation of all features' sequences.

    Example:
        >>> import torch
        >>> from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
        >>> from blockattn_layers import JaggedSequenceEncoder, JaggedTransformerEncoderLayer
        >>> tables = [EmbeddingConfig(name="item_ids", embedding_dim=16, num_embeddings=100, feature_names=["clicks"])]
        >>> model = JaggedSequenceEncoder(
        ...     EmbeddingCollection(tables=tables),
        ...     JaggedTransformerEncoderLayer(16, 2, dim_feedforward=32, block_size=4),
        ... )
        >>> ids = KeyedJaggedTensor(keys=["clicks"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 3]))
        >>> out = model(ids)
        >>> out["clicks"].values().shape, out["clicks"].lengths().tolist()
        (torch.Size([5, 16]), [2, 3])
    """

    def __init__(self, embedding_collection: nn.Module, encoder: nn.Module) -> None:
        super().__init__()
        self.embedding_collection = embedding_collection
        self.encoder = encoder

    def forward(
        self, features: Any, positions: Any = None, *, cpu_offsets: Optional[Tensor] = None,
        max_seqlen: Optional[int] = None,
    ) -> Dict[str, Any]:
        embedded = self.embedding_collection(features)
        extra = {"cpu_offsets": cpu_offsets, "max_seqlen": max_seqlen}
        if positions is not None:
            extra["positions"] = positions
        return self.encoder(embedded, **extra)
