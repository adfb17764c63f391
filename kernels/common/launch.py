"""Kernel launches with little host time.

``kernel[grid](...)`` binds and specializes every argument through Triton's generic path
before it finds the compiled kernel: about 15 us of host time per launch on the H200's host,
more than the GPU time of a small batch, and for a millisecond-long call a gap that the GPU
waits through whenever the host has nothing queued ahead (the flash paths launch 3 to 7
kernels per call). :class:`Launcher` keys its own cache by what Triton
specializes on, or finer: each tensor's dtype and 16-byte alignment, the value of each int
that Triton specializes (strides: a handful of values per layout, whatever T and B are), the
constexprs and launch options; it launches the compiled kernel directly on a hit (its entries
are a ``runtime.caches.HostCache``; the Triton internals it calls are listed in
``runtime.private_api``). A miss goes
through ``kernel[grid]``, which compiles or finds the kernel and returns it. As the key is at
least as fine as Triton's, a hit always runs the kernel Triton itself would have chosen.
Arguments Triton does not specialize (``do_not_specialize`` ints, floats) stay out of the key;
each launcher passes the same kinds of arguments at the same positions on every call.
On a hit, tensors are passed to the compiled kernel as their addresses (ints): for a tensor
Triton's C launcher otherwise calls ``data_ptr()`` and asks the driver whether the address is
a device pointer, a few microseconds per launch; these tensors are on the call's device. Where
the kernel needs no scratch memory, a hit calls the C launch function under Triton's launcher
object directly (its Python ``__call__`` only adds scratch allocations). Callers that build their
launch options once per signature (``block.plan.block_plan``) pass that signature as ``meta_key``,
so the key need not hash every option on each call.

Launch hooks (profilers) force the ordinary path. Triton launches on the current device; a call
whose tensors are on another GPU switches to theirs for the launch.

Kernels that need global scratch memory (``scratch=True``: the tensor maps the experimental
hopper_ws kernels make) get it from Triton's allocator; where the caller has set none, their launches set one over
PyTorch's caching allocator for the duration of the launch (CUDA-graph capture included).
"""
from __future__ import annotations

import contextlib
import inspect
from operator import itemgetter
from typing import Dict, Hashable, Optional, Sequence, Tuple

import torch
from triton import knobs
from triton.runtime import _allocation, driver

from blockattn_layers.runtime.caches import HostCache

# False sends every launch through ``kernel[grid]`` (the tests run both paths).
DIRECT = True


def _picker(indices: Sequence[int]):
    """``args -> tuple(args[i] for i in indices)`` (an ``itemgetter`` where it returns a tuple)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    return lambda args: tuple([args[i] for i in indices])


def _hooked(hook) -> bool:
    """Whether a launch hook is set (a ``HookChain`` with calls in Triton 3.6, else a callable)."""
    return bool(getattr(hook, "calls", hook))


def _hooks_set() -> bool:
    """Whether a launch enter or exit hook is set (profilers): launches then take ``kernel[grid]``."""
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton allocator over PyTorch's caching allocator (its blocks are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


@contextlib.contextmanager
def scratch_allocator():
    """Triton's allocator for a launch: the caller's, or ``_torch_scratch`` where none is set."""
    if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
        yield
        return
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _cache_key(device: int, meta_key: Hashable, tensors: Sequence[torch.Tensor], aligned: Sequence[bool],
               ints: tuple) -> tuple:
    """The launcher's cache key: at least as fine as what Triton specializes on (module docstring)."""
    return device, meta_key, tuple([t.dtype for t in tensors]), tuple(aligned), ints


class Launcher:
    """Launch ``kernel`` by its positional (non-constexpr) arguments and keyword meta."""

    def __init__(self, kernel, scratch: bool = False):
        self.kernel = kernel
        self.scratch = scratch
        self._const_names = None
        self._tensors = self._ints = None
        self._tensor_positions: Tuple[int, ...] = ()
        self._compiled: Dict[Tuple, Tuple[object, tuple, tuple]] = HostCache(
            f"launcher:{getattr(kernel, '__name__', kernel)}")
        self._device = self._stream = None

    def constexpr_names(self) -> list:
        """Names of the kernel's constexpr parameters, in order."""
        if self._const_names is None:
            params = getattr(self.kernel, "params", None)
            if params is not None:
                self._const_names = [p.name for p in params if p.is_constexpr]
            else:  # the interpreter's function: read the annotations
                annotations = inspect.signature(self.kernel.fn).parameters
                self._const_names = [n for n in self.kernel.arg_names if "constexpr" in str(annotations[n].annotation)]
        return self._const_names

    def _key_getters(self, args: Sequence[object]):
        """Getters of the tensor arguments and of the ints Triton specializes (from the first call)."""
        if self._tensors is None:
            params = [p for p in self.kernel.params if not p.is_constexpr]
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            ints = [i for i, (p, a) in enumerate(zip(params, args))
                    if isinstance(a, int) and not p.do_not_specialize]
            self._tensors, self._ints = _picker(tensors), _picker(ints)
            self._tensor_positions = tuple(tensors)
        return self._tensors, self._ints

    def __call__(self, grid: Sequence[int], args: Sequence[object], meta: dict, q: torch.Tensor,
                 meta_key: Hashable = None) -> Optional[tuple]:
        """Launch on ``q``'s device: Triton launches on the current device, so a call whose tensors
        live on another GPU switches to theirs for the launch.

        ``meta_key``, when given, stands for ``meta`` in the cache key: the caller promises that
        equal keys come with equal ``meta`` (``block.plan.block_plan`` builds both), which spares
        hashing every item of ``meta`` on each call.

        Returns the cache key of a direct launch on the current device (equal keys: the same
        compiled kernel, tensor dtypes and alignments, and specialized ints), else None.
        """
        if self.scratch:
            with scratch_allocator():
                return self._call(grid, args, meta, q, meta_key)
        return self._call(grid, args, meta, q, meta_key)

    def _call(self, grid, args, meta, q, meta_key) -> Optional[tuple]:
        if not q.is_cuda:
            self.kernel[grid](*args, **meta)
            return None
        if self._device is None:
            self._device, self._stream = driver.active.get_current_device, driver.active.get_current_stream
        device = q.get_device()
        if device != self._device():
            with torch.cuda.device(device):
                self._launch(grid, args, meta, device, meta_key)
            return None
        return self._launch(grid, args, meta, device, meta_key)

    def entry_for(self, args: Sequence[object], q: torch.Tensor, meta_key: Hashable, aligned: Sequence[bool]):
        """The compiled kernel that a direct launch of ``args`` on ``q``'s device would run if its
        tensor arguments had the 16-byte alignments ``aligned``: ``(launch, head, consts)`` as
        :func:`_entry` builds it (``launch(gx, gy, 1, stream, *head, *args, *consts)`` runs it), or
        None where such a launch would not go direct (not on the current device, launch hooks set,
        64-bit addressing) or nothing is cached for it yet.

        Lets a caller prepare a later launch whose tensors do not exist yet (the backward's
        gradient buffers): it passes stand-ins of the same dtypes and strides in ``args``.
        """
        if not DIRECT or not q.is_cuda or self._tensors is None or self._device is None:
            return None
        device = q.get_device()
        if device != self._device() or _hooks_set():
            return None
        tensors, ints = self._key_getters(args)
        return self._compiled.get(_cache_key(device, meta_key, tensors(args), aligned, ints(args)))

    def compiled(self, key: tuple) -> tuple:
        """The ``(launch, head, consts)`` of the direct launch that returned ``key`` (see
        ``entry_for``)."""
        return self._compiled[key]

    def goes_direct(self, device: int) -> bool:
        """Whether a launch on ``device`` now would go direct (after a first launch): it is the
        current device, and no launch hook is set."""
        return DIRECT and self._device() == device and not _hooks_set()

    def stream(self, device: int) -> int:
        """The current stream of ``device`` (after a first launch: the driver's own getter)."""
        return self._stream(device)

    def _launch(self, grid: Sequence[int], args: Sequence[object], meta: dict, device: int,
                meta_key: Hashable) -> Optional[tuple]:
        """On the current device ``device``: calls with 32-bit addressing go direct (see ``__call__``)."""
        fast = DIRECT and not meta.get("INT64", False)
        if not fast or _hooks_set():
            self.kernel[grid](*args, **meta)
            return None
        tensors, ints = self._key_getters(args)
        tensors = tensors(args)
        addresses = [t.data_ptr() for t in tensors]
        key = _cache_key(device, meta_key if meta_key is not None else tuple(meta.items()), tensors,
                         [a % 16 == 0 for a in addresses], ints(args))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **meta)
            self._compiled.put(key, _entry(compiled, tuple(meta[n] for n in self.constexpr_names())))
            return key
        launch, head, consts = entry
        args = list(args)
        for i, address in zip(self._tensor_positions, addresses):
            args[i] = address
        grid_y = grid[1] if len(grid) > 1 else 1
        launch(grid[0], grid_y, 1, self._stream(device), *head, *args, *consts)
        return key


def _entry(compiled, consts: tuple) -> tuple:
    """``(launch, head, consts)`` of a compiled kernel: ``launch(gx, gy, gz, stream, *head, *args,
    *consts)`` runs it. Where the kernel needs no scratch memory, ``launch`` is the C launch
    function under Triton's launcher object (whose Python ``__call__`` only adds the scratch
    allocations: a few microseconds per launch); otherwise the launcher itself."""
    run = compiled.run
    hooks = (compiled.packed_metadata, None, None, None)
    launch = getattr(run, "launch", None)
    if (launch is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        return launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *hooks), consts
    return run, (compiled.function, *hooks), consts
