"""The normalized, validated arguments of one attention call, shared by every backend."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class AttentionParams(NamedTuple):
    """Scalars and optional tensors of a call after validation and defaulting (a named tuple:
    cheap to build, which matters for the host time of small calls).

    ``block_size`` is ``None`` for full per-sequence attention; ``rotary_dim`` is 0
    when ``rope_theta`` is ``None``; ``scale`` is already resolved to a float.
    """

    block_size: Optional[int]
    scale: float
    causal: bool
    rope_theta: Optional[float]
    positions: Optional[torch.Tensor]
    rotary_dim: int
    rotary_interleaved: bool
    cpu_offsets: Optional[torch.Tensor]
    max_seqlen: Optional[int]

    @property
    def rotary(self) -> bool:
        return self.rope_theta is not None

    @property
    def block_arg(self) -> int:
        """``block_size`` as the int that registered ops take: 0 means full attention."""
        return 0 if self.block_size is None else self.block_size

    def op_args(self) -> tuple:
        """The trailing arguments of the registered ops, in schema order."""
        return (
            self.block_arg, self.scale, self.causal, self.rope_theta, self.positions,
            self.rotary_dim, self.rotary_interleaved, self.cpu_offsets, self.max_seqlen,
        )
