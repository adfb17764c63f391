"""The op layer: one registered ``torch.library`` op pair for every kind of attention.

``blockattn::attention_fwd`` / ``blockattn::attention_bwd`` (:mod:`.library`) serve block
attention of any block size and full attention (``block_size=0``); the kernel is chosen inside
the op at run time from the tensors' device and the ``backend`` argument, through the one
dispatcher (:mod:`blockattn_layers.dispatch`), so a graph traced or exported on one device runs
the best kernels of another. :mod:`.entry` is what the public functions call: the ops while
tracing, the chosen backend's implementation directly in eager mode. Each backend lives in
:mod:`.backends` and registers itself there.
"""
from .entry import attention

__all__ = ["attention"]
