"""Run Gluon (``triton.experimental.gluon``) kernel code on CPU tensors: a torch-backed stand-in.

Gluon has no interpreter. A ``@gluon.jit`` function keeps its Python function (``.fn``), so
:func:`function` rebinds that function's code to a copy of its module globals in which ``gl``
(and ``async_copy``, ``mbarrier``, ``tma``, ``warpgroup_mma``, ``fence_async_shared``) are the
torch versions below, every other ``@gluon.jit`` or ``@gluon.constexpr_function`` it calls is
rebound the same way, and ``gl.constexpr`` globals are their values. The code then runs as
plain Python on torch tensors, one program at a time (:func:`launch` loops over a grid).

What it models:

- tensors are torch tensors (:class:`GTensor`, which also takes the shim's dtypes in ``.to``),
  with torch's dtype rules (int32 stays int32 and wraps like on the GPU); scalar arguments of a
  Gluon function are 0-d tensors, as in Gluon; layouts are inert records;
- pointers are (tensor storage, int64 element offsets) (:class:`Pointer`); ``gl.load`` /
  ``gl.store`` honour ``mask`` and ``other``, raise ``IndexError`` for an unmasked offset outside
  the tensor, read masked lanes without ``other`` as NaN (floats) or the smallest integer, and count
  every element written (:meth:`Launch.writes`), so tests can check that each output element is
  written exactly once and nothing outside a block;
- shared memory is a torch tensor (:class:`SharedTile`: ``load``, ``store`` with shape and dtype
  checks, ``index``, ``slice``, ``permute``, ``_reinterpret`` as a view of the same bytes), filled
  with NaN (floats) or the smallest integer when allocated, so reading what no one wrote shows;
- ``cp.async`` copies happen at once, masked rows zero-filled; ``warpgroup_mma`` is a float32
  matmul of its operands (which must share a dtype); an asynchronous one returns a
  :class:`PendingProduct` that only another product (as accumulator) or ``warpgroup_mma_wait``
  takes until a wait has it done: each partition's products complete in issue order, all but the
  wait's ``num_outstanding`` newest (so a use before the wait, or a wait that leaves the product
  outstanding, raises); fences and thread barriers do nothing;
- ``gl.associative_scan`` is a generic inclusive scan calling the kernel's own combine function;
  ``inline_asm_elementwise`` knows ``sin.approx.f32`` / ``cos.approx.f32`` of float32 operands
  (torch's sin / cos, exact: the approximations' error is not modelled) and ``mov.b32`` (a bit
  copy of a 32-bit operand; an int64 one is first truncated to its low 32 bits, as Triton's
  lowering does for an ``r`` register), and the GPU-scope fence before such a copy (a no-op here);
  :func:`record_asm` logs the operands (e.g. the angles the GPU approximates);
- ``gl.atomic_add`` adds lane by lane and returns the old values (programs run one at a time);
- ``gl.warp_specialize`` runs the worker partitions in threads beside the default one, one partition at a
  time (``_Turns``): a partition runs until it must wait on a barrier, or until a plain ``arrive`` of its
  completes a phase another partition waits on, which then runs first (so a buffer released before its last
  read is refilled before that read, every time); a producer whose TMA copies complete a phase runs on (ahead
  of its consumers, as on the GPU); every partition waiting at once raises a deadlock at once; mbarriers
  count arrivals and TMA bytes per phase (``expect`` arrives once and announces bytes, a TMA copy
  pays them; more bytes than announced, too many arrivals, use before ``init`` or after
  ``invalidate`` raise), and waits time out (a deadlock fails instead of hanging); TMA copies
  move a box at once, zero-filled outside the descriptor's shape, TMA stores (and TMA reduce-adds,
  ``sm90.tma_add``, added lane by lane as atomics) drop what lies outside it; a TMA store reads its
  shared tile only when a ``store_wait`` retires it (or its partition or program ends), so a staging
  tile written again before that wait stores the later data; :func:`launch`
  checks that a program invalidated every barrier it initialized, and invalidating one mid-phase
  (arrivals or bytes still due) raises;
- Blackwell: tensor memory is a float32 torch tensor (:class:`TensorMemory`, NaN when allocated,
  ``slice`` along the last dimension); ``tcgen05_mma`` is a float32 matmul of shared-memory
  operands into it (``use_acc``, shapes and dtypes checked) that arrives on its ``mbarriers``;
  ``tcgen05_commit`` arrives on its barrier at once (the products are synchronous);
  ``TensorMemoryLayout`` and ``get_tmem_reg_layout`` are inert layouts.

What it does not model: timing, and concurrency inside a program beyond that one order of turns (no warps
or threads within a partition; TMA copies and reduce-adds are synchronous, so a missing
fence, barrier or ``thread_barrier`` goes unnoticed, as do a register operand of
an asynchronous ``warpgroup_mma`` changed before its wait and races between programs), layouts
and their conversions (every layout argument is accepted), register or shared-memory limits, the accuracy of ``sin/cos.approx`` or of low-precision accumulation, and
integer ``//`` and ``%`` of negative operands (torch floors, Gluon truncates; the kernels' index
math has non-negative operands). Any other Gluon name a rebound function reaches raises
``NotImplementedError`` when used.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import triton.language as tl
from triton.experimental.gluon import language as _real_gl
from triton.experimental.gluon.language.nvidia import blackwell as _real_blackwell
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _real_async_copy
from triton.experimental.gluon.language.nvidia.ampere import mbarrier as _real_ampere_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared as _real_fence
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as _real_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import tma as _real_tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma as _real_wgmma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait as _real_wgmma_wait
from triton.runtime.jit import ConstexprFunction, JITFunction

from blockattn_layers.kernels.sm90.tma_add import async_add_shared_to_global as _real_tma_add

__all__ = [
    "DType", "GTensor", "Launch", "Layout", "Memory", "PendingProduct", "Pointer", "SharedTile", "TensorMemory",
    "function", "launch", "pointer", "program", "record_asm", "scalar", "shared", "tensor", "warpgroup_mma_functions",
]

# A deadlocked mbarrier wait, or a spin on a counter that does not change, fails after this many seconds.
WAIT_TIMEOUT_S = 20.0


# ----------------------------------------------------------------------------- tensors, dtypes
class DType:
    """A Gluon dtype: a torch dtype with Gluon's attributes (``primitive_bitwidth``)."""

    __slots__ = ("torch",)

    def __init__(self, dtype: torch.dtype):
        self.torch = dtype

    @property
    def primitive_bitwidth(self) -> int:
        return 1 if self.torch == torch.bool else self.torch.itemsize * 8

    def __eq__(self, other) -> bool:
        return _torch_dtype(other) == self.torch

    def __hash__(self) -> int:
        return hash(self.torch)

    def __repr__(self) -> str:
        return f"DType({self.torch})"


def _torch_dtype(dtype):
    return dtype.torch if isinstance(dtype, DType) else dtype


class GTensor(torch.Tensor):
    """A torch tensor whose ``.to`` also takes the shim's :class:`DType`s (``x.to(gl.float32)``)."""

    def to(self, *args, bitcast: bool = False, **kwargs):
        args = tuple(_torch_dtype(a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _torch_dtype(kwargs["dtype"])
        if bitcast:  # the same bits as another dtype of the same width
            return self.view(*args, **kwargs)
        return super().to(*args, **kwargs)


def tensor(x) -> GTensor:
    """``x`` (a tensor or a number) as a :class:`GTensor`."""
    if isinstance(x, GTensor):
        return x
    return torch.as_tensor(x).as_subclass(GTensor)


def scalar(value, dtype: Optional[torch.dtype] = None) -> GTensor:
    """A 0-d tensor, as Gluon passes a scalar argument: ints as int32 (int64 past its range),
    floats as float32, unless ``dtype`` says otherwise."""
    if dtype is None:
        if isinstance(value, bool):
            dtype = torch.bool
        elif isinstance(value, int):
            dtype = torch.int32 if -2**31 <= value < 2**31 else torch.int64
        else:
            dtype = torch.float32
    return torch.tensor(value, dtype=_torch_dtype(dtype)).as_subclass(GTensor)


def _undefined(shape, dtype: torch.dtype) -> GTensor:
    """What a masked load without ``other``, or fresh shared memory, holds: NaN, or the dtype's
    smallest integer (True for booleans)."""
    if dtype.is_floating_point:
        junk = float("nan")
    else:
        junk = True if dtype == torch.bool else torch.iinfo(dtype).min
    return torch.full(shape, junk, dtype=dtype).as_subclass(GTensor)


# ----------------------------------------------------------------------------- layouts
class Layout:
    """An inert layout (distributed, shared or mbarrier): the constructor's name and arguments."""

    def __init__(self, kind: str, *args, **kwargs):
        self.kind, self.args, self.kwargs = kind, args, kwargs

    def __repr__(self) -> str:
        return f"{self.kind}{self.args}"


def _layout(kind: str) -> Callable[..., Layout]:
    return lambda *args, **kwargs: Layout(kind, *args, **kwargs)


# ----------------------------------------------------------------------------- global memory
class Memory:
    """The elements a tensor's pointer addresses: its storage span, flat, and a write count per
    element."""

    def __init__(self, t: torch.Tensor, name: str = "tensor"):
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
        self.tensor, self.name = t, name
        self.flat = t.as_strided((span,), (1,))
        self.writes = torch.zeros(span, dtype=torch.int32)

    def writes_as_tensor(self) -> torch.Tensor:
        """Write counts laid out like the tensor."""
        return self.writes.as_strided(self.tensor.shape, self.tensor.stride(), 0)

    def active(self, offsets: torch.Tensor, mask: torch.Tensor, op: str) -> torch.Tensor:
        """``offsets`` with masked lanes at 0; raises for an active lane outside the tensor."""
        safe = torch.where(mask, offsets, 0)
        if safe.numel() and (int(safe.min()) < 0 or int(safe.max()) >= self.flat.numel()):
            bad = safe[(safe < 0) | (safe >= self.flat.numel())]
            raise IndexError(f"{op} of {self.name} at element offset {int(bad[0])}, outside [0, {self.flat.numel()})")
        return safe


class PointerType:
    """``pointer.dtype``: its ``element_ty``."""

    def __init__(self, element_ty: DType):
        self.element_ty = element_ty


class Pointer:
    """A (block of) pointer(s): a :class:`Memory` and int64 element offsets (any shape), in units of
    ``view`` (the memory's own dtype, or a wider one after a pointer cast: ``ptr.to(pointer_type(t))``)."""

    def __init__(self, memory: Memory, offsets=None, view: Optional[torch.dtype] = None):
        self.memory = memory
        self.offsets = tensor(torch.zeros((), dtype=torch.int64) if offsets is None else offsets)
        self.view = memory.flat.dtype if view is None else view

    def __add__(self, other) -> "Pointer":
        return Pointer(self.memory, self.offsets + other, self.view)

    __radd__ = __add__

    @property
    def dtype(self) -> PointerType:
        return PointerType(DType(self.view))

    @property
    def ratio(self) -> int:
        """Memory elements per element of the view."""
        return self.view.itemsize // self.memory.flat.dtype.itemsize

    def to(self, ty: PointerType, bitcast: bool = False) -> "Pointer":
        """The same addresses seen as ``ty.element_ty`` (at least as wide as the memory's dtype,
        the addresses aligned to it)."""
        view = _torch_dtype(ty.element_ty)
        ratio = view.itemsize // self.memory.flat.dtype.itemsize
        offsets = _plain(self.offsets) * self.ratio
        if ratio < 1 or bool((offsets % ratio).ne(0).any()):
            raise ValueError(f"pointer cast of {self.memory.name} to {view}: not aligned to it")
        return Pointer(self.memory, offsets // ratio, view)

    @property
    def shape(self) -> list:
        return list(self.offsets.shape)


def pointer(t: torch.Tensor, name: str = "tensor") -> Pointer:
    """A pointer to ``t``'s first element (what a kernel receives for a tensor argument)."""
    return Pointer(Memory(t, name))


def _plain(x) -> torch.Tensor:
    """``x`` as a plain torch tensor (the shim's own bookkeeping skips GTensor's dispatch)."""
    return torch.as_tensor(x).as_subclass(torch.Tensor)


def _mask_like(offsets, mask) -> Tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones((), dtype=torch.bool) if mask is None else _plain(mask)
    offsets, mask = torch.broadcast_tensors(_plain(offsets), mask)
    return offsets, mask


def _elements(pointer: Pointer, offsets: torch.Tensor) -> torch.Tensor:
    """The memory elements of each view element at ``offsets``: ``[..., ratio]``."""
    return offsets.unsqueeze(-1) * pointer.ratio + torch.arange(pointer.ratio)


def _load(pointer: Pointer, mask=None, other=None, **_ignored) -> GTensor:
    offsets, mask = _mask_like(pointer.offsets, mask)
    memory = pointer.memory
    parts = _elements(pointer, offsets)
    values = memory.flat[memory.active(parts, mask.unsqueeze(-1).expand(parts.shape), "load")]
    values = values.contiguous().view(pointer.view).squeeze(-1)
    fill = _undefined((), values.dtype) if other is None else _plain(other)
    return torch.where(mask, values, fill).to(values.dtype).as_subclass(GTensor)


def _store(pointer: Pointer, value, mask=None, **_ignored) -> None:
    offsets, mask = _mask_like(pointer.offsets, mask)
    memory = pointer.memory
    parts = _elements(pointer, offsets)
    value = _plain(value).to(pointer.view).expand(offsets.shape).unsqueeze(-1).contiguous()
    value = value.view(memory.flat.dtype)
    mask = mask.unsqueeze(-1).expand(parts.shape)
    on = memory.active(parts, mask, "store")[mask]
    memory.flat[on] = value[mask]
    memory.writes.index_put_((on,), torch.ones_like(on, dtype=torch.int32), accumulate=True)


# ----------------------------------------------------------------------------- shared memory
class SharedTile:
    """A shared-memory descriptor: a torch tensor (a view for slices, indices and permutes)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def dtype(self) -> DType:
        return DType(self.data.dtype)

    @property
    def shape(self) -> list:
        return list(self.data.shape)

    def load(self, layout=None) -> GTensor:
        return self.data.clone().as_subclass(GTensor)

    def store(self, value) -> None:
        value = torch.as_tensor(value)
        if list(value.shape) != self.shape or value.dtype != self.data.dtype:
            raise TypeError(f"store of {value.dtype}{list(value.shape)} to a {self.data.dtype}{self.shape} tile")
        self.data.copy_(value)

    def index(self, i) -> "SharedTile":
        return SharedTile(self.data[int(i)])

    def slice(self, start, length, dim=0) -> "SharedTile":
        return SharedTile(self.data.narrow(int(dim), int(start), int(length)))

    def permute(self, order) -> "SharedTile":
        return SharedTile(self.data.permute(tuple(order)))

    def reshape(self, shape) -> "SharedTile":
        return SharedTile(self.data.view(tuple(int(n) for n in shape)))

    def _reinterpret(self, dtype, shape, layout=None) -> "SharedTile":
        return SharedTile(self.data.view(_torch_dtype(dtype)).view(tuple(shape)))


def shared(t: torch.Tensor) -> SharedTile:
    """``t`` as a shared tile (its own storage: stores into the tile write ``t``)."""
    return SharedTile(t)


def _allocate_shared_memory(element_ty, shape, layout=None, value=None) -> SharedTile:
    nvmma = isinstance(layout, Layout) and layout.kind == "NVMMASharedLayout"
    if nvmma and any(n <= 0 or n & (n - 1) for n in shape[-2:]):  # a tile's, as Gluon requires
        raise ValueError(f"shape must have power-of-2 and non-zero dimensions; got {list(shape)}")
    tile = SharedTile(_undefined(tuple(shape), _torch_dtype(element_ty)).as_subclass(torch.Tensor))
    if value is not None:
        tile.store(value)
    return tile


# ----------------------------------------------------------------------------- programs
class _State:
    """The program being run (its id and the grid), the asm log, barriers and partition errors."""

    def __init__(self):
        self.pid: Tuple[int, ...] = (0, 0, 0)
        self.grid: Tuple[int, ...] = (1, 1, 1)
        self.asm_log: Optional[List[Tuple[str, torch.Tensor]]] = None
        self.barriers: Dict[int, "_Barrier"] = {}
        self.cond = threading.Condition()
        self.aborted = False
        # The partitions of the warp-specialized program being run, one at a time (``_Turns``); None outside one.
        self.turns: Optional["_Turns"] = None


_STATE = _State()


@contextlib.contextmanager
def program(pid: Sequence[int], grid: Sequence[int]) -> Iterator[None]:
    """Run the block as program ``pid`` of ``grid`` (what ``gl.program_id`` / ``num_programs`` give),
    with barriers of its own."""
    before = _STATE.pid, _STATE.grid, _STATE.barriers, _STATE.aborted
    _STATE.pid = tuple(pid) + (0,) * (3 - len(pid))
    _STATE.grid = tuple(grid) + (1,) * (3 - len(grid))
    _STATE.barriers, _STATE.aborted = {}, False
    _COPIES.open, _COPIES.groups = [], []
    try:
        yield
    finally:
        _STATE.pid, _STATE.grid, _STATE.barriers, _STATE.aborted = before


@contextlib.contextmanager
def record_asm() -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Log ``(asm, operand)`` of every ``inline_asm_elementwise`` run inside the block."""
    log: List[Tuple[str, torch.Tensor]] = []
    before = _STATE.asm_log
    _STATE.asm_log = log
    try:
        yield log
    finally:
        _STATE.asm_log = before


def _program_id(axis) -> GTensor:
    return scalar(_STATE.pid[int(axis)])


def _num_programs(axis) -> GTensor:
    return scalar(_STATE.grid[int(axis)])


# ----------------------------------------------------------------------------- elementwise, reductions
def _as_tensors(*xs):
    return [x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in xs]


def _arange(start, end, layout=None) -> GTensor:
    return torch.arange(int(start), int(end), dtype=torch.int32).as_subclass(GTensor)


def _full(shape, value, dtype, layout=None) -> GTensor:
    return torch.full(tuple(shape), value, dtype=_torch_dtype(dtype)).as_subclass(GTensor)


def _zeros(shape, dtype, layout=None) -> GTensor:
    return _full(shape, 0, dtype)


def _where(condition, x, y) -> GTensor:
    return tensor(torch.where(tensor(condition), x, y))


def _minimum(x, y, propagate_nan=None) -> GTensor:
    return tensor(torch.minimum(*_as_tensors(x, y)))


def _maximum(x, y, propagate_nan=None) -> GTensor:
    return tensor(torch.maximum(*_as_tensors(x, y)))


def _sum(x, axis=None, keep_dims=False, dtype=None) -> GTensor:
    out_dtype = torch.int32 if x.dtype == torch.bool else x.dtype
    out = torch.sum(x, dim=axis, keepdim=keep_dims) if axis is not None else torch.sum(x)
    return tensor(out.to(_torch_dtype(dtype) or out_dtype))


def _max(x, axis=None, keep_dims=False, **_ignored) -> GTensor:
    return tensor(torch.amax(x, dim=axis, keepdim=keep_dims) if axis is not None else torch.amax(x))


def _associative_scan(x, axis, combine_fn, reverse=False) -> GTensor:
    """Inclusive scan along ``axis`` (Hillis-Steele: log2(n) rounds of ``combine_fn``)."""
    if reverse:
        raise NotImplementedError("gluon_shim: reverse associative_scan")
    axis = int(axis) % x.dim()
    n = x.shape[axis]
    step = 1
    while step < n:
        combined = combine_fn(x.narrow(axis, 0, n - step), x.narrow(axis, step, n - step))
        x = torch.cat([x.narrow(axis, 0, step), combined], axis)
        step *= 2
    return tensor(x)


_ASM = {
    "sin.approx.f32 $0, $1;": (torch.float32, torch.sin),
    "cos.approx.f32 $0, $1;": (torch.float32, torch.cos),
    "mov.b32 $0, $1;": (None, None),
    "fence.acq_rel.gpu; mov.u32 $0, $1;": (None, None),  # programs run one at a time: the fence is moot
    # The shim's TMA adds are done when issued, and programs run one at a time: waits and fences are moot.
    "fence.proxy.async.global; mov.u32 $0, $1;": (None, None),
    "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, $1;": (None, None),
}


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack) -> GTensor:
    key = " ".join(str(asm).split())
    if key not in _ASM or len(args) != 1 or int(pack) != 1:
        raise NotImplementedError(f"gluon_shim: inline asm {asm!r} of {len(args)} operands, pack {pack}")
    operand = tensor(args[0])
    needs, op = _ASM[key]
    if operand.dtype == torch.int64 and needs is None:
        operand = operand.to(torch.int32)  # Triton's lowering truncates it to the "r" register (cvt.u32.u64)
    if operand.dtype.itemsize != 4 or (needs is not None and operand.dtype != needs):
        raise TypeError(f"inline asm {asm!r}: operand {operand.dtype}, the instruction takes a 32-bit register")
    if _STATE.asm_log is not None:
        _STATE.asm_log.append((key, operand.detach().clone()))
    if op is None:
        return tensor(operand.contiguous().view(_torch_dtype(dtype)))
    return tensor(op(operand).to(_torch_dtype(dtype)))


_ATOMIC = threading.Lock()
# (memory, element) of each counter read by an acquiring add of zero -> (since when, value read then).
_SPINS: Dict[Tuple[int, int], Tuple[float, float]] = {}


def _atomic_add(pointer: Pointer, val, mask=None, sem=None, scope=None) -> GTensor:
    """Add ``val`` at each active lane in turn (lanes sharing an address each add) and return the
    values before; programs run one at a time, so the ordering ``sem`` / ``scope`` ask for holds.
    An acquiring add of zero to one element (a spin-wait's read of a counter) that reads the same
    value for ``WAIT_TIMEOUT_S`` raises: only a partition of the same program can still change it."""
    offsets, mask = _mask_like(pointer.offsets, mask)
    if sem == "acquire" and offsets.dim() == 0 and bool(mask) and float(_plain(val)) == 0:
        memory = pointer.memory
        at = int(memory.active(offsets, mask, "atomic_add"))
        value = float(memory.flat[at])
        key, now = (id(memory), at), time.monotonic()
        since, before = _SPINS.get(key, (now, value))
        since = since if before == value else now
        if now - since > WAIT_TIMEOUT_S:
            raise RuntimeError(f"spin on {memory.name}[{at}] == {value} for {WAIT_TIMEOUT_S} s: no one counts it")
        _SPINS[key] = (since, value)
        with _STATE.cond:
            if _STATE.turns is not None:
                _STATE.turns.hand_on()
                _STATE.turns.await_turn()
        time.sleep(0)
    if pointer.ratio != 1:
        raise NotImplementedError("gluon_shim: atomic_add through a cast pointer")
    memory = pointer.memory
    on = memory.active(offsets, mask, "atomic_add")
    old = torch.empty(offsets.shape, dtype=memory.flat.dtype)
    add = _plain(val).to(memory.flat.dtype).expand(offsets.shape)
    lanes = mask.reshape(-1).nonzero().flatten()
    at = on.reshape(-1)[lanes]
    with _ATOMIC:  # partitions run in threads; torch ops let others run mid-update
        if at.unique().numel() == at.numel():  # no two lanes share an address: all at once
            old.view(-1)[lanes] = memory.flat[at]
            memory.flat.index_add_(0, at, add.reshape(-1)[lanes])
            memory.writes.index_add_(0, at, torch.ones_like(at, dtype=memory.writes.dtype))
            return tensor(old)
        for i in lanes.tolist():
            at = int(on.reshape(-1)[i])
            old.view(-1)[i] = memory.flat[at]
            memory.flat[at] += add.reshape(-1)[i]
            memory.writes[at] += 1
    return tensor(old)


def _nothing(*args, **kwargs) -> None:
    return None


def _static_assert(condition, message: str = "") -> None:
    if not condition:
        raise AssertionError(f"gluon_shim: static_assert failed: {message}")


class _Unsupported:
    """A Gluon object the shim does not model: using it raises."""

    def __init__(self, name: str):
        self._name = name

    def _fail(self):
        raise NotImplementedError(f"gluon_shim does not model {self._name}")

    def __call__(self, *args, **kwargs):
        self._fail()

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unsupported(f"{self._name}.{attr}")


# ----------------------------------------------------------------------------- matrix products
class PendingProduct:
    """The accumulator of an asynchronous ``warpgroup_mma`` until a ``warpgroup_mma_wait`` has it
    done: only another ``warpgroup_mma`` (as its accumulator) or a wait may take it; anything else
    raises (on the GPU those registers are not written yet)."""

    def __init__(self, value: GTensor):
        self.value = value
        self.done = False

    def __getattr__(self, name):
        raise TypeError(f"an asynchronous warpgroup_mma's result used before its warpgroup_mma_wait ({name})")


# Each partition's (thread's) asynchronous products not yet waited for, oldest first.
_PENDING = threading.local()


def _pending() -> List[PendingProduct]:
    if not hasattr(_PENDING, "products"):
        _PENDING.products = []
    return _PENDING.products


def _warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    a = a.data if isinstance(a, SharedTile) else a
    b = b.data if isinstance(b, SharedTile) else b
    if isinstance(a, PendingProduct):
        raise TypeError("an asynchronous warpgroup_mma's result used as an operand before its wait")
    acc = acc.value if isinstance(acc, PendingProduct) else acc  # chained on the tensor cores
    if a.dtype != b.dtype:
        raise TypeError(f"warpgroup_mma of {a.dtype} and {b.dtype} operands")
    product = torch.matmul(a.float(), b.float())
    out = tensor(product + acc if use_acc else product)
    if not is_async:
        return out
    pending = PendingProduct(out)
    _pending().append(pending)
    return pending


def warpgroup_mma_functions() -> Tuple[Callable, Callable]:
    """The shim's ``warpgroup_mma`` and ``warpgroup_mma_wait`` (for tests of their model)."""
    return _warpgroup_mma, _warpgroup_mma_wait


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Products complete in the order issued (each asynchronous one its own group): all but the
    ``num_outstanding`` newest of this partition's are done, and the wait hands its ``deps`` back
    (one, or a tuple), the done ones as tensors and the rest still pending."""
    if deps is None:
        raise ValueError("warpgroup_mma_wait deps must be given")
    products = _pending()
    keep = int(num_outstanding)
    for product in products[:len(products) - keep] if keep else products:
        product.done = True
    del products[:len(products) - keep if keep else len(products)]
    out = tuple(d.value if isinstance(d, PendingProduct) and d.done else d for d in deps)
    return out[0] if len(out) == 1 else out


# ----------------------------------------------------------------------------- async copies
# ``cp.async`` copies of this thread (a program, or a partition of one): read from global memory at
# issue, written to shared memory only when a ``wait_group`` retires their commit group, so a tile
# read before its wait holds what it held before the copy (as on the GPU, at worst).
_COPIES = threading.local()
# The threads of the program or partition this Python thread runs (its warps times ``WARP_THREADS``): what one
# ``.noinc`` copy arrival counts on a barrier.
_THREADS = threading.local()
WARP_THREADS = 32


def _partition_threads() -> int:
    return getattr(_THREADS, "count", 4 * WARP_THREADS)


def _copies():
    if not hasattr(_COPIES, "groups"):
        _COPIES.open, _COPIES.groups = [], []
    return _COPIES


def _async_copy_global_to_shared(smem: SharedTile, pointer: Pointer, mask=None, **_ignored) -> None:
    offsets, mask = _mask_like(pointer.offsets, mask)
    values = _load(Pointer(pointer.memory, offsets), mask, other=0)
    _copies().open.append((smem, values.expand(smem.data.shape).as_subclass(torch.Tensor)))


def _commit_group() -> None:
    copies = _copies()
    copies.groups.append(copies.open)
    copies.open = []


def _land(groups) -> None:
    """Write ``groups``' copies to shared memory, oldest first."""
    for group in groups:
        for smem, values in group:
            smem.store(values)


def _wait_group(num_outstanding=0) -> None:
    """Land every committed group but the ``num_outstanding`` newest, oldest first."""
    copies = _copies()
    keep = int(num_outstanding)
    done = copies.groups[:len(copies.groups) - keep] if keep else copies.groups
    _land(done)
    copies.groups = copies.groups[len(done):]


def _copies_mbarrier_arrive(bar: SharedTile, increment_count=True) -> None:
    """``cp.async.mbarrier.arrive``: the barrier's phase waits for this thread's copies so far, which
    land here (taken out of their groups); without ``increment_count`` (``.noinc``) their completion
    also counts as the phase's arrivals of every thread of the partition (which the shim runs as one:
    on the GPU each thread arrives; ``_partition_threads``), with it it does not."""
    copies = _copies()
    _land(copies.groups + [copies.open])
    copies.groups = [[] for _ in copies.groups]
    copies.open = []
    if not increment_count:
        _mbarrier_arrive(bar, count=_partition_threads())


# ----------------------------------------------------------------------------- mbarriers
class _Aborted(RuntimeError):
    """Another partition of the program failed."""


class _Barrier:
    """One mbarrier: arrivals still due in this phase, TMA bytes still due, completed phases."""

    def __init__(self, count: int):
        self.count = self.pending = count
        self.tx = 0
        self.completed = 0
        self.valid = True

    def done(self, phase) -> bool:
        """Whether the phase of parity ``phase`` has completed (a wait on it returns)."""
        return self.completed % 2 != int(phase)

    def settle(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count
            _STATE.cond.notify_all()


class _Turns:
    """The partitions of a warp-specialized program run one at a time, in threads that hand the turn over at
    barrier operations: a partition that must wait hands it to the next one that can run (in partition order);
    one whose arrival completes a phase hands it to the first partition that phase woke, and gets it back when
    that one has to wait (so a release that comes too early is followed at once by the refill it allows); a
    spin read hands it on. The producer whose copies complete a phase keeps it (it runs ahead). Every partition
    waiting at once is a deadlock and raises. All methods run under ``_STATE.cond``."""

    def __init__(self, count: int):
        self.order: List[Optional[int]] = [None] * count
        self.holder: Optional[int] = None
        self.waiting: Dict[int, Tuple[_Barrier, int]] = {}
        self.finished: set = set()

    def can_run(self, t: int) -> bool:
        if t in self.finished:
            return False
        wait = self.waiting.get(t)
        return wait is None or wait[0].done(wait[1])

    def hand_on(self, first: Sequence[int] = (), keep: bool = True) -> None:
        """Give the turn to the first of ``first`` that can run, else to the next partition after this one that
        can (this one last, where ``keep``)."""
        me = threading.get_ident()
        at = self.order.index(me)
        after = self.order[at + 1:] + self.order[:at] + ([me] if keep else [])
        for t in list(first) + after:
            if self.can_run(t):
                self.holder = t
                _STATE.cond.notify_all()
                return
        if any(t not in self.finished for t in self.order):
            _STATE.aborted = True
            _STATE.cond.notify_all()
            raise RuntimeError("deadlock: every partition waits on a barrier phase that no one can complete: "
                               + ", ".join(f"{w[0].pending} arrivals and {w[0].tx} bytes due"
                                           for w in self.waiting.values()))
        self.holder = None

    def await_turn(self) -> None:
        me = threading.get_ident()
        _STATE.cond.wait_for(lambda: _STATE.aborted or self.holder == me, WAIT_TIMEOUT_S)
        if _STATE.aborted:
            raise _Aborted("another partition failed")


def _barrier(bar: SharedTile, op: str) -> _Barrier:
    state = _STATE.barriers.get(bar.data.data_ptr())
    if state is None or not state.valid:
        why = "not initialized" if state is None else "invalidated"
        raise RuntimeError(f"mbarrier.{op} on a barrier that is {why}")
    return state


def _mbarrier_init(bar: SharedTile, count) -> None:
    with _STATE.cond:
        _STATE.barriers[bar.data.data_ptr()] = _Barrier(int(count))


def _mbarrier_invalidate(bar: SharedTile) -> None:
    """Invalidate a barrier; one left in the middle of a phase (arrivals or TMA bytes still due, or
    bytes announced and never paid) means the arrivals and bytes did not balance, and raises."""
    with _STATE.cond:
        state = _barrier(bar, "invalidate")
        if state.pending != state.count or state.tx != 0:
            raise RuntimeError(f"mbarrier invalidated mid-phase: {state.count - state.pending} of {state.count} "
                               f"arrivals, {state.tx} TMA bytes due")
        state.valid = False


def _arrive(state: _Barrier, count: int) -> None:
    state.pending -= count
    if state.pending < 0:
        raise RuntimeError("mbarrier: more arrivals than its count in one phase")
    state.settle()


def _mbarrier_arrive(bar: SharedTile, *, count=1, pred=True) -> None:
    if bool(pred):
        with _STATE.cond:
            state = _barrier(bar, "arrive")
            phases = state.completed
            _arrive(state, int(count))
            turns = _STATE.turns
            if turns is not None and state.completed != phases:
                woken = [t for t, (s, _) in turns.waiting.items() if s is state]
                if woken:
                    turns.hand_on(first=woken)
                    turns.await_turn()


def _mbarrier_expect(bar: SharedTile, bytes, pred=True) -> None:
    """``mbarrier.arrive.expect_tx``: announce ``bytes`` of TMA traffic and arrive once."""
    if bool(pred):
        with _STATE.cond:
            state = _barrier(bar, "expect")
            state.tx += int(bytes)
            _arrive(state, 1)


def _mbarrier_wait(bar: SharedTile, phase, pred=True, deps=()) -> None:
    """Wait for the phase of parity ``phase`` to complete (at once for parity 1 of a new barrier)."""
    if not bool(pred):
        return
    with _STATE.cond:
        state = _barrier(bar, "wait")
        turns = _STATE.turns
        if turns is not None and not state.done(phase):
            me = threading.get_ident()
            turns.waiting[me] = (state, int(phase))
            try:
                turns.hand_on(keep=False)
                turns.await_turn()
            finally:
                turns.waiting.pop(me, None)
        done = _STATE.cond.wait_for(lambda: _STATE.aborted or state.done(phase), WAIT_TIMEOUT_S)
        if _STATE.aborted:
            raise _Aborted("another partition failed")
        if not done:
            raise RuntimeError(f"mbarrier.wait(phase={int(phase)}) deadlocked: {state.completed} phases completed, "
                               f"{state.pending} arrivals and {state.tx} bytes due")


def _tma_bytes(bar: SharedTile, nbytes: int) -> None:
    with _STATE.cond:
        state = _barrier(bar, "TMA copy")
        state.tx -= nbytes
        if state.tx < 0:
            raise RuntimeError(f"TMA copy of {nbytes} bytes beyond the {nbytes + state.tx} its barrier expects")
        state.settle()


# ----------------------------------------------------------------------------- TMA
class _TensorDescriptor:
    """A tensor map: base pointer, global shape and strides (elements), box shape."""

    def __init__(self, base: Pointer, shape, strides, block_shape):
        self.base = base
        self.shape = [int(s) for s in shape]
        self.strides = [int(s) for s in strides]
        self.block_shape = [int(s) for s in block_shape]

    def box(self, coord) -> Tuple[Pointer, torch.Tensor]:
        """Pointers of the box at ``coord`` and the mask of its elements inside the shape."""
        rank = len(self.block_shape)
        offsets = torch.zeros(self.block_shape, dtype=torch.int64)
        inside = torch.ones(self.block_shape, dtype=torch.bool)
        for d, (start, size, extent, stride) in enumerate(zip(coord, self.block_shape, self.shape, self.strides)):
            index = torch.arange(int(start), int(start) + size, dtype=torch.int64)
            index = index.view([size if e == d else 1 for e in range(rank)])
            offsets = offsets + index * stride
            inside = inside & (index >= 0) & (index < extent)
        return self.base + offsets, inside


def _make_tensor_descriptor(base, shape, strides, block_shape, layout=None, padding_option="zero"):
    if not 2 <= len(block_shape) <= 5 or len(shape) != len(block_shape) or len(strides) != len(block_shape):
        raise NotImplementedError("gluon_shim: tensor maps of rank 2 to 5 only, shape, strides and box alike")
    return _TensorDescriptor(base, shape, strides, block_shape)


def _tma_load(tensor_desc: _TensorDescriptor, coord, barrier: SharedTile, result: SharedTile, pred=True) -> None:
    if not bool(pred):
        return
    ptrs, inside = tensor_desc.box(coord)
    result.store(_load(ptrs, inside, other=0).as_subclass(torch.Tensor))
    _tma_bytes(barrier, result.data.numel() * result.data.element_size())


# TMA stores of this thread (a program, or a partition of one) not yet retired, oldest first: each reads its
# shared tile only when a ``store_wait`` retires it (or its partition or program ends), the latest a GPU may read
# it, so a tile written again before that wait stores what was written last.
_STORES = threading.local()


def _stores() -> list:
    if not hasattr(_STORES, "pending"):
        _STORES.pending = []
    return _STORES.pending


def _tma_store(tensor_desc: _TensorDescriptor, coord, src: SharedTile) -> None:
    ptrs, inside = tensor_desc.box(coord)
    _stores().append((ptrs, inside, src))


def _store_wait(pendings=0) -> None:
    """Retire this thread's TMA stores but the ``pendings`` newest: each stores its tile as it is now."""
    pending = _stores()
    keep = int(pendings)
    while len(pending) > keep:
        ptrs, inside, src = pending.pop(0)
        _store(ptrs, src.data, inside)


def _tma_add(tensor_desc: _TensorDescriptor, coord, src: SharedTile) -> None:
    ptrs, inside = tensor_desc.box(coord)
    _atomic_add(ptrs, tensor(src.data), mask=inside)


# ----------------------------------------------------------------------------- Blackwell: tensor memory, tcgen05
class TensorMemory:
    """A tensor-memory descriptor: a float32 torch tensor (``slice`` along the last dimension, as
    Gluon's), NaN when allocated, so an accumulation onto what no product wrote shows."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    @property
    def dtype(self) -> DType:
        return DType(self.data.dtype)

    @property
    def shape(self) -> list:
        return list(self.data.shape)

    def load(self, layout=None) -> GTensor:
        return self.data.clone().as_subclass(GTensor)

    def store(self, value, pred=True) -> None:
        value = torch.as_tensor(value)
        if list(value.shape) != self.shape or value.dtype != self.data.dtype:
            raise TypeError(f"tensor-memory store of {value.dtype}{list(value.shape)} to {self.data.dtype}{self.shape}")
        if bool(pred):
            self.data.copy_(value)

    def index(self, i) -> "TensorMemory":
        return TensorMemory(self.data[int(i)])

    def slice(self, start, length) -> "TensorMemory":
        return TensorMemory(self.data.narrow(self.data.dim() - 1, int(start), int(length)))


def _allocate_tensor_memory(element_ty, shape, layout=None, value=None) -> TensorMemory:
    memory = TensorMemory(_undefined(tuple(shape), _torch_dtype(element_ty)).as_subclass(torch.Tensor))
    if value is not None:
        memory.store(value)
    return memory


def _tcgen05_mma(a, b, acc, *, use_acc=True, pred=True, mbarriers=None, mbarrier_preds=None) -> None:
    """``acc = a @ b (+ acc)``: operands in shared memory of one dtype, the accumulator in tensor
    memory (shapes checked); done at once, then each of ``mbarriers`` arrived on."""
    if not isinstance(a, SharedTile) or not isinstance(b, (SharedTile, TensorMemory)):
        raise TypeError("tcgen05_mma: operand a in shared memory, b in shared or tensor memory")
    if not isinstance(acc, TensorMemory):
        raise TypeError("tcgen05_mma: the accumulator must be tensor memory")
    if a.data.dtype != b.data.dtype:
        raise TypeError(f"tcgen05_mma of {a.data.dtype} and {b.data.dtype} operands")
    (m, k), (k2, n) = a.data.shape, b.data.shape
    if k != k2 or list(acc.data.shape) != [m, n]:
        raise TypeError(f"tcgen05_mma of [{m}, {k}] x [{k2}, {n}] into {list(acc.data.shape)}")
    if bool(pred):
        product = torch.matmul(a.data.float(), b.data.float())
        acc.data.copy_(product + acc.data if bool(use_acc) else product)
    for i, bar in enumerate(mbarriers or ()):
        if mbarrier_preds is None or bool(mbarrier_preds[i]):
            _mbarrier_arrive(bar)


def _tcgen05_commit(barrier) -> None:
    """Arrive once on ``barrier`` when the products issued before are done (at once here)."""
    _mbarrier_arrive(barrier)


# ----------------------------------------------------------------------------- warp specialization
def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs) -> None:
    """The first partition here, the workers in threads, all of one program."""
    (default_fn, default_args), *workers = functions_and_args
    errors: List[BaseException] = []
    turns = _Turns(len(functions_and_args))

    def run(index, fn, args):
        if index:
            _THREADS.count = int(worker_num_warps[index - 1]) * WARP_THREADS
        try:
            with _STATE.cond:
                turns.order[index] = threading.get_ident()
                _STATE.cond.notify_all()
                turns.await_turn()
            fn(*args)
            _store_wait(0)  # a partition's stores land by its end
        except _Aborted:
            pass
        except BaseException as error:  # handed to the default partition's thread
            errors.append(error)
            with _STATE.cond:
                _STATE.aborted = True
                _STATE.cond.notify_all()
        finally:
            with _STATE.cond:
                turns.finished.add(threading.get_ident())
                if turns.holder == threading.get_ident() and not _STATE.aborted:
                    try:
                        turns.hand_on(keep=False)
                    except RuntimeError as error:
                        errors.append(error)

    threads = [threading.Thread(target=run, args=(i + 1, fn, args), daemon=True) for i, (fn, args) in enumerate(workers)]
    with _STATE.cond:
        _STATE.turns = turns
        turns.order[0] = threading.get_ident()
        turns.holder = turns.order[0]
    try:
        for t in threads:
            t.start()
        with _STATE.cond:
            _STATE.cond.wait_for(lambda: None not in turns.order, WAIT_TIMEOUT_S)
        run(0, default_fn, default_args)
        for t in threads:
            t.join(WAIT_TIMEOUT_S * 2)
    finally:
        _STATE.turns = None
    if errors:
        raise errors[0]


# ----------------------------------------------------------------------------- the namespaces
def _namespace(name: str, **members) -> types.SimpleNamespace:
    return types.SimpleNamespace(__name__=name, **members)


_DTYPES = dict(
    int1=torch.bool, int8=torch.int8, int16=torch.int16, int32=torch.int32, int64=torch.int64, uint8=torch.uint8,
    float16=torch.float16, bfloat16=torch.bfloat16, float32=torch.float32, float64=torch.float64,
)

language = _namespace(
    "gluon_shim.language",
    constexpr=lambda value: value, static_range=range,
    program_id=_program_id, num_programs=_num_programs, thread_barrier=_nothing, static_assert=_static_assert,
    arange=_arange, full=_full, zeros=_zeros, load=_load, store=_store,
    pointer_type=lambda dtype: PointerType(DType(_torch_dtype(dtype))),
    expand_dims=lambda x, axis: tensor(x).unsqueeze(int(axis)), where=_where, minimum=_minimum, maximum=_maximum,
    exp2=lambda x: tensor(torch.exp2(x)), exp=lambda x: tensor(torch.exp(x)), log2=lambda x: tensor(torch.log2(x)),
    floor=lambda x: tensor(torch.floor(x)), sqrt=lambda x: tensor(torch.sqrt(x)), abs=lambda x: tensor(torch.abs(x)),
    sum=_sum, max=_max, associative_scan=_associative_scan, inline_asm_elementwise=_inline_asm_elementwise,
    atomic_add=_atomic_add, convert_layout=lambda x, layout, assert_trivial=False: x,
    reshape=lambda x, shape, can_reorder=False: tensor(tensor(x).reshape([int(n) for n in shape])),
    split=lambda x: tuple(tensor(t) for t in tensor(x).unbind(-1)),
    permute=lambda x, *dims: tensor(tensor(x).permute([int(d) for d in (dims[0] if len(dims) == 1 else dims)])),
    join=lambda a, b: tensor(torch.stack(_as_tensors(a, b), -1)),
    allocate_shared_memory=_allocate_shared_memory, warp_specialize=_warp_specialize,
    BlockedLayout=_layout("BlockedLayout"), SliceLayout=_layout("SliceLayout"),
    DotOperandLayout=_layout("DotOperandLayout"), NVMMASharedLayout=_layout("NVMMASharedLayout"),
    NVMMADistributedLayout=_layout("NVMMADistributedLayout"), SwizzledSharedLayout=_layout("SwizzledSharedLayout"),
    **{name: DType(dtype) for name, dtype in _DTYPES.items()},
)
async_copy = _namespace(
    "gluon_shim.async_copy", async_copy_global_to_shared=_async_copy_global_to_shared,
    commit_group=_commit_group, wait_group=_wait_group, mbarrier_arrive=_copies_mbarrier_arrive,
)
mbarrier = _namespace(
    "gluon_shim.mbarrier", MBarrierLayout=_layout("MBarrierLayout"), init=_mbarrier_init,
    invalidate=_mbarrier_invalidate, expect=_mbarrier_expect, arrive=_mbarrier_arrive, wait=_mbarrier_wait,
)
tma = _namespace(
    "gluon_shim.tma", make_tensor_descriptor=_make_tensor_descriptor, async_copy_global_to_shared=_tma_load,
    async_copy_shared_to_global=_tma_store, store_wait=_store_wait,
)

blackwell = _namespace(
    "gluon_shim.blackwell", TensorMemoryLayout=_layout("TensorMemoryLayout"),
    allocate_tensor_memory=_allocate_tensor_memory, get_tmem_reg_layout=_layout("TmemRegLayout"),
    tcgen05_mma=_tcgen05_mma, tcgen05_commit=_tcgen05_commit, mbarrier=mbarrier, tma=tma, fence_async_shared=_nothing,
)

_REPLACEMENTS = {
    id(_real_gl): language, id(_real_blackwell.tma): tma, id(_real_blackwell.TensorMemoryLayout): blackwell.TensorMemoryLayout,
    id(_real_blackwell.allocate_tensor_memory): _allocate_tensor_memory,
    id(_real_blackwell.get_tmem_reg_layout): blackwell.get_tmem_reg_layout,
    id(_real_blackwell.tcgen05_mma): _tcgen05_mma, id(_real_blackwell.tcgen05_commit): _tcgen05_commit, id(_real_async_copy): async_copy, id(_real_mbarrier): mbarrier,
    id(_real_ampere_mbarrier): mbarrier, id(_real_tma): tma,
    id(_real_fence): _nothing, id(_real_tma_add): _tma_add, id(_real_wgmma): _warpgroup_mma,
    id(_real_wgmma_wait): _warpgroup_mma_wait,
}


# ----------------------------------------------------------------------------- rebinding
_GLOBALS: Dict[int, dict] = {}
_REBOUND: Dict[int, types.FunctionType] = {}


def _is_gluon_object(value) -> bool:
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return isinstance(name, str) and name.startswith("triton.experimental.gluon")


def _translate(value):
    if id(value) in _REPLACEMENTS:
        return _REPLACEMENTS[id(value)]
    if isinstance(value, JITFunction):
        return _rebind(value.fn) if value.is_gluon() else _Unsupported(f"Triton JIT function {value.fn.__name__}")
    if isinstance(value, ConstexprFunction):
        return _rebind(value.fn)
    if isinstance(value, tl.constexpr):
        return value.value
    if _is_gluon_object(value):
        return _Unsupported(getattr(value, "__name__", repr(value)))
    return value


def _globals_of(module_globals: dict) -> dict:
    """The shim's copy of a module's globals (one per module, filled on first use)."""
    key = id(module_globals)
    if key not in _GLOBALS:
        copy = _GLOBALS[key] = {}
        copy.update({name: _translate(value) for name, value in module_globals.items()})
    return _GLOBALS[key]


def _rebind(fn: types.FunctionType) -> types.FunctionType:
    rebound = _REBOUND.get(id(fn))
    if rebound is None:
        module_globals = _globals_of(fn.__globals__)
        rebound = _REBOUND.get(id(fn))  # (filling the module's globals may have rebound fn)
        if rebound is None:
            rebound = types.FunctionType(fn.__code__, module_globals, fn.__name__, fn.__defaults__, fn.__closure__)
            rebound.__kwdefaults__, rebound.__doc__ = fn.__kwdefaults__, fn.__doc__
            _REBOUND[id(fn)] = rebound
    return rebound


def _argument(value, name: str):
    """A call's argument as Gluon sees it: tensors as they are, numbers as 0-d tensors."""
    if isinstance(value, (Pointer, SharedTile, TensorMemory, Layout, DType)):
        return value
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, (bool, int, float)):
        return scalar(value)
    raise TypeError(f"argument {name}: {type(value).__name__}")


class _Function:
    """A ``@gluon.jit`` function callable on CPU values: non-constexpr numbers become 0-d tensors."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.fn = _rebind(jit_fn.fn)
        self._params = list(jit_fn.params)

    def __call__(self, *args):
        if len(args) != len(self._params):
            raise TypeError(f"{self.fn.__name__} takes {len(self._params)} arguments, got {len(args)}")
        return self.fn(*[a if p.is_constexpr else _argument(a, p.name) for p, a in zip(self._params, args)])


def function(jit_fn) -> Callable:
    """The CPU version of a ``@gluon.jit`` function (``@gluon.constexpr_function``: its plain
    rebound function). Call it with positional arguments: constexprs as Python values, pointers
    (:func:`pointer`), shared tiles (:func:`shared`), tensors and numbers."""
    if isinstance(jit_fn, ConstexprFunction):
        return _rebind(jit_fn.fn)
    if not (isinstance(jit_fn, JITFunction) and jit_fn.is_gluon()):
        raise TypeError(f"not a gluon.jit function: {jit_fn!r}")
    return _Function(jit_fn)


class Launch:
    """What :func:`launch` ran: the pointer of each tensor argument, for its write counts."""

    def __init__(self, memories: Dict[str, Memory]):
        self.memories = memories

    def writes(self, name: str) -> torch.Tensor:
        """How many times each element of argument ``name`` was stored to, shaped like it."""
        return self.memories[name].writes_as_tensor()


def launch(kernel, grid: Sequence[int], **values) -> Launch:
    """Run ``kernel`` (a ``@gluon.jit`` kernel) for every program of ``grid``, in order.

    ``values`` are its arguments by name: tensors become pointers (tensors given twice share
    one), numbers 0-d tensors, constexprs stay Python values. Names the kernel does not take are
    ignored (launch options, or the arguments of a kernel of another variant), missing ones
    raise; ``num_warps`` (4 if not given) sets the threads of the program's default partition.
    Each program must invalidate every mbarrier it initializes.
    """
    fn = _rebind(kernel.fn)
    _SPINS.clear()
    missing = [p.name for p in kernel.params if p.name not in values]
    if missing:
        raise TypeError(f"{kernel.fn.__name__}: arguments {missing} not given")
    memories: Dict[str, Memory] = {}
    call = []
    for p in kernel.params:
        value = values[p.name]
        if p.is_constexpr:
            call.append(value)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            same = next((m for m in memories.values() if m.tensor is value), None)
            memories[p.name] = same or Memory(value, p.name)
            call.append(Pointer(memories[p.name]))
        else:
            call.append(_argument(value, p.name))
    _THREADS.count = int(values.get("num_warps", 4)) * WARP_THREADS
    for pid in itertools.product(*[range(int(g)) for g in grid]):
        with program(pid, grid):
            fn(*call)
            _store_wait(0)  # and a program's by its end
            live = [key for key, state in _STATE.barriers.items() if state.valid]
            if live:
                raise RuntimeError(f"program {pid} left {len(live)} mbarriers initialized (not invalidated)")
    return Launch(memories)
