"""TMA reduce-add from shared memory for Gluon (Triton 3.6 builds the op, ``ttng.async_tma_reduce``,
but its Gluon language exposes no function for it).

``async_add_shared_to_global(desc, coord, src)`` adds the shared tile ``src`` element by element
to the box of the tensor map ``desc`` at ``coord`` (``cp.reduce.async.bulk.tensor`` ``.add``: each
element's add atomic, elements outside the map's shape dropped), issued and completed as a TMA
store is: ``fence_async_shared`` after the threads' writes to ``src``, ``tma.store_wait(k)``
before ``src`` is written again.

For adds in a fixed order across programs (the deterministic flash backward's ordered writer):
``after_turn`` after acquiring the turn and before the adds, ``wait_adds_done`` after them and
before releasing the next turn. ``tma.store_wait`` waits only until the tiles are read
(``cp.async.bulk.wait_group.read``); ``wait_adds_done`` waits until the adds' writes are done
(``cp.async.bulk.wait_group 0``), and both fence the async proxy's global accesses against the
generic proxy's (``fence.proxy.async.global``), where the turn counters live.
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin


@builtin
def async_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def after_turn(token):
    """Order this thread's later TMA adds after its earlier generic accesses (the turn's acquire);
    ``token``: a tensor of one 32-bit element per thread of the partition."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [token], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def wait_adds_done(token):
    """Wait until this thread's TMA adds have written global memory, and order them before its
    later generic accesses (the next turn's release); ``token`` as for :func:`after_turn`."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, $1;", "=r,r",
                              [token], dtype=gl.int32, is_pure=False, pack=1)
