"""TMA reduce-add from shared memory for Gluon (Triton 3.6 builds the op, ``ttng.async_tma_reduce``,
but its Gluon language exposes no function for it).

``async_add_shared_to_global(desc, coord, src)`` adds the shared tile ``src`` element by element
to the box of the tensor map ``desc`` at ``coord`` (``cp.reduce.async.bulk.tensor`` ``.add``: each
element's add atomic, elements outside the map's shape dropped), issued and completed as a TMA
store is: ``fence_async_shared`` after the threads' writes to ``src``, ``tma.store_wait(k)``
before ``src`` is written again.
"""
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin


@builtin
def async_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
